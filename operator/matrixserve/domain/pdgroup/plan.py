"""Planning a P/D group: from the view to idempotent actions and status (pure).

The stages, in order (P/D-Serve §3.2-3.4):

1. **Desired counts** — seam ``Seams.ratio``: how many prefill and decode instances the group
   should have: the spec's replicas under the ``Fixed`` policy; under ``Model`` and
   ``Feedback`` the replicas' total, split by the policy and walked to one instance at a time
   (:mod:`.split`), which also says ``status.ratio`` and a change's Event.
2. **Obtaining instances** — seam ``Seams.obtain``: how the missing instances' pods come to be
   (all of this pass's at once): a warm pod claimed (loading by NPU-fork, DRAM, SSD or the
   shared file service) where faster by estimate, else a cold start (a new role-less pod)
   (:mod:`.obtain`); each claimed pod's assignment follows.
3. Without coordination (ZooKeeper session not connected) nothing destructive is planned: only
   missing pods are obtained; the status keeps what was last known (entrances, map version,
   instances: the gateway routes by it) and says ``Coordinated=False`` since when. The same
   status is kept while a group whose server lost its data is rebuilt (``Rebuilding``).
4. **Faults** — seam ``Seams.faults``: detection and minimum-cost recovery
   (:mod:`.recovery`): the records of recoveries under way, each new fault's plan, and
   its first actions (a logical removal, a relink, a group restart). A shrink under way leaves
   its prefill out of the desired instances.
5. **Membership** (:mod:`.membership`): gathering, or the map's joins and leaves by dynamic RoCE
   construction, the release of instances out of the map, then the decode meta and entrances.
6. **Status** (:mod:`.status`): conditions, instance rows, links, ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec, RatioMode
from matrixserve.api.status import PDGroupStatus, RatioStatus
from matrixserve.domain.conditions import Condition, seconds_since
from matrixserve.domain.pdgroup import gang, membership, recovery, split, status
from matrixserve.domain.pdgroup.actions import Action, DeletePod
from matrixserve.domain.pdgroup.membership import RoleCounts
from matrixserve.domain.pdgroup.obtain import (
    assignments,
    last_scale,
    missing_pods,
    warm_or_cold,
)
from matrixserve.domain.pdgroup.pods import pod_names
from matrixserve.domain.pdgroup.view import GroupView


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    status: PDGroupStatus
    conditions: list[Condition]
    ready: bool
    # Seconds until this plan is due to change with nothing else happening (None: on a change).
    recheck_after: float | None = None

    def stored_status(self) -> dict[str, Any]:
        return self.status.dump()


# --------------------------------------------------------------------------- today's seams
def counts(view: GroupView, seams: Seams | None = None) -> RoleCounts:
    """This pass's desired counts (the ratio seam's)."""
    return (seams or TODAY).ratio(view).counts


def spec_pod_names(group: str, spec: PDGroupSpec) -> list[str]:
    """The pod names the spec's replicas ask for (to see whether another owner holds one)."""
    desired = membership.desired_instances(
        group, RoleCounts(spec.prefill.replicas, spec.decode.replicas)
    )
    return [
        pod
        for instance, role in desired.items()
        for pod in pod_names(instance, spec.role_spec(role).pods_per_instance)
    ]


def warm_needed(view: GroupView, seams: Seams | None = None) -> tuple[bool, list[str]]:
    """What this pass must read of the warm pods: whether an instance is missing a
    pod (the warm pods and fork sources are then read), and the claimed pods that have not
    reported (their assignments are then read)."""
    desired = membership.desired_instances(view.name, counts(view, seams))
    missing = any(missing_pods(view, n, r) for n, r in desired.items())
    waiting = [
        p.name
        for p in view.pods.values()
        if view.claimed(p) and p.label(kinds.LABEL_INSTANCE) not in view.reports
    ]
    return missing, waiting


def no_faults(view: GroupView, roce_map: zl.RoceMap | None) -> recovery.RecoveryPass:
    return recovery.RecoveryPass()


@dataclass(frozen=True)
class Seams:
    """Where the ratio policy, the scale-out path and recovery plug into the plan."""

    ratio: Callable[[GroupView], split.RatioPass] = split.ratio_pass
    # All the instances missing a pod this pass at once, so one source (a warm pod, a fork
    # peer) is never promised to two of them.
    obtain: Callable[[GroupView, Mapping[str, zl.Role]], list[Action]] = warm_or_cold
    faults: Callable[[GroupView, zl.RoceMap | None], recovery.RecoveryPass] = recovery.recover


TODAY = Seams()


REBUILDING = (
    "ZooKeeper lost the group's data: rebuilding it from the engines' reports (they keep "
    "serving; the status is the last known until the prefills are entrances again)"
)


REBUILD_HOLD_SECONDS = 30.0  # the bound required for Ready after data loss


def rebuilding(view: GroupView) -> bool:
    """The group had served (its status lists entrances) and ZooKeeper has no entrances folder
    for it: the server lost its data and the entrances are not back yet. Held for at most
    ``REBUILD_HOLD_SECONDS``: a group that cannot open again (a member down) then says so."""
    zk = view.zk
    if not (
        zk.connected
        and not zk.entrances_present
        and bool(view.previous.roce_map_version)
        and bool(view.previous.entrances)
    ):
        return False
    held = view.previous.condition(status.COORDINATED)
    if held is None or held.reason != "Rebuilding":
        return True
    since = seconds_since(held.last_transition_time, view.now)
    return since is None or since < REBUILD_HOLD_SECONDS


# --------------------------------------------------------------------------- the plan
def plan(view: GroupView, seams: Seams = TODAY) -> Plan:
    ratio = seams.ratio(view)
    desired = membership.desired_instances(view.name, ratio.counts)
    sacrificed = frozenset(recovery.sacrificed(view))
    for name in sacrificed:  # a shrink under way gives up its prefill
        desired.pop(name, None)
    rebuilding_now = rebuilding(view)
    healing = (
        seams.faults(view, view.zk.roce_map)
        if view.zk.connected and not rebuilding_now
        else recovery.RecoveryPass()
    )
    actions, roce_map, blocked = _actions(view, seams, desired, healing, sacrificed)
    actions += status.trouble_notices(view, desired)
    if blocked:
        held = status.hold(view, desired, blocked)
    elif rebuilding_now:
        held = status.hold(view, desired, REBUILDING, reason="Rebuilding")
    else:
        held = None
    derived = held or status.derive(view, actions, desired, roce_map, blocked)
    conditions = derived.conditions
    out = derived.status
    if held is None:
        serving = out.ratio.current if out.ratio is not None else None
        out = out.model_copy(
            update={
                "recovering": healing.recovering,
                "last_recovery": healing.last,
                "deferred": sorted(healing.deferred),
                "last_scale": last_scale(view),
                "ratio": ratio.status.model_copy(update={"current": serving}),
            }
        )
        actions += ratio.notices  # said once: the next pass reads the new target
        conditions = status.recovering(conditions, healing.recovering)
    ready = derived.ready and not healing.recovering
    recheck = _recheck_after(view, ratio.status) if held is None else None
    return Plan(actions, out, conditions, ready, recheck_after=recheck)


def _recheck_after(view: GroupView, ratio: RatioStatus) -> float | None:
    """Seconds until this plan is due to change with nothing else happening: the ratio
    policy's window ends (its decision is taken then, not at the next resync). From this pass's
    ratio stage, which starts a new window once one is due: a window that would be due already
    asks nothing (a held status keeps an old one: no pass every instant while ZooKeeper is
    away)."""
    window = ratio.window
    policy = view.spec.ratio_policy
    if policy.mode is RatioMode.FIXED or window is None or window.start is None:
        return None
    due = float(window.start) + policy.window_seconds - view.now
    return due if due > 0 else None


def _actions(
    view: GroupView,
    seams: Seams,
    desired: dict[str, zl.Role],
    healing: recovery.RecoveryPass,
    sacrificed: frozenset[str] = frozenset(),
) -> tuple[list[Action], zl.RoceMap | None, str | None]:
    """This pass's actions, the RoCE map after them, and why the plan is blocked (if it is)."""
    zk = view.zk
    missing = {n: r for n, r in desired.items() if missing_pods(view, n, r)}
    actions: list[Action] = seams.obtain(view, missing) if missing else []
    actions += gang.lift(view)
    if not zk.connected:
        return actions, zk.roce_map, "ZooKeeper is not connected"
    actions += gang.overdue(view)
    actions += assignments(view)
    actions += healing.actions
    if healing.restarting_group and any(isinstance(a, DeletePod) for a in healing.actions):
        return actions, zk.roce_map, None  # this pass deletes every pod: nothing else
    if zk.roce_map is None:
        gathered, roce_map = membership.gather(view, desired)
        return actions + gathered, roce_map, None
    change = membership.change_map(view, zk.roce_map, desired, sacrificed)
    actions += change.actions
    actions += membership.release(view, desired, change)
    actions += membership.open_traffic(view, change, actions)
    return actions, change.roce_map, None
