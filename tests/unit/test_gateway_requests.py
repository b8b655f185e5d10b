"""The gateway's request semantics (issue 16, findings 2, 3, 5, 6, and its review), served as
``__main__`` serves it (``Gateway.runner()`` through ``httpserving.start``: the guarded
protocol) on 127.0.0.1, in front of a scripted engine on 127.0.0.1: hostile names and engine
codes never reach ``/metrics``; malformed bodies get OpenAI-shaped 4xx; a client that leaves, or
stops reading, closes its engine streams; a prefill's refusal of the request itself is the
client's 400 at once; stop strings (across tokens too), ``n``, lists of prompts, token-id
prompts, ``include_usage`` and ``GET /v1/models/{id}`` as OpenAI. Issue 31: the process stopped
by SIGTERM drains (readiness down, still serving), then lets what is in flight end, and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from matrixserve import httpserving
from matrixserve.api.engine_protocol import (
    Timings,
    done_event,
    error_event,
    sse_data,
    token_event,
)
from matrixserve.api.kinds import API_VERSION, PDGROUP
from matrixserve.coordination import Session
from matrixserve.devcluster.cluster import free_ports
from matrixserve.gateway import __main__ as gateway_main
from matrixserve.gateway.app import Gateway
from matrixserve.gateway.config import GatewayConfig
from matrixserve.gateway.discovery import Discovery
from matrixserve.httpserving import ConnectionLimits
from unit.test_adapters import local_kubeconfig


class _Zk:
    connected = False

    def add_listener(self, listener: Callable[[str], None]) -> None:
        pass


# the engine stub's refusals of a request itself (api.engine_protocol.GenerateRequest.parse)
REFUSALS = {
    413: ("prompt_too_long", "prompt has 9000 tokens; this engine takes at most 8192"),
    400: ("invalid_request", "maxTokens must be an integer in 1..4096"),
}


@dataclass
class FakeEngine:
    """A prefill entrance as the gateway sees one: ``/v1/generate`` answers a stream of
    ``maxTokens`` tokens (``word(i)`` each, ``delay`` s apart), or what ``answer(n)`` says for
    its n-th request (a status to refuse with, or an error event's code to fail the stream)."""

    delay: float = 0.0
    word: Callable[[int], str] = lambda i: f"t{i} "
    answer: Callable[[int], int | str | None] = lambda n: None
    refusal_delay: float = 0.0  # s between a refusal's head and its body
    stall: float = 0.0  # s before it answers at all (a hung serving loop)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    open: int = 0  # streams under way
    cut: int = 0  # streams the gateway closed before their end
    finished: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a stream was cut

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.stall:
            await asyncio.sleep(self.stall)
        answer = self.answer(len(self.bodies))
        if isinstance(answer, int):
            code, message = REFUSALS.get(answer, ("x", "no"))
            error = {"code": code, "message": message, "type": "x", "param": None}
            if not self.refusal_delay:
                return web.json_response({"error": error}, status=answer)
            late = web.StreamResponse(status=answer, headers={"Content-Type": "application/json"})
            await late.prepare(request)  # the head now, the body later
            await asyncio.sleep(self.refusal_delay)
            await late.write(json.dumps({"error": error}).encode())
            await late.write_eof()
            return late
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.open += 1
        self.started.set()
        try:
            if isinstance(answer, str):
                await response.write(sse_data(error_event(answer, "failed")))
            else:
                for i in range(body["maxTokens"]):
                    await asyncio.sleep(self.delay)
                    await response.write(sse_data(token_event(i, self.word(i), 0.0)))
                timings = Timings(0.1, 0.1, 0.0, 0.01, 0.2)
                done = done_event(1, body["maxTokens"], timings, "g-p-0", "g-d-0")
                await response.write(sse_data(done))
            await response.write_eof()
            self.finished += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.cut += 1
            self.closed.set()
            raise
        finally:
            self.open -= 1
        return response


@dataclass
class Served:
    url: str
    gateway: Gateway
    engine: FakeEngine
    http: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
        async with self.http.post(self.url + path, json=body, **kwargs) as r:
            return r.status, await r.json()

    async def stream(self, path: str, body: Any) -> list[Any]:
        async with self.http.post(self.url + path, json=body) as r:
            assert r.status == 200, await r.text()
            lines = [line.decode().strip() async for line in r.content]
        return [
            "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
            for line in lines
            if line.startswith("data: ")
        ]

    def counters(self) -> tuple[int, int, int]:
        f = self.gateway.forwarder
        return sum(f.open.values()), sum(f.prefilling.values()), sum(f.holding.values())

    async def scrape(self) -> str:
        async with self.http.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()

    async def released(self, outcome: str) -> str:
        """After the one request of a test whose engine stream the gateway cut: the stream cut,
        not finished; every count back to 0; the request counted with ``outcome``. The scrape."""
        assert (self.engine.cut, self.engine.finished) == (1, 0)
        await asyncio.sleep(0.05)
        assert self.counters() == (0, 0, 0)
        text = await self.scrape()
        assert series(text, "matrixserve_gateway_requests") == [
            {"scenario": "general", "outcome": outcome}
        ]
        return text


async def _site(runner: web.AppRunner) -> str:
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = cast(Any, site._server).sockets[0].getsockname()[:2]
    return f"{host}:{port}"


def group_object(addresses: Sequence[str]) -> dict[str, Any]:
    """PDGroup ``ns/g`` (scenario ``general``) as the API server shows it, its entrances
    ``g-p-0``... serving at ``addresses`` (the gateway routes by status without ZooKeeper)."""
    names = [f"g-p-{i}" for i in range(len(addresses))]
    return {
        "apiVersion": API_VERSION,
        "kind": PDGROUP.kind,
        "metadata": {"namespace": "ns", "name": "g", "generation": 1},
        "spec": {
            "service": "chat",
            "scenario": "general",
            "model": {"name": "llama3-8b"},
            "prefill": {"replicas": 1, "batchSize": 64},
            "decode": {"replicas": 1},
        },
        "status": {
            "entrances": names,
            "instances": [
                {"name": n, "state": "Serving", "endpoint": a}
                for n, a in zip(names, addresses, strict=True)
            ],
        },
    }


@asynccontextmanager
async def served(
    engine: FakeEngine,
    limits: ConnectionLimits | None = None,
    others: Sequence[FakeEngine] = (),
    **config: Any,
) -> AsyncIterator[Served]:
    """The gateway in front of ``engine`` (entrance ``g-p-0``) and ``others`` (``g-p-1``...)."""
    runners, addresses = [], []
    for each in (engine, *others):
        app = web.Application()
        app.router.add_post("/v1/generate", each.generate)
        runners.append(web.AppRunner(app, handler_cancellation=True))
        addresses.append(await _site(runners[-1]))  # a scripted engine: aiohttp's plain serving
    discovery = Discovery(client.ApiClient(), cast(Session, _Zk()), "ns")
    discovery._upsert(group_object(addresses))
    discovery.synced.set()
    gateway = Gateway(discovery, GatewayConfig(**config))
    await gateway.start()
    runner = gateway.runner()  # as __main__ serves it: guarded, its metrics on the gateway's
    limits = limits or ConnectionLimits()
    await httpserving.start(runner, "127.0.0.1", 0, limits, gateway.metrics.registry)
    url = "http://{}:{}".format(*runner.addresses[0][:2])
    try:
        async with aiohttp.ClientSession() as http:
            yield Served(url, gateway, engine, http)
    finally:
        await runner.cleanup()
        await gateway.close()
        for engine_runner in runners:
            await engine_runner.cleanup()


def assert_openai_error(status: int, body: Any, expected_status: int, param: str | None) -> None:
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str), body
    assert body["error"]["code"], body
    assert body["error"]["param"] == param, body


async def raw_request(url: str, data: bytes) -> tuple[int, bytes, bytes]:
    """One request written as given; the status, the head and the body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, body


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Length: {len(body)}"]
    lines += [*headers, "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# --------------------------------------------------------------------------- finding 2
def series(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of a metric's samples in a scrape (parsed as Prometheus parses it)."""
    return [
        s.labels
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name == name + "_total"
    ]


async def test_no_client_name_or_engine_code_becomes_a_label_and_the_scrape_stays_whole() -> None:
    hostile = iter(["\ud800", "\udcff", "x" * 5000, "\x00", *(f"m{i}" for i in range(300))])
    engine = FakeEngine(answer=lambda n: next(hostile) if n <= 304 else None)
    async with served(engine) as s:
        bodies = [{"model": f"made-up-{i}", "prompt": "x"} for i in range(300)]
        bodies += [{"model": "\ud800", "prompt": "x"}, {"model": "general\udcff", "prompt": "x"}]
        statuses = await asyncio.gather(*(s.post("/v1/completions", b) for b in bodies))
        assert {status for status, _ in statuses} == {404}
        # a scenario header of raw bytes that are not UTF-8
        raw = post(
            "/v1/completions",
            b'{"model": "general", "prompt": "x"}',
            "X-MatrixServe-Scenario: \xff\xfe\udcff".encode("utf-8", "surrogateescape").decode(
                "latin-1"
            ),
        )
        assert (await raw_request(s.url, raw))[0] == 404
        # the engine's error codes: hostile strings (a stream's and a plain answer's)
        for i in range(304):
            body = {"model": "general", "prompt": "x", "stream": i % 2 == 0, "max_tokens": 1}
            async with s.http.post(s.url + "/v1/completions", json=body) as r:
                await r.read()
        async with s.http.get(s.url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    labels = series(text, "matrixserve_gateway_requests")
    assert {lab["scenario"] for lab in labels} == {"_unknown", "general"}
    assert {lab["outcome"] for lab in labels} == {"unknown_scenario", "engine_error"}
    assert len(labels) == 2


# --------------------------------------------------------------------------- finding 3
@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        (b"[" * 200_000, (), None),
        (
            b'{"model": "general", "prompt": "x"}',
            ("Content-Type: application/json; charset=nope",),
            None,
        ),
        (b'{"model": "general", "prompt": "x"}', ("Content-Encoding: gzip",), None),
        (gzip.compress(b"{" * 100_000), ("Content-Encoding: gzip",), None),
        (b'{"model": "general", "prompt": "\xff"}', (), None),
        (b'["model", "general"]', (), None),
        (b"null", (), None),
        (b'{"model": "general", "prompt": {"a": 1}}', (), "prompt"),
        (b'{"model": 5, "prompt": "x"}', (), "model"),
        (b'{"model": "general", "prompt": "x", "max_tokens": "9"}', (), "max_tokens"),
        (b'{"model": "general", "prompt": "x", "temperature": NaN}', (), "temperature"),
        (b'{"model": "general", "prompt": "x", "n": 1e400}', (), "n"),
        (b'{"model": "general", "prompt": "x", "tools": []}', (), "tools"),
    ],
    ids=[
        "deep-nesting",
        "unknown-charset",
        "gzip-header-plain-body",
        "gzip-of-deep-nesting",
        "bad-utf8",
        "array",
        "null",
        "prompt-object",
        "model-number",
        "max-tokens-string",
        "temperature-nan",
        "n-infinite",
        "unknown-for-completions",
    ],
)
async def test_a_malformed_request_gets_an_openai_shaped_4xx(
    body: bytes, headers: tuple[str, ...], param: str | None
) -> None:
    async with served(FakeEngine()) as s:
        status, head, answer = await raw_request(s.url, post("/v1/completions", body, *headers))
        assert b"application/json" in head
        assert_openai_error(status, json.loads(answer), 400, param)
        assert s.engine.bodies == []
        async with s.http.get(s.url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        assert series(text, "matrixserve_gateway_requests") == [
            {"scenario": "_unknown", "outcome": "bad_request"}
        ]


# --------------------------------------------------------------------------- finding 5
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_closes_its_engine_stream(stream: bool) -> None:
    engine = FakeEngine(delay=0.01)  # 1,000 tokens: 10 s
    async with served(engine) as s:
        body = {"model": "general", "prompt": "x", "max_tokens": 1000, "stream": stream}
        host, port = s.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post("/v1/completions", json.dumps(body).encode()))
        await asyncio.wait_for(engine.started.wait(), 5)
        await asyncio.sleep(0.05)  # a few tokens relayed (or collected)
        writer.close()
        await asyncio.wait_for(engine.closed.wait(), 2)  # not the stream's 10 s
        text = await s.released("client_gone")
        assert "matrixserve_gateway_open_streams 0.0" in text
        assert "matrixserve_gateway_prefill_slots_held 0.0" in text
        del reader


# --------------------------------------------------------------------------- finding 6
@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_cuts_the_text_and_ends_the_engine_stream(stream: bool) -> None:
    engine = FakeEngine(delay=0.005)
    async with served(engine) as s:
        body = {"model": "general", "prompt": "x", "max_tokens": 1000, "stop": ["t3", "zz"]}
        if stream:
            chunks = await s.stream("/v1/completions", {**body, "stream": True})
            text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
            final = chunks[-2]["choices"][0]
            assert chunks[-1] == "[DONE]"
            assert all("usage" not in c for c in chunks[:-1])  # no include_usage: no usage
        else:
            status, answer = await s.post("/v1/completions", body)
            assert status == 200
            final = answer["choices"][0]
            text = final["text"]
            assert answer["usage"] == {
                "prompt_tokens": 1,
                "completion_tokens": 4,
                "total_tokens": 5,
            }
        assert text == "t0 t1 t2 "
        assert final["finish_reason"] == "stop"
        await asyncio.wait_for(engine.closed.wait(), 2)
        assert (engine.cut, engine.finished) == (1, 0)
        status, answer = await s.post("/v1/completions", {**body, "max_tokens": 3})
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["text"] == "t0 t1 t2 "
        assert s.counters() == (0, 0, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_spanning_two_tokens_is_cut_where_it_begins(stream: bool) -> None:
    """Through the relay's legs and reader, not only the scanner: "1 t2" begins in token 1
    ("t1 ") and ends in token 2 ("t2 "); the text before it is held until token 2 tells."""
    engine = FakeEngine(delay=0.005)
    async with served(engine) as s:
        body = {"model": "general", "prompt": "x", "max_tokens": 1000, "stop": "1 t2"}
        if stream:
            chunks = await s.stream("/v1/completions", {**body, "stream": True})
            text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
            finish = chunks[-2]["choices"][0]["finish_reason"]
        else:
            status, answer = await s.post("/v1/completions", body)
            assert status == 200, answer
            text, finish = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
        assert (text, finish) == ("t0 t", "stop")
        await asyncio.wait_for(engine.closed.wait(), 2)  # the engine stream ended there
        assert (engine.cut, engine.finished) == (1, 0)
        assert s.counters() == (0, 0, 0)


async def test_n_and_a_list_of_prompts_give_one_choice_each_in_openai_order() -> None:
    engine = FakeEngine(word=lambda i: "w ")
    async with served(engine) as s:
        body = {"model": "general", "prompt": ["aaaa", "bbbbbbbb"], "n": 2, "max_tokens": 3}
        status, answer = await s.post("/v1/completions", body)
        assert status == 200, answer
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in answer["choices"]] == ["w w w "] * 4
        assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
        assert sorted(b["prompt"] for b in engine.bodies) == ["aaaa"] * 2 + ["bbbbbbbb"] * 2

        engine.bodies.clear()
        body = {"model": "general", "prompt": [[1, 2, 3], [4]], "max_tokens": 2, "stream": True}
        chunks = await s.stream(
            "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        assert sorted(b["promptTokens"] for b in engine.bodies) == [1, 3]
        assert all("prompt" not in b for b in engine.bodies)
        assert chunks[-1] == "[DONE]"
        assert chunks[-2]["choices"] == []
        assert chunks[-2]["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 4,
            "total_tokens": 8,
        }
        assert all(c["usage"] is None for c in chunks[:-2])
        by_index: dict[int, list[Any]] = {0: [], 1: []}
        for c in chunks[:-2]:
            by_index[c["choices"][0]["index"]].append(c["choices"][0])
        for choices in by_index.values():
            assert "".join(c["text"] for c in choices) == "w w "
            assert [c["finish_reason"] for c in choices] == [None, None, "length"]

        chat = {"model": "general", "messages": [{"role": "user", "content": "hi"}], "n": 3}
        chunks = await s.stream("/v1/chat/completions", {**chat, "max_tokens": 1, "stream": True})
        roles = [c["choices"][0] for c in chunks[:3]]
        assert [(r["index"], r["delta"]) for r in roles] == [
            (i, {"role": "assistant"}) for i in range(3)
        ]
        # ids as OpenAI's: chatcmpl- for a chat, cmpl- for a completion
        assert all(c["id"].startswith("chatcmpl-") for c in chunks[:-1])
        status, answer = await s.post("/v1/chat/completions", chat)
        assert (status, answer["id"][:9]) == (200, "chatcmpl-")
        status, answer = await s.post("/v1/completions", {"model": "general", "prompt": "x"})
        assert (status, answer["id"][:5]) == (200, "cmpl-")
        assert s.counters() == (0, 0, 0)


async def test_a_request_goes_ahead_only_when_every_choice_is_accepted() -> None:
    engine = FakeEngine(delay=0.01, answer=lambda n: None if n == 1 else 429)
    async with served(engine, default_ttft_ms=300) as s:
        body = {"model": "general", "prompt": "x", "n": 2, "max_tokens": 1000}
        async with s.http.post(s.url + "/v1/completions", json=body) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "no_capacity"
        await asyncio.wait_for(engine.closed.wait(), 2)  # the accepted choice was dropped
        assert (engine.cut, engine.finished) == (1, 0)
        assert s.counters() == (0, 0, 0)


async def test_an_engine_error_in_one_choice_fails_the_request_and_drops_the_others() -> None:
    engine = FakeEngine(delay=0.01, answer=lambda n: "\ud800bad" if n == 2 else None)
    async with served(engine) as s:
        body = {"model": "general", "prompt": "x", "n": 2, "max_tokens": 1000}
        status, answer = await s.post("/v1/completions", body)
        assert status == 502
        assert answer["error"]["code"] == "engine_error"
        await asyncio.wait_for(engine.closed.wait(), 2)
        assert s.counters() == (0, 0, 0)


@pytest.mark.parametrize(
    ("status", "path", "param", "code"),
    [
        (413, "/v1/chat/completions", "messages", "context_length_exceeded"),
        (413, "/v1/completions", "prompt", "context_length_exceeded"),
        (400, "/v1/completions", "max_tokens", "invalid_request"),
    ],
)
async def test_a_prefill_refusing_the_request_itself_is_the_clients_400_at_once(
    status: int, path: str, param: str, code: str
) -> None:
    """Review of issue 16, finding 2: an engine's 413 (a prompt over its limit or its HBM) or 400
    (max_tokens over its output limit) is final: one try, a 400 in OpenAI's words at once, not
    tries until the TTFT budget is spent and a 503 the client would retry."""
    engine = FakeEngine(answer=lambda n: status)
    async with served(engine, default_ttft_ms=5000) as s:
        chat = path.endswith("chat/completions")
        body: dict[str, Any] = {"model": "general", "max_tokens": 5000, "n": 2}
        body |= {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
        started = asyncio.get_running_loop().time()
        got, answer = await s.post(path, body)
        took = asyncio.get_running_loop().time() - started
        assert_openai_error(got, answer, 400, param)
        assert answer["error"]["code"] == code
        assert answer["error"]["type"] == "invalid_request_error"
        assert REFUSALS[status][1] in answer["error"]["message"]  # what the engine said
        assert took < 1, f"answered after {took:.2f} s"
        assert len(engine.bodies) <= 2  # one try per choice, none again
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)
        async with s.http.get(s.url + "/metrics") as r:
            text = await r.text()
        assert series(text, "matrixserve_gateway_requests") == [
            {"scenario": "general", "outcome": "bad_request"}
        ]


async def test_a_refusals_late_body_is_waited_for_within_the_requests_budget_only() -> None:
    """Second review of issue 16: the wait for a refusal's body (up to 1 s) was not bounded by
    the request's TTFT budget: a prefill sending its 400's head at once and its body late made
    the client wait past the budget."""
    engine = FakeEngine(answer=lambda n: 400, refusal_delay=3.0)
    async with served(engine, default_ttft_ms=300) as s:
        started = asyncio.get_running_loop().time()
        got, answer = await s.post("/v1/completions", {"model": "general", "prompt": "x"})
        took = asyncio.get_running_loop().time() - started
        assert got == 400, answer  # final, with what had arrived of the body (nothing)
        assert took < 0.3 + 0.5, f"answered after {took:.2f} s, past the 0.3 s budget"


async def test_a_client_that_reads_nothing_is_cut_and_its_engine_stream_closed() -> None:
    """Review of issue 16, finding 6: a client that stops reading a stream is cut after the
    send timeout, and the engine stream behind it closed (the engine frees its work)."""
    engine = FakeEngine(word=lambda i: "w" * 2000)  # 16 MB over 8,000 tokens: buffers fill
    async with served(engine, ConnectionLimits(send_timeout=0.5)) as s:
        host, port = s.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        _, writer = await asyncio.open_connection(sock=sock)
        try:
            body = {"model": "general", "prompt": "x", "max_tokens": 8000, "stream": True}
            writer.write(post("/v1/completions", json.dumps(body).encode()))
            await asyncio.wait_for(engine.started.wait(), 5)
            await asyncio.wait_for(engine.closed.wait(), 10)  # not never
        finally:
            writer.transport.abort()
        text = await s.released("client_gone")
        assert 'matrixserve_http_connections_timed_out_total{phase="send"} 1.0' in text


async def test_an_unexpected_failure_is_a_500_counted_as_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with served(FakeEngine()) as s:

        async def broken(*_: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(s.gateway.forwarder, "forward_all", broken)
        status, answer = await s.post("/v1/completions", {"model": "general", "prompt": "x"})
        assert_openai_error(status, answer, 500, None)
        async with s.http.get(s.url + "/metrics") as r:
            text = await r.text()
        assert series(text, "matrixserve_gateway_requests") == [
            {"scenario": "general", "outcome": "internal_error"}
        ]


async def test_models_are_listed_and_retrieved_and_an_unknown_one_is_not_found() -> None:
    async with served(FakeEngine()) as s:
        async with s.http.get(s.url + "/v1/models") as r:
            listed = await r.json()
        assert listed["data"] == [
            {"id": "general", "object": "model", "created": 0, "owned_by": "matrixserve"}
        ]
        async with s.http.get(s.url + "/v1/models/general") as r:
            assert (r.status, await r.json()) == (200, listed["data"][0])
        async with s.http.get(s.url + "/v1/models/org/no-such-model") as r:
            error = await r.json()
            assert_openai_error(r.status, error, 404, "model")
            assert error["error"]["code"] == "model_not_found"


async def test_a_prefill_that_does_not_answer_is_passed_over_after_the_answer_deadline() -> None:
    """Issue 17: a hung prefill neither accepts nor rejects; the gateway waits for its answer at
    most ``answer_timeout`` (not the whole TTFT budget), then tries the next entrance and passes
    the silent one over for a while, so a hang does not stall every request sent its way."""
    hung, healthy = FakeEngine(stall=30.0), FakeEngine()
    async with served(hung, others=[healthy], default_ttft_ms=60000, answer_timeout=0.3) as s:
        began = time.monotonic()
        firsts = []
        for _ in range(4):
            body = {"model": "general", "prompt": "x", "max_tokens": 4, "stream": True}
            events = await s.stream("/v1/completions", body)
            assert events[-1] == "[DONE]"
            firsts.append(time.monotonic() - began)
        assert healthy.finished == 4
        assert len(hung.bodies) <= 1, "tried again while passed over"
        assert firsts[-1] < 2.0, firsts  # one deadline at most, not the 60 s budget


# --------------------------------------------------------------------------- issue 31: stopping
async def _fake_api(groups: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """An API server that lists ``groups`` and holds every watch open, sending nothing."""

    async def answer(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") not in (None, "false", "0"):
            held = web.StreamResponse(headers={"Content-Type": "application/json"})
            await held.prepare(request)
            await asyncio.sleep(3600)
            return held
        return web.json_response({"items": groups, "metadata": {"resourceVersion": "1"}})

    app = web.Application()
    app.router.add_get("/{path:.*}", answer)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    return runner, await _site(runner)


async def test_on_sigterm_the_gateway_drains_then_lets_the_stream_in_flight_end_and_exits_0(
    tmp_path: Path,
) -> None:
    """Issue 31: ``python -m matrixserve.gateway`` signalled to stop answers ``/healthz`` 503
    ``draining`` for ``--drain-seconds`` while a new request is still served (with
    ``Connection: close``), then refuses connections, lets the stream in flight end whole, and
    exits 0."""
    engine = FakeEngine(delay=0.1)
    engine_app = web.Application()
    engine_app.router.add_post("/v1/generate", engine.generate)
    engine_runner = web.AppRunner(engine_app, handler_cancellation=True)
    engine_address = await _site(engine_runner)
    api_runner, api_address = await _fake_api([group_object([engine_address])])
    kubeconfig = local_kubeconfig(tmp_path / "kubeconfig", api_address)
    port, nobody = free_ports(2)  # the gateway's; a ZooKeeper port nothing listens on
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "gateway.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "matrixserve.gateway", "--kubeconfig", str(kubeconfig)),
        *("--zookeeper", f"127.0.0.1:{nobody}", "--namespace", "ns"),
        *("--port", str(port), "--drain-seconds", "2", "--finish-seconds", "20"),
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    log.close()

    def told() -> str:
        return (tmp_path / "gateway.log").read_text()[-3000:]

    async def health(http: aiohttp.ClientSession) -> tuple[int, str] | None:
        try:
            async with http.get(f"{url}/healthz") as r:
                return r.status, await r.text()
        except aiohttp.ClientConnectionError:
            return None

    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 30
            while await health(http) != (200, "ok"):
                assert proc.returncode is None, told()
                assert time.monotonic() < deadline, told()
                await asyncio.sleep(0.1)

            async def long_stream() -> list[Any]:
                body = {"model": "general", "prompt": "x", "max_tokens": 40, "stream": True}
                async with http.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    lines = [line.decode().strip() async for line in r.content]
                return [line for line in lines if line.startswith("data: ")]

            in_flight = asyncio.create_task(long_stream())  # 40 tokens 0.1 s apart: 4 s
            await asyncio.wait_for(engine.started.wait(), 10)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while (answer := await health(http)) != (503, "draining"):
                assert answer == (200, "ok"), answer
                assert time.monotonic() - signalled < 1.5, "not draining 1.5 s after SIGTERM"
                await asyncio.sleep(0.05)
            # still serving while the readiness probe fails: on a new connection, which the
            # answer says to close
            async with aiohttp.ClientSession() as fresh:
                body = {"model": "general", "prompt": "x", "max_tokens": 2}
                async with fresh.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers.get("Connection") == "close"
                    assert (await r.json())["usage"]["completion_tokens"] == 2
            # then the listener closes: new connections are refused
            while (answer := await health(http)) is not None:
                assert answer == (503, "draining"), answer
                assert time.monotonic() - signalled < 5, "still listening 5 s after SIGTERM"
                await asyncio.sleep(0.05)
            refused_after = time.monotonic() - signalled
            assert refused_after >= 1.8, f"the drain ended after {refused_after:.2f} s, not 2"
            assert not in_flight.done(), "the stream should outlast the drain (the test's premise)"
            events = await asyncio.wait_for(in_flight, 20)
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert text == "".join(f"t{i} " for i in range(40)), "the stream in flight ended whole"
        assert await asyncio.wait_for(proc.wait(), 15) == 0, told()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await api_runner.cleanup()
        await engine_runner.cleanup()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--drain-seconds", "301"), "--drain-seconds must be between 0 and 300, not 301"),
        (("--drain-seconds", "-1"), "--drain-seconds must be between 0 and 300, not -1"),
        (("--drain-seconds", "nan"), "--drain-seconds must be between 0 and 300, not nan"),
        (("--finish-seconds", "0"), "--finish-seconds must be above 0 and at most 3600, not 0"),
    ],
)
def test_drain_and_finish_seconds_out_of_range_are_flag_errors(
    flags: tuple[str, ...], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--zookeeper", "127.0.0.1:2181"]
    args = gateway_main.parse(base)
    assert (args.drain_seconds, args.finish_seconds) == (8.0, 30.0)
    assert gateway_main.parse([*base, "--drain-seconds", "0"]).drain_seconds == 0
    with pytest.raises(SystemExit) as exit_:
        gateway_main.parse([*base, *flags])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


async def test_the_key_loader_survives_an_api_server_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The Secret's reader fails closed while the API server refuses connections, and keeps
    reading (it used to die at the first error that was not an API answer, leaving the keys
    of the last read valid for ever)."""
    from matrixserve.gateway import auth
    from matrixserve.gateway.config import GatewayMetrics

    monkeypatch.setattr(auth, "KEYS_RELOAD_SECONDS", 0.05)
    from matrixserve.adapters.kube import api_client

    (port,) = free_ports(1)  # nothing listens there: every connection refused
    api = api_client(
        local_kubeconfig(tmp_path / "kubeconfig", f"127.0.0.1:{port}")
    )  # the gateway's own
    keys = auth.ApiKeys(GatewayConfig(), GatewayMetrics())
    keys.names = {"a-key-read-before-0123": "old"}
    loader = asyncio.create_task(auth.keep_keys(keys, api, "ns", "keys"))
    try:
        # a read's connection is tried 4 times (about 1 s here), then the keys go
        await asyncio.sleep(3.0)
        assert not loader.done(), loader.exception() if loader.done() else None
        assert keys.names == {}
    finally:
        loader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loader
