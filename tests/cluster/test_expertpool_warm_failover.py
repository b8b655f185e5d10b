"""An ExpertPool's coverage restored from a WarmPool on the local cluster (EaaS §3.4, §4.4;
DeepServe §6.1): a WarmPool and an ExpertPool naming it (``warmPoolRef``), attention clients
streaming through the pool's servers; one server's engine SIGKILLed mid-decode (by pid). The
clients re-send its part to replicas (0 failed requests), the map drops it at once (the
kubelet's restart count says the engine exited), recovery prices a warm pod's claim below the
restart in place, a warm pod is claimed (``claimed-kind: ExpertPool``) and becomes an expert
server by its assignment, and every expert is back to ``minReplicasPerExpert``. The seconds from
the kill to coverage restored are printed (a cold restart in place measured ~1.7 s at this size
before the warm path). Real API server, scheduler, ZooKeeper, node emulator, expert servers,
warm engines and attention clients (processes on loopback, as the pods' engines).

Pool, servers and clients are of one model, DeepSeek-V2-Lite as the catalogue has it (26 MoE
layers of 64 experts, top 6): a pool of a few servers holds it whole."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from cluster.test_expertpool_serving import Pool, read_map
from engine.conftest import EngineProc, sse_post, start_engine  # noqa: F401  (fixture)
from matrixserve.api import kinds
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.domain.expertpool import expertmap as em
from testkit.chaoskit import pod_runs
from testkit.helpers import events_of, wait_for

EP, WP = kinds.EXPERTPOOL, kinds.WARMPOOL
MODEL, EXPERTS, MOE_LAYERS, TOP_K = "deepseek-v2-lite", 64, 26, 6
SERVERS, SLOTS, COPIES = 4, 32, 2  # 128 slots per layer for 64 experts x 2: the survivors cannot
TIME_SCALE = "20"  # the operator's engines'
CLIENTS, STREAMS, TOKENS = 2, 3, 48


def bodies(namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    warm = {
        "apiVersion": kinds.API_VERSION,
        "kind": WP.kind,
        "metadata": {"name": "wp"},
        "spec": {"shapes": [{"name": "one", "size": 1, "devicesPerPod": 1}]},
    }
    pool = {
        "apiVersion": kinds.API_VERSION,
        "kind": EP.kind,
        "metadata": {"name": "ep"},
        "spec": {
            "model": {"name": MODEL, "experts": EXPERTS, "layers": MOE_LAYERS, "topK": TOP_K},
            "servers": {"replicas": SERVERS, "slotsPerServer": SLOTS},
            "minReplicasPerExpert": COPIES,
            "warmPoolRef": {"name": "wp"},
        },
    }
    return warm, pool


def warm_ready(core: client.CoreV1Api, namespace: str) -> list[str]:
    """The WarmPool's claimable pods (Ready, unclaimed)."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"{kinds.LABEL_WARMPOOL}=wp").items
    return [
        p.metadata.name
        for p in pods
        if kinds.LABEL_CLAIMED_BY not in (p.metadata.labels or {})
        and p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]


def covered(m: em.ExpertMap) -> bool:
    return m.steady and all(
        len({i for i, held in enumerate(layer) if e in held}) >= COPIES
        for layer in m.held
        for e in range(EXPERTS)
    )


def attention_clients(
    start_engine: Callable[..., EngineProc],  # noqa: F811
    cluster: ClusterInfo,
    namespace: str,
    count: int = CLIENTS,
    *extra: str,
) -> list[EngineProc]:
    """``count`` attention clients of the pool ``ep`` (engine processes on loopback, as a
    decode pod's engine), ``extra`` arguments added."""
    env = {"MATRIXSERVE_EXPERT_POOL": f"{namespace}/ep", "MATRIXSERVE_ZK": cluster.zookeeper}
    args = (
        *("--role", "attention", "--model", MODEL, "--time-scale", TIME_SCALE),
        *("--pre-load-seconds", "0", "--load-source", "HostDRAM", "--health-interval", "5"),
        *extra,
    )
    return [start_engine(f"att-{i}", *args, env=env) for i in range(count)]


class Streams:
    """``streams`` streams per client, back to back, until stopped; each request's outcome."""

    def __init__(
        self, clients: list[EngineProc], streams: int = STREAMS, tokens: int = TOKENS
    ) -> None:
        self.clients, self.tokens = clients, tokens
        self.outcomes: list[tuple[str, int, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(len(clients) * streams)
        self.futures = [self.pool.submit(self._run, c, i) for c in clients for i in range(streams)]

    def _run(self, engine: EngineProc, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            body = {
                "requestId": f"{engine.name}-{index}-{n}",
                "promptTokens": 64,
                "maxTokens": self.tokens,
            }
            status, events = sse_post(f"{engine.url}/v1/generate", body, 120)
            last = events[-1] if events else None
            with self.lock:
                self.outcomes.append((engine.name, status, last))
            n += 1

    def failed(self) -> list[tuple[str, int, Any]]:
        """The requests that did not end ``done``."""
        with self.lock:
            return [o for o in self.outcomes if not self.ok(o)]

    def finish(self) -> list[tuple[str, int, Any]]:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=180)
        self.pool.shutdown()
        return self.outcomes

    @staticmethod
    def ok(outcome: tuple[str, int, Any]) -> bool:
        _, status, last = outcome
        return status == 200 and bool(last) and last.get("type") == "done"

    def done(self) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if self.ok(o))


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_killed_server_is_replaced_from_the_warm_pool_under_traffic(
    warm: bool,
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    start_operator: Callable[..., Any],
    start_engine: Callable[..., EngineProc],  # noqa: F811
    tmp_path: Path,
) -> None:
    operator = start_operator(namespace, time_scale=TIME_SCALE)
    pool = Pool(api_client, namespace, cluster.zookeeper, operator)
    warm_body, pool_body = bodies(namespace)
    if warm:  # else the pool names a WarmPool that is not there: its engine restarts in place
        pool.custom.create_namespaced_custom_object(
            WP.group, WP.version, namespace, WP.plural, warm_body
        )
    pool.custom.create_namespaced_custom_object(
        EP.group, EP.version, namespace, EP.plural, pool_body
    )
    wait_for(lambda: pool.settled(SERVERS), 180, "the pool serving", explain=pool.explain)
    if warm:
        wait_for(lambda: warm_ready(pool.core, namespace), 120, "a warm pod ready")
    before = read_map(cluster.zookeeper, namespace, "ep")
    assert covered(before)

    # attention clients decoding through the pool's servers
    streams = Streams(attention_clients(start_engine, cluster, namespace))
    try:
        wait_for(lambda: streams.done() >= CLIENTS, 60, "streams completing before the kill")
        # one server's engine killed mid-decode
        victim = "ep-s1"
        with httpx.Client(base_url=cluster.node_emulator, timeout=10, trust_env=False) as http:
            (pid,) = pod_runs(http.get("/pods").json(), namespace)[victim].pids
        served = streams.done()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(
            lambda: (
                (f := pool.status().get("lastFailover"))
                and victim in f["servers"]
                and f.get("restoredVersion")
                and pool.settled(SERVERS)
            ),
            120,
            "coverage restored from the warm pool",
            explain=pool.explain,
            every=0.05,
        )
        restored = time.monotonic() - killed
        wait_for(lambda: streams.done() >= served + 2 * CLIENTS, 60, "streams after the restore")
    finally:
        outcomes = streams.finish()
    failover = pool.status()["lastFailover"]
    print(
        f"\n{'warm' if warm else 'cold'}: {victim} killed mid-decode: coverage restored after {restored:.2f} s (kill to "
        f"FullyReplicated seen), {failover.get('restoredSeconds')} s by the status (failure seen "
        f"to restored); path {failover.get('replacementPath')}, replacement "
        f"{failover.get('replacement')}; recovery {failover.get('recovery', {}).get('action')} "
        f"(predicted {failover.get('recovery', {}).get('predictedRestoreSeconds')} s); "
        f"{len(outcomes)} requests"
    )
    failed = streams.failed()
    assert failed == [], failed[:5]
    after = read_map(cluster.zookeeper, namespace, "ep")
    assert covered(after)
    reasons = [e.reason for e in events_of(pool.core, namespace, "ep")]
    assert "ServerFailed" in reasons  # the map dropped it at once
    if not warm:  # restarted in place, taken back
        assert failover["recovery"]["action"] == "RestartInPlace"
        assert failover.get("replacement") is None
        assert victim in after.servers
        return
    # a warm pod claimed as the ExpertPool's replaced it
    assert failover["recovery"]["action"] == "Replace"
    assert failover["replacementPath"].startswith("Warm")
    replacement = failover["replacement"]
    pods = pool.pods()
    assert victim not in pods
    labels = pods[replacement].metadata.labels
    assert labels[kinds.LABEL_CLAIMED_KIND] == "ExpertPool"
    assert labels[kinds.LABEL_CLAIMED_BY] == "ep"
    assert victim not in after.servers
    assert replacement in after.servers
    assert {"ClaimedWarmServer", "AssignedWarmServer"} <= set(reasons)
