"""The gateway's OpenAI side (P/D-Serve §3.5: the gateway is the clients' entry): the engine's
stream rendered as ``/v1/completions`` and ``/v1/chat/completions`` answers — SSE chunks and the
plain response, ``usage``, the ``matrixserve`` timings — and OpenAI-style errors. The requests
are validated in :func:`matrixserve.domain.forwarding.parse_completion` (pure).

A stream's token chunks are serialised once per stream (:class:`TokenFrame`): only each token's
text is encoded, to the same bytes the whole chunk would make (the relay's hot path).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from matrixserve.api.engine_protocol import Event
from matrixserve.domain.forwarding import BadRequest, Completion

PIECE = "\x00piece\x00"  # stands in for a token's text in a serialised chunk


def chunk(
    ident: str, created: int, c: Completion, piece: Any, finish: str | None
) -> dict[str, Any]:
    if c.chat:
        delta = piece if isinstance(piece, dict) else {"content": piece}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": ident, "object": kind, "created": created, "model": c.model, "choices": [choice]}


def usage(done: Event) -> dict[str, int]:
    prompt, completion = done["usage"]["promptTokens"], done["usage"]["completionTokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _served(done: Event) -> dict[str, Any]:
    """The engines' own account of the request: emulated timings, the instances that served it."""
    return {"timings": done["timings"], "instances": done["instances"]}


def final_chunk(ident: str, created: int, c: Completion, done: Event) -> dict[str, Any]:
    """A stream's last chunk, from the engine's ``done``."""
    final = chunk(ident, created, c, "" if not c.chat else {}, "length")
    final["usage"] = usage(done)
    final["matrixserve"] = _served(done)
    return final


def completion(c: Completion, text: str, done: Event) -> dict[str, Any]:
    """The whole answer of a request that did not ask for a stream."""
    choice: dict[str, Any] = (
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        if c.chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    )
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion" if c.chat else "text_completion",
        "created": int(time.time()),
        "model": c.model,
        "choices": [choice],
        "usage": usage(done),
        "matrixserve": _served(done),
    }


class TokenFrame:
    """A stream's token events as SSE frames: the chunk around the text is serialised once per
    stream, and each token only has its text encoded (the same bytes ``frame`` would make)."""

    def __init__(self, template: dict[str, Any]) -> None:
        # the text is the chunk's last string: whatever the client named its model, the last
        # occurrence of the stand-in is the text's place
        self.head, _, self.tail = frame(template).rpartition(json.dumps(PIECE).encode())

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text).encode() + self.tail


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def error_response(exc: BadRequest) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def failure(
    status: int, message: str, kind: str, code: str | None, retry_after: str | None = None
) -> web.Response:
    """An OpenAI-style error response."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)


def error_chunk(message: str, code: str | None) -> dict[str, Any]:
    """The last SSE chunk of a stream that failed after it started."""
    return {"error": {"message": message, "type": "server_error", "code": code}}
