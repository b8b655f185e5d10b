"""Issue 16 findings 1 and 5 over HTTP: an exchange gives back what it took (prefill slot, decode
place, KV) on every path, the caller gone before the response started included; a prefill whose
slots are held without progress past the bound is not ready, one merely busy stays ready; a wait
on a decode that never answers is bounded; a caller that goes frees its slot and its decode's
place at once. Engines in this process on loopback (aiohttp), or as processes (``start_engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from enginestub.engine import kvpull, to_decode
from enginestub.engine.clock import Clock
from enginestub.engine.config import parse
from enginestub.engine.core import Engine
from enginestub.engine.server import build_app
from matrixserve.api.engine_protocol import GenerateRequest

LLAMA = ["--model", "llama3-8b", "--dies", "0,1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(*args: str, clock: Clock | None = None) -> Engine:
    config = parse([*LLAMA, "--host", "127.0.0.1", "--port", str(_free_port()), *args])
    engine = Engine(config, clock=clock) if clock is not None else Engine(config)
    engine.loaded = True  # the load is not what these tests are about
    return engine


@contextlib.asynccontextmanager
async def _serving(
    engine: Engine, setup: Callable[[web.Application], None] | None = None
) -> AsyncIterator[str]:
    """The engine's app on its loopback address; yields its base URL."""
    app = build_app(engine)
    if setup is not None:
        setup(app)
    await engine.start()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, engine.config.host, engine.config.port).start()
    try:
        yield f"http://{engine.config.host}:{engine.config.port}"
    finally:
        await runner.cleanup()
        await engine.close()


def _body(rid: str, prompt: int = 512, out: int = 4, **extra: Any) -> dict[str, Any]:
    return {"requestId": rid, "promptTokens": prompt, "maxTokens": out, **extra}


async def _events(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        return [json.loads(line[6:]) async for line in response.aiter_lines() if line]


def _gone_before_the_headers(app: web.Application, switch: dict[str, bool]) -> None:
    """While ``switch["on"]``, every response's caller is gone just before its headers go out
    (the transport closes in ``on_response_prepare``): the response's prepare raises."""

    async def gone(request: web.Request, _: web.StreamResponse) -> None:
        if switch["on"] and request.transport is not None:
            request.transport.close()

    app.on_response_prepare.append(gone)


@pytest.mark.parametrize(
    ("role", "path", "extra"),
    [
        ("colocated", "/v1/generate", {}),
        ("prefill", "/v1/generate", {}),
        ("decode", "/v1/decode", {"prefill": {"address": "127.0.0.1:9", "roceIps": []}}),
    ],
)
async def test_a_caller_gone_before_the_response_starts_takes_nothing_with_it(
    role: str, path: str, extra: dict[str, Any]
) -> None:
    """Finding 1: the slot (or decode place) and KV were taken, then the response's prepare
    raised before the stream that gave them back had started: they leaked for ever."""
    engine = _engine("--role", role, "--max-batch", "2")
    switch = {"on": True}
    async with (
        _serving(engine, lambda app: _gone_before_the_headers(app, switch)) as url,
        httpx.AsyncClient(trust_env=False) as client,
    ):
        for i in range(3 * engine.config.max_batch):  # more than there are slots
            with contextlib.suppress(httpx.HTTPError):  # the connection closes unanswered
                await client.post(
                    f"{url}{path}", json=_body(f"gone{i}", **extra), headers={"Connection": "close"}
                )
        switch["on"] = False
        health = (await client.get(f"{url}/v1/info")).json()["health"]
        assert health["prefillSlots"]["used"] == 0
        assert health["decodeBatch"].get("admitted", 0) == 0
        assert health["kvReservedBytes"] == 0
        if role != "decode":  # and the next request is admitted and prefilled
            events = await _events(client, f"{url}{path}", _body("after", out=2))
            assert events[0]["type"] == "token", events


async def test_busy_and_not_ready_answers_say_when_to_retry_in_openai_shape() -> None:
    engine = _engine("--role", "prefill", "--max-batch", "1")
    async with _serving(engine) as url, httpx.AsyncClient(trust_env=False) as client:
        with engine.admit_prefill(GenerateRequest("holds-the-slot", 64, 4)):
            busy = await client.post(f"{url}/v1/generate", json=_body("busy"))
        engine.loaded = False
        loading = await client.post(f"{url}/v1/generate", json=_body("early"))
        unready = await client.get(f"{url}/readyz")
    assert (busy.status_code, busy.headers.get("Retry-After")) == (429, "1")
    assert busy.json()["error"] == {
        "message": "prefill busy: 1/1 slots in use",
        "type": "rate_limit_exceeded",
        "param": None,
        "code": "rejected",
    }
    assert (loading.status_code, loading.headers.get("Retry-After")) == (503, "5")
    assert loading.json()["error"]["type"] == "server_error"
    assert (unready.status_code, unready.headers.get("Retry-After")) == (503, "5")


async def test_a_slot_held_without_progress_turns_readyz_to_503_until_it_is_freed() -> None:
    class Manual(Clock):
        t = 0.0

        def now(self) -> float:
            return self.t

    clock = Manual(1.0)
    engine = _engine("--role", "prefill", clock=clock)
    async with _serving(engine) as url, httpx.AsyncClient(trust_env=False) as client:
        assert (await client.get(f"{url}/readyz")).status_code == 200
        leaked = engine.admit_prefill(GenerateRequest("leaked", 64, 4))  # never streamed
        clock.t = engine.stuck_bound() + 1
        ready = await client.get(f"{url}/readyz")
        assert ready.status_code == 503
        assert ready.json()["stuckSlots"] == 1
        leaked.release()
        assert (await client.get(f"{url}/readyz")).status_code == 200


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> float:
    """A KV-pull wait floor of 0.3 wall s (5 s in production), so a test outlasts the bound
    several times in seconds; retries of a refused forward every 20 ms emulated (the test is
    about readiness, not the retry rate)."""
    monkeypatch.setattr(kvpull, "WAIT_FLOOR_WALL_SECONDS", 0.3)
    monkeypatch.setattr(to_decode, "RETRY_SECONDS", 0.02)
    return 0.3


@contextlib.asynccontextmanager
async def _pd_pair(
    scale: str, prefill_batch: int, decode_batch: int
) -> AsyncIterator[tuple[Engine, str, Engine, str]]:
    decode = _engine("--role", "decode", "--time-scale", scale, "--max-batch", str(decode_batch))
    prefill = _engine("--role", "prefill", "--time-scale", scale, "--max-batch", str(prefill_batch))
    prefill.decode_peers = [f"{decode.config.host}:{decode.config.port}"]
    async with _serving(decode) as decode_url, _serving(prefill) as prefill_url:
        yield prefill, prefill_url, decode, decode_url


def _slots(engine: Engine) -> int:
    return engine.prefill.slots


async def test_a_prefill_with_every_slot_busy_but_progressing_stays_ready(
    short_bound: float,
) -> None:
    """All slots held for several stuck bounds: prefilling, or waiting for a decode that is full
    (it answers 429: alive and busy) - never stuck, so /readyz stays 200 throughout."""
    async with (
        _pd_pair("5", prefill_batch=2, decode_batch=1) as (prefill, p_url, decode, _),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        stuck_wall = prefill.clock.to_wall(prefill.stuck_bound())
        assert stuck_wall < 2.0, "the test must outlast the bound several times"
        # One long request fills the decode; two more hold both prefill slots behind it.
        long = asyncio.create_task(_events(client, f"{p_url}/v1/generate", _body("a", out=8000)))
        while len(decode.batch.places) < 1 or _slots(prefill):
            await asyncio.sleep(0.01)
        waiting = [
            asyncio.create_task(_events(client, f"{p_url}/v1/generate", _body(f"w{i}", out=2)))
            for i in range(2)
        ]
        began, full_for, readiness = time.monotonic(), 0.0, set()
        while time.monotonic() - began < 3 * stuck_wall:
            readiness.add((await client.get(f"{p_url}/readyz")).status_code)
            if _slots(prefill) == 2:
                full_for = time.monotonic() - began
            await asyncio.sleep(0.02)
        assert readiness == {200}
        assert full_for > 2.5 * stuck_wall, "both slots were held all along"
        assert not long.done()
        long.cancel()
        results = await asyncio.gather(*waiting)  # the decode freed: they are served
        assert all(events[-1]["type"] == "done" for events in results), results


async def test_a_decode_that_never_answers_costs_the_prefill_one_bound_not_a_slot_for_ever(
    short_bound: float,
) -> None:
    """The prefill holds the slot and KV for a decode to pull: not for ever. A hung decode (it
    answers nothing) makes the request end with ``kv_pull_timeout`` after the KV-pull wait
    bound, and the slot is free."""
    async with (
        _pd_pair("5", prefill_batch=1, decode_batch=4) as (prefill, p_url, decode, _),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        decode.inject("hang", {})
        bound_wall = prefill.clock.to_wall(kvpull.kv_wait_bound(prefill.config, 1.0))
        began = time.monotonic()
        events = await _events(client, f"{p_url}/v1/generate", _body("h", out=4))
        took = time.monotonic() - began
        decode.heal("hang")
        assert events[0]["type"] == "token"
        assert events[-1]["type"] == "error"
        assert events[-1]["code"] == "kv_pull_timeout"
        assert bound_wall <= took < bound_wall + 1.0
        assert prefill.prefill.slots == 0
        assert prefill.kv.reserved == 0
        assert (await client.get(f"{p_url}/readyz")).status_code == 200


# ----------------------------------------------------------------------- finding 5 (processes)


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/info", trust_env=False).json()["health"])


def _until(what: str, check: Callable[[], bool], bound: float) -> float:
    """Wall seconds until ``check()`` holds; fails past ``bound``."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < bound, f"{what} not within {bound} s"
        time.sleep(0.01)
    return time.monotonic() - began


def _open_stream(url: str, body: dict[str, Any], tokens: int) -> socket.socket:
    """A raw ``/v1/generate`` whose first ``tokens`` token events have arrived."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/generate HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    seen = b""
    while seen.count(b'"type": "token"') < tokens:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {seen[-300:]!r}"
        seen += chunk
    return sock


# Wall seconds within which a caller's going frees what its request held: the handler is
# cancelled when its connection closes (one event-loop turn), and the decode's when the
# prefill's relay to it closes; 1 s is room for a loaded machine.
GONE_BOUND = 1.0


def test_a_caller_that_goes_frees_its_slot_and_its_decode_place_at_once(
    start_engine: Any,
) -> None:
    """Finding 5, the engine's side: a caller that goes while its request waits for a decode
    (silent: nothing is written, so nothing failed to write) frees the prefill slot and KV
    within GONE_BOUND, not when a decode finally takes it; one that goes mid-stream frees its
    place in the decode batch within the same bound."""
    # No TE-Pre-Load: 20 wall s at time scale 1, and not what this test is about.
    fast = ("--load-source", "NPUForkUB", "--pre-load-seconds", "0")
    decode = start_engine("gone-d", "--role", "decode", *LLAMA, "--max-batch", "1", *fast)
    prefill = start_engine(
        "gone-p",
        "--role",
        "prefill",
        *LLAMA,
        *fast,
        "--decode-peer",
        decode.address,
    )
    first = _open_stream(prefill.url, _body("long", out=8000), tokens=3)  # fills the decode
    assert _health(decode.url)["decodeBatch"]["running"] == 1
    waiting = _open_stream(prefill.url, _body("waits", out=4), tokens=1)  # prefilled, waits
    assert _health(prefill.url)["prefillSlots"]["used"] == 1
    waiting.close()
    _until(
        "the waiting request's slot freed",
        lambda: _health(prefill.url)["prefillSlots"]["used"] == 0,
        GONE_BOUND,
    )
    assert _health(prefill.url)["kvReservedBytes"] == 0
    first.close()
    _until(
        "the decode's batch emptied",
        lambda: _health(decode.url)["decodeBatch"]["admitted"] == 0,
        GONE_BOUND,
    )
    assert _health(decode.url)["decodeBatch"]["running"] == 0
    assert _health(decode.url)["kvReservedBytes"] == 0
