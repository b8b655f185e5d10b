"""The HTTP serving the gateway and the engines share (``matrixserve.httpserving``, issue 16
findings 3 and 4), on real sockets on 127.0.0.x: slow heads, stalled bodies and idle keep-alive
connections are closed within their limits; connections over a cap are refused at once and the
capped ones keep working; a stream longer than every limit is not cut; aiohttp's own errors
(404, 405, 413, 417, a malformed head or body, an uncaught exception) are OpenAI-shaped JSON;
bad limit flags exit 2."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from enginestub.engine import config as engine_config
from enginestub.engine.config import parse as engine_parse
from matrixserve import httpserving
from matrixserve.gateway import __main__ as gateway_main
from matrixserve.gateway.__main__ import parse as gateway_parse
from matrixserve.gateway.upstream import EnginePool
from matrixserve.httpserving import ConnectionLimits

SLOW = 0.5  # s: the deadlines of the tests that check one deadline
LONG = 30.0  # s: the deadlines a test is not about
MARGIN = 1.5  # s: a loaded 2-core machine's lateness allowed past a deadline
STREAM_PAUSE = 1.0  # s: a stream's silence, longer than every deadline of its test


# --------------------------------------------------------------------------- the served app
class FLOOD:
    """The flood handler's last run: it started writing; it ended (its client gone)."""

    started: asyncio.Event
    ended: asyncio.Event


def make_app() -> web.Application:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await request.json())

    async def sink(request: web.Request) -> web.Response:
        """Reads the body as it streams in (no size limit): the body's bytes, counted."""
        size = 0
        while chunk := await request.content.read(1 << 16):
            size += len(chunk)
        return web.json_response({"bytes": size})

    async def boom(_: web.Request) -> web.Response:
        raise RuntimeError("secret detail")

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(b"data: %d\n\n" % i)
            await asyncio.sleep(STREAM_PAUSE)
        await response.write(b"data: done\n\n")
        await response.write_eof()
        return response

    async def generate(request: web.Request) -> web.StreamResponse:
        """An engine's answer as the gateway's pool reads it: chunked SSE events."""
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"type": "token", "index": 0, "text": "a"}\n\n')
        await response.write(b'data: {"type": "done"}\n\n')
        await response.write_eof()
        return response

    async def flood(request: web.Request) -> web.StreamResponse:
        """64 KiB writes, for ever or ``megabytes``, until the client is gone."""
        FLOOD.started.set()
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        try:
            for _ in range(int(request.query.get("megabytes", 1 << 20)) * 16):
                await response.write(b"x" * (1 << 16))
            await response.write_eof()
        finally:
            FLOOD.ended.set()
        return response

    async def broken_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 0\n\n")
        raise RuntimeError("failed mid-stream")

    app = httpserving.application(client_max_size=1024)
    FLOOD.started, FLOOD.ended = asyncio.Event(), asyncio.Event()
    gets = {"/ok": ok, "/boom": boom, "/broken-stream": broken_stream, "/flood": flood}
    for path, handler in gets.items():
        app.router.add_get(path, handler)
    for path, handler in {
        "/echo": echo,
        "/sink": sink,
        "/stream": stream,
        "/generate": generate,
    }.items():
        app.router.add_post(path, handler)
    return app


class Served:
    def __init__(self, runner: web.AppRunner, registry: CollectorRegistry) -> None:
        self.runner, self.registry = runner, registry
        self.port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def served(**limits: Any) -> AsyncIterator[Served]:
    registry = CollectorRegistry()
    runner = web.AppRunner(make_app(), access_log=None)
    await httpserving.start(runner, "127.0.0.1", 0, ConnectionLimits(**limits), registry)
    try:
        yield Served(runner, registry)
    finally:
        await runner.cleanup()


async def connect(
    server: Served, source: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port, local_addr=(source, 0))


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """A response with a Content-Length body: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 5)
    return int(lines[0].split()[1]), headers, body


async def get_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n")
    status, _, _ = await read_response(reader)
    return status


async def seconds_until_closed(reader: asyncio.StreamReader, limit: float) -> float:
    """Seconds until the server closes the connection (reading what it sends meanwhile)."""
    start = time.monotonic()
    with suppress(ConnectionError):
        while await asyncio.wait_for(reader.read(65536), limit):
            pass
    return time.monotonic() - start


async def trickle(writer: asyncio.StreamWriter, data: bytes, every: float = 0.1) -> None:
    """``data`` a byte at a time, until written or the connection is gone."""
    with suppress(ConnectionError):
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(every)


# --------------------------------------------------------------------------- finding 4
@pytest.mark.parametrize("case", ["silent", "slow head", "slow head after a request"])
async def test_a_head_that_does_not_arrive_in_time_is_closed_within_the_header_timeout(
    case: str,
) -> None:
    async with served(header_timeout=SLOW, body_timeout=LONG, idle_timeout=LONG) as server:
        reader, writer = await connect(server)
        if case == "slow head after a request":  # the deadline runs from the head's first byte
            assert await get_ok(reader, writer) == 200
        slow_head = b"GET /ok HTTP/1.1\r\nHost: t\r\n" + b"X-Slow: " + b"a" * 200
        started = time.monotonic()
        sender = asyncio.create_task(trickle(writer, b"" if case == "silent" else slow_head))
        took = await seconds_until_closed(reader, limit=SLOW + 10)
        sender.cancel()
        writer.close()
        assert took <= SLOW + MARGIN, f"a slow head kept its connection {took:.2f} s"
        assert time.monotonic() - started >= SLOW * 0.9
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="header") == 1


GET_OK = b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n"
POST_ECHO = b'POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 8\r\n\r\n{"a": 1}'
POST_CHUNKED = (
    b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'3\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
)
WHOLE_REQUESTS = {"get": GET_OK, "post": POST_ECHO, "chunked post": POST_CHUNKED}


async def test_a_head_begun_in_the_read_that_ended_a_request_is_held_to_the_header_timeout() -> (
    None
):
    """Beside "slow head after a request": the next head's first bytes come in the same read as
    the end of the body-less request before it (pipelined), and nothing more. (After a request
    with a body, such a head has the idle limit: docs/gateway.md, "Connection limits".)"""
    async with served(header_timeout=SLOW, body_timeout=LONG, idle_timeout=LONG) as server:
        reader, writer = await connect(server)
        writer.write(GET_OK + b"GET /ok HT")
        status, _, _ = await read_response(reader)
        assert status == 200
        took = await seconds_until_closed(reader, limit=SLOW + 10)
        writer.close()
        assert took <= SLOW + MARGIN, f"a head begun with a request's end held {took:.2f} s"
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="header") == 1


@pytest.mark.parametrize("first", WHOLE_REQUESTS)
async def test_a_connection_waiting_after_a_whole_request_is_held_to_the_idle_limit_only(
    first: str,
) -> None:
    """The other side: a request that ended its read leaves no head begun, whatever its body's
    framing, so the connection waits for its next request as long as the idle limit allows."""
    async with served(header_timeout=SLOW, body_timeout=LONG, idle_timeout=LONG) as server:
        reader, writer = await connect(server)
        writer.write(WHOLE_REQUESTS[first])
        assert (await read_response(reader))[0] == 200
        await asyncio.sleep(SLOW * 3)
        assert await get_ok(reader, writer) == 200
        writer.close()
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="header") == 0


async def test_a_body_of_blank_lines_costs_what_the_parser_costs() -> None:
    """Review of issue 16: feeding the parser a piece per blank line made a chunked body of
    CRLFs cost seconds of the event loop (every client's). Each read is fed whole."""
    async with served(body_timeout=LONG, idle_timeout=LONG) as server:
        reader, writer = await connect(server)
        body = b"\r\n\r\n" * (1 << 18)  # 1 MiB of blank lines, one chunk
        writer.write(
            b"POST /sink HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n"
        )
        started = time.monotonic()
        status, _, answer = await read_response(reader)
        took = time.monotonic() - started
        writer.close()
        assert (status, json.loads(answer)) == (200, {"bytes": len(body)})
        assert took < 0.5, f"a body of blank lines took {took:.2f} s"


@pytest.mark.parametrize("sender", ["stalls", "trickles"])
async def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closed(
    sender: str,
) -> None:
    async with served(header_timeout=LONG, body_timeout=SLOW, idle_timeout=LONG) as server:
        reader, writer = await connect(server)
        body = b'{"a": "' + b"x" * 80 + b'"}'
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10])
        )
        started = time.monotonic()
        task = asyncio.create_task(trickle(writer, body[10:]) if sender == "trickles" else _idle())
        try:
            status, headers, answer = await asyncio.wait_for(read_response(reader), SLOW + 10)
        except (ConnectionResetError, asyncio.IncompleteReadError):
            # a client still sending when the server closes may get a reset before the 408
            assert sender == "trickles", "a client that only waits must read the 408"
            status = 0
        took = time.monotonic() - started
        assert SLOW * 0.9 <= took <= SLOW + MARGIN
        if status:
            assert status == 408
            assert json.loads(answer)["error"]["code"] == "request_timeout"
            assert headers["connection"] == "close"
        assert await seconds_until_closed(reader, limit=5) < 5
        task.cancel()
        writer.close()
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="body") == 1


async def _idle() -> None:
    await asyncio.sleep(3600)


async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_limit() -> None:
    async with served(header_timeout=LONG, body_timeout=LONG, idle_timeout=SLOW) as server:
        reader, writer = await connect(server)
        assert await get_ok(reader, writer) == 200
        took = await seconds_until_closed(reader, limit=SLOW + 10)
        writer.close()
        assert SLOW * 0.9 <= took <= SLOW + MARGIN


async def test_over_the_per_client_cap_a_connection_is_refused_and_the_capped_ones_work() -> None:
    cap = 3
    async with served(max_connections_per_client=cap) as server:
        first = [await connect(server) for _ in range(cap)]
        assert [await get_ok(r, w) for r, w in first] == [200] * cap
        reader, writer = await connect(server)
        status, headers, body = await read_response(reader)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert await seconds_until_closed(reader, limit=5) < 5
        writer.close()
        # another address is not held to this one's cap
        other = await connect(server, source="127.0.0.2")
        assert await get_ok(*other) == 200
        other[1].close()
        assert [await get_ok(r, w) for r, w in first] == [200] * cap
        assert server.metric("matrixserve_http_connections_refused_total", reason="per_client") == 1
        for _, w in first:
            w.close()
        assert await _served_again(server), "the cap must free up as its connections close"


async def test_over_the_total_cap_a_connection_from_any_address_is_refused() -> None:
    async with served(max_connections=2, max_connections_per_client=10) as server:
        held = [await connect(server, f"127.0.0.{i}") for i in (2, 3)]
        assert [await get_ok(r, w) for r, w in held] == [200, 200]
        reader, writer = await connect(server, "127.0.0.4")
        status, _, body = await read_response(reader)
        assert status == 503
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        writer.close()
        assert server.metric("matrixserve_http_connections_refused_total", reason="total") == 1
        assert server.metric("matrixserve_http_connections_open") == 2
        for _, w in held:
            w.close()
        assert await _served_again(server)


async def _served_again(server: Served) -> bool:
    """Whether a new connection is served within 5 s (the server sees closes asynchronously)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reader, writer = await connect(server)
        status, _, _ = await get_ok(reader, writer), None, None
        writer.close()
        if status == 200:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_client_that_reads_nothing_is_cut_after_the_send_timeout() -> None:
    """A response written to a client that stops reading: once the send buffers are full, its
    write stalls; past the send timeout the connection is aborted and the handler's write
    fails (or it is cancelled), so it gives back what it holds."""
    async with served(send_timeout=SLOW, idle_timeout=LONG) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        _, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(b"GET /flood HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(FLOOD.started.wait(), 5)
            started = time.monotonic()
            await asyncio.wait_for(FLOOD.ended.wait(), SLOW + 10)  # never read: buffers fill
            took = time.monotonic() - started
        finally:
            writer.transport.abort()
        assert took <= SLOW + MARGIN + 1, f"a client reading nothing held its stream {took:.2f} s"
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="send") == 1


async def test_a_client_that_reads_slowly_is_not_cut_by_the_send_timeout() -> None:
    async with served(send_timeout=SLOW, idle_timeout=LONG) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /flood?megabytes=4 HTTP/1.1\r\nHost: t\r\n\r\n")
        received = 0
        while chunk := await asyncio.wait_for(reader.read(1 << 16), 10):
            received += len(chunk)
            await asyncio.sleep(0.02)  # ~3 MB/s: each write drains well within the deadline
            if received > 4 << 20:
                break
        writer.close()
        assert received > 4 << 20, received
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="send") == 0


async def test_a_stream_longer_than_every_limit_is_not_cut_and_its_connection_stays_usable() -> (
    None
):
    tight = {"header_timeout": 0.3, "body_timeout": 0.3, "idle_timeout": 0.5, "send_timeout": 0.3}
    assert all(t < STREAM_PAUSE for t in tight.values())
    async with (
        served(**tight) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as client,
    ):
        async with client.stream("POST", "/stream", json={"prompt": "x"}) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        assert lines == ["data: 0", "data: 1", "data: 2", "data: done"]
        again = await client.get("/ok")  # the same pooled connection, well within the idle limit
        assert again.status_code == 200
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="header") == 0
        assert server.metric("matrixserve_http_connections_timed_out_total", phase="body") == 0


async def test_the_gateways_pool_passes_over_a_connection_the_engines_idle_limit_closed() -> None:
    """The gateway keeps engine connections pooled with no limit of its own: an engine closing
    one at its idle limit costs the next request a new connection, never a failure."""
    async with served(idle_timeout=SLOW) as server:
        pool = EnginePool()
        address = f"127.0.0.1:{server.port}"
        for _ in range(2):
            stream = await pool.post(address, "/generate", b"{}")
            assert stream.status == 200
            events = []
            while batch := await asyncio.wait_for(stream.batch(), 5):
                events.extend(batch)
            assert [e["type"] for e in events] == ["token", "done"]
            stream.release()
            assert pool.idle_count(address) == 1
            deadline = time.monotonic() + SLOW + MARGIN
            while pool.idle_count(address) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert pool.idle_count(address) == 0, "the engine must close an idle connection"
        pool.close()


async def test_start_keeps_the_runners_own_settings() -> None:
    """The servers' runners carry settings of their own (``handler_cancellation``: a client that
    leaves cancels its handler, finding 5); serving them under the limits keeps them."""
    app = httpserving.application(handler_args={"handler_cancellation": True})
    runner = web.AppRunner(app, access_log=None)
    await httpserving.start(runner, "127.0.0.1", 0, ConnectionLimits(idle_timeout=7.0))
    try:
        assert runner.server is not None
        assert runner.server.handler_cancellation
        assert runner.server().keepalive_timeout == 7.0
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- finding 3
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("GET", "/nope", None, 404, "not_found"),
        ("DELETE", "/ok", None, 405, "method_not_allowed"),
        ("POST", "/echo", b"x" * 4096, 413, "request_too_large"),
        ("GET", "/boom", None, 500, "internal_error"),
    ],
)
async def test_the_frameworks_errors_are_openai_json(
    method: str, path: str, body: bytes | None, status: int, code: str
) -> None:
    async with served() as server, httpx.AsyncClient(base_url=server.url) as client:
        response = await client.request(method, path, content=body)
        assert response.status_code == status
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == code
        assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
        if status == 405:
            assert "GET" in response.headers["allow"]
        if status == 500:
            assert "secret detail" not in response.text
            assert "Traceback" not in response.text


async def test_an_uncaught_exception_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with served() as server, httpx.AsyncClient(base_url=server.url) as client:
        with caplog.at_level(logging.ERROR, logger="matrixserve.httpserving"):
            assert (await client.get("/boom")).status_code == 500
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1
    assert logged[0].exc_info is not None
    assert "secret detail" in str(logged[0].exc_info[1])


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        # refused by aiohttp's parser before any application code
        (b"GET /ok HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n", 400, "malformed_http"),
        (b"G\x00T /ok HTTP/1.1\r\n\r\n", 400, "malformed_http"),
        # checked by aiohttp before the middlewares
        (b"GET /ok HTTP/1.1\r\nHost: t\r\nExpect: tea\r\n\r\n", 417, "expectation_failed"),
        # a body the parser cannot decode
        (
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Encoding: gzip\r\nContent-Length: 8\r\n"
            b"\r\nnot gzip",
            400,
            "invalid_body",
        ),
    ],
)
async def test_requests_refused_outside_the_handlers_are_openai_json(
    request_bytes: bytes, status: int, code: str
) -> None:
    async with served() as server:
        reader, writer = await connect(server)
        writer.write(request_bytes)
        got, headers, body = await read_response(reader)
        writer.close()
        assert got == status
        assert headers["content-type"].startswith("application/json")
        assert json.loads(body)["error"]["code"] == code


async def test_an_error_after_a_stream_started_cuts_the_stream_and_writes_nothing_into_it() -> None:
    async with served() as server:
        reader, writer = await connect(server)
        writer.write(b"GET /broken-stream HTTP/1.1\r\nHost: t\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
        writer.close()
    assert head.startswith(b"HTTP/1.1 200")
    assert b"chunked" in head.lower()
    # the stream's own event, then nothing: no error body, not the chunked body's end
    assert rest == b"9\r\ndata: 0\n\n\r\n"


# --------------------------------------------------------------------------- flags
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    httpserving.add_arguments(parser, "TEST_HTTP_", ConnectionLimits(idle_timeout=300.0))
    return parser


def test_the_flags_default_to_the_environment_then_to_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_HTTP_MAX_CONNECTIONS", "77")
    limits = httpserving.limits_from(_parser().parse_args(["--header-timeout", "2.5"]))
    assert limits == ConnectionLimits(header_timeout=2.5, idle_timeout=300.0, max_connections=77)


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--header-timeout", "0"], {}),
        (["--body-timeout", "-1"], {}),
        (["--idle-timeout", "nan"], {}),
        (["--idle-timeout", "inf"], {}),
        (["--max-connections", "0"], {}),
        (["--max-connections-per-client", "1.5"], {}),
        ([], {"TEST_HTTP_BODY_TIMEOUT": "soon"}),
    ],
)
def test_bad_limit_values_exit_2_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    flag = argv[0] if argv else "--body-timeout"
    assert flag in capsys.readouterr().err


def test_the_gateway_takes_the_limit_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = gateway_parse(["--zookeeper", "127.0.0.1:2181", "--max-connections", "9"])
    assert httpserving.limits_from(args) == replace(
        gateway_main.CONNECTION_LIMITS, max_connections=9
    )
    with pytest.raises(SystemExit) as exit_:
        gateway_parse(["--zookeeper", "127.0.0.1:2181", "--header-timeout", "0"])
    assert exit_.value.code == 2
    assert "--header-timeout" in capsys.readouterr().err


def test_the_engine_takes_the_limit_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = engine_parse(["--idle-timeout", "600"])
    assert config.connection_limits == replace(engine_config.CONNECTION_LIMITS, idle_timeout=600.0)
    monkeypatch.setenv("ENGINE_MAX_CONNECTIONS_PER_CLIENT", "none")
    with pytest.raises(SystemExit) as exit_:
        engine_parse([])
    assert exit_.value.code == 2
    assert "--max-connections-per-client" in capsys.readouterr().err


async def test_start_raises_the_soft_open_file_limit_before_fitting_the_caps() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    runner = web.AppRunner(make_app(), access_log=None)
    try:
        guard = await httpserving.start(runner, "127.0.0.1", 0, ConnectionLimits())
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        await runner.cleanup()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if hard != resource.RLIM_INFINITY:  # Linux refuses an unlimited soft limit for files
        assert raised == hard
        assert guard.limits == ConnectionLimits().within_open_files(hard)
    assert guard.limits.max_connections > (low - httpserving.RESERVED_FDS) // 2 or low == hard


def test_the_caps_fit_within_the_open_file_limit() -> None:
    limits = ConnectionLimits(max_connections=10_000, max_connections_per_client=4096)
    assert limits.within_open_files(-1) == limits  # unlimited
    assert limits.within_open_files(1_000_000) == limits
    fitted = limits.within_open_files(1024)
    assert fitted.max_connections == (1024 - httpserving.RESERVED_FDS) // 2
    assert fitted.max_connections_per_client == fitted.max_connections
