"""The gateway's per-stream token frames are byte-for-byte the chunks it would serialise whole."""

from __future__ import annotations

import json

import pytest

from matrixserve.domain.gateway.completions import Completion, Prompt
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
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_token_frame_equals_the_whole_chunk_serialised(
    chat: bool, model: str, index: int, include_usage: bool
) -> None:
    c = Completion(
        model=model,
        prompts=(Prompt.of_text("hi"),),
        max_tokens=4,
        stream=True,
        chat=chat,
        include_usage=include_usage,
    )
    frame = _TokenFrame(_chunk("cmpl-1", 1700000000, c, _PIECE, None, index))
    for text in ["tok", "", 'a "quoted"\nline', "\x00piece\x00", "ünï", _PIECE, "\ud800"]:
        expected = _frame(_chunk("cmpl-1", 1700000000, c, text, None, index))
        assert frame(text) == expected
        payload = json.loads(frame(text)[len(b"data: ") : -2])
        piece = payload["choices"][0]["delta"]["content"] if chat else payload["choices"][0]["text"]
        assert piece == text
        assert payload["model"] == model
        assert payload["choices"][0]["index"] == index
        assert ("usage" in payload) == include_usage  # OpenAI: null in every chunk but the last
