"""Planning a P/D group: from what is observed (pods, ZooKeeper) to idempotent actions and status.

P/D-Serve §3.2-3.3 as a level-based reconciler:

- **Gathering** (no RoCE map yet): one pod per instance; once every desired instance has reported
  its RoCE IPs (reports == expected), write the RoCE map (v1, roles bound) and the init order.
- **Setup**: engines link (device k <-> device k), load and report health; once *every* instance
  is healthy the decode meta is pushed to the prefills and the prefills become entrances.
- **Scale-out** (dynamic RoCE construction, Fig. 7): a new, role-less container reports; the map
  gains it (version bump); it links to the existing peers, loads, reports health; only then does
  the decode meta (for a decode) or the entrances (for a prefill) include it. Nobody restarts.
- **Scale-in** (§3.3, in this order): remove the instance from the map, the decode meta and the
  entrances and mark it removed; next pass, erase its links and release its pod; once the pod is
  gone, clear the marker.

Without coordination (ZooKeeper session not connected) nothing destructive is planned: only
missing pods are created. Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.domain.conditions import Condition

GATHER_TIMEOUT_SECONDS = 300.0


# --------------------------------------------------------------------------- observations
@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    role: zl.Role
    phase: str
    ready: bool
    deleting: bool
    node: str | None
    superpod: str | None
    created_at: float


@dataclass(frozen=True)
class ZkView:
    connected: bool
    reports: Mapping[str, zl.Report] = field(default_factory=dict)
    roce_map: zl.RoceMap | None = None
    init_order: zl.InitOrder | None = None
    links: Mapping[tuple[str, str], zl.Link] = field(default_factory=dict)
    health: Mapping[str, zl.Health] = field(default_factory=dict)
    decode_meta: zl.DecodeMeta | None = None
    entrances: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GroupView:
    namespace: str
    name: str
    generation: int
    spec: PDGroupSpec
    pods: Mapping[str, PodView]
    zk: ZkView
    now: float


# --------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class CreatePod:
    name: str
    role: zl.Role


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    reason: str


@dataclass(frozen=True)
class WriteRoceMap:
    roce_map: zl.RoceMap
    added: tuple[str, ...]
    removed: tuple[str, ...]


@dataclass(frozen=True)
class WriteInitOrder:
    order: zl.InitOrder


@dataclass(frozen=True)
class WriteDecodeMeta:
    meta: zl.DecodeMeta


@dataclass(frozen=True)
class SetEntrance:
    entrance: zl.Entrance


@dataclass(frozen=True)
class DeleteEntrance:
    name: str


@dataclass(frozen=True)
class MarkRemoved:
    removal: zl.Removal


@dataclass(frozen=True)
class EraseInstance:
    """Delete the instance's links (its data in the group) before its pod is released."""

    name: str
    links: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ClearRemoved:
    name: str


Action = (
    CreatePod
    | DeletePod
    | WriteRoceMap
    | WriteInitOrder
    | WriteDecodeMeta
    | SetEntrance
    | DeleteEntrance
    | MarkRemoved
    | EraseInstance
    | ClearRemoved
)


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    status: dict[str, Any]
    conditions: list[Condition]
    ready: bool


# --------------------------------------------------------------------------- naming
def instance_name(group: str, role: zl.Role, ordinal: int) -> str:
    return f"{group}-{'p' if role is zl.Role.PREFILL else 'd'}-{ordinal}"


def desired_instances(group: str, spec: PDGroupSpec) -> dict[str, zl.Role]:
    out = {
        instance_name(group, zl.Role.PREFILL, i): zl.Role.PREFILL
        for i in range(spec.prefill.replicas)
    }
    out |= {
        instance_name(group, zl.Role.DECODE, i): zl.Role.DECODE for i in range(spec.decode.replicas)
    }
    return out


def devices_k(spec: PDGroupSpec) -> int:
    """RoCE IPs per instance: one per die, two dies per NPU."""
    return spec.prefill.devices_per_instance * 2


# --------------------------------------------------------------------------- planning
def _entry(report: zl.Report) -> zl.MapEntry:
    return zl.MapEntry(
        instance=report.instance, podIP=report.pod_ip, port=report.port, roceIps=report.roce_ips
    )


def _healthy(view: GroupView, name: str) -> bool:
    health = view.zk.health.get(name)
    return health is not None and health.state is zl.HealthState.SERVING


def plan(view: GroupView) -> Plan:
    zk = view.zk
    desired = desired_instances(view.name, view.spec)
    actions: list[Action] = []
    live_pods = {n: p for n, p in view.pods.items() if not p.deleting}

    for name, role in desired.items():
        if name not in view.pods:
            actions.append(CreatePod(name, role))

    if not zk.connected:
        return _finish(view, actions, desired, zk.roce_map, blocked="ZooKeeper is not connected")

    roce_map = zk.roce_map
    if roce_map is None:
        # Gathering: extra pods (replicas lowered before the map existed) carry no traffic yet.
        for name, pod in live_pods.items():
            if name not in desired:
                actions.append(DeletePod(name, pod.uid, "not desired before the group formed"))
            elif name not in zk.reports and view.now - pod.created_at > GATHER_TIMEOUT_SECONDS:
                actions.append(
                    DeletePod(name, pod.uid, "did not report its RoCE IPs in time; retrying")
                )
        reported = [zk.reports[n] for n in desired if n in zk.reports]
        if desired and len(reported) == len(desired):
            new_map = zl.build_roce_map(reported, dict(desired), version=1)
            actions.append(WriteRoceMap(new_map, tuple(sorted(desired)), ()))
            actions.append(WriteInitOrder(zl.InitOrder(epoch=1, roceMapVersion=1)))
            roce_map = new_map
        return _finish(view, actions, desired, roce_map)

    members = {e.instance: zl.Role.PREFILL for e in roce_map.prefill} | {
        e.instance: zl.Role.DECODE for e in roce_map.decode
    }
    observed_members = set(members)  # the map as ZooKeeper holds it now
    joining = [n for n in desired if n not in members and n in zk.reports and n not in zk.removed]
    leaving = [n for n in members if n not in desired]
    if joining or leaving:
        kept = [e for e in (*roce_map.prefill, *roce_map.decode) if e.instance not in leaving]
        by_name = {e.instance: e for e in kept}
        roles = {n: members[n] for n in by_name} | {n: desired[n] for n in joining}
        reports = [
            zl.Report(
                instance=e.instance,
                podIP=e.pod_ip,
                port=e.port,
                node="",
                superpod="",
                dies=[],
                roceIps=e.roce_ips,
                ts=0.0,
            )
            for e in kept
        ] + [zk.reports[n] for n in joining]
        new_map = zl.build_roce_map(reports, roles, version=roce_map.version + 1)
        actions.append(WriteRoceMap(new_map, tuple(sorted(joining)), tuple(sorted(leaving))))
        for name in leaving:
            actions.append(MarkRemoved(zl.Removal(instance=name, reason="scale-in", at=view.now)))
            if name in zk.entrances:
                actions.append(DeleteEntrance(name))
        roce_map = new_map
        members = {n: roles[n] for n in by_name} | {n: desired[n] for n in joining}

    # Instances out of the (observed) map: erase their data, then release their pods, then clear
    # the marker. An instance leaving in this pass keeps its pod until the new map is written.
    # A desired instance still marked removed (scaled in, then back up) is released and recreated.
    for name, pod in live_pods.items():
        if name in observed_members or (name in desired and name not in zk.removed):
            continue
        mine = tuple(k for k in zk.links if name in k)
        if mine:
            actions.append(EraseInstance(name, mine))
        actions.append(DeletePod(name, pod.uid, "scale-in: removed from the RoCE map"))
    for name in zk.removed:
        if name not in view.pods and name not in members:
            actions.append(ClearRemoved(name))

    all_healthy = bool(members) and all(_healthy(view, n) for n in members)
    serving_decodes = [
        e for e in roce_map.decode if _healthy(view, e.instance) and e.instance not in zk.removed
    ]
    current = [d.instance for d in zk.decode_meta.decodes] if zk.decode_meta else []
    opened = bool(zk.entrances - set(leaving))
    if (opened or all_healthy) and [d.instance for d in serving_decodes] != current:
        version = (zk.decode_meta.version if zk.decode_meta else 0) + 1
        actions.append(WriteDecodeMeta(zl.DecodeMeta(version=version, decodes=serving_decodes)))
    if (opened or all_healthy) and serving_decodes:
        for entry in roce_map.prefill:
            if _healthy(view, entry.instance) and entry.instance not in zk.entrances:
                actions.append(
                    SetEntrance(
                        zl.Entrance(instance=entry.instance, podIP=entry.pod_ip, port=entry.port)
                    )
                )
    already = {a.name for a in actions if isinstance(a, DeleteEntrance)}
    for name in zk.entrances - already:
        if name not in members or (not _healthy(view, name) and name not in leaving):
            actions.append(DeleteEntrance(name))
    return _finish(view, actions, desired, roce_map)


# --------------------------------------------------------------------------- status
@dataclass(frozen=True)
class InstanceRow:
    name: str
    role: str
    pod: str
    node: str
    superpod: str
    roce_ips: tuple[str, ...]
    state: str
    endpoint: str = ""  # podIP:port of its engine, as reported (the gateway's fallback route)

    def to_status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "pod": self.pod,
            "node": self.node,
            "superpod": self.superpod,
            "roceIps": list(self.roce_ips),
            "state": self.state,
            "endpoint": self.endpoint,
        }


def _instance_state(view: GroupView, name: str, roce_map: zl.RoceMap | None) -> str:
    pod = view.pods.get(name)
    if pod is None:
        return "Pending"
    if pod.deleting:
        return "Terminating"
    if name in view.zk.removed:
        return "Removing"
    if name not in view.zk.reports:
        return "Starting"
    if roce_map is None or roce_map.role_of(name) is None:
        return "Joining"
    health = view.zk.health.get(name)
    if health is None:
        return "Initializing"
    if health.state is not zl.HealthState.SERVING:
        return "Degraded"
    return "Serving" if pod.ready else "Initializing"  # what kubectl shows agrees with the group


def _finish(
    view: GroupView,
    actions: list[Action],
    desired: Mapping[str, zl.Role],
    roce_map: zl.RoceMap | None,
    blocked: str | None = None,
) -> Plan:
    zk = view.zk
    spec = view.spec
    names = sorted(
        set(desired)
        | set(view.pods)
        | ({e.instance for e in (*roce_map.prefill, *roce_map.decode)} if roce_map else set())
    )
    instances: list[InstanceRow] = []
    for name in names:
        report = zk.reports.get(name)
        pod = view.pods.get(name)
        role = (
            desired.get(name)
            or (roce_map.role_of(name) if roce_map else None)
            or (pod.role if pod else None)
        )
        instances.append(
            InstanceRow(
                name=name,
                role="prefill" if role is zl.Role.PREFILL else "decode",
                pod=name if pod else "",
                node=(pod.node or "") if pod else "",
                superpod=(pod.superpod or "") if pod else "",
                roce_ips=tuple(report.roce_ips) if report else (),
                state=_instance_state(view, name, roce_map),
                endpoint=f"{report.pod_ip}:{report.port}" if report else "",
            )
        )
    serving = {i.name for i in instances if i.state == "Serving"}
    n_p = sum(1 for n, r in desired.items() if r is zl.Role.PREFILL)
    n_d = len(desired) - n_p
    ready_p = sum(1 for n in serving if desired.get(n) is zl.Role.PREFILL)
    ready_d = sum(1 for n in serving if desired.get(n) is zl.Role.DECODE)
    k = devices_k(spec)
    members_p = [e.instance for e in roce_map.prefill] if roce_map else []
    members_d = [e.instance for e in roce_map.decode] if roce_map else []
    expected_links = len(members_p) * len(members_d) * k
    verified = sum(
        len(link.sub_links)
        for (p, d), link in zk.links.items()
        if p in members_p and d in members_d
    )
    entrances = sorted(zk.entrances)
    reported = sum(1 for n in desired if n in zk.reports)
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
        i.name
        for i in instances
        if i.state in ("Initializing", "Degraded") and i.name in (members_p + members_d)
    )
    degraded = bool(zk.entrances) and bool(unhealthy)
    conditions = [
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
            roce_map is not None and expected_links > 0 and verified == expected_links,
            "LinksVerified"
            if roce_map is not None and verified == expected_links and expected_links
            else "LinksPending",
            f"{verified}/{expected_links} sub-links verified",
        ),
        Condition(
            "Progressing",
            not ready,
            "Stable"
            if ready
            else ("Blocked" if blocked else ("Gathering" if roce_map is None else "Converging")),
            blocked
            or ("" if ready else f"{len(serving & set(desired))}/{len(desired)} instances serving"),
        ),
        Condition(
            "Degraded", degraded, "InstanceUnhealthy" if degraded else "AsExpected", unhealthy
        ),
        Condition(
            "Ready",
            ready,
            "Ready" if ready else ("Blocked" if blocked else "SettingUp"),
            "every instance serving, links verified, prefills open"
            if ready
            else (blocked or f"{len(serving & set(desired))}/{len(desired)} instances serving"),
        ),
    ]
    status = {
        "observedGeneration": view.generation,
        "selector": f"matrixserve.io/group={view.name},matrixserve.io/role=decode",
        "prefill": {"replicas": n_p, "ready": ready_p, "summary": f"{ready_p}/{n_p}"},
        "decode": {"replicas": n_d, "ready": ready_d, "summary": f"{ready_d}/{n_d}"},
        "instances": [i.to_status() for i in instances],
        "roceMapVersion": roce_map.version if roce_map else 0,
        "links": {
            "expected": expected_links,
            "verified": verified,
            "summary": f"{verified}/{expected_links}",
        },
        "entrances": entrances,
        "ratio": {
            "current": f"{ready_p}:{ready_d}",
            "target": f"{n_p}:{n_d}",
            "reason": f"{spec.ratio_policy.mode} policy",
        },
    }
    return Plan(actions, status, conditions, ready)
