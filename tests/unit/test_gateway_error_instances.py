"""A stream that fails mid-way names the instances it was on (issue 17): its error chunk carries
``matrixserve.instances`` as a choice's last chunk does — the prefill the gateway forwarded it to,
and the decode the engines name in their error event (none named: ``null``) — so a client tells
a failure on a faulty instance from one elsewhere. Served as ``__main__`` serves the gateway, in
front of a scripted engine on 127.0.0.1 (``test_gateway_requests``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from test_gateway_requests import FakeEngine, served

from matrixserve.api.engine_protocol import error_event, sse_data, token_event
from matrixserve.gateway import openai

TOKENS = 4
BODY = {"model": "general", "prompt": "hi", "max_tokens": TOKENS, "stream": True}


@dataclass
class FailingEngine(FakeEngine):  # type: ignore[misc]  # a sibling module mypy does not resolve
    """Two tokens, then the error event ``ending`` (``None``: the connection closed early)."""

    ending: dict[str, Any] | None = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(2):
            await response.write(sse_data(token_event(i, f"t{i} ", 0.0)))
        if self.ending is None:
            assert request.transport is not None
            request.transport.close()  # cut mid-stream, as a killed prefill's stream ends
            return response
        await response.write(sse_data(self.ending))
        await response.write_eof()
        return response


def with_decode(decode: Any) -> dict[str, Any]:
    return error_event("decode_failed", "the decode died") | {"instances": {"decode": decode}}


@pytest.mark.parametrize(
    ("ending", "code", "decode"),
    [
        # a decode had taken it and failed: the engines name it
        (with_decode("g-d-0"), "decode_failed", "g-d-0"),
        # no decode named (none took it yet): the prefill alone
        (error_event("no_decode", "no decode is available"), "no_decode", None),
        # the prefill's stream cut short: the gateway knows its prefill only
        (None, "upstream_failed", None),
        # an engine's value that is not a name is not passed on
        (with_decode({"x": "y"}), "decode_failed", None),
    ],
)
async def test_a_streams_error_chunk_names_the_instances_it_was_on(
    ending: dict[str, Any] | None, code: str, decode: str | None
) -> None:
    async with served(FailingEngine(ending=ending)) as s:
        chunks = await s.stream("/v1/completions", BODY)
    # a stream cut short is an entrance lost: offered again (issue 31 item 2), but this engine
    # starts over whatever it is told: a refusal, none of its tokens twice
    assert [c["choices"][0]["text"] for c in chunks[:-2]] == ["t0 ", "t1 "]
    error, done = chunks[-2:]
    assert done == "[DONE]"
    assert error["error"]["code"] == code
    assert error["matrixserve"] == {"instances": {"prefill": "g-p-0", "decode": decode}}


def test_an_error_chunk_without_an_account_is_openais_alone() -> None:
    """Errors the gateway renders without a leg (none served) keep OpenAI's shape alone."""
    assert openai.error_chunk("no", "x") == {
        "error": {"message": "no", "type": "server_error", "param": None, "code": "x"}
    }
