"""Gang placement of multi-pod instances (pure): pods created gated and pinned only when the whole
instance has servers in one SuperPod, their gates lifted together once all exist, a half-bound
instance released after the bound, a wait that holds nothing and names the free NPUs per
SuperPod; rank settings in each pod; the instance's fault when a worker exits."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fakes import formed_group, formed_zk, pdgroup_spec
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_settings import EngineEnv
from matrixserve.domain import pdgroup
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import FaultKind, NodeView, PodView
from matrixserve.domain.pdgroup import ZkView, gang
from matrixserve.domain.pdgroup.actions import CreatePod, DeletePod, UngatePod
from matrixserve.domain.pdgroup.pods import pod_labels
from matrixserve.domain.pdgroup.recovery import detect

P, D = zl.Role.PREFILL, zl.Role.DECODE
ENGINE = EngineSettings(zookeeper="127.0.0.1:2181")


def spec(p_pods: int = 2, d_pods: int = 2, p_npus: int = 16, d_npus: int = 16) -> Any:
    """1 prefill + 1 decode of DeepSeek-V3 sized instances (p_npus over p_pods, ...)."""
    s = pdgroup_spec(1, 1)
    return s.model_copy(
        update={
            "prefill": s.prefill.model_copy(
                update={"devices_per_instance": p_npus, "pods_per_instance": p_pods}
            ),
            "decode": s.decode.model_copy(
                update={"devices_per_instance": d_npus, "pods_per_instance": d_pods}
            ),
        }
    )


def servers(layout: Mapping[str, int], per: int = 8) -> dict[str, NodeView]:
    """``layout``: SuperPod -> servers; each server ``<sp>-s<i>`` with ``per`` NPUs."""
    return {
        f"{sp}-s{i}": NodeView(
            f"{sp}-s{i}",
            True,
            per,
            labels={
                kinds.LABEL_SUPERPOD: sp,
                kinds.LABEL_SERVER: f"{sp}-s{i}",
                kinds.LABEL_NPU_TYPE: "Ascend910C",
            },
        )
        for sp, n in layout.items()
        for i in range(n)
    }


def pod(
    name: str,
    role: zl.Role,
    instance: str,
    *,
    node: str | None = None,
    pinned: str | None = None,
    gated: bool = False,
    running: float | None = None,
    created: float = 0.0,
    **extra: Any,
) -> PodView:
    return PodView(
        name,
        f"uid-{name}",
        pod_labels("g", role, instance),
        "Running" if running is not None else "Pending",
        running is not None,
        False,
        node,
        None,
        created,
        gated=gated,
        pinned=pinned,
        running_since=running,
        **extra,
    )


def view(
    s: Any,
    pods: Mapping[str, PodView],
    nodes: Mapping[str, NodeView],
    now: float = 100.0,
    used: Mapping[str, int] | None = None,
    zk: ZkView | None = None,
) -> Any:
    return formed_group(
        s,
        pods,
        zk or ZkView(connected=True),
        now=now,
        engine=ENGINE,
        nodes=nodes,
        npus_used=used or {},
    )


def created(plan: pdgroup.Plan) -> dict[str, dict[str, Any]]:
    return {a.name: dict(a.manifest) for a in plan.actions if isinstance(a, CreatePod)}


def env_of(manifest: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in manifest["spec"]["containers"][0]["env"] if "value" in e}


def test_a_multi_pod_instance_is_created_gated_and_pinned_in_one_superpod() -> None:
    nodes = servers({"sp0": 4, "sp1": 4})
    plan = pdgroup.plan(view(spec(), {}, nodes))
    pods = created(plan)
    assert set(pods) == {"g-p-0", "g-p-0-1", "g-d-0", "g-d-0-1"}
    pinned = {n: m["spec"]["nodeSelector"][kinds.LABEL_SERVER] for n, m in pods.items()}
    assert len(set(pinned.values())) == 4  # one pod per server
    for _name, manifest in pods.items():
        assert manifest["spec"]["schedulingGates"] == [{"name": kinds.GANG_GATE}]
        resources = manifest["spec"]["containers"][0]["resources"]
        assert resources["limits"][kinds.NPU_RESOURCE] == "8"  # 16 NPUs over 2 pods
    # each instance's pods in one SuperPod; the prefill paired with its decode's SuperPod
    sp = {n: m["metadata"]["annotations"][kinds.ANNOTATION_SUPERPOD] for n, m in pods.items()}
    assert sp["g-p-0"] == sp["g-p-0-1"] == sp["g-d-0"] == sp["g-d-0-1"]
    env = {n: env_of(m) for n, m in pods.items()}
    assert env["g-p-0-1"][EngineEnv.name("instance")] == "g-p-0"
    assert env["g-p-0-1"][EngineEnv.name("rank")] == "1"
    assert env["g-p-0"][EngineEnv.name("rank")] == "0"
    assert env["g-d-0"][EngineEnv.name("ranks")] == "2"
    assert env["g-p-0"][EngineEnv.name("kv_plane")] == "UB"


def test_an_instance_no_superpod_can_hold_waits_holding_nothing_and_says_why() -> None:
    # 16-NPU prefill on 2 servers: each SuperPod has one whole free server only
    nodes = servers({"sp0": 2, "sp1": 2})
    used = {"sp0-s0": 8, "sp1-s0": 4}
    s = spec(d_pods=1, d_npus=2)
    plan = pdgroup.plan(view(s, {}, nodes, used=used))
    pods = created(plan)
    assert "g-p-0" not in pods
    assert "g-p-0-1" not in pods
    assert "g-d-0" in pods  # a single-pod decode is the scheduler's, as before
    ready = next(c for c in plan.conditions if c.type == "Ready")
    assert ready.reason == gang.UNPLACEABLE
    progressing = next(c for c in plan.conditions if c.type == "Progressing")
    assert "holding no NPU" in progressing.message
    assert "sp0" in progressing.message
    assert "sp1" in progressing.message


def test_gates_are_lifted_together_only_once_every_pod_exists() -> None:
    nodes = servers({"sp0": 4})
    s = spec(d_pods=1, d_npus=2)
    half = {"g-p-0": pod("g-p-0", P, "g-p-0", pinned="sp0-s0", gated=True)}
    plan = pdgroup.plan(view(s, half, nodes, used={"sp0-s0": 8}))
    assert not [a for a in plan.actions if isinstance(a, UngatePod)]
    # the missing rank is seated in the same SuperPod, on another server
    rest = created(plan)["g-p-0-1"]
    assert rest["spec"]["nodeSelector"][kinds.LABEL_SERVER] != "sp0-s0"
    whole = {
        **half,
        "g-p-0-1": pod("g-p-0-1", P, "g-p-0", pinned="sp0-s1", gated=True),
    }
    plan = pdgroup.plan(view(s, whole, nodes, used={"sp0-s0": 8, "sp0-s1": 8}))
    lifted = {a.name for a in plan.actions if isinstance(a, UngatePod)}
    assert lifted == {"g-p-0", "g-p-0-1"}


def test_a_half_bound_instance_is_released_after_the_bound() -> None:
    nodes = servers({"sp0": 4})
    s = spec(d_pods=1, d_npus=2)
    pods = {
        "g-p-0": pod("g-p-0", P, "g-p-0", node="sp0-s0", running=5.0, created=1.0),
        "g-p-0-1": pod("g-p-0-1", P, "g-p-0", pinned="sp0-s1", created=2.0),
    }
    early = pdgroup.plan(view(s, pods, nodes, now=2.0 + gang.GANG_BOUND_SECONDS - 1))
    assert not [a for a in early.actions if isinstance(a, DeletePod)]
    late = pdgroup.plan(view(s, pods, nodes, now=2.0 + gang.GANG_BOUND_SECONDS + 1))
    released = {a.name for a in late.actions if isinstance(a, DeletePod)}
    assert released == {"g-p-0", "g-p-0-1"}


def test_a_worker_exit_is_its_instance_fault_restarting_one_pod() -> None:
    s = spec(d_pods=1, d_npus=2)
    entry = zl.MapEntry(
        instance="g-p-0", podIP="127.0.0.1", port=1, roceIps=["10.0.0.1"], incarnation="a"
    )
    report = zl.Report(
        instance="g-p-0",
        podIP="127.0.0.1",
        port=1,
        node="sp0-s0",
        superpod="sp0",
        dies=[0],
        roceIps=["10.0.0.1"],
        ts=10.0,
        podUid="uid-g-p-0",
        incarnation="a",
    )
    roce_map = zl.RoceMap(version=1, P=[entry], D=[])
    pods = {
        "g-p-0": pod("g-p-0", P, "g-p-0", node="sp0-s0", running=1.0),
        "g-p-0-1": pod(
            "g-p-0-1", P, "g-p-0", node="sp0-s1", running=21.0, last_exit_at=20.0, restarts=1
        ),
    }
    zk = ZkView(connected=True, reports={"g-p-0": report}, roce_map=roce_map)
    faults = detect(view(s, pods, servers({"sp0": 2}), zk=zk), roce_map)
    assert len(faults) == 1
    fault = faults[0]
    assert fault.kind is FaultKind.KILL
    assert fault.instances == ("g-p-0",)
    assert fault.pods == ("g-p-0-1",)
    assert "rank 1" in fault.detail
    # once the leader reported again after the exit, it is no fault any more
    later = report.model_copy(update={"ts": 25.0})
    zk = ZkView(connected=True, reports={"g-p-0": later}, roce_map=roce_map)
    assert detect(view(s, pods, servers({"sp0": 2}), zk=zk), roce_map) == []


def test_a_worker_whose_pod_is_not_ready_takes_its_instance_out_of_traffic() -> None:
    """Before its leader has seen the rank go (a killed worker's session lives on until its
    timeout), the worker's pod not Ready closes the instance's entrance."""
    s = spec(d_pods=1, d_npus=2)
    zk = formed_zk(
        {"g-p-0": (P, 0), "g-d-0": (D, 1)},
        health_ts=99.0,
        loads={"g-p-0": zl.Load(), "g-d-0": zl.Load()},
    )
    report_at = zk.reports["g-p-0"].ts

    def worker(ready: bool, started: float) -> PodView:
        return dataclasses.replace(
            pod("g-p-0-1", P, "g-p-0", node="sp0-s1", running=started),
            ready=ready,
            ready_changed_at=started,
        )

    leader = pod("g-p-0", P, "g-p-0", node="sp0-s0", running=report_at - 5)
    leader = dataclasses.replace(leader, ready=True)
    decode = dataclasses.replace(pod("g-d-0", D, "g-d-0", node="sp0-s2", running=1.0), ready=True)
    nodes = servers({"sp0": 4})
    serving = {"g-p-0": leader, "g-p-0-1": worker(True, report_at - 5), "g-d-0": decode}
    assert view(s, serving, nodes, zk=zk).healthy("g-p-0")
    # its first probe pending since before the leader reported: still serving
    waiting = {**serving, "g-p-0-1": worker(False, report_at - 5)}
    assert view(s, waiting, nodes, zk=zk).healthy("g-p-0")
    # restarted after the report, not Ready: out of traffic
    restarted = {**serving, "g-p-0-1": worker(False, report_at + 1)}
    out = view(s, restarted, nodes, zk=zk)
    assert not out.healthy("g-p-0")
    assert "DeleteEntrance" in [type(a).__name__ for a in pdgroup.plan(out).actions]


def test_an_instance_that_was_whole_is_never_released_by_the_bound() -> None:
    """A worker restarting in place an hour after its pods were created (not running for a
    while) is recovery's: the bound is for instances being placed, never whole yet."""
    s = spec(d_pods=1, d_npus=2)
    zk = formed_zk(
        {"g-p-0": (P, 0), "g-d-0": (D, 1)},
        health_ts=3599.0,
        loads={"g-p-0": zl.Load(), "g-d-0": zl.Load()},
    )
    pods = {
        "g-p-0": pod("g-p-0", P, "g-p-0", node="sp0-s0", running=5.0, created=1.0),
        "g-p-0-1": pod("g-p-0-1", P, "g-p-0", node="sp0-s1", created=1.0, last_exit_at=3590.0),
        "g-d-0": pod("g-d-0", D, "g-d-0", node="sp0-s2", running=5.0, created=1.0),
    }
    plan = pdgroup.plan(view(s, pods, servers({"sp0": 4}), now=3600.0, zk=zk))
    assert not [a for a in plan.actions if isinstance(a, DeletePod)], plan.actions


def test_ungated_pods_that_never_bind_are_released_after_the_bound() -> None:
    """Pinned to servers taken meanwhile: Pending for ever unless released and placed again."""
    s = spec(d_pods=1, d_npus=2)
    pods = {
        "g-p-0": pod("g-p-0", P, "g-p-0", pinned="sp0-s0", created=1.0),
        "g-p-0-1": pod("g-p-0-1", P, "g-p-0", pinned="sp0-s1", created=1.0),
    }
    late = pdgroup.plan(view(s, pods, servers({"sp0": 4}), now=1.0 + gang.GANG_BOUND_SECONDS + 1))
    assert {a.name for a in late.actions if isinstance(a, DeletePod)} == {"g-p-0", "g-p-0-1"}


def test_a_leaders_own_exit_is_not_blamed_on_an_old_worker_restart() -> None:
    s = spec(d_pods=1, d_npus=2)
    entry = zl.MapEntry(
        instance="g-p-0", podIP="127.0.0.1", port=1, roceIps=["10.0.0.1"], incarnation="a"
    )
    roce_map = zl.RoceMap(version=1, P=[entry], D=[])
    pods = {
        "g-p-0": pod(
            "g-p-0", P, "g-p-0", node="sp0-s0", running=101.0, last_exit_at=100.0, restarts=1
        ),
        # restarted once at start-up, running since
        "g-p-0-1": pod(
            "g-p-0-1", P, "g-p-0", node="sp0-s1", running=6.0, last_exit_at=5.0, restarts=1
        ),
    }
    zk = ZkView(connected=True, reports={}, roce_map=roce_map)  # the leader's report gone
    faults = detect(view(s, pods, servers({"sp0": 2}), now=102.0, zk=zk), roce_map)
    assert [(f.kind, f.pods, f.since) for f in faults] == [(FaultKind.KILL, (), 100.0)]


def test_a_rank_fault_with_its_workers_pod_not_ready_restarts_that_pod() -> None:
    """A worker that exits gracefully: its leader sees the rank go (its session closed) before
    the kubelet says the container ended. Restarted in place, not the instance replaced."""
    s = spec(d_pods=1, d_npus=2)
    zk = formed_zk(
        {"g-p-0": (P, 0), "g-d-0": (D, 1)},
        health_ts=99.0,
        loads={"g-p-0": zl.Load(), "g-d-0": zl.Load()},
    )
    health = zk.health["g-p-0"].model_copy(
        update={
            "state": zl.HealthState.FAULTY,
            "faults": [
                zl.EngineFault(kind=zl.EngineFaultKind.RANK, since=98.0, dies=[2], detail="gone")
            ],
        }
    )
    zk = dataclasses.replace(zk, health={**zk.health, "g-p-0": health})
    leader = dataclasses.replace(pod("g-p-0", P, "g-p-0", node="sp0-s0", running=-5.0), ready=True)
    worker = dataclasses.replace(
        pod("g-p-0-1", P, "g-p-0", node="sp0-s1", running=-5.0), ready=False
    )
    decode = dataclasses.replace(pod("g-d-0", D, "g-d-0", node="sp0-s2", running=1.0), ready=True)
    pods = {"g-p-0": leader, "g-p-0-1": worker, "g-d-0": decode}
    faults = detect(view(s, pods, servers({"sp0": 4}), zk=zk), zk.roce_map)
    assert [(f.kind, f.instances, f.pods) for f in faults] == [
        (FaultKind.KILL, ("g-p-0",), ("g-p-0-1",))
    ]
    ready = {**pods, "g-p-0-1": dataclasses.replace(worker, ready=True)}
    faults = detect(view(s, ready, servers({"sp0": 4}), zk=zk), zk.roce_map)
    assert [f.kind for f in faults] == [FaultKind.RANK]


def test_an_instance_no_superpod_of_the_cluster_could_hold_is_refused_naming_the_field() -> None:
    nodes = servers({"sp0": 4, "sp1": 3}).values()
    assert gang.larger_than_any_superpod(spec(p_pods=4, p_npus=32), nodes) == []
    errors = gang.larger_than_any_superpod(spec(p_pods=5, p_npus=40), nodes)
    assert errors == [
        "spec.prefill.podsPerInstance: an instance of 5 pods of 8 NPUs fits no SuperPod of this "
        "cluster, even empty (the largest: sp0, 4 servers of Ascend910C); an instance's pods run "
        "one per server in one SuperPod"
    ]
    # no server of the role's NPU type seen yet: nothing said (not refused for ever)
    assert gang.larger_than_any_superpod(spec(p_pods=5, p_npus=40), []) == []
