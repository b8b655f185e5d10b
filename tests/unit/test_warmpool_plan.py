"""The WarmPool planner and the PDGroup's warm-pod claims (pure; issue 18): the pool is kept at
its size per shape, refilled after claims, trimmed with the pod's resourceVersion as precondition;
a group claims a fitting warm pod instead of creating one, never one pod twice, forks from a live
source of its model, and writes the claimed pod's assignment until the pod reports."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from fakes import FakeCore, engine_report, formed_group, pdgroup_spec
from matrixserve.adapters.kube import KubeAdapter
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import EngineResources, Ref, WarmPoolSpec
from matrixserve.api.status import PDGroupStatus
from matrixserve.domain import pdgroup, warmclaim
from matrixserve.domain import scaleout as so
from matrixserve.domain import warmpool as wp
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import PodView
from matrixserve.domain.pdgroup import GroupView, ZkView
from matrixserve.domain.pdgroup.actions import AssignWarmPod, ClaimWarmPod, CreatePod, DeletePod
from matrixserve.domain.pdgroup.obtain import assignments, last_scale, warm_or_cold
from matrixserve.domain.pdgroup.pods import pod_labels
from matrixserve.domain.scaleout import Path
from matrixserve.domain.warmpool.plan import CreateWarmPod, DeleteWarmPod
from matrixserve.domain.warmpool.pods import pod_labels as warm_labels
from matrixserve.domain.warmpool.pods import template

pytestmark = pytest.mark.unit
P, D = zl.Role.PREFILL, zl.Role.DECODE
ENGINE = EngineSettings(zookeeper="127.0.0.1:2181", time_scale="20")


# --------------------------------------------------------------------------- the pool
def pool_spec(size: int = 2, **extra: Any) -> WarmPoolSpec:
    body: dict[str, Any] = {"shapes": [{"name": "two", "size": size, "devicesPerPod": 2}]}
    body.update(extra)
    return WarmPoolSpec.model_validate(body)


def warm_pod(
    name: str,
    ready: bool = True,
    claimed_by: str | None = None,
    shape: str = "two",
    rv: str = "5",
    node: str = "n1",
) -> PodView:
    labels = warm_labels("wp", shape, pool_spec().shapes[0])
    if claimed_by:
        labels[kinds.LABEL_CLAIMED_BY] = claimed_by
    made = {kinds.ANNOTATION_WARM_TEMPLATE: template(pool_spec().shapes[0], pool_spec().image)}
    return PodView(
        name,
        f"uid-{name}",
        labels,
        "Running",
        ready,
        False,
        node,
        "sp0",
        0.0,
        annotations=made,
        resource_version=rv,
    )


def warm_report(name: str, superpod: str = "sp0", dies: int = 4) -> zl.WarmReport:
    return zl.WarmReport(
        pod=name,
        podUid=f"uid-{name}",
        podIP="127.70.0.2",
        port=8000,
        node="n1",
        superpod=superpod,
        dies=list(range(dies)),
        roceIps=[f"198.19.0.{i + 1}" for i in range(dies)],
        incarnation="i1",
        ts=0.0,
    )


def pool_view(
    pods: list[PodView],
    reports: list[str] | None = None,
    spec: WarmPoolSpec | None = None,
    **kw: Any,
) -> wp.PoolView:
    names = [p.name for p in pods] if reports is None else reports
    return wp.PoolView(
        "ns",
        "wp",
        "uid-wp",
        kw.pop("generation", 1),
        spec or pool_spec(),
        {p.name: p for p in pods},
        {n: warm_report(n) for n in names},
        ENGINE,
        now=100.0,
        **kw,
    )


def test_an_empty_pool_is_filled_with_warm_pods_at_low_priority_owned_by_the_pool() -> None:
    plan = wp.plan(pool_view([]))
    created = [a for a in plan.actions if isinstance(a, CreateWarmPod)]
    assert [a.name for a in created] == ["wp-two-w0", "wp-two-w1"]
    manifest = created[0].manifest
    assert "priorityClassName" not in manifest["spec"]  # the serving pods' priority (see pods.py)
    assert manifest["metadata"]["ownerReferences"][0]["kind"] == "WarmPool"
    env = {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}
    assert env["ENGINE_WARM"] == "1"
    assert "ENGINE_MODEL" not in env
    assert "MATRIXSERVE_GROUP" not in env
    npus = manifest["spec"]["containers"][0]["resources"]["limits"][kinds.NPU_RESOURCE]
    assert npus == "2"
    assert plan.status["warming"] == 0
    assert plan.status["ready"] == 0
    assert plan.conditions[0].status is False


def test_a_claimed_pod_is_counted_claimed_untouched_and_refilled_under_a_new_name() -> None:
    pods = [warm_pod("wp-two-0", claimed_by="g"), warm_pod("wp-two-1")]
    plan = wp.plan(pool_view(pods))
    assert [a.name for a in plan.actions if isinstance(a, CreateWarmPod)] == ["wp-two-w0"]
    assert not [a for a in plan.actions if isinstance(a, DeleteWarmPod)]
    assert plan.status["claimed"] == 1
    assert plan.status["ready"] == 1


def test_only_a_ready_pod_whose_engine_reported_is_warm() -> None:
    pods = [warm_pod("wp-two-0"), warm_pod("wp-two-1", ready=False)]
    plan = wp.plan(pool_view(pods, reports=["wp-two-1"]))  # the Ready one has not reported
    assert plan.status["ready"] == 0
    assert plan.status["warming"] == 2
    assert not plan.actions


def test_beyond_the_size_warming_pods_go_first_with_their_resource_version() -> None:
    pods = [warm_pod("wp-two-0"), warm_pod("wp-two-1"), warm_pod("wp-two-2", ready=False)]
    plan = wp.plan(pool_view(pods, spec=pool_spec(size=1)))
    deleted = [a for a in plan.actions if isinstance(a, DeleteWarmPod)]
    assert [(a.name, a.resource_version) for a in deleted] == [("wp-two-2", "5"), ("wp-two-1", "5")]


def test_a_shape_removed_from_the_spec_loses_its_unclaimed_pods_only() -> None:
    pods = [warm_pod("wp-old-0", shape="old"), warm_pod("wp-old-1", shape="old", claimed_by="g")]
    plan = wp.plan(pool_view(pods))
    assert [a.name for a in plan.actions if isinstance(a, DeleteWarmPod)] == ["wp-old-0"]


def test_manual_refill_fills_a_new_generation_once_and_does_not_refill_claims() -> None:
    spec = pool_spec(refillPolicy="Manual")
    first = wp.plan(pool_view([], spec=spec))
    assert len([a for a in first.actions if isinstance(a, CreateWarmPod)]) == 2
    pods = [warm_pod("wp-two-0", claimed_by="g"), warm_pod("wp-two-1")]
    later = wp.plan(pool_view(pods, spec=spec, previous=first.status))
    assert not later.actions
    assert later.conditions[0].reason == "NotRefilled"
    edited = wp.plan(pool_view(pods, spec=spec, previous=first.status, generation=2))
    assert [a.name for a in edited.actions if isinstance(a, CreateWarmPod)] == ["wp-two-w0"]


def test_without_zookeeper_nothing_is_created_and_nothing_counted_warm() -> None:
    plan = wp.plan(pool_view([warm_pod("wp-two-0")], connected=False))
    assert not [a for a in plan.actions if isinstance(a, CreateWarmPod)]
    assert plan.conditions[0].reason == "ZooKeeperUnreachable"


# --------------------------------------------------------------------------- the group's claims
group_spec = pdgroup_spec


def member(name: str, role: zl.Role) -> PodView:
    return PodView(
        name, f"uid-{name}", pod_labels("g", role, name), "Running", True, False, "n1", "sp0", 0.0
    )


def source(instance: str = "g-p-0", superpod: str = "sp0", dies: int = 4) -> zl.ForkSource:
    return zl.ForkSource(
        key="llama3-8b.abc",
        model="llama3-8b",
        artifacts="abc",
        group="ns/g",
        instance=instance,
        podIP="127.64.0.2",
        port=8000,
        node="n1",
        superpod=superpod,
        dies=dies,
        incarnation="x",
        ts=0.0,
    )


def serving_zk(*names: str) -> ZkView:
    """ZooKeeper as it is while these members serve (each reported, healthy)."""
    reports = {n: engine_report(n, i) for i, n in enumerate(names)}
    health = {
        n: zl.Health(
            instance=n,
            role=P if "-p-" in n else D,
            state=zl.HealthState.SERVING,
            seq=1,
            ts=49.0,
            podIP=r.pod_ip,
            port=8000,
        )
        for n, r in reports.items()
    }
    return ZkView(connected=True, reports=reports, health=health)


def group_view(pods: list[PodView], warm: list[PodView], **kw: Any) -> GroupView:
    view: GroupView = formed_group(
        group_spec(), {p.name: p for p in pods}, ZkView(connected=True), now=50.0, engine=ENGINE
    )
    return dataclasses.replace(
        view,
        warm_pods={p.name: p for p in warm},
        warm_reports={p.name: warm_report(p.name) for p in warm},
        **kw,
    )


def test_a_missing_instance_claims_a_warm_pod_instead_of_creating_one() -> None:
    view = group_view([member("g-p-0", P), member("g-d-0", D)], [warm_pod("wp-two-0")])
    actions = warm_or_cold(view, {"g-p-1": P})
    assert [type(a) for a in actions] == [ClaimWarmPod]
    claim = actions[0]
    assert isinstance(claim, ClaimWarmPod)
    assert claim.name == "wp-two-0"
    assert claim.resource_version == "5"
    labels = claim.patch["labels"]
    assert labels[kinds.LABEL_GROUP] == "g"
    assert labels[kinds.LABEL_INSTANCE] == "g-p-1"
    assert labels[kinds.LABEL_CLAIMED_BY] == "g"
    assert claim.patch["ownerReferences"][0]["uid"] == "uid-g"
    assert json.loads(claim.patch["annotations"][kinds.ANNOTATION_CLAIM])["instance"] == "g-p-1"


def test_a_claim_names_its_kind_and_a_bare_name_reads_as_a_pdgroups() -> None:
    view = group_view([member("g-d-0", D)], [warm_pod("wp-two-0")])
    (claim,) = warm_or_cold(view, {"g-p-0": P})
    assert isinstance(claim, ClaimWarmPod)
    assert claim.patch["labels"][kinds.LABEL_CLAIMED_KIND] == "PDGroup"
    # a pod the operator claimed before the kind was written: the group's still
    old = claimed("wp-two-0", "g-p-1", P, {"path": "WarmSharedFileService"})
    assert kinds.LABEL_CLAIMED_KIND not in old.labels
    assert warmclaim.Claimer.of(old) == warmclaim.Claimer("PDGroup", "g")
    assert warmclaim.Claimer.of(warm_pod("wp-two-1")) is None
    assert group_view([member("g-d-0", D), old], []).claimed(old)


def test_an_expert_pools_claim_of_the_same_name_is_not_the_groups() -> None:
    pool = warmclaim.Claimer("ExpertPool", "g")
    theirs = claimed("wp-two-0", "g-p-1", P, {"path": "WarmSharedFileService"})
    theirs = dataclasses.replace(theirs, labels={**theirs.labels, **pool.labels()})
    view = group_view([member("g-p-0", P), member("g-d-0", D), theirs], [])
    assert pool.claimed(theirs)
    assert not view.claimed(theirs)
    assert "g-p-1" not in view.instances  # a stray of the group's label, not its instance
    assert not assignments(view)
    # and a claimed pod is no candidate for anyone
    fit = warmclaim.Fit("Ascend910C", 2, pool_spec().image)
    free = warm_pod("wp-two-1")
    taken = dataclasses.replace(free, name="wp-two-2", labels={**free.labels, **pool.labels()})
    reports = {n: warm_report(n) for n in ("wp-two-1", "wp-two-2")}
    reports["wp-two-2"] = reports["wp-two-2"].model_copy(update={"pod_uid": "uid-wp-two-1"})
    pods = {"wp-two-1": free, "wp-two-2": taken}
    assert [w.name for w in warmclaim.candidates(pods, reports, fit)] == ["wp-two-1"]
    elsewhere = dataclasses.replace(fit, superpods=frozenset({"sp9"}))
    assert warmclaim.candidates(pods, reports, elsewhere) == []


def test_an_expert_pool_claims_and_assigns_a_warm_pod_through_the_shared_claim() -> None:
    """What an ExpertPool's replacement server takes from the shared module: the patch with
    its kind, its owner, the record; the assignment falling back when its fork source is gone."""
    pool = warmclaim.Claimer("ExpertPool", "experts")
    choice = so.choose(
        [so.Want("srv-3", "llama3-8b", "", 2)],
        [so.WarmPod("wp-two-0", "n1", "sp0", 2)],
        [so.ForkSource("ns/g/g-p-0", "sp0", "llama3-8b", "", None)],
        so.Estimates(1.0, 0.2, 1.0, 0.1, 0.5, dict.fromkeys(so.LOAD_SOURCE.values(), 5.0)),
        set(so.Path),
    )[0]
    owner = {"apiVersion": kinds.API_VERSION, "kind": "ExpertPool", "name": "experts", "uid": "u"}
    record = warmclaim.record(choice, "srv-3", "expert", now=12.0)
    patch = warmclaim.claim_patch(pool, owner, {"app": "x"}, {}, record)
    assert patch["labels"] == {"app": "x", **pool.labels()}
    assert patch["ownerReferences"] == [owner]
    pod = dataclasses.replace(
        warm_pod("wp-two-0"),
        labels={**warm_pod("wp-two-0").labels, **patch["labels"]},
        annotations=patch["annotations"],
    )
    assert warmclaim.claim_of(pod).instance == "srv-3"
    assert choice.path in (Path.WARM_FORK_UB, Path.WARM_FORK_ROCE)
    env = {"ENGINE_ROLE": "expert"}
    forked = warmclaim.assignment(
        pod, owner="ns/experts", instance="srv-3", env=env, fork_sources=[source()], now=13.0
    )
    assert forked.fork is not None
    assert forked.load_source == "NPUForkUB"
    assert (forked.group, forked.instance, forked.env) == ("ns/experts", "srv-3", env)
    gone = warmclaim.assignment(
        pod, owner="ns/experts", instance="srv-3", env=env, fork_sources=[], now=13.0
    )
    assert gone.fork is None
    assert gone.load_source == "SharedFileService"


def test_one_warm_pod_is_promised_to_one_instance_the_rest_start_cold() -> None:
    view = group_view([member("g-d-0", D)], [warm_pod("wp-two-0")])
    actions = warm_or_cold(view, {"g-p-0": P, "g-p-1": P})
    claims = [a for a in actions if isinstance(a, ClaimWarmPod)]
    creates = [a for a in actions if isinstance(a, CreatePod)]
    assert [c.instance for c in claims] == ["g-p-0"]
    assert [c.name for c in creates] == ["g-p-1"]


def test_a_warm_pod_that_does_not_fit_or_is_not_warm_yet_is_not_claimed() -> None:
    other = warm_pod("wp-four-0")
    other = dataclasses.replace(other, labels={**other.labels, kinds.LABEL_WARM_NPUS: "4"})
    warming = warm_pod("wp-two-1", ready=False)
    view = group_view([member("g-d-0", D)], [other, warming])
    assert [type(a) for a in warm_or_cold(view, {"g-p-0": P})] == [CreatePod]


def test_a_live_source_of_the_model_in_the_superpod_forks_over_ub_across_over_roce() -> None:
    pods = [member("g-p-0", P), member("g-d-0", D)]
    near = group_view(
        pods, [warm_pod("wp-two-0")], fork_sources=(source(),), zk=serving_zk("g-p-0")
    )
    (claim,) = warm_or_cold(near, {"g-p-1": P})
    assert isinstance(claim, ClaimWarmPod)
    assert claim.path == Path.WARM_FORK_UB
    assert claim.fork_source == "ns/g/g-p-0"
    far = group_view(
        pods, [warm_pod("wp-two-0")], fork_sources=(source(superpod="sp9"),), zk=serving_zk("g-p-0")
    )
    (claim,) = warm_or_cold(far, {"g-p-1": P})
    assert isinstance(claim, ClaimWarmPod)
    assert claim.path == Path.WARM_FORK_ROCE
    other_dies = group_view(pods, [warm_pod("wp-two-0")], fork_sources=(source(dies=8),))
    (claim,) = warm_or_cold(other_dies, {"g-p-1": P})
    assert isinstance(claim, ClaimWarmPod)
    assert claim.path == Path.WARM_SHARED


def claimed(name: str, instance: str, role: zl.Role, claim: dict[str, Any]) -> PodView:
    labels = {**warm_labels("wp", "two", pool_spec().shapes[0]), **pod_labels("g", role, instance)}
    labels[kinds.LABEL_CLAIMED_BY] = "g"
    return PodView(
        name,
        f"uid-{name}",
        labels,
        "Running",
        True,
        False,
        "n1",
        "sp0",
        0.0,
        annotations={
            kinds.ANNOTATION_CLAIM: json.dumps({"instance": instance, "role": role.value, **claim})
        },
    )


def test_a_claimed_pod_is_its_instance_and_gets_its_assignment_until_it_reports() -> None:
    pod = claimed("wp-two-0", "g-p-1", P, {"path": "WarmForkUB", "forkSource": "ns/g/g-p-0"})
    view = group_view([member("g-p-0", P), member("g-d-0", D), pod], [], fork_sources=(source(),))
    assert "g-p-1" in view.instances
    assert view.instances["g-p-1"].leader.name == "wp-two-0"
    assert pdgroup.warm_needed(view) == (False, ["wp-two-0"])
    (assign,) = assignments(view)
    assert isinstance(assign, AssignWarmPod)
    a = assign.assignment
    assert a.pod_uid == "uid-wp-two-0"
    assert a.instance == "g-p-1"
    assert a.group == "ns/g"
    assert a.env["ENGINE_MODEL"] == "llama3-8b"
    assert set(a.env) <= zl.ASSIGNMENT_ENV  # never the pod's own ZooKeeper, credential, devices
    assert a.env["ENGINE_ROLE"] == "auto"
    assert a.fork is not None
    assert a.fork.plane == "UB"
    assert a.load_source == "NPUForkUB"
    assert a.fallback == "SharedFileService"
    ops = assign.znodes(zl.GroupPaths("ns", "g"))
    assert ops == [zl.Put(zl.WarmPaths("ns").assignment("wp-two-0"), a.dump())]
    # written already: not again; reported: not again
    assert not assignments(dataclasses.replace(view, assigned=frozenset({"wp-two-0"})))
    reported = dataclasses.replace(
        view,
        zk=ZkView(
            connected=True, reports={"g-p-1": engine_report("g-p-1", 3, pod_uid="uid-wp-two-0")}
        ),
    )
    assert not assignments(reported)


def test_a_fork_whose_source_is_gone_since_the_claim_loads_from_the_fallback_at_once() -> None:
    pod = claimed("wp-two-0", "g-p-1", P, {"path": "WarmForkUB", "forkSource": "ns/g/g-p-0"})
    view = group_view([member("g-d-0", D), pod], [])
    (assign,) = assignments(view)
    assert isinstance(assign, AssignWarmPod)
    assert assign.assignment.fork is None
    assert assign.assignment.load_source == "SharedFileService"


def test_the_plan_claims_rather_than_creating_and_creates_nothing_for_a_claimed_instance() -> None:
    pods = [member("g-p-0", P), member("g-d-0", D)]
    view = group_view(pods, [warm_pod("wp-two-0")])
    actions = pdgroup.plan(view).actions
    assert [a.instance for a in actions if isinstance(a, ClaimWarmPod)] == ["g-p-1"]
    assert not [a for a in actions if isinstance(a, CreatePod)]
    after = group_view(
        [*pods, claimed("wp-two-0", "g-p-1", P, {"path": "WarmSharedFileService"})], []
    )
    actions = pdgroup.plan(after).actions
    assert not [a for a in actions if isinstance(a, CreatePod | ClaimWarmPod)]
    assert [a.pod for a in actions if isinstance(a, AssignWarmPod)] == ["wp-two-0"]


# --------------------------------------------------------------------------- the claim itself
async def test_of_two_claims_on_one_pod_at_one_resource_version_only_the_first_goes_through() -> (
    None
):
    core = FakeCore()
    core.create_namespaced_pod(
        "ns", {"metadata": {"name": "wp-two-0", "labels": {kinds.LABEL_WARMPOOL: "wp"}}}
    )
    kube = KubeAdapter.__new__(KubeAdapter)
    kube.core = core
    seen = (await kube.list_pods("ns", {}, (kinds.LABEL_WARMPOOL, f"!{kinds.LABEL_CLAIMED_BY}")))[
        "wp-two-0"
    ]
    first = {"labels": {kinds.LABEL_CLAIMED_BY: "a"}}
    second = {"labels": {kinds.LABEL_CLAIMED_BY: "b"}}
    assert await kube.claim_pod("ns", "wp-two-0", seen.resource_version, first) is True
    assert await kube.claim_pod("ns", "wp-two-0", seen.resource_version, second) is False
    assert core.pods[("ns", "wp-two-0")]["metadata"]["labels"][kinds.LABEL_CLAIMED_BY] == "a"
    # the claimed pod is no longer a candidate, and the pool's delete at the old version fails
    assert not await kube.list_pods("ns", {}, (kinds.LABEL_WARMPOOL, f"!{kinds.LABEL_CLAIMED_BY}"))
    assert (
        await kube.delete_pod("ns", "wp-two-0", seen.uid, resource_version=seen.resource_version)
        is False
    )
    assert ("ns", "wp-two-0") in core.pods


def test_one_source_forks_to_at_most_32_targets_over_a_whole_pass() -> None:
    warm = [warm_pod(f"wp-two-{i}") for i in range(34)]
    view = group_view(
        [member("g-p-0", P), member("g-d-0", D)],
        warm,
        fork_sources=(source(),),
        zk=serving_zk("g-p-0"),
    )
    missing = {f"g-p-{i}": P for i in range(1, 35)}
    claims = [a for a in warm_or_cold(view, missing) if isinstance(a, ClaimWarmPod)]
    assert len(claims) == 34
    assert len({c.name for c in claims}) == 34  # every warm pod promised once
    forked = [c for c in claims if c.fork_source == "ns/g/g-p-0"]
    assert len(forked) == 32
    assert {c.path for c in claims if c.fork_source is None} == {Path.WARM_SHARED}


def test_the_operator_may_allow_only_some_paths_and_an_instance_without_one_waits() -> None:
    pods = [member("g-p-0", P), member("g-d-0", D)]
    only_shared = dataclasses.replace(ENGINE, scale_out_paths=("WarmSharedFileService",))
    view = group_view(pods, [warm_pod("wp-two-0")], fork_sources=(source(),), engine=only_shared)
    (claim,) = warm_or_cold(view, {"g-p-1": P, "g-p-2": P})  # one warm pod: the other waits
    assert isinstance(claim, ClaimWarmPod)
    assert claim.path == Path.WARM_SHARED
    only_cold = dataclasses.replace(ENGINE, scale_out_paths=("Cold",))
    view = group_view(pods, [warm_pod("wp-two-0")], engine=only_cold)
    assert [type(a) for a in warm_or_cold(view, {"g-p-1": P})] == [CreatePod]


def serving_health(report: zl.Report, role: zl.Role, **extra: Any) -> zl.Health:
    """The Serving health of the engine that wrote ``report``."""
    return zl.Health(
        instance=report.instance,
        role=role,
        state=zl.HealthState.SERVING,
        seq=1,
        ts=49.0,
        podIP=report.pod_ip,
        port=8000,
        **extra,
    )


def test_last_scale_records_the_newest_serving_instance_once() -> None:
    pod = claimed(
        "wp-two-0", "g-p-1", P, {"path": "WarmForkUB", "forkSource": "ns/g/g-p-0", "at": 40.0}
    )
    report = engine_report("g-p-1", 3, pod_uid="uid-wp-two-0")
    health = serving_health(
        report,
        P,
        phases={"TEPreLoad": 0.0, "TELoad": 0.1, "TEPostLoad": 0.5},
        loadSource="NPUForkUB",
        warm=True,
    )
    zk = ZkView(connected=True, reports={"g-p-1": report}, health={"g-p-1": health})
    view = group_view([member("g-d-0", D), pod], [], zk=zk)
    record = last_scale(view)
    assert record is not None
    assert record["instance"] == "g-p-1"
    assert record["path"] == "WarmForkUB"
    assert record["loadSource"] == "NPUForkUB"
    assert record["emulatedSeconds"] == 0.6
    assert record["wallSeconds"] == 10.0  # claimed at 40, seen serving at 50
    later = dataclasses.replace(view, now=80.0, previous=PDGroupStatus(last_scale=record))
    assert last_scale(later) == record  # kept, not re-timed


# --------------------------------------------------------------------------- host DRAM pre-loads
def test_dram_preloads_follow_the_demand_in_order_within_each_servers_capacity() -> None:
    from matrixserve.domain.warmpool import dram

    gb = 1e9
    demand = [
        dram.Demand("big", 1000 * gb),
        dram.Demand("only-sp1", 100 * gb, {"matrixserve.io/superpod": "sp1"}),
        dram.Demand("huge", 900 * gb),  # does not fit after "big": skipped, the next may go
        dram.Demand("small", 16 * gb),
        dram.Demand("big", 1000 * gb),  # named twice: once
    ]
    nodes = {"a": {"matrixserve.io/superpod": "sp0"}, "b": {"matrixserve.io/superpod": "sp1"}}
    plans = dram.plan(demand, nodes, capacity=1500 * gb)  # 90 %: 1,350 GB of room
    assert plans["a"].models == ("big", "small")
    assert plans["b"].models == ("big", "only-sp1", "small")
    assert plans["b"].bytes == 1116 * gb
    assert all(p.bytes <= 0.9 * 1500 * gb for p in plans.values())


def test_the_pool_status_says_each_servers_planned_and_loaded_models_and_its_hit_rate() -> None:
    from matrixserve.domain.warmpool import dram

    pods = [
        warm_pod("wp-two-0", node="n1"),
        warm_pod("wp-two-1", node="n1", claimed_by="g"),
    ]
    pods[1] = dataclasses.replace(
        pods[1], annotations={kinds.ANNOTATION_CLAIM: json.dumps({"path": "WarmDRAM"})}
    )
    reports = {
        "wp-two-0": warm_report("wp-two-0").model_copy(update={"dram_models": ["llama3-8b"]})
    }
    view = dataclasses.replace(
        pool_view(pods),
        reports=reports,
        dram_demand=(dram.Demand("llama3-8b", 16e9),),
        nodes={"n1": {}},
    )
    plan = wp.plan(view)
    assert plan.status["dram"] == [
        {
            "node": "n1",
            "models": ["llama3-8b"],
            "loaded": ["llama3-8b"],
            "bytes": 16_000_000_000,
            "capacityBytes": 1_500_000_000_000,
        }
    ]
    assert plan.dram["n1"].models == ("llama3-8b",)
    assert plan.status["hitRatePercent"] == 100


def test_the_dram_demand_reads_pools_and_groups_through_their_models_in_order() -> None:
    """Pools in name order with their pre-loads, then the groups' models, the group with the
    most instances first; an object whose spec does not parse, or a model of unknown size, asks
    for nothing."""
    from matrixserve.domain.warmpool import dram

    def body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": spec}

    shapes = [{"size": 1, "devicesPerPod": 2}]
    pools = [
        body("b", {"shapes": shapes, "dramPreload": [{"model": "llama3-8b"}]}),
        body("a", {"shapes": shapes, "dramPreload": [{"model": "gpt3-175b"}, {"model": "x"}]}),
        body("broken", {"shapes": [], "dramPreload": [{"model": "deepseek-v3"}]}),
    ]
    small = group_spec(p=1, d=1).model_dump(by_alias=True, exclude_none=True)
    big = group_spec(p=2, d=2).model_dump(by_alias=True, exclude_none=True)
    sized = copy.deepcopy(small)
    sized["model"] = {"name": "custom", "sizeBytes": 7}
    groups = [
        body("small", small),
        body("big", big),
        body("sized", sized),
        body("invalid", {**big, "prefill": {"replicas": -1}}),
    ]
    assert [(d.model, d.why) for d in dram.demand(pools, groups)] == [
        ("gpt3-175b", "WarmPool a"),
        ("llama3-8b", "WarmPool b"),
        ("llama3-8b", "PDGroup big"),
        ("custom", "PDGroup sized"),  # as many instances as "small": by name
        ("llama3-8b", "PDGroup small"),
    ]
    assert dram.demand([], [body("sized", sized)])[0].bytes == 7.0


def test_dram_plans_are_written_where_zookeepers_differ_stamped_with_the_views_time() -> None:
    from matrixserve.domain.warmpool import dram

    plans = dram.plan([dram.Demand("llama3-8b", 16e9)], {"n1": {}, "n2": {}, "n3": {}})
    same = zl.DramPlan(node="n1", models=["llama3-8b"], bytes=16e9, ts=1.0)
    other = zl.DramPlan(node="n2", models=["gpt3-175b"], bytes=16e9)
    written = {"n1": same, "n2": other, "n3": None, "n4": zl.DramPlan(node="n4")}
    change = dram.writes(plans, written, now=42.0)
    assert change is not None
    assert [(p.node, p.models, p.ts) for p in change.plans] == [
        ("n2", ["llama3-8b"], 42.0),
        ("n3", ["llama3-8b"], 42.0),  # unreadable there: written again
    ]
    assert change.removed == ("n4",)
    assert change.nodes == ["n2", "n3", "n4"]
    paths = zl.WarmPaths("ns")
    assert [type(op).__name__ + " " + op.path for op in change.znodes(paths)] == [
        f"Delete {paths.dram('n4')}",
        f"Put {paths.dram('n2')}",
        f"Put {paths.dram('n3')}",
    ]
    assert dram.writes(plans, {**written, "n2": same, "n3": same}, now=42.0) == (
        dram.WriteDramPlans(removed=("n4",))
    )
    assert dram.writes({"n1": plans["n1"]}, {"n1": same}, now=42.0) is None


def test_the_pool_writes_its_dram_plans_only_with_zookeeper_and_only_what_changed() -> None:
    from matrixserve.domain.warmpool import dram

    view = dataclasses.replace(
        pool_view([warm_pod("wp-two-0"), warm_pod("wp-two-1")]),
        now=7.0,
        dram_demand=(dram.Demand("llama3-8b", 16e9),),
        nodes={"n1": {}},
    )
    (write,) = [a for a in wp.plan(view).actions if isinstance(a, dram.WriteDramPlans)]
    assert [(p.node, p.models, p.ts) for p in write.plans] == [("n1", ["llama3-8b"], 7.0)]
    settled = dataclasses.replace(view, dram_written={"n1": write.plans[0]})
    assert not wp.plan(settled).actions
    away = dataclasses.replace(view, connected=False)
    assert not [a for a in wp.plan(away).actions if isinstance(a, dram.WriteDramPlans)]


def test_no_pod_or_assignment_fixes_how_many_read_the_shared_file_service() -> None:
    """The engines count the bucket's readers as they load (enginestub.engine.bucket): a count
    fixed in a pod's environment outlived the first setup, and a container restarted in place
    loaded eight times slower than alone (bench-recovery's kill: 67 s)."""

    def env_of(action: Any) -> dict[str, str | None]:
        return {e["name"]: e.get("value") for e in action.manifest["spec"]["containers"][0]["env"]}

    cold = group_view([], [])
    creates = warm_or_cold(cold, {"g-p-0": P, "g-p-1": P, "g-d-0": D})
    assert len(creates) == 3
    assert all("ENGINE_CONCURRENT_LOADERS" not in env_of(a) for a in creates)
    mixed = group_view([member("g-d-0", D)], [warm_pod("wp-two-0")])
    actions = warm_or_cold(mixed, {"g-p-0": P, "g-p-1": P})
    (claim,) = [a for a in actions if isinstance(a, ClaimWarmPod)]
    record = json.loads(claim.patch["annotations"][kinds.ANNOTATION_CLAIM])
    assert "loaders" not in record
    (assign,) = assignments(
        group_view([member("g-d-0", D), claimed("wp-two-0", "g-p-0", P, record)], [])
    )
    assert isinstance(assign, AssignWarmPod)
    assert assign.assignment.load_source == "SharedFileService"
    assert "ENGINE_CONCURRENT_LOADERS" not in assign.assignment.env
    assert "ENGINE_CONCURRENT_LOADERS" not in zl.ASSIGNMENT_ENV


def test_a_warm_decode_must_be_in_the_superpod_of_the_groups_decodes() -> None:
    far = warm_pod("wp-two-0")
    view = group_view([member("g-p-0", P), member("g-d-0", D)], [far])
    view = dataclasses.replace(
        view, warm_reports={"wp-two-0": warm_report("wp-two-0", superpod="sp9")}
    )
    assert [type(a) for a in warm_or_cold(view, {"g-d-1": D})] == [CreatePod]
    assert [type(a) for a in warm_or_cold(view, {"g-p-1": P})] == [ClaimWarmPod]


def test_a_name_with_a_trailing_newline_is_no_znode_name() -> None:
    with pytest.raises(ValueError, match="lower-case DNS name"):
        zl.WarmPaths("t").pod("w-1\n")
    with pytest.raises(ValueError, match="lower-case DNS name"):
        zl.GroupPaths("t", "g").report("g-p-0\n")


# --------------------------------------------------------------------------- review findings
def test_an_old_warm_pod_claimed_in_a_first_setup_is_not_released_as_late() -> None:
    pod = claimed("wp-two-0", "g-p-0", P, {"path": "WarmSharedFileService", "at": 999.0})
    view = dataclasses.replace(group_view([pod], []), now=1000.0)  # the pod was made at 0
    actions = pdgroup.plan(view).actions
    assert not [a for a in actions if isinstance(a, DeletePod)]
    assert [a.pod for a in actions if isinstance(a, AssignWarmPod)] == ["wp-two-0"]
    late = dataclasses.replace(view, now=999.0 + 301.0)  # 300 s after its claim: released
    assert [a.name for a in pdgroup.plan(late).actions if isinstance(a, DeletePod)] == ["wp-two-0"]


def test_the_pool_replaces_pods_of_another_template_and_pods_that_ended() -> None:
    old = dataclasses.replace(
        warm_pod("wp-two-w0"), annotations={kinds.ANNOTATION_WARM_TEMPLATE: "{}"}
    )
    ended = dataclasses.replace(warm_pod("wp-two-w1"), phase="Failed")
    plan = wp.plan(pool_view([old, ended]))
    deleted = {a.name: a.reason for a in plan.actions if isinstance(a, DeleteWarmPod)}
    assert deleted == {"wp-two-w0": "its shape or image changed", "wp-two-w1": "it ended (Failed)"}
    assert len([a for a in plan.actions if isinstance(a, CreateWarmPod)]) == 2


def test_a_starved_serving_pod_gets_the_npus_of_a_warm_pod_and_the_pool_waits() -> None:
    pods = [warm_pod("wp-two-w0"), warm_pod("wp-two-w1", ready=False)]
    plan = wp.plan(dataclasses.replace(pool_view(pods), starved=1))
    assert [a.name for a in plan.actions if isinstance(a, DeleteWarmPod)] == ["wp-two-w1"]
    assert not [a for a in plan.actions if isinstance(a, CreateWarmPod)]
    assert plan.conditions[0].reason == "Yielding"


def test_only_serving_pods_short_of_npus_starve() -> None:
    """A serving pod (or a claimed warm one, its group's now) Pending for want of NPUs starves;
    an unclaimed warm pod, one short of something else, or one being deleted does not."""
    npus = ("Unschedulable", f"0/3 nodes are available: 3 Insufficient {kinds.NPU_RESOURCE}.")
    pending = dataclasses.replace(
        warm_pod("g-p-0"), labels={kinds.LABEL_GROUP: "g"}, phase="Pending", trouble=npus
    )
    pods = [
        pending,
        dataclasses.replace(warm_pod("wp-two-w0", claimed_by="g"), phase="Pending", trouble=npus),
        dataclasses.replace(warm_pod("wp-two-w1"), phase="Pending", trouble=npus),
        dataclasses.replace(pending, trouble=("Unschedulable", "0/3 nodes: Insufficient cpu")),
        dataclasses.replace(pending, deleting=True),
        dataclasses.replace(pending, phase="Running"),
    ]
    assert wp.starved(pods) == 2


def test_a_name_someone_else_holds_is_not_tried_again() -> None:
    plan = wp.plan(dataclasses.replace(pool_view([]), taken=frozenset({"wp-two-w0"})))
    assert [a.name for a in plan.actions if isinstance(a, CreateWarmPod)] == [
        "wp-two-w1",
        "wp-two-w2",
    ]


def test_a_manual_pool_made_while_zookeeper_was_out_fills_once_it_is_back() -> None:
    spec = pool_spec(refillPolicy="Manual")
    out = wp.plan(pool_view([], spec=spec, connected=False))
    assert out.status["filledGeneration"] == 0
    back = wp.plan(pool_view([], spec=spec, previous=out.status))
    assert len([a for a in back.actions if isinstance(a, CreateWarmPod)]) == 2


def test_a_group_claims_only_a_warm_pod_running_its_image_and_default_resources() -> None:
    other = dataclasses.replace(
        warm_pod("wp-two-0"),
        annotations={kinds.ANNOTATION_WARM_TEMPLATE: json.dumps({"image": "someone/else:1"})},
    )
    view = group_view([member("g-d-0", D)], [other])
    assert [type(a) for a in warm_or_cold(view, {"g-p-0": P})] == [CreatePod]
    own = group_view([member("g-d-0", D)], [warm_pod("wp-two-0")])
    custom = dataclasses.replace(
        own,
        spec=own.spec.model_copy(
            update={
                "prefill": own.spec.prefill.model_copy(
                    update={"resources": EngineResources.model_validate({"requests": {"cpu": "1"}})}
                )
            }
        ),
    )
    assert [type(a) for a in warm_or_cold(custom, {"g-p-0": P})] == [CreatePod]


def test_a_first_setups_warm_decodes_come_from_one_superpod() -> None:
    pods = [warm_pod(f"wp-two-{i}") for i in range(3)]
    view = group_view([], pods)
    reports = {
        "wp-two-0": warm_report("wp-two-0", superpod="sp1"),
        "wp-two-1": warm_report("wp-two-1", superpod="sp0"),
        "wp-two-2": warm_report("wp-two-2", superpod="sp1"),
    }
    view = dataclasses.replace(view, warm_reports=reports)
    claims = [
        a for a in warm_or_cold(view, {"g-d-0": D, "g-d-1": D}) if isinstance(a, ClaimWarmPod)
    ]
    assert sorted(c.name for c in claims) == ["wp-two-0", "wp-two-2"]


def test_a_pool_whose_names_cannot_be_labels_or_models_are_unknown_is_refused() -> None:
    from matrixserve.domain.warmpool.validation import problems

    assert problems("wp", pool_spec()) == []
    assert any("at most 63" in e for e in problems("w" * 64, pool_spec()))
    bad = pool_spec(dramPreload=[{"model": "llama3-8B"}])
    assert problems("wp", bad) == [
        "spec.dramPreload[0].model: 'llama3-8B' is not a model the platform knows the size of"
    ]
    odd = WarmPoolSpec.model_validate(
        {"shapes": [{"size": 1, "devicesPerPod": 2, "npuType": "A B"}]}
    )
    assert any("npuType" in e for e in problems("wp", odd))
    # issue 31: Scheduled was accepted and acted as Immediate
    scheduled = pool_spec(refillPolicy="Scheduled")
    assert problems("wp", scheduled) == [
        "spec.refillPolicy: Scheduled is not implemented (there is no schedule to refill by): "
        "use Immediate (refill at once) or Manual (refill on a new generation)"
    ]
    assert problems("wp", pool_spec(refillPolicy="Manual")) == []


def test_a_member_that_no_longer_serves_is_no_fork_source() -> None:
    pods = [member("g-p-0", P), member("g-d-0", D)]
    dead = group_view(pods, [warm_pod("wp-two-0")], fork_sources=(source(),))
    (claim,) = warm_or_cold(dead, {"g-p-1": P})  # g-p-0 has no health: killed, entry not expired
    assert isinstance(claim, ClaimWarmPod)
    assert claim.path == Path.WARM_SHARED
    report = engine_report("g-p-0", 0)
    health = serving_health(report, P)
    alive = dataclasses.replace(
        dead, zk=ZkView(connected=True, reports={"g-p-0": report}, health={"g-p-0": health})
    )
    (claim,) = warm_or_cold(alive, {"g-p-1": P})
    assert isinstance(claim, ClaimWarmPod)
    assert claim.path == Path.WARM_FORK_UB


async def test_a_group_naming_a_warm_pool_claims_only_that_pools_pods() -> None:
    """Issue 31: ``warmPoolRef`` was accepted and ignored (a claim took any pool's pod of the
    namespace). A group that names a pool sees only that pool's unclaimed pods; one that names
    none sees every pool's."""
    core = FakeCore()
    for pool in ("a", "b"):
        core.create_namespaced_pod(
            "ns", {"metadata": {"name": f"{pool}-two-0", "labels": {kinds.LABEL_WARMPOOL: pool}}}
        )
    core.create_namespaced_pod(
        "ns",
        {
            "metadata": {
                "name": "b-two-1",
                "labels": {kinds.LABEL_WARMPOOL: "b", kinds.LABEL_CLAIMED_BY: "other"},
            }
        },
    )
    kube = KubeAdapter.__new__(KubeAdapter)
    kube.core = core
    named = group_spec().model_copy(update={"warm_pool_ref": Ref(name="b")})
    assert sorted(await kube.list_pods("ns", {}, pdgroup.claimable(named))) == ["b-two-0"]
    assert sorted(await kube.list_pods("ns", {}, pdgroup.claimable(group_spec()))) == [
        "a-two-0",
        "b-two-0",
    ]


def test_a_groups_tpot_slo_reaches_its_engines_cold_or_claimed() -> None:
    """Issue 31: ``slo.tpotMilliseconds`` reaches every instance's engine (a decode's batch
    meets it): in a cold pod's environment and in a claimed warm pod's assignment."""
    from matrixserve.api.resources import SLO
    from matrixserve.domain.pdgroup.pods import engine_env

    spec = group_spec().model_copy(update={"slo": SLO(tpotMilliseconds=50)})
    for role in (P, D):
        env = {e["name"]: e["value"] for e in engine_env("ns", "g", role, spec, ENGINE)}
        assert env["ENGINE_TPOT_SLO_MS"] == "50"
    without = engine_env("ns", "g", D, group_spec(), ENGINE)
    assert "ENGINE_TPOT_SLO_MS" not in {e["name"] for e in without}
    assert "ENGINE_TPOT_SLO_MS" in zl.ASSIGNMENT_ENV  # an assignment may carry it
