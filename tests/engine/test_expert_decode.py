"""A P/D group's decode given an expert pool (``MATRIXSERVE_EXPERT_POOL``, its role ``auto``: the
RoCE map makes it a decode) is the pool's attention client (EaaS §3.1, §5.1), on one private
ZooKeeper holding the group and the pool, the test playing both controllers:

- before the pool's map is in force it links but does not serve: no health znode, ``/readyz``
  503 saying it waits for the pool's map (a group would not count it Ready); the prefill serves;
- once the map is in force (and its servers serve), it serves as a decode (role ``decode``, its
  health ``Serving``), holds the non-expert weights only, and every stream through the prefill
  completes, its steps the disaggregated iteration (the client's iterations and messages move,
  the servers receive them); ``/v1/attention/step`` predicts its iteration;
- an expert server killed mid-stream: 0 failed streams.

A prefill given a pool is refused at start (exit 2, the message says why).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.conftest import EngineProc, Group, concurrent_streams
from engine.test_expert_client import _failed, _metric
from engine.test_expert_server import TIME_SCALE, Pool, every_layer, small_moe
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import ModelShape
from testkit.helpers import wait_for

HALF_A, HALF_B, ALL = list(range(8)), list(range(8, 16)), list(range(16))


@pytest.fixture
def experts(group: Group, tmp_path: Path) -> Pool:
    """The pool, in the group's ZooKeeper: no map in force yet (its pointer at version 0)."""
    paths = zl.ExpertPoolPaths("t", "experts")
    group.zk.ensure_path(paths.map)
    group.zk.set(paths.map, zl.ExpertMapPointer(version=0).dump())
    return Pool(group.zk, paths, "t/experts", group.hosts, small_moe(tmp_path))


def test_a_group_decode_with_a_pool_serves_once_its_map_is_in_force(
    group: Group, experts: Pool, start_engine: Callable[..., EngineProc]
) -> None:
    servers = [experts.start_server(start_engine, name) for name in ("ex-a", "ex-b", "ex-c")]
    wait_for(
        lambda: all(experts.report(s.name) is not None for s in servers),
        timeout=30,
        what="the expert servers registered",
    )
    model = ("--model", experts.model, "--time-scale", TIME_SCALE, "--pre-load-seconds", "0")
    engines = group.start(
        start_engine,
        (*model, "--load-source", "HostDRAM", "--health-interval", "5"),
        ("p-0", "prefill", "198.19.1.1,198.19.1.2"),
        ("d-0", "auto", "198.19.2.1,198.19.2.2", "--expert-pool", experts.name),
    )
    prefill, decode = engines["p-0"], engines["d-0"]
    formed = concurrent.futures.ThreadPoolExecutor(1).submit(group.form, ["p-0"], ["d-0"])

    # linked and loaded, but no map in force: the prefill serves, the decode does not
    wait_for(
        lambda: (h := group.health("p-0")) is not None and h.state is zl.HealthState.SERVING,
        timeout=30,
        what="the prefill serving",
    )
    wait_for(
        lambda: "expert pool" in (decode_info(decode)["health"]["waitingFor"] or ""),
        timeout=30,
        what="the decode waiting for its pool's map",
    )
    time.sleep(1.0)  # a few health intervals (0.5 wall s each): still nothing said
    assert group.health("d-0") is None
    ready = httpx.get(f"{decode.url}/readyz", timeout=5, trust_env=False)
    assert ready.status_code == 503
    assert not formed.done()

    # the map in force: every expert on two servers
    experts.write(1, ["ex-a", "ex-b", "ex-c"], every_layer(HALF_A, HALF_B, ALL))
    formed.result(timeout=60)
    health = group.health("d-0")
    assert health is not None
    assert health.role is zl.Role.DECODE
    info, prefill_info = decode_info(decode), decode_info(prefill)
    assert info["role"] == "decode"
    assert info["health"]["waitingFor"] is None
    print(
        f"\nweights: decode {info['weightsBytes'] / 1e9:.2f} GB, "
        f"prefill {prefill_info['weightsBytes'] / 1e9:.2f} GB"
    )
    shape = ModelShape.model_validate_json(Path(experts.model).read_text())
    experts_bytes = (shape.routed_expert_params + shape.shared_expert_params) * shape.weight_bytes
    # the same dies and TP: the prefill holds every expert, the decode none (the pool's)
    assert info["weightsBytes"] == pytest.approx(prefill_info["weightsBytes"] - experts_bytes)

    predicted = httpx.post(
        f"{decode.url}/v1/attention/step", json={"batch": 4}, timeout=5, trust_env=False
    )
    assert predicted.status_code == 200, predicted.text
    assert predicted.json()["mapVersion"] == 1

    results = concurrent_streams(prefill, 4, 24)
    assert _failed(results) == []
    iterations = _metric(decode, "matrixserve_engine_expert_iteration_seconds_count")
    assert iterations >= 23  # 24 tokens, the first from the prefill
    for server in servers:
        assert _metric(
            server, "matrixserve_engine_expert_messages_received_total", '{outcome="served"}'
        )

    # an expert server killed mid-stream: its parts go to the replicas, no stream fails
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        running = ex.submit(concurrent_streams, prefill, 4, 150)
        wait_for(
            lambda: (
                _metric(decode, "matrixserve_engine_expert_iteration_seconds_count")
                > iterations + 5
            ),
            timeout=30,
            what="decoding",
        )
        os.kill(servers[0].pid, signal.SIGKILL)
        results = running.result()
    assert _failed(results) == []
    assert sum(
        _metric(decode, "matrixserve_engine_expert_failovers_total", f'{{why="{why}"}}')
        for why in ("gone", "timeout", "unreachable")
    )

    # The pool deleted (its servers stopped, its subtree removed, as the controller's
    # finalizer does): the decode says it cannot serve (Degraded, why), is unready, and
    # refuses at once; it used to stay Serving, Ready and admitting, each request then waiting
    # out the KV-pull bound at its prefill.
    for server in servers[1:]:
        server.sup.stop(server.name, grace=5)
    experts.zk.delete(experts.paths.root, recursive=True)

    def degraded() -> zl.Health | None:
        h = group.health("d-0")
        return h if h is not None and h.state is zl.HealthState.DEGRADED else None

    wait_for(degraded, timeout=15, what="the decode's health Degraded")
    health = degraded()
    assert health is not None
    assert health.message == (
        "its expert pool t/experts is gone (the map pointer deleted; v1 was in force)"
    )
    assert httpx.get(f"{decode.url}/readyz", timeout=5, trust_env=False).status_code == 503
    began = time.monotonic()
    refused = httpx.post(
        f"{decode.url}/v1/decode",
        json={"requestId": "after", "promptTokens": 8, "prefill": {"address": prefill.address}},
        timeout=10,
        trust_env=False,
    )
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "expert_uncovered"
    assert "is gone" in refused.json()["error"]["message"]
    assert time.monotonic() - began < 2.0

    # Made again under the same name: its first version (v1 again, another one) enables no
    # expert: the client stays out (it would have said it served, idle, and held its first
    # request) until a version covers every expert.
    again = [experts.start_server(start_engine, name) for name in ("ex-d", "ex-e")]
    names = [s.name for s in again]
    experts.write(1, names, every_layer(ALL, ALL), disabled=every_layer(ALL, ALL))
    wait_for(lambda: all(experts.serving(n, 1) for n in names), timeout=30, what="v1 loaded")
    time.sleep(1.5)  # three health intervals (0.5 wall s each): still not serving
    health = group.health("d-0")
    assert health is not None
    assert health.state is zl.HealthState.DEGRADED
    assert health.message.startswith("no live copy of layer 0 expert 0, "), health.message
    assert httpx.get(f"{decode.url}/readyz", timeout=5, trust_env=False).status_code == 503
    experts.write(2, names, every_layer(ALL, ALL))
    wait_for(
        lambda: (h := group.health("d-0")) is not None and h.state is zl.HealthState.SERVING,
        timeout=30,
        what="the decode serving again on the new pool's v2",
    )
    assert httpx.get(f"{decode.url}/readyz", timeout=5, trust_env=False).status_code == 200
    assert _failed(concurrent_streams(prefill, 2, 8)) == []


def decode_info(engine: EngineProc) -> dict[str, Any]:
    return dict(httpx.get(f"{engine.url}/v1/info", timeout=5, trust_env=False).json())


def test_a_prefill_given_a_pool_is_refused(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "enginestub", "--role", "prefill", "--model", small_moe(tmp_path)],
        env={**os.environ, "MATRIXSERVE_EXPERT_POOL": "t/experts", "MATRIXSERVE_ZK": "127.0.0.1:1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "an expert pool's clients are decodes" in run.stderr
