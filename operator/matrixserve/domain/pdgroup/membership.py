"""Who is in the group: gathering, dynamic RoCE construction, release, and opening traffic.

P/D-Serve §3.2-3.3 as stages of a level-based plan (pure; ``now`` comes with the view):

- **Gathering** (no RoCE map yet): once every desired instance has reported its RoCE IPs
  (reports == expected), write the RoCE map (v1, roles bound) and the init order. Extra
  instances (replicas lowered before the map existed) and instances that never report go.
- **Dynamic RoCE construction** (Fig. 7): a new, role-less container that has reported joins
  the map (version bump); an instance no longer desired leaves it, is marked removed and loses
  its entrance. A member that came back as someone else (moved to another server, or its engine
  restarted: a new pod IP, new RoCE IPs or a new incarnation) rejoins: its entry is replaced in
  the same way, its entrance closed, and its links count again only once verified between the
  current incarnations. Nobody else restarts.
- **Drain** (``[design]``: the paper's removal is for faults): an instance no longer
  desired first gets no new work (its entrance closed, out of the decode meta, a ``draining/``
  marker it answers by refusing new requests) and finishes the requests it holds; it leaves the
  map once its health says it holds none, or after ``DRAIN_SECONDS``, or at once if it is not
  serving anyway (nothing of it to finish). A fault's removal does not drain.
- **Release** (§3.3, in this order): an instance out of the map has its links erased, then its
  pods deleted; once they are gone its removal and drain markers are cleared.
- **Traffic**: once *every* member is healthy the decode meta (the healthy decodes) is pushed to
  the prefills and the healthy prefills become entrances; later, only healthy members get
  traffic, and while no decode serves, no prefill is an entrance (a request would be accepted
  only to fail for want of a decode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from matrixserve.api import catalog
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.domain.observed import InstanceView
from matrixserve.domain.pdgroup.actions import (
    Action,
    ClearDrain,
    ClearRemoved,
    DeleteEntrance,
    DeletePod,
    EraseInstance,
    MarkRemoved,
    SetEntrance,
    StartDrain,
    WriteDecodeMeta,
    WriteInitOrder,
    WriteRoceMap,
)
from matrixserve.domain.pdgroup.view import GroupView

GATHER_TIMEOUT_SECONDS = 300.0
# [design] The longest a draining instance keeps the group waiting for its requests to end: a
# stream of thousands of tokens lasts minutes; past this the instance leaves with what it holds.
DRAIN_SECONDS = 300.0


# --------------------------------------------------------------------------- naming
@dataclass(frozen=True)
class RoleCounts:
    """How many instances of each role the group should have."""

    prefill: int
    decode: int


def instance_name(group: str, role: zl.Role, ordinal: int) -> str:
    return f"{group}-{'p' if role is zl.Role.PREFILL else 'd'}-{ordinal}"


def desired_instances(group: str, counts: RoleCounts) -> dict[str, zl.Role]:
    out = {instance_name(group, zl.Role.PREFILL, i): zl.Role.PREFILL for i in range(counts.prefill)}
    out |= {instance_name(group, zl.Role.DECODE, i): zl.Role.DECODE for i in range(counts.decode)}
    return out


def sub_links_per_pair(spec: PDGroupSpec) -> int:
    """Sub-links of each P-D pair: one per decode die (:mod:`matrixserve.api.kvmapping`, the
    same size's k <-> k and CloudMatrix-Infer §4.3.3's mapping alike); a decode's RoCE IPs are
    one per die, two dies per NPU."""
    return spec.decode.devices_per_instance * catalog.DIES_PER_NPU


def release_pods(instance: InstanceView, reason: str) -> list[Action]:
    """Its pods deleted; forced (grace 0) on a server that is down: no kubelet will finish a
    graceful delete there, and the pod's name is wanted for its replacement."""
    return [
        DeletePod(pod.name, pod.uid, reason, force=pod.node_down_since is not None)
        for pod in instance.pods
        if not (pod.deleting and pod.node_down_since is None)
    ]


def live_instances(view: GroupView) -> dict[str, InstanceView]:
    return {n: i for n, i in view.instances.items() if not i.deleting}


# --------------------------------------------------------------------------- gathering
def gather(
    view: GroupView, desired: Mapping[str, zl.Role]
) -> tuple[list[Action], zl.RoceMap | None]:
    """Before the group has a map: its actions, and the map written now (if every desired
    instance has reported)."""
    actions: list[Action] = []
    reported = [view.reports[n] for n in desired if n in view.reports]
    known = view.previous.roce_map_version or 0
    if known:  # a formed group whose map ZooKeeper lost: its pods serve; none is released here
        return rebuild(view, desired, reported, known)
    # Extra instances (replicas lowered before the map existed) carry no traffic yet.
    for name, instance in live_instances(view).items():
        if name not in desired:
            actions += release_pods(instance, "not desired before the group formed")
        elif (
            name not in view.reports
            and view.now - view.started_at(instance.leader) > GATHER_TIMEOUT_SECONDS
        ):
            actions += release_pods(instance, "did not report its RoCE IPs in time; retrying")
    if not desired or len(reported) != len(desired):
        return actions, None
    new_map = zl.build_roce_map(reported, dict(desired), version=1)
    actions.append(WriteRoceMap(new_map, tuple(sorted(desired)), ()))
    actions.append(WriteInitOrder(zl.InitOrder(epoch=1, roceMapVersion=1)))
    return actions, new_map


def rebuild(
    view: GroupView, desired: Mapping[str, zl.Role], reported: list[zl.Report], known: int
) -> tuple[list[Action], zl.RoceMap | None]:
    """The group had a map (its status says which version) and ZooKeeper no longer has it: the
    server lost its data. The engines kept serving and report again; once every instance whose
    pod is Ready (its engine serving) has, the map is written again from those reports, its
    version continuing from the status (engines and gateway compare versions), and the init
    order with it. Instances still starting join later, by dynamic RoCE construction; nobody
    restarts."""
    serving_pods = [n for n in desired if n in view.instances and view.instances[n].ready]
    roles = {r.instance: desired[r.instance] for r in reported}
    if any(n not in view.reports for n in serving_pods) or set(roles.values()) != {
        zl.Role.PREFILL,
        zl.Role.DECODE,
    }:
        return [], None
    version = known + 1
    new_map = zl.build_roce_map(reported, roles, version=version)
    return [
        WriteRoceMap(new_map, tuple(sorted(roles)), (), rebuilt=True),
        WriteInitOrder(zl.InitOrder(epoch=version, roceMapVersion=version)),
    ], new_map


# --------------------------------------------------------------------------- dynamic RoCE construction
@dataclass(frozen=True)
class Change:
    """The map after this pass's joins and leaves."""

    actions: list[Action]
    roce_map: zl.RoceMap
    members: dict[str, zl.Role]  # the new map's members
    observed: frozenset[str]  # the map's members as ZooKeeper holds it now
    leaving: tuple[str, ...]
    draining: frozenset[str] = frozenset()  # members not desired, finishing their requests


def _as_report(entry: zl.MapEntry) -> zl.Report:
    return zl.Report(
        instance=entry.instance,
        podIP=entry.pod_ip,
        port=entry.port,
        node="",
        superpod="",
        dies=[],
        roceIps=entry.roce_ips,
        ts=0.0,
        incarnation=entry.incarnation,
        tp=entry.tp,  # kept through a new version: the peers pair its dies by it
    )


def change_map(
    view: GroupView,
    roce_map: zl.RoceMap,
    desired: Mapping[str, zl.Role],
    sacrificed: frozenset[str] = frozenset(),
) -> Change:
    """Joiners (desired, reported, not in the map, not marked removed) enter the map, rejoiners
    (members whose current report is someone else than their entry) replace their entries, and
    leavers (in the map, not desired) go, in one new version; leavers are marked removed and
    closed, rejoiners closed until they serve again."""
    zk = view.zk
    members = {e.instance: zl.Role.PREFILL for e in roce_map.prefill} | {
        e.instance: zl.Role.DECODE for e in roce_map.decode
    }
    observed = frozenset(members)
    usable = {n for n in desired if n in view.reports and n not in zk.removed}
    joining = [n for n in desired if n in usable and n not in members]
    rejoining = [
        e.instance
        for e in (*roce_map.prefill, *roce_map.decode)
        if e.instance in usable and not view.current(e)
    ]
    # Logically removed for a fault (recovery wrote the marker), or not desired any more and
    # drained: out. Not desired and not drained yet: draining (kept in the map meanwhile).
    leaving = [
        n for n in members if n in zk.removed or (n not in desired and drained(view, n, sacrificed))
    ]
    actions: list[Action] = []
    draining = frozenset(n for n in members if n not in desired and n not in leaving)
    for name in sorted(draining):
        if name not in zk.draining:
            actions.append(StartDrain(zl.Drain(instance=name, reason="scale-in", at=view.now)))
        if name in zk.entrances:
            actions.append(DeleteEntrance(name))
    for name in zk.draining:  # wanted again before it left: it takes work again
        if name in desired and name in members and name not in zk.removed:
            actions.append(ClearDrain(name))
    if joining or rejoining or leaving:
        kept = [
            e
            for e in (*roce_map.prefill, *roce_map.decode)
            if e.instance not in leaving and e.instance not in rejoining
        ]
        newcomers = [*joining, *rejoining]
        roles = {e.instance: members[e.instance] for e in kept} | {
            n: members.get(n, desired[n]) for n in newcomers
        }
        reports = [_as_report(e) for e in kept] + [view.reports[n] for n in newcomers]
        roce_map = zl.build_roce_map(reports, roles, version=roce_map.version + 1)
        actions.append(
            WriteRoceMap(
                roce_map,
                tuple(sorted(joining)),
                tuple(sorted(leaving)),
                tuple(sorted(rejoining)),
            )
        )
        for name in leaving:
            if name not in zk.removed:
                actions.append(
                    MarkRemoved(zl.Removal(instance=name, reason="scale-in", at=view.now))
                )
        for name in (*leaving, *rejoining):
            if name in zk.entrances:
                actions.append(DeleteEntrance(name))
        members = roles
    return Change(actions, roce_map, members, observed, tuple(leaving), draining)


def drained(view: GroupView, name: str, sacrificed: frozenset[str] = frozenset()) -> bool:
    """A member that is no longer desired may leave the map: its health says it drained this
    drain (``drainAt`` echoes the marker's ``at``: no clocks compared) and holds no request, or
    it has drained for ``DRAIN_SECONDS``, or there is nothing to wait for: it does not serve (a
    dead or faulty engine), its engine cannot drain (an older one: no ``load`` in its health),
    or recovery gave it up (``sacrificed``: a shrink frees its NPUs for a faulty decode now)."""
    drain = view.zk.draining.get(name)
    health = view.zk.health.get(name)
    if not view.healthy(name) or health is None or health.load is None or name in sacrificed:
        return True
    if drain is None:
        return False
    if health.draining and health.drain_at == drain.at and health.inflight == 0:
        return True
    return view.now - drain.at >= DRAIN_SECONDS


# --------------------------------------------------------------------------- release
def release(view: GroupView, desired: Mapping[str, zl.Role], change: Change) -> list[Action]:
    """Instances out of the (observed) map: erase their data, then release their pods, then
    clear the marker. An instance leaving in this pass keeps its pods until the new map is
    written. A desired instance still marked removed (scaled in, then back up) is released and
    recreated."""
    zk = view.zk
    actions: list[Action] = []
    for name, instance in view.instances.items():
        # A pod already going is left to its kubelet, unless its server is down (forced).
        stranded = any(p.node_down_since is not None for p in instance.pods)
        if instance.deleting and not stranded:
            continue
        if name in change.observed or (name in desired and name not in zk.removed):
            continue
        mine = tuple(k for k in zk.links if name in k)
        if mine:
            actions.append(EraseInstance(name, mine))
        actions += release_pods(instance, "scale-in: removed from the RoCE map")
    for name in zk.removed | set(zk.draining):  # (clears both markers)
        if name not in view.instances and name not in change.members:
            actions.append(ClearRemoved(name))
    return actions


# --------------------------------------------------------------------------- traffic
def serving(view: GroupView, entry: zl.MapEntry, draining: frozenset[str] = frozenset()) -> bool:
    """A member that may get traffic: the map names it as it is now, its engine is healthy, and
    it is not being removed or drained (``draining``: those this pass starts to drain)."""
    return (
        view.current(entry)
        and view.healthy(entry.instance)
        and entry.instance not in view.zk.removed
        and entry.instance not in view.zk.draining
        and entry.instance not in draining
    )


def open_traffic(view: GroupView, change: Change, earlier: list[Action]) -> list[Action]:
    """The decode meta and the entrances, from who serves (P/D-Serve §3.3 step 3): opened once
    every member is healthy; afterwards kept to the serving members, and closed while no decode
    serves (the gateway then refuses up front, or uses another group of the scenario)."""
    zk = view.zk
    roce_map, members = change.roce_map, change.members
    actions: list[Action] = []
    all_healthy = bool(members) and all(view.healthy(n) for n in members)
    serving_decodes = [e for e in roce_map.decode if serving(view, e, change.draining)]
    current = list(zk.decode_meta.decodes) if zk.decode_meta else []
    # Opened before: entrances now, or (ZooKeeper lost them with its data) in the last status.
    opened = bool(zk.entrances - set(change.leaving)) or (
        not zk.entrances_present and bool(view.previous.entrances)
    )
    if (opened or all_healthy) and serving_decodes != current:
        version = (zk.decode_meta.version if zk.decode_meta else 0) + 1
        actions.append(WriteDecodeMeta(zl.DecodeMeta(version=version, decodes=serving_decodes)))
    if (opened or all_healthy) and serving_decodes:
        for entry in roce_map.prefill:
            if serving(view, entry, change.draining) and entry.instance not in zk.entrances:
                actions.append(
                    SetEntrance(
                        zl.Entrance(instance=entry.instance, podIP=entry.pod_ip, port=entry.port)
                    )
                )
    closing = {a.name for a in earlier if isinstance(a, DeleteEntrance)}
    for name in sorted(zk.entrances - closing):
        member = roce_map.entry(name)
        if (
            member is None
            or not serving_decodes
            or (not serving(view, member, change.draining) and name not in change.leaving)
        ):
            actions.append(DeleteEntrance(name))
    return actions
