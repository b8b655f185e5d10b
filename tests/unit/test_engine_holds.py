"""Issue 16 findings 1 and 9 inside one engine (no HTTP): what a request holds (a prefill slot, a
decode place, KV) is given back exactly once on every path; a hold kept without progress past
the bound makes the engine unready; the metrics read the engine's state at each scrape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig, parse
from enginestub.engine.core import STUCK_BOUNDS, Engine
from enginestub.engine.kvpull import WAIT_FLOOR_WALL_SECONDS, kv_wait_bound
from matrixserve.api.engine_protocol import EngineError, Event, GenerateRequest, PrefillRef


class ManualClock(Clock):
    """Emulated time that moves only when the test says."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self.t = 0.0

    def now(self) -> float:
        return self.t


def _config(*args: str) -> EngineConfig:
    return parse(["--model", "llama3-8b", "--dies", "0,1", "--time-scale", "1000", *args])


def _engine(*args: str, clock: Clock | None = None) -> Engine:
    engine = Engine(_config(*args), clock=clock)
    engine.loaded = True  # the load itself is not what these tests are about
    return engine


def _sample(engine: Engine, name: str, **labels: str) -> float | None:
    return engine.metrics.registry.get_sample_value(name, labels)


def _request(rid: str, prompt: int = 64, out: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, prompt, out)


async def _drain(events: AsyncGenerator[Event, None]) -> list[Event]:
    return [event async for event in events]


# --------------------------------------------------------------------------- finding 1


def test_a_ticket_whose_exchange_never_started_gives_its_slot_and_kv_back() -> None:
    """The leak of the issue: the slot was taken, the stream that would free it never ran."""
    engine = _engine("--role", "prefill", "--max-batch", "2")
    for i in range(5):  # more than the slots: a leak would refuse the third
        with engine.admit_prefill(_request(f"r{i}")):
            assert engine.prefill.slots == 1
            assert engine.kv.reserved > 0
    assert engine.prefill.slots == 0
    assert engine.kv.reserved == 0


def test_a_release_given_twice_frees_once() -> None:
    engine = _engine("--role", "prefill", "--max-batch", "2")
    first = engine.admit_prefill(_request("a"))
    second = engine.admit_prefill(_request("b"))
    reserved_both = engine.kv.reserved
    first.release()
    first.release()
    assert engine.prefill.slots == 1
    assert engine.kv.reserved == pytest.approx(reserved_both / 2)
    second.release()
    assert (engine.prefill.slots, engine.kv.reserved) == (0, 0)


def test_a_queued_ticket_left_before_its_turn_leaves_the_queue() -> None:
    engine = _engine("--role", "prefill", "--admission", "queue")
    with engine.admit_prefill(_request("q")) as ticket:
        assert ticket.queued
        assert engine.prefill.queue == 1
    assert engine.prefill.queue == 0


async def test_a_decode_place_counts_while_its_kv_is_pulled_and_is_given_back_on_failure() -> None:
    engine = _engine("--role", "decode", "--max-batch", "2")
    first = engine.admit_decode(_request("a"))
    second = engine.admit_decode(_request("b"))
    # Before this fix a decode counted only its running batch: places pulling their KV did not
    # count, so a third request was accepted beyond the batch.
    with pytest.raises(EngineError) as full:
        engine.admit_decode(_request("c"))
    assert full.value.status == 429
    # A pull that fails (no prefill there) ends the stream; the exchange's hold frees it.
    nowhere = PrefillRef("127.0.0.1:9", "p", ())
    with first:
        events = await _drain(engine.decode(first, _request("a"), nowhere))
    assert events[-1]["type"] == "error"
    assert len(engine.batch.places) == 1
    second.release()
    assert (len(engine.batch.places), engine.kv.reserved) == (0, 0)
    await engine.http.aclose()


async def test_a_stream_closed_mid_decode_leaves_the_batch_at_once() -> None:
    engine = _engine("--role", "colocated")
    await engine.start()
    try:
        with engine.admit_prefill(_request("long", out=8000)) as ticket:
            events = engine.generate(ticket)
            async for event in events:
                if event["type"] == "token" and event["index"] == 3:
                    break
            assert len(engine.batch.running) + len(engine.batch.joining) == 1
            await events.aclose()  # what the server does when its caller goes
        assert len(engine.batch.running) + len(engine.batch.joining) == 0
        assert (len(engine.batch.places), engine.prefill.slots, engine.kv.reserved) == (0, 0, 0)
    finally:
        await engine.close()


def test_the_kv_wait_bound_is_the_transfer_of_a_full_hbm_or_the_wall_floor() -> None:
    slow_link = _config("--time-scale", "0.001", "--kv-plane", "RoCE")
    bound = kv_wait_bound(slow_link, 1.0)
    # 2 dies of RoCE at 25 GB/s: twice the ~100 GB of KV the instance can hold is about 4 s
    assert bound == pytest.approx(2 * slow_link.kv_capacity_bytes / (2 * 25e9), rel=1e-6)
    assert kv_wait_bound(slow_link, 10.0) == pytest.approx(10 * bound)  # a slow fault
    fast = _config("--time-scale", "1000")
    assert kv_wait_bound(fast, 1.0) == WAIT_FLOOR_WALL_SECONDS * 1000


def test_a_slot_held_without_progress_past_the_bound_makes_the_engine_unready() -> None:
    clock = ManualClock()
    engine = _engine("--role", "prefill", clock=clock)
    stuck_after = STUCK_BOUNDS * kv_wait_bound(engine.config, 1.0)
    assert engine.stuck_bound() == stuck_after
    ticket = engine.admit_prefill(_request("leaked"))  # an exchange that never runs
    clock.t = stuck_after  # not past it yet
    assert engine.ready
    assert engine.health()["stuckSlots"] == 0
    clock.t = stuck_after + 0.001
    assert not engine.ready
    assert engine.health()["stuckSlots"] == 1
    ticket.release()
    assert engine.ready
    assert engine.health()["stuckSlots"] == 0


def test_an_engine_with_stuck_slots_reports_itself_degraded_in_zookeeper() -> None:
    """The operator learns it too (ZooKeeper health, not only the pod's readiness): a prefill
    whose slots nothing will free closes its entrance, and serves again once they are freed."""
    from enginestub.engine.resident import Resident
    from matrixserve.api import zk_layout as zl

    clock = ManualClock()
    engine = _engine(
        "--role", "prefill", "--group", "ns/g", "--zookeeper", "127.0.0.1:1", clock=clock
    )
    resident = Resident(engine)  # never started: no connection is made
    resident.role = zl.Role.PREFILL
    ticket = engine.admit_prefill(_request("leaked"))
    health = resident._health()
    assert health is not None
    assert health.state is zl.HealthState.SERVING
    clock.t = engine.stuck_bound() + 0.001
    health = resident._health()
    assert health is not None
    assert health.state is zl.HealthState.DEGRADED
    assert "1 request(s) held without progress" in health.message
    ticket.release()
    health = resident._health()
    assert health is not None
    assert health.state is zl.HealthState.SERVING


def test_progress_and_work_keep_a_slot_from_counting_as_stuck() -> None:
    clock = ManualClock()
    engine = _engine("--role", "prefill", clock=clock)
    bound = engine.stuck_bound()
    ticket = engine.admit_prefill(_request("busy"))
    assert ticket.hold is not None
    ticket.hold.working = True  # its prompt in the prefill compute: it advances on its own
    clock.t = 10 * bound
    assert engine.ready
    ticket.hold.working = False
    ticket.progressed()  # e.g. a decode answered
    clock.t = 10.5 * bound
    assert engine.ready
    clock.t = 11.5 * bound
    assert not engine.ready
    ticket.release()


# --------------------------------------------------------------------------- finding 9


def test_the_info_gauge_follows_the_role_with_one_series() -> None:
    engine = _engine("--role", "auto")
    assert _sample(engine, "matrixserve_engine_info", role="auto") == 1
    engine.role = "prefill"  # the resident process, from the RoCE map
    assert _sample(engine, "matrixserve_engine_info", role="prefill") == 1
    assert _sample(engine, "matrixserve_engine_info", role="auto") is None
    series = [
        s
        for m in engine.metrics.registry.collect()
        if m.name == "matrixserve_engine_info"
        for s in m.samples
    ]
    assert len(series) == 1


async def test_the_gauges_read_zero_once_the_batch_and_slots_empty() -> None:
    engine = _engine("--role", "colocated", "--time-scale", "5")  # steps slower than the reader
    await engine.start()
    try:
        weights = engine.config.weights_bytes
        seen_batch: list[float | None] = []

        async def generate(rid: str) -> list[Event]:
            with engine.admit_prefill(_request(rid, out=40)) as ticket:
                events = []
                async for event in engine.generate(ticket):
                    seen_batch.append(_sample(engine, "matrixserve_engine_decode_batch_size"))
                    events.append(event)
                return events

        results = await asyncio.gather(*(generate(f"r{i}") for i in range(3)))
        assert all(events[-1]["type"] == "done" for events in results)
        assert max(v or 0 for v in seen_batch) >= 2  # the gauge did show the batch
        assert _sample(engine, "matrixserve_engine_decode_batch_size") == 0
        assert _sample(engine, "matrixserve_engine_prefill_slots_used") == 0
        assert _sample(engine, "matrixserve_engine_hbm_used_bytes") == weights
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("variable", "flag"),
    [
        ("ENGINE_PORT", "--port"),
        ("ENGINE_TP", "--tp"),
        ("ENGINE_MAX_BATCH", "--max-batch"),
        ("ENGINE_LINK_TIMEOUT", "--link-timeout"),
        ("ENGINE_HEALTH_INTERVAL", "--health-interval"),
        ("ENGINE_TPOT_SLO_MS", "--tpot-slo-ms"),
    ],
)
def test_a_bad_number_in_the_environment_exits_2_naming_its_flag(
    variable: str, flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 16 (bad input gets a clear error): it crashed with a traceback before argparse."""
    monkeypatch.setenv(variable, "abc")
    with pytest.raises(SystemExit) as exited:
        _config()
    assert exited.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_numbers_from_the_environment_still_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_PORT", "8123")
    monkeypatch.setenv("ENGINE_MAX_BATCH", "3")
    config = _config()
    assert (config.port, config.max_batch) == (8123, 3)


# --------------------------------------------------------------------------- issue 31: TPOT SLO
def test_a_decode_admits_only_while_its_modelled_step_meets_the_tpot_slo() -> None:
    """``slo.tpotMilliseconds`` was accepted and ignored. CloudMatrix-Infer §5.2 chooses the
    decode batch to meet the TPOT SLO: with an SLO, a decode refuses (429, saying why) a request
    whose batch would step slower than the SLO, never the first of an empty batch; without one,
    only the batch size limits."""
    from enginestub import timing

    free = _engine("--role", "decode", "--max-batch", "64")
    model, shape = free.config.model, free.config.shape
    tokens = 2048 + 256

    def step_ms(n: int) -> float:
        return timing.tpot(model, shape, n / shape.npus, tokens) * 1000

    fits = next(n for n in range(1, 64) if step_ms(n + 1) > step_ms(1) * 1.5)
    slo = (step_ms(fits) + step_ms(fits + 1)) / 2  # between a batch of `fits` and one more
    engine = _engine("--role", "decode", "--max-batch", "64", "--tpot-slo-ms", f"{slo}")
    holds = [engine.batch.admit(tokens) for _ in range(fits)]
    with pytest.raises(EngineError) as refused:
        engine.batch.admit(tokens)
    assert refused.value.status == 429
    assert f"decode TPOT SLO: a batch of {fits + 1} would step in" in refused.value.message
    assert len(engine.batch.places) == fits  # the refused one took nothing
    holds.pop().release()
    holds.append(engine.batch.admit(tokens))  # a place freed: room again
    # a request that alone would miss the SLO is still served, one at a time
    lone = _engine("--role", "decode", "--max-batch", "64", "--tpot-slo-ms", "0.001")
    first = lone.batch.admit(tokens)
    with pytest.raises(EngineError):
        lone.batch.admit(tokens)
    first.release()
    # no SLO: the batch size alone
    assert len([free.batch.admit(tokens) for _ in range(fits + 1)]) == fits + 1
    for hold in holds:
        hold.release()
