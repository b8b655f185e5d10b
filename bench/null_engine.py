"""A null engine for the gateway-overhead benchmark: the engine's wire protocol at almost no cost.

It speaks what the gateway uses of an engine stub's ``POST /v1/generate`` (SSE ``data:`` events
of type ``token`` then ``done``, chunked HTTP/1.1, keep-alive), nothing else (404). The body and
the events are the engine's (``matrixserve.api.engine_protocol``): the gateway parses and relays
the same bytes. The first token is written as soon as the request is read (prefill
costs nothing here); the rest come from a decode loop as in the engine stub (continuous
batching: each step, ``gap`` wall seconds apart, emits one token for every running stream), each
token its own write on its stream's connection, so the gateway reads every token separately as
it does in production, where tokens are a TPOT (tens of ms) apart; nothing is coalesced for it.

Why not the engine stub: this 2-core VM gives the gateway one core and everything else the other.
The engine stub (aiohttp, continuous batching, timing model) spends more of that core per stream
than the gateway spends of its own, so upstream queueing, not the gateway, made the tails of a
TTFT comparison, and the gateway could not be driven to its own limit. Here the first token is
written as soon as the request is read: the direct TTFT is the network path alone, and the
gateway's is that plus the gateway.

Run: ``python bench/null_engine.py HOST[,HOST...] PORT [GAP_MS]`` (prints ``ready`` when
listening).
"""

from __future__ import annotations

import asyncio
import json
import sys

from matrixserve.api.engine_protocol import (
    EngineError,
    Event,
    GenerateRequest,
    Timings,
    done_event,
    sse_data,
    synthetic_token,
    token_event,
)

_NO_LIMIT = 1 << 62  # prompt and output tokens: the null engine takes any request
_TIMINGS = Timings(ttft=0.0, prefill=0.0, kv_transfer=0.0, tpot_mean=0.03, e2e=0.5)
_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _chunk(event: Event) -> bytes:
    data = sse_data(event)
    return b"%x\r\n%s\r\n" % (len(data), data)


def _plain(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)


class _Stream:
    __slots__ = ("index", "prompt_tokens", "protocol", "seed", "tokens")

    def __init__(self, protocol: NullEngine, request: GenerateRequest) -> None:
        self.protocol, self.seed, self.index = protocol, request.seed, 0
        self.tokens, self.prompt_tokens = request.max_tokens, request.prompt_tokens


class Decode:
    """The decode loop: every ``gap`` s, the next token of every running stream."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.running: list[_Stream] = []  # while any, a step is scheduled

    def join(self, stream: _Stream) -> None:
        if not stream.protocol.token(stream):  # the first token: the prefill's
            return
        self.running.append(stream)
        if len(self.running) == 1:
            asyncio.get_running_loop().call_later(self.gap, self.step)

    def step(self) -> None:
        self.running = [s for s in self.running if s.protocol.token(s)]
        if self.running:
            asyncio.get_running_loop().call_later(self.gap, self.step)


class NullEngine(asyncio.Protocol):
    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.answer(head.split(" ", 2)[:2], body)

    def answer(self, method_path: list[str], body: bytes) -> None:
        assert self.transport is not None
        if method_path != ["POST", "/v1/generate"]:
            self.transport.write(_plain(b"404 Not Found", b'{"error": {"code": "not_found"}}'))
            return
        try:
            request = GenerateRequest.parse(json.loads(body), _NO_LIMIT, _NO_LIMIT)
        except EngineError as exc:  # a body the gateway does not send
            self.transport.write(_plain(b"400 Bad Request", json.dumps(exc.body()).encode()))
            return
        self.transport.write(_HEAD)
        self.decode.join(_Stream(self, request))

    def token(self, s: _Stream) -> bool:
        """Write the stream's next token (and its end after the last): False once it ended."""
        if self.transport is None:  # the client went away
            return False
        index = s.index
        s.index += 1
        text = synthetic_token(s.seed, index)
        event = token_event(index, text, index * 0.03)
        if s.index < s.tokens:
            self.transport.write(_chunk(event))
            return True
        done = done_event(s.prompt_tokens, s.tokens, _TIMINGS, "null", "null")
        self.transport.write(_chunk(event))
        self.transport.write(_chunk(done) + b"0\r\n\r\n")
        return False


async def serve(hosts: list[str], port: int, gap: float) -> None:
    loop = asyncio.get_running_loop()
    decode = Decode(gap)  # one decode loop for the engine's hosts, as one engine's batch
    servers = [await loop.create_server(lambda: NullEngine(decode), h, port) for h in hosts]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    hosts, port = sys.argv[1].split(","), int(sys.argv[2])
    gap_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
    asyncio.run(serve(hosts, port, gap_ms / 1000))
