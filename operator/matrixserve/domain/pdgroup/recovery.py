"""Recovery for a P/D group: detection over the group's view, the planner
(:mod:`matrixserve.domain.recovery`) per fault, and the plan executed with the group's own
primitive, dynamic RoCE construction (P/D-Serve §3.4, Fig. 8: "the faulty instance is logically
removed ... and one new container is added").

**Detection** (one typed :class:`~matrixserve.domain.observed.Fault` per fault, from the tiers
the view holds; the engine-side tiers are the engine stub's, docs/engine-stub.md):

| tier | seen as | fault |
|---|---|---|
| node | a member's pod on a server that is not Ready | ``node`` (every member there) |
| device status | the engine's health ``Faulty`` with a die / NPU / HBM fault | ``die``, ``npu``, ``hbm`` |
| heartbeat | the engine's health ``Faulty`` with a hang (its serving loop stopped) | ``hang`` |
| pod | the member's engine container exited (``lastState.terminated``) | ``kill`` |
| ZooKeeper session | the member's report gone, its pod running and not Ready for ``SESSION_GRACE`` (a pod never Ready in its container: the gather timeout) | ``session`` |
| staleness | its health not refreshed for 3 health intervals and 10 s (``GroupView.stale``) | ``stale`` |
| link probe | a prefill's sub-link to a decode ``Blocked`` | ``link`` |

**Execution**, by the planner's choice: ``Replace``: the instance is logically removed first
(``removed/<instance>``: out of the entrances and the decode meta, then out of the map), its pod
released (force-deleted on a server that is down: no kubelet will finish it), and once gone a new
pod of the same instance joins by dynamic RoCE construction; nobody else restarts.
``RestartInPlace``: the kubelet restarts the container; it rejoins as someone else.
``Relink``: a new map version, so the members verify their sub-links again. ``Shrink``: the
faulty decode is replaced and the last prefill is left out of the desired instances until the
decode serves again. ``RestartGroup`` (the anchors' default, ``spec.recovery.policy``): every
pod of the group deleted at once. ``MaskAndRetry``: nothing but the traffic masking the
membership already does.

**Bookkeeping**: each recovery under way is a record in ``status.recovering`` (so a fault seen
again on the next pass, or a flapping one, starts nothing new: damping); it ends ``Restored``
once every instance it took out serves again as a new incarnation (or, for ``Relink`` and
``MaskAndRetry``, serves again), or ``Failed`` after ``deadline`` and is planned for anew.
``status.lastRecovery`` is the latest record.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.rfc3339 import format as rfc3339
from matrixserve.api.rfc3339 import parse as parse_time
from matrixserve.api.status import FaultStatus, OptionStatus, RecoveryRecord
from matrixserve.domain import recovery as rc
from matrixserve.domain import scaleout as so
from matrixserve.domain.observed import Fault, FaultKind, PodView, Tier
from matrixserve.domain.pdgroup.actions import (
    Action,
    DeleteEntrance,
    DeletePod,
    ForgetLink,
    MarkRemoved,
    ReportRecovery,
    WriteRoceMap,
)
from matrixserve.domain.pdgroup.membership import GATHER_TIMEOUT_SECONDS
from matrixserve.domain.pdgroup.pods import pod_manifest, role_of
from matrixserve.domain.pdgroup.view import GroupView
from matrixserve.domain.pdgroup.warm import lone_load, warm_pod_names, warm_replacement

SESSION_GRACE_SECONDS = 10.0  # a report gone this long, its pod unready: the session is lost
DEADLINE_FACTOR = 4.0  # a recovery not done within 4x its prediction (and a minute) failed
DEADLINE_FLOOR_SECONDS = 60.0
# A relink is judged sooner: the prefill probes its sub-links again within a few seconds (the
# probe interval, at least 0.5 wall s, plus a 2 s timeout); one still blocked after this long
# was not cleared by verifying it again, and is planned for as a port that is down.
RELINK_DEADLINE_SECONDS = 15.0
FAULT_PREFIX = "fault: "  # a removal marker's reason when recovery wrote it


# --------------------------------------------------------------------------- detection
def _members(roce_map: zl.RoceMap | None) -> dict[str, zl.MapEntry]:
    if roce_map is None:
        return {}
    return {e.instance: e for e in (*roce_map.prefill, *roce_map.decode)}


def detect(view: GroupView, roce_map: zl.RoceMap | None) -> list[Fault]:
    """The faults on the map's members, one per instance (a server's: one for all of its
    members), the most telling tier first."""
    members = _members(roce_map)
    faults: list[Fault] = []
    by_node: dict[str, list[str]] = {}
    node_since: dict[str, float] = {}
    for name in sorted(members):
        instance = view.instances.get(name)
        if instance is None:
            continue
        down = [p for p in instance.pods if p.node_down_since is not None]
        if down:
            node = down[0].node or "?"
            by_node.setdefault(node, []).append(name)
            node_since[node] = min(node_since.get(node, view.now), down[0].node_down_since or 0)
            continue
        # a member draining out leaves anyway: its fault is not one to recover
        if instance.deleting or name in view.zk.removed or name in view.zk.draining:
            continue
        found = _instance_fault(view, name, members[name])
        if found is not None and not any(found.instances == f.instances for f in faults):
            faults.append(found)
    for node, names in sorted(by_node.items()):
        faults.insert(
            0,
            Fault(
                FaultKind.NODE,
                tuple(names),
                Tier.NODE,
                node_since[node],
                f"server {node} is not Ready",
                node=node,
            ),
        )
    return faults


_ENGINE_KINDS = {
    zl.EngineFaultKind.DIE: (FaultKind.DIE, Tier.DEVICE_STATUS),
    zl.EngineFaultKind.NPU: (FaultKind.NPU, Tier.DEVICE_STATUS),
    zl.EngineFaultKind.HBM: (FaultKind.HBM, Tier.DEVICE_STATUS),
    zl.EngineFaultKind.HANG: (FaultKind.HANG, Tier.HEARTBEAT),
    # a rank of a multi-pod instance gone, faulty or silent, as its leader sees it
    zl.EngineFaultKind.RANK: (FaultKind.RANK, Tier.HEARTBEAT),
}
_ENGINE_ORDER = (zl.EngineFaultKind.NPU, zl.EngineFaultKind.DIE, zl.EngineFaultKind.HBM)


def _exited(pod: PodView, report: zl.Report | None, entry: zl.MapEntry) -> float | None:
    """When the pod's engine container exited, if the member the map names has not reported
    again since (the kubelet restarts it, or is waiting to)."""
    exited = pod.last_exit_at
    if (
        exited is not None
        and (report is None or report.incarnation == entry.incarnation)
        and (pod.running_since is None or pod.running_since >= exited)
        and (report is None or report.ts <= exited)
    ):
        return exited
    return None


def _worker_kill(name: str, rank: int, worker: PodView, since: float, why: str) -> Fault:
    """A rank of a multi-pod instance whose engine exited or stopped: the instance's fault (its
    leader stops serving with it), restarted in place as that one pod (the kubelet restarts
    it; the leader re-forms around it)."""
    return Fault(
        FaultKind.KILL,
        (name,),
        Tier.POD,
        since,
        f"rank {rank} (pod {worker.name}) {why}",
        node=worker.node,
        pods=(worker.name,),
    )


def _instance_fault(view: GroupView, name: str, entry: zl.MapEntry) -> Fault | None:
    instance = view.instances[name]
    pod = instance.leader
    report = view.reports.get(name)
    health = view.zk.health.get(name)
    workers = list(enumerate(instance.pods[1:], start=1))
    # (a worker's exit counts against the leader's report: without one, the leader's own
    # tiers below say what is wrong)
    for rank, worker in workers if report is not None else []:
        exited = _exited(worker, report, entry)
        if exited is not None:
            return _worker_kill(name, rank, worker, exited, f"exited (restart {worker.restarts})")
    if health is not None and report is not None and health.incarnation == report.incarnation:
        if health.state is zl.HealthState.FAULTY and health.faults:
            ranked = sorted(
                health.faults,
                key=lambda f: _ENGINE_ORDER.index(f.kind) if f.kind in _ENGINE_ORDER else 9,
            )
            first = ranked[0]
            # (a kind of fault this operator does not know yet: the engine cannot serve)
            kind, tier = _ENGINE_KINDS.get(first.kind, (FaultKind.HANG, Tier.HEARTBEAT))
            detail = first.detail or f"{first.kind} fault"
            # The leader lost a rank whose pod is not Ready on a server that is: its engine
            # stopped (a graceful exit's session ends before the kubelet says the container
            # did): restarted in place, like an exit, not the whole instance replaced.
            stopped = [(k, w) for k, w in workers if not w.ready and w.node_down_since is None]
            if kind is FaultKind.RANK and stopped:
                rank, worker = stopped[0]
                return _worker_kill(name, rank, worker, first.since, f"stopped: {detail}")
            return Fault(kind, (name,), tier, first.since, detail, node=pod.node)
        blocked = [link for link in health.links if link.state is zl.LinkState.BLOCKED]
        if blocked:
            # The end whose device status says its port is down is the faulty one (replacing it
            # moves the link off that port); with no device saying so, the prober's.
            link = min(blocked, key=lambda link: (not link.device_down, link.since))
            end = link.down_at if link.down_at in view.instances else name
            if (
                not link.device_down
                and link.peer in view.instances
                and _blocked_from(view, link.peer) >= 2
            ):
                end = link.peer  # unanswered by one decode from several prefills: the decode
            where = f", down at {link.down_at}'s port" if link.device_down else ""
            return Fault(
                FaultKind.LINK,
                (end,),
                Tier.LINK_PROBE,
                link.since,
                f"sub-link {link.device} from {name} to {link.peer} ({link.peer_roce_ip}) "
                f"blocked{where}",
                node=view.instances[end].leader.node,
                peer=link.peer if end == name else name,
                on_device=link.device_down,
            )
        if view.stale(health):
            return Fault(
                FaultKind.STALE,
                (name,),
                Tier.STALENESS,
                health.ts + view.health_interval,
                f"health not refreshed since {rfc3339(health.ts)}",
                node=pod.node,
            )
    # The engine the map names exited: the kubelet restarts it (or is waiting to).
    exited = _exited(pod, report, entry)
    if exited is not None:
        return Fault(
            FaultKind.KILL,
            (name,),
            Tier.POD,
            exited,
            f"engine exited (restart {pod.restarts})",
            node=pod.node,
        )
    if report is None and not pod.ready and pod.running_since is not None:
        since = pod.ready_changed_at or pod.running_since
        # A pod never Ready in its container is starting (a pod recreated under a member's
        # name, its engine not registered yet): it has the gather timeout to report, as a new
        # group's have; replaced after SESSION_GRACE_SECONDS it would be replaced again, and
        # again, by an engine that takes longer than that to start.
        starting = since <= pod.running_since
        grace = GATHER_TIMEOUT_SECONDS if starting else SESSION_GRACE_SECONDS
        if view.now - since > grace and (exited is None or exited < since):
            return Fault(
                FaultKind.SESSION,
                (name,),
                Tier.SESSION,
                since,
                "its ZooKeeper registration is gone while its pod runs unready",
                node=pod.node,
            )
    return None


# --------------------------------------------------------------------------- inputs
def topology(view: GroupView, roce_map: zl.RoceMap | None) -> rc.Topology:
    members = {}
    for name in _members(roce_map):
        role = roce_map.role_of(name) if roce_map else None
        if role is None:
            continue
        instance = view.instances.get(name)
        spec = view.spec.role_spec(role)
        members[name] = rc.Member(
            name,
            role,
            spec.devices_per_instance,
            node=instance.leader.node if instance else None,
            restarts=max((p.restarts for p in instance.pods), default=0) if instance else 0,
            pods=spec.pods_per_instance,
            superpod=instance.leader.superpod if instance else None,
            pod_nodes=tuple(p.node for p in instance.pods)
            if instance and len(instance.pods) > 1
            else (),
        )
    # a group's decodes stay in one SuperPod (their pods' required affinity, pods.py)
    return rc.Topology(
        members, free_npus(view), servers(view), same_superpod=frozenset({zl.Role.DECODE})
    )


def _used(view: GroupView) -> dict[str, int]:
    """NPUs the group's own pods hold, by server (other tenants' are not visible to the
    operator: what is free errs high, and a replacement that stays unschedulable is planned for
    again)."""
    used: dict[str, int] = {}
    for pod in view.pods.values():
        if pod.node is not None and not pod.deleting:
            spec = view.spec.role_spec(role_of(pod))
            used[pod.node] = used.get(pod.node, 0) + spec.npus_per_pod
    return used


def free_npus(view: GroupView) -> int | None:
    """NPUs the schedulable servers can still give, as far as the operator sees (its own pods'
    grants subtracted). None: no servers seen."""
    if not view.nodes:
        return None
    used = _used(view)
    return sum(
        max(0, n.allocatable_npus - used.get(n.name, 0))
        for n in view.nodes.values()
        if n.ready and n.schedulable
    )


def servers(view: GroupView) -> dict[str, rc.Server] | None:
    """Each server as a new pod of the group would find it: its free NPUs, its
    SuperPod, and why the scheduler would not place a new pod of each role there, judged by
    what the operator would create (the role's pod: its node selector and tolerations). None:
    no servers seen."""
    if not view.nodes:
        return None
    used = _used(view)
    wanted = {}
    for role in (zl.Role.PREFILL, zl.Role.DECODE):
        pod = pod_manifest(
            view.namespace, view.name, view.uid, view.name, role, view.spec, view.engine
        )
        wanted[role] = (pod["spec"].get("nodeSelector") or {}, pod["spec"].get("tolerations") or [])
    return {
        n.name: rc.Server(
            n.name,
            max(0, n.allocatable_npus - used.get(n.name, 0)),
            n.labels.get(kinds.LABEL_SUPERPOD),
            {
                role: why
                for role, (selector, tolerations) in wanted.items()
                if (why := n.refuses(selector, tolerations))
            },
        )
        for n in view.nodes.values()
    }


def estimates(view: GroupView) -> rc.Estimates:
    """Each restore term, learned from the group's members where they show it: a pod's start
    (created → container running) and an engine's time to serve (its health's ``readyAfter``)."""
    # A replacement's time to serve: a member's own link + load (its readyAfter less its wait
    # for the map), plus the shortest wait for the map any member had (a lone newcomer's join;
    # a first-setup member's wait also counts the others' reports); its load as it would be
    # alone (a first setup's members shared the shared file service's bucket).
    said = [h for h in view.zk.health.values() if h.ready_after > 0]
    gathered = [h.gathered_after for h in said if 0 < h.gathered_after <= h.ready_after]
    join = min(gathered, default=0.0)
    scale = float(view.engine.time_scale)
    ready = [
        (
            h.ready_after - h.gathered_after + join
            if 0 < h.gathered_after <= h.ready_after
            else h.ready_after
        )
        - (h.phases.get(so.TE_LOAD, 0.0) - lone_load(h)) / scale
        for h in said
    ]
    # one lone load from the shared file service (wall s), what each further engine loading
    # at the same time adds (the bucket's readers share it)
    shared = [
        lone_load(h) / scale
        for h in said
        if h.load_source == so.SHARED_FILE_SERVICE and so.TE_LOAD in h.phases
    ]
    base = rc.Estimates()
    warm = {role: warm_replacement(view, role) for role in (zl.Role.PREFILL, zl.Role.DECODE)}
    return rc.Estimates(
        pod_delete=base.pod_delete,
        pod_start=view.learned_pod_start(base.pod_start),
        engine_ready=statistics.median(ready) if ready else base.engine_ready,
        shared_load=statistics.median(shared) if shared else 0.0,
        restart_backoff=0.0,
        relink=base.relink,
        retry_window=max(base.retry_window, 2 * view.health_interval),
        horizon=base.horizon,
        warm_pods={r: n for r, (n, _) in warm.items()},
        warm_ready={r: t for r, (_, t) in warm.items() if t is not None},
        warm_total=len(warm_pod_names(view)),
    )


def _backoff(view: GroupView, names: tuple[str, ...]) -> float:
    """The kubelet's back-off still ahead of a restart in place: what the kubelet says it
    waits (its CrashLoopBackOff message), else its default: none before the first restart,
    then 10 s doubling per restart, at most 300 s (kubernetes/kubernetes#133472)."""
    worst = 0.0
    for name in names:
        instance = view.instances.get(name)
        if instance is None:
            continue
        for pod in instance.pods:
            exited = pod.last_exit_at
            if pod.running_since is not None and exited is not None and pod.running_since >= exited:
                continue  # restarted already
            wait = (
                pod.restart_backoff
                if pod.restart_backoff is not None
                else 0.0
                if pod.restarts == 0
                else min(300.0, 10.0 * 2 ** (pod.restarts - 1))
            )
            elapsed = view.now - (exited or view.now)
            worst = max(worst, 0.0, wait - elapsed)
    return worst


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Record:
    """One recovery under way (or just ended), as kept in the status."""

    data: RecoveryRecord

    @property
    def instances(self) -> list[str]:
        return self.data.planned + self.data.faulty

    @property
    def action(self) -> str:
        return self.data.action

    @property
    def sacrificed(self) -> list[str]:
        return self.data.sacrificed

    @property
    def replaced(self) -> list[str]:
        """The instances it takes out to restart or replace (a shrink's given-up prefills
        are not replaced)."""
        if self.action in (rc.ActionKind.MASK_AND_RETRY, rc.ActionKind.RELINK):
            return []
        return [n for n in self.data.planned if n not in self.sacrificed]


def records(view: GroupView) -> list[Record]:
    return [Record(r) for r in view.previous.recovering or []]


def sacrificed(view: GroupView) -> set[str]:
    """Prefills a shrink under way gives up: out of the desired instances meanwhile."""
    return {n for r in records(view) if r.action == rc.ActionKind.SHRINK for n in r.sacrificed}


def _record(view: GroupView, plan: rc.Plan, incarnations: Mapping[str, str]) -> RecoveryRecord:
    fault, chosen = plan.fault, plan.chosen
    assert chosen is not None
    return RecoveryRecord(
        fault=FaultStatus(
            kind=str(fault.kind),
            instances=list(fault.instances),
            detected_by=str(fault.tier),
            at=rfc3339(fault.since),
            detail=fault.detail,
            peer=fault.peer or None,
        ),
        detected_at=rfc3339(view.now),
        detected_after_seconds=round(max(0.0, view.now - fault.since), 3),
        plan=OptionStatus.model_validate(
            chosen.as_status() | {"sacrificed": list(chosen.sacrificed)}
        ),
        alternatives=[OptionStatus.model_validate(o.as_status()) for o in plan.alternatives],
        pods_restarted=chosen.pods_restarted,
        incarnations=dict(incarnations),
        phase="InProgress",
        deferred=list(plan.deferred),
    )


def _restored(view: GroupView, roce_map: zl.RoceMap | None, record: Record) -> bool:
    members = _members(roce_map)
    action = record.action
    back = record.data.planned or record.data.faulty
    old = record.data.incarnations or {}
    for name in back:
        if name in record.sacrificed:
            continue
        entry = members.get(name)
        if entry is None or not view.current(entry) or not view.healthy(name):
            return False
        if name in view.zk.removed:
            return False
        same = bool(old.get(name)) and entry.incarnation == old[name]
        if same and action not in (rc.ActionKind.RELINK, rc.ActionKind.MASK_AND_RETRY):
            return False
        prefill = roce_map is not None and roce_map.role_of(name) is zl.Role.PREFILL
        if prefill and name not in view.zk.entrances:
            return False
    fault = record.data.fault
    if fault is not None and fault.kind == FaultKind.LINK and fault.peer:
        ends = [*(fault.instances or []), fault.peer]
        if any(_blocked(view, a, b) for a in ends for b in ends if a != b):
            return False  # the sub-link still probes blocked (a relink that did not clear it)
    return True


def _blocked_from(view: GroupView, decode: str) -> int:
    """How many prefills' current health says a sub-link to ``decode`` went unanswered."""
    return sum(
        any(
            link.peer == decode and link.state is zl.LinkState.BLOCKED and not link.device_down
            for link in health.links
        )
        for name, health in view.zk.health.items()
        if name != decode
    )


def _blocked(view: GroupView, prober: str, peer: str) -> bool:
    """Whether ``prober``'s current health says a sub-link to ``peer`` is blocked."""
    health = view.zk.health.get(prober)
    return health is not None and any(
        link.peer == peer and link.state is zl.LinkState.BLOCKED for link in health.links
    )


# --------------------------------------------------------------------------- the pass
@dataclass
class RecoveryPass:
    actions: list[Action] = field(default_factory=list)
    recovering: list[RecoveryRecord] = field(default_factory=list)
    last: RecoveryRecord | None = None
    deferred: set[str] = field(default_factory=set)  # faulty, masked, waiting under the cap
    # Instances the pass takes out of the map (a replacement's logical removal is seen by
    # membership through the removal marker; a group restart releases every pod).
    restarting_group: bool = False


def recover(view: GroupView, roce_map: zl.RoceMap | None) -> RecoveryPass:
    """Finish the recoveries that are done, then plan for each new fault (pure)."""
    last = view.previous.last_recovery
    out = RecoveryPass(last=last if last is not None and last.dump() else None)
    held: set[str] = set()  # not planned for again (damping): under recovery or given up
    replacing: set[str] = set()  # out for a replacement or restart: what the cap counts
    deferred_before = set(view.previous.deferred or [])
    relinked_in_vain = _relinked_in_vain(out.last)
    for record in records(view):
        data = record.data
        started = parse_time(data.detected_at) or view.now
        predicted = float((data.plan.predicted_restore_seconds if data.plan else None) or 0.0)
        floor = (
            RELINK_DEADLINE_SECONDS
            if record.action == rc.ActionKind.RELINK
            else DEADLINE_FLOOR_SECONDS
        )
        deadline = max(floor, DEADLINE_FACTOR * predicted)
        if _restored(view, roce_map, record):
            data = data.model_copy(
                update={
                    "phase": "Restored",
                    "restored_at": rfc3339(view.now),
                    "restored_after_seconds": round(view.now - started, 3),
                }
            )
            out.actions.append(ReportRecovery("Recovered", _summary(data, "restored"), record=data))
            out.last = data
            continue
        if view.now - started > deadline:
            data = data.model_copy(update={"phase": "Failed"})
            out.actions.append(
                ReportRecovery(
                    "RecoveryFailed",
                    _summary(data, f"not restored within {deadline:.0f} s; planning again"),
                    warning=True,
                    record=data,
                )
            )
            out.last = data
            if record.action == rc.ActionKind.RELINK:
                relinked_in_vain.update(record.data.faulty)
            continue
        out.recovering.append(data)
        held.update(record.instances)
        replacing.update(set(record.replaced))
        if record.action == rc.ActionKind.RESTART_GROUP:
            out.restarting_group = True
    if out.restarting_group or not view.zk.connected:
        return out
    faults = [f for f in detect(view, roce_map) if not set(f.instances) & held]
    if not faults:
        return out
    topo = topology(view, roce_map)
    policy = rc.Policy(view.spec.recovery.policy, view.spec.recovery.protect)
    est = estimates(view)
    members = _members(roce_map)
    for seen in faults:
        fault = dataclasses.replace(
            seen, instances=tuple(n for n in seen.instances if n not in held)
        )
        if not fault.instances:
            continue
        if fault.kind is FaultKind.LINK and set(fault.instances) <= relinked_in_vain:
            # verified again and still blocked: as a port that is down (replace that end)
            fault = dataclasses.replace(
                fault, on_device=True, detail=f"{fault.detail} (a relink did not clear it)"
            )
        est_f = est
        if fault.kind is FaultKind.KILL:
            est_f = dataclasses.replace(est, restart_backoff=_backoff(view, fault.instances))
        if fault.kind is FaultKind.NODE:
            est_f = dataclasses.replace(est, pod_delete=0.2)  # forced: nobody to wait for
        plan = rc.choose(
            fault, topo, policy, est_f, connected=view.zk.connected, in_recovery=len(replacing)
        )
        out.deferred.update(plan.deferred)
        if plan.chosen is None:
            out.deferred.update(fault.instances)
            if not set(fault.instances) <= deferred_before:  # said once, not every pass
                out.actions.append(_detected(view, fault))
                out.actions.append(ReportRecovery("RecoveryDeferred", plan.why, warning=True))
            continue
        out.actions.append(_detected(view, fault))
        incarnations = {n: members[n].incarnation for n in plan.chosen.instances if n in members}
        data = _record(view, plan, incarnations)
        out.actions.append(
            ReportRecovery("RecoveryPlanned", _summary(data, "planned"), record=data)
        )
        out.actions += execute(view, plan.chosen, fault, roce_map)
        out.recovering.append(data)
        out.last = data
        held.update(plan.chosen.instances)
        held.update(fault.instances)
        replacing.update(set(plan.chosen.instances) - set(plan.chosen.sacrificed))
        if plan.chosen.action is rc.ActionKind.RESTART_GROUP:
            out.restarting_group = True
            break
    return out


def _relinked_in_vain(last: RecoveryRecord | None) -> set[str]:
    """The instances whose latest recovery was a relink that failed (their link still blocked)."""
    if last is None or last.phase != "Failed" or last.action != rc.ActionKind.RELINK:
        return set()
    return set(last.faulty)


def _detected(view: GroupView, fault: Fault) -> ReportRecovery:
    return ReportRecovery(
        "FaultDetected",
        f"{fault.kind} fault on {', '.join(fault.instances)} (seen by {fault.tier}, "
        f"{max(0.0, view.now - fault.since):.2f} s after it): {fault.detail}",
        warning=True,
    )


def _summary(data: RecoveryRecord, what: str) -> str:
    plan = data.plan or OptionStatus()
    fault = data.fault or FaultStatus()
    text = (
        f"{plan.action} of {', '.join(plan.instances or []) or 'nothing'} "
        f"for a {fault.kind} fault on {', '.join(fault.instances or [])}: {what}"
    )
    if what == "planned":
        others = ", ".join(
            f"{o.action} {o.cost}{'' if o.feasible else ' (infeasible)'}"
            for o in data.alternatives or []
        )
        text += (
            f" (predicted {plan.predicted_restore_seconds} s, cost {plan.cost}; "
            f"considered: {others})"
        )
    if data.restored_after_seconds is not None:
        text += f" after {data.restored_after_seconds} s"
    return text


def execute(
    view: GroupView, option: rc.Option, fault: Fault, roce_map: zl.RoceMap | None
) -> list[Action]:
    """The option as the group's actions: logical removal first (ZooKeeper), pods later."""
    action = option.action
    reason = f"{FAULT_PREFIX}{fault.kind} ({fault.tier})"
    out: list[Action] = []
    if action is rc.ActionKind.RELINK and roce_map is not None:
        # The pair's link forgotten, then a new map version: both ends verify it again.
        for end in fault.instances:
            peer = fault.peer or ""
            pair = (end, peer) if roce_map.role_of(end) is zl.Role.PREFILL else (peer, end)
            if roce_map.entry(pair[0]) is not None and roce_map.entry(pair[1]) is not None:
                out.append(ForgetLink(*pair))
        relinked = zl.RoceMap(
            version=roce_map.version + 1, P=list(roce_map.prefill), D=list(roce_map.decode)
        )
        out.append(WriteRoceMap(relinked, (), (), relinked=tuple(fault.instances)))
    if action in (rc.ActionKind.REPLACE, rc.ActionKind.SHRINK):
        for name in option.instances:
            if name in option.sacrificed:
                continue  # leaves by the desired counts (scale-in)
            out.append(MarkRemoved(zl.Removal(instance=name, reason=reason, at=view.now)))
            if name in view.zk.entrances:
                out.append(DeleteEntrance(name))
    if action is rc.ActionKind.RESTART_GROUP:
        for name in sorted(view.zk.entrances):
            out.append(DeleteEntrance(name))
        for instance in view.instances.values():
            for pod in instance.pods:
                if not pod.deleting:
                    out.append(
                        DeletePod(
                            pod.name,
                            pod.uid,
                            f"{reason}: the whole group restarts (spec.recovery.policy)",
                            force=pod.node_down_since is not None,
                        )
                    )
    return out
