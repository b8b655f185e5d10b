"""The ExpertPool controller's decisions (pure): refusals with the numbers, the initial map on
distinct servers, coverage, failover, drains one server at a time, the autoscaler's clamp.

A small world (:class:`World`) plays the servers and ZooKeeper: pods the plan creates start and
report ``Serving``; a map version written goes in force; a server loads the slots disabled in
the version in force and reports it loaded. Each test drives the planner through it and checks
what the map and status say at every step."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_settings import LoadSource
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.api.status import ExpertPoolStatus, ExpertTokenSample
from matrixserve.domain import expertpool as ep
from matrixserve.domain.effects import ZnodeChange
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.expertpool import autoscale, obtain, rebalance, validation
from matrixserve.domain.expertpool import expertmap as em
from matrixserve.domain.expertpool.plan import (
    CreateServerPod,
    DeleteServerPod,
    ScaleServers,
    WriteMapVersion,
)
from matrixserve.domain.expertpool.pods import (
    ANNOTATION_OBTAINED,
    LABEL_EXPERTPOOL,
    template_changes,
)
from matrixserve.domain.observed import PodView
from matrixserve.domain.scaleout import PRIOR_RATES, PRIOR_TE_PRE_LOAD_SECONDS

pytestmark = pytest.mark.unit
P = zl.ExpertMapPhase
PHASES = [*list(P)[1:], P.STEADY]  # Prefetch ... Steady: EPLB's walk
NEWCOMER = [P.LOAD, P.STEADY]  # a new pool's walk, a replacement's, a scale-up's
DRAIN = [P.PREFETCH, P.LOAD, P.ENABLE, P.STEADY]  # a scale-down's, with room on the others
ENGINE = EngineSettings(zookeeper="127.0.0.1:2181")
STATE = zl.ExpertServerState
PATHS = zl.ExpertPoolPaths("ns", "pool")


def spec(**extra: Any) -> ExpertPoolSpec:
    """12 experts x 3 layers, 4 slots, 2 copies + 2 redundant = 26 slots: bound 7 servers."""
    body: dict[str, Any] = {
        "model": {"name": "deepseek-v3", "experts": 12, "layers": 3, "topK": 2},
        "servers": {"replicas": 8, "slotsPerServer": 4},
        "minReplicasPerExpert": 2,
        "redundantExpertBudget": 2,
    }
    for key, value in extra.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return ExpertPoolSpec.model_validate(body)


def report(
    name: str, uid: str, state: STATE, loaded: int = 0, **extra: Any
) -> zl.ExpertServerReport:
    return zl.ExpertServerReport.model_validate(
        {
            "pod": name,
            "podUid": uid,
            "podIP": "127.0.0.1",
            "port": 8000,
            "node": "n",
            "superpod": "sp",
            "dies": [0],
            "roceIps": ["198.18.0.1"],
            "incarnation": extra.pop("incarnation", f"{name}-1"),
            "ts": 0.0,
            "pool": "ns/pool",
            "slots": 4,
            "loaded": loaded,
            "state": state,
            **extra,
        }
    )


def round_trip(m: em.ExpertMap) -> em.ExpertMap:
    """``m`` written to its znodes and read back."""
    head, layers = m.payloads()
    return em.ExpertMap.of(
        zl.ExpertMapVersion.parse(head.dump()), [zl.ExpertMapLayer.parse(x.dump()) for x in layers]
    )


@dataclasses.dataclass
class World:
    """Pods, reports and the map in force, moved by the plans' actions."""

    spec: ExpertPoolSpec
    pods: dict[str, PodView] = dataclasses.field(default_factory=dict)
    reports: dict[str, zl.ExpertServerReport] = dataclasses.field(default_factory=dict)
    current: em.ExpertMap | None = None
    versions: list[int] = dataclasses.field(default_factory=list)
    status: ExpertPoolStatus = dataclasses.field(default_factory=ExpertPoolStatus)
    now: float = 1000.0
    generation: int = 1
    history: list[em.ExpertMap] = dataclasses.field(default_factory=list)
    auto_load: bool = True
    stored: dict[int, em.ExpertMap] = dataclasses.field(default_factory=dict)  # written ahead
    sampled: dict[str, zl.ExpertServerReport] | None = None
    pointer: bytes | None = None  # the ``map`` znode as the plans' writes left it

    def view(self) -> ep.PoolView:
        return ep.PoolView(
            "ns",
            "pool",
            "uid-pool",
            self.generation,
            "rv1",
            self.spec,
            dict(self.pods),
            dict(self.reports),
            self.current,
            tuple(self.versions),
            ENGINE,
            now=self.now,
            previous=self.status,
            successor=self.stored.get(self.current.version + 1) if self.current else None,
            sampled=self.sampled,
            pointer=zl.ExpertMapPointer.parse(self.pointer) if self.pointer else None,
        )

    def start(self, name: str) -> None:
        uid = f"uid-{name}-{len(self.history)}"
        self.pods[name] = PodView(
            name, uid, {LABEL_EXPERTPOOL: "pool"}, "Running", True, False, "n", "sp", 0.0
        )
        self.reports[name] = report(name, uid, STATE.LOADING)  # in no table yet

    def step(self) -> ep.Plan:
        p = ep.plan(self.view())
        for a in p.actions:
            if isinstance(a, ZnodeChange):
                puts = [op for op in a.znodes(PATHS) if isinstance(op, zl.Put)]
                self.pointer = next((op.data for op in puts if op.path == PATHS.map), self.pointer)
            if isinstance(a, CreateServerPod):
                self.start(a.name)
            elif isinstance(a, DeleteServerPod):
                self.pods.pop(a.name, None)
                self.reports.pop(a.name, None)
            elif isinstance(a, WriteMapVersion):
                assert a.map.version > (self.current.version if self.current else 0)
                if a.stored:  # its head alone written: its layers must be the stored ones
                    was = self.stored[a.map.version]
                    layers = (a.map.held, a.map.disabled, a.map.prefetch)
                    assert layers == (was.held, was.disabled, was.prefetch)
                    assert a.map.servers == was.servers
                self.current = round_trip(a.map)  # as a reader gets it from ZooKeeper
                written = [a.map.version, *(m.version for m in a.ahead)]
                self.versions = sorted(
                    {v for v in self.versions if v not in a.prune} | set(written)
                )
                self.stored = {v: m for v, m in self.stored.items() if v in self.versions}
                self.stored.update({m.version: m for m in a.ahead})
                self.history.append(a.map)
            elif isinstance(a, ScaleServers):
                replicas = a.patch["spec"]["servers"]["replicas"]
                self.spec = self.spec.model_copy(
                    update={"servers": self.spec.servers.model_copy(update={"replicas": replicas})}
                )
                self.generation += 1
        self.status = p.status
        sample = p.status.token_sample
        if sample is not None and sample.at == self.now:  # the handler keeps these reports
            self.sampled = dict(self.reports)
        if self.auto_load:
            self.load()
        self.now += 1.0
        return p

    def load(self) -> None:
        """Every server in the map in force loads it (and a server out of it drains)."""
        m = self.current
        for name, r in list(self.reports.items()):
            if m is not None and name in m.servers:
                self.reports[name] = r.model_copy(
                    update={"loaded": m.version, "state": STATE.SERVING}
                )
            elif name in self.status.draining:
                self.reports[name] = r.model_copy(update={"state": STATE.DRAINING, "in_flight": 0})

    def settle(self, steps: int = 30) -> ep.Plan:
        p = self.step()
        for _ in range(steps):
            if not p.actions:
                return p
            p = self.step()
        raise AssertionError(f"not settled: {p.actions}")

    def traffic(self, per_expert: list[int]) -> None:
        """Each layer's tokens per expert computed by the servers that hold it enabled in the
        map in force, split evenly (the clients' rotation), added to their reports' counts."""
        m = self.current
        assert m is not None
        for n in range(m.layers):
            off = m.disabled[n] if m.disabled else tuple(() for _ in m.servers)
            for expert, tokens in enumerate(per_expert):
                holders = [
                    s
                    for i, s in enumerate(m.servers)
                    if expert in m.held[n][i] and expert not in off[i]
                ]
                for server in holders:
                    r = self.reports[server]
                    counts = {layer: dict(row) for layer, row in r.tokens.items()}
                    row = counts.setdefault(n, {})
                    row[expert] = row.get(expert, 0) + tokens // len(holders)
                    self.reports[server] = r.model_copy(update={"tokens": counts})

    def window(self, per_expert: list[int]) -> ep.Plan:
        """A rebalance interval of traffic, then the pass that samples it."""
        self.traffic(per_expert)
        self.now += self.spec.rebalance.interval_seconds
        return self.step()

    def copies(self, expert: int, layer: int = 0) -> int:
        assert self.current is not None
        return sum(expert in held for held in self.current.held[layer])

    def coverage(self) -> em.Coverage:
        s = self.spec
        live = {n for n in self.reports if n in self.pods}
        return em.coverage(
            self.current, live, s.model.experts, s.model.layers, s.min_replicas_per_expert
        )


def conditions(p: ep.Plan) -> dict[str, tuple[bool, str]]:
    return {c.type: (c.status, c.reason) for c in p.conditions}


def check_map(m: em.ExpertMap, s: ExpertPoolSpec) -> None:
    """Every layer: every expert on >= min distinct servers, no server over its slots,
    redundancy within the budget."""
    for layer in m.held:
        count = [0] * s.model.experts
        for held in layer:
            assert len(held) == len(set(held)) <= s.servers.slots_per_server
            for e in held:
                count[e] += 1
        assert min(count) >= s.min_replicas_per_expert
        assert (
            sum(max(0, c - s.min_replicas_per_expert) for c in count) <= s.redundant_expert_budget
        )


# --------------------------------------------------------------------------- refusals
def test_the_issues_sample_shape_with_8_slots_is_refused_with_the_numbers() -> None:
    s = spec(
        model={"experts": 256, "layers": 58, "topK": 8},
        servers={"replicas": 64, "slotsPerServer": 8},
        redundantExpertBudget=32,
    )
    errors = validation.problems("pool", s)
    assert errors == [
        "spec.servers.replicas: 64 servers x 8 slots = 512 slots per layer, fewer than 256 "
        "experts x 2 replicas + 32 redundant = 544 (at least 68 servers of 8 slots)"
    ]
    fixed = spec(
        model={"experts": 256, "layers": 58, "topK": 8},
        servers={"replicas": 64, "slotsPerServer": 9},
        redundantExpertBudget=32,
    )
    assert validation.problems("pool", fixed) == []
    assert validation.coverage_bound(fixed) == math.ceil(544 / 9) == 61


def test_slots_that_do_not_fit_a_servers_hbm_are_refused_with_the_sizes() -> None:
    s = spec(
        model={"experts": 256, "layers": 58, "topK": 8},
        servers={"replicas": 64, "slotsPerServer": 64},
    )
    (error,) = validation.hbm_problems(s)
    # one DeepSeek expert: 3 x 7168 x 2048 INT8 parameters per layer, over 58 layers
    assert error.startswith("spec.servers.slotsPerServer: 64 slots x 2.55 GB (one deepseek-v3")
    assert "163.5 GB, more than 1 NPUs' 115.2 GB of usable HBM" in error
    two = spec(
        model={"experts": 256, "layers": 58, "topK": 8},
        servers={"replicas": 64, "slotsPerServer": 64, "devicesPerServer": 2},
    )
    assert validation.hbm_problems(two) == []


@pytest.mark.parametrize("name", [None, "llama3-8b", "mystery"])
def test_a_model_whose_expert_size_is_unknown_is_said(name: str | None) -> None:
    (error,) = validation.hbm_problems(spec(model={"name": name}))
    assert error.startswith(f"spec.model.name: {name!r} is not a MoE model the platform knows")
    assert "known: deepseek-v2-lite, deepseek-v3" in error


def test_more_copies_than_servers_is_refused() -> None:
    s = spec(
        servers={"replicas": 3, "slotsPerServer": 64},
        minReplicasPerExpert=4,
        redundantExpertBudget=0,
    )
    errors = validation.capacity_problems(s, 3, "spec.servers.replicas")
    assert errors == [
        "spec.servers.replicas: 3 servers cannot hold minReplicasPerExpert 4 copies of an "
        "expert on distinct servers"
    ]


def test_a_scale_below_the_coverage_bound_is_refused_and_the_bound_itself_is_not() -> None:
    assert validation.coverage_bound(spec()) == 7  # ceil((12 x 2 + 2) / 4)
    assert validation.capacity_problems(spec(), 7, "spec.servers.replicas") == []
    (error,) = validation.capacity_problems(spec(), 6, "spec.servers.replicas")
    assert error == (
        "spec.servers.replicas: 6 servers x 4 slots = 24 slots per layer, fewer than 12 experts "
        "x 2 replicas + 2 redundant = 26 (at least 7 servers of 4 slots)"
    )


def test_autoscaling_bounds_are_checked() -> None:
    errors = validation.autoscaling_problems(
        spec(autoscaling={"enabled": True, "minServers": 9, "maxServers": 6})
    )
    assert errors == [
        "spec.autoscaling.targetTokensPerServerPerSecond: required when autoscaling is enabled",
        "spec.autoscaling.maxServers: 6 is below the coverage bound 7 (the fewest servers that hold the map)",
        "spec.autoscaling.minServers: 9 is above maxServers 6",
    ]


def test_a_known_model_is_served_with_its_own_shape() -> None:
    """The engines route and time by the catalogue's shape: a map of another would leave
    experts without a server. (This module's small shape is for the planner's tests only.)"""
    assert validation.shape_problems(spec()) == [
        "spec.model.experts: 12, but deepseek-v3 has 256 routed experts",
        "spec.model.layers: 3, but deepseek-v3 has 58 MoE layers",
        "spec.model.topK: 2, but deepseek-v3 has 8 experts per token",
    ]
    lite = spec(
        model={"name": "deepseek-v2-lite", "experts": 64, "layers": 26, "topK": 6},
        servers={"replicas": 8, "slotsPerServer": 17},
    )
    assert validation.problems("pool", lite) == []  # 8 x 17 = 136 >= 64 x 2 + 2


# --------------------------------------------------------------------------- the map
@pytest.mark.parametrize("servers", [7, 8, 11, 13])
def test_the_initial_map_puts_each_experts_copies_on_distinct_servers_balanced(
    servers: int,
) -> None:
    s = spec(servers={"replicas": servers})
    m = em.wanted(None, [f"s{i}" for i in range(servers)], 12, 3, 4, 2, 2)
    check_map(m, s)
    for layer in m.held:
        used = [len(h) for h in layer]
        assert max(used) - min(used) <= 1  # balanced slot use
        assert sum(used) == 26  # every copy and the whole budget


def test_a_swap_makes_room_when_the_only_free_slot_is_beside_a_copy() -> None:
    # expert 0 needs a second copy; the only free slots are on server 0, which holds it
    layer = em.place_layer([[0], [1, 2, 3], [1, 2, 3]], 4, 3, 2, 0)
    assert [sum(e in h for h in layer) for e in range(4)] == [2, 2, 2, 2]
    assert all(len(h) <= 3 for h in layer)


def test_coverage_counts_under_replicated_and_uncovered_experts() -> None:
    m = em.wanted(None, ["a", "b", "c"], 3, 1, 2, 2, 0)
    assert em.coverage(m, {"a", "b", "c"}, 3, 1, 2) == em.Coverage(0, 0, 2)
    one_left = em.coverage(m, {"a"}, 3, 1, 2)
    assert one_left.under_replicated == 3
    assert one_left.uncovered == 3 - len(m.held[0][0])


def test_every_version_of_a_walk_round_trips_through_its_payloads() -> None:
    target = em.wanted(None, ["a", "b", "c"], 3, 2, 2, 2, 0)
    walk = rebalance.change(None, target, 1, "initial", 5.0)
    # nothing to stage nor free on servers that hold nothing: straight to Load
    assert [(m.version, m.phase) for m in walk] == list(enumerate(NEWCOMER, start=1))
    for m in (*walk, *em.stamped(None, walk)):
        assert round_trip(m) == m
    load, steady = walk
    # every slot of a new pool is disabled until loaded: no client routes to it
    assert all(not any(r) for r in load.payloads()[1][0].routes(3))
    assert steady.held == target.held
    assert steady.disabled == steady.prefetch == ()


# --------------------------------------------------------------------------- the pool
def test_a_new_pool_creates_its_servers_then_loads_then_enables_the_map() -> None:
    w = World(spec())
    first = w.step()
    assert sorted(a.name for a in first.actions if isinstance(a, CreateServerPod)) == [
        f"pool-s{i}" for i in range(8)
    ]
    assert conditions(first)["Available"] == (False, "NoMap")
    p = w.step()
    assert w.current is not None
    assert w.current.phase is zl.ExpertMapPhase.LOAD
    # its first map's copies loading are no failure
    assert conditions(p)["Degraded"] == (False, "Healthy")
    p = w.settle()
    assert [m.phase for m in w.history] == NEWCOMER
    assert w.current is not None
    assert len(w.current.servers) == 8
    check_map(w.current, w.spec)
    assert conditions(p) == {
        "Available": (True, "Covered"),
        "FullyReplicated": (True, "Replicated"),
        "Rebalancing": (False, "Steady"),
        "Degraded": (False, "Healthy"),
        "Ready": (True, "Covered"),
    }
    assert p.status.ready_servers == 8
    assert p.status.selector == "matrixserve.io/expertpool=pool"  # the scale subresource's
    assert p.status.map_version == 2
    assert p.status.coverage.uncovered == 0
    assert p.status.coverage_bound == 7
    manifest = next(a for a in first.actions if isinstance(a, CreateServerPod)).manifest
    env = {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}
    assert (env["ENGINE_ROLE"], env["MATRIXSERVE_EXPERT_POOL"]) == ("expert", "ns/pool")
    assert env["ENGINE_EXPERT_SLOTS"] == "4"
    assert manifest["metadata"]["labels"][LABEL_EXPERTPOOL] == "pool"
    assert manifest["metadata"]["ownerReferences"][0]["kind"] == "ExpertPool"


def test_a_server_gone_is_dropped_at_once_then_replaced_and_restored() -> None:
    w = World(spec())
    w.settle()
    before = w.current
    assert before is not None
    since = len(w.history)
    victim = "pool-s3"
    w.reports.pop(victim)  # its session ended: the ephemeral report is gone
    w.pods.pop(victim)  # and the pod with it (deleted by hand, evicted)
    p = w.step()
    writes = [a for a in p.actions if isinstance(a, WriteMapVersion)]
    assert len(writes) == 1
    assert writes[0].describe().reason == "ServerFailed"
    dropped = writes[0].map
    assert victim not in dropped.servers
    assert dropped.version == before.version + 1
    # what it held is still covered by the copies elsewhere (minReplicas 2)
    assert p.status.coverage.uncovered == 0
    assert p.status.coverage.under_replicated > 0
    assert conditions(p)["Degraded"] == (True, "FailedOver")
    assert conditions(p)["FullyReplicated"][0] is False
    assert p.status.last_failover is not None
    assert p.status.last_failover.servers == [victim]
    # the replacement takes the name its predecessor left, obtained cold (no warm claim yet)
    (created,) = [a for a in p.actions if isinstance(a, CreateServerPod)]
    assert created.name == victim
    failover = p.status.last_failover
    assert (failover.replacement, failover.replacement_path) == (victim, "Cold")
    assert failover.replacement_estimate_seconds == created.estimate_seconds
    record = json.loads(created.manifest["metadata"]["annotations"][ANNOTATION_OBTAINED])
    assert record["path"] == "Cold"
    assert record["estimateSeconds"] == created.estimate_seconds
    p = w.settle()
    assert w.current is not None
    assert victim in w.current.servers
    check_map(w.current, w.spec)
    assert conditions(p)["FullyReplicated"] == (True, "Replicated")
    assert conditions(p)["Degraded"] == (False, "Healthy")
    assert p.status.last_failover is not None
    assert p.status.last_failover.restored_version == w.current.version
    # the restore loaded the newcomer's slots (disabled until loaded), then enabled them
    assert [m.phase for m in w.history[since + 1 :]] == NEWCOMER
    # coverage never fell to zero for any expert on the way
    for m in w.history[since:]:
        assert em.coverage(m, set(m.servers), 12, 3, 2).uncovered == 0
    # no other server's rows changed on the way: each keeps its stamp, and reads heads alone
    stamp = dict(zip(before.servers, before.rows_at, strict=True))
    assert all(stamp.values())
    for m in w.history[since:]:
        for server, since_version in zip(m.servers, m.rows_at, strict=True):
            if server == victim:
                assert since_version == m.version  # the newcomer's rows are new each time
            else:
                assert since_version == stamp[server], (m.version, server)


def test_a_restarted_engine_is_failed_over_and_taken_back() -> None:
    w = World(spec())
    w.settle()
    name = "pool-s1"
    r = w.reports[name]
    w.reports[name] = r.model_copy(update={"incarnation": "new", "loaded": 0})
    p = w.step()
    (write,) = [a for a in p.actions if isinstance(a, WriteMapVersion)]
    assert name not in write.map.servers
    assert "restarted" in write.map.reason
    # out of the table, the new engine drains what it was sent: still taken back
    w.reports[name] = w.reports[name].model_copy(update={"state": STATE.DRAINING})
    w.settle()
    assert w.current is not None
    assert name in w.current.servers
    assert w.status.members[name] == "new"


def scaling_down_to_7() -> World:
    """A settled pool of 8 whose spec now asks 7, its servers loading only when told."""
    w = World(spec())
    w.settle()
    w.spec = spec(servers={"replicas": 7})
    w.generation += 1
    w.auto_load = False
    return w


def test_scale_down_drains_one_server_keeping_coverage_then_deletes_it() -> None:
    w = scaling_down_to_7()
    p = w.step()
    (write,) = [a for a in p.actions if isinstance(a, WriteMapVersion)]
    # the whole walk written at once, the pointer on its first phase; the victim in its table
    # (the others have room for its copies: nothing to disable)
    assert [write.map.phase, *(m.phase for m in write.ahead)] == DRAIN
    assert "pool-s7" in write.map.servers
    assert p.status.draining == ["pool-s7"]
    assert conditions(p)["Rebalancing"] == (True, "Prefetch")
    assert not any(isinstance(a, DeleteServerPod) for a in p.actions)
    for phase in DRAIN[1:]:
        # nothing moves before every server says it applied the version in force
        assert not [a for a in w.step().actions if isinstance(a, WriteMapVersion)]
        w.load()
        p = w.step()
        (write,) = [a for a in p.actions if isinstance(a, WriteMapVersion)]
        assert write.map.phase is phase
        if phase is not zl.ExpertMapPhase.STEADY:
            # the victim serves its experts, enabled, until their new copies are
            assert "pool-s7" in write.map.servers
            assert em.coverage(write.map, set(write.map.servers), 12, 3, 2).under_replicated == 0
    assert write.map.steady
    assert "pool-s7" not in write.map.servers
    assert em.coverage(write.map, set(write.map.servers), 12, 3, 2).under_replicated == 0
    # out of the map, still finishing: not deleted
    w.reports["pool-s7"] = w.reports["pool-s7"].model_copy(
        update={"state": STATE.DRAINING, "in_flight": 3}
    )
    assert not any(isinstance(a, DeleteServerPod) for a in w.step().actions)
    w.reports["pool-s7"] = w.reports["pool-s7"].model_copy(update={"in_flight": 0})
    p = w.step()
    assert [a.name for a in p.actions if isinstance(a, DeleteServerPod)] == ["pool-s7"]
    p = w.settle()
    assert p.status.draining == []
    assert len(w.pods) == 7
    assert conditions(p)["FullyReplicated"] == (True, "Replicated")


def test_a_walks_next_phase_rewrites_its_head_alone_a_new_version_is_created_first() -> None:
    w = scaling_down_to_7()
    (write,) = [a for a in w.step().actions if isinstance(a, WriteMapVersion)]
    assert not write.stored
    puts = [op for op in write.znodes(PATHS) if isinstance(op, zl.Put) and op.path != PATHS.map]
    assert len(puts) == len(DRAIN) * (3 + 1)  # every version written ahead: 3 layers and a head
    heads = {PATHS.version(m.version) for m in (write.map, *write.ahead)}
    # the layers created first (one round trip each), each head set once they are there
    assert [op.new for op in puts] == [op.path not in heads for op in puts]
    w.load()
    (write,) = [a for a in w.step().actions if isinstance(a, WriteMapVersion)]
    assert write.stored  # the next phase, stored already: its head alone, stamped now
    ops = write.znodes(PATHS)
    puts = [op for op in ops if isinstance(op, zl.Put)]
    assert [op.path for op in puts] == [PATHS.version(write.map.version), PATHS.map]
    assert not puts[0].new
    assert zl.ExpertMapVersion.parse(puts[0].data).at == write.map.at


def test_stamps_follow_each_servers_rows_through_a_walk() -> None:
    a = em.wanted(None, ["a", "b", "c"], 3, 2, 2, 2, 0)
    first = em.stamped(None, [replace(a, version=1, at=0.5)])[0]
    assert (first.rows_at, first.origin) == ((1, 1, 1), 0.5)  # a history begins
    # c gone: a and b keep their stamps; d joins with nothing, then loads
    dropped = first.without(["c"], 2, "failover", 1.0)
    target = em.wanted(dropped, ["a", "b", "d"], 3, 2, 2, 2, 0)
    walk = rebalance.change(dropped, target, 3, "copies restored", 2.0)
    stamped = em.stamped(first, [dropped, *walk])
    assert [m.rows_at for m in stamped] == [(1, 1), (1, 1, 3), (1, 1, 4)]
    assert {m.origin for m in stamped} == {0.5}
    # a row that changes is stamped anew, and its stamp then kept while it stays
    row = ((0,), *stamped[-1].held[0][1:])
    moved = replace(stamped[-1], version=5, held=(row, row))
    again = em.stamped(stamped[-1], [moved, replace(moved, version=6)])
    assert [m.rows_at for m in again] == [(5, 1, 4), (5, 1, 4)]
    # unknown stamps, or a version of no known history (written before them): every row new
    assert em.stamped(replace(first, rows_at=()), [dropped])[0].rows_at == (2, 2)
    other = em.stamped(replace(first, origin=0.0), [dropped])[0]
    assert (other.rows_at, other.origin) == ((2, 2), 1.0)
    # enabling every slot changes rows: such a map carries no stamps until it is written
    assert first.enabled(7, "x", 3.0).rows_at == ()


def test_scale_up_adds_one_server_that_takes_a_share_of_the_slots() -> None:
    w = World(spec(servers={"replicas": 7}))
    w.settle()
    w.spec = spec()
    w.generation += 1
    w.settle()
    assert w.current is not None
    assert "pool-s7" in w.current.servers
    check_map(w.current, w.spec)
    for layer in w.current.held:
        assert len(layer[w.current.servers.index("pool-s7")]) >= 3  # not left idle


def test_every_version_written_prunes_all_but_the_last_two() -> None:
    w = World(spec())
    w.settle()
    w.reports.pop("pool-s0")
    w.pods.pop("pool-s0")
    w.settle()
    assert len(w.versions) == 2
    assert w.current is not None
    assert w.current.version == max(w.versions)


# --------------------------------------------------------------------------- autoscaler
def test_the_autoscaler_is_clamped_to_the_coverage_bound_and_max() -> None:
    s = spec(
        autoscaling={
            "enabled": True,
            "minServers": 2,
            "maxServers": 10,
            "targetTokensPerServerPerSecond": 100,
        }
    )
    bound = validation.coverage_bound(s)
    assert autoscale.bounds(s, bound) == (7, 10)

    def asked(goals: list[int], rate: float = 10.0) -> ExpertTokenSample:
        return ExpertTokenSample(at=0.0, tokensPerSecond=rate, goals=goals)

    low = [7] * autoscale.STABILIZATION_SAMPLES
    # little traffic: never below the bound; one step down
    assert autoscale.goal(s, bound, 10.0) == 7
    assert autoscale.servers_wanted(s, bound, asked(low), None, 0.0) == 7
    at_bound = s.model_copy(update={"servers": s.servers.model_copy(update={"replicas": 7})})
    assert autoscale.goal(at_bound, bound, 10.0) == 7
    assert autoscale.servers_wanted(at_bound, bound, asked(low), None, 0.0) is None
    # much traffic: never above max; one step up, at once
    assert autoscale.goal(s, bound, 10_000.0) == 10
    busy = asked([10], 10_000.0)
    assert autoscale.servers_wanted(s, bound, busy, None, 0.0) == 9
    at_max = s.model_copy(update={"servers": s.servers.model_copy(update={"replicas": 10})})
    assert autoscale.servers_wanted(at_max, bound, busy, None, 0.0) is None
    # within the cooldown of the last change: nothing
    cooling = autoscale.COOLDOWN_SECONDS
    assert autoscale.servers_wanted(s, bound, busy, 0.0, cooling - 1) is None
    assert autoscale.servers_wanted(s, bound, busy, 0.0, cooling) == 9
    # no rate, or autoscaling off: nothing asked
    assert autoscale.goal(s, bound, None) is None
    assert autoscale.servers_wanted(s, bound, None, None, 0.0) is None


def test_the_autoscaler_holds_within_its_tolerance_and_steps_down_only_when_asked_a_while() -> None:
    s = spec(
        servers={"replicas": 9},
        autoscaling={"enabled": True, "maxServers": 10, "targetTokensPerServerPerSecond": 100},
    )
    bound = validation.coverage_bound(s)
    # sized for 900 tokens/s: within 10% the spec's count stands (no flapping on noise)
    assert [autoscale.goal(s, bound, r) for r in (810.0, 900.0, 989.0)] == [9, 9, 9]
    assert autoscale.goal(s, bound, 799.0) == 8
    assert autoscale.goal(s, bound, 991.0) == 10
    # down, the count the rate asks for, not the tolerance's edge: a walk one step at a time
    # from 64 reaches 40 for 4,000 tokens/s (held at 10% it would stop at 44)
    wide = s.model_copy(
        update={"autoscaling": s.autoscaling.model_copy(update={"max_servers": 64})}
    )
    for servers in range(41, 65):
        at = wide.model_copy(
            update={"servers": wide.servers.model_copy(update={"replicas": servers})}
        )
        assert autoscale.goal(at, bound, 4000.0) == 40, servers

    def wanted(goals: list[int]) -> int | None:
        sample = ExpertTokenSample(at=0.0, tokensPerSecond=799.0, goals=goals)
        return autoscale.servers_wanted(s, bound, sample, None, 0.0)

    window = autoscale.STABILIZATION_SAMPLES
    assert wanted([8] * (window - 1)) is None  # not asked long enough
    assert wanted([8, 8, 9] + [8] * (window - 3)) is None  # one sample in the window wanted 9
    assert wanted([9] + [8] * window) == 8  # the window: the last samples
    # the window is what the samples asked, newest last, at most its length
    sample = ExpertTokenSample(at=0.0, goals=list(range(window)))
    assert autoscale.recorded(sample, 99).goals == [*range(1, window), 99]


def test_the_token_rate_is_each_servers_over_its_own_reports_times() -> None:
    def at(name: str, ts: float, tokens: dict[int, dict[int, int]]) -> zl.ExpertServerReport:
        return report(name, "u", STATE.SERVING, tokens=tokens).model_copy(update={"ts": ts})

    c_ts = 98.00000049  # finer than the status keeps (the microsecond)
    first = autoscale.sample(
        None,
        {
            "a": at("a", 99.0, {0: {1: 100, 2: 100}}),
            "b": at("b", 95.0, {0: {1: 50}}),
            "c": at("c", c_ts, {0: {1: 10}}),
        },
        100.0,
    )
    assert first.tokens == {"a": 200, "b": 50, "c": 10}
    assert first.reported_at == {"a": 99.0, "b": 95.0, "c": 98.0}
    assert first.tokens_per_second is None
    # the next pass reads it back from the status, as it was stored
    first = ExpertTokenSample.model_validate(first.model_dump(by_alias=True, mode="json"))
    assert autoscale.sample(first, {}, 105.0) is first  # too soon
    second = autoscale.sample(
        first,
        {
            "a": at("a", 109.0, {0: {1: 600, 2: 600}}),  # 1000 over its 10 s: 100/s
            "b": at("b", 105.0, {0: {1: 20}}),  # restarted: its window not known
            "c": at("c", c_ts, {0: {1: 10}}),  # its report not rewritten yet
            "d": at("d", 108.0, {0: {1: 70}}),  # new: a scale-up's, no traffic to speak of
        },
        110.0,
    )
    # a's rate, taken for each of the three of both samples (the samples' own 10 s would have
    # said 102/s for a alone: its reports were 10 s apart, the samples' reads too, but not the
    # same 10 s); c's report did not move: not a rate of 0
    assert second.tokens_per_second == 300.0
    # a sample stored before report times were kept: the samples' own times
    old = ExpertTokenSample(at=100.0, tokens={"a": 200})
    third = autoscale.sample(old, {"a": at("a", 200.0, {0: {1: 700}})}, 110.0)
    assert third.tokens_per_second == 50.0
    # no report moved: no rate
    assert (
        autoscale.sample(third, {"a": at("a", 200.0, {0: {1: 700}})}, 130.0).tokens_per_second
        is None
    )


def test_the_pool_scales_itself_down_one_step_when_traffic_falls() -> None:
    s = spec(
        autoscaling={
            "enabled": True,
            "minServers": 7,
            "maxServers": 8,
            "targetTokensPerServerPerSecond": 1000,
        }
    )
    w = World(s)
    w.settle()

    def sampled(goals: list[int]) -> None:
        """A sample 20 s ago, every server's report 10 s before the ones they have now."""
        previous = ExpertTokenSample(
            at=w.now - 20,
            tokens=dict.fromkeys(w.reports, 0),
            reportedAt={name: r.ts - 10 for name, r in w.reports.items()},
            goals=goals,
        )
        w.status = w.status.model_copy(update={"token_sample": previous})

    window = autoscale.STABILIZATION_SAMPLES
    sampled([7] * (window - 2))  # with this pass's sample, one short of the window
    p = w.step()
    assert not [a for a in p.actions if isinstance(a, ScaleServers)]
    assert p.status.token_sample is not None
    assert p.status.token_sample.goals == [7] * (window - 1)  # this sample's goal recorded
    sampled([7] * (window - 1))
    p = w.step()
    (scale,) = [a for a in p.actions if isinstance(a, ScaleServers)]
    assert scale.patch == {"spec": {"servers": {"replicas": 7}}}
    assert scale.resource_version == "rv1"
    assert scale.describe().reason == "Autoscaled"
    # autoscaling off: what the samples asked before is no window any more
    w.spec = w.spec.model_copy(
        update={"autoscaling": w.spec.autoscaling.model_copy(update={"enabled": False})}
    )
    sampled([7] * window)
    p = w.step()
    assert not [a for a in p.actions if isinstance(a, ScaleServers)]
    assert p.status.token_sample is not None
    assert p.status.token_sample.goals == []


def test_a_server_is_priced_by_its_slots_weights_not_the_models() -> None:
    s = spec(
        model={"experts": 256, "layers": 58, "topK": 8},
        servers={"replicas": 64, "slotsPerServer": 9},
        redundantExpertBudget=32,
    )
    engine = EngineSettings(zookeeper="z", time_scale="10")
    record = obtain.choose(s, engine, "pool-s0", 5.0)
    assert record is not None
    assert record.path == "Cold"
    weights = 9 * 3 * 7168 * 2048 * 58  # nine INT8 DeepSeek experts over 58 layers
    load = weights / PRIOR_RATES[LoadSource.SHARED_FILE_SERVICE] / 10
    assert record.phases["TELoad"] == pytest.approx(load, abs=1e-3)
    assert record.phases["TEPreLoad"] == pytest.approx(PRIOR_TE_PRE_LOAD_SECONDS / 10)
    assert record.estimate_seconds == pytest.approx(sum(record.phases.values()), abs=1e-2)
    only_warm = EngineSettings(zookeeper="z", scale_out_paths=("WarmDRAM",))
    assert obtain.choose(s, only_warm, "pool-s0", 5.0) is None


def test_a_template_the_running_servers_were_not_made_from_is_refused() -> None:
    w = World(spec())
    manifest = next(a for a in w.step().actions if isinstance(a, CreateServerPod)).manifest
    made = dict(manifest["metadata"]["annotations"])
    pod = dataclasses.replace(w.pods["pool-s0"], annotations=made)
    assert template_changes(spec(), [pod]) == []
    assert template_changes(spec(servers={"replicas": 9}), [pod]) == []  # a scale is no change
    (error,) = template_changes(spec(servers={"slotsPerServer": 5}), [pod, pod])
    assert error.startswith(
        "spec.servers.slotsPerServer: 5, but the running servers were made with 4"
    )


@pytest.mark.parametrize(
    ("name", "needed", "slots", "bound"),
    [("expertpool.yaml", 544, 576, 61), ("expertpool-small.yaml", 160, 192, 5)],
)
def test_the_samples_are_pools_the_controller_runs(
    name: str, needed: int, slots: int, bound: int
) -> None:
    """As their comments say (the small one fits `make demo`'s cluster)."""
    sample = Path(__file__).resolve().parents[2] / "crds" / "samples" / name
    body = yaml.safe_load(sample.read_text())
    parsed, errors = validation.parse(body)
    assert errors == []
    assert parsed is not None
    assert validation.slots_needed(parsed) == needed
    assert parsed.servers.replicas * parsed.servers.slots_per_server == slots
    assert validation.coverage_bound(parsed) == bound


# --------------------------------------------------------------------------- EPLB
HOT = [3000] + [100] * 11  # expert 0 30x the others' (Fig. 11a's hottest over the mean)


def full_pool(**extra: Any) -> World:
    """8 servers x 4 slots = 32 = 12 experts x 2 copies + 8 redundant: every slot taken, so a
    new replica of a hot expert replaces a cold expert's redundant copy (Disable frees it)."""
    w = World(spec(redundantExpertBudget=8, **extra))
    w.settle()
    w.window([0] * 12)  # the first window: no tokens, nothing to balance
    return w


def walk_step(w: World) -> WriteMapVersion | None:
    writes = [a for a in w.step().actions if isinstance(a, WriteMapVersion)]
    return writes[0] if writes else None


def test_a_hot_expert_is_replicated_through_the_four_phases_each_waiting_for_the_servers() -> None:
    w = full_pool()
    w.auto_load = False
    before = w.copies(0)
    p = w.window(HOT)
    (write,) = [a for a in p.actions if isinstance(a, WriteMapVersion)]
    assert write.describe().reason == "Rebalance"
    assert "imbalance" in write.describe().message
    assert [write.map.phase, *(m.phase for m in write.ahead)] == PHASES
    first = write.map.version
    last = p.status.last_rebalance
    assert last is not None
    assert last.versions == list(range(first, first + 5))
    assert last.imbalance_after < last.imbalance_before
    assert last.moe_time_after < last.moe_time_before
    assert (last.ended_version, last.outcome) == (None, None)
    hot = p.status.hot_experts[0]
    assert (hot.expert, hot.tokens) == (0, 3000)
    assert hot.ratio == pytest.approx(3000 / (4100 / 12), abs=0.05)
    assert conditions(p)["Rebalancing"] == (True, "Prefetch")
    seen = [write.map]
    for phase in PHASES[1:]:
        assert walk_step(w) is None  # no server has applied the version in force
        m = w.current
        assert m is not None
        if m.phase is zl.ExpertMapPhase.LOAD:
            loading = m.loading()
            assert loading  # the hot expert's new copies, disabled while they load
            w.load()
            w.reports[loading[0]] = w.reports[loading[0]].model_copy(
                update={"loaded": m.version - 1, "state": STATE.LOADING}
            )
            assert walk_step(w) is None  # one server still loading
        w.load()
        moved = walk_step(w)
        assert moved is not None
        assert moved.map.phase is phase
        seen.append(moved.map)
    disable = seen[1]
    assert any(any(server) for layer in disable.disabled for server in layer)  # slots freed
    for m in seen:  # no expert below its replicas at any phase
        assert em.coverage(m, set(m.servers), 12, 3, 2).under_replicated == 0
    assert w.copies(0) > before
    p = w.settle()
    assert p.status.last_rebalance is not None
    assert p.status.last_rebalance.ended_version == first + 4
    assert p.status.last_rebalance.outcome == "Completed"
    assert conditions(p)["Rebalancing"] == (False, "Steady")
    # the same load again: each further rebalance lowers the simulated time, until none does
    times = [p.status.last_rebalance.moe_time_after]
    for _ in range(4):
        if not [a for a in w.window(HOT).actions if isinstance(a, WriteMapVersion)]:
            break
        w.settle()
        assert w.status.last_rebalance is not None
        times.append(w.status.last_rebalance.moe_time_after)
    else:
        raise AssertionError(f"still rebalancing the same load: {times}")
    assert times == sorted(times, reverse=True)


@pytest.mark.parametrize("phase", PHASES[:-1])
def test_a_failover_preempts_a_rebalance_never_leaving_an_expert_without_a_copy(
    phase: zl.ExpertMapPhase,
) -> None:
    w = full_pool()
    w.auto_load = False
    w.window(HOT)
    while w.current is not None and w.current.phase is not phase:
        w.load()
        walk_step(w)
    m = w.current
    assert m is not None
    since = len(w.history)
    # the server with the most at stake: one freeing or loading slots, if any
    victim = (m.loading() or [s for i, s in enumerate(m.servers) if any(
        layer[i] for layer in m.disabled
    )] or [m.servers[0]])[0]  # fmt: skip
    w.reports.pop(victim)
    w.pods.pop(victim)
    p = w.step()
    (write,) = [a for a in p.actions if isinstance(a, WriteMapVersion)]
    assert write.describe().reason == "ServerFailed"
    assert write.ahead == ()
    # the rest of the walk is pruned: nothing stored after the failover's version
    assert [v for v in w.versions if v > write.map.version] == []
    if phase in (zl.ExpertMapPhase.PREFETCH, zl.ExpertMapPhase.DISABLE):
        assert write.map.steady  # the old slots, still held, enabled again
    else:
        assert write.map.phase is phase
    w.auto_load = True
    p = w.settle()
    while p.status.coverage.under_replicated or not (w.current and w.current.steady):
        p = w.settle()  # a pass that only waits for the servers has no actions
    for m in w.history[since:]:
        live = set(m.servers) - {victim}
        assert em.coverage(m, live, 12, 3, 2).uncovered == 0, (m.version, m.phase)
    last = p.status.last_rebalance
    assert last is not None
    assert last.outcome == "Preempted"
    assert conditions(p)["FullyReplicated"] == (True, "Replicated")
    assert w.current is not None
    assert w.current.steady


def test_a_skew_under_the_threshold_is_left_alone_and_its_hot_experts_said() -> None:
    w = full_pool(rebalance={"imbalancePercentThreshold": 1000})
    p = w.window(HOT)
    assert not [a for a in p.actions if isinstance(a, WriteMapVersion)]
    assert p.status.hot_experts[0].expert == 0
    assert p.status.rebalance_checked_at == w.now - 1
    assert p.status.last_rebalance is None
    assert conditions(p)["Rebalancing"] == (False, "Steady")


def test_even_traffic_changes_nothing_and_windows_wait_for_the_interval() -> None:
    w = full_pool()
    m = w.current
    assert m is not None
    p = w.window([600] * 12)
    assert not [a for a in p.actions if isinstance(a, WriteMapVersion)]
    assert w.current == m
    checked = p.status.rebalance_checked_at
    assert checked is not None
    # skewed traffic inside the interval: not looked at before the interval has passed
    w.traffic(HOT)
    w.now += autoscale.SAMPLE_SECONDS
    p = w.step()
    assert p.status.rebalance_checked_at == checked
    assert not [a for a in p.actions if isinstance(a, WriteMapVersion)]
