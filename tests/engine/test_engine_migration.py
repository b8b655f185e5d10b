"""A stream survives its decode (issue 31 item 2), the engines' side: a prefill whose decode is
lost mid-stream moves the request to another decode of its group — re-prefilled with the output
so far once the KV was pulled, or the KV still held pulled by the new decode — and the caller's
stream goes on with exactly the tokens an unfaulted run gives, usage counted once; a request that
cannot move ends with the lost decode's error saying why; every slot, place and KV is given back
on every path (a move that fails, a caller gone mid-move). A stream re-offered by the gateway
(``resumeAt``) goes on where it stopped. Engines in this process on loopback; a decode is "lost"
by closing its server mid-stream (its connections drop, as a killed process's do)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from test_engine_exchanges import _body, _engine, _events, _free_port, _serving

from enginestub.engine import kvpull
from enginestub.engine.core import Engine
from enginestub.engine.server import build_app
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import (
    EngineError,
    GenerateRequest,
    error_event,
    sse_data,
    synthetic_token,
    token_event,
    token_seed,
)
from matrixserve.domain.gateway.reoffer import entrance_lost

OUT = 3000  # tokens per request: ~12 emulated ms each, 0.7 wall s at time scale 50


@contextlib.asynccontextmanager
async def _decode(name: str, *args: str) -> AsyncIterator[tuple[Engine, web.AppRunner]]:
    """Decode ``name`` served on a runner of its own (closing it mid-stream loses the decode)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ENGINE_INSTANCE", name)
        decode = _engine("--role", "decode", *args)
    await decode.start()
    runner = web.AppRunner(build_app(decode), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, decode.config.host, decode.config.port).start()
    try:
        yield decode, runner
    finally:
        await runner.cleanup()
        await decode.close()


def _address(engine: Engine) -> str:
    return f"{engine.config.host}:{engine.config.port}"


@contextlib.asynccontextmanager
async def _group(
    scale: str = "50", prefill_batch: int = 4, decode_batch: int = 8
) -> AsyncIterator[tuple[Engine, str, list[tuple[Engine, web.AppRunner]]]]:
    """One prefill forwarding to two decodes (``g-d-0`` first in its turn); its URL."""
    args = ("--time-scale", scale, "--max-batch", str(decode_batch))
    async with _decode("g-d-0", *args) as d0, _decode("g-d-1", *args) as d1:
        prefill = _engine(
            "--role", "prefill", "--time-scale", scale, "--max-batch", str(prefill_batch)
        )
        prefill.decode_peers = [_address(d0[0]), _address(d1[0])]
        prefill.decode_entries = [
            zl.MapEntry(instance=name, podIP=d.config.host, port=d.config.port, roceIps=[])
            for name, (d, _) in (("g-d-0", d0), ("g-d-1", d1))
        ]
        async with _serving(prefill) as url:
            yield prefill, url, [d0, d1]


def _first_turn(prefill: Engine) -> None:
    """The prefill's next request goes to ``d-0`` first (its round robin from the start)."""
    prefill.forwarder._turn = itertools.count()


def _tokens(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(e["index"], e["text"]) for e in events if e["type"] == "token"]


def _expected(prompt_tokens: int, out: int) -> list[tuple[int, str]]:
    seed = token_seed(prompt_tokens)
    return [(i, synthetic_token(seed, i)) for i in range(out)]


def _idle(engine: Engine) -> bool:
    health = engine.health()
    return bool(
        health["prefillSlots"]["used"] == 0
        and health["decodeBatch"]["admitted"] == 0
        and health["kvReservedBytes"] == 0
        and health["kvEgressFlows"] == 0
        and health["streams"] == 0
    )


async def _until(what: str, predicate: Any, bound: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while not predicate():
        assert loop.time() < deadline, f"{what}: not within {bound} s"
        await asyncio.sleep(0.005)


def _migrations(engine: Engine, outcome: str) -> float:
    value = engine.metrics.registry.get_sample_value(
        "matrixserve_engine_migrations_total", {"outcome": outcome}
    )
    return float(value or 0.0)


async def test_a_decode_lost_mid_stream_moves_the_request_and_its_text_is_an_unfaulted_runs() -> (
    None
):
    """The KV was pulled (the prefill's slot freed): the prefill re-prefills the prompt and the
    tokens sent, makes the next token, and forwards the rest to the other decode."""
    async with (
        _group() as (prefill, url, [(d0, runner0), (d1, _)]),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        body = _body("r", prompt=512, out=OUT)
        unfaulted = await _events(client, f"{url}/v1/generate", body)
        assert _tokens(unfaulted) == _expected(512, OUT)
        _first_turn(prefill)
        task = asyncio.create_task(_events(client, f"{url}/v1/generate", body))
        await _until("d-0 decoding it", lambda: bool(d0.batch.running))
        await _until("some tokens out", lambda: d0.batch.running[0].emitted >= 20)
        await runner0.cleanup()  # d-0 lost mid-stream
        events = await task
        assert _tokens(events) == _tokens(unfaulted)  # none twice, none missing
        done = events[-1]
        assert done["type"] == "done", done
        assert done["usage"] == {"promptTokens": 512, "completionTokens": OUT}
        assert done["instances"] == {"prefill": prefill.config.instance, "decode": "g-d-1"}
        assert done["migrations"] == 1
        assert _migrations(prefill, "reprefill") == 1
        stall = prefill.metrics.registry.get_sample_value(
            "matrixserve_engine_migration_stall_seconds_sum"
        )
        assert stall is not None
        print(f"\nstall after the decode's loss: {stall * 1000:.1f} emulated ms")
        assert stall > 0
        await _until("the prefill and d-1 idle", lambda: _idle(prefill) and _idle(d1), 1.0)


async def test_a_decode_lost_before_its_pull_ended_leaves_the_kv_for_the_next_to_pull() -> None:
    """P/D-Serve keeps the KV until it is pulled: a decode lost during its pull leaves it held,
    and the other decode pulls it (nothing prefilled again)."""
    # d-0 pulls 1000x slower: its pull of 2,048 tokens' KV lasts ~5 emulated s (0.5 wall s)
    async with (
        _group(scale="10") as (prefill, url, [(d0, runner0), (d1, _)]),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        body = _body("r", prompt=2048, out=8)
        unfaulted = await _events(client, f"{url}/v1/generate", body)
        d0.inject("slow", {"factor": 1000})
        _first_turn(prefill)
        task = asyncio.create_task(_events(client, f"{url}/v1/generate", body))
        await _until("d-0 pulling its KV", lambda: prefill.holdings.egress_flows == 1)
        assert d0.batch.places
        assert not d0.batch.running
        await runner0.cleanup()
        events = await task
        assert _tokens(events) == _tokens(unfaulted)
        assert events[-1]["type"] == "done", events[-1]
        assert events[-1]["migrations"] == 1
        assert (_migrations(prefill, "pull"), _migrations(prefill, "reprefill")) == (1, 0)
        await _until("the prefill and d-1 idle", lambda: _idle(prefill) and _idle(d1), 1.0)


async def test_a_request_with_nowhere_to_go_ends_with_the_lost_decodes_error_saying_why() -> None:
    async with (
        _group() as (prefill, url, [(d0, runner0), (_, runner1)]),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        await runner1.cleanup()  # d-1 gone first: nothing to move to
        prefill.decode_peers = [_address(d0)]
        task = asyncio.create_task(_events(client, f"{url}/v1/generate", _body("r", out=OUT)))
        await _until("d-0 decoding it", lambda: bool(d0.batch.running))
        await runner0.cleanup()
        events = await task
    last = events[-1]
    assert (last["type"], last["code"]) == ("error", "decode_failed"), last
    assert "not moved to another decode: no other decode is open" in last["message"]
    assert last["instances"] == {"prefill": prefill.config.instance, "decode": "g-d-0"}
    assert _migrations(prefill, "no_decode") == 1
    assert _idle(prefill)


async def test_no_slot_for_the_re_prefill_within_the_bound_ends_it_and_frees_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill's one slot is held by a request waiting for the decodes (both full): the
    request whose decode is lost waits the KV-pull wait bound for it, then ends; what it held
    is given back."""
    monkeypatch.setattr(kvpull, "WAIT_FLOOR_WALL_SECONDS", 0.3)
    async with (
        _group(scale="5", prefill_batch=1, decode_batch=1) as (prefill, url, [(d0, r0), (d1, _)]),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        _first_turn(prefill)
        lost = asyncio.create_task(_events(client, f"{url}/v1/generate", _body("a", out=8000)))
        await _until("a on d-0", lambda: bool(d0.batch.running) and prefill.prefill.slots == 0)
        other = asyncio.create_task(_events(client, f"{url}/v1/generate", _body("b", out=8000)))
        await _until("b on d-1", lambda: bool(d1.batch.running) and prefill.prefill.slots == 0)
        waits = asyncio.create_task(_events(client, f"{url}/v1/generate", _body("c", out=4)))
        await _until("c holding the slot", lambda: prefill.prefill.slots == 1)
        await r0.cleanup()  # a's wait for a slot: seen by its outcome (no_slot), not polled
        events = await lost
        last = events[-1]
        assert (last["type"], last["code"]) == ("error", "decode_failed"), last
        assert "no prefill slot for its re-prefill" in last["message"]
        assert _migrations(prefill, "no_slot") == 1
        assert prefill.prefill.returning == 0
        assert prefill.prefill.slots == 1  # c's, still
        other.cancel()
        waits.cancel()
        await _until("the prefill and d-1 idle", lambda: _idle(prefill) and _idle(d1), 1.0)


async def test_more_streams_lost_on_one_decode_than_the_prefill_has_slots_all_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5 streams on d-0, a prefill of 2 slots: all 5 take a slot back in turn as slots free
    (each held only until d-1 pulls its KV), none ends for want of one."""
    monkeypatch.setattr(kvpull, "WAIT_FLOOR_WALL_SECONDS", 1.5)  # fails fast without the fix
    async with (
        _group(prefill_batch=2) as (prefill, url, [(d0, runner0), (d1, _)]),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        prefill.decode_peers = [_address(d0)]  # every stream on d-0
        tasks = []
        for i in range(5):
            body = _body(f"r{i}", prompt=512 + i, out=OUT)
            tasks.append(asyncio.create_task(_events(client, f"{url}/v1/generate", body)))
            await _until(f"r{i} on d-0", lambda n=i + 1: len(d0.batch.running) == n)
        prefill.decode_peers = [_address(d0), _address(d1)]
        await runner0.cleanup()  # d-0 lost with 5 streams
        streams = await asyncio.gather(*tasks)
        for i, events in enumerate(streams):
            assert events[-1]["type"] == "done", events[-1]
            assert events[-1]["migrations"] == 1
            assert _tokens(events) == _expected(512 + i, OUT)
        assert (_migrations(prefill, "reprefill"), _migrations(prefill, "no_slot")) == (5, 0)
        assert prefill.prefill.returning == 0
        await _until("the prefill and d-1 idle", lambda: _idle(prefill) and _idle(d1), 1.0)


async def test_a_re_prefill_that_can_never_fit_is_refused_at_once_not_after_the_bound() -> None:
    engine = _engine("--role", "prefill", "--time-scale", "50")
    capacity = engine.config.kv_capacity_bytes
    huge = GenerateRequest("r", int(capacity / engine.kv.bytes_for(1000) * 1000), 3, resume_at=2)
    assert engine.kv.bytes_for(huge.context_tokens) > capacity
    async with asyncio.timeout(0.5):  # the bound is 5 s of wall time
        with pytest.raises(EngineError) as refused:
            await engine.prefill.retake(huge, bound=5.0)
    assert refused.value.status == 413
    assert engine.prefill.returning == 0


def test_a_decodes_error_is_named_even_when_the_decode_meta_no_longer_lists_it() -> None:
    """Named by its host:port, it is still a decode's, not a lost entrance's, to the gateway."""
    engine = _engine("--role", "prefill")
    event = engine.forwarder._named(error_event("device_fault", "die down"), "10.0.0.9:8000")
    assert event["instances"]["decode"] == "10.0.0.9:8000"
    assert not entrance_lost(event)


async def test_a_decode_that_does_not_go_on_where_the_request_is_counts_as_lost() -> None:
    """A decode from before resumeAt makes the whole output again from index 0: its tokens are
    not relayed (the caller would get more than its maxTokens); the request moves on."""

    async def old_decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["maxTokens"]):
            await response.write(sse_data(token_event(i, "old ", 0.0)))
        return response

    app = web.Application()
    app.router.add_post("/v1/decode", old_decode)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with (
            _group() as (prefill, url, [_, (d1, _)]),
            httpx.AsyncClient(trust_env=False, timeout=60) as client,
        ):
            prefill.decode_peers = [f"127.0.0.1:{port}", _address(d1)]
            _first_turn(prefill)
            events = await _events(client, f"{url}/v1/generate", _body("r", out=40))
            assert _tokens(events) == _expected(512, 40)
            assert events[-1]["type"] == "done", events[-1]
            assert events[-1]["migrations"] == 1
            assert events[-1]["usage"]["completionTokens"] == 40
    finally:
        await runner.cleanup()


async def test_a_caller_gone_mid_move_takes_nothing_with_it() -> None:
    """The caller leaves while its request is re-prefilled (a slow prefill): the re-prefill's
    slot and KV are given back at once, and no decode takes the request."""
    async with (
        _group(scale="5") as (prefill, url, [(d0, runner0), (d1, _)]),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        _first_turn(prefill)
        task = asyncio.create_task(
            _events(client, f"{url}/v1/generate", _body("r", prompt=4000, out=8000))
        )
        await _until("d-0 decoding it", lambda: bool(d0.batch.running))
        prefill.inject("slow", {"factor": 1000})  # its re-prefill: ~110 emulated s
        await runner0.cleanup()
        await _until(
            "its re-prefill", lambda: prefill.prefill.slots == 1 and prefill.compute.active
        )
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _until("the prefill idle", lambda: _idle(prefill), 1.0)
        assert _idle(d1)
        assert _migrations(prefill, "reprefill") == 1


@pytest.mark.parametrize("role", ["prefill", "colocated"])
async def test_a_stream_resumed_at_a_token_goes_on_from_there(role: str) -> None:
    """What the gateway sends when an entrance was lost mid-stream: the new entrance prefills
    the prompt and the output the client has, and its tokens go on from ``resumeAt``."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        if role == "colocated":
            engine = _engine("--role", "colocated", "--time-scale", "50")
            async with _serving(engine) as url:
                whole = await _events(client, f"{url}/v1/generate", _body("w", out=40))
                resumed = await _events(
                    client, f"{url}/v1/generate", _body("r", out=40, resumeAt=17)
                )
        else:
            async with _group() as (engine, url, _):
                whole = await _events(client, f"{url}/v1/generate", _body("w", out=40))
                resumed = await _events(
                    client, f"{url}/v1/generate", _body("r", out=40, resumeAt=17)
                )
    # a resumed stream's first token there is no TTFT, its re-prefill no prompt's prefill
    ttfts = engine.metrics.registry.get_sample_value("matrixserve_engine_ttft_seconds_count")
    assert (ttfts, engine.metrics.load.prefilled) == (1, 1)
    assert _tokens(whole) == _expected(512, 40)
    assert _tokens(resumed) == _tokens(whole)[17:]
    assert resumed[-1]["usage"] == {"promptTokens": 512, "completionTokens": 40}
