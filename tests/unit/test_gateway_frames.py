"""The gateway's per-stream token frames are byte-for-byte the chunks it would serialise whole."""

from __future__ import annotations

import json
from typing import Any

import pytest

from matrixserve.domain.forwarding import Completion
from matrixserve.gateway.app import _PIECE, Gateway, _chunk, _frame, _TokenFrame


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "model",
    ["general", 'we"ird\\model', _PIECE, "模型"],
    ids=["plain", "escapes", "stand-in", "cjk"],
)
def test_a_token_frame_equals_the_whole_chunk_serialised(chat: bool, model: str) -> None:
    c = Completion(model=model, prompt="hi", max_tokens=4, stream=True, chat=chat)
    frame = _TokenFrame(_chunk("cmpl-1", 1700000000, c, _PIECE, None))
    for text in ["tok", "", 'a "quoted"\nline', "\x00piece\x00", "ünï", _PIECE]:
        expected = _frame(_chunk("cmpl-1", 1700000000, c, text, None))
        assert frame(text) == expected
        payload = json.loads(frame(text)[len(b"data: ") : -2])
        piece = payload["choices"][0]["delta"]["content"] if chat else payload["choices"][0]["text"]
        assert piece == text
        assert payload["model"] == model


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class _Upstream:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)


async def test_upstream_events_come_in_batches_across_split_lines_and_bad_json_ends_them() -> None:
    chunks = [
        b'data: {"type": "token", "text": "a"}\n\ndata: {"type": "tok',
        b'en", "text": "b"}\n\ndata: {"type": "token", "text": "c"}\n\n',
        b"data: {not json\n\n",
        b'data: {"type": "token", "text": "never"}\n\n',
    ]
    batches = [b async for b in Gateway._events(Any, _Upstream(chunks))]  # type: ignore[arg-type]
    assert [[e.get("text") for e in b] for b in batches[:2]] == [["a"], ["b", "c"]]
    assert batches[2][0]["type"] == "error"
    assert batches[2][0]["code"] == "upstream_failed"
    assert len(batches) == 3
