"""An ExpertPool changed under streamed traffic on the local cluster (EaaS §3.4, §5.3;
xDeepServe §4.5): attention clients decode through the pool's servers while

- the pool goes 8 -> 7 -> 8 servers through the scale subresource: the drained server keeps its
  slots enabled until its experts' new copies are loaded and enabled elsewhere, leaves the map
  only then, and its pod is deleted after that; the new server is added by the same walk;
- the clients route by a Zipf popularity whose hottest expert weighs ~30x the mean (Fig. 11a) and
  EPLB replicates the hot experts into the redundant slots through its four phases (Prefetch,
  Disable, Load, Enable, then Steady), each version put in force only once every server of
  the one before has applied it.

Every map version put in force is read from ZooKeeper as it comes (:class:`MapLog`, the
pointer polled on its own session): none may leave an expert of any layer without an enabled
copy. Every request must finish (0 failed). The figures are printed: the seconds each change
took, the simulated MoE time EPLB priced before and after (tokens on the slowest server per
iteration, summed over layers) and the clients' measured iteration (emulated) before and after.
Real API server, scheduler, ZooKeeper, node emulator, expert servers and attention clients
(processes on loopback, as the pods' engines)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import NoNodeError
from kubernetes import client

from cluster.test_expertpool_serving import WHERE, Pool, pool, pool_body, read_map  # noqa: F401
from cluster.test_expertpool_warm_failover import EXPERTS, Streams, attention_clients
from engine.conftest import EngineProc, start_engine  # noqa: F401  (fixture)
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.helpers import events_of, metric, wait_for, zookeeper

P = zl.ExpertMapPhase
WALK = [P.PREFETCH, P.DISABLE, P.LOAD, P.ENABLE, P.STEADY]
ITERATION = "matrixserve_engine_expert_iteration_seconds"
POLL_SECONDS = 0.02
# [design] the clients' failover timeout (emulated ms; 2 wall s at the time scale of 20): these
# tests change the map, they fail no server, and on a loaded 2-core machine a loopback answer
# can take longer than the default's 0.3 wall s (every server dropped at once, then the
# iteration held that long and failed): the bound is the time a stall may last, not the subject
FAILOVER_MS = "40000"


@dataclass
class InForce:
    """A map version put in force: its table and layers, when the pointer was seen on it
    (monotonic s; None: it moved on between two polls), and the servers' reports read right
    after (server -> (loaded, state))."""

    head: zl.ExpertMapVersion
    layers: list[zl.ExpertMapLayer]
    seen: float | None = None
    reports: dict[str, tuple[int, str]] = field(default_factory=dict)

    def fewest_enabled(self) -> int:
        """The fewest enabled copies any expert has in any layer (servers of the table)."""
        return min(len(r) for layer in self.layers for r in layer.routes(EXPERTS))

    def enabled_elsewhere(self, server: str) -> bool:
        """Whether every expert ``server`` holds has an enabled copy on another server."""
        index = self.head.servers.index(server)
        for layer in self.layers:
            routes = layer.routes(EXPERTS)
            if any(not [s for s in routes[e] if s != index] for e in layer.slots[index]):
                return False
        return True


class MapLog:
    """Every version of a pool's map put in force while it runs, in order, polled every
    :data:`POLL_SECONDS` on a ZooKeeper session of its own: each version read whole as soon
    as it is stored (a walk is written ahead, and pruned only two versions after it is in
    force), and the pointer followed, the servers' reports read at each move. The controller
    numbers its versions on from the last (no failover here), so the versions in force are
    the stored ones from the first pointer seen to the last."""

    def __init__(self, hosts: str, namespace: str) -> None:
        self.hosts, self.paths = hosts, zl.ExpertPoolPaths(namespace, "ep")
        self.stored: dict[int, InForce] = {}
        self.moves: dict[int, tuple[float, dict[str, tuple[int, str]]]] = {}  # first sight
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.problem = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _read(self, zk: Any, version: int) -> InForce | None:
        """Version ``version`` whole, or None while it is being written (its head comes last)."""
        try:
            head = zl.ExpertMapVersion.parse(zk.get(self.paths.version(version))[0])
            pending = [zk.get_async(self.paths.layer(version, n)) for n in range(head.layers)]
            layers = [zl.ExpertMapLayer.parse(p.get(timeout=10)[0]) for p in pending]
        except (NoNodeError, ValueError):
            return None
        return InForce(head, layers)

    def _reports(self, zk: Any) -> dict[str, tuple[int, str]]:
        out = {}
        for server in zk.get_children(self.paths.servers):
            try:
                r = zl.ExpertServerReport.parse(zk.get(self.paths.server(server))[0])
            except NoNodeError:
                continue
            out[server] = (r.loaded, str(r.state))
        return out

    def _poll(self, zk: Any) -> None:
        try:
            pointer = zl.ExpertMapPointer.parse(zk.get(self.paths.map)[0]).version
            children = zk.get_children(self.paths.map)
        except NoNodeError:
            return
        if pointer not in self.moves:
            move = (time.monotonic(), self._reports(zk))
            with self.lock:
                self.moves[pointer] = move
        numbers = sorted(v for c in children if (v := zl.ExpertPoolPaths.version_of(c)))
        for v in numbers:  # the oldest first: they are pruned first
            if v not in self.stored and (read := self._read(zk, v)):
                with self.lock:
                    self.stored[v] = read

    def _run(self) -> None:
        try:
            with zookeeper(self.hosts) as zk:
                while not self.stop.wait(POLL_SECONDS):
                    self._poll(zk)
        except Exception as exc:  # said by close(): a log with holes proves nothing
            self.problem = f"{type(exc).__name__}: {exc}"

    def in_force(self) -> list[InForce]:
        """The versions put in force so far, in order (AssertionError if one was not read)."""
        with self.lock:
            if not self.moves:
                return []
            span = range(min(self.moves), max(self.moves) + 1)
            missed = [v for v in span if v not in self.stored]
            assert not missed, f"map versions {missed} in force but not read in time"
            for v, (seen, reports) in self.moves.items():
                self.stored[v].seen, self.stored[v].reports = seen, reports
            return [self.stored[v] for v in span]

    def close(self) -> list[InForce]:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.problem, f"the map log stopped: {self.problem}"
        return self.in_force()


def check_walked(log: list[InForce], copies: int) -> int:
    """Every version in force kept ``copies`` enabled copies of every expert, and a version
    after one mid-walk came only once every server of that one's table had applied it; the
    number of such moves checked (the servers' reports read as the pointer moved)."""
    checked = 0
    for v in log:
        assert v.fewest_enabled() >= copies, (v.head.version, v.head.phase, v.fewest_enabled())
    for before, after in itertools.pairwise(log):
        if before.head.phase is P.STEADY or not after.reports:
            continue
        behind = {  # a server with no report is gone (a drained one's pod deleted)
            s: r
            for s in before.head.servers
            if (r := after.reports.get(s)) is not None and r[0] < before.head.version
        }
        assert not behind, (
            f"v{after.head.version} put in force while servers had not applied "
            f"v{before.head.version} ({before.head.phase}): {behind}"
        )
        checked += 1
    return checked


def iteration(clients: list[EngineProc]) -> tuple[float, float]:
    """The clients' iteration histogram summed: (seconds, iterations)."""
    return (
        sum(metric(c.url, f"{ITERATION}_sum") for c in clients),
        sum(metric(c.url, f"{ITERATION}_count") for c in clients),
    )


def mean_ms(start: tuple[float, float], end: tuple[float, float]) -> float:
    count = end[1] - start[1]
    assert count > 0, "no iteration in the window"
    return 1000 * (end[0] - start[0]) / count


def settle(pool: Pool, servers: int, status: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    """The status once the pool serves ``servers``, steady at a version after ``status``'s."""
    return dict(
        wait_for(
            lambda: pool.settled(servers, int(status["mapVersion"])),
            120,
            f"{servers} servers",
            explain=pool.explain,
        )
    )


def test_8_to_7_to_8_servers_while_clients_stream(
    cluster: ClusterInfo,
    namespace: str,
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],  # noqa: F811
) -> None:
    began = time.monotonic()
    status = wait_for(lambda: pool.settled(8), 180, "8 servers serving", explain=pool.explain)
    settled = time.monotonic() - began
    log = MapLog(cluster.zookeeper, namespace)
    clients = attention_clients(
        start_engine, cluster, namespace, 2, "--expert-failover-ms", FAILOVER_MS
    )
    streams = Streams(clients)
    try:
        wait_for(lambda: streams.done() >= 2, 60, "streams completing before the scale")

        # 8 -> 7: ep-s7 drained, out of the map once its experts are enabled elsewhere
        victim = "ep-s7"
        scaled = time.monotonic()
        pool.scale(7)
        gone = wait_for(
            lambda: victim not in pool.pods() and time.monotonic(),
            120,
            f"{victim}'s pod deleted",
            every=0.05,
        )
        in_force = read_map(cluster.zookeeper, namespace, "ep")  # as the pod is seen gone
        assert victim not in in_force.servers, (in_force.version, in_force.servers)
        status = settle(pool, 7, status)
        down = time.monotonic() - scaled
        served = streams.done()

        # 7 -> 8: a new server, used once it serves
        scaled = time.monotonic()
        pool.scale(8)
        status = settle(pool, 8, status)
        up = time.monotonic() - scaled
        wait_for(lambda: streams.done() >= served + 2, 60, "streams after the scale-up")
    finally:
        outcomes = streams.finish()
        versions = log.close()
    failed = streams.failed()
    assert failed == [], failed[:5]

    # the drain: ep-s7 left the map at a Steady version after one where every expert it held
    # was enabled elsewhere, and every server had applied that one; then the pod went
    out = next(i for i, v in enumerate(versions) if i and victim not in v.head.servers)
    last_in = versions[out - 1]
    assert victim in last_in.head.servers
    assert versions[out].head.phase is P.STEADY
    assert last_in.enabled_elsewhere(victim)
    moves = check_walked(versions, 2)  # coverage never dropped below minReplicasPerExpert
    phases = [v.head.phase for v in versions[1 : out + 1]]
    assert phases[-1] is P.STEADY, phases
    assert P.ENABLE in phases, phases
    deleted = [
        e.message
        for e in events_of(pool.core, namespace, "ep")
        if e.reason == "DeletedServer" and victim in e.message
    ]
    assert deleted, "no DeletedServer event"
    assert "drained, out of the map" in deleted[0], deleted
    assert status["lastScale"]["from"] == 7
    assert status["lastScale"]["to"] == 8
    assert "ep-s7" in status["servers"]
    after = gone - (versions[out].seen or gone)
    print(
        f"\n8 servers settled in {settled:.1f} s; 8 -> 7 in {down:.1f} s (map out of {victim} "
        f"at v{versions[out].head.version}, its pod deleted {after:.2f} s after), 7 -> 8 in "
        f"{up:.1f} s; {len(versions)} versions in force ({moves} moves checked against the "
        f"servers' loaded), fewest enabled copies {min(v.fewest_enabled() for v in versions)}; "
        f"{len(outcomes)} requests, 0 failed"
    )


def eplb_body() -> dict[str, Any]:
    """Four full servers (4 x 34 = 64 experts x 2 + 8 redundant slots per layer) and an EPLB
    that looks at every token sample and acts on a 10 % imbalance."""
    body: dict[str, Any] = pool_body()
    body["spec"]["servers"] = {"replicas": 4, "slotsPerServer": 34}
    body["spec"]["redundantExpertBudget"] = 8
    body["spec"]["rebalance"] = {"intervalSeconds": 1, "imbalancePercentThreshold": 10}
    return body


def test_eplb_replicates_the_hot_experts_in_four_phases_while_clients_stream(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    start_operator: Callable[..., Any],
    start_engine: Callable[..., EngineProc],  # noqa: F811
) -> None:
    operator = start_operator(namespace)
    ep = Pool(api_client, namespace, cluster.zookeeper, operator)
    ep.custom.create_namespaced_custom_object(
        *WHERE, namespace, kinds.EXPERTPOOL.plural, eplb_body()
    )
    began = time.monotonic()
    status = wait_for(lambda: ep.settled(4), 180, "4 servers serving", explain=ep.explain)
    settled = time.monotonic() - began
    steady = int(status["mapVersion"])
    log = MapLog(cluster.zookeeper, namespace)
    clients = attention_clients(
        start_engine,
        cluster,
        namespace,
        2,
        *("--expert-popularity", "zipf", "--expert-failover-ms", FAILOVER_MS),
    )
    streams = Streams(clients)
    try:
        wait_for(lambda: streams.done() >= 2, 60, "streams completing before EPLB")
        before_start = iteration(clients)
        record = wait_for(
            lambda: ep.status().get("lastRebalance"), 90, "EPLB deciding", explain=ep.explain
        )
        before_end = iteration(clients)
        decided = time.monotonic() - began
        status = wait_for(
            lambda: (s := ep.settled(4)) and (s["lastRebalance"].get("endedVersion") and s),
            90,
            "the rebalance walked to Steady",
            explain=ep.explain,
        )
        walked = time.monotonic() - began - decided
        after_start = iteration(clients)
        served = streams.done()
        wait_for(lambda: streams.done() >= served + 2 * len(clients), 60, "streams after EPLB")
        after_end = iteration(clients)
    finally:
        outcomes = streams.finish()
        versions = log.close()
    failed = streams.failed()
    assert failed == [], failed[:5]

    last = status["lastRebalance"]
    assert last["at"] == record["at"], "another rebalance came before the first one's end"
    assert last["outcome"] == "Completed"
    assert last["moeTimeAfter"] < last["moeTimeBefore"]
    assert last["imbalanceAfter"] < last["imbalanceBefore"]
    hot = status["hotExperts"]
    assert hot, "no hot experts in the status"
    # Zipf's hottest weighs 30x the mean, but a token picks 6 distinct experts: it is capped at
    # every token, 64 / 6 = 10.7x the layer's mean expert
    assert hot[0]["ratio"] >= 10, hot
    assert "Rebalance" in [e.reason for e in events_of(ep.core, namespace, "ep")]

    # the walk in ZooKeeper: its five versions in force in order, each once the servers had
    # applied the one before; no expert ever without an enabled copy
    walk = [v for v in versions if v.head.version in last["versions"]]
    assert [v.head.version for v in walk] == last["versions"]
    assert [v.head.phase for v in walk] == WALK
    assert walk[0].head.version > steady
    moves = check_walked(versions, 1)
    held = {  # the copies of each layer's hottest expert, before and after
        h["layer"]: (
            len(versions[0].layers[h["layer"]].routes(EXPERTS)[h["expert"]]),
            len(walk[-1].layers[h["layer"]].routes(EXPERTS)[h["expert"]]),
        )
        for h in hot
    }

    # EPLB acts on the layers whose imbalance is worst (``last["layers"]``), which need not hold
    # the five hottest experts overall: a copy is added in each of those layers, and to the
    # hot experts of them that the status lists
    def copies(version: Any, layer: int, expert: int) -> int:
        return len(version.layers[layer].routes(EXPERTS)[expert])

    assert last["layers"], last
    for layer in last["layers"]:
        assert any(
            copies(walk[-1], layer, e) > copies(versions[0], layer, e) for e in range(EXPERTS)
        ), f"layer {layer} rebalanced without a copy added"
    in_rebalanced = {n: held[n] for n in held if n in last["layers"]}
    if in_rebalanced:
        assert any(after > before for before, after in in_rebalanced.values()), held

    before_ms = mean_ms(before_start, before_end)
    after_ms = mean_ms(after_start, after_end)
    print(
        f"\n4 servers settled in {settled:.1f} s; EPLB decided at {decided:.1f} s "
        f"({last['reason']}), walked v{walk[0].head.version}..v{walk[-1].head.version} in "
        f"{walked:.1f} s; imbalance {last['imbalanceBefore']} -> {last['imbalanceAfter']}, "
        f"simulated MoE time {last['moeTimeBefore']} -> {last['moeTimeAfter']} tokens per "
        f"iteration; hottest {hot[0]} ; copies of the hot experts (before, after) {held}; the "
        f"clients' iteration {before_ms:.2f} -> {after_ms:.2f} ms (emulated); fewest enabled "
        f"copies {min(v.fewest_enabled() for v in versions)} ({moves} moves checked against the "
        f"servers' loaded); {len(outcomes)} requests, 0 failed"
    )
