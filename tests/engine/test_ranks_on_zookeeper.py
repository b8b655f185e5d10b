"""An instance of two pods, on engine processes in a P/D group over a private ZooKeeper (the test
plays the operator's side: RoCE map, init order, decode meta):

- the leader reports only after its worker's rank report, and its report lists both ranks, with
  the RoCE IPs of each in rank order and ``roceIps`` concatenated; it is the whole instance
  (its dies, weights, KV) and links and serves as one with a prefill of as many devices;
- the worker serves nothing (409 naming its leader) and is ready once its rank report is written;
- the worker's process stopped: the leader's health is ``Faulty`` with a ``Rank`` fault naming
  it (and the stream it decoded ends with an error) within a few seconds;
- the worker restarted (on another server's address and RoCE IPs: its pod moved): the leader
  re-forms in its process, a new incarnation, rejoins the group as a newcomer and serves again.

Each measured latency is printed.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx

from engine.conftest import EngineProc, Group
from matrixserve.api import zk_layout as zl
from testkit.helpers import wait_for

MODEL = (
    *("--model", "llama3-8b", "--time-scale", "1", "--load-source", "NPUForkUB"),
    *("--pre-load-seconds", "0"),
)
LEADER_ROCE = "198.19.1.1,198.19.1.2"
WORKER_ROCE = "198.19.2.1,198.19.2.2"
MOVED_ROCE = "198.19.3.1,198.19.3.2"  # the worker's pod on another server
PREFILL_ROCE = "198.19.9.1,198.19.9.2,198.19.9.3,198.19.9.4"
SESSION_TIMEOUT = 10.0  # s, the engines' ZooKeeper sessions' (enginestub.engine.ranks)
TP = ("--tp", "4")  # across both pods: the prefill's shape (4 dies, TP 4) in one process


def _until(what: str, check: Callable[[], Any], bound: float) -> float:
    """Wall seconds until ``check()`` is truthy (the test fails past ``bound``)."""
    began = time.monotonic()
    wait_for(check, timeout=bound, what=what, every=0.02)
    return time.monotonic() - began


def _info(engine: EngineProc) -> dict[str, Any]:
    return dict(httpx.get(f"{engine.url}/v1/info", timeout=5, trust_env=False).json())


def _report(group: Group, name: str) -> zl.Report | None:
    stat = group.zk.exists(group.paths.report(name))
    return zl.Report.parse(group.zk.get(group.paths.report(name))[0]) if stat else None


def _rank(env: dict[str, str], instance: str, rank: int, node: str) -> dict[str, str]:
    return {
        **env,
        "ENGINE_INSTANCE": instance,
        "ENGINE_RANK": str(rank),
        "ENGINE_RANKS": "2",
        "MATRIXSERVE_NODE_NAME": node,
        "MATRIXSERVE_NPUS": "0",
        "MATRIXSERVE_DIES": "0,1",
    }


def _remap(group: Group, prefills: list[str], decodes: list[str], version: int) -> None:
    """The operator's side of a member that rejoined: the map and decode meta of its reports."""
    names = [*prefills, *decodes]
    reports = [r for n in names if (r := _report(group, n)) is not None]
    roles = dict.fromkeys(prefills, zl.Role.PREFILL) | dict.fromkeys(decodes, zl.Role.DECODE)
    roce_map = zl.build_roce_map(reports, roles, version=version)
    group.zk.set(group.paths.roce_map, roce_map.dump())
    meta = zl.DecodeMeta(version=version, decodes=roce_map.decode)
    group.zk.set(group.paths.decode_meta, meta.dump())


def test_an_instance_of_two_pods_forms_serves_goes_faulty_with_its_worker_and_reforms(
    group: Group, start_engine: Any, stream: Any
) -> None:
    prefill = start_engine(
        "p-1",
        "--role",
        "prefill",
        *MODEL,
        env=group.env(PREFILL_ROCE, MATRIXSERVE_DIES="0,1,2,3"),
        wait_ready=False,
    )
    leader = start_engine(
        "d-0",
        "--role",
        "decode",
        *MODEL,
        *TP,
        env=_rank(group.env(LEADER_ROCE), "d-0", 0, "server-a"),
        wait_ready=False,
    )
    # The leader waits for its worker, and says so; it does not report meanwhile.
    _until(
        "the leader waiting for rank 1",
        lambda: "waits for rank(s) 1: no report yet" in leader.log(),
        30,
    )
    time.sleep(1.0)
    assert _report(group, "d-0") is None
    assert httpx.get(f"{leader.url}/readyz", trust_env=False).status_code == 503

    worker = start_engine(
        "d-0-1",
        "--role",
        "decode",
        *MODEL,
        *TP,
        env=_rank(group.env(WORKER_ROCE), "d-0", 1, "server-b"),
    )  # ready: its rank report is written
    rank_path = group.paths.rank("d-0", 1)
    rank_report = zl.RankReport.parse(group.zk.get(rank_path)[0])
    assert (rank_report.pod, rank_report.node, rank_report.state) == (
        "d-0-1",
        "server-b",
        zl.HealthState.SERVING,
    )
    assert rank_report.roce_ips == WORKER_ROCE.split(",")
    took = _until("the leader's report", lambda: _report(group, "d-0") is not None, 10)
    print(f"\nleader reported {took * 1000:.0f} ms after its worker was ready")
    report = _report(group, "d-0")
    assert report is not None
    assert group.zk.exists(group.paths.report("d-0")).ctime >= group.zk.exists(rank_path).ctime
    assert [(r.rank, r.pod, r.node) for r in report.ranks] == [
        (0, "d-0", "server-a"),
        (1, "d-0-1", "server-b"),
    ]
    assert [r.roce_ips for r in report.ranks] == [LEADER_ROCE.split(","), WORKER_ROCE.split(",")]
    assert report.roce_ips == [*LEADER_ROCE.split(","), *WORKER_ROCE.split(",")]
    assert report.dies == [0, 1, 0, 1]
    assert report.ranks[1].incarnation == rank_report.incarnation
    first_incarnation = report.incarnation

    roce_map = group.form(["p-1"], ["d-0"])
    link = zl.Link.parse(group.zk.get(group.paths.link("p-1", "d-0"))[0])
    assert [(s.prefill_ip, s.decode_ip) for s in link.sub_links] == list(
        zip(PREFILL_ROCE.split(","), report.roce_ips, strict=True)
    )
    assert roce_map.decode[0].roce_ips == report.roce_ips
    # The whole instance: its 4 dies' weights and KV, as the prefill of 4 dies in one pod.
    info, alone = _info(leader), _info(prefill)
    assert (info["rank"], info["ranks"], info["instanceDies"], info["dies"]) == (0, 2, 4, [0, 1])
    assert info["roceIps"] == report.roce_ips
    assert (info["weightsBytes"], info["kvCapacityBytes"]) == (
        alone["weightsBytes"],
        alone["kvCapacityBytes"],
    )
    status, events = stream(
        f"{prefill.url}/v1/generate", {"requestId": "a", "promptTokens": 64, "maxTokens": 8}
    )
    assert status == 200
    assert events[-1]["type"] == "done", events[-1]
    assert events[-1]["instances"] == {"prefill": "p-1", "decode": "d-0"}

    # The worker serves nothing: its leader does.
    for path in ("/v1/generate", "/v1/decode", "/v1/kv/x/pull", "/v1/link/handshake"):
        answer = httpx.post(f"{worker.url}{path}", json={"requestId": "w"}, trust_env=False)
        assert answer.status_code == 409, (path, answer.text)
        assert answer.json()["error"]["code"] == "not_the_leader"
        assert answer.json()["error"]["message"] == "rank 1 of d-0: requests go to its leader d-0"
    assert httpx.get(f"{worker.url}/readyz", trust_env=False).status_code == 200
    assert httpx.get(f"{worker.url}/healthz", trust_env=False).status_code == 200
    assert "matrixserve_" in httpx.get(f"{worker.url}/metrics", trust_env=False).text

    # A die of the worker's own faulty: its rank report says so at once, and the instance is
    # Faulty; healed, the instance re-forms (same worker, a new leader incarnation).
    die_fault = {"kind": "die-down", "die": 1}
    assert httpx.post(f"{worker.url}/v1/faults", json=die_fault, trust_env=False).status_code == 201
    injected = time.monotonic()

    def faulty() -> zl.Health | None:
        health = group.health("d-0")
        return health if health is not None and health.state is zl.HealthState.FAULTY else None

    _until("d-0 Faulty by its worker's die", faulty, 5)
    print(f"d-0 Faulty {(time.monotonic() - injected) * 1000:.0f} ms after its worker's die fault")
    health = faulty()
    assert health is not None
    assert [f.kind for f in health.faults] == [zl.EngineFaultKind.RANK]
    assert health.faults[0].detail == (
        "rank 1 (pod d-0-1 on server server-b): Faulty (die: die 1: DIE_DOWN (injected))"
    )
    assert zl.RankReport.parse(group.zk.get(rank_path)[0]).state is zl.HealthState.FAULTY
    assert httpx.get(f"{worker.url}/readyz", trust_env=False).status_code == 503
    assert (
        httpx.request(
            "DELETE", f"{worker.url}/v1/faults", json=die_fault, trust_env=False
        ).status_code
        == 200
    )
    _until(
        "d-0 re-formed",
        lambda: (r := _report(group, "d-0")) is not None and r.incarnation != first_incarnation,
        5,
    )
    _remap(group, ["p-1"], ["d-0"], version=2)
    _until(
        "d-0 Serving",
        lambda: (h := group.health("d-0")) is not None and h.state is zl.HealthState.SERVING,
        10,
    )
    second = _report(group, "d-0")
    assert second is not None
    assert second.ranks[1].incarnation == rank_report.incarnation  # the same worker process
    first_incarnation = second.incarnation

    # Its worker's process stopped: the instance is Faulty at once, its stream ends with an error.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(
            stream,
            f"{prefill.url}/v1/generate",
            {"requestId": "long", "promptTokens": 64, "maxTokens": 5000},
            60,
        )
        _until(
            "a stream decoding on d-0",
            lambda: _info(leader)["health"]["decodeBatch"]["running"] == 1,
            10,
        )
        os.kill(worker.pid, signal.SIGTERM)
        killed = time.monotonic()
        _until("d-0 Faulty", faulty, 5)
        detected = time.monotonic() - killed
        ended = decoding.result(timeout=10)[1]
    health = faulty()
    assert health is not None
    print(f"d-0 Faulty {detected * 1000:.0f} ms after its worker's process was stopped")
    assert detected < 3.0
    [fault] = health.faults
    assert fault.kind is zl.EngineFaultKind.RANK
    assert fault.detail == "rank 1 (pod d-0-1 on server server-b): its report is gone"
    assert fault.dies == [0, 1]
    assert health.incarnation == first_incarnation
    assert ended[-1]["type"] == "error", ended[-1]
    assert "rank 1 (pod d-0-1 on server server-b)" in ended[-1]["message"]
    assert httpx.get(f"{leader.url}/readyz", trust_env=False).status_code == 503
    refused = httpx.post(
        f"{leader.url}/v1/decode",
        json={"requestId": "r", "promptTokens": 8, "prefill": {"address": prefill.address}},
        trust_env=False,
    )
    assert refused.status_code == 503, refused.text
    assert "rank 1 (pod d-0-1 on server server-b)" in refused.json()["error"]["message"]

    # Restarted on another server once the old process is gone (its report goes first, while it
    # is still shutting down; a name runs once at a time).
    _until("d-0-1's old process gone", lambda: not worker.alive(), 15)
    # The leader re-forms in its process as someone else.
    restarted_at = time.monotonic()
    moved = start_engine(
        "d-0-1",
        "--role",
        "decode",
        *MODEL,
        *TP,
        env=_rank(group.env(MOVED_ROCE), "d-0", 1, "server-c"),
    )

    def new_report() -> bool:
        found = _report(group, "d-0")
        return found is not None and found.incarnation != first_incarnation

    _until("d-0 reported again, a new incarnation", new_report, 10)
    reported = time.monotonic() - restarted_at
    again = _report(group, "d-0")
    assert again is not None
    assert again.roce_ips == [*LEADER_ROCE.split(","), *MOVED_ROCE.split(",")]
    assert [(r.pod, r.node) for r in again.ranks] == [("d-0", "server-a"), ("d-0-1", "server-c")]
    assert group.health("d-0") is None  # as a restarted engine: no health until it serves
    remapped = time.monotonic()
    _remap(group, ["p-1"], ["d-0"], version=3)
    _until(
        "d-0 Serving again",
        lambda: (
            (h := group.health("d-0")) is not None
            and h.state is zl.HealthState.SERVING
            and h.incarnation == again.incarnation
        ),
        15,
    )
    serving = time.monotonic() - remapped
    print(
        f"d-0 re-formed: reported {reported * 1000:.0f} ms after its worker restarted, "
        f"serving {serving * 1000:.0f} ms after the new map"
    )
    assert "re-forms as incarnation" in leader.log()
    assert leader.alive()  # in its process: only the worker restarted
    link = zl.Link.parse(group.zk.get(group.paths.link("p-1", "d-0"))[0])
    assert link.decode_incarnation == again.incarnation
    assert [s.decode_ip for s in link.sub_links] == again.roce_ips
    _until(
        "d-0 ready",
        lambda: httpx.get(f"{leader.url}/readyz", trust_env=False).status_code == 200,
        5,
    )
    status, events = stream(
        f"{prefill.url}/v1/generate", {"requestId": "b", "promptTokens": 64, "maxTokens": 8}
    )
    assert status == 200
    assert events[-1]["type"] == "done", events[-1]

    # Killed outright (SIGKILL: no session closed), its report goes with its ZooKeeper session's
    # timeout: the leader sees the rank lost then (or at once, if its restart comes first).
    os.kill(moved.pid, signal.SIGKILL)
    killed = time.monotonic()
    _until(
        "d-0 Faulty after SIGKILL",
        lambda: (h := group.health("d-0")) is not None and h.state is zl.HealthState.FAULTY,
        SESSION_TIMEOUT + 5,
    )
    print(
        f"d-0 Faulty {(time.monotonic() - killed) * 1000:.0f} ms after its worker was killed (SIGKILL)"
    )
