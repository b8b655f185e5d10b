"""ExpertPool on the local cluster (EaaS §3.4, §4.4, §5.3-5.4): a pool reaches Available and
FullyReplicated with its map in ZooKeeper (every expert on distinct servers); a server's engine
killed is dropped from the map, taken back and the copies restored; 8 -> 7 -> 8 servers through
the scale subresource, draining first; a scale below the coverage bound refused by the webhook
with the numbers. The store against the real ZooKeeper: a version written whole then the
pointer, read back, pruned, the pool's subtree deleted. Real API server, scheduler, ZooKeeper,
node emulator and expert server processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from kubernetes import client

from matrixserve.adapters.zk_experts import ExpertStore
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.domain.expertpool import autoscale, rebalance
from matrixserve.domain.expertpool import expertmap as em
from matrixserve.domain.expertpool.plan import WriteMapVersion
from matrixserve.domain.expertpool.pods import LABEL_EXPERTPOOL
from testkit.chaoskit import pod_runs
from testkit.helpers import events_of, wait_for, zookeeper

KIND = kinds.EXPERTPOOL
WHERE = (KIND.group, KIND.version)
P = zl.ExpertMapPhase
# DeepSeek-V2-Lite as the catalogue has it: 64 x 2 + 2 = 130 slots per layer, bound 7 servers
MODEL, EXPERTS, LAYERS, TOP_K = "deepseek-v2-lite", 64, 26, 6
SLOTS, COPIES, BUDGET = 19, 2, 2


def pool_body(name: str = "ep", servers: int = 8) -> dict[str, Any]:
    return {
        "apiVersion": kinds.API_VERSION,
        "kind": KIND.kind,
        "metadata": {"name": name},
        "spec": {
            "model": {"name": MODEL, "experts": EXPERTS, "layers": LAYERS, "topK": TOP_K},
            "servers": {"replicas": servers, "slotsPerServer": SLOTS},
            "minReplicasPerExpert": COPIES,
            "redundantExpertBudget": BUDGET,
        },
    }


class Pool:
    def __init__(
        self, api_client: client.ApiClient, namespace: str, hosts: str, operator: Any
    ) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace, self.name = namespace, "ep"
        self.hosts, self.operator = hosts, operator

    def get(self) -> dict[str, Any]:
        return dict(
            self.custom.get_namespaced_custom_object(*WHERE, self.namespace, KIND.plural, self.name)
        )

    def status(self) -> dict[str, Any]:
        return dict(self.get().get("status") or {})

    def condition(self, kind: str, status: dict[str, Any] | None = None) -> str | None:
        """Condition ``kind``'s status, of ``status`` if given (one read), else read now."""
        status = self.status() if status is None else status
        found = [c for c in status.get("conditions") or [] if c["type"] == kind]
        return found[0]["status"] if found else None

    def scale(self, replicas: int) -> None:
        self.custom.patch_namespaced_custom_object_scale(
            *WHERE, self.namespace, KIND.plural, self.name, {"spec": {"replicas": replicas}}
        )

    def pods(self) -> dict[str, client.V1Pod]:
        items = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_EXPERTPOOL}={self.name}"
        ).items
        return {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}

    def settled(self, servers: int, after_version: int = 0) -> dict[str, Any] | None:
        """The status once the pool serves ``servers`` servers, fully replicated, steady."""
        s = self.status()  # one read: conditions and fields of the same pass
        ok = (
            self.condition("Available", s) == "True"
            and self.condition("FullyReplicated", s) == "True"
            and self.condition("Rebalancing", s) == "False"
            and s.get("readyServers") == servers
            and len(s.get("servers") or []) == servers
            and int(s.get("mapVersion") or 0) > after_version
            and not s.get("draining")
            and len(self.pods()) == servers
        )
        return s if ok else None

    def explain(self) -> str:
        paths = zl.ExpertPoolPaths(self.namespace, self.name)
        with zookeeper(self.hosts) as zk:
            reports = {
                server: zl.ExpertServerReport.parse(zk.get(paths.server(server))[0])
                for server in zk.get_children(paths.servers)
            }
        said = {s: (r.state, r.loaded, r.incarnation, r.pod_uid) for s, r in reports.items()}
        pods = {n: p.metadata.uid for n, p in self.pods().items()}
        log = "\n".join(self.operator.log().splitlines()[-40:])
        return f"status: {self.status()}\npods: {pods}\nreports: {said}\noperator:\n{log}"


def read_map(hosts: str, namespace: str, pool: str) -> em.ExpertMap:
    """The map in force, read as a client reads it: pointer, version, layers."""
    paths = zl.ExpertPoolPaths(namespace, pool)
    with zookeeper(hosts) as zk:
        pointer = zl.ExpertMapPointer.parse(zk.get(paths.map)[0])
        head = zl.ExpertMapVersion.parse(zk.get(paths.version(pointer.version))[0])
        layers = [
            zl.ExpertMapLayer.parse(zk.get(paths.layer(pointer.version, n))[0])
            for n in range(head.layers)
        ]
    return em.ExpertMap.of(head, layers)


def assert_covered(m: em.ExpertMap, servers: int) -> None:
    assert m.steady, m.phase
    assert len(m.servers) == servers
    for layer in m.held:
        for expert in range(EXPERTS):
            holders = [i for i, held in enumerate(layer) if expert in held]
            assert len(set(holders)) >= COPIES, (expert, holders)
        assert all(len(held) <= SLOTS for held in layer)


@pytest.fixture
def pool(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    start_operator: Callable[..., Any],
) -> Pool:
    operator = start_operator(namespace)
    p = Pool(api_client, namespace, cluster.zookeeper, operator)
    p.custom.create_namespaced_custom_object(*WHERE, namespace, KIND.plural, pool_body())
    return p


def test_a_pool_serves_fails_over_and_scales_one_server_at_a_time(
    cluster: ClusterInfo, namespace: str, pool: Pool
) -> None:
    began = time.monotonic()
    status = wait_for(
        lambda: pool.settled(8), 180, "the pool Available, 8 servers", explain=pool.explain
    )
    print(f"\n8 servers serving, map v{status['mapVersion']}: {time.monotonic() - began:.1f} s")
    m = read_map(cluster.zookeeper, namespace, "ep")
    assert_covered(m, 8)
    assert sorted(m.servers) == sorted(pool.pods())
    assert m.version == status["mapVersion"]

    # a server's engine killed: dropped from the map, taken back, every expert restored
    victim = "ep-s3"
    with httpx.Client(base_url=cluster.node_emulator, timeout=10, trust_env=False) as http:
        (pid,) = pod_runs(http.get("/pods").json(), namespace)[victim].pids
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    failover = wait_for(
        lambda: (f := pool.status().get("lastFailover")) and victim in f["servers"] and f,
        90,
        f"the failover of {victim}",
        explain=pool.explain,
    )
    dropped_at = time.monotonic() - killed
    status = wait_for(
        lambda: pool.settled(8, failover["version"]),
        120,
        "the copies restored",
        explain=pool.explain,
    )
    restored_at = time.monotonic() - killed
    print(f"{victim} dropped after {dropped_at:.1f} s, restored after {restored_at:.1f} s")
    assert status["lastFailover"]["restoredVersion"] >= failover["version"]
    assert "ServerFailed" in [e.reason for e in events_of(pool.core, namespace, "ep")]
    assert_covered(read_map(cluster.zookeeper, namespace, "ep"), 8)

    # 8 -> 7: one server drained (out of the map first), then its pod deleted
    version = int(status["mapVersion"])
    pool.scale(7)
    status = wait_for(lambda: pool.settled(7, version), 120, "7 servers", explain=pool.explain)
    assert "ep-s7" not in pool.pods()
    assert_covered(read_map(cluster.zookeeper, namespace, "ep"), 7)
    assert status["lastScale"]["from"] == 8
    assert status["lastScale"]["to"] == 7
    # the scale subresource names the server pods by its selector (an HPA counts them so)
    scale = pool.custom.get_namespaced_custom_object_scale(*WHERE, namespace, KIND.plural, "ep")
    assert scale["spec"]["replicas"] == 7
    assert scale["status"]["replicas"] == 7
    selected = pool.core.list_namespaced_pod(namespace, label_selector=scale["status"]["selector"])
    assert sorted(p.metadata.name for p in selected.items) == sorted(pool.pods())

    # below the coverage bound: refused with the numbers, nothing changed
    with pytest.raises(client.ApiException) as refused:
        pool.scale(6)
    assert refused.value.status == 422
    assert "6 servers x 19 slots = 114 slots per layer, fewer than 64 experts x 2 replicas" in str(
        refused.value.body
    )
    assert pool.get()["spec"]["servers"]["replicas"] == 7

    # 7 -> 8: a new server, used once it serves
    version = int(status["mapVersion"])
    pool.scale(8)
    wait_for(lambda: pool.settled(8, version), 120, "8 servers again", explain=pool.explain)
    assert_covered(read_map(cluster.zookeeper, namespace, "ep"), 8)


def test_the_store_writes_a_version_whole_then_the_pointer_and_prunes(
    cluster: ClusterInfo, namespace: str
) -> None:
    auth = os.environ.get("MATRIXSERVE_ZK_AUTH")
    session = Session(cluster.zookeeper, auth=zl.Credentials.parse(auth) if auth else None)

    async def run() -> None:
        await session.connect(attempt_timeout=5, pause=1)
        store = ExpertStore(session)
        try:
            assert await store.map_in_force(namespace, "p") == (None, [])
            woken: list[int] = []
            assert await store.arm(namespace, "p", lambda: woken.append(1))
            servers = ["a", "b", "c", "d"]  # 44 slots each: 3 of them hold 132 >= 128 copies
            target = em.wanted(None, servers, EXPERTS, LAYERS, 44, COPIES, 0)
            first, *ahead = em.stamped(None, rebalance.change(None, target, 1, "initial", 1.0))
            assert [first.phase, *(m.phase for m in ahead)] == [P.LOAD, P.STEADY]
            walk = WriteMapVersion(first, ahead=tuple(ahead))
            await store.apply(namespace, "p", walk)
            await store.apply(namespace, "p", walk)  # idempotent
            read, versions = await store.map_in_force(namespace, "p")
            assert (read, versions) == (first, [1, 2])  # the walk stored ahead
            assert await store.stored(namespace, "p", 2) == ahead[0]
            # the next phase put in force: its head alone rewritten, stamped now
            (steady,) = em.stamped(first, [replace(ahead[0], at=2.0)])
            await store.apply(namespace, "p", WriteMapVersion(steady, stored=True))
            read, versions = await store.map_in_force(namespace, "p")
            assert (read, versions) == (steady, [1, 2])
            # d drained: its walk written ahead; b fails in its first phase, cutting it short
            drained = em.wanted(steady, servers[:3], EXPERTS, LAYERS, 44, COPIES, 0)
            drain = em.stamped(steady, rebalance.change(steady, drained, 3, "scale down", 3.0))
            assert [m.phase for m in drain] == [P.PREFETCH, P.DISABLE, P.LOAD, P.ENABLE, P.STEADY]
            await store.apply(namespace, "p", WriteMapVersion(drain[0], (1,), ahead=drain[1:]))
            read, versions = await store.map_in_force(namespace, "p")
            assert (read, versions) == (drain[0], [2, 3, 4, 5, 6, 7])
            cut = rebalance.preempt(drain[0], ["b"], 8, "failover", 4.0)
            (failed,) = em.stamped(drain[0], [cut])
            # d stages nothing: its rows as in v2; a and c staged in v3, no longer in v8
            assert failed.rows_at == (8, 8, 2)
            await store.apply(namespace, "p", WriteMapVersion(failed, prune=(2, 4, 5, 6, 7)))
            read, versions = await store.map_in_force(namespace, "p")
            assert read == failed
            assert versions == [3, 8]  # the one before kept, the walk cut short pruned
            wait_for(lambda: woken, 10, "the pointer's watch firing")
            assert "p" in [p for ns, p in await store.pools([namespace])]
            assert await store.delete(namespace, "p")
            assert await store.map_in_force(namespace, "p") == (None, [])
            store.disarm(namespace, "p")
        finally:
            await session.stop()

    asyncio.run(run())


def test_the_autoscaler_steps_down_to_the_coverage_bound_and_no_further(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    start_operator: Callable[..., Any],
) -> None:
    """No traffic: the token rate is 0, so the autoscaler asks for its low end, max(minServers
    5, coverage bound 7) = 7: one step from 8 (a drain, once its samples asked for it through
    the stabilization window), then nothing more."""
    operator = start_operator(namespace)
    pool = Pool(api_client, namespace, cluster.zookeeper, operator)
    body = pool_body()
    body["spec"]["autoscaling"] = {
        "enabled": True,
        "minServers": 5,
        "maxServers": 8,
        "targetTokensPerServerPerSecond": 1000,
    }
    pool.custom.create_namespaced_custom_object(*WHERE, namespace, KIND.plural, body)
    wait_for(lambda: pool.settled(8), 180, "8 servers", explain=pool.explain)
    status = wait_for(lambda: pool.settled(7), 240, "7 servers", explain=pool.explain)
    assert pool.get()["spec"]["servers"]["replicas"] == 7
    assert status["lastScale"]["by"] == "autoscaler"
    assert status["tokenSample"]["tokensPerSecond"] == 0
    assert len(status["tokenSample"]["goals"]) == autoscale.STABILIZATION_SAMPLES
    assert "Autoscaled" in [e.reason for e in events_of(pool.core, namespace, "ep")]
    time.sleep(15)  # a sample window and more: the bound holds
    assert pool.get()["spec"]["servers"]["replicas"] == 7
    assert len(pool.pods()) == 7
