"""Issue 17, the engine's detection tiers, on engine processes in a P/D group over a private
ZooKeeper (the test plays the operator's side: RoCE map, init order, decode meta, removals):

1. a device fault makes the health ``Faulty`` with the typed fault (die, npu, hbm), written at
   once (within the device status poll and one write), the report kept;
2. a hung serving loop stops the beat, and the watchdog makes the health ``Faulty`` (hang)
   within the hang bound and one write; liveness keeps answering, readiness does not; the beat
   and ``Serving`` come back with the loop;
3. a prefill probes its decodes' sub-links: a link down is ``Blocked`` within one probe interval
   and the probe timeout (``downAt`` the decode whose device status says so), a full decode
   ``Delayed``; the health lists them and stays ``Serving`` (one link is not a whole instance
   out), and no request is sent to a decode with a blocked sub-link;
4. a logically removed instance closes its entrance side and ends every stream it serves with
   ``instance_removed``, giving back every slot, place and KV.

Each measured latency is printed and asserted against the bound docs/engine-stub.md states.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.conftest import Group
from enginestub import calibration as cal
from enginestub.engine.faults import STATUS_POLL_SECONDS
from enginestub.engine.heartbeat import RECHECK_WALL_SECONDS
from enginestub.node import devicestatus
from enginestub.node.topology import SuperPodSpec, TopologySpec, build
from matrixserve.api import zk_layout as zl

# No TE-Pre-Load (issue 18): at time scale 1 its 20 emulated s would be 20 wall s per engine, and
# detection is measured once serving (tests/engine/test_warm_fork.py tests the start-up phases).
MODEL = (
    *("--model", "llama3-8b", "--time-scale", "1", "--load-source", "NPUForkUB"),
    *("--pre-load-seconds", "0"),
)
# One health write to ZooKeeper on loopback, on a loaded 2-core machine: a few ms when idle; the
# bound leaves room for the pauses other tests' processes cause.
WRITE_BOUND = 0.5
PROBE_INTERVAL = 0.5  # emulated s, at time scale 1 (the wall floor)


def _until(what: str, check: Callable[[], Any], bound: float, every: float = 0.01) -> float:
    """Wall seconds until ``check()`` is truthy; fails past ``bound``."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < bound, f"{what}: not within {bound:.2f} s"
        time.sleep(every)
    return time.monotonic() - began


def _info(engine: Any) -> dict[str, Any]:
    return dict(httpx.get(f"{engine.url}/v1/info", timeout=5, trust_env=False).json()["health"])


def _fault(engine: Any, kind: str, heal: bool = False, **params: Any) -> None:
    method = "DELETE" if heal else "POST"
    response = httpx.request(
        method, f"{engine.url}/v1/faults", json={"kind": kind, **params}, trust_env=False
    )
    assert response.status_code == (200 if heal else 201), response.text


def _state(group: Group, name: str) -> zl.HealthState | None:
    health = group.health(name)
    return health.state if health is not None else None


# ------------------------------------------------------------------ 1. Faulty, not silent


def test_a_device_fault_makes_the_health_faulty_at_once_and_keeps_the_report(
    group: Group, start_engine: Any, tmp_path: Path, stream: Any
) -> None:
    server = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=1)]))[0]
    status = devicestatus.DeviceStatus(server)
    device_file = tmp_path / "device-status.json"
    devicestatus.write_atomically(device_file, status.render("t0"))
    env = group.env(
        "198.19.1.3,198.19.1.4",
        MATRIXSERVE_DEVICE_STATUS_FILE=str(device_file),
        MATRIXSERVE_DIES="2,3",  # NPU 1 of the node: both its dies
    )
    engine = start_engine("p-die", "--role", "prefill", *MODEL, env=env, wait_ready=False)
    group.form(["p-die"], [])

    def faults_after(fault: devicestatus.Fault, generation: str) -> tuple[float, zl.Health]:
        status.inject(fault)
        devicestatus.write_atomically(device_file, status.render(generation))
        written = time.time()
        took = _until(
            f"health Faulty after {fault.kind} on die {fault.die}",
            lambda: (
                (h := group.health("p-die")) is not None
                and h.state is zl.HealthState.FAULTY
                and h.faults[0].since >= written - 0.05
            ),
            bound=STATUS_POLL_SECONDS + WRITE_BOUND,
        )
        health = group.health("p-die")
        assert health is not None
        return took, health

    took, health = faults_after(devicestatus.Fault(devicestatus.FaultKind.DIE_DOWN, 3, "t1"), "t1")
    bound = STATUS_POLL_SECONDS + WRITE_BOUND
    print(f"\ndie fault in the health after {took * 1000:.0f} ms (bound {bound:g} s)")
    (fault,) = health.faults
    assert (fault.kind, fault.dies) == (zl.EngineFaultKind.DIE, [3])
    assert "DIE_DOWN" in fault.detail
    assert "DIE_DOWN" in health.message
    assert group.report_kept("p-die"), "the report stays: the operator reads who is faulty"
    refused, body = stream(f"{engine.url}/v1/generate", {"requestId": "r", "promptTokens": 8})
    assert refused == 503
    assert body[0]["error"]["code"] == "device_fault"
    assert httpx.get(f"{engine.url}/readyz", trust_env=False).status_code == 503

    # The NPU's other die too: one fault of kind npu, first seen with the first die.
    status.inject(devicestatus.Fault(devicestatus.FaultKind.DIE_DOWN, 2, "t2"))
    devicestatus.write_atomically(device_file, status.render("t2"))
    _until(
        "an npu fault",
        lambda: (
            [f.kind for f in (group.health("p-die") or health).faults] == [zl.EngineFaultKind.NPU]
        ),
        bound=STATUS_POLL_SECONDS + WRITE_BOUND,
    )
    npu = (group.health("p-die") or health).faults[0]
    assert npu.dies == [2, 3]
    assert npu.since == pytest.approx(fault.since)

    # Healed: Serving again, no fault; then an HBM error on die 2.
    status.heal_all()
    devicestatus.write_atomically(device_file, status.render("t3"))
    _until(
        "Serving after healing",
        lambda: _state(group, "p-die") is zl.HealthState.SERVING,
        bound=STATUS_POLL_SECONDS + WRITE_BOUND,
    )
    healed = group.health("p-die")
    assert healed is not None
    assert healed.faults == []
    _, health = faults_after(devicestatus.Fault(devicestatus.FaultKind.HBM_ERROR, 2, "t4"), "t4")
    assert [(f.kind, f.dies) for f in health.faults] == [(zl.EngineFaultKind.HBM, [2])]


# ------------------------------------------------------------------ 2. a heartbeat from the loop


def test_a_hung_serving_loop_is_faulty_within_the_hang_bound_and_serving_again_when_it_runs(
    group: Group, start_engine: Any, stream: Any
) -> None:
    started_before = time.time()
    engine = start_engine(
        "p-hang",
        "--role",
        "prefill",
        *MODEL,
        env=group.env("198.19.1.1,198.19.1.2"),
        wait_ready=False,
    )
    group.form(["p-hang"], [])
    bound = _info(engine)["hangAfterSeconds"]  # emulated = wall at time scale 1
    assert bound == cal.LOOP_BEAT_INTERVAL_SECONDS * cal.HANG_MISSED_BEATS
    before = group.health("p-hang")
    assert before is not None
    assert before.loop_beat > 0
    # what a cold replacement costs, as the recovery planner learns it: process start -> Serving
    assert 0 < before.ready_after < time.time() - started_before
    assert 0 < before.gathered_after <= before.ready_after  # the map came before its load

    _fault(engine, "hang")
    hung_at = time.time()
    took = _until(
        "health Faulty (hang)",
        lambda: (
            (h := group.health("p-hang")) is not None
            and [f.kind for f in h.faults] == [zl.EngineFaultKind.HANG]
        ),
        bound=bound + RECHECK_WALL_SECONDS + WRITE_BOUND,
    )
    print(f"\nhang in the health after {took:.2f} s (bound {bound:g} s + one write)")
    # The last beat came before the hang; nothing declared it early.
    assert took >= bound - cal.LOOP_BEAT_INTERVAL_SECONDS, "declared before the bound"
    hung = group.health("p-hang")
    assert hung is not None
    assert hung.state is zl.HealthState.FAULTY
    assert hung.loop_beat <= hung_at + 0.05
    assert hung.ts > hung.loop_beat + bound - cal.LOOP_BEAT_INTERVAL_SECONDS
    # the hang dates from the last beat (detection latency counts the bound it waited)
    assert hung.faults[0].since == pytest.approx(hung.loop_beat)
    # Alive (liveness answers), not ready, and new requests get a clear 503.
    assert httpx.get(f"{engine.url}/healthz", timeout=2, trust_env=False).text == "ok"
    assert httpx.get(f"{engine.url}/readyz", timeout=2, trust_env=False).status_code == 503
    refused, body = stream(f"{engine.url}/v1/generate", {"requestId": "h", "promptTokens": 8})
    assert refused == 503
    assert body[0]["error"]["code"] == "engine_hung"

    healed_at = time.time()
    _fault(engine, "hang", heal=True)
    back = _until(
        "Serving again once the loop runs",
        lambda: _state(group, "p-hang") is zl.HealthState.SERVING,
        bound=WRITE_BOUND,
    )
    print(f"serving again {back * 1000:.0f} ms after the loop ran again")
    again = group.health("p-hang")
    assert again is not None
    assert again.faults == []
    assert again.loop_beat >= healed_at
    assert httpx.get(f"{engine.url}/readyz", timeout=2, trust_env=False).status_code == 200
    done, events = stream(
        f"{engine.url}/v1/generate", {"requestId": "h2", "promptTokens": 8, "maxTokens": 1}
    )
    assert (done, events[-1]["type"]) == (200, "done")


# ------------------------------------------------------------------ 3. link probing


def test_a_prefill_probes_its_sub_links_blocked_and_delayed_and_sends_nothing_over_a_blocked_one(
    group: Group, start_engine: Any, stream: Any
) -> None:
    probing = ("--link-probe-interval", str(PROBE_INTERVAL))
    decodes = {
        "d-a": start_engine(
            "d-a",
            "--role",
            "decode",
            *MODEL,
            env=group.env("198.19.2.1,198.19.2.2"),
            wait_ready=False,
        ),
        "d-b": start_engine(
            "d-b",
            "--role",
            "decode",
            *MODEL,
            "--max-batch",
            "1",
            env=group.env("198.19.3.1,198.19.3.2"),
            wait_ready=False,
        ),
    }
    prefill = start_engine(
        "p-probe",
        "--role",
        "prefill",
        *MODEL,
        *probing,
        env=group.env("198.19.1.1,198.19.1.2"),
        wait_ready=False,
    )
    group.form(["p-probe"], list(decodes))
    assert _info(prefill)["links"] == []
    started, rounds = time.monotonic(), _info(prefill)["linkProbeRounds"]

    # Sub-link 1 down on d-a's side (its device status says so): Blocked.
    _fault(decodes["d-a"], "link-down", peerRoceIp="198.19.1.2")
    down_at = time.time()
    bound = PROBE_INTERVAL + cal.LINK_PROBE_TIMEOUT_WALL_SECONDS + WRITE_BOUND
    took = _until(
        "d-a#1 Blocked in the prefill's health",
        lambda: (
            (h := group.health("p-probe")) is not None
            and [(p.peer, p.device, p.state) for p in h.links] == [("d-a", 1, zl.LinkState.BLOCKED)]
        ),
        bound=bound,
    )
    print(f"\nblocked sub-link in the health after {took * 1000:.0f} ms (bound {bound:g} s)")
    health = group.health("p-probe")
    assert health is not None
    assert health.state is zl.HealthState.SERVING
    (blocked,) = health.links
    assert blocked.peer_roce_ip == "198.19.2.2"
    assert blocked.down_at == "d-a"  # its device status says so: a port down, not a timeout
    assert blocked.since >= down_at - 0.05
    assert "d-a#1" in health.message

    # Nothing goes to d-a while a sub-link to it is blocked: every request decodes on d-b.
    for i in range(4):
        status, events = stream(
            f"{prefill.url}/v1/generate", {"requestId": f"b{i}", "promptTokens": 64, "maxTokens": 2}
        )
        assert (status, events[-1]["type"]) == (200, "done"), events[-1]
        assert events[-1]["instances"]["decode"] == "d-b"

    # d-b's one place taken by a long request: its KV ingress is backed up, the probe Delayed.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(
            stream,
            f"{prefill.url}/v1/generate",
            {"requestId": "long", "promptTokens": 64, "maxTokens": 400},
            60,
        )
        _until(
            "d-b Delayed",
            lambda: (
                ("d-b", zl.LinkState.DELAYED)
                in {(p.peer, p.state) for p in (group.health("p-probe") or health).links}
            ),
            bound=bound + 2.0,  # the request reaching d-b's batch first
        )
        delayed = [p for p in (group.health("p-probe") or health).links if p.peer == "d-b"]
        assert {p.device for p in delayed} == {0, 1}
        # The link healed: d-a's entries go at the next round, d-b's stay while it is full.
        _fault(decodes["d-a"], "link-down", heal=True, peerRoceIp="198.19.1.2")
        _until(
            "d-a healthy again",
            lambda: all(p.peer != "d-a" for p in (group.health("p-probe") or health).links),
            bound=bound,
        )
        assert not long.done()
        status, events = stream(
            f"{prefill.url}/v1/generate", {"requestId": "a", "promptTokens": 64, "maxTokens": 2}
        )
        assert events[-1]["instances"]["decode"] == "d-a", "d-b is full: d-a again"
        assert long.result()[1][-1]["type"] == "done"
    _until(
        "every sub-link healthy",
        lambda: (h := group.health("p-probe")) is not None and h.links == [],
        bound=bound,
    )
    # Cheap: one round (one request to each decode) per interval, not more.
    elapsed = time.monotonic() - started
    made = _info(prefill)["linkProbeRounds"] - rounds
    assert made <= elapsed / PROBE_INTERVAL + 2, (made, elapsed)
    # A port down on the prefill's own side is known without a probe: said at once, not at
    # the next round, down at the prefill.
    _fault(prefill, "link-down", peerRoceIp="198.19.3.1")
    own = _until(
        "d-b#0 Blocked, down at the prefill",
        lambda: (
            [(p.peer, p.device, p.down_at) for p in (group.health("p-probe") or health).links]
            == [("d-b", 0, "p-probe")]
        ),
        bound=WRITE_BOUND,
    )
    print(f"a port down on our side in the health after {own * 1000:.0f} ms")
    _fault(prefill, "link-down", heal=True, peerRoceIp="198.19.3.1")


# ------------------------------------------------------------------ 4. no zombie streams


def test_a_removed_instance_ends_its_streams_with_a_clear_error_and_refuses_new_ones(
    group: Group, start_engine: Any, stream: Any
) -> None:
    engines = group.start(
        start_engine,
        MODEL,
        ("p-1", "prefill", "198.19.1.1,198.19.1.2"),
        ("p-2", "prefill", "198.19.4.1,198.19.4.2"),
        ("d-1", "decode", "198.19.2.1,198.19.2.2"),
    )
    group.form(["p-1", "p-2"], ["d-1"])
    url = {name: f"{e.url}/v1/generate" for name, e in engines.items()}

    def idle(name: str) -> bool:
        health = _info(engines[name])
        return bool(
            health["prefillSlots"]["used"] == 0
            and health["decodeBatch"]["admitted"] == 0
            and health["kvReservedBytes"] == 0
            and health["kvEgressFlows"] == 0
            and health["streams"] == 0
        )

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        decoding = pool.submit(
            stream, url["p-1"], {"requestId": "dec", "promptTokens": 64, "maxTokens": 5000}, 60
        )
        _until(
            "a stream decoding on d-1",
            lambda: _info(engines["d-1"])["decodeBatch"]["running"] == 1,
            bound=10,
        )
        prefilling = pool.submit(
            stream, url["p-1"], {"requestId": "pre", "promptTokens": 32000, "maxTokens": 4}, 60
        )
        _until(
            "a prompt in prefill on p-1",
            lambda: _info(engines["p-1"])["prefillSlots"]["used"] == 1,
            bound=10,
        )
        group.remove("p-1")
        removed_at = time.monotonic()
        ended = [f.result(timeout=10)[1] for f in (decoding, prefilling)]
    took = time.monotonic() - removed_at
    print(f"\np-1's two streams ended {took * 1000:.0f} ms after its removal")
    for events in ended:
        assert events[-1]["type"] == "error"
        assert events[-1]["code"] == "instance_removed"
        assert "p-1" in events[-1]["message"]
    assert [e["type"] for e in ended[0][:3]] == ["token"] * 3, "it was decoding"
    assert took < 2.0
    _until("p-1 and d-1 idle, every hold given back", lambda: idle("p-1") and idle("d-1"), bound=2)
    refused, body = stream(url["p-1"], {"requestId": "new", "promptTokens": 8})
    assert refused == 503
    assert body[0]["error"]["code"] == "instance_removed"
    assert httpx.get(f"{engines['p-1'].url}/readyz", trust_env=False).status_code == 503

    # A decode removed: the stream it decodes (through p-2) ends as clearly; p-2 forwards no more.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        relayed = pool.submit(
            stream, url["p-2"], {"requestId": "rel", "promptTokens": 64, "maxTokens": 5000}, 60
        )
        _until(
            "a stream decoding on d-1",
            lambda: _info(engines["d-1"])["decodeBatch"]["running"] == 1,
            bound=10,
        )
        group.remove("d-1")
        events = relayed.result(timeout=10)[1]
    assert events[-1]["type"] == "error"
    assert events[-1]["code"] == "instance_removed"
    assert "d-1" in events[-1]["message"]
    _until("p-2 and d-1 idle", lambda: idle("p-2") and idle("d-1"), bound=2)
    direct = httpx.post(
        f"{engines['d-1'].url}/v1/decode",
        json={"requestId": "x", "promptTokens": 8, "prefill": {"address": engines["p-2"].address}},
        trust_env=False,
    )
    assert direct.status_code == 503
    assert direct.json()["error"]["code"] == "instance_removed"
    # ... and, its only decode removed, refuses at admission (the gateway tries elsewhere)
    status, none_left = stream(
        url["p-2"], {"requestId": "after", "promptTokens": 8, "maxTokens": 2}
    )
    assert status == 503
    assert none_left[0]["error"]["code"] == "no_decode"
