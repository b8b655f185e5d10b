"""Gang placement of the instances that span servers (pure).

CloudMatrix-Infer serves DeepSeek-R1 with prefill instances of 16 NPUs on 2 servers (EP32) and a
decode instance of 160 NPUs on 20 servers (EP320) (§4.1, §5.1; notes 001 §2.2-2.4). Such an
instance serves only whole: a pod bound alone holds NPUs for nothing, and may keep another
instance from fitting (the reason LeaderWorkerSet, Grove and RBG gang-place). Its pods are all in
one SuperPod: the tightly coupled block the UB fabric joins (001 §6.1.2).

The operator places such an instance itself, with what every current control plane has:

1. **reserve**: :func:`matrixserve.domain.placement.place` picks one server per pod, all in one
   SuperPod (a decode in its group's decodes' SuperPod: required; a prefill prefers it, so that
   its KV moves on UB), from the servers' allocatable NPUs less what every pod holds or has
   reserved (the cluster's, or the watched namespaces' when the operator watches some); the pods are created with the scheduling gate :data:`kinds.GANG_GATE`
   (the scheduler leaves a gated pod alone: Pod scheduling readiness, GA since Kubernetes 1.30)
   and pinned to their server by ``nodeSelector`` ``matrixserve.io/server`` (the scheduler still
   checks the fit: NPUs, taints, readiness). A gated pod holds no NPU; the operator counts it
   as its server's reservation;
2. **lift**: once every pod of the instance exists, all their gates are lifted in one pass;
3. **bound**: pods of an instance not all running within :data:`GANG_BOUND_SECONDS` of the
   newest one's creation (a server taken meanwhile by a pod the reservation did not see, a
   server gone) are deleted together and placed again: no half instance holds NPUs longer than
   the bound plus one pass.

An instance that no SuperPod can hold now waits, creating nothing, its reason naming the free
NPUs per SuperPod (status ``Progressing``/``Ready`` reason ``Unplaceable``, a Warning Event).

Why not the scheduler's own pod-group support: gang scheduling by the ``Workload``/``PodGroup``
API (KEP-4671, ``scheduling.k8s.io``, alpha since 1.35 and still an alpha API version in 1.37) is
served only with the ``GenericWorkload`` feature gate and the alpha API group turned on, off by
default, so most clusters a platform runs on do not have it; scheduling gates work on all. And the
placement here chooses by an allocation target (packing to limit SuperPod fragmentation,
pairing prefills with decodes), which a gang scheduler alone does not.

Single-pod instances keep the scheduler's own placement (their SuperPod affinity,
:mod:`.pods`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.domain import placement
from matrixserve.domain.observed import NodeView, PodView
from matrixserve.domain.pdgroup.actions import Action, DeletePod, UngatePod
from matrixserve.domain.pdgroup.pods import Seat, pod_manifest, pod_names, role_of
from matrixserve.domain.pdgroup.view import GroupView

GANG_BOUND_SECONDS = 60.0  # an instance's pods all running within this, or all released
UNPLACEABLE = "Unplaceable"


@dataclass(frozen=True)
class SeatPlan:
    """Where each missing pod of the multi-pod instances goes, and why an instance waits."""

    seats: Mapping[str, Seat]  # pod name -> its seat
    waiting: Mapping[str, str]  # instance -> why none of its pods is created


def needs_servers(spec: PDGroupSpec, pods: Iterable[PodView]) -> bool:
    """Whether a pass must read the servers and what the cluster's pods hold, to place the pods
    of a multi-pod instance: one of a multi-pod role's pods is gated or not running, one of its
    instances lacks a pod, or the role has fewer instances than its replicas (under a ratio
    policy, more may be wanted: a pass that finds an instance missing reads them then). The
    pods of single-pod roles never make it read them."""
    multi = {role: spec.role_spec(role) for role in zl.Role}
    multi = {role: r for role, r in multi.items() if r.pods_per_instance > 1}
    counts: dict[zl.Role, dict[str, int]] = {role: {} for role in multi}
    for pod in pods:
        role = role_of(pod)
        if role not in multi:
            continue
        if pod.gated or pod.running_since is None:
            return True
        instance = pod.label(kinds.LABEL_INSTANCE) or pod.name
        counts[role][instance] = counts[role].get(instance, 0) + 1
    return any(
        len(counts[role]) < r.replicas
        or any(n < r.pods_per_instance for n in counts[role].values())
        for role, r in multi.items()
    )


def larger_than_any_superpod(spec: PDGroupSpec, nodes: Iterable[NodeView]) -> list[str]:
    """The roles whose instance (of several pods) no SuperPod of the cluster could hold even
    empty, each a message naming the field: refused at admission rather than left waiting for
    ever. Servers of the role's NPU type only; nothing is said while no such server carries a
    SuperPod label (a cluster whose servers have not registered yet)."""
    errors = []
    for role in zl.Role:
        r = spec.role_spec(role)
        if r.pods_per_instance < 2:
            continue
        capacity: dict[str, tuple[int, int]] = {}
        for node in nodes:
            superpod = node.labels.get(kinds.LABEL_SUPERPOD)
            if superpod is None or node.labels.get(kinds.LABEL_NPU_TYPE) != r.npu_type:
                continue
            servers, largest = capacity.get(superpod, (0, 0))
            capacity[superpod] = (servers + 1, max(largest, node.allocatable_npus))
        pods = [r.npus_per_pod] * r.pods_per_instance
        if capacity and not placement.fits_any_superpod(pods, capacity):
            biggest, (count, _) = max(capacity.items(), key=lambda kv: (kv[1][0], kv[0]))
            errors.append(
                f"spec.{role.spec_key}.podsPerInstance: an instance of {r.pods_per_instance} "
                f"pods of {r.npus_per_pod} NPUs fits no SuperPod of this cluster, even empty "
                f"(the largest: {biggest}, {count} servers of {r.npu_type}); an "
                "instance's pods run one per server in one SuperPod"
            )
    return errors


def multi_pod(view: GroupView, role: zl.Role) -> bool:
    return view.spec.role_spec(role).pods_per_instance > 1


def superpod_of(view: GroupView, pod: PodView) -> str | None:
    """The SuperPod a pod runs in, or was reserved in (a gated pod has no node yet)."""
    if pod.superpod:
        return pod.superpod
    if kinds.ANNOTATION_SUPERPOD in pod.annotations:
        return pod.annotations[kinds.ANNOTATION_SUPERPOD]
    node = view.nodes.get(pod.pinned or "")
    return node.labels.get(kinds.LABEL_SUPERPOD) if node is not None else None


def server_of(pod: PodView) -> str | None:
    return pod.node or pod.pinned


def decode_home(view: GroupView) -> str | None:
    """The SuperPod of the group's decodes (the first placed decode's), if any is placed."""
    for pod in sorted(view.pods.values(), key=lambda p: p.name):
        if role_of(pod) is zl.Role.DECODE and not pod.deleting:
            found = superpod_of(view, pod)
            if found:
                return found
    return None


def _eligible(view: GroupView, role: zl.Role) -> set[str]:
    """The servers a pod of ``role`` may go to (its node selector and tolerations, as the
    scheduler would judge them, NPUs aside)."""
    manifest = pod_manifest(
        view.namespace, view.name, view.uid, view.name, role, view.spec, view.engine
    )
    selector = manifest["spec"].get("nodeSelector") or {}
    tolerations = manifest["spec"].get("tolerations") or []
    return {n.name for n in view.nodes.values() if not n.refuses(selector, tolerations)}


def plan_seats(view: GroupView, wanted: Mapping[str, tuple[zl.Role, list[str]]]) -> SeatPlan:
    """Seats for the missing pods of each multi-pod instance (``wanted``: instance -> its role
    and missing pod names), decodes first (they fix the group's SuperPod), each placed whole
    or not at all; an instance with pods already there gets the rest in their SuperPod, on
    other servers."""
    if not any(names for _, names in wanted.values()):
        return SeatPlan({}, {})  # every pass of a group with nothing to place: no work
    free = {
        name: max(0, node.allocatable_npus - view.npus_used.get(name, 0))
        for name, node in view.nodes.items()
    }
    eligible = {role: _eligible(view, role) for role in (zl.Role.PREFILL, zl.Role.DECODE)}
    home = decode_home(view)
    seats: dict[str, Seat] = {}
    waiting: dict[str, str] = {}
    order = sorted(wanted.items(), key=lambda kv: (kv[1][0] is not zl.Role.DECODE, kv[0]))
    for instance, (role, names) in order:
        if not names:
            continue
        r = view.spec.role_spec(role)
        found = view.instances.get(instance)
        present = [p for p in found.pods if not p.deleting] if found is not None else []
        there = {s for p in present if (s := server_of(p))}
        fixed = next((sp for p in present if (sp := superpod_of(view, p))), None)
        servers = [
            placement.Server(
                name,
                view.nodes[name].labels.get(kinds.LABEL_SUPERPOD),
                0 if name in there else free[name],
            )
            for name in sorted(eligible[role])
        ]
        request = placement.Request(
            instance,
            tuple(r.npus_per_pod for _ in names),
            superpod=fixed or (home if role is zl.Role.DECODE else None),
            prefer_superpod=home if role is zl.Role.PREFILL else None,
        )
        placed, refused = placement.place([request], servers)
        if not placed:
            waiting[instance] = refused[0].reason if refused else "no server can hold it"
            continue
        where = placed[0]
        plane = placement.kv_plane(
            where.superpod, where.superpod if role is zl.Role.DECODE else home
        )
        for name, server in zip(names, where.servers, strict=True):
            seats[name] = Seat(server, where.superpod, str(plane))
            free[server] = free.get(server, 0) - r.npus_per_pod
        if role is zl.Role.DECODE and home is None:
            home = where.superpod
    return SeatPlan(seats, waiting)


def wanted(view: GroupView, missing: Mapping[str, zl.Role]) -> dict[str, tuple[zl.Role, list[str]]]:
    """The multi-pod instances among ``missing`` with their role and missing pods."""
    return {
        instance: (role, view.missing_pods(instance, role))
        for instance, role in missing.items()
        if multi_pod(view, role)
    }


def waiting(view: GroupView, desired: Mapping[str, zl.Role]) -> dict[str, str]:
    """The desired multi-pod instances that no SuperPod can hold now, and why."""
    return dict(plan_seats(view, wanted(view, desired)).waiting)


def lift(view: GroupView) -> list[Action]:
    """The gates of the pods of every instance whose pods all exist, lifted together."""
    actions: list[Action] = []
    for name, instance in sorted(view.instances.items()):
        gated = [p for p in instance.pods if p.gated and not p.deleting]
        if not gated or name in view.zk.removed:
            continue
        role = role_of(instance.leader)
        present = [p for p in instance.pods if not p.deleting]
        if len(present) < len(pod_names(name, view.spec.role_spec(role).pods_per_instance)):
            continue
        actions += [UngatePod(p.name, p.uid) for p in gated]
    return actions


def overdue(view: GroupView) -> list[Action]:
    """Every pod of a multi-pod instance being placed (never whole yet: its leader has not
    reported, and the RoCE map does not name it) whose pods are not all running
    :data:`GANG_BOUND_SECONDS` after the newest was created: released together, so that the
    instance is placed again whole. Gated, pinned to a server taken meanwhile, or bound alone:
    a half instance holds NPUs, or reserves them, for nothing. An instance that was whole is
    recovery's, never released here (a worker restarting in place is not running for a while)."""
    actions: list[Action] = []
    roce_map = view.zk.roce_map
    for name, instance in sorted(view.instances.items()):
        pods = [p for p in instance.pods if not p.deleting]
        if not pods or view.claimed(instance.leader):
            continue
        if name in view.reports or (roce_map is not None and roce_map.entry(name) is not None):
            continue
        role = role_of(instance.leader)
        wanted = pod_names(name, view.spec.role_spec(role).pods_per_instance)
        if len(wanted) < 2:
            continue
        whole = len(pods) == len(wanted) and all(p.running_since is not None for p in pods)
        newest = max(view.started_at(p) for p in pods)
        if whole or view.now - newest < GANG_BOUND_SECONDS:
            continue
        actions += [
            DeletePod(
                p.name,
                p.uid,
                reason=f"instance {name} not placed whole within {GANG_BOUND_SECONDS:.0f} s: "
                "its pods are released together and placed again",
            )
            for p in pods
        ]
    return actions
