"""The gateway's engine client (``matrixserve.gateway.upstream``) against real sockets on
127.0.0.1: framing across arbitrary splits, keep-alive reuse, and every way an engine can fail
(before answering, mid-stream, silent, malformed), each ending in an error, never a hang."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest

from matrixserve.gateway import upstream
from matrixserve.gateway.upstream import (
    MAX_EVENT_BYTES,
    MAX_PENDING_EVENTS,
    EnginePool,
    UpstreamError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
_BIG = MAX_EVENT_BYTES + 10  # an event longer than an engine may send
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def sse(event: dict[str, Any]) -> bytes:
    data = b"data: " + json.dumps(event).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_bytes(texts: list[str]) -> bytes:
    events = [{"type": "token", "index": i, "text": t} for i, t in enumerate(texts)]
    events.append({"type": "done", "usage": {"promptTokens": 1, "completionTokens": len(texts)}})
    return STREAM_HEAD + b"".join(sse(e) for e in events) + b"0\r\n\r\n"


async def read_request(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """One request's JSON body, or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    body: dict[str, Any] = json.loads(await reader.readexactly(length))
    return body


class Engine:
    """A scripted engine: ``handler(reader, writer, connection_number)`` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.closed = handler, 0, 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed += 1
            writer.close()


@asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[tuple[Engine, str]]:
    e = Engine(handler)
    server = await asyncio.start_server(e._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield e, f"127.0.0.1:{port}"
    finally:
        server.close()


async def drain(stream: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while batch := await asyncio.wait_for(stream.batch(), 5):
        events.extend(batch)
    return events


async def test_a_stream_split_at_every_byte_gives_the_same_events_and_the_connection_is_reused() -> (
    None
):
    texts = ["a", 'q"uote', "\n", "ünï"]
    answer = stream_bytes(texts)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            for i in range(len(answer)):  # one byte per write, each read on its own
                writer.write(answer[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)

    pool = EnginePool()
    async with engine(handler) as (e, address):
        for _ in range(2):
            stream = await pool.post(address, "/v1/generate", b"{}")
            assert stream.status == 200
            events = await drain(stream)
            assert [ev.get("text") for ev in events[:-1]] == texts
            assert events[-1]["type"] == "done"
            stream.release()
            assert pool.idle_count(address) == 1
        assert e.connections == 1, "the second request must reuse the kept-alive connection"
    pool.close()


async def test_a_handler_that_falls_behind_pauses_reading_and_loses_nothing() -> None:
    texts = [f"t{i}" for i in range(4 * MAX_PENDING_EVENTS)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(stream_bytes(texts))
        await writer.drain()
        await reader.read()

    pool = EnginePool(read_timeout=0.3)
    async with engine(handler) as (_, address):
        stream = await pool.post(address, "/v1/generate", b"{}")
        await asyncio.sleep(0.5)  # a slow client: nothing taken, longer than the read timeout
        assert stream.transport is not None
        assert not stream.transport.is_reading(), "reading must pause while events pile up"
        events = await drain(stream)
        assert [ev.get("text") for ev in events[:-1]] == texts
        assert events[-1]["type"] == "done", "a paused read is not the engine's silence"
        stream.release()
    pool.close()


async def test_a_refusal_is_read_whole_and_its_connection_pooled() -> None:
    body = b'{"error": {"code": "rejected"}}'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            await writer.drain()
            await asyncio.sleep(0.01)  # the body in a later read than the head
            writer.write(body)

    pool = EnginePool()
    async with engine(handler) as (e, address):
        stream = await pool.post(address, "/v1/generate", b"{}")
        assert stream.status == 429
        assert await drain(stream) == [], "a refusal's body is not the stream's events"
        stream.release()
        again = await pool.post(address, "/v1/generate", b"{}")
        assert again.status == 429
        assert e.connections == 1
        again.release()
    pool.close()


@pytest.mark.parametrize(
    ("tail", "reason"),
    [
        (b"", "closed the connection"),  # cut mid-stream: the decode died
        (b"12\r\ndata: {not json}\n\n\r\n", "Expecting property name"),
        (b"zz\r\n", "bad chunk size"),
        (b"-5\r\n", "bad chunk size"),  # int(-5, 16) would loop the event loop for ever
        (b"3\r\nabcx\r\n", "not ended by CRLF"),
        (b"c\r\ndata: [1,2]\n\n\r\n", "not a JSON object with a type"),
        (b"%x\r\ndata: %s" % (_BIG + 6, b"x" * _BIG), "event over"),
    ],
    ids=[
        "cut",
        "bad-json",
        "bad-chunk-size",
        "negative-chunk-size",
        "chunk-overrun",
        "not-an-object",
        "oversize-event",
    ],
)
async def test_a_stream_broken_mid_way_ends_with_one_error_event(tail: bytes, reason: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + sse({"type": "token", "index": 0, "text": "a"}) + tail)
        await writer.drain()
        if tail:
            await asyncio.sleep(5)  # keeps the connection: the client must not wait on it

    pool = EnginePool()
    async with engine(handler) as (_, address):
        stream = await pool.post(address, "/v1/generate", b"{}")
        events = await drain(stream)
        assert [ev["type"] for ev in events] == ["token", "error"]
        assert events[1]["code"] == "upstream_failed"
        assert reason in events[1]["message"], events[1]["message"]
        stream.release()
        assert pool.idle_count(address) == 0, "a broken connection must never be pooled"
    pool.close()


async def test_a_silent_engine_ends_the_stream_after_the_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + sse({"type": "token", "index": 0, "text": "a"}))
        await writer.drain()
        await asyncio.sleep(0.25)
        writer.write(sse({"type": "token", "index": 1, "text": "b"}))  # in time: resets the clock
        await writer.drain()
        await reader.read()  # silent until the gateway closes it

    pool = EnginePool(read_timeout=0.4)
    async with engine(handler) as (e, address):
        stream = await pool.post(address, "/v1/generate", b"{}")
        started = asyncio.get_running_loop().time()
        events = await drain(stream)
        took = asyncio.get_running_loop().time() - started
        assert [ev["type"] for ev in events] == ["token", "token", "error"]
        assert "no data for 0.4 s" in events[2]["message"]
        assert 0.6 <= took < 2, f"ended after {took:.2f} s: 0.25 s + 0.4 s of silence expected"
        stream.release()
        await _closed(e, 1)
    pool.close()


async def test_a_pooled_connection_closed_by_the_engine_is_retried_on_a_new_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(stream_bytes(["a"]))
            await writer.drain()
            await read_request(reader)  # the second request on this connection: dropped unread
            return
        writer.write(stream_bytes(["b"]))
        await writer.drain()
        await asyncio.sleep(1)

    pool = EnginePool()
    async with engine(handler) as (e, address):
        first = await pool.post(address, "/v1/generate", b"{}")
        await drain(first)
        first.release()
        second = await pool.post(address, "/v1/generate", b"{}")
        assert second.status == 200
        assert not second.reused
        assert [ev.get("text") for ev in await drain(second)][:1] == ["b"]
        assert e.connections == 2
        second.release()
    pool.close()


async def test_an_engine_that_closes_before_answering_or_is_not_there_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    pool = EnginePool()
    async with engine(handler) as (_, address):
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.post(address, "/v1/generate", b"{}")
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.post(address, "/v1/generate", b"{}")  # the server is gone: refused

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await asyncio.sleep(5)

    async with engine(garbage) as (_, address):
        with pytest.raises(UpstreamError, match=r"not an HTTP/1\.x status line"):
            await asyncio.wait_for(pool.post(address, "/v1/generate", b"{}"), 5)
    pool.close()


async def test_a_caller_giving_up_before_the_answer_drops_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await reader.read()  # until the gateway closes it

    pool = EnginePool()
    async with engine(handler) as (e, address):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await pool.post(address, "/v1/generate", b"{}")
        await _closed(e, 1)
        assert pool.idle_count(address) == 0


async def test_releasing_a_stream_cut_short_closes_it_and_close_drops_streams_in_use() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + sse({"type": "token", "index": 0, "text": "a"}))
        await writer.drain()
        await reader.read()  # until the gateway closes it

    pool = EnginePool()
    async with engine(handler) as (e, address):
        cut = await pool.post(address, "/v1/generate", b"{}")
        assert (await cut.batch())[0]["text"] == "a"
        cut.release()  # the client went away mid-stream: the engine must see it at once
        await _closed(e, 1)
        assert pool.idle_count(address) == 0
        in_use = await pool.post(address, "/v1/generate", b"{}")
        await in_use.batch()
        pool.close()  # the gateway shutting down leaves no connection behind
        await _closed(e, 2)


async def _closed(e: Engine, n: int) -> None:
    """Wait (at most 5 s) until the engine has seen ``n`` connections closed."""
    async with asyncio.timeout(5):
        while e.closed < n:
            await asyncio.sleep(0.01)


async def test_a_stream_released_at_its_last_event_is_pooled_when_the_body_end_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine writes its stream's end (the zero chunk) after the ``done`` event, often in a
    read of its own; the gateway releases at ``done``. The connection waits for the end and is
    pooled, or is dropped if the end never comes."""
    monkeypatch.setattr(upstream, "LINGER_SECONDS", 0.3)
    done = {"type": "done", "usage": {"promptTokens": 1, "completionTokens": 1}}

    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        nonlocal served
        while await read_request(reader) is not None:
            served += 1
            writer.write(STREAM_HEAD + sse({"type": "token", "index": 0, "text": "a"}) + sse(done))
            await writer.drain()
            if served == 3:  # the end never comes
                await reader.read()
                return
            await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    pool = EnginePool()
    async with engine(handler) as (e, address):
        for _ in range(2):
            stream = await pool.post(address, "/v1/generate", b"{}")
            events: list[dict[str, Any]] = []
            while not events or events[-1]["type"] != "done":
                events.extend(await asyncio.wait_for(stream.batch(), 5))
            stream.release()  # as the gateway does: at the last event, the end not yet read
            assert pool.idle_count(address) == 0, "pooled before the body's end was read"
            await asyncio.sleep(0.15)
            assert pool.idle_count(address) == 1, "the body's end came: the connection is reusable"
        assert e.connections == 1
        assert e.closed == 0, "the engine must not see a stream it finished as cut short"
        last = await pool.post(address, "/v1/generate", b"{}")
        assert [ev["type"] for ev in await asyncio.wait_for(last.batch(), 5)] == ["token", "done"]
        last.release()
        # the end never comes: dropped after the linger, not pooled
        await _closed(e, 1)
        assert pool.idle_count(address) == 0
    pool.close()


async def test_closing_the_pool_ends_what_waits_on_it() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(STREAM_HEAD + sse({"type": "token", "index": 0, "text": "a"}))
            await writer.drain()
        await reader.read()  # no more, until the gateway closes it

    pool = EnginePool()
    async with engine(handler) as (_, address):
        streaming = await pool.post(address, "/v1/generate", b"{}")
        assert (await streaming.batch())[0]["text"] == "a"
        waiting = asyncio.create_task(streaming.batch())
        heading = asyncio.create_task(pool.post(address, "/v1/generate", b"{}"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        assert not heading.done()
        pool.close()
        events = await asyncio.wait_for(waiting, 2)
        assert events[0]["code"] == "upstream_failed"
        with pytest.raises(UpstreamError, match="dropped the connection"):
            await asyncio.wait_for(heading, 2)
        assert await streaming.batch() == []


async def test_a_prefill_that_cannot_be_reached_is_passed_over_for_a_while() -> None:
    """Passive health: routes may be stale (ZooKeeper out of reach, the status the last known),
    so a prefill that could not be reached is not tried first again by the next requests."""
    from matrixserve.domain.gateway.completions import Completion, Prompt
    from matrixserve.domain.gateway.routing import Entrance
    from matrixserve.gateway.config import GatewayConfig, GatewayMetrics
    from matrixserve.gateway.discovery import GroupRoute
    from matrixserve.gateway.forwarder import Forwarder

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await read_request(reader) is not None:
            writer.write(stream_bytes(["a"]))
            await writer.drain()

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        async with engine(answer) as (_, alive):
            route = GroupRoute("ns", "g", "general", 2000, 0, 8)
            route.entrances = [
                Entrance("g-p-0", f"127.0.0.1:{dead.getsockname()[1]}"),
                Entrance("g-p-1", alive),
            ]
            metrics = GatewayMetrics()
            forwarder = Forwarder(cast(Any, None), GatewayConfig(), metrics)
            await forwarder.start()
            completion = Completion("general", (Prompt.of_text("hi"),), 1, stream=True, chat=False)
            for i in range(3):  # a scenario each: no batch-forwarding stickiness
                chosen = await forwarder.forward(f"s{i}", [route], completion)
                assert not isinstance(chosen, str), chosen
                entrance, stream = chosen
                assert entrance.instance == "g-p-1"
                await drain(stream)
                stream.release()
            unreachable = metrics.registry.get_sample_value(
                "matrixserve_gateway_forward_attempts_total", {"answer": "unreachable"}
            )
            assert unreachable == 1  # tried once, then passed over
            await forwarder.close()
    finally:
        dead.close()


# --------------------------------------------------------------------------- forwarding
class _Stream:
    """An accepted try's stream, as ``forward_all`` holds it: released once, or leaked."""

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def _forwarder(**config: Any) -> Any:
    from matrixserve.gateway.config import GatewayConfig, GatewayMetrics
    from matrixserve.gateway.forwarder import Forwarder

    return Forwarder(cast(Any, None), GatewayConfig(**config), GatewayMetrics())


@pytest.mark.parametrize("refusal", ["refused", "raised"])
async def test_a_try_accepted_in_the_round_another_was_refused_gives_its_stream_back(
    refusal: str,
) -> None:
    """Review of issue 16, finding 1: tries that end in the same round of ``asyncio.wait`` —
    one refused (or failed), the other accepted — in whichever order the round lists them."""
    from matrixserve.domain.gateway.completions import BadRequest, Completion, Prompt
    from matrixserve.domain.gateway.routing import Entrance

    forwarder = _forwarder()
    refused, accepted = Prompt.of_text("refused"), Prompt.of_text("accepted")
    completion = Completion("general", (refused, accepted), 1, stream=True, chat=False)
    streams: list[_Stream] = []

    async def forward(
        scenario: str, routes: Any, c: Completion, prompt: Prompt, choice: int = 0
    ) -> Any:
        if prompt is refused:  # both end without awaiting: in one round
            if refusal == "raised":
                raise BadRequest("the prompt is too long", "prompt")
            return "no prefill accepted"
        streams.append(_Stream())
        return Entrance("g-p-0", "127.0.0.1:1"), streams[-1]

    forwarder.forward = forward
    for _ in range(40):  # the round's order is a set's: each order comes up
        if refusal == "raised":
            with pytest.raises(BadRequest):
                await forwarder.forward_all("general", [], completion)
        else:
            assert await forwarder.forward_all("general", [], completion) == "no prefill accepted"
    assert len(streams) == 40
    assert [s.released for s in streams] == [1] * 40


async def test_a_try_accepted_as_its_request_is_cancelled_gives_its_stream_back() -> None:
    """The request cancelled (its client left) between a try's end and the round's return."""
    from matrixserve.domain.gateway.completions import Completion, Prompt
    from matrixserve.domain.gateway.routing import Entrance

    forwarder = _forwarder()
    completion = Completion("general", (Prompt.of_text("x"),), 1, stream=True, chat=False, n=2)
    stream, hung = _Stream(), asyncio.Event()
    request: asyncio.Task[Any] | None = None

    async def forward(
        scenario: str, routes: Any, c: Completion, prompt: Prompt, choice: int = 0
    ) -> Any:
        if hung.is_set():  # the second try: never answered
            await asyncio.Event().wait()
        hung.set()
        await asyncio.sleep(0)
        assert request is not None
        request.cancel()  # the client leaves as this try ends
        return Entrance("g-p-0", "127.0.0.1:1"), stream

    forwarder.forward = forward
    request = asyncio.create_task(forwarder.forward_all("general", [], completion))
    with pytest.raises(asyncio.CancelledError):
        await request
    assert stream.released == 1


async def test_a_prefill_that_answers_503_is_passed_over_for_its_retry_after() -> None:
    """Review of issue 16, finding 5: an engine's 503 (``too_many_connections`` with
    ``Connection: close``, or not serving) is not tried again before its Retry-After (at most
    2 s), by any request, even when it is the only entrance: no reconnection every 20 ms; a
    request whose budget ends first is answered at once."""
    from matrixserve.domain.gateway.completions import Completion, Prompt
    from matrixserve.domain.gateway.routing import Entrance
    from matrixserve.gateway.discovery import GroupRoute

    async def busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        body = b'{"error": {"code": "too_many_connections", "message": "retry later"}}'
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await read_request(reader) is not None:
            writer.write(stream_bytes(["a"]))
            await writer.drain()

    forwarder = _forwarder(default_ttft_ms=1000)
    await forwarder.start()
    completion = Completion("general", (Prompt.of_text("hi"),), 1, stream=True, chat=False)
    async with engine(busy) as (refusing, full), engine(answer) as (_, alive):
        route = GroupRoute("ns", "g", "general", 1000, 0, 8)
        route.entrances = [Entrance("g-p-0", full), Entrance("g-p-1", alive)]
        for i in range(3):  # a scenario each: no batch-forwarding stickiness
            chosen = await forwarder.forward(f"s{i}", [route], completion)
            assert not isinstance(chosen, str), chosen
            assert chosen[0].instance == "g-p-1"
            await drain(chosen[1])
            chosen[1].release()
        route.entrances = [Entrance("g-p-0", full)]  # the only one, answering 503
        started = asyncio.get_running_loop().time()
        reason = await forwarder.forward("s9", [route], completion)
        took = asyncio.get_running_loop().time() - started
    assert isinstance(reason, str)
    assert "unavailable (503)" in reason, reason
    assert took < 0.5, f"waited {took:.2f} s for a prefill back after the budget"
    assert refusing.connections == 1, "tried again before its Retry-After"
    tries = forwarder.metrics.registry.get_sample_value(
        "matrixserve_gateway_forward_attempts_total", {"answer": "http_503"}
    )
    assert tries == 1
    await forwarder.close()


async def test_a_freed_slot_wakes_the_first_waiter_in_line_that_may_use_it_and_no_other() -> None:
    """Issue 31: every entrance busy, requests wait in line; a slot freed wakes one waiter,
    the first in line of those whose prefills include the freed one (before: every waiter woke
    and all tried for the one slot). A request keeps its place between waits; a wake that
    reaches a waiter as it is cancelled goes on to the next."""
    forwarder = _forwarder()
    forwarder.holding = {"p-0": 4, "p-1": 1}
    line = {
        name: forwarder.join_line(frozenset(instances))
        for name, instances in [
            ("a", {"p-1"}),
            ("b", {"p-0", "p-1"}),
            ("c", {"p-0"}),
            ("d", {"p-0"}),
        ]
    }
    woke: list[tuple[str, str | None]] = []

    async def wait(name: str, timeout: float = 0.3) -> None:
        woke.append((name, await forwarder.wait_for_slot(line[name], timeout)))

    waiters = {name: asyncio.create_task(wait(name)) for name in line}
    await asyncio.sleep(0.01)
    forwarder.release_slot("p-0")
    await asyncio.sleep(0.01)
    assert woke == [("b", "p-0")]  # a may not use p-0; b is before c and d
    # b tries, finds nothing, waits again: it keeps its place before c and d
    waiters["b"] = asyncio.create_task(wait("b"))
    await asyncio.sleep(0.01)
    forwarder.release_slot("p-0")
    await asyncio.sleep(0.01)
    assert woke[1:] == [("b", "p-0")]
    # a wake reaching a waiter being cancelled goes on to the next in line
    forwarder.release_slot("p-0")  # wakes c ...
    waiters["c"].cancel()  # ... whose client is gone before it ran
    await asyncio.sleep(0.01)
    assert ("d", "p-0") in woke
    forwarder.release_slot("p-1")
    await asyncio.sleep(0.01)
    assert ("a", "p-1") in woke
    assert forwarder.holding == {"p-0": 1, "p-1": 0}
    await asyncio.gather(*waiters.values(), return_exceptions=True)
    for waiter in line.values():
        forwarder.leave_line(waiter)
    assert not forwarder.waiting
    forwarder.release_slot("p-0")  # nobody waits: nothing to wake, nothing breaks
    assert forwarder.holding["p-0"] == 0
