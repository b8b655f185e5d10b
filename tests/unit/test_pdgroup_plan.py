"""The PDGroup planner (pure): gathering, setup, scale-out by dynamic RoCE construction, scale-in
order, no destructive plan without ZooKeeper; and the cross-field validation rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from fakes import engine_report, formed_group, formed_zk, pdgroup_spec
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.status import PDGroupStatus
from matrixserve.domain import conditions, pdgroup
from matrixserve.domain.enginepod import FIRST_PROBE_GRACE_SECONDS, EngineSettings
from matrixserve.domain.observed import PodView
from matrixserve.domain.pdgroup import GroupView, ZkView
from matrixserve.domain.pdgroup.actions import (
    ClearDrain,
    ClearRemoved,
    CreatePod,
    DeleteEntrance,
    DeletePod,
    EraseInstance,
    MarkRemoved,
    ReportPodTrouble,
    SetEntrance,
    StartDrain,
    WriteDecodeMeta,
    WriteInitOrder,
    WriteRoceMap,
)
from matrixserve.domain.pdgroup.membership import DRAIN_SECONDS
from matrixserve.domain.pdgroup.pods import pod_labels
from matrixserve.domain.pdgroup.status import hold
from matrixserve.domain.pdgroup.validation import validate_pdgroup

P, D = zl.Role.PREFILL, zl.Role.DECODE


spec = pdgroup_spec


def pod(name: str, role: zl.Role, created: float = 0.0, deleting: bool = False) -> PodView:
    labels = pod_labels("g", role, name)
    return PodView(name, f"uid-{name}", labels, "Running", True, deleting, "n1", "sp0", created)


ENGINE = EngineSettings(zookeeper="127.0.0.1:2181")


def group_view(s: PDGroupSpec, pods: Mapping[str, PodView], zk: ZkView, now: float) -> GroupView:
    view: GroupView = formed_group(s, pods, zk, now=now, engine=ENGINE)
    return view


report = engine_report


NAMES = {"g-p-0": (P, 0), "g-p-1": (P, 1), "g-d-0": (D, 2), "g-d-1": (D, 3)}


def view(s: PDGroupSpec, pods: list[str], zk: ZkView, now: float = 10.0) -> GroupView:
    return group_view(s, {n: pod(n, NAMES[n][0]) for n in pods}, zk, now)


def kinds(plan: pdgroup.Plan) -> list[str]:
    return [type(a).__name__ for a in plan.actions]


def serving_group(names: list[str]) -> ZkView:
    """A formed group: map, links, health, decode meta and entrances for ``names``; each health
    with a load (an engine that reports its load drains)."""
    zk: ZkView = formed_zk({n: NAMES[n] for n in names}, loads={n: zl.Load() for n in names})
    return zk


def test_a_new_group_creates_one_pod_per_instance_and_gathers() -> None:
    plan = pdgroup.plan(view(spec(), [], ZkView(connected=True)))
    assert [a for a in plan.actions if isinstance(a, CreatePod)] == [
        CreatePod("g-p-0", P),
        CreatePod("g-p-1", P),
        CreatePod("g-d-0", D),
    ]
    cond = {c.type: c for c in plan.conditions}
    assert cond["Gathering"].status is True
    assert cond["Gathering"].message == "0/3 instances reported their RoCE IPs"
    assert cond["Ready"].status is False


def test_init_order_waits_until_reports_equal_expected_instances() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    partial = pdgroup.plan(
        view(spec(), pods, ZkView(connected=True, reports={"g-p-0": report("g-p-0", 0)}))
    )
    assert not any(isinstance(a, WriteRoceMap | WriteInitOrder) for a in partial.actions)
    full = pdgroup.plan(
        view(
            spec(), pods, ZkView(connected=True, reports={n: report(n, NAMES[n][1]) for n in pods})
        )
    )
    writes = [a for a in full.actions if isinstance(a, WriteRoceMap)]
    assert len(writes) == 1
    assert [e.instance for e in writes[0].roce_map.prefill] == ["g-p-0", "g-p-1"]
    assert [e.instance for e in writes[0].roce_map.decode] == ["g-d-0"]
    assert writes[0].roce_map.expected_links() == 2 * 1 * 4
    assert WriteInitOrder(zl.InitOrder(epoch=1, roceMapVersion=1)) in full.actions


def test_entrances_open_only_when_every_instance_is_healthy() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    setting_up = ZkView(
        **{
            **zk.__dict__,
            "decode_meta": None,
            "entrances": frozenset(),
            "health": {n: h for n, h in zk.health.items() if n != "g-p-1"},
        }
    )
    waiting = pdgroup.plan(view(spec(), pods, setting_up))
    assert not any(isinstance(a, SetEntrance | WriteDecodeMeta) for a in waiting.actions)
    all_up = ZkView(**{**zk.__dict__, "decode_meta": None, "entrances": frozenset()})
    opening = pdgroup.plan(view(spec(), pods, all_up))
    assert kinds(opening) == ["WriteDecodeMeta", "SetEntrance", "SetEntrance"]


def test_a_formed_group_is_ready_and_plans_nothing() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    plan = pdgroup.plan(view(spec(), pods, serving_group(pods)))
    assert plan.actions == []
    assert plan.ready
    assert plan.status["links"] == {"expected": 8, "verified": 8, "summary": "8/8"}
    assert plan.status["entrances"] == ["g-p-0", "g-p-1"]
    assert plan.status["ratio"]["current"] == "2:1"
    assert {c.type: c.status for c in plan.conditions} == {
        "Coordinated": True,
        "Gathering": False,
        "Linked": True,
        "Progressing": False,
        "Degraded": False,
        "Ready": True,
    }


def test_scale_out_joins_through_the_map_and_disturbs_nobody() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    created = pdgroup.plan(view(spec(d=2), pods, zk))
    assert created.actions == [CreatePod("g-d-1", D)]
    assert not created.ready
    reported = ZkView(**{**zk.__dict__, "reports": {**zk.reports, "g-d-1": report("g-d-1", 3)}})
    joined = pdgroup.plan(view(spec(d=2), [*pods, "g-d-1"], reported))
    write = next(a for a in joined.actions if isinstance(a, WriteRoceMap))
    assert write.added == ("g-d-1",)
    assert write.removed == ()
    assert write.roce_map.version == 2
    assert [e.instance for e in write.roce_map.decode] == ["g-d-0", "g-d-1"]
    assert not any(
        isinstance(a, DeletePod | DeleteEntrance | WriteDecodeMeta) for a in joined.actions
    ), "nothing else changes until the newcomer is healthy"


def drained(
    zk: ZkView, name: str, at: float = 10.0, inflight: int = 0, reported: float | None = None
) -> ZkView:
    """``name`` asked to drain at ``at``, and its health since (written at ``reported``, ``at``
    unless given, and so for every member): draining, ``inflight`` left."""
    ts = at if reported is None else reported
    health = zk.health[name].model_copy(
        update={"draining": True, "drain_at": at, "inflight": inflight, "ts": ts}
    )
    others = {n: h.model_copy(update={"ts": ts}) for n, h in zk.health.items() if n != name}
    return dataclasses.replace(
        zk,
        draining={**zk.draining, name: zl.Drain(instance=name, reason="scale-in", at=at)},
        health={**others, name: health},
        entrances=zk.entrances - {name},
    )


def test_scale_in_drains_then_removes_the_map_entry_then_releases_the_pod() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    # First the instance drains: no new work (its entrance closed), still in the map
    start = pdgroup.plan(view(spec(p=1), pods, zk))
    assert kinds(start) == ["StartDrain", "DeleteEntrance"]
    assert isinstance(start.actions[0], StartDrain)
    assert start.actions[0].drain.instance == "g-p-1"
    # ... holding requests still: it stays
    busy = pdgroup.plan(view(spec(p=1), pods, drained(zk, "g-p-1", inflight=3), now=20.0))
    assert busy.actions == []
    # ... until it holds none (or DRAIN_SECONDS pass)
    late = pdgroup.plan(
        view(
            spec(p=1),
            pods,
            drained(zk, "g-p-1", inflight=3, reported=DRAIN_SECONDS),
            now=10.0 + DRAIN_SECONDS,
        )
    )
    assert kinds(late) == ["WriteRoceMap", "MarkRemoved"]
    first = pdgroup.plan(view(spec(p=1), pods, drained(zk, "g-p-1"), now=20.0))
    assert kinds(first) == ["WriteRoceMap", "MarkRemoved"]
    write = first.actions[0]
    assert isinstance(write, WriteRoceMap)
    assert write.removed == ("g-p-1",)
    assert [e.instance for e in write.roce_map.prefill] == ["g-p-0"]
    # Next pass: the map no longer has it -> erase its links, then release the pod.
    after = ZkView(
        **{
            **zk.__dict__,
            "roce_map": write.roce_map,
            "removed": frozenset({"g-p-1"}),
            "entrances": frozenset({"g-p-0"}),
        }
    )
    second = pdgroup.plan(view(spec(p=1), pods, after))
    assert second.actions == [
        EraseInstance("g-p-1", (("g-p-1", "g-d-0"),)),
        DeletePod("g-p-1", "uid-g-p-1", "scale-in: removed from the RoCE map"),
    ]
    # Once the pod is gone, the marker is cleared and the group is Ready again.
    gone = ZkView(
        **{**after.__dict__, "links": {k: v for k, v in zk.links.items() if "g-p-1" not in k}}
    )
    third = pdgroup.plan(view(spec(p=1), ["g-p-0", "g-d-0"], gone))
    assert third.actions == [ClearRemoved("g-p-1")]


def test_without_zookeeper_only_missing_pods_are_created() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = ZkView(**{**serving_group(pods).__dict__, "connected": False})
    plan = pdgroup.plan(view(spec(p=1, d=2), pods, zk))
    assert plan.actions == [CreatePod("g-d-1", D)], (
        "no map change, no pod deletion without coordination"
    )
    cond = {c.type: c for c in plan.conditions}
    assert cond["Ready"].reason == "Blocked"
    assert "ZooKeeper is not connected" in cond["Ready"].message


def test_a_pod_that_never_reports_is_replaced_after_the_gather_timeout() -> None:
    s = spec()
    pods = {n: pod(n, NAMES[n][0], created=0.0) for n in ["g-p-0", "g-p-1", "g-d-0"]}
    early = pdgroup.plan(group_view(s, pods, ZkView(connected=True), now=10.0))
    assert not any(isinstance(a, DeletePod) for a in early.actions)
    late = pdgroup.plan(group_view(s, pods, ZkView(connected=True), now=10_000.0))
    assert [a.name for a in late.actions if isinstance(a, DeletePod)] == ["g-p-0", "g-p-1", "g-d-0"]


def test_a_stray_pod_claiming_a_members_instance_is_released_not_folded_in() -> None:
    """Membership is by name: a pod that carries the group's labels and names an instance it is
    not a pod of neither joins that instance (a not-Ready stray would hold the group back) nor
    stays."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = view(spec(), pods, serving_group(pods))
    stray = PodView(
        "stray", "uid-stray", pod_labels("g", P, "g-p-0"), "Pending", False, False, None, None, 0.0
    )
    plan = pdgroup.plan(group_view(v.spec, {**v.pods, "stray": stray}, v.zk, now=10.0))
    assert DeletePod("stray", "uid-stray", "scale-in: removed from the RoCE map") in plan.actions
    rows = {r["name"]: r for r in plan.status["instances"]}
    assert rows["g-p-0"]["state"] == "Serving"


def test_an_unhealthy_member_degrades_a_ready_group_and_closes_its_entrance() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    sick = ZkView(**{**zk.__dict__, "health": {n: h for n, h in zk.health.items() if n != "g-p-1"}})
    plan = pdgroup.plan(view(spec(), pods, sick))
    assert DeleteEntrance("g-p-1") in plan.actions
    cond = {c.type: c for c in plan.conditions}
    assert cond["Degraded"].status is True
    assert cond["Ready"].status is False


def test_conditions_keep_their_transition_time_until_they_flip() -> None:
    first = conditions.merge([], [conditions.Condition("Ready", False, "SettingUp")], "t1", 1)
    same = conditions.merge(
        first, [conditions.Condition("Ready", False, "SettingUp", "x")], "t2", 2
    )
    flipped = conditions.merge(same, [conditions.Condition("Ready", True, "Ready")], "t3", 2)
    assert same[0]["lastTransitionTime"] == "t1"
    assert same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == "t3"


# ----------------------------------------------------------------------------- validation


def test_a_sensible_spec_is_valid() -> None:
    assert validate_pdgroup(spec(), "g") == []


def test_under_a_policy_the_replicas_are_a_total_to_split() -> None:
    """Under Model and Feedback the replicas set the total: 1 prefill + 3 decodes with
    maxDecode 2 is fine (the policy splits 4 as 2:2 at most), under Fixed it is not."""
    policy = {"mode": "Model", "maxDecode": 2}
    assert validate_pdgroup(spec(1, 3, ratioPolicy=policy), "g") == []
    errors = validate_pdgroup(spec(1, 3, ratioPolicy={"maxDecode": 2}), "g")
    assert any("above ratioPolicy.maxDecode" in e for e in errors)


@pytest.mark.parametrize("rung", ["0:2", "2", "a:b", "1:2:3", "1000:1"])
def test_a_ladder_rung_that_is_not_p_to_d_is_refused(rung: str) -> None:
    with pytest.raises(ValidationError, match="ladder"):
        spec(ratioPolicy={"mode": "Model", "ladder": ["1:1", rung]})


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (
            {
                "prefill": {"replicas": 1, "devicesPerInstance": 16},
                "decode": {"replicas": 1, "devicesPerInstance": 16},
            },
            "more than a server has (8 NPUs)",
        ),
        (  # a larger decode whose TP (its 8 dies) does not divide the prefill's (4)
            {"decode": {"replicas": 1, "devicesPerInstance": 4}},
            "spec.decode.parallelism.tp: 8 does not divide the prefill's tp 4",
        ),
        ({"model": {"name": "mystery-70b"}}, "cannot be served yet"),
        ({"model": {"name": "gpt3-175b"}}, "of weights do not fit 2 NPUs"),
        ({"decode": {"replicas": 1, "devicesPerInstance": 2, "batchSize": 4096}}, "GB of KV cache"),
        (
            {"decode": {"replicas": 200, "devicesPerInstance": 2}},
            "cannot be placed in one SuperPod",
        ),
        ({"ratioPolicy": {"minPrefill": 3, "maxPrefill": 2}}, "minPrefill: 3 exceeds maxPrefill 2"),
        (
            {"ratioPolicy": {"maxDecode": 1}, "decode": {"replicas": 2, "devicesPerInstance": 2}},
            "above ratioPolicy.maxDecode",
        ),
        ({"ratioPolicy": {"minRatio": 2, "maxRatio": 1}}, "minRatio: 2 exceeds maxRatio 1"),
        (  # Model splits the total of 3: no split of it has three decodes
            {"ratioPolicy": {"mode": "Model", "minDecode": 3}},
            "no split of the total of 3 instances",
        ),
        (
            {"ratioPolicy": {"mode": "Feedback", "ladder": ["1:3", "3:1"]}},
            "within its bounds and the ladder 1:3, 3:1",
        ),
        ({"moe": {"mode": "Disaggregated"}}, "spec.moe: Disaggregated needs expertPoolRef"),
        (
            {"moe": {"mode": "Disaggregated", "expertPoolRef": {"name": "e"}}},
            "spec.moe: Disaggregated needs an MoE model: llama3-8b has no routed experts",
        ),
        (
            {
                "moe": {
                    "mode": "Disaggregated",
                    "expertPoolRef": {"name": "e"},
                    "dpDomainRef": {"name": "d"},
                }
            },
            "spec.moe.dpDomainRef: DPDomain has no controller yet",
        ),
        (
            {"prefill": {"replicas": 1, "devicesPerInstance": 2, "parallelism": {"tp": 3}}},
            "tp: 3 does not divide",
        ),
    ],
)
def test_cross_field_rules_name_the_field_and_the_reason(
    changes: dict[str, Any], needle: str
) -> None:
    errors = validate_pdgroup(spec(**changes), "g")
    assert any(needle in e for e in errors), errors


def test_long_group_names_are_rejected() -> None:
    assert any("metadata.name" in e for e in validate_pdgroup(spec(), "x" * 60))


def test_a_decode_drains_out_of_the_decode_meta_and_a_dead_one_leaves_at_once() -> None:
    pods = ["g-p-0", "g-d-0", "g-d-1"]
    zk = serving_group(pods)
    start = pdgroup.plan(view(spec(p=1, d=1), pods, zk))
    assert kinds(start) == ["StartDrain", "WriteDecodeMeta"]
    meta = start.actions[1]
    assert isinstance(meta, WriteDecodeMeta)
    assert [d.instance for d in meta.meta.decodes] == ["g-d-0"]  # prefills forward no more
    # an instance that does not serve has nothing to finish: it leaves at once
    dead = dataclasses.replace(zk, health={n: h for n, h in zk.health.items() if n != "g-d-1"})
    assert "WriteRoceMap" in kinds(pdgroup.plan(view(spec(p=1, d=1), pods, dead)))


def test_a_drain_answered_for_another_marker_is_not_this_one() -> None:
    """The engine echoes the marker's time it drains for: a report for an earlier drain (the
    instance was wanted again, then not) does not let it leave."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = drained(serving_group(pods), "g-p-1", at=10.0)
    later = dataclasses.replace(
        zk, draining={"g-p-1": zl.Drain(instance="g-p-1", reason="scale-in", at=15.0)}
    )
    assert "WriteRoceMap" not in kinds(pdgroup.plan(view(spec(p=1), pods, later, now=20.0)))


def test_an_engine_that_cannot_drain_leaves_at_once() -> None:
    """An older engine (no load in its health) never says it drained: not waited for."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    old = {n: h.model_copy(update={"load": None}) for n, h in zk.health.items()}
    plan = pdgroup.plan(view(spec(p=1), pods, dataclasses.replace(zk, health=old)))
    assert kinds(plan)[:2] == ["WriteRoceMap", "MarkRemoved"]


def test_a_draining_instance_wanted_again_takes_work_again() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = drained(serving_group(pods), "g-p-1", inflight=2)
    back = pdgroup.plan(view(spec(p=2), pods, zk, now=20.0))
    assert ClearDrain("g-p-1") in back.actions
    assert not any(isinstance(a, DeletePod | WriteRoceMap) for a in back.actions)


def test_scaling_back_up_before_the_old_pod_is_gone_recreates_it() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = drained(serving_group(pods), "g-p-1")
    first = pdgroup.plan(view(spec(p=1), pods, zk, now=20.0))
    write = first.actions[0]
    assert isinstance(write, WriteRoceMap)
    after = ZkView(
        **{
            **zk.__dict__,
            "roce_map": write.roce_map,
            "removed": frozenset({"g-p-1"}),
            "entrances": frozenset({"g-p-0"}),
        }
    )
    back_up = pdgroup.plan(view(spec(p=2), pods, after))
    assert DeletePod("g-p-1", "uid-g-p-1", "scale-in: removed from the RoCE map") in back_up.actions
    assert not any(isinstance(a, WriteRoceMap) for a in back_up.actions), (
        "a removed instance does not rejoin"
    )


# --------------------------------------------------------------------------- identity (issue 15)
def moved(zk: ZkView, name: str, i: int, incarnation: str, pod_uid: str) -> ZkView:
    """``name`` came back as someone else: its report (and only its report) is new."""
    report = engine_report(name, i, pod_uid=pod_uid, incarnation=incarnation)
    return dataclasses.replace(zk, reports={**zk.reports, name: report})


def with_pod(v: GroupView, name: str, uid: str) -> dict[str, PodView]:
    return {**v.pods, name: dataclasses.replace(v.pods[name], uid=uid)}


def test_a_decode_that_moved_to_another_server_rejoins_and_the_group_stops_serving() -> None:
    """A drained decode comes back with a new pod, pod IP and RoCE IPs: its old map entry,
    links and decode meta describe someone who is gone, so it rejoins, and with the only decode
    not serving the prefills stop taking requests."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = view(spec(), pods, serving_group(pods))
    zk = moved(v.zk, "g-d-0", 7, incarnation="new", pod_uid="uid-new-d")
    plan = pdgroup.plan(group_view(v.spec, with_pod(v, "g-d-0", "uid-new-d"), zk, now=10.0))
    write = next(a for a in plan.actions if isinstance(a, WriteRoceMap))
    assert write.rejoined == ("g-d-0",)
    assert write.roce_map.version == 2
    (entry,) = write.roce_map.decode
    assert (entry.pod_ip, entry.incarnation) == ("127.64.0.9", "new")
    # the old links and health prove nothing for the new incarnation
    assert plan.status["links"]["verified"] == 0
    assert DeleteEntrance("g-p-0") in plan.actions
    assert DeleteEntrance("g-p-1") in plan.actions
    cond = {c.type: c for c in plan.conditions}
    assert cond["Ready"].status is False
    assert cond["Degraded"].reason == "NoServingDecode"


def test_a_prefill_whose_engine_restarted_rejoins_and_closes_until_it_serves_again() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = view(spec(), pods, serving_group(pods))
    # kill -9: same pod (UID), same IPs; a new engine process
    zk = moved(v.zk, "g-p-1", 1, incarnation="second", pod_uid="uid-g-p-1")
    plan = pdgroup.plan(group_view(v.spec, v.pods, zk, now=10.0))
    write = next(a for a in plan.actions if isinstance(a, WriteRoceMap))
    assert write.rejoined == ("g-p-1",)
    assert DeleteEntrance("g-p-1") in plan.actions
    assert DeleteEntrance("g-p-0") not in plan.actions  # the other prefill keeps serving
    assert plan.status["links"]["verified"] == 4  # g-p-0--g-d-0 only
    assert not plan.ready


def test_a_report_of_a_pod_that_is_gone_is_not_the_members() -> None:
    """The old pod's report outlives it (its session not expired yet): the new pod of the same
    name has not reported, so the member is Starting and the map is left alone."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = view(spec(), pods, serving_group(pods))
    plan = pdgroup.plan(group_view(v.spec, with_pod(v, "g-d-0", "uid-recreated"), v.zk, 10.0))
    assert not any(isinstance(a, WriteRoceMap) for a in plan.actions)
    rows = {r["name"]: r for r in plan.status["instances"]}
    assert rows["g-d-0"]["state"] == "Starting"
    assert not plan.ready


def test_links_and_health_count_only_for_the_current_incarnations() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    # the map already names g-d-0's new incarnation; its links and health are the old one's
    roce_map = zk.roce_map
    assert roce_map is not None
    renamed = [e.model_copy(update={"incarnation": "new"}) for e in roce_map.decode]
    new_map = roce_map.model_copy(update={"decode": renamed, "version": 2})
    zk = moved(zk, "g-d-0", 2, incarnation="new", pod_uid="uid-g-d-0")
    zk = dataclasses.replace(zk, roce_map=new_map)
    plan = pdgroup.plan(view(spec(), pods, zk))
    rows = {r["name"]: r for r in plan.status["instances"]}
    assert rows["g-d-0"]["state"] == "Initializing"
    assert plan.status["links"] == {"expected": 8, "verified": 0, "summary": "0/8"}
    fresh = dict(zk.links)
    for p in ("g-p-0", "g-p-1"):
        fresh[(p, "g-d-0")] = zk.links[(p, "g-d-0")].model_copy(
            update={"decode_incarnation": "new"}
        )
    new_health = zk.health["g-d-0"].model_copy(update={"incarnation": "new"})
    healed = dataclasses.replace(zk, links=fresh, health={**zk.health, "g-d-0": new_health})
    again = pdgroup.plan(view(spec(), pods, healed))
    assert again.status["links"]["verified"] == 8
    assert {r["name"]: r["state"] for r in again.status["instances"]}["g-d-0"] == "Serving"


def test_a_decode_that_says_why_it_cannot_serve_is_said_in_the_groups_conditions() -> None:
    """An attention client whose expert pool is gone reports Degraded with why: the group's
    Degraded and Ready conditions say it in its words (they said only that no decode served),
    and nothing is recovered (the decode is not at fault)."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    why = "its expert pool ns/experts is gone (the map pointer deleted; v5 was in force)"
    degraded = zk.health["g-d-0"].model_copy(
        update={"state": zl.HealthState.DEGRADED, "message": why}
    )
    plan = pdgroup.plan(
        view(spec(), pods, dataclasses.replace(zk, health={**zk.health, "g-d-0": degraded}))
    )
    cond = {c.type: c for c in plan.conditions}
    assert (cond["Degraded"].status, cond["Degraded"].reason) == (True, "NoServingDecode")
    assert cond["Degraded"].message == (
        f"no decode instance serves: the entrances are closed (g-d-0: {why})"
    )
    assert cond["Ready"].status is False
    rows = {r["name"]: r["state"] for r in plan.status["instances"]}
    assert rows["g-d-0"] == "Degraded"
    assert not any(isinstance(a, (MarkRemoved, DeletePod)) for a in plan.actions)


def test_without_a_serving_decode_no_prefill_is_an_entrance_until_one_serves() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    sick = dataclasses.replace(zk, health={n: h for n, h in zk.health.items() if n != "g-d-0"})
    plan = pdgroup.plan(view(spec(), pods, sick))
    assert {a for a in plan.actions if isinstance(a, DeleteEntrance)} == {
        DeleteEntrance("g-p-0"),
        DeleteEntrance("g-p-1"),
    }
    cond = {c.type: c for c in plan.conditions}
    assert (cond["Degraded"].status, cond["Degraded"].reason) == (True, "NoServingDecode")
    assert cond["Ready"].reason == "NoServingDecode"
    closed = dataclasses.replace(sick, entrances=frozenset())
    assert not any(
        isinstance(a, SetEntrance) for a in pdgroup.plan(view(spec(), pods, closed)).actions
    )
    back = dataclasses.replace(closed, health=zk.health)
    reopened = pdgroup.plan(view(spec(), pods, back))
    assert {a.entrance.instance for a in reopened.actions if isinstance(a, SetEntrance)} == {
        "g-p-0",
        "g-p-1",
    }


# --------------------------------------------------------------------------- data loss (issue 15)
LAST_KNOWN: dict[str, Any] = {
    "roceMapVersion": 3,
    "entrances": ["g-p-0", "g-p-1"],
    "links": {"expected": 8, "verified": 8, "summary": "8/8"},
    "instances": [],
    "prefill": {"replicas": 2, "ready": 2, "summary": "2/2"},
    "decode": {"replicas": 1, "ready": 1, "summary": "1/1"},
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "Ready", "message": "serving"},
        {"type": "Coordinated", "status": "True", "reason": "Connected", "message": ""},
    ],
}


def after_data_loss(pods: list[str], reported: list[str]) -> GroupView:
    """A serving group whose ZooKeeper came back empty; ``reported`` engines reported again."""
    zk = ZkView(
        connected=True,
        reports={n: report(n, NAMES[n][1]) for n in reported},
        present=True,
        entrances_present=False,
    )
    v = view(spec(), pods, zk)
    return dataclasses.replace(v, previous=PDGroupStatus.read(LAST_KNOWN))


def test_after_data_loss_the_map_is_rebuilt_from_the_reports_continuing_its_version() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    waiting = pdgroup.plan(after_data_loss(pods, ["g-p-0", "g-d-0"]))
    assert not any(isinstance(a, WriteRoceMap) for a in waiting.actions)  # g-p-1 serves: wait
    cond = {c.type: c for c in waiting.conditions}
    assert (cond["Coordinated"].status, cond["Coordinated"].reason) == (False, "Rebuilding")
    assert waiting.status["roceMapVersion"] == 3  # the last known status is kept meanwhile
    assert waiting.status["entrances"] == ["g-p-0", "g-p-1"]
    assert cond["Ready"].status is True

    rebuilt = pdgroup.plan(after_data_loss(pods, pods))
    write = next(a for a in rebuilt.actions if isinstance(a, WriteRoceMap))
    assert (write.roce_map.version, write.rebuilt) == (4, True)
    assert WriteInitOrder(zl.InitOrder(epoch=4, roceMapVersion=4)) in rebuilt.actions
    assert not any(isinstance(a, DeletePod) for a in rebuilt.actions)  # nobody restarts


def test_a_group_that_never_served_gathers_as_usual_after_data_loss() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = dataclasses.replace(after_data_loss(pods, pods), previous=PDGroupStatus())
    plan = pdgroup.plan(v)
    write = next(a for a in plan.actions if isinstance(a, WriteRoceMap))
    assert (write.roce_map.version, write.rebuilt) == (1, False)


def test_a_pod_that_cannot_run_is_the_reason_and_is_reported() -> None:
    """An impossible placement or an image that does not pull becomes the group's condition
    reason, in the scheduler's words, and a notice while it lasts (the applier posts it once:
    tests/unit/test_reconcile.py)."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    v = view(spec(d=2), [*pods, "g-d-1"], zk)
    why = ("Unschedulable", "0/4 nodes are available: 4 Insufficient huawei.com/Ascend910.")
    stuck = dataclasses.replace(v.pods["g-d-1"], ready=False, trouble=why)
    v = dataclasses.replace(v, pods={**v.pods, "g-d-1": stuck})
    plan = pdgroup.plan(v)
    ready = next(c for c in plan.conditions if c.type == "Ready")
    assert ready.reason == "Unschedulable"
    assert "g-d-1: 0/4 nodes are available" in ready.message
    assert ReportPodTrouble("g-d-1", *why) in plan.actions
    healed = dataclasses.replace(
        v, pods={**v.pods, "g-d-1": dataclasses.replace(stuck, trouble=None)}
    )
    assert not any(isinstance(a, ReportPodTrouble) for a in pdgroup.plan(healed).actions)


def test_a_rebuild_releases_no_pod_however_old() -> None:
    """Right after data loss nobody has reported yet: pods older than the gather timeout are
    the serving engines, not engines that never reported."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = dataclasses.replace(after_data_loss(pods, []), now=10_000.0)
    plan = pdgroup.plan(v)
    assert not any(isinstance(a, DeletePod) for a in plan.actions)


def test_the_rebuild_hold_ends_after_its_bound_and_never_holds_an_invalid_status() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = after_data_loss(pods, ["g-p-0", "g-d-0"])
    since = datetime.fromtimestamp(v.now - 31, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rebuilding = {
        "type": "Coordinated",
        "status": "False",
        "reason": "Rebuilding",
        "lastTransitionTime": since,
    }
    late = dataclasses.replace(
        v,
        previous=PDGroupStatus.read(
            {**LAST_KNOWN, "conditions": [*LAST_KNOWN["conditions"][:1], rebuilding]}
        ),
    )
    cond = {c.type: c for c in pdgroup.plan(late).conditions}
    assert cond["Coordinated"].status is True  # derived again: no longer the last known
    assert cond["Ready"].status is False
    invalid = PDGroupStatus.read(
        {
            **LAST_KNOWN,
            "conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec"}],
        }
    )
    assert hold(dataclasses.replace(v, previous=invalid), {}, "why") is None
    only_generation = PDGroupStatus.read({"observedGeneration": 1})
    assert hold(dataclasses.replace(v, previous=only_generation), {}, "why") is None


def test_without_zookeeper_a_member_whose_pod_is_gone_is_not_held_ready() -> None:
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    v = view(spec(), ["g-p-0", "g-p-1"], ZkView(connected=False))
    plan = pdgroup.plan(dataclasses.replace(v, previous=PDGroupStatus.read(LAST_KNOWN)))
    ready = next(c for c in plan.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == (False, "ZooKeeperUnreachable")
    assert ready.message.startswith("g-d-0 not Ready")
    assert plan.status["entrances"] == ["g-p-0", "g-p-1"]  # still the last known routes
    assert not plan.ready
    kept = pdgroup.plan(
        dataclasses.replace(
            view(spec(), pods, ZkView(connected=False)), previous=PDGroupStatus.read(LAST_KNOWN)
        )
    )
    assert kept.ready


def test_an_engine_of_an_older_image_without_a_pod_uid_is_known_by_name() -> None:
    """An operator upgrade must not close the entrances of groups whose engines predate
    reporting their pod."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    legacy = {n: r.model_copy(update={"pod_uid": ""}) for n, r in zk.reports.items()}
    plan = pdgroup.plan(view(spec(), pods, dataclasses.replace(zk, reports=legacy)))
    assert plan.ready
    assert plan.actions == []


def test_a_group_in_its_first_setup_is_setting_up_not_degraded() -> None:
    """Decode meta pushed, no instance serving yet, no entrance ever opened: the group is
    SettingUp (a new group is not Degraded, nor without a decode); once it has served, losing
    its decode is NoServingDecode, and it stays Degraded while its entrances are closed; losing
    a prefill then is Recovering."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    formed = serving_group(pods)
    setting_up = dataclasses.replace(formed, health={}, entrances=frozenset())
    cond = {c.type: c for c in pdgroup.plan(view(spec(), pods, setting_up)).conditions}
    assert (cond["Ready"].status, cond["Ready"].reason) == (False, "SettingUp")
    assert cond["Degraded"].status is False
    # the same world after the group had served: its last status named its entrances
    had_served = dataclasses.replace(
        group_view(spec(), view(spec(), pods, setting_up).pods, setting_up, 10.0),
        previous=PDGroupStatus(entrances=["g-p-0", "g-p-1"]),
    )
    no_decode = dataclasses.replace(
        had_served,
        zk=dataclasses.replace(
            setting_up, health={n: h for n, h in formed.health.items() if n != "g-d-0"}
        ),
    )
    plan = pdgroup.plan(no_decode)
    cond = {c.type: c for c in plan.conditions}
    assert (cond["Degraded"].status, cond["Degraded"].reason) == (True, "NoServingDecode")
    # a prefill lost after it served: Ready=False says Recovering, not SettingUp (issue 31),
    # and goes on saying it until the group is Ready again
    serving = pdgroup.plan(view(spec(), pods, formed))
    assert serving.ready
    no_prefill = dataclasses.replace(
        had_served,
        previous=serving.status,
        zk=dataclasses.replace(
            formed, health={n: h for n, h in formed.health.items() if n != "g-p-1"}
        ),
    )
    lost = pdgroup.plan(no_prefill)
    cond = {c.type: c for c in lost.conditions}
    assert (cond["Ready"].status, cond["Ready"].reason) == (False, "Recovering")
    ready = {"type": "Ready", "status": "False", "reason": "Recovering"}
    later = dataclasses.replace(
        no_prefill, previous=PDGroupStatus.read({**lost.status, "conditions": [ready]})
    )
    cond = {c.type: c for c in pdgroup.plan(later).conditions}
    assert cond["Ready"].reason == "Recovering"
    # a scale-out of a group that serves sets up: nothing it had is lost
    scaled = dataclasses.replace(
        group_view(spec(d=2), view(spec(d=2), pods, formed).pods, formed, 10.0),
        previous=serving.status,
    )
    cond = {c.type: c for c in pdgroup.plan(scaled).conditions}
    assert (cond["Ready"].status, cond["Ready"].reason) == (False, "SettingUp")
    # next pass: entrances closed and listed nowhere, but Degraded is in the last status
    degraded = {"type": "Degraded", "status": "True", "reason": "NoServingDecode"}
    later = dataclasses.replace(no_decode, previous=PDGroupStatus.read({"conditions": [degraded]}))
    cond = {c.type: c for c in pdgroup.plan(later).conditions}
    assert (cond["Degraded"].status, cond["Degraded"].reason) == (True, "NoServingDecode")


def test_a_pod_not_yet_probed_since_its_engine_started_does_not_hold_the_group_back() -> None:
    """The kubelet probes each pod every ``periodSeconds``: at setup the group would wait for
    the slowest phase of all (~1 s for 8 pods) although every engine serves. A pod whose Ready
    condition has not flipped since its container started, and whose engine reported after
    that, counts as serving; a pod that was Ready and failed its probe, or whose report is an
    earlier container's (a killed engine, restarted), does not."""
    pods = ["g-p-0", "g-p-1", "g-d-0"]
    zk = serving_group(pods)
    zk = dataclasses.replace(
        zk,
        reports={n: r.model_copy(update={"ts": 100.5}) for n, r in zk.reports.items()},
        # serving since 9.0, the view's now is 10.0: within the first probe's grace
        health={n: h.model_copy(update={"ts": 9.0}) for n, h in zk.health.items()},
    )

    def with_d0(**fields: Any) -> GroupView:
        v = view(spec(), pods, zk)
        return group_view(
            v.spec, {**v.pods, "g-d-0": dataclasses.replace(v.pods["g-d-0"], **fields)}, zk, 10.0
        )

    def state(v: GroupView) -> str:
        return str({r["name"]: r["state"] for r in pdgroup.plan(v).status["instances"]}["g-d-0"])

    not_probed = with_d0(ready=False, running_since=100.0, ready_changed_at=99.0)
    assert state(not_probed) == "Serving"
    assert pdgroup.plan(not_probed).ready
    # the same second (the API's times are whole seconds) is still "not flipped since"
    assert state(with_d0(ready=False, running_since=100.0, ready_changed_at=100.0)) == "Serving"
    # Ready in this container, then its probe failed: the kubelet's word counts
    failed = with_d0(ready=False, running_since=100.0, ready_changed_at=101.0)
    assert state(failed) == "Initializing"
    assert not pdgroup.plan(failed).ready
    # killed and restarted: the report is the earlier container's
    restarted = with_d0(ready=False, running_since=102.0, ready_changed_at=101.0)
    assert state(restarted) == "Initializing"
    # not running at all (the container exited), or nothing known of it
    assert state(with_d0(ready=False, running_since=None, ready_changed_at=99.0)) == "Initializing"
    assert state(with_d0(ready=False)) == "Initializing"
    # still not Ready longer after its engine began serving than a first probe takes: its
    # probe fails (a hang before it), whatever the engine's health says
    late = dataclasses.replace(not_probed, now=9.0 + FIRST_PROBE_GRACE_SECONDS + 0.1)
    assert state(late) == "Initializing"
    # the health is written once an interval (20 s here): its 3rd write means serving since
    # two intervals before it
    third = {n: h.model_copy(update={"ts": 9.0, "seq": 3}) for n, h in zk.health.items()}
    assert state(dataclasses.replace(not_probed, zk=dataclasses.replace(zk, health=third))) == (
        "Initializing"
    )
