"""The gateway's OpenAI side (P/D-Serve §3.5: the gateway is the clients' entry): the engines'
streams rendered as ``/v1/completions`` and ``/v1/chat/completions`` answers — SSE chunks and the
plain response, one choice per prompt and ``n``, ``usage`` (in streams only with
``stream_options.include_usage``, as OpenAI: a last chunk with ``choices: []``), the
``matrixserve`` timings — models, and OpenAI-style errors. The requests are validated in
:func:`matrixserve.domain.gateway.completions.parse_completion` (pure).

A stream's token chunks are serialised once per choice (:class:`TokenFrame`): only each token's
text is encoded, to the same bytes the whole chunk would make (the relay's hot path).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from matrixserve.api.engine_protocol import Event
from matrixserve.domain.gateway.completions import BadRequest, Completion

PIECE = "\x00piece\x00"  # stands in for a token's text in a serialised chunk
OWNER = "matrixserve"


def chunk(
    ident: str, created: int, c: Completion, piece: Any, finish: str | None, index: int = 0
) -> dict[str, Any]:
    if c.chat:
        delta = piece if isinstance(piece, dict) else {"content": piece}
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": piece, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    body = {"id": ident, "object": kind, "created": created, "model": c.model, "choices": [choice]}
    if c.include_usage:  # OpenAI: every chunk but the last has "usage": null
        body["usage"] = None
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def served(done: Event | None, prefill: str, reoffers: int = 0) -> dict[str, Any]:
    """The engines' own account of a choice: emulated timings and the instances that served it
    (from their ``done``; a choice the gateway cut at a stop string has only its prefill), and
    how many times it moved (to another decode, its last entrance says; to another entrance,
    ``reoffers``)."""
    if done is None:
        return {
            "timings": None,
            "instances": {"prefill": prefill, "decode": None},
            "migrations": reoffers,
        }
    moved = done.get("migrations")
    engines = moved if isinstance(moved, int) and not isinstance(moved, bool) else 0
    return {
        "timings": done.get("timings"),
        "instances": done.get("instances"),
        "migrations": max(engines, 0) + reoffers,
    }


def final_chunk(
    ident: str, created: int, c: Completion, index: int, finish: str, account: dict[str, Any]
) -> dict[str, Any]:
    """A choice's last chunk: its finish reason and the engines' account of it."""
    final = chunk(ident, created, c, "" if not c.chat else {}, finish, index)
    final["matrixserve"] = account
    return final


def usage_chunk(ident: str, created: int, c: Completion, totals: dict[str, int]) -> dict[str, Any]:
    """``stream_options.include_usage``: the stream's last chunk, with no choice."""
    kind = "chat.completion.chunk" if c.chat else "text_completion"
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": c.model,
        "choices": [],
        "usage": totals,
    }


@dataclass(frozen=True)
class Answer:
    """One choice of a plain (not streamed) answer."""

    index: int
    text: str
    finish: str
    account: dict[str, Any]  # the ``matrixserve`` object: see :func:`served`


def completion(c: Completion, answers: Sequence[Answer], totals: dict[str, int]) -> dict[str, Any]:
    """The whole answer of a request that did not ask for a stream."""
    choices = [
        {
            "index": a.index,
            "message": {"role": "assistant", "content": a.text},
            "logprobs": None,
            "finish_reason": a.finish,
            "matrixserve": a.account,
        }
        if c.chat
        else {
            "index": a.index,
            "text": a.text,
            "logprobs": None,
            "finish_reason": a.finish,
            "matrixserve": a.account,
        }
        for a in answers
    ]
    return {
        "id": completion_id(c),
        "object": "chat.completion" if c.chat else "text_completion",
        "created": int(time.time()),
        "model": c.model,
        "choices": choices,
        "usage": totals,
    }


def completion_id(c: Completion) -> str:
    """An answer's id, prefixed as OpenAI's: ``chatcmpl-`` for a chat, ``cmpl-`` otherwise."""
    return f"{'chatcmpl' if c.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def model(name: str) -> dict[str, Any]:
    """A scenario as an OpenAI model (``created`` is not known here: 0)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNER}


class TokenFrame:
    """A stream's token events as SSE frames: the chunk around the text is serialised once per
    choice, and each token only has its text encoded (the same bytes ``frame`` would make)."""

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


def failed_on(error: Event, prefill: str) -> dict[str, Any]:
    """Where a choice that failed was served (so a client tells a failure on a faulty instance
    from one elsewhere): its prefill, and the decode the engines name in their error
    (one had taken the request; a name only, nothing else of an engine's is passed on)."""
    said = error.get("instances")
    decode = said.get("decode") if isinstance(said, dict) else None
    named = decode if isinstance(decode, str) else None
    return {"instances": {"prefill": prefill, "decode": named}}


def error_chunk(
    message: str, code: str | None, account: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The last SSE chunk of a stream that failed after it started; with ``account``
    (:func:`failed_on`), the instances it was on, as a choice's last chunk names them."""
    chunk: dict[str, Any] = {
        "error": {"message": message, "type": "server_error", "param": None, "code": code}
    }
    if account is not None:
        chunk[OWNER] = account
    return chunk
