"""The gateway's per-stream token frames are byte-for-byte the chunks it would serialise whole."""

from __future__ import annotations

import json

import pytest

from matrixserve.domain.forwarding import Completion
from matrixserve.gateway.openai import PIECE as _PIECE
from matrixserve.gateway.openai import TokenFrame as _TokenFrame
from matrixserve.gateway.openai import chunk as _chunk
from matrixserve.gateway.openai import frame as _frame


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
