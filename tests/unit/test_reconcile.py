"""The shared per-object loop and PDGroup's ``reconcile()`` with fakes in place of the API server
and ZooKeeper (the real adapters over a scripted API and a scripted kazoo client): what a pass
creates, writes, reports and refuses, and how the loop runs passes. The cluster tests run the
same code against the real parts."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from types import SimpleNamespace
from typing import Any, cast

import kopf
import pytest
from kazoo.client import KazooState
from kubernetes import client

from fakes import FakeCore, FakeCustom, FakeKazoo, engine_report
from matrixserve.adapters.kube import KubeAdapter
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.adapters.pdgroup_metrics import PDGroupMetrics
from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.status import PDGroupStatus, RecoveryRecord
from matrixserve.coordination import Session
from matrixserve.domain.effects import Event
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.pdgroup.actions import ClaimWarmPod
from matrixserve.handlers import runtime
from matrixserve.handlers.controller import Watches
from matrixserve.handlers.pdgroup import PDGroups
from matrixserve.handlers.reconciler import BACKOFF_MAX_SECONDS, Outcome, Reconciler
from matrixserve.handlers.runtime import OperatorConfig, Runtime

LOG = logging.getLogger("test")
KEY = (kinds.GROUP, kinds.VERSION, "ns", kinds.PDGROUP.plural, "g")
SPEC = {
    "service": "chat",
    "scenario": "general",
    "model": {"name": "llama3-8b"},
    "prefill": {"replicas": 2, "devicesPerInstance": 2},
    "decode": {"replicas": 1, "devicesPerInstance": 2, "batchSize": 32},
}


class World:
    """A PDGroup controller wired to fakes, and what it did to them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.core, self.custom, self.zk = FakeCore(), FakeCustom(), FakeKazoo()
        kube = KubeAdapter(client.ApiClient())
        kube.core, kube.custom = self.core, self.custom
        metrics = OperatorMetrics()
        session = Session("zk", client=self.zk)
        self.zk.transition(KazooState.CONNECTED)
        config = OperatorConfig(kubeconfig=None, zookeeper="zk", engine=EngineSettings("zk:2181"))
        rt = Runtime(config, kube, session, metrics, loop)
        self.events: list[Event] = []
        reconciler = Reconciler(kinds.PDGROUP, kube, metrics, loop, poster=self.record)
        self.groups = PDGroups(
            rt, reconciler, GroupStore(session), PDGroupMetrics(metrics.registry)
        )
        self.custom.objects[KEY] = {
            "apiVersion": kinds.API_VERSION,
            "kind": kinds.PDGROUP.kind,
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 1},
            "spec": copy.deepcopy(SPEC),
        }

    def record(self, body: Mapping[str, Any], event: Event | None) -> None:
        if event is not None:
            self.events.append(event)

    async def reconcile(self) -> bool:
        return (await self.groups.loop.reconcile(self.groups, "ns", "g", LOG)).busy

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.custom.objects[KEY].get("status") or {}
        return status

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == kind)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    def report_all(self) -> None:
        """Every pod's engine reports its RoCE IPs (what the resident process writes)."""
        paths = zl.GroupPaths("ns", "g")
        for i, (key, name) in enumerate(sorted(self.core.pods)):
            report = engine_report(name, i, pod_uid=self.core.pods[(key, name)]["metadata"]["uid"])
            self.zk.create(paths.report(name), report.dump(), ephemeral=True)


@pytest.fixture
async def world() -> World:
    w = World(asyncio.get_running_loop())
    await w.groups.store.ensure("ns", "g")
    return w


async def test_a_new_group_gets_its_pods_once_with_owner_labels_and_events(world: World) -> None:
    assert await world.reconcile() is True
    assert sorted(name for _, name in world.core.pods) == ["g-d-0", "g-p-0", "g-p-1"]
    pod = world.core.pods[("ns", "g-d-0")]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-g"
    assert pod["metadata"]["labels"][kinds.LABEL_ROLE] == "decode"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MATRIXSERVE_ZK"] == "zk:2181"
    assert env["MATRIXSERVE_GROUP"] == "ns/g"
    assert world.reasons() == ["CreatedPod"] * 3
    assert world.condition("Ready")["status"] == "False"
    assert world.condition("Gathering")["message"] == "0/3 instances reported their RoCE IPs"

    # The pods exist now: nothing to do, nothing reported; the status (rows with the pods now)
    # written once more, then not again while nothing changes.
    assert await world.reconcile() is False
    assert world.reasons() == ["CreatedPod"] * 3
    patches = len(world.custom.patches)
    assert await world.reconcile() is False
    assert len(world.custom.patches) == patches


async def test_the_map_and_init_order_are_written_once_every_instance_reported(
    world: World,
) -> None:
    await world.reconcile()
    world.report_all()
    assert await world.reconcile() is True
    paths = zl.GroupPaths("ns", "g")
    roce_map = zl.RoceMap.parse(world.zk.nodes[paths.roce_map][0])
    assert [e.instance for e in roce_map.prefill] == ["g-p-0", "g-p-1"]
    assert paths.init_order in world.zk.nodes
    assert world.reasons()[-2:] == ["RoceMap", "InitOrder"]
    assert world.status["roceMapVersion"] == 1
    assert world.status["links"]["expected"] == 2 * 1 * 4


async def test_an_invalid_spec_is_reported_once_per_generation_and_touches_nothing(
    world: World,
) -> None:
    await world.reconcile()
    pods = dict(world.core.pods)
    obj = world.custom.objects[KEY]
    obj["spec"]["decode"]["devicesPerInstance"] = 4
    obj["metadata"]["generation"] = 2
    assert await world.reconcile() is False
    assert await world.reconcile() is False
    ready = world.condition("Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "InvalidSpec",
        2,
    )
    assert "spec.decode.parallelism.tp" in ready["message"]
    warnings = [e for e in world.events if e.warning]
    assert [e.reason for e in warnings] == ["InvalidSpec"]
    assert world.core.pods == pods
    assert world.core.deletes == []


async def test_without_zookeeper_only_missing_pods_come_back(world: World) -> None:
    await world.reconcile()
    world.report_all()
    await world.reconcile()
    known = {k: v for k, v in world.status.items() if k != "conditions"}
    assert known["roceMapVersion"] == 1
    world.zk.transition(KazooState.SUSPENDED)
    del world.core.pods[("ns", "g-p-1")]
    obj = world.custom.objects[KEY]
    obj["spec"]["prefill"]["replicas"] = 1  # a scale-in: destructive, so it must wait
    obj["metadata"]["generation"] = 2
    await world.reconcile()
    assert ("ns", "g-p-1") not in world.core.pods  # not desired any more: not recreated
    assert world.core.deletes == []
    # The last known status is kept (the gateway routes by it); one condition says why.
    assert {k: v for k, v in world.status.items() if k != "conditions"} == known
    coordinated = world.condition("Coordinated")
    assert (coordinated["status"], coordinated["reason"]) == ("False", "ZooKeeperUnreachable")
    assert coordinated["observedGeneration"] == 1
    obj["spec"]["prefill"]["replicas"] = 2
    await world.reconcile()
    assert ("ns", "g-p-1") in world.core.pods
    assert world.core.deletes == []


async def test_a_deleted_or_deleting_group_is_left_alone(world: World) -> None:
    world.custom.objects[KEY]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert await world.reconcile() is False
    del world.custom.objects[KEY]
    assert await world.reconcile() is False
    assert world.core.pods == {}
    assert world.custom.patches == []


# --------------------------------------------------------------------------- the loop
class Idle:
    """A kind whose passes the test scripts (:func:`scripted`)."""

    watches = Watches()
    store = None


def scripted(loop: Reconciler, reconcile: Any) -> Any:
    """The loop's pass replaced by ``reconcile(namespace, name, logger) -> busy``."""

    async def one(_: Any, namespace: str, name: str, logger: logging.Logger) -> Outcome:
        return Outcome(busy=await reconcile(namespace, name, logger))

    loop.reconcile = one  # type: ignore[method-assign,assignment]
    return Idle()


class Stopped:
    def __init__(self) -> None:
        self.flag = False

    def __bool__(self) -> bool:
        return self.flag


async def test_a_failed_pass_does_not_end_the_loop_and_busy_passes_follow_at_once() -> None:
    metrics = OperatorMetrics()
    loop = Reconciler(
        kinds.PDGROUP, cast(KubeAdapter, None), metrics, asyncio.get_running_loop(), 30.0
    )
    stopped = Stopped()
    passes: list[float] = []
    failed = asyncio.Event()

    async def reconcile(namespace: str, name: str, logger: logging.Logger) -> bool:
        passes.append(asyncio.get_running_loop().time())
        if len(passes) == 1:
            failed.set()
            raise RuntimeError("API server away")
        if len(passes) == 4:
            stopped.flag = True
        return len(passes) < 4  # busy: look again at once

    task = asyncio.create_task(
        loop.run(scripted(loop, reconcile), "ns", "g", cast(kopf.DaemonStopped, stopped), LOG)
    )
    await asyncio.wait_for(failed.wait(), 2)
    loop.wake("ns", "g")  # the next wake-up runs the next pass
    await asyncio.wait_for(task, timeout=10)
    assert len(passes) == 4
    assert passes[1] - passes[0] >= 0.9  # a failed pass holds the loop a second
    assert passes[3] - passes[1] < 0.5  # busy passes follow each other at once
    errors = metrics.registry.get_sample_value(
        "matrixserve_operator_reconcile_errors_total", {"kind": "PDGroup"}
    )
    assert errors == 1
    assert loop.wakes == {}


@pytest.mark.parametrize("event_driven", [True, False], ids=["events", "polling"])
async def test_a_wake_ends_the_wait_and_polling_wakes_only_on_a_new_generation(
    event_driven: bool,
) -> None:
    loop = Reconciler(
        kinds.PDGROUP,
        cast(KubeAdapter, None),
        OperatorMetrics(),
        asyncio.get_running_loop(),
        resync_seconds=30.0,
        event_driven=event_driven,
    )
    stopped = Stopped()
    passes = asyncio.Queue[int]()

    async def reconcile(namespace: str, name: str, logger: logging.Logger) -> bool:
        passes.put_nowait(1)
        return False

    task = asyncio.create_task(
        loop.run(scripted(loop, reconcile), "ns", "g", cast(kopf.DaemonStopped, stopped), LOG)
    )
    await asyncio.wait_for(passes.get(), 2)
    loop.object_changed("ns", "g", generation=1)  # a first sighting: always a wake
    await asyncio.wait_for(passes.get(), 2)
    loop.object_changed("ns", "g", generation=1)  # a status change, same spec
    loop.related_changed("ns", "g")  # a pod event
    if event_driven:
        await asyncio.wait_for(passes.get(), 2)
    else:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(passes.get(), 1.5)
    stopped.flag = True
    loop.wake("ns", "g")
    await asyncio.wait_for(task, 3)


async def test_the_operators_flags_reach_every_kinds_loop() -> None:
    """``--resync-seconds`` and ``--no-zk-watches`` (the benchmark's polling baseline) shape the
    loop each kind gets from the runtime, and a ZooKeeper reconnection wakes every loop."""
    config = OperatorConfig(
        kubeconfig=None,
        zookeeper="zk",
        engine=EngineSettings("zk:2181"),
        resync_seconds=3.0,
        zk_watches=False,
    )
    rt = Runtime(
        config,
        cast(KubeAdapter, None),
        Session("zk", client=FakeKazoo()),
        OperatorMetrics(),
        asyncio.get_running_loop(),
    )
    loop = rt.reconciler(kinds.PDGROUP)
    assert (loop.resync_seconds, loop.event_driven) == (3.0, False)
    assert rt.reconcilers == [loop]
    woken = loop.wakes[("ns", "g")] = asyncio.Event()
    rt.wake_all()
    assert woken.is_set()


async def test_the_kinds_sweeps_run_every_sweep_seconds_while_connected_never_overlapping() -> None:
    """``--sweep-seconds``: what nothing owns any more is removed at least that often (not only
    on a new session: a namespace deleted with everything in it leaves what its engines wrote
    after the finalizers ran), never two runs at once, and not while ZooKeeper is away."""
    fake = FakeKazoo()
    config = OperatorConfig(
        kubeconfig=None, zookeeper="zk", engine=EngineSettings("zk:2181"), sweep_seconds=0.05
    )
    rt = Runtime(
        config,
        cast(KubeAdapter, None),
        Session("zk", client=fake),
        OperatorMetrics(),
        asyncio.get_running_loop(),
    )
    runs: list[str] = []
    running = [0]
    overlapped: list[str] = []

    async def slow(name: str) -> None:
        running[0] += 1
        try:
            if running[0] != 1:  # (an assertion here would be the runtime's to log)
                overlapped.append(name)
            runs.append(name)
            await asyncio.sleep(0.12)  # outlasts two periods: the next waits for it
        finally:
            running[0] -= 1

    async def broken() -> None:
        runs.append("x")
        raise RuntimeError("a kind's sweep that fails")

    for i, sweep in enumerate((lambda: slow("a"), broken, lambda: slow("b"))):
        rt.controllers[kinds.Kind(f"K{i}", f"k{i}")] = cast(Any, SimpleNamespace(sweep=sweep))
    ticker = asyncio.create_task(rt.sweep_periodically())
    try:
        await asyncio.sleep(0.2)
        assert runs == []  # not connected: nothing swept
        fake.transition(KazooState.CONNECTED)
        await asyncio.sleep(0.6)
        # each kind's in turn, again and again; one that fails never skips the others
        assert runs[:6] == ["a", "x", "b", "a", "x", "b"]
    finally:
        ticker.cancel()
        if rt.sweeping is not None:
            rt.sweeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rt.sweeping
    # asked while they run (a new session), they run once more after, not dropped
    runs.clear()
    rt.sweep()
    await asyncio.sleep(0.05)
    rt.sweep()
    assert rt.sweeping is not None
    await rt.sweeping
    assert runs == ["a", "x", "b", "a", "x", "b"]
    assert not overlapped, "two sweeps at once"


# --------------------------------------------------------------------------- what a group leaves
async def test_a_new_session_sweeps_the_subtrees_of_groups_that_are_gone(world: World) -> None:
    """A deletion while ZooKeeper was away leaves the group's subtree; the next session (or
    start-up) removes it, and nothing of a group that exists."""
    await world.groups.store.ensure("ns", "ghost")
    await world.groups.store.ensure("other", "ghost")
    # fork sources (engines' ephemerals): one live, one key whose engines went, a namespace
    # whose engines all went (issue 31)
    live = zl.fork_source_path("ns", "k-live", "g", "g-p-0")
    world.zk.create(live, b"{}", ephemeral=True, makepath=True)
    world.zk.ensure_path(f"{zl.fork_sources_root('ns')}/k-gone")
    world.zk.ensure_path(f"{zl.fork_sources_root('gone')}/k-old")
    await world.groups.sweep()
    assert zl.group_path("ns", "g") in world.zk.nodes
    assert zl.group_path("ns", "ghost") not in world.zk.nodes
    assert zl.groups_root("other") not in world.zk.nodes  # an emptied namespace folder goes too
    assert live in world.zk.nodes
    assert f"{zl.fork_sources_root('ns')}/k-gone" not in world.zk.nodes
    assert zl.fork_sources_root("gone") not in world.zk.nodes


async def test_a_namespaces_warm_folder_is_swept_once_no_pool_nor_pool_pod_is_left(
    world: World,
) -> None:
    """Issue 31: a namespace deleted with its WarmPool (or whose last pool went) left its DRAM
    plans and folders in ZooKeeper. The sweep removes them once nothing there is a pool's: not
    while a pool exists, nor while a pod of a pool (warm, or claimed: its assignment) is left."""
    from matrixserve.handlers.warmpool import WarmPools

    rt = world.groups.rt
    pools = WarmPools.install(rt)
    plan = zl.DramPlan(node="n0", models=["llama3-8b"], bytes=1)
    # a pool created after the sweep listed the pools has armed its watch on the folder (under
    # the store's lock): its folder stays (the second reader's finding)
    pools.store._watched["watched"] = [lambda: None]
    for ns in ("pooled", "podded", "gone", "watched"):
        world.zk.ensure_path(zl.WarmPaths(ns).pods)
        world.zk.ensure_path(zl.WarmPaths(ns).assignments)
        world.zk.create(zl.WarmPaths(ns).dram("n0"), plan.dump(), makepath=True)
    world.custom.objects[(kinds.GROUP, kinds.VERSION, "pooled", kinds.WARMPOOL.plural, "wp")] = {
        "metadata": {"name": "wp", "namespace": "pooled"}
    }
    world.core.create_namespaced_pod(
        "podded", {"metadata": {"name": "w-0", "labels": {kinds.LABEL_WARMPOOL: "wp"}}}
    )
    await pools.sweep()
    assert zl.WarmPaths("pooled").dram("n0") in world.zk.nodes
    assert zl.WarmPaths("podded").dram("n0") in world.zk.nodes
    assert not [p for p in world.zk.nodes if p.startswith(zl.WarmPaths("gone").root)]
    assert zl.WarmPaths("watched").dram("n0") in world.zk.nodes
    world.core.pods.clear()  # the last pool pod went
    await pools.sweep()
    assert not [p for p in world.zk.nodes if p.startswith(zl.WarmPaths("podded").root)]
    assert zl.WarmPaths("pooled").dram("n0") in world.zk.nodes


async def test_a_pools_host_dram_plans_are_written_by_its_plan_only_where_they_changed(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool's plan writes the namespace's host-DRAM plans as an effect, applied by its
    store: a server's plan where it changed (stamped with the pass's time), the plan of a
    server no warm pod runs on any more removed; a settled namespace writes nothing and its
    pass has nothing to do."""
    from matrixserve.adapters.warmpool_metrics import WarmPoolMetrics
    from matrixserve.adapters.zk_warm import WarmStore
    from matrixserve.handlers.warmpool import WarmPools

    rt = world.groups.rt
    loop = Reconciler(kinds.WARMPOOL, rt.kube, rt.metrics, rt.loop, poster=world.record)
    pools = WarmPools(rt, loop, WarmStore(rt.session), WarmPoolMetrics(OperatorMetrics().registry))

    async def reconcile() -> bool:
        return (await loop.reconcile(pools, "ns", "wp", LOG)).busy

    key = (kinds.GROUP, kinds.VERSION, "ns", kinds.WARMPOOL.plural, "wp")
    world.custom.objects[key] = {
        "apiVersion": kinds.API_VERSION,
        "kind": kinds.WARMPOOL.kind,
        "metadata": {"name": "wp", "namespace": "ns", "uid": "uid-wp", "generation": 1},
        "spec": {
            "shapes": [{"name": "two", "size": 1, "devicesPerPod": 2}],
            "dramPreload": [{"model": "llama3-8b"}],
        },
    }
    world.core.nodes["n0"] = {}
    paths = zl.WarmPaths("ns")
    await pools.store.ensure("ns")
    assert await reconcile() is True  # its warm pod, no server yet
    assert not [p for p in world.zk.nodes if p.startswith(f"{paths.root}/dram")]
    world.core.pods[("ns", "wp-two-w0")]["spec"]["nodeName"] = "n0"
    world.zk.create(paths.dram("n9"), zl.DramPlan(node="n9").dump(), makepath=True)

    with caplog.at_level(logging.INFO, logger=LOG.name):
        before = time.time()
        await reconcile()
    written = zl.DramPlan.parse(world.zk.nodes[paths.dram("n0")][0])
    assert written.models == ["llama3-8b"]  # the pool's, and the group's model: once
    assert written.ts >= before
    assert paths.dram("n9") not in world.zk.nodes
    assert "host DRAM pre-load plans changed on n0, n9" in caplog.messages
    assert world.custom.objects[key]["status"]["dram"][0]["models"] == ["llama3-8b"]

    data = world.zk.nodes[paths.dram("n0")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert await reconcile() is False
    assert world.zk.nodes[paths.dram("n0")] == data  # not written again
    assert not [m for m in caplog.messages if "DRAM" in m]


def test_a_deletion_waits_for_zookeeper_a_bounded_time() -> None:
    from matrixserve.domain.pdgroup.cleanup import FINALIZER_WAIT_SECONDS, give_up_waiting

    deleted_at = "2026-01-01T00:00:00Z"
    at = datetime.fromisoformat("2026-01-01T00:00:00+00:00").timestamp()
    assert not give_up_waiting(deleted_at, at + FINALIZER_WAIT_SECONDS - 1)
    assert give_up_waiting(deleted_at, at + FINALIZER_WAIT_SECONDS)
    assert not give_up_waiting(None, at + 1e6)
    assert FINALIZER_WAIT_SECONDS < 60  # kubectl delete completes within a minute


async def test_a_foreign_pod_holding_a_members_name_is_the_reason_not_a_silent_retry(
    world: World,
) -> None:
    """Someone else's pod named g-d-0: creating it would be refused (409) every pass. The group
    says so instead (reason, Event once) and does not try."""
    world.core.pods[("ns", "g-d-0")] = {
        "metadata": {
            "name": "g-d-0",
            "uid": "theirs",
            "labels": {"app": "other"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "web-7d", "uid": "rs"}],
        },
        "status": {"phase": "Running"},
    }
    await world.reconcile()
    # A notice is posted once while it holds, and does not make a pass busy (no hot loop).
    assert await world.reconcile() is False
    assert await world.reconcile() is False
    ready = world.condition("Ready")
    assert ready["reason"] == "PodNameTaken"
    assert (
        "g-d-0: a pod of this name exists and is not this group's (ReplicaSet web-7d)"
        in (ready["message"])
    )
    assert world.reasons().count("PodNameTaken") == 1
    assert world.core.pods[("ns", "g-d-0")]["metadata"]["uid"] == "theirs"


def test_recovery_metrics_count_every_step_of_every_recovery_in_a_pass() -> None:
    """Issue 17's metrics come from each step's own record: two recoveries ending in one pass
    are both counted (keyed by nothing that two records can share)."""
    from matrixserve.domain.pdgroup.actions import ReportRecovery

    registry = OperatorMetrics().registry
    metrics = PDGroupMetrics(registry)
    get = registry.get_sample_value

    def record(kind: str, seconds: float | None = None) -> RecoveryRecord:
        return RecoveryRecord.model_validate(
            {
                "fault": {"kind": kind, "detectedBy": "device-status"},
                "plan": {"action": "Replace", "lostFraction": 0.25},
                "detectedAfterSeconds": 0.4,
                "restoredAfterSeconds": seconds,
            }
        )

    metrics.record_recovery([ReportRecovery("RecoveryPlanned", "", record=record("die"))])
    metrics.record_recovery(
        [
            ReportRecovery("Recovered", "", record=record("die", 4.0)),
            ReportRecovery("Recovered", "", record=record("die", 8.0)),
            ReportRecovery("FaultDetected", ""),  # no record: nothing counted
        ],
    )
    detected = {"fault": "die", "tier": "device-status"}
    assert get("matrixserve_operator_fault_detection_seconds_count", detected) == 1
    labels = {"fault": "die", "action": "Replace"}
    assert get("matrixserve_operator_recoveries_total", labels | {"outcome": "planned"}) == 1
    assert get("matrixserve_operator_recovery_restore_seconds_count", labels) == 2
    assert get("matrixserve_operator_recovery_restore_seconds_sum", labels) == 12.0
    lost = get("matrixserve_operator_recovery_capacity_lost_seconds_total", {"fault": "die"})
    assert lost == 0.25 * 12.0
    assert get("matrixserve_operator_recoveries_total", labels | {"outcome": "restored"}) == 2


def test_the_split_metrics_follow_the_policy_and_phi_goes_when_no_window_says_it() -> None:
    """Issue 19's gauges: the serving and target split and Φ as the status says them; after a
    switch to Fixed (which observes no window) the group's Φ series is gone, not frozen at the
    last Feedback window's."""
    from matrixserve.domain.pdgroup.actions import ReportRatioChange
    from matrixserve.domain.pdgroup.plan import Plan

    registry = OperatorMetrics().registry
    metrics = PDGroupMetrics(registry)
    get = registry.get_sample_value
    group = {"namespace": "ns", "group": "g"}

    def passed(ratio: dict[str, Any], *actions: Any) -> None:
        status = PDGroupStatus.read({"ratio": ratio})
        metrics.record_ratio("ns", "g", Plan(list(actions), status, [], True))

    feedback = {"policy": "Feedback", "current": "3:5", "target": "2:6", "phi": 7.5}
    passed(feedback, ReportRatioChange("Moving one instance from prefill to decode"))
    assert get("matrixserve_operator_ratio_phi", group) == 7.5
    assert (
        get("matrixserve_operator_ratio_instances", group | {"role": "decode", "which": "target"})
        == 6
    )
    changes = group | {"policy": "Feedback"}
    assert get("matrixserve_operator_ratio_changes_total", changes) == 1
    passed({"policy": "Fixed", "current": "3:5", "target": "3:5"})
    assert get("matrixserve_operator_ratio_phi", group) is None
    assert (
        get("matrixserve_operator_ratio_instances", group | {"role": "decode", "which": "target"})
        == 5
    )
    assert get("matrixserve_operator_ratio_changes_total", changes) == 1
    passed({"policy": "Fixed", "current": "3:5", "target": "3:5"})  # nothing to remove: no error
    assert get("matrixserve_operator_ratio_phi", group) is None


def _claiming(kube: KubeAdapter) -> tuple[Reconciler, list[str]]:
    """A PDGroup loop over ``kube``, and the reasons of the Events it posts."""
    posted: list[str] = []
    loop = Reconciler(
        kinds.PDGROUP,
        kube,
        OperatorMetrics(),
        asyncio.get_running_loop(),
        poster=lambda _body, event: posted.append(event.reason if event else ""),
    )
    return loop, posted


def _claims(n: int) -> list[ClaimWarmPod]:
    return [
        ClaimWarmPod(f"wp-{i}", "7", f"g-p-{i}", zl.Role.PREFILL, "WarmForkUB", 1.0, None, {})
        for i in range(n)
    ]


async def test_warm_pod_claims_are_issued_together_not_one_round_trip_each() -> None:
    """64 instances claimed one after another cost 64 API round trips of wall time before any
    of them starts (bench-scale-out's warm paths spent 14-20 s of wall time); each claim is
    conditional on its own pod, so they go together."""

    class SlowCore:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.now = self.most = 0
            self.patched: list[str] = []

        def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **_: Any) -> None:
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            time.sleep(0.2)  # one API round trip
            with self.lock:
                self.now -= 1
                self.patched.append(name)

    core = SlowCore()
    kube = KubeAdapter(client.ApiClient())
    kube.core = cast(Any, core)
    loop, posted = _claiming(kube)
    claims = _claims(4)
    body = {"metadata": {"namespace": "ns", "name": "g", "uid": "uid-g"}}

    began = time.monotonic()
    assert await loop.apply(body, claims)  # no store: a znode change would fail
    assert sorted(core.patched) == [f"wp-{i}" for i in range(4)]
    assert core.most > 1
    assert time.monotonic() - began < 0.6  # not 4 x 0.2 s
    assert posted == ["ClaimedWarmPod"] * 4


async def test_a_claim_that_fails_is_raised_after_the_others_are_done() -> None:
    """One claim's API error does not leave the others running past the pass: each finishes
    (its Event posted) before the failure ends the pass."""

    class Core:
        def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **_: Any) -> None:
            if name == "wp-0":
                raise client.ApiException(status=500, reason="etcd away")
            time.sleep(0.2)

    kube = KubeAdapter(client.ApiClient())
    kube.core = cast(Any, Core())
    loop, posted = _claiming(kube)
    claims = _claims(3)

    body = {"metadata": {"namespace": "ns", "name": "g", "uid": "uid-g"}}
    with pytest.raises(client.ApiException):
        await loop.apply(body, claims)  # no store: a znode change would fail
    assert posted == ["ClaimedWarmPod"] * 2  # both others finished before the raise


async def test_the_loop_looks_again_when_the_plan_is_due_and_backs_off_over_failures() -> None:
    """A plan due again in 0.3 s is looked at then, not at the 30 s resync; consecutive failures
    wait 1, 2, 4 ... s (at most the cap), and a success ends the back-off."""
    loop = Reconciler(
        kinds.PDGROUP, cast(KubeAdapter, None), OperatorMetrics(), asyncio.get_running_loop(), 30.0
    )
    assert loop.next_pass(Outcome(recheck_after=0.3), failures=0) == 0.3
    assert loop.next_pass(Outcome(recheck_after=90.0), failures=0) == 30.0  # the resync first
    assert loop.next_pass(Outcome(), failures=0) == 30.0
    assert loop.next_pass(Outcome(recheck_after=-1.0), failures=0) > 0  # never a hot loop
    assert [loop.next_pass(Outcome(failed=True), n) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert loop.next_pass(Outcome(failed=True), failures=30) == BACKOFF_MAX_SECONDS

    stopped = Stopped()
    passes: list[float] = []
    clock = asyncio.get_running_loop().time

    async def one(_: Any, namespace: str, name: str, logger: logging.Logger) -> Outcome:
        passes.append(clock())
        if len(passes) in (2, 3):
            raise RuntimeError("API server away")
        if len(passes) == 5:
            stopped.flag = True
        return Outcome(recheck_after=0.3)

    loop.reconcile = one  # type: ignore[method-assign,assignment]
    await asyncio.wait_for(
        loop.run(cast(Any, Idle()), "ns", "g", cast(kopf.DaemonStopped, stopped), LOG), timeout=15
    )
    gaps = [b - a for a, b in itertools.pairwise(passes)]
    assert 0.25 < gaps[0] < 0.8  # due again: looked at then
    assert 1.9 < gaps[1] < 2.6  # a failure: held a second, then 1 s of back-off
    assert 2.9 < gaps[2] < 3.6  # the second in a row: held a second, then 2 s
    assert 0.25 < gaps[3] < 0.8  # a success ends the back-off: due again in 0.3 s


async def test_a_store_that_fails_to_arm_is_let_go_and_armed_again_on_a_later_pass() -> None:
    """ZooKeeper failing midway through arming an object's watches: what was armed is let go
    (a later arm starts afresh, not on a half-made registration), the pass still runs, and the
    next pass arms again; the loop's end lets the watches go."""
    calls: list[str] = []

    class Store:
        connected = True

        async def arm(self, namespace: str, name: str, wake: Any) -> bool:
            calls.append("arm")
            if calls.count("arm") == 1:
                raise ConnectionError("ZooKeeper lost midway")
            return True

        def disarm(self, namespace: str, name: str) -> None:
            calls.append("disarm")

    class Watched:
        watches = Watches(store=True)
        store = Store()

    loop = Reconciler(
        kinds.PDGROUP, cast(KubeAdapter, None), OperatorMetrics(), asyncio.get_running_loop(), 30.0
    )
    stopped = Stopped()

    async def one(_: Any, namespace: str, name: str, logger: logging.Logger) -> Outcome:
        calls.append("pass")
        if calls.count("pass") == 2:
            stopped.flag = True
        return Outcome(busy=True)

    loop.reconcile = one  # type: ignore[method-assign,assignment]
    await asyncio.wait_for(
        loop.run(cast(Any, Watched()), "ns", "g", cast(kopf.DaemonStopped, stopped), LOG), 5
    )
    assert calls == ["arm", "disarm", "pass", "arm", "pass", "disarm"]


async def test_an_independent_effect_is_applied_though_a_pod_creation_fails() -> None:
    """A pool's host-DRAM plans (an independent znode change) are written even when the pass's
    pod creation is refused (a quota, an admission webhook): the failure is raised after."""
    from dataclasses import dataclass, field
    from typing import ClassVar

    from matrixserve.domain.effects import PodCreation, ZnodeChange

    @dataclass(frozen=True)
    class Create(PodCreation):
        manifest: dict[str, Any] = field(default_factory=lambda: {"metadata": {"name": "p"}})

    @dataclass(frozen=True)
    class Write(ZnodeChange[Any]):
        independent: ClassVar[bool] = True

    class Kube:
        pod_policies: tuple[Any, ...] = ()

        async def create_pod(self, namespace: str, manifest: Any) -> bool:
            raise client.ApiException(status=403, reason="exceeded quota")

    written: list[Any] = []

    class Store:
        async def apply(self, namespace: str, name: str, change: Any) -> None:
            written.append(change)

    loop = Reconciler(
        kinds.WARMPOOL, cast(KubeAdapter, Kube()), OperatorMetrics(), asyncio.get_running_loop()
    )
    body = {"metadata": {"namespace": "ns", "name": "wp"}}
    with pytest.raises(client.ApiException):
        await loop.apply(body, [Create(), Write()], cast(Any, Store()))
    assert written == [Write()]


async def test_a_stuck_pass_is_cancelled_counted_as_failed_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pass that never returns (a call that hangs) is cancelled at the deadline, counted and
    logged with where it waited; the loop's next pass runs (it used to wait for ever)."""
    metrics = OperatorMetrics()
    loop = Reconciler(
        kinds.PDGROUP, cast(KubeAdapter, None), metrics, asyncio.get_running_loop(), 30.0
    )
    loop.pass_deadline = 0.3
    stopped = Stopped()
    passes: list[float] = []
    cancelled: list[bool] = []
    never = asyncio.Event()

    async def a_call_that_hangs() -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def one(_: Any, namespace: str, name: str, logger: logging.Logger) -> Outcome:
        passes.append(asyncio.get_running_loop().time())
        if len(passes) == 1:
            await a_call_that_hangs()
        stopped.flag = True
        return Outcome()

    loop.reconcile = one  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        await asyncio.wait_for(
            loop.run(cast(Any, Idle()), "ns", "g", cast(kopf.DaemonStopped, stopped), LOG), 10
        )
    assert len(passes) == 2
    assert cancelled == [True]
    # the deadline, then the hold of a failed pass (a second) and the first back-off (a second)
    assert 2.2 < passes[1] - passes[0] < 3.5
    errors = metrics.registry.get_sample_value(
        "matrixserve_operator_reconcile_errors_total", {"kind": "PDGroup"}
    )
    assert errors == 1
    [stuck] = [m for m in caplog.messages if "cancelled" in m]
    assert stuck.startswith("reconcile of ns/g failed: still running after 0.3 s, cancelled;")
    assert "one (test_reconcile.py:" in stuck
    assert "a_call_that_hangs (test_reconcile.py:" in stuck


async def test_a_daemon_stopped_mid_pass_takes_its_pass_with_it() -> None:
    loop = Reconciler(
        kinds.PDGROUP, cast(KubeAdapter, None), OperatorMetrics(), asyncio.get_running_loop()
    )
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def hangs() -> Outcome:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return Outcome()

    waiting = asyncio.create_task(loop._bounded(hangs()))
    await asyncio.wait_for(started.wait(), 2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(cancelled.wait(), 2)


def test_kopfs_events_name_the_operator_and_its_calls_are_bounded() -> None:
    """`kubectl describe`'s From column says matrixserve-operator (kopf's default: "kopf"), the
    instance is the replica's Lease identity; kopf's own calls wait 30 s, not aiohttp's 300."""
    config = OperatorConfig(
        kubeconfig=None,
        zookeeper="zk",
        engine=EngineSettings("zk:2181"),
        leader_identity="operator-7d9f_1a2b3c4d",
    )
    settings = kopf.OperatorSettings()
    runtime.configure(settings, config)
    assert settings.posting.reporting_component == "matrixserve-operator"
    assert settings.posting.reporting_instance == "operator-7d9f_1a2b3c4d"
    assert settings.posting.event_name_prefix == "matrixserve-"
    assert (settings.networking.request_timeout, settings.networking.connect_timeout) == (30, 5)
    assert settings.watching.connect_timeout == 5
    assert settings.persistence.finalizer == kinds.FINALIZER
