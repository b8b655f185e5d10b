"""The recovery planner (issue 17): each fault kind on representative topologies gives the
cheapest plan the documented cost model predicts; a property test shows every plan is feasible on
its snapshot; and detection over a group's view types each fault by its tier.

Expected costs are derived from ``domain/recovery.py``'s docstring: ``cost = restore_s * lost +
horizon_s * lost_after``, ``lost = (w_P*out_P/n_P + w_D*out_D/n_D) / (w_P + w_D)``, the protected
role weighing 2. With the default estimates a cold replacement takes 1 + 1 + 2 = 4 s, a restart
in place 0 + 1 + 2 = 3 s, a relink 0.5 s, a retry 10 s, and the horizon is 600 s.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import formed_group, formed_zk
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec, Protect, RecoveryPolicy
from matrixserve.domain import pdgroup
from matrixserve.domain import recovery as rc
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import Fault, FaultKind, NodeView, PodView, Taint, Tier
from matrixserve.domain.pdgroup import GroupView, ZkView
from matrixserve.domain.pdgroup import recovery as pr
from matrixserve.domain.pdgroup.actions import (
    DeleteEntrance,
    DeletePod,
    ForgetLink,
    MarkRemoved,
    ReportRecovery,
    SetEntrance,
    WriteDecodeMeta,
    WriteRoceMap,
)
from matrixserve.domain.pdgroup.membership import GATHER_TIMEOUT_SECONDS
from matrixserve.domain.pdgroup.pods import pod_labels

pytestmark = pytest.mark.unit

P, D = zl.Role.PREFILL, zl.Role.DECODE
A = rc.ActionKind
EST = rc.Estimates()
COLD = 1.0 + 1.0 + 2.0  # podDelete + podStart + engineReady
IN_PLACE = 0.0 + 1.0 + 2.0  # restartBackoff + podStart + engineReady
HORIZON = 600.0


# --------------------------------------------------------------------------- planner builders
def group(
    p: int = 4,
    d: int = 2,
    free: int | None = 8,
    npus: int = 2,
    on: dict[str, str] | None = None,
    restarts: dict[str, int] | None = None,
) -> rc.Topology:
    members = {}
    for role, n, tag in ((P, p, "p"), (D, d, "d")):
        for i in range(n):
            name = f"g-{tag}-{i}"
            node = (on or {}).get(name, f"n-{name}")
            members[name] = rc.Member(name, role, npus, node, (restarts or {}).get(name, 0))
    return rc.Topology(members, free)


def fault(kind: FaultKind, *names: str, on_device: bool = False) -> Fault:
    return Fault(kind, names, Tier.POD, 0.0, on_device=on_device)


def choose(
    f: Fault,
    topo: rc.Topology,
    policy: rc.Policy | None = None,
    est: rc.Estimates = EST,
    connected: bool = True,
    in_recovery: int = 0,
) -> rc.Plan:
    return rc.choose(
        f, topo, policy or rc.Policy(), est, connected=connected, in_recovery=in_recovery
    )


def by_action(plan: rc.Plan) -> dict[rc.ActionKind, rc.Option]:
    assert plan.chosen is not None
    considered = (plan.chosen, *plan.alternatives)
    assert sorted(o.action for o in considered) == sorted(A), "every option is considered once"
    return {o.action: o for o in considered}


def chosen(plan: rc.Plan) -> rc.Option:
    assert plan.chosen is not None, plan.why
    return plan.chosen


DEVICE_KINDS = [FaultKind.DIE, FaultKind.NPU, FaultKind.HBM]


# --------------------------------------------------------------------------- each fault kind
@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_a_device_fault_on_a_decode_with_npus_free_replaces_just_that_decode(
    kind: FaultKind,
) -> None:
    plan = choose(fault(kind, "g-d-0"), group())
    pick = chosen(plan)
    assert (pick.action, pick.instances, pick.pods_restarted) == (A.REPLACE, ("g-d-0",), 1)
    # one decode of two out, decode weighing 2: lost = 2*(1/2)/3 = 1/3
    assert pick.cost == pytest.approx(COLD / 3)
    assert pick.restore_s == pytest.approx(COLD)
    options = by_action(plan)
    assert options[A.MASK_AND_RETRY].cost == pytest.approx(10 / 3 + HORIZON / 3)
    assert options[A.RESTART_GROUP].cost == pytest.approx(COLD * 1.0)
    assert options[A.RESTART_GROUP].pods_restarted == 6
    assert options[A.RESTART_GROUP].feasible
    for action in (A.RELINK, A.RESTART_IN_PLACE, A.SHRINK):
        assert not options[action].feasible
        assert options[action].why
    assert "free" in options[A.SHRINK].why
    status = options[A.RELINK].as_status()
    assert {"action", "cost", "feasible", "why", "terms", "predictedRestoreSeconds"} <= set(status)
    assert status["feasible"] is False


def test_a_die_fault_on_a_prefill_is_priced_by_the_prefill_s_smaller_weight() -> None:
    plan = choose(fault(FaultKind.DIE, "g-p-1"), group())
    pick = chosen(plan)
    assert (pick.action, pick.instances) == (A.REPLACE, ("g-p-1",))
    assert pick.cost == pytest.approx(COLD * (1 / 4) / 3)  # one prefill of four, weight 1 of 3
    assert by_action(plan)[A.SHRINK].why == "no decode is faulty"


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_decode_protected_on_a_full_cluster_gives_up_the_last_prefill(kind: FaultKind) -> None:
    plan = choose(fault(kind, "g-d-0"), group(free=0))
    pick = chosen(plan)
    assert pick.action is A.SHRINK
    assert pick.instances == ("g-d-0", "g-p-3")
    assert pick.sacrificed == ("g-p-3",)
    assert pick.pods_restarted == 2
    # out while restoring: a decode of 2 (weight 2) and a prefill of 4 (weight 1); after: the prefill
    assert pick.lost == pytest.approx((2 * 1 / 2 + 1 / 4) / 3)
    assert pick.lost_after == pytest.approx((1 / 4) / 3)
    assert pick.cost == pytest.approx(COLD * 1.25 / 3 + HORIZON / 12)
    options = by_action(plan)
    for action in (A.REPLACE, A.RESTART_GROUP):
        assert not options[action].feasible
        assert "0" in options[action].why
    assert options[A.MASK_AND_RETRY].cost == pytest.approx(10 / 3 + HORIZON / 3)
    assert options[A.MASK_AND_RETRY].cost > pick.cost


@pytest.mark.parametrize(
    ("protect", "lost"),
    [(Protect.NONE, (1 / 2) / 2), (Protect.PREFILL, (1 / 2) / 3)],
)
def test_without_decode_protected_no_shrink_and_the_decode_stays_masked(
    protect: Protect, lost: float
) -> None:
    plan = choose(fault(FaultKind.DIE, "g-d-0"), group(free=0), rc.Policy(protect=protect))
    pick = chosen(plan)
    assert (pick.action, pick.instances) == (A.MASK_AND_RETRY, ())
    assert pick.cost == pytest.approx(10 * lost + HORIZON * lost)
    assert by_action(plan)[A.SHRINK].why == "decode is not the protected role"


def test_a_shrink_needs_a_second_prefill_and_enough_freed_npus() -> None:
    lone = choose(fault(FaultKind.DIE, "g-d-0"), group(p=1, free=0))
    assert chosen(lone).action is A.MASK_AND_RETRY
    assert by_action(lone)[A.SHRINK].why == "the group would keep no prefill"
    # A down server withholds all 4 of the decode's NPUs: free + the prefills given up must
    # cover them, as few prefills as do, from the last, never the last one left.
    for p, prefill_npus, free, gives_up in (
        (4, 3, 0, ("g-p-2", "g-p-3")),  # 3 are not enough: the one before goes too
        (4, 3, 1, ("g-p-3",)),
        (4, 4, 0, ("g-p-3",)),
        (2, 3, 0, ()),  # only g-p-1 may go, and its 3 are not enough
    ):
        members = dict(group(p=p, free=free).members)
        last = f"g-p-{p - 1}"
        members["g-d-0"] = dataclasses.replace(members["g-d-0"], npus=4)
        members[last] = dataclasses.replace(members[last], npus=prefill_npus)
        plan = choose(fault(FaultKind.NODE, "g-d-0"), rc.Topology(members, free))
        shrink = by_action(plan)[A.SHRINK]
        assert chosen(plan).action is (A.SHRINK if gives_up else A.MASK_AND_RETRY)
        assert shrink.feasible is bool(gives_up)
        if gives_up:
            assert shrink.sacrificed == gives_up
            assert shrink.instances == ("g-d-0", *gives_up)
            assert shrink.pods_restarted == 1 + len(gives_up)
        else:
            assert shrink.why == "giving up g-p-1 frees 3 NPUs; 4 are needed"


def test_a_server_with_two_members_under_a_cap_of_one_takes_the_decode_first() -> None:
    topo = group(on={"g-p-0": "n1", "g-d-0": "n1"})
    assert rc.concurrency_cap(len(topo.members)) == 1
    plan = choose(fault(FaultKind.NODE, "g-p-0", "g-d-0"), topo)
    pick = chosen(plan)
    assert (pick.action, pick.instances) == (A.REPLACE, ("g-d-0",))
    assert plan.deferred == ("g-p-0",)
    assert pick.cost == pytest.approx(COLD / 3)


def test_a_server_with_two_members_under_a_cap_of_two_replaces_both() -> None:
    topo = group(d=4, on={"g-p-0": "n1", "g-d-0": "n1"})
    plan = choose(fault(FaultKind.NODE, "g-p-0", "g-d-0"), topo)
    pick = chosen(plan)
    assert (pick.action, pick.instances, pick.pods_restarted) == (
        A.REPLACE,
        ("g-d-0", "g-p-0"),
        2,
    )
    assert plan.deferred == ()
    assert pick.cost == pytest.approx(COLD * (1 / 4 + 2 * 1 / 4) / 3)
    assert by_action(plan)[A.RESTART_GROUP].pods_restarted == 8


def test_a_server_down_on_a_full_cluster_shrinks_for_its_decode() -> None:
    topo = group(d=4, free=0, on={"g-p-0": "n1", "g-d-0": "n1"})
    plan = choose(fault(FaultKind.NODE, "g-p-0", "g-d-0"), topo)
    pick = chosen(plan)
    assert pick.action is A.SHRINK
    assert pick.instances == ("g-d-0", "g-p-0", "g-p-3")
    # the faulty prefill is given up (its server is down), and g-p-3's NPUs restore the decode
    assert pick.sacrificed == ("g-p-0", "g-p-3")
    assert pick.cost == pytest.approx(COLD * (2 / 4 + 2 * 1 / 4) / 3 + HORIZON * (2 / 4) / 3)
    replace = by_action(plan)[A.REPLACE]
    assert not replace.feasible
    assert replace.why == "4 NPUs needed, 0 come back where the faulty pods ran, 0 free elsewhere"


def test_a_blocked_link_with_its_ports_up_is_relinked_and_nobody_restarts() -> None:
    plan = choose(fault(FaultKind.LINK, "g-p-0"), group())
    pick = chosen(plan)
    assert (pick.action, pick.instances, pick.pods_restarted) == (A.RELINK, (), 0)
    assert pick.cost == pytest.approx(0.5 * (1 / 4) / 3)
    assert by_action(plan)[A.REPLACE].cost == pytest.approx(COLD * (1 / 4) / 3)


@pytest.mark.parametrize(
    ("free", "action", "instances"),
    [
        (8, A.REPLACE, ("g-p-0",)),
        (None, A.REPLACE, ("g-p-0",)),
        # its NPU is NetworkUnhealthy and its server tainted: no room, the prefill stays masked
        (0, A.MASK_AND_RETRY, ()),
    ],
)
def test_a_link_whose_port_is_down_replaces_the_instance_where_there_is_room(
    free: int | None, action: rc.ActionKind, instances: tuple[str, ...]
) -> None:
    plan = choose(fault(FaultKind.LINK, "g-p-0", on_device=True), group(free=free))
    assert (chosen(plan).action, chosen(plan).instances) == (action, instances)
    relink = by_action(plan)[A.RELINK]
    assert not relink.feasible
    assert "port is down" in relink.why


@pytest.mark.parametrize("kind", [FaultKind.HANG, FaultKind.SESSION])
def test_a_hang_or_a_lost_session_is_replaced_even_on_a_full_cluster(kind: FaultKind) -> None:
    plan = choose(fault(kind, "g-d-1"), group(free=0))  # its own NPUs come back
    pick = chosen(plan)
    assert (pick.action, pick.instances) == (A.REPLACE, ("g-d-1",))
    assert pick.cost == pytest.approx(COLD / 3)
    assert by_action(plan)[A.RESTART_GROUP].feasible


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_killed_engine_restarts_in_place(restarts: int) -> None:
    plan = choose(fault(FaultKind.KILL, "g-d-0"), group(restarts={"g-d-0": restarts}))
    pick = chosen(plan)
    assert (pick.action, pick.instances, pick.pods_restarted) == (
        A.RESTART_IN_PLACE,
        ("g-d-0",),
        1,
    )
    assert pick.cost == pytest.approx(IN_PLACE / 3)
    assert by_action(plan)[A.REPLACE].cost == pytest.approx(COLD / 3)


@pytest.mark.parametrize("restarts", [3, 7])
def test_a_crash_looping_engine_is_replaced(restarts: int) -> None:
    plan = choose(fault(FaultKind.KILL, "g-d-0"), group(restarts={"g-d-0": restarts}))
    assert (chosen(plan).action, chosen(plan).instances) == (A.REPLACE, ("g-d-0",))
    in_place = by_action(plan)[A.RESTART_IN_PLACE]
    assert not in_place.feasible
    assert f"crash-looping ({restarts} restarts)" in in_place.why


def test_a_killed_engine_facing_a_long_back_off_is_replaced() -> None:
    est = dataclasses.replace(EST, restart_backoff=10.0)  # 13 s in place vs 4 s cold
    plan = choose(fault(FaultKind.KILL, "g-d-0"), group(), est=est)
    assert chosen(plan).action is A.REPLACE
    assert by_action(plan)[A.RESTART_IN_PLACE].cost == pytest.approx((10 + IN_PLACE) / 3)


def test_a_stale_report_is_masked_only_when_waiting_is_cheaper_than_replacing() -> None:
    quick = choose(fault(FaultKind.STALE, "g-d-0"), group())
    assert chosen(quick).action is A.REPLACE  # 4 s cold < 10 s retry, same capacity out
    mask = by_action(quick)[A.MASK_AND_RETRY]
    assert mask.lost_after == 0.0
    assert mask.cost == pytest.approx(10 / 3)
    slow = choose(
        fault(FaultKind.STALE, "g-d-0"), group(), est=dataclasses.replace(EST, engine_ready=20.0)
    )
    assert (chosen(slow).action, chosen(slow).instances) == (A.MASK_AND_RETRY, ())
    assert by_action(slow)[A.REPLACE].cost == pytest.approx(22 / 3)


def test_policy_restart_group_never_restarts_a_group_that_would_not_fit_back() -> None:
    """The anchors' rule, but a die withholds the decode's NPUs and none are free: deleting
    every pod would leave the group unschedulable, so the decode stays masked instead."""
    plan = choose(
        fault(FaultKind.DIE, "g-d-0"),
        group(free=0),
        rc.Policy(policy=RecoveryPolicy.RESTART_GROUP),
    )
    assert chosen(plan).action is A.MASK_AND_RETRY
    assert not by_action(plan)[A.RESTART_GROUP].feasible


@pytest.mark.parametrize("kind", list(FaultKind))
def test_policy_restart_group_always_restarts_the_whole_group(kind: FaultKind) -> None:
    topo = group()
    plan = choose(fault(kind, "g-d-0"), topo, rc.Policy(policy=RecoveryPolicy.RESTART_GROUP))
    pick = chosen(plan)
    assert pick.action is A.RESTART_GROUP
    assert pick.feasible
    assert pick.instances == tuple(sorted(topo.members))
    assert pick.pods_restarted == 6
    assert min(o.cost for o in plan.alternatives if o.feasible) < pick.cost


@pytest.mark.parametrize("kind", list(FaultKind))
def test_without_zookeeper_nothing_is_planned(kind: FaultKind) -> None:
    plan = choose(fault(kind, "g-d-0"), group(), connected=False)
    assert plan.chosen is None
    assert plan.alternatives == ()
    assert plan.deferred == ()
    assert "ZooKeeper" in plan.why


def test_the_concurrency_cap_is_a_quarter_of_the_group_at_least_one() -> None:
    caps = {n: rc.concurrency_cap(n) for n in (1, 2, 3, 4, 7, 8, 11, 12, 100)}
    assert caps == {1: 1, 2: 1, 3: 1, 4: 1, 7: 1, 8: 2, 11: 2, 12: 3, 100: 25}


def test_instances_already_in_recovery_use_up_the_cap() -> None:
    topo = group(d=4, on={"g-p-0": "n1", "g-d-0": "n1"})  # 8 instances: cap 2
    node = fault(FaultKind.NODE, "g-p-0", "g-d-0")
    one = choose(node, topo, in_recovery=1)
    assert (chosen(one).instances, one.deferred) == (("g-d-0",), ("g-p-0",))
    prefill_first = choose(node, topo, rc.Policy(protect=Protect.PREFILL), in_recovery=1)
    assert (chosen(prefill_first).instances, prefill_first.deferred) == (("g-p-0",), ("g-d-0",))
    full = choose(node, topo, in_recovery=2)
    assert full.chosen is None
    assert full.deferred == ("g-d-0", "g-p-0")
    assert "already in recovery" in full.why


def test_equal_costs_go_to_the_option_restarting_fewer_pods() -> None:
    # A retry window as long as a cold replacement: both keep 1/3 out for 4 s.
    est = dataclasses.replace(EST, retry_window=COLD)
    tie = choose(fault(FaultKind.STALE, "g-d-0"), group(), est=est)
    options = by_action(tie)
    assert options[A.MASK_AND_RETRY].cost == pytest.approx(options[A.REPLACE].cost)
    assert chosen(tie).action is A.MASK_AND_RETRY
    relink = choose(
        fault(FaultKind.LINK, "g-p-0"), group(), est=dataclasses.replace(EST, relink=COLD)
    )
    assert chosen(relink).action is A.RELINK
    longer = dataclasses.replace(EST, retry_window=COLD + 0.5)
    assert chosen(choose(fault(FaultKind.STALE, "g-d-0"), group(), est=longer)).action is A.REPLACE


# --------------------------------------------------------------------------- where NPUs are
NPU_FAULT = Taint(kinds.TAINT_NPU_FAULT, "npu-1")
SERVER_TROUBLE: dict[str, tuple[dict[str, Any], str]] = {
    # what keeps a decode's new pod off the server of prefill g-p-2, and the reason said
    "cordoned": ({"cordoned": True}, "n-g-p-2 is cordoned"),
    # another of its NPUs is faulty: the prefill serves on, nothing new lands there (NoSchedule)
    "npu-fault": (
        {"taints": (NPU_FAULT,)},
        f"n-g-p-2 is tainted {kinds.TAINT_NPU_FAULT}=npu-1:NoSchedule",
    ),
    "down": ({"ready": False}, "n-g-p-2 is not Ready"),
    "other SuperPod": (
        {"superpod": "sp1"},
        "n-g-p-2 is in SuperPod sp1, not in sp0 where the others of its role stay",
    ),
    "other NPU type": ({"npu_type": "Ascend910B"}, "not the decode's NPU type"),
}


def placed(
    topo: rc.Topology, trouble: dict[str, dict[str, Any]] | None = None, free: int = 0
) -> rc.Topology:
    """The topology with its servers known: each member alone on its 2-NPU server (full), all
    in SuperPod sp0 and taking either role, but where ``trouble`` says otherwise."""
    servers = {}
    members = {}
    for name, member in topo.members.items():
        how = (trouble or {}).get(member.node or "", {})
        superpod = how.get("superpod", "sp0")
        refuses = ""
        if not how.get("ready", True):
            refuses = f"{member.node} is not Ready"
        elif how.get("cordoned"):
            refuses = f"{member.node} is cordoned"
        elif how.get("taints"):
            refuses = f"{member.node} is tainted {how['taints'][0]}"
        elif how.get("npu_type"):
            refuses = "not the decode's NPU type"
        servers[member.node or ""] = rc.Server(
            member.node or "", free, superpod, {D: refuses} if refuses else {}
        )
        members[name] = dataclasses.replace(member, superpod=superpod)
    return dataclasses.replace(topo, members=members, servers=servers, same_superpod=frozenset({D}))


def test_with_the_servers_known_a_shrink_gives_up_the_last_prefill_where_the_decode_fits() -> None:
    plan = choose(fault(FaultKind.DIE, "g-d-0"), placed(group(p=3, free=0)))
    pick = chosen(plan)
    assert (pick.action, pick.sacrificed) == (A.SHRINK, ("g-p-2",))
    assert not by_action(plan)[A.REPLACE].feasible


@pytest.mark.parametrize("trouble", list(SERVER_TROUBLE))
def test_a_shrink_never_gives_up_a_prefill_whose_npus_the_decode_cannot_use(trouble: str) -> None:
    """Issue 31: the last prefill's server takes no new decode (cordoned, another NPU faulty,
    down, in another SuperPod than the decode that stays, another NPU type): giving it up
    restores nothing. The one before is given up instead; with none usable, the decode stays
    masked and the shrink says why. (Before issue 31, g-p-2 was given up in every case.)"""
    how, reason = SERVER_TROUBLE[trouble]
    one = placed(group(p=3, free=0), {"n-g-p-2": how})
    pick = chosen(choose(fault(FaultKind.DIE, "g-d-0"), one))
    assert (pick.action, pick.sacrificed) == (A.SHRINK, ("g-p-1",))
    every = placed(group(p=3, free=0), {f"n-g-p-{i}": how for i in range(3)})
    plan = choose(fault(FaultKind.DIE, "g-d-0"), every)
    assert chosen(plan).action is A.MASK_AND_RETRY
    shrink = by_action(plan)[A.SHRINK]
    assert not shrink.feasible
    assert f"g-p-2's: {reason}" in shrink.why, shrink.why
    # the first prefill may go too, one prefill being kept: a group of two gives up g-p-0
    two = placed(group(p=2, free=0), {"n-g-p-1": how})
    pick = chosen(choose(fault(FaultKind.DIE, "g-d-0"), two))
    assert (pick.action, pick.sacrificed) == (A.SHRINK, ("g-p-0",))


def test_a_decode_left_alone_may_restart_in_any_superpod_and_others_join_it() -> None:
    """The decodes keep one SuperPod: with a decode staying in sp0, NPUs in sp1 cannot serve
    the replacement; when the only decode is faulty, its replacement may go anywhere."""
    lone = placed(group(p=3, d=1, free=0), {"n-g-p-2": {"superpod": "sp1"}})
    pick = chosen(choose(fault(FaultKind.DIE, "g-d-0"), lone))
    assert (pick.action, pick.sacrificed) == (A.SHRINK, ("g-p-2",))
    # free NPUs count only where the replacement may go: in sp1, beside d-1 staying in sp0
    topo = placed(group(p=3, d=2, free=0))
    servers = dict(topo.servers or {}) | {"spare": rc.Server("spare", 2, "sp1")}
    elsewhere = dataclasses.replace(topo, servers=servers, free_npus=2)
    plan = choose(fault(FaultKind.DIE, "g-d-0"), elsewhere)
    replace = by_action(plan)[A.REPLACE]
    assert not replace.feasible
    assert "0 free where the new pods may go" in replace.why, replace.why
    shrink = by_action(plan)[A.SHRINK]  # (a whole-group restart fits too, and costs less)
    assert (shrink.feasible, shrink.sacrificed) == (True, ("g-p-2",))
    in_home = dataclasses.replace(
        elsewhere, servers=servers | {"spare": rc.Server("spare", 2, "sp0")}
    )
    pick = chosen(choose(fault(FaultKind.DIE, "g-d-0"), in_home))
    assert (pick.action, pick.instances) == (A.REPLACE, ("g-d-0",))


def test_a_pod_is_placed_whole_on_one_server() -> None:
    """A 4-NPU decode needs 4 NPUs on one server: two prefills' 2 NPUs on two servers do not
    make one; giving up the prefill beside 2 free NPUs does, and only that one goes."""
    members = dict(group(p=3, d=2, npus=2).members)
    members["g-d-0"] = dataclasses.replace(members["g-d-0"], npus=4)
    topo = placed(rc.Topology(members, 2))
    servers = dict(topo.servers or {})
    servers["n-g-p-1"] = dataclasses.replace(servers["n-g-p-1"], free=2)
    topo = dataclasses.replace(topo, servers=servers)
    pick = chosen(choose(fault(FaultKind.NODE, "g-d-0"), topo))
    assert (pick.action, pick.sacrificed) == (A.SHRINK, ("g-p-1",))
    servers["n-g-p-1"] = dataclasses.replace(servers["n-g-p-1"], free=0)
    servers["n-g-p-0"] = dataclasses.replace(servers["n-g-p-0"], free=1)
    spread = dataclasses.replace(topo, servers=servers, free_npus=1)
    plan = choose(fault(FaultKind.NODE, "g-d-0"), spread)
    assert chosen(plan).action is A.MASK_AND_RETRY
    assert "not enough for pods of 4 NPUs each" in by_action(plan)[A.SHRINK].why


def test_a_replacement_needs_every_npu_of_an_instance_whose_pods_split_them_unevenly() -> None:
    """The property test's example: g-p-0 holds 1 NPU over 2 pods, a die withholds it and none
    is free. Its new pods must ask for that NPU between them (1 and 0), not 0 each (each pod's
    share rounded down: a replacement that fitted in no NPU at all, chosen on a full cluster)."""
    members = {
        "g-p-0": rc.Member("g-p-0", P, 1, "n0", pods=2),
        "g-p-1": rc.Member("g-p-1", P, 1, "n0"),
        "g-d-0": rc.Member("g-d-0", D, 1, "n0"),
        "g-d-1": rc.Member("g-d-1", D, 1, "n0"),
    }
    quick = rc.Estimates(0.0, 0.0, 0.0, relink=0.0, retry_window=0.0, horizon=1.0)
    die = fault(FaultKind.DIE, "g-p-0")
    plan = choose(die, rc.Topology(members, 0), est=quick)
    replace = by_action(plan)[A.REPLACE]
    assert not replace.feasible
    assert replace.why == "1 NPUs needed, 0 come back where the faulty pods ran, 0 free elsewhere"
    assert chosen(plan).action is A.MASK_AND_RETRY
    assert chosen(choose(die, rc.Topology(members, 1), est=quick)).action is A.REPLACE
    # with the servers known: the pod asking for the NPU needs it free where it may go
    cordoned = rc.Server("n1", 1, refuses={P: "n1 is cordoned"})
    full = rc.Topology(members, 0, {"n0": rc.Server("n0", 0), "n1": cordoned})
    assert not by_action(choose(die, full, est=quick))[A.REPLACE].feasible
    room = dataclasses.replace(full, servers={"n0": rc.Server("n0", 1), "n1": cordoned})
    assert chosen(choose(die, room, est=quick)).action is A.REPLACE


# --------------------------------------------------------------------------- the property
def npus_withheld(f: Fault, topo: rc.Topology, names: set[str]) -> int:
    """As the module defines it: a down server keeps all its members' NPUs, and so does a
    device fault (the NPU unallocatable, its server tainted NoSchedule), a link fault a device
    reports included; any other fault none (the NPUs come back where they were)."""
    device = f.kind in DEVICE_KINDS or (f.kind is FaultKind.LINK and f.on_device)
    if f.kind is FaultKind.NODE or device:
        return sum(topo.members[n].npus for n in names)
    return 0


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    members = {}
    for role, tag in ((P, "p"), (D, "d")):
        for i in range(draw(st.integers(1, 5))):
            name = f"g-{tag}-{i}"
            members[name] = rc.Member(
                name,
                role,
                draw(st.sampled_from([1, 2, 4, 8])),
                draw(st.sampled_from(["n0", "n1", "n2"])),
                draw(st.integers(0, 5)),
                draw(st.integers(1, 2)),
            )
    kind = draw(st.sampled_from(list(FaultKind)))
    names = sorted(members)
    if kind is FaultKind.NODE:
        node = draw(st.sampled_from(["n0", "n1", "n2"]))
        faulty = tuple(n for n in names if members[n].node == node) or (names[0],)
    else:
        faulty = (draw(st.sampled_from(names)),)
    seconds = st.floats(0.0, 60.0, allow_nan=False)
    timings: dict[str, Any] = {
        k: draw(seconds)
        for k in (f.name for f in dataclasses.fields(rc.Estimates))
        if k not in ("warm_pods", "warm_ready", "warm_total")
    }
    return {
        "topo": rc.Topology(members, draw(st.none() | st.integers(0, 24))),
        "fault": Fault(kind, faulty, Tier.POD, 0.0, on_device=draw(st.booleans())),
        "policy": rc.Policy(
            draw(st.sampled_from(list(RecoveryPolicy))), draw(st.sampled_from(list(Protect)))
        ),
        "est": dataclasses.replace(
            rc.Estimates(**timings),
            warm_pods=draw(st.dictionaries(st.sampled_from([P, D]), st.integers(0, 3))),
            warm_ready=draw(st.dictionaries(st.sampled_from([P, D]), seconds)),
            warm_total=draw(st.none() | st.integers(0, 3)),
        ),
        "connected": draw(st.booleans()),
        "in_recovery": draw(st.integers(0, 3)),
    }


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_every_plan_is_feasible_on_its_snapshot(case: dict[str, Any]) -> None:
    """Whatever the snapshot, the plan is the cheapest feasible option and could be carried out
    on it. A cold replacement, or a group restart, needs the NPUs the fault withholds free (the
    rest come back where the faulty pods ran). A warm replacement needs none: its warm pods
    already hold their NPUs (DeepServe §6.1's pre-warmed pods; the module's rule, and
    ``test_a_warm_pod_replaces_a_faulty_instance_without_free_npus_and_sooner``), so it is
    checked for a warm pod per faulty instance instead (held to the free NPUs, it failed
    whenever a warm pod was drawn for a device fault on a full cluster)."""
    topo: rc.Topology = case["topo"]
    est: rc.Estimates = case["est"]
    f: Fault = case["fault"]
    policy: rc.Policy = case["policy"]
    plan = choose(f, topo, policy, est, case["connected"], case["in_recovery"])
    if not case["connected"]:
        assert plan.chosen is None
        assert not plan.alternatives
        return
    room = max(0, rc.concurrency_cap(len(topo.members)) - case["in_recovery"])
    taken = set(f.instances) - set(plan.deferred)
    assert set(plan.deferred) <= set(f.instances)
    assert len(taken) == min(room, len(f.instances))
    if plan.deferred and taken:  # the protected role is taken first under the cap
        assert min(policy.weight(topo.members[n].tag) for n in taken) >= max(
            policy.weight(topo.members[n].tag) for n in plan.deferred
        )
    if plan.chosen is None:
        assert room == 0
        return
    pick = plan.chosen
    assert set(pick.instances) <= set(topo.members)
    assert pick.feasible
    if policy.policy is RecoveryPolicy.RESTART_GROUP:  # the rule, or masked if it cannot be
        restart = next(o for o in (pick, *plan.alternatives) if o.action is A.RESTART_GROUP)
        assert pick.action is (A.RESTART_GROUP if restart.feasible else A.MASK_AND_RETRY)
        return
    feasible = [o for o in (pick, *plan.alternatives) if o.feasible]
    assert pick.cost == pytest.approx(min(o.cost for o in feasible), abs=1e-6)
    free = topo.free_npus
    held = npus_withheld(f, topo, taken)
    if "warmReady" in pick.terms:  # a warm pod per faulty instance, of its role
        assert pick.action is A.REPLACE
        roles = Counter(topo.members[n].tag for n in taken)
        assert all(est.warm_pods.get(r, 0) >= k and r in est.warm_ready for r, k in roles.items())
        assert est.warm_total is None or est.warm_total >= len(taken)
    elif pick.action in (A.REPLACE, A.RESTART_GROUP):
        assert free is None or free >= held
    if pick.action is A.SHRINK:
        decodes = {n for n in taken if topo.members[n].tag is D}
        assert decodes
        assert free is not None
        assert free < held
        freed = sum(topo.members[n].npus for n in pick.sacrificed)
        assert free + freed >= npus_withheld(f, topo, decodes)
        prefills = {n for n, m in topo.members.items() if m.tag is P}
        assert set(pick.sacrificed) <= prefills  # faulty prefills first, then healthy ones
        assert taken & prefills <= set(pick.sacrificed)
        assert len(prefills - set(pick.sacrificed)) >= 1
        assert topo.count(D) >= 1
    if pick.action is A.RELINK:
        assert f.kind is FaultKind.LINK
        assert not f.on_device
    if pick.action is A.RESTART_IN_PLACE:
        assert f.kind is FaultKind.KILL
        assert all(topo.members[n].restarts < rc.CRASH_LOOP_RESTARTS for n in taken)
    if pick.action is not A.RESTART_GROUP:
        assert set(pick.instances) - set(pick.sacrificed) <= taken
        assert len(set(pick.instances) - set(pick.sacrificed)) <= room


@st.composite
def placed_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Members (one pod each) on servers that may or may not take a new decode, in two
    SuperPods, with some NPUs free; a fault that withholds a decode's NPUs."""
    servers = {
        f"n{i}": rc.Server(
            f"n{i}",
            draw(st.integers(0, 4)),
            draw(st.sampled_from(["sp0", "sp1"])),
            {D: "refused"} if draw(st.booleans()) else {},
        )
        for i in range(draw(st.integers(2, 6)))
    }
    members = {}
    for role, tag in ((P, "p"), (D, "d")):
        for i in range(draw(st.integers(1, 4))):
            name = f"g-{tag}-{i}"
            at = draw(st.sampled_from(sorted(servers)))
            npus = draw(st.sampled_from([1, 2, 4]))
            members[name] = rc.Member(name, role, npus, at, superpod=servers[at].superpod)
    topo = rc.Topology(
        members,
        sum(s.free for s in servers.values() if not s.refuses),
        servers,
        frozenset({D}),
    )
    decode = draw(st.sampled_from(sorted(n for n in members if n.startswith("g-d-"))))
    kind = draw(st.sampled_from([FaultKind.DIE, FaultKind.NODE]))
    return {"topo": topo, "fault": Fault(kind, (decode,), Tier.POD, 0.0)}


@settings(max_examples=300, deadline=None)
@given(placed_scenarios())
def test_a_shrink_frees_npus_a_new_decode_can_use(case: dict[str, Any]) -> None:
    """Issue 31's rule as a property: a chosen shrink gives up only healthy prefills on servers
    that take a new decode, in the SuperPod of the decodes that stay, and with them one such
    server has room for the decode's pod; a replacement is chosen only where one has room."""
    topo: rc.Topology = case["topo"]
    f: Fault = case["fault"]
    plan = choose(f, topo)
    pick = chosen(plan)
    (decode,) = f.instances
    servers = topo.servers or {}
    size = topo.members[decode].npus
    home = {m.superpod for n, m in topo.members.items() if m.tag is D and n != decode}

    def takes(server: rc.Server) -> bool:
        return not server.refuses and (not home or server.superpod in home)

    if pick.action is A.SHRINK:
        freed: dict[str, int] = {}
        for name in pick.sacrificed:
            member = topo.members[name]
            assert member.tag is P
            assert takes(servers[member.node or ""]), (name, member.node)
            freed[member.node or ""] = freed.get(member.node or "", 0) + member.npus
        assert any(takes(s) and s.free + freed.get(s.name, 0) >= size for s in servers.values())
        assert any(m.tag is P and n not in pick.sacrificed for n, m in topo.members.items())
    if pick.action is A.REPLACE:
        assert any(takes(s) and s.free >= size for s in servers.values())


# --------------------------------------------------------------------------- detection
NAMES = {f"g-p-{i}": (P, i) for i in range(4)} | {f"g-d-{i}": (D, 4 + i) for i in range(2)}
NOW = 50.0


def spec() -> PDGroupSpec:
    return PDGroupSpec.model_validate(
        {
            "service": "chat",
            "scenario": "general",
            "model": {"name": "llama3-8b"},
            "prefill": {"replicas": 4, "devicesPerInstance": 2},
            "decode": {"replicas": 2, "devicesPerInstance": 2, "batchSize": 32},
        }
    )


def pod(name: str, node: str = "n1", running: float | None = 1.0, **extra: Any) -> PodView:
    role = NAMES[name][0]
    return PodView(
        name, f"uid-{name}", pod_labels("g", role, name), "Running", True, False, node, "sp0",
        0.0, running_since=running, **extra,
    )  # fmt: skip


def health(name: str, state: zl.HealthState = zl.HealthState.SERVING, **extra: Any) -> zl.Health:
    role, i = NAMES[name]
    return zl.Health(
        instance=name, role=role, state=state, seq=1, ts=NOW - 1.0,
        podIP=f"127.64.0.{i + 2}", port=8000, **extra,
    )  # fmt: skip


def serving(**health_of: zl.Health) -> ZkView:
    zk: ZkView = formed_zk(NAMES, health_ts=NOW - 1.0)
    return dataclasses.replace(zk, health={**zk.health, **health_of})


def node(name: str, npus: int, superpod: str = "sp0", **extra: Any) -> NodeView:
    """A Ready server of the group's NPU type (what its pods' node selector asks for)."""
    labels = {kinds.LABEL_NPU_TYPE: "Ascend910C", kinds.LABEL_SUPERPOD: superpod}
    return NodeView(name, True, npus, labels=labels, **extra)


def group_view(zk: ZkView, pods: dict[str, PodView] | None = None, free: int = 8) -> GroupView:
    pods = {n: pod(n) for n in NAMES} | (pods or {})
    nodes = {"n1": node("n1", 12), "n2": node("n2", free)}
    engine = EngineSettings(zookeeper="127.0.0.1:2181")
    view: GroupView = formed_group(spec(), pods, zk, now=NOW, engine=engine, nodes=nodes)
    return view


def die(name: str) -> zl.Health:
    fault = zl.EngineFault(kind=zl.EngineFaultKind.DIE, since=NOW - 0.3, dies=[1])
    return health(name, state=zl.HealthState.FAULTY, faults=[fault])


def test_a_healthy_group_has_no_faults_and_its_free_npus_are_counted() -> None:
    view = group_view(serving())
    assert pr.detect(view, view.zk.roce_map) == []
    assert pr.free_npus(view) == 8  # n1's 12 all granted to the six members, n2's 8 free
    topo = pr.topology(view, view.zk.roce_map)
    assert (topo.count(P), topo.count(D), topo.members["g-d-0"].npus) == (4, 2, 2)


def test_a_faulty_health_with_a_die_fault_is_a_die_fault_seen_by_the_device_status() -> None:
    view = group_view(serving(**{"g-d-0": die("g-d-0")}))
    faults = pr.detect(view, view.zk.roce_map)
    assert [(f.kind, f.instances, f.tier) for f in faults] == [
        (FaultKind.DIE, ("g-d-0",), Tier.DEVICE_STATUS)
    ]
    assert faults[0].since == NOW - 0.3
    assert faults[0].node == "n1"


def test_a_server_down_is_one_node_fault_naming_every_member_there() -> None:
    down = {n: pod(n, node="n2", node_down_since=NOW - 2.0) for n in ("g-p-2", "g-d-1")}
    view = group_view(serving(), down)
    faults = pr.detect(view, view.zk.roce_map)
    assert [(f.kind, f.instances, f.tier, f.node) for f in faults] == [
        (FaultKind.NODE, ("g-d-1", "g-p-2"), Tier.NODE, "n2")
    ]
    assert faults[0].since == NOW - 2.0


def test_an_exited_engine_container_is_a_kill() -> None:
    exited = pod("g-p-1", running=None, last_exit_at=NOW - 1.0, restarts=1)
    view = group_view(serving(), {"g-p-1": exited})
    faults = pr.detect(view, view.zk.roce_map)
    assert [(f.kind, f.instances, f.tier) for f in faults] == [
        (FaultKind.KILL, ("g-p-1",), Tier.POD)
    ]


@pytest.mark.parametrize(
    ("restarts", "backoff", "action"),
    [
        (0, None, "RestartInPlace"),  # the kubelet's first restart is at once
        (2, 0.5, "RestartInPlace"),  # a short back-off, as the kubelet says it
        (2, 40.0, "Replace"),  # a long one: a new pod is sooner
        (2, None, "Replace"),  # not said yet: its default after two restarts, 20 s
    ],
)
def test_a_killed_engine_is_restarted_in_place_unless_the_kubelets_back_off_is_longer(
    restarts: int, backoff: float | None, action: str
) -> None:
    exited = pod(
        "g-p-1", running=None, last_exit_at=NOW, restarts=restarts, restart_backoff=backoff
    )
    plan = pdgroup.plan(group_view(serving(), {"g-p-1": exited}))
    last = plan.status["lastRecovery"]
    assert (last["fault"]["kind"], last["plan"]["action"]) == ("kill", action)


@pytest.mark.parametrize(
    ("down_at", "faulty", "peer"),
    [
        ("", "g-p-0", "g-d-1"),  # unanswered: the prober's, relinked if its ports are up
        ("g-p-0", "g-p-0", "g-d-1"),  # the prober's own port down
        ("g-d-1", "g-d-1", "g-p-0"),  # the decode's port down, as its answer says
    ],
)
def test_a_blocked_sub_link_is_a_link_fault_of_the_end_whose_port_is_down(
    down_at: str, faulty: str, peer: str
) -> None:
    probe = zl.LinkProbe(
        peer="g-d-1", device=2, peerRoceIp="198.18.0.23", state=zl.LinkState.BLOCKED,
        since=NOW - 4.0, downAt=down_at,
    )  # fmt: skip
    delayed = probe.model_copy(update={"peer": "g-d-0", "state": zl.LinkState.DELAYED})
    view = group_view(serving(**{"g-p-0": health("g-p-0", links=[delayed, probe])}))
    faults = pr.detect(view, view.zk.roce_map)
    assert [(f.kind, f.instances, f.tier, f.peer) for f in faults] == [
        (FaultKind.LINK, (faulty,), Tier.LINK_PROBE, peer)
    ]
    assert faults[0].on_device is bool(down_at)
    assert faults[0].since == NOW - 4.0


def test_a_lost_session_is_a_running_pods_that_was_ready_not_a_starting_pods() -> None:
    """A member's pod deleted by hand and made again: the new pod's engine has not registered
    yet (the old report is another pod's). Past SESSION_GRACE_SECONDS it used to be a lost
    session, replaced, and its replacement replaced again in turn while engines took longer
    than that to register; it is starting, and has the gather timeout to report."""
    since = NOW - 3 * pr.SESSION_GRACE_SECONDS
    starting = dataclasses.replace(
        pod("g-p-0", running=since, ready_changed_at=since), uid="uid-recreated", ready=False
    )
    view = group_view(serving(), {"g-p-0": starting})
    assert "g-p-0" not in view.reports  # the old pod's report is not this pod's
    assert pr.detect(view, view.zk.roce_map) == []
    plan = pdgroup.plan(view)
    assert not any(isinstance(a, MarkRemoved) for a in plan.actions)
    # It registers within the gather timeout or is a lost session.
    late = dataclasses.replace(view, now=since + GATHER_TIMEOUT_SECONDS + 1.0)
    faults = [f for f in pr.detect(late, late.zk.roce_map) if "g-p-0" in f.instances]
    assert [f.kind for f in faults] == [FaultKind.SESSION]  # (the others' health is stale)
    # A pod that was Ready in its container and is not any more, its report gone: a lost
    # session past the grace.
    lost = dataclasses.replace(
        pod("g-p-0", running=NOW - 600.0, ready_changed_at=since), ready=False
    )
    zk = serving()
    gone = dataclasses.replace(zk, reports={n: r for n, r in zk.reports.items() if n != "g-p-0"})
    view = group_view(gone, {"g-p-0": lost})
    faults = pr.detect(view, view.zk.roce_map)
    assert [(f.kind, f.instances, f.tier) for f in faults] == [
        (FaultKind.SESSION, ("g-p-0",), Tier.SESSION)
    ]


def test_the_group_plan_for_a_die_on_a_decode_removes_it_logically_then_releases_its_pod() -> None:
    zk = serving(**{"g-d-0": die("g-d-0")})
    first = pdgroup.plan(group_view(zk))
    actions = first.actions
    assert [a.reason for a in actions if isinstance(a, ReportRecovery)] == [
        "FaultDetected",
        "RecoveryPlanned",
    ]
    marks = [a.removal.instance for a in actions if isinstance(a, MarkRemoved)]
    assert marks == ["g-d-0"]
    assert not any(isinstance(a, DeletePod) for a in actions), "logical removal comes first"
    meta = next(a.meta for a in actions if isinstance(a, WriteDecodeMeta))
    assert [e.instance for e in meta.decodes] == ["g-d-1"]  # out of the decode meta at once
    last = first.status["lastRecovery"]
    assert last["plan"]["action"] == "Replace"
    assert last["plan"]["instances"] == ["g-d-0"]
    assert last["plan"]["cost"] == pytest.approx(COLD / 3, abs=1e-3)
    assert last["fault"]["kind"] == "die"
    assert last["fault"]["detectedBy"] == "device-status"
    assert last["detectedAfterSeconds"] == pytest.approx(0.3)
    assert last["phase"] == "InProgress"
    assert last["podsRestarted"] == 1
    assert {o["action"] for o in last["alternatives"]} == {str(a) for a in A} - {"Replace"}
    assert [r["plan"]["action"] for r in first.status["recovering"]] == ["Replace"]
    degraded = next(c for c in first.conditions if c.type == "Degraded")
    assert degraded.status is True
    assert degraded.reason == "Recovering"
    assert not first.ready
    ready = next(c for c in first.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == (False, "Recovering")  # not SettingUp (issue 31)
    # Next pass: the marker is there; the map drops it, and the fault starts nothing new.
    marked = dataclasses.replace(zk, removed=frozenset({"g-d-0"}), decode_meta=meta)
    second = pdgroup.plan(dataclasses.replace(group_view(marked), previous=first.status))
    write = next(a for a in second.actions if isinstance(a, WriteRoceMap))
    assert write.removed == ("g-d-0",)
    assert not any(isinstance(a, ReportRecovery | DeletePod) for a in second.actions)
    # Then, out of the map: only its pod is released.
    unmapped = dataclasses.replace(marked, roce_map=write.roce_map)
    third = pdgroup.plan(dataclasses.replace(group_view(unmapped), previous=second.status))
    assert [a.name for a in third.actions if isinstance(a, DeletePod)] == ["g-d-0"]


def test_a_faulty_prefill_leaves_the_entrances_when_it_is_logically_removed() -> None:
    view = group_view(serving(**{"g-p-1": die("g-p-1")}))
    [found] = pr.detect(view, view.zk.roce_map)
    option = rc.Option(A.REPLACE, ("g-p-1",), {}, 0.0, 0.0, feasible=True, why="")
    executed = pr.execute(view, option, found, view.zk.roce_map)
    assert [type(a) for a in executed] == [MarkRemoved, DeleteEntrance]
    plan = pdgroup.plan(view)
    steps = [
        (type(a).__name__, a.removal.instance if isinstance(a, MarkRemoved) else a.name)
        for a in plan.actions
        if isinstance(a, MarkRemoved | DeleteEntrance | DeletePod)
    ]
    assert steps == [("MarkRemoved", "g-p-1"), ("DeleteEntrance", "g-p-1")]
    assert plan.status["lastRecovery"]["plan"]["instances"] == ["g-p-1"]


def blocked_link(down_at: str = "") -> zl.Health:
    probe = zl.LinkProbe(
        peer="g-d-1", device=0, peerRoceIp="198.18.0.23", state=zl.LinkState.BLOCKED,
        since=NOW - 1.0, downAt=down_at,
    )  # fmt: skip
    return health("g-p-0", links=[probe])


def test_a_taint_keeps_off_only_the_pods_that_do_not_tolerate_it() -> None:
    """Kubernetes' toleration rule, as the scheduler applies it to a new pod."""
    taint = Taint(kinds.TAINT_NPU_FAULT, "npu-3")
    assert not taint.tolerated_by([])
    assert taint.tolerated_by([{"key": kinds.TAINT_NPU_FAULT, "operator": "Exists"}])
    assert taint.tolerated_by([{"key": kinds.TAINT_NPU_FAULT, "value": "npu-3"}])
    assert not taint.tolerated_by([{"key": kinds.TAINT_NPU_FAULT, "value": "npu-1"}])
    assert taint.tolerated_by([{"operator": "Exists"}])  # no key, Exists: every taint
    assert not taint.tolerated_by([{"operator": "Exists", "effect": "NoExecute"}])
    assert taint.tolerated_by([{"operator": "Exists", "effect": "NoSchedule"}])
    assert not taint.tolerated_by([{"key": "other", "operator": "Exists"}])
    soft = Taint("example.com/soft", effect="PreferNoSchedule")
    server = node("n", 2, taints=(soft,))
    selector = {kinds.LABEL_NPU_TYPE: "Ascend910C"}
    assert server.schedulable  # a preference refuses nothing
    assert not server.refuses(selector)
    tainted = node("n", 2, taints=(soft, taint))
    assert not tainted.schedulable
    assert tainted.refuses(selector) == f"n is tainted {kinds.TAINT_NPU_FAULT}=npu-3:NoSchedule"
    assert not tainted.refuses(selector, [{"key": kinds.TAINT_NPU_FAULT, "operator": "Exists"}])
    assert node("n", 2, cordoned=True).refuses(selector) == "n is cordoned"
    assert node("n", 2).refuses({kinds.LABEL_NPU_TYPE: "Ascend910B"}) == (
        f"n is not {kinds.LABEL_NPU_TYPE}=Ascend910B"
    )
    down = dataclasses.replace(node("n", 2), ready=False)
    assert down.refuses(selector) == "n is not Ready"


def test_the_group_gives_up_a_prefill_only_where_its_npus_serve_the_decode() -> None:
    """Issue 31, over the group's view: every instance alone on a full 2-NPU server; a die on
    g-d-0 taints its server and none is free, so the decode is restored by giving up a prefill.
    The last one, g-p-3, serves on a server whose other NPU is faulty (tainted
    ``npu-fault:NoSchedule``, which engine pods do not tolerate): its NPUs would restore
    nothing, so g-p-2 is given up. (Before issue 31: g-p-3, and the decode stayed Pending.)"""
    fault_taint = (Taint(kinds.TAINT_NPU_FAULT, "npu-1"),)
    pods = {n: pod(n, node=f"s-{n}") for n in NAMES}
    nodes = {f"s-{n}": node(f"s-{n}", 2) for n in NAMES}
    nodes["s-g-d-0"] = node("s-g-d-0", 1, taints=fault_taint)
    view = dataclasses.replace(group_view(serving(**{"g-d-0": die("g-d-0")}), pods), nodes=nodes)
    assert pr.free_npus(view) == 0
    last = pdgroup.plan(view).status["lastRecovery"]
    assert (last["plan"]["action"], last["plan"]["sacrificed"]) == ("Shrink", ["g-p-3"])
    nodes["s-g-p-3"] = node("s-g-p-3", 1, taints=fault_taint)
    last = pdgroup.plan(dataclasses.replace(view, nodes=nodes)).status["lastRecovery"]
    assert (last["plan"]["action"], last["plan"]["sacrificed"]) == ("Shrink", ["g-p-2"])
    shrink = pr.servers(dataclasses.replace(view, nodes=nodes))
    assert shrink is not None
    assert shrink["s-g-p-3"].refuses[D] == (
        f"s-g-p-3 is tainted {kinds.TAINT_NPU_FAULT}=npu-1:NoSchedule"
    )
    assert (shrink["s-g-p-2"].free, shrink["s-g-p-2"].superpod, shrink["s-g-p-2"].refuses) == (
        0,
        "sp0",
        {},
    )


def test_a_blocked_link_is_relinked_first_and_replaced_once_a_relink_did_not_clear_it() -> None:
    zk = serving(**{"g-p-0": blocked_link()})
    first = pdgroup.plan(group_view(zk))
    assert first.status["lastRecovery"]["plan"]["action"] == "Relink"
    # the pair's link forgotten, then a new map version: both ends verify it again
    kinds = [type(a) for a in first.actions if isinstance(a, ForgetLink | WriteRoceMap)]
    assert kinds == [ForgetLink, WriteRoceMap]
    assert next(a for a in first.actions if isinstance(a, ForgetLink)) == ForgetLink(
        "g-p-0", "g-d-1"
    )
    assert not any(isinstance(a, MarkRemoved | DeletePod) for a in first.actions)
    # Still blocked past the relink's deadline: failed, and planned anew as a port down.
    late = dataclasses.replace(
        group_view(zk), now=NOW + pr.RELINK_DEADLINE_SECONDS + 1, previous=first.status
    )
    second = pdgroup.plan(late)
    reasons = [a.reason for a in second.actions if isinstance(a, ReportRecovery)]
    assert reasons[0] == "RecoveryFailed"
    assert second.status["lastRecovery"]["plan"]["action"] == "Replace"
    assert "a relink did not clear it" in second.status["lastRecovery"]["fault"]["detail"]
    assert [a.removal.instance for a in second.actions if isinstance(a, MarkRemoved)] == ["g-p-0"]


def test_a_port_down_at_the_decode_replaces_the_decode_not_the_prefill_that_saw_it() -> None:
    plan = pdgroup.plan(group_view(serving(**{"g-p-0": blocked_link(down_at="g-d-1")})))
    last = plan.status["lastRecovery"]
    assert (last["fault"]["kind"], last["fault"]["instances"]) == ("link", ["g-d-1"])
    assert (last["plan"]["action"], last["plan"]["instances"]) == ("Replace", ["g-d-1"])
    assert [a.removal.instance for a in plan.actions if isinstance(a, MarkRemoved)] == ["g-d-1"]


def test_a_stale_member_is_masked_once_and_not_planned_again_until_it_refreshes() -> None:
    """A frozen engine whose session lives on: its health stops moving. It gets no traffic
    (not healthy), and when waiting is cheaper than replacing it (a slow cold start) the mask
    is one recovery, not a new one every pass."""
    slow = {n: health(n, readyAfter=120.0) for n in NAMES}  # a cold start takes 2 min here
    frozen = slow["g-p-0"].model_copy(update={"ts": NOW - 200.0})
    zk = serving(**(slow | {"g-p-0": frozen}))
    first = pdgroup.plan(group_view(zk))
    last = first.status["lastRecovery"]
    assert (last["fault"]["kind"], last["plan"]["action"]) == ("stale", "MaskAndRetry")
    assert DeleteEntrance("g-p-0") in first.actions  # no traffic to it meanwhile
    still = dataclasses.replace(zk, entrances=zk.entrances - {"g-p-0"})
    second = pdgroup.plan(dataclasses.replace(group_view(still), previous=first.status))
    assert not [a for a in second.actions if isinstance(a, ReportRecovery)], "planned again"
    assert second.status["recovering"] == first.status["recovering"]
    # refreshed: open again, then restored
    fresh = dataclasses.replace(still, health=dict(still.health) | {"g-p-0": slow["g-p-0"]})
    third = pdgroup.plan(dataclasses.replace(group_view(fresh), previous=second.status))
    assert [a.entrance.instance for a in third.actions if isinstance(a, SetEntrance)] == ["g-p-0"]
    opened = dataclasses.replace(fresh, entrances=zk.entrances)
    fourth = pdgroup.plan(dataclasses.replace(group_view(opened), previous=third.status))
    assert [a.reason for a in fourth.actions if isinstance(a, ReportRecovery)] == ["Recovered"]
    assert fourth.status["lastRecovery"]["phase"] == "Restored"


def test_a_decode_several_prefills_cannot_reach_is_the_faulty_end_of_an_unanswered_link() -> None:
    """No device status says which port is down; when two prefills' probes to one decode go
    unanswered, the decode is the end in common (one prefill alone: its own end is guessed)."""

    def unanswered(prefill: str) -> zl.Health:
        probe = zl.LinkProbe(
            peer="g-d-1", device=0, peerRoceIp="198.18.0.23", state=zl.LinkState.BLOCKED,
            since=NOW - 1.0,
        )  # fmt: skip
        return health(prefill, links=[probe])

    alone = group_view(serving(**{"g-p-0": unanswered("g-p-0")}))
    assert [f.instances for f in pr.detect(alone, alone.zk.roce_map)] == [("g-p-0",)]
    two = group_view(serving(**{p: unanswered(p) for p in ("g-p-0", "g-p-1")}))
    assert [f.instances for f in pr.detect(two, two.zk.roce_map)] == [("g-d-1",)]


def test_a_replacements_time_to_serve_is_learned_without_the_first_setups_wait() -> None:
    """A first-setup member waited for every other member's report before its map; a lone
    replacement does not: the estimate is each member's own link + load, plus the shortest
    wait for a map any member had."""
    said = {
        n: health(n, readyAfter=10.0 + i, gatheredAfter=4.0 + i) for i, n in enumerate(NAMES)
    } | {"g-d-1": health("g-d-1", readyAfter=8.0, gatheredAfter=0.5)}
    est = pr.estimates(group_view(serving(**said)))
    # link + load: 6.0 for the first five, 7.5 for g-d-1; the shortest wait for a map: 0.5
    assert est.engine_ready == pytest.approx(6.5)


def test_a_replacements_load_is_learned_as_it_would_be_alone() -> None:
    """A first setup's members shared the shared file service's bucket (their health's
    ``loadShare``): a lone replacement, or a container restarted in place, loads alone, so the
    estimate takes the shared part out (bench-recovery's planner over-predicted by 40-57%)."""
    scale = float(EngineSettings(zookeeper="-").time_scale)
    said = {
        n: health(
            n, readyAfter=30.0, gatheredAfter=0.5, loadShare=8.0,
            phases={"TEPreLoad": 2.0 * scale, "TELoad": 24.0 * scale, "TEPostLoad": 0.1 * scale},
            loadSource="SharedFileService",
        )
        for n in NAMES
    }  # fmt: skip
    est = pr.estimates(group_view(serving(**said)))
    # 30 s to serve, of which 24 s loading with 8 readers: 3 s alone, so 30 - 21
    assert est.engine_ready == pytest.approx(9.0)
    assert est.shared_load == pytest.approx(3.0)
    # one engine restarted alone pays one lone load; k restarted together share the bucket
    topo = pr.topology(group_view(serving(**said)), serving(**said).roce_map)
    kill = Fault(FaultKind.KILL, ("g-p-0",), Tier.POD, 0.0)
    one = rc.options(kill, topo, rc.Policy(), est, {"g-p-0"})
    restart = next(o for o in one if o.action is rc.ActionKind.RESTART_IN_PLACE)
    assert "sharedLoad" not in restart.terms
    every = next(o for o in one if o.action is rc.ActionKind.RESTART_GROUP)
    assert every.terms["sharedLoad"] == pytest.approx(3.0 * (len(NAMES) - 1))
    node = Fault(FaultKind.NODE, ("g-p-0", "g-p-1"), Tier.NODE, 0.0)
    two = rc.options(node, topo, rc.Policy(), est, {"g-p-0", "g-p-1"})
    replace = next(o for o in two if o.action is rc.ActionKind.REPLACE)
    assert replace.terms["sharedLoad"] == pytest.approx(3.0)
    alone = {n: h.model_copy(update={"load_share": 1.0}) for n, h in said.items()}
    assert pr.estimates(group_view(serving(**alone))).engine_ready == pytest.approx(30.0)
    unsaid = {n: h.model_copy(update={"load_share": 0.0}) for n, h in said.items()}
    assert pr.estimates(group_view(serving(**unsaid))).engine_ready == pytest.approx(30.0)


# --------------------------------------------------------------------------- warm replacements
def test_a_warm_pod_replaces_a_faulty_instance_without_free_npus_and_sooner() -> None:
    topo = rc.Topology(
        {
            "g-p-0": rc.Member("g-p-0", P, 2, "n0"),
            "g-d-0": rc.Member("g-d-0", D, 2, "n1"),
        },
        free_npus=0,
    )
    fault = Fault(FaultKind.DIE, ("g-d-0",), Tier.POD, 0.0)
    cold = choose(fault, topo, rc.Policy(), EST, True, 0)
    replace = next(o for o in cold.alternatives if o.action is rc.ActionKind.REPLACE)
    assert not replace.feasible  # a die withholds its NPUs and none are free
    warm_est = dataclasses.replace(EST, warm_pods={D: 1}, warm_ready={D: 0.9})
    warm = choose(fault, topo, rc.Policy(), warm_est, True, 0)
    assert warm.chosen is not None
    assert warm.chosen.action is rc.ActionKind.REPLACE
    assert warm.chosen.terms == {"podDelete": EST.pod_delete, "warmReady": 0.9}


def test_a_killed_engine_is_replaced_warm_when_that_beats_its_restart_in_place() -> None:
    topo = rc.Topology(
        {"g-p-0": rc.Member("g-p-0", P, 2, "n0"), "g-d-0": rc.Member("g-d-0", D, 2, "n1")}
    )
    fault = Fault(FaultKind.KILL, ("g-p-0",), Tier.POD, 0.0)
    slow = dataclasses.replace(EST, engine_ready=21.0)  # a new process pays TE-Pre-Load
    assert choose(fault, topo, rc.Policy(), slow, True, 0).chosen.action is (  # type: ignore[union-attr]
        rc.ActionKind.RESTART_IN_PLACE
    )
    warm = dataclasses.replace(slow, warm_pods={P: 1}, warm_ready={P: 1.0})
    plan = choose(fault, topo, rc.Policy(), warm, True, 0)
    assert plan.chosen is not None
    assert plan.chosen.action is rc.ActionKind.REPLACE
    # not enough warm pods for every faulty instance: the cold replacement's terms
    two = Fault(FaultKind.NODE, ("g-p-0", "g-d-0"), Tier.NODE, 0.0)
    options = rc.options(two, topo, rc.Policy(), warm, {"g-p-0", "g-d-0"})
    replace = next(o for o in options if o.action is rc.ActionKind.REPLACE)
    assert "warmReady" not in replace.terms


def test_one_warm_pod_that_fits_both_roles_replaces_only_one_instance() -> None:
    topo = rc.Topology(
        {"g-p-0": rc.Member("g-p-0", P, 2, "n0"), "g-d-0": rc.Member("g-d-0", D, 2, "n0")}
    )
    both = Fault(FaultKind.NODE, ("g-p-0", "g-d-0"), Tier.NODE, 0.0)
    one_pod = dataclasses.replace(
        EST, warm_pods={P: 1, D: 1}, warm_ready={P: 1.0, D: 1.0}, warm_total=1
    )
    options = rc.options(both, topo, rc.Policy(), one_pod, {"g-p-0", "g-d-0"})
    replace = next(o for o in options if o.action is rc.ActionKind.REPLACE)
    assert "warmReady" not in replace.terms
    two_pods = dataclasses.replace(one_pod, warm_total=2)
    options = rc.options(both, topo, rc.Policy(), two_pods, {"g-p-0", "g-d-0"})
    replace = next(o for o in options if o.action is rc.ActionKind.REPLACE)
    assert replace.terms["warmReady"] == 1.0


def test_a_multi_pod_decode_whose_worker_server_is_down_is_replaced_whole_beside_its_leader() -> (
    None
):
    """A 2 x 8-NPU decode: its worker's server is down, its leader's is not. Only the worker's 8
    NPUs are withheld (the leader's come back where they ran), and the new pods go one per
    server in the decodes' SuperPod: replaced, no prefill given up for it."""
    members = {
        "g-p-0": rc.Member("g-p-0", P, 8, "p0", superpod="sp0"),
        "g-d-0": rc.Member("g-d-0", D, 16, "d0", pods=2, superpod="sp0", pod_nodes=("d0", "d1")),
    }
    servers = {
        "p0": rc.Server("p0", 0, "sp0"),
        "d0": rc.Server("d0", 0, "sp0"),
        "d1": rc.Server("d1", 0, "sp0", refuses={P: "d1 is not Ready", D: "d1 is not Ready"}),
        "spare": rc.Server("spare", 8, "sp0"),
    }
    topo = rc.Topology(members, 8, servers, same_superpod=frozenset({D}))
    node_down = Fault(FaultKind.NODE, ("g-d-0",), Tier.NODE, 0.0, node="d1")
    assert rc.withheld(node_down, topo, ("g-d-0",)) == 8
    plan = choose(node_down, topo)
    assert (chosen(plan).action, chosen(plan).instances) == (A.REPLACE, ("g-d-0",))
    # the two new pods cannot share one server: with the spare gone, nothing fits
    full = dataclasses.replace(
        topo, free_npus=0, servers={**servers, "spare": rc.Server("spare", 0, "sp0")}
    )
    assert not by_action(choose(node_down, full))[A.REPLACE].feasible


# --------------------------------------------------------------------------- any kind's members
def test_the_planner_prices_an_expert_servers_replacement_by_its_tag() -> None:
    """Members are tagged, not roled: an ExpertPool's servers (tag ``expert``) are priced by the
    same planner. A killed server past its crash loop: a warm pod of its tag replaces it; the
    shrink, a PDGroup's, is not for them; capacity lost is one server in eight."""
    servers = {
        f"n{i}": rc.Server(f"n{i}", 0, "sp0", {"other": "not its NPU type"}) for i in range(8)
    }
    members = {
        f"srv-{i}": rc.Member(f"srv-{i}", "expert", 1, f"n{i}", restarts=5, superpod="sp0")
        for i in range(8)
    }
    topo = rc.Topology(members, 0, servers)
    fault = Fault(FaultKind.KILL, ("srv-3",), Tier.SESSION, 0.0)
    cold = rc.choose(fault, topo, rc.Policy(), rc.Estimates(), connected=True)
    assert cold.chosen is not None
    # no NPU free anywhere but its own, which comes back where it ran: replaced cold there
    assert cold.chosen.action is rc.ActionKind.REPLACE
    assert cold.chosen.lost == pytest.approx(1 / 8)
    shrink = next(o for o in cold.alternatives if o.action is rc.ActionKind.SHRINK)
    assert not shrink.feasible
    assert shrink.why == "no decode is faulty"
    warm = rc.Estimates(warm_pods={"expert": 1}, warm_ready={"expert": 0.7}, warm_total=1)
    plan = rc.choose(fault, topo, rc.Policy(), warm, connected=True)
    assert plan.chosen is not None
    assert plan.chosen.action is rc.ActionKind.REPLACE
    assert plan.chosen.terms == {"podDelete": 1.0, "warmReady": 0.7}
    # a warm pod of another tag is no replacement for a server
    other = rc.Estimates(warm_pods={P: 1}, warm_ready={P: 0.7})
    (replace,) = (
        o
        for o in rc.options(fault, topo, rc.Policy(), other, {"srv-3"})
        if o.action is rc.ActionKind.REPLACE
    )
    assert "warmReady" not in replace.terms
