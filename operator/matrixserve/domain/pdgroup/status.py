"""The PDGroup's status, derived from what was observed and what this pass plans (pure).

Ready means the group serves what its spec asks: every desired instance serving (the map names
it as it is now, its current engine healthy in ZooKeeper, its pods Ready), exactly n_p·n_d·K_d
sub-links verified between the members' current incarnations (P/D-Serve §3.2; one per decode
die for each pair, :mod:`matrixserve.api.kvmapping`), every prefill an
entrance and the decode meta complete; and nothing left to change this pass.
The conditions follow the Kubernetes conventions (``matrixserve.domain.conditions``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.status import (
    InstanceStatus,
    LinksStatus,
    OptionStatus,
    PDGroupStatus,
    RatioStatus,
    RecoveryRecord,
    RoleStatus,
    Split,
)
from matrixserve.domain.conditions import Condition
from matrixserve.domain.enginepod import FIRST_PROBE_GRACE_SECONDS
from matrixserve.domain.pdgroup import gang
from matrixserve.domain.pdgroup.actions import (
    Action,
    CreatePod,
    DeletePod,
    ReportPodTrouble,
    WriteRoceMap,
)
from matrixserve.domain.pdgroup.membership import sub_links_per_pair
from matrixserve.domain.pdgroup.pods import role_of
from matrixserve.domain.pdgroup.view import GroupView


@dataclass(frozen=True)
class GroupStatus:
    status: PDGroupStatus
    conditions: list[Condition]
    ready: bool


def instance_state(view: GroupView, name: str, roce_map: zl.RoceMap | None) -> str:
    instance = view.instances.get(name)
    if instance is None:
        return "Pending"
    if instance.deleting:
        return "Terminating"
    if name in view.zk.removed:
        return "Removing"
    report = view.reports.get(name)
    if report is None:
        return "Starting"
    entry = roce_map.entry(name) if roce_map is not None else None
    if entry is None or not view.current(entry):
        return "Joining"
    health = view.zk.health.get(name)
    if health is None or health.incarnation != report.incarnation:
        return "Initializing"
    if health.state is not zl.HealthState.SERVING:
        return "Degraded"
    # What kubectl shows agrees with the group: a pod the kubelet found unready is not serving
    # (a killed engine is seen there first); one not probed yet since its engine started is,
    # for as long as its first readiness probe may take once the engine serves.
    if instance.ready:
        return "Serving"
    probe_due = serving_since(view, health) + FIRST_PROBE_GRACE_SECONDS
    return "Serving" if view.now <= probe_due and instance.serving(report.ts) else "Initializing"


def serving_since(view: GroupView, health: zl.Health) -> float:
    """When the engine began serving, at the latest: it writes its health once it serves, then
    once a health interval (and on changes: more often, so this errs early, never late)."""
    interval = float(view.engine.health_interval_seconds) / float(view.engine.time_scale)
    return health.ts - (health.seq - 1) * interval


def said(view: GroupView, name: str) -> str:
    """The instance, with why its engine says it does not serve (its health's message) when it
    says so (an attention client whose expert pool is gone, slots held without progress)."""
    health = view.zk.health.get(name)
    if health is not None and health.state is not zl.HealthState.SERVING and health.message:
        return f"{name}: {health.message}"
    return name


def instance_rows(
    view: GroupView, desired: Mapping[str, zl.Role], roce_map: zl.RoceMap | None
) -> list[InstanceStatus]:
    """One row per instance that is desired, has pods, or is in the map."""
    in_map = {e.instance for e in (*roce_map.prefill, *roce_map.decode)} if roce_map else set()
    rows = []
    for name in sorted(set(desired) | set(view.instances) | in_map):
        report = view.reports.get(name)
        instance = view.instances.get(name)
        pod = instance.leader if instance else None
        several = instance is not None and len(instance.pods) > 1
        role = (
            desired.get(name)
            or (roce_map.role_of(name) if roce_map else None)
            or (role_of(pod) if pod else None)
        )
        rows.append(
            InstanceStatus(
                name=name,
                role="prefill" if role is zl.Role.PREFILL else "decode",
                pod=pod.name if pod else "",
                node=(pod.node or "") if pod else "",
                superpod=(pod.superpod or "") if pod else "",
                roce_ips=list(report.roce_ips) if report else [],
                state=instance_state(view, name, roce_map),
                endpoint=f"{report.pod_ip}:{report.port}" if report else "",
                pods=[p.name for p in instance.pods] if instance and several else None,
                servers=[gang.server_of(p) or "" for p in instance.pods]
                if instance and several
                else None,
                kv_plane=(pod.annotations.get(kinds.ANNOTATION_KV_PLANE) or "RoCE") if pod else "",
            )
        )
    return rows


def troubles(view: GroupView, desired: Mapping[str, zl.Role]) -> dict[str, tuple[str, str]]:
    """The desired instances' pods that cannot run, and why (the scheduler's or kubelet's
    reason and message, or a pod of another owner holding the name), by pod name."""
    found = {
        pod.name: pod.trouble
        for name in desired
        if (instance := view.instances.get(name)) is not None
        for pod in instance.pods
        if pod.trouble is not None and not pod.deleting
    }
    for waiting, why in gang.waiting(view, desired).items():
        found[waiting] = (gang.UNPLACEABLE, f"not placed whole, holding no NPU: {why}")
    for pod, owner in view.foreign.items():
        found[pod] = (
            "PodNameTaken",
            f"a pod of this name exists and is not this group's ({owner}): delete or rename it",
        )
    return found


def trouble_notices(view: GroupView, desired: Mapping[str, zl.Role]) -> list[Action]:
    """A Warning Event for each pod that cannot run, every pass it lasts (the applier posts a
    notice once while it holds)."""
    return [
        ReportPodTrouble(pod, reason, message)
        for pod, (reason, message) in sorted(troubles(view, desired).items())
    ]


def current_sub_links(view: GroupView, roce_map: zl.RoceMap | None) -> int:
    """Sub-links verified between the map's members as they are now: a link made with an
    earlier incarnation, or for other RoCE IPs, proves nothing."""
    if roce_map is None:
        return 0
    total = 0
    for p in roce_map.prefill:
        for d in roce_map.decode:
            link = view.zk.links.get((p.instance, d.instance))
            if link is not None and view.current(p) and view.current(d) and link.joins(p, d):
                total += len(link.sub_links)
    return total


COORDINATED = "Coordinated"


def coordinated(blocked: str | None, reason: str = "ZooKeeperUnreachable") -> Condition:
    if blocked is None:
        return Condition(COORDINATED, True, "Connected", "ZooKeeper session connected")
    return Condition(COORDINATED, False, reason, blocked)


def _reason(status: PDGroupStatus, kind: str) -> str | None:
    found = status.condition(kind)
    return found.reason if found is not None else None


def _kept(status: PDGroupStatus) -> bool:
    """The status has what the gateway routes by and ``kubectl`` shows of the members."""
    return all(
        part is not None
        for part in (
            status.roce_map_version,
            status.links,
            status.instances,
            status.entrances,
            status.prefill,
            status.decode,
        )
    )


def hold(
    view: GroupView,
    desired: Mapping[str, zl.Role],
    blocked: str,
    reason: str = "ZooKeeperUnreachable",
) -> GroupStatus | None:
    """The last known status, kept while ZooKeeper cannot say better (out of reach, or the
    group's data being rebuilt after the server lost it), as the engines keep serving and the
    gateway routes by it: the ``Coordinated`` condition says since when (its
    ``lastTransitionTime``). What Kubernetes shows still counts: a member whose pod is gone or
    not Ready makes ``Ready`` False. None when there is no complete status to keep (nothing
    known yet, or only an ``InvalidSpec`` one)."""
    previous = view.previous
    if not _kept(previous) or _reason(previous, "Ready") == "InvalidSpec":
        return None
    conditions = [
        Condition(c.type, c.true, c.reason or "", c.message or "")
        for c in previous.conditions or []
        if c.type not in (COORDINATED, "Ready")
    ]
    ready = previous.is_true("Ready")
    down = sorted(
        name
        for name in desired
        if (instance := view.instances.get(name)) is None or instance.deleting or not instance.ready
    )
    if ready and down:
        ready_condition = Condition(
            "Ready", False, reason, f"{', '.join(down)} not Ready; {blocked}"
        )
    else:
        old = previous.condition("Ready")
        ready_condition = Condition(
            "Ready",
            ready,
            old.reason if old is not None and old.reason is not None else reason,
            old.message if old is not None and old.message is not None else blocked,
        )
    return GroupStatus(
        previous.without_conditions(),
        [*conditions, ready_condition, coordinated(blocked, reason)],
        ready and not down,
    )


def derive(
    view: GroupView,
    actions: Sequence[Action],
    desired: Mapping[str, zl.Role],
    roce_map: zl.RoceMap | None,
    blocked: str | None = None,
) -> GroupStatus:
    """Status, conditions and readiness after this pass (``blocked``: why nothing but pod
    creation could be planned)."""
    zk = view.zk
    rows = instance_rows(view, desired, roce_map)
    serving = {i.name for i in rows if i.state == "Serving"}
    n_p = sum(1 for r in desired.values() if r is zl.Role.PREFILL)
    n_d = len(desired) - n_p
    ready_p = sum(1 for n in serving if desired.get(n) is zl.Role.PREFILL)
    ready_d = sum(1 for n in serving if desired.get(n) is zl.Role.DECODE)
    members_p = [e.instance for e in roce_map.prefill] if roce_map else []
    members_d = [e.instance for e in roce_map.decode] if roce_map else []
    expected_links = len(members_p) * len(members_d) * sub_links_per_pair(view.spec)
    verified = current_sub_links(view, roce_map)
    entrances = sorted(zk.entrances)
    stable = set(members_p) | set(members_d) == set(desired) and not any(
        isinstance(a, CreatePod | DeletePod | WriteRoceMap) for a in actions
    )
    ready = (
        blocked is None
        and roce_map is not None
        and n_p >= 1
        and n_d >= 1
        and stable
        and serving >= set(desired)
        and verified == expected_links
        and set(entrances) == set(members_p)
        and zk.decode_meta is not None
        and {d.instance for d in zk.decode_meta.decodes} == set(members_d)
    )
    unhealthy = ", ".join(
        said(view, i.name)
        for i in rows
        if i.state in ("Initializing", "Degraded", "Joining") and i.name in (members_p + members_d)
    )
    progress = f"{len(serving & set(desired))}/{len(desired)} instances serving"
    stuck = troubles(view, desired)
    if stuck:  # say why, in the scheduler's or the kubelet's words
        progress += "; " + "; ".join(
            f"{pod}: {message}" for pod, (_, message) in sorted(stuck.items())
        )
    stuck_reason = stuck[min(stuck)][0] if stuck else None
    reported = sum(1 for n in desired if n in view.reports)
    linked = roce_map is not None and expected_links > 0 and verified == expected_links
    # The group has served (its entrances opened, now or in its last status, or it is degraded
    # already) and now cannot as it should; during the first setup it is only SettingUp.
    opened = zk.decode_meta is not None and (
        bool(zk.entrances) or bool(view.previous.entrances) or view.previous.is_true("Degraded")
    )
    no_decode = opened and bool(members_d) and not (serving & set(members_d))
    # Recovering, not SettingUp: an instance that served (the last status says so)
    # and is wanted serves no more, until the group is Ready again; a scale-out sets up
    was_serving = {i.name for i in view.previous.instances or [] if i.state == "Serving"}
    recovering_now = opened and (
        bool((was_serving & set(desired)) - serving)
        or _reason(view.previous, "Ready") == "Recovering"
    )
    degraded = opened and (bool(unhealthy) or no_decode)
    if no_decode:
        decodes = ", ".join(
            said(view, n) for n in members_d if said(view, n) != n
        )  # in their engines' words, where they said why
        why_degraded = (
            "NoServingDecode",
            "no decode instance serves: the entrances are closed"
            + (f" ({decodes})" if decodes else ""),
        )
    else:
        why_degraded = ("InstanceUnhealthy" if degraded else "AsExpected", unhealthy)
    conditions = [
        coordinated(blocked),
        Condition(
            "Gathering",
            roce_map is None,
            "Gathering" if roce_map is None else "Gathered",
            f"{reported}/{len(desired)} instances reported their RoCE IPs"
            if roce_map is None
            else f"RoCE map v{roce_map.version}",
        ),
        Condition(
            "Linked",
            linked,
            "LinksVerified" if linked else "LinksPending",
            f"{verified}/{expected_links} sub-links verified",
        ),
        Condition(
            "Progressing",
            not ready,
            "Stable"
            if ready
            else (
                "Blocked"
                if blocked
                else stuck_reason or ("Gathering" if roce_map is None else "Converging")
            ),
            blocked or ("" if ready else progress),
        ),
        Condition("Degraded", degraded, *why_degraded),
        Condition(
            "Ready",
            ready,
            "Ready"
            if ready
            else (
                "Blocked"
                if blocked
                else (
                    "NoServingDecode"
                    if no_decode
                    else stuck_reason or ("Recovering" if recovering_now else "SettingUp")
                )
            ),
            "every instance serving, links verified, prefills open"
            if ready
            else (blocked or progress),
        ),
    ]
    status = PDGroupStatus(
        observed_generation=view.generation,
        selector=f"{kinds.LABEL_GROUP}={view.name},{kinds.LABEL_ROLE}=decode",
        prefill=RoleStatus(replicas=n_p, ready=ready_p, summary=f"{ready_p}/{n_p}"),
        decode=RoleStatus(replicas=n_d, ready=ready_d, summary=f"{ready_d}/{n_d}"),
        instances=rows,
        roce_map_version=roce_map.version if roce_map else 0,
        links=LinksStatus(
            expected=expected_links, verified=verified, summary=f"{verified}/{expected_links}"
        ),
        entrances=entrances,
        ratio=RatioStatus(
            current=Split(ready_p, ready_d),
            target=Split(n_p, n_d),
            reason=f"{view.spec.ratio_policy.mode} policy",
        ),
    )
    return GroupStatus(status, conditions, ready)


def recovering(
    conditions: Sequence[Condition], records: Sequence[RecoveryRecord]
) -> list[Condition]:
    """``Degraded`` while a recovery is under way (capacity short), saying which; a
    ``Ready=False`` that would say ``SettingUp`` says ``Recovering`` then."""
    if not records:
        return list(conditions)
    what = "; ".join(_under_way(r) for r in records)

    def during(c: Condition) -> Condition:
        if c.type == "Degraded":
            return Condition("Degraded", True, "Recovering", what)
        if c.type == "Ready" and not c.status and c.reason == "SettingUp":
            return Condition("Ready", False, "Recovering", f"{c.message}; recovering: {what}")
        return c

    return [during(c) for c in conditions]


def _under_way(record: RecoveryRecord) -> str:
    plan = record.plan or OptionStatus()
    kind = record.fault.kind if record.fault is not None else None
    return (
        f"{plan.action} of {', '.join(plan.instances or []) or 'nothing'} for a {kind} fault "
        f"(predicted {plan.predicted_restore_seconds} s)"
    )
