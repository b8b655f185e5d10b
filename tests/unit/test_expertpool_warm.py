"""ExpertPool servers from a WarmPool (pure decisions, the finalizer and the metrics adapter):
a replacement or new server is priced warm against cold and a warm pod claimed when faster,
labelled as the ExpertPool's claim; its assignment makes the warm engine an expert server of
the pool; an engine that exited is replaced by a warm pod rather than restarted in place when
that is cheaper (recovery's choice), restarted in place otherwise (its lingering report not
taken back); a claimed pod that never serves is released with its assignment; a deleted
pool's claims leave no assignment behind; the metrics count a failover once, by path."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import types
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from matrixserve.adapters.expertpool_metrics import ExpertPoolMetrics
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_settings import EngineEnv
from matrixserve.api.resources import WarmClaim, WarmPoolSpec
from matrixserve.api.status import ExpertFailoverStatus
from matrixserve.domain import expertpool as ep
from matrixserve.domain import warmclaim
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.expertpool import obtain, warm
from matrixserve.domain.expertpool.plan import CreateServerPod, DeleteServerPod
from matrixserve.domain.expertpool.pods import LABEL_EXPERTPOOL
from matrixserve.domain.observed import PodView
from matrixserve.domain.warmpool.pods import pod_labels as warm_labels
from matrixserve.domain.warmpool.pods import template as warm_template
from matrixserve.handlers.expertpool import ExpertPools
from unit.test_expertpool import STATE, World, report, spec

pytestmark = pytest.mark.unit
SHAPE = WarmPoolSpec.model_validate({"shapes": [{"name": "one", "size": 2, "devicesPerPod": 1}]})


def warm_pod(name: str, devices: int = 1) -> tuple[PodView, zl.WarmReport]:
    shape = SHAPE.shapes[0].model_copy(update={"devices_per_pod": devices})
    pod = PodView(
        name,
        f"uid-{name}",
        warm_labels("wp", "one", shape),
        "Running",
        True,
        False,
        "n1",
        "sp0",
        0.0,
        annotations={kinds.ANNOTATION_WARM_TEMPLATE: warm_template(shape, SHAPE.image)},
        resource_version="7",
    )
    said = zl.WarmReport(
        pod=name,
        podUid=pod.uid,
        podIP="127.70.0.9",
        port=8000,
        node="n1",
        superpod="sp0",
        dies=[0, 1],
        roceIps=["198.19.0.1", "198.19.0.2"],
        incarnation="w1",
        ts=0.0,
    )
    return pod, said


@dataclasses.dataclass
class WarmWorld(World):  # type: ignore[misc]  # (World: a sibling test module's, untyped here)
    """The pool's world with a WarmPool beside it: claims move warm pods into the pool (the
    patch's labels, annotations and owner applied), assignments are recorded."""

    auto_load: bool = True  # (World's, typed here)
    warm_pods: dict[str, PodView] = dataclasses.field(default_factory=dict)
    warm_reports: dict[str, zl.WarmReport] = dataclasses.field(default_factory=dict)
    assigned: dict[str, zl.Assignment] = dataclasses.field(default_factory=dict)

    def add_warm(self, *names: str, devices: int = 1) -> None:
        for name in names:
            self.warm_pods[name], self.warm_reports[name] = warm_pod(name, devices)

    def view(self) -> ep.PoolView:
        plain: ep.PoolView = super().view()
        return dataclasses.replace(
            plain,
            warm_pods=dict(self.warm_pods),
            warm_reports=dict(self.warm_reports),
            assigned=frozenset(self.assigned),
        )

    def apply_warm(self, p: ep.Plan) -> None:
        for a in p.actions:
            if isinstance(a, warm.ClaimWarmServer):
                pod = self.warm_pods.pop(a.name)
                self.warm_reports.pop(a.name)
                self.pods[a.name] = dataclasses.replace(
                    pod,
                    labels={**pod.labels, **a.patch["labels"]},
                    annotations={**pod.annotations, **a.patch["annotations"]},
                    resource_version="8",
                )
            elif isinstance(a, warm.AssignWarmServer):
                self.assigned[a.pod] = a.assignment
            elif isinstance(a, warm.ForgetAssignment):
                self.assigned.pop(a.pod, None)

    def warm_step(self) -> ep.Plan:
        auto: bool = self.auto_load
        self.auto_load = False
        p: ep.Plan = self.step()
        self.auto_load = auto
        self.apply_warm(p)
        if auto:
            self.load()
        return p

    def serve(self, name: str) -> None:
        """The claimed engine became the server its assignment says: it reports to the pool."""
        assert name in self.assigned
        self.reports[name] = report(name, self.pods[name].uid, STATE.LOADING, incarnation="a1")


def settled_world(**extra: Any) -> WarmWorld:
    w = WarmWorld(spec(**extra))
    w.settle()
    assert w.current is not None
    assert len(w.current.servers) == 8
    return w


def actions(p: ep.Plan, kind: type) -> list[Any]:
    return [a for a in p.actions if isinstance(a, kind)]


# --------------------------------------------------------------------------- the path
def test_a_replacement_is_a_warm_pod_when_faster_claimed_as_the_expert_pools() -> None:
    w = settled_world()
    w.add_warm("wp-one-a")
    w.pods.pop("pool-s3")
    w.reports.pop("pool-s3")  # the pod gone with its server (evicted)
    p = w.warm_step()
    assert not actions(p, CreateServerPod), "no cold pod beside the warm one"
    (claim,) = actions(p, warm.ClaimWarmServer)
    assert claim.name == "wp-one-a"
    assert claim.resource_version == "7"
    # priced: the warm path beat the cold one by estimate (no pod start, no TE-Pre-Load)
    record = WarmClaim.model_validate_json(claim.patch["annotations"][kinds.ANNOTATION_CLAIM])
    assert record.path == claim.path == "WarmSharedFileService"
    assert (
        record.considered["Cold"]
        > record.considered["WarmSharedFileService"]
        == claim.estimate_seconds
    )
    # the claim names the kind, makes it a server pod of the pool, owned by the pool
    labels = claim.patch["labels"]
    assert labels[kinds.LABEL_CLAIMED_KIND] == "ExpertPool"
    assert labels[kinds.LABEL_CLAIMED_BY] == "pool"
    assert labels[LABEL_EXPERTPOOL] == "pool"
    (owner,) = claim.patch["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ExpertPool", "pool", "uid-pool")
    failover = p.status.last_failover
    assert failover is not None
    assert (failover.replacement, failover.replacement_path) == (
        "wp-one-a",
        "WarmSharedFileService",
    )
    # next pass: the claimed pod has not reported: its assignment, once
    p = w.warm_step()
    (assign,) = actions(p, warm.AssignWarmServer)
    a = assign.assignment
    assert (a.pod_uid, a.group, a.instance) == ("uid-wp-one-a", "ns/pool", "wp-one-a")
    env = {EngineEnv.name(f): v for f, v in [("role", "expert"), ("expert_pool", "ns/pool")]}
    assert {k: a.env[k] for k in env} == env
    assert a.env[EngineEnv.name("expert_slots")] == "4"
    assert a.env[EngineEnv.name("model")] == "deepseek-v3"
    assert set(a.env) <= zl.ASSIGNMENT_ENV
    assert a.load_source == "SharedFileService"
    assert [z.path for z in assign.znodes(zl.ExpertPoolPaths("ns", "pool"))] == [
        zl.WarmPaths("ns").assignment("wp-one-a")
    ]
    assert not actions(w.warm_step(), warm.AssignWarmServer), "written once"
    w.serve("wp-one-a")
    p = w.settle()
    assert w.current is not None
    assert "wp-one-a" in w.current.servers
    restored = p.status.last_failover
    assert restored is not None
    assert restored.restored_version == w.current.version
    assert restored.restored_seconds == pytest.approx(restored.restored_at - restored.at)


def test_cold_when_no_warm_pod_fits_or_cold_is_the_only_path_allowed() -> None:
    w = settled_world()
    w.add_warm("wp-two-a", devices=2)  # two NPUs: not a one-NPU server's stand-in
    w.pods.pop("pool-s3")
    w.reports.pop("pool-s3")
    p = w.warm_step()
    assert not actions(p, warm.ClaimWarmServer)
    (created,) = actions(p, CreateServerPod)
    assert created.path == "Cold"
    fits, said = warm_pod("x")
    pods = warm.candidates(
        dataclasses.replace(w.view(), warm_pods={"x": fits}, warm_reports={"x": said})
    )
    assert [p.name for p in pods] == ["x"]
    only_cold = EngineSettings(zookeeper="z", scale_out_paths=("Cold",))
    (choice,) = obtain.paths(w.spec, only_cold, ["s"], pods)
    assert choice.warm_pod is None
    (choice,) = obtain.paths(w.spec, EngineSettings(zookeeper="z"), ["s"], pods)
    assert choice.warm_pod == "x"


# --------------------------------------------------------------------------- exited engines
def kill(w: WarmWorld, server: str) -> None:
    """The server's engine exits: the kubelet restarts its container (the count says so at
    once); its report lingers until its session ends."""
    pod = w.pods[server]
    w.pods[server] = dataclasses.replace(pod, restarts=pod.restarts + 1)


def killed(w: WarmWorld, server: str, action: str) -> tuple[ep.Plan, ExpertFailoverStatus]:
    """Kill ``server``'s engine; the pass that fails it over, recovery choosing ``action``."""
    kill(w, server)
    p = w.warm_step()
    failover = p.status.last_failover
    assert failover is not None
    assert failover.servers == [server]
    assert failover.recovery is not None
    assert failover.recovery["action"] == action
    return p, failover


def test_an_exited_engine_is_replaced_by_a_warm_pod_rather_than_restarted() -> None:
    w = settled_world()
    w.add_warm("wp-one-a")
    p, failover = killed(w, "pool-s2", "Replace")
    assert "warmReady" in (failover.recovery or {})["terms"]
    (deleted,) = actions(p, DeleteServerPod)
    assert deleted.name == "pool-s2"
    assert "replaced rather than restarted in place" in deleted.reason
    (claim,) = actions(p, warm.ClaimWarmServer)
    assert failover.replacement == claim.name == "wp-one-a"


def test_without_a_warm_pod_an_exited_engine_restarts_in_place_and_is_taken_back() -> None:
    w = settled_world()
    old = w.reports["pool-s2"]
    p, _ = killed(w, "pool-s2", "RestartInPlace")
    assert not actions(p, DeleteServerPod)
    assert not actions(p, CreateServerPod)
    assert w.current is not None
    assert "pool-s2" not in w.current.servers
    # its dead engine's report lingers: no server to take back
    for _ in range(3):
        p = w.warm_step()
        assert w.current is not None
        assert "pool-s2" not in w.current.servers
    assert w.reports["pool-s2"].incarnation == old.incarnation
    # the restarted engine reports: taken back, copies restored
    w.reports["pool-s2"] = report("pool-s2", old.pod_uid, STATE.LOADING, incarnation="again")
    p = w.settle()
    assert w.current is not None
    assert "pool-s2" in w.current.servers
    assert p.status.last_failover is not None
    assert p.status.last_failover.restored_version == w.current.version


# --------------------------------------------------------------------------- releases
@pytest.mark.parametrize("how", ["ended", "silent"])
def test_a_claimed_pod_that_never_serves_is_released_with_its_assignment(how: str) -> None:
    w = settled_world()
    w.add_warm("wp-one-a", "wp-one-b")
    w.pods.pop("pool-s3")
    w.reports.pop("pool-s3")
    w.warm_step()  # claimed
    w.warm_step()  # assigned
    assert "wp-one-a" in w.assigned
    if how == "ended":
        w.pods["wp-one-a"] = dataclasses.replace(w.pods["wp-one-a"], phase="Failed")
    else:
        w.now += warm.CLAIM_BOUND_SECONDS
    p = w.warm_step()
    (deleted,) = actions(p, DeleteServerPod)
    assert (deleted.name, deleted.uid) == ("wp-one-a", "uid-wp-one-a")
    assert "wp-one-a" not in w.assigned, "its assignment removed with it"
    assert "wp-one-a" not in w.pods
    (claim,) = actions(p, warm.ClaimWarmServer)
    assert claim.name == "wp-one-b", "the next warm pod obtained at once"


def test_a_deleted_pools_claims_leave_no_assignment_and_a_pdgroups_of_its_name_are_kept() -> None:
    def claimed(name: str, kind: str) -> PodView:
        labels = warmclaim.Claimer(kind, "pool").labels()
        return PodView(name, f"uid-{name}", labels, "Running", True, False, "n", "sp", 0.0)

    pods = {
        "wp-a": claimed("wp-a", "ExpertPool"),
        "wp-b": claimed("wp-b", "PDGroup"),
    }
    forgotten: list[list[str]] = []
    deleted: list[tuple[str, str]] = []

    async def list_pods(namespace: str, labels: dict[str, str]) -> dict[str, PodView]:
        assert labels == {kinds.LABEL_CLAIMED_BY: "pool"}
        return pods

    async def delete(namespace: str, name: str) -> bool:
        deleted.append((namespace, name))
        return True

    async def forget(namespace: str, names: list[str]) -> None:
        forgotten.append(names)

    store = types.SimpleNamespace(connected=True, delete=delete, forget_assignments=forget)
    rt = types.SimpleNamespace(kube=types.SimpleNamespace(list_pods=list_pods))
    pools = ExpertPools(rt, None, store, ExpertPoolMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    body = {"metadata": {"namespace": "ns", "name": "pool"}}
    asyncio.run(pools.finalize(body, logging.getLogger("test")))
    assert deleted == [("ns", "pool")]
    assert forgotten == [["wp-a"]]


# --------------------------------------------------------------------------- metrics
def test_the_metrics_count_a_failover_once_by_path_and_forget_the_pool() -> None:
    registry = CollectorRegistry()
    m = ExpertPoolMetrics(registry)
    w = settled_world()
    w.add_warm("wp-one-a")
    m.record("ns", "pool", w.status)  # what an operator finds at its start: not counted
    kill(w, "pool-s2")
    m.record("ns", "pool", w.warm_step().status)
    w.warm_step()
    w.serve("wp-one-a")
    for _ in range(10):
        m.record("ns", "pool", w.warm_step().status)
    labels = {"namespace": "ns", "pool": "pool"}
    value = registry.get_sample_value
    assert (
        value("matrixserve_expertpool_failovers_total", {**labels, "path": "WarmSharedFileService"})
        == 1
    )
    assert value("matrixserve_expertpool_servers", {**labels, "state": "serving"}) == 8
    assert value("matrixserve_expertpool_servers", {**labels, "state": "desired"}) == 8
    assert value("matrixserve_expertpool_experts", {**labels, "coverage": "uncovered"}) == 0
    assert value("matrixserve_expertpool_map_version", labels) == w.status.map_version
    seconds = value(
        "matrixserve_expertpool_failover_restore_seconds",
        {**labels, "path": "WarmSharedFileService"},
    )
    assert w.status.last_failover is not None
    assert seconds is not None
    assert seconds == w.status.last_failover.restored_seconds
    assert seconds > 0
    m.forget("ns", "pool")
    assert value("matrixserve_expertpool_map_version", labels) is None
    assert (
        value("matrixserve_expertpool_failovers_total", {**labels, "path": "WarmSharedFileService"})
        is None
    )


def test_a_claimed_server_whose_engine_exited_restarts_in_place_not_released() -> None:
    w = settled_world()
    w.add_warm("wp-one-a")
    w.pods.pop("pool-s3")
    w.reports.pop("pool-s3")
    w.warm_step()  # claimed
    w.warm_step()  # assigned
    w.serve("wp-one-a")
    w.settle()
    assert w.current is not None
    assert "wp-one-a" in w.current.servers
    w.now += warm.CLAIM_BOUND_SECONDS * 2  # it served long past its claim's bound
    w.settle()
    # its engine exits (no warm pod left: restarted in place), then its session ends
    w.pods["wp-one-a"] = dataclasses.replace(w.pods["wp-one-a"], last_exit_at=w.now)
    killed(w, "wp-one-a", "RestartInPlace")
    uid = w.reports.pop("wp-one-a").pod_uid
    for _ in range(3):
        p = w.warm_step()
        assert not actions(p, DeleteServerPod), "the pod restarting its engine is kept"
        assert not actions(p, warm.ForgetAssignment)
    assert "wp-one-a" in w.assigned
    # the restarted engine takes its assignment again: taken back
    w.reports["wp-one-a"] = report("wp-one-a", uid, STATE.LOADING, incarnation="a2")
    w.settle()
    assert w.current is not None
    assert "wp-one-a" in w.current.servers
    # one that never reports again is released the bound after its exit
    kill(w, "wp-one-a")
    w.pods["wp-one-a"] = dataclasses.replace(w.pods["wp-one-a"], last_exit_at=w.now)
    w.warm_step()
    w.reports.pop("wp-one-a")
    w.now += warm.CLAIM_BOUND_SECONDS
    (deleted,) = actions(w.warm_step(), DeleteServerPod)
    assert deleted.name == "wp-one-a"
    assert "last exit" in deleted.reason
