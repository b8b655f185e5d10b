"""What the PDGroup planner asks for: pod creations and deletions, and writes to the group's
ZooKeeper subtree (P/D-Serve §3.2-3.4). Each action carries what applying it needs and says how
it is reported (its Event)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from matrixserve.api import zk_layout as zl
from matrixserve.api.status import RecoveryRecord
from matrixserve.domain.effects import (
    Event,
    Notice,
    PodClaim,
    PodCreation,
    PodDeletion,
    PodUngate,
    ZnodeChange,
)
from matrixserve.domain.pdgroup.pods import role_label


# --------------------------------------------------------------------------- Kubernetes
@dataclass(frozen=True)
class CreatePod(PodCreation):
    name: str
    role: zl.Role
    # Derived from the view, name and role; equality is by what is created.
    manifest: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> Event:
        return Event(
            "CreatedPod", f"Created pod {self.name} for a {role_label(self.role)} instance"
        )


@dataclass(frozen=True)
class DeletePod(PodDeletion):
    name: str
    uid: str
    reason: str
    force: bool = False  # grace period 0: its server is down, no kubelet will finish it

    def describe(self) -> Event:
        return Event("DeletedPod", f"Deleted pod {self.name}: {self.reason}")


@dataclass(frozen=True)
class UngatePod(PodUngate):
    """Lift a gang-placed pod's scheduling gate (every pod of its instance exists)."""

    name: str
    uid: str

    def describe(self) -> Event:
        return Event("PlacedPod", f"Lifted the scheduling gate of pod {self.name}")


@dataclass(frozen=True)
class ReportPodTrouble(Notice):
    """A pod of the group that cannot run (unschedulable, its image not pulled, ...)."""

    pod: str
    reason: str
    message: str

    def describe(self) -> Event:
        return Event(self.reason, f"Pod {self.pod} cannot run: {self.message}", warning=True)


@dataclass(frozen=True)
class ReportRecovery(Notice):
    """A step of a recovery: a fault detected, a plan chosen, restored, failed;
    ``record`` is the recovery's status record (what the handler's metrics count)."""

    reason: str
    message: str
    warning: bool = False
    record: RecoveryRecord | None = field(default=None, compare=False, hash=False)

    def describe(self) -> Event:
        return Event(self.reason, self.message, warning=self.warning)


@dataclass(frozen=True)
class ReportRatioChange(Notice):
    """The ratio policy moved the group's target split: why, with the numbers."""

    message: str
    reason: str = "RatioChange"
    warning: bool = False

    def describe(self) -> Event:
        return Event(self.reason, self.message, warning=self.warning)


# --------------------------------------------------------------------------- ZooKeeper
class _GroupZnodes(ZnodeChange[zl.GroupPaths]):
    """A write to the group's subtree. ``reason`` and ``message`` (a format string over the
    action's fields) make its Event; no reason: no Event."""

    reason: ClassVar[str] = ""
    message: ClassVar[str] = ""

    def describe(self) -> Event | None:
        if not self.reason:
            return None
        return Event(self.reason, self.message.format(**vars(self)))


@dataclass(frozen=True)
class WriteRoceMap(_GroupZnodes):
    roce_map: zl.RoceMap
    added: tuple[str, ...]
    removed: tuple[str, ...]
    rejoined: tuple[str, ...] = ()  # members now someone else: new pod, RoCE IPs or engine
    rebuilt: bool = False  # written again after ZooKeeper lost the group's data
    relinked: tuple[str, ...] = ()  # the same members, their sub-links verified again

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.roce_map, self.roce_map.dump())]

    def describe(self) -> Event:
        m = self.roce_map
        change = ", ".join(
            [
                *(f"+{a}" for a in self.added),
                *(f"-{r}" for r in self.removed),
                *(f"~{r} rejoined" for r in self.rejoined),
                *(f"{r}'s sub-links to verify again" for r in self.relinked),
            ]
        )
        if self.rebuilt:
            return Event(
                "RoceMapRebuilt",
                f"ZooKeeper lost the group's data: wrote RoCE map v{m.version} again from the "
                f"engines' reports ({change}); {m.expected_links()} sub-links expected",
            )
        return Event(
            "RoceMap",
            f"Wrote RoCE map v{m.version} ({change}); {m.expected_links()} sub-links expected",
        )


@dataclass(frozen=True)
class WriteInitOrder(_GroupZnodes):
    order: zl.InitOrder
    reason = "InitOrder"
    message = "All instances reported their RoCE IPs; init order delivered"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.init_order, self.order.dump())]


@dataclass(frozen=True)
class WriteDecodeMeta(_GroupZnodes):
    meta: zl.DecodeMeta

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.decode_meta, self.meta.dump())]

    def describe(self) -> Event:
        decodes = ", ".join(d.instance for d in self.meta.decodes) or "no decodes"
        return Event(
            "DecodeMeta", f"Pushed decode meta v{self.meta.version} ({decodes}) to the prefills"
        )


@dataclass(frozen=True)
class SetEntrance(_GroupZnodes):
    entrance: zl.Entrance
    reason = "EntranceOpened"
    message = "Prefill {entrance.instance} is open for requests"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.entrance(self.entrance.instance), self.entrance.dump())]


@dataclass(frozen=True)
class DeleteEntrance(_GroupZnodes):
    name: str
    reason = "EntranceClosed"
    message = "Prefill {name} no longer takes requests"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Delete(paths.entrance(self.name))]


@dataclass(frozen=True)
class MarkRemoved(_GroupZnodes):
    removal: zl.Removal
    reason = "LogicallyRemoved"
    message = "Removed {removal.instance} from the group ({removal.reason})"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.removed_of(self.removal.instance), self.removal.dump())]


@dataclass(frozen=True)
class EraseInstance(_GroupZnodes):
    """Delete the instance's links (its data in the group) before its pod is released."""

    name: str
    links: tuple[tuple[str, str], ...]
    reason = "Erased"
    message = "Erased the links of {name}"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Delete(paths.link(p, d)) for p, d in self.links]


@dataclass(frozen=True)
class ForgetLink(_GroupZnodes):
    """Drop a pair's verified link (a recovery's relink): both ends verify it again (a new
    handshake) on the next map version, instead of taking the old znode as proof."""

    prefill: str
    decode: str
    reason = "Relink"
    message = "Asked {prefill} and {decode} to verify their sub-links again"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Delete(paths.link(self.prefill, self.decode))]


@dataclass(frozen=True)
class ClearRemoved(_GroupZnodes):
    name: str

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Delete(paths.removed_of(self.name)), zl.Delete(paths.draining_of(self.name))]


@dataclass(frozen=True)
class StartDrain(_GroupZnodes):
    """An instance leaving in order: no new work, it finishes what it has."""

    drain: zl.Drain
    reason = "Draining"
    message = "Draining {drain.instance} before it leaves the group ({drain.reason})"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.draining_of(self.drain.instance), self.drain.dump())]


@dataclass(frozen=True)
class ClearDrain(_GroupZnodes):
    """A draining instance wanted again (scaled back up before it left): it takes work again."""

    name: str
    reason = "DrainCancelled"
    message = "{name} is wanted again: no longer draining"

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Delete(paths.draining_of(self.name))]


# --------------------------------------------------------------------------- warm pods
@dataclass(frozen=True)
class ClaimWarmPod(PodClaim):
    """Claim a warm pod for a new instance: its labels, annotations and owner become the
    group's, on the condition that it is still at ``resource_version`` (two claims on one pod:
    the API server lets one through)."""

    name: str
    resource_version: str
    instance: str
    role: zl.Role
    path: str
    estimate: float
    fork_source: str | None = None
    patch: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> Event:
        via = f" from {self.fork_source}" if self.fork_source else ""
        return Event(
            "ClaimedWarmPod",
            f"Claimed warm pod {self.name} as {role_label(self.role)} instance {self.instance}: "
            f"{self.path}{via}, estimated {self.estimate:.1f} s",
        )


@dataclass(frozen=True)
class AssignWarmPod(ZnodeChange[zl.GroupPaths]):
    """Tell a claimed warm pod's engine what it becomes (its assignment znode, bound to the
    pod's UID). Written while the pod has not reported to the group, so an operator that died
    between the claim and this write writes it after its restart."""

    namespace: str
    pod: str
    instance: str
    assignment: zl.Assignment

    def znodes(self, paths: zl.GroupPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(zl.WarmPaths(self.namespace).assignment(self.pod), self.assignment.dump())]

    def describe(self) -> Event:
        fork = self.assignment.fork
        how = (
            f"fork from {fork.instance} over {fork.plane}, else {self.assignment.fallback}"
            if fork
            else self.assignment.load_source
        )
        return Event(
            "AssignedWarmPod", f"Assigned warm pod {self.pod} to instance {self.instance}: {how}"
        )


Action = (
    CreatePod
    | ClaimWarmPod
    | AssignWarmPod
    | DeletePod
    | UngatePod
    | ReportPodTrouble
    | ReportRecovery
    | ReportRatioChange
    | WriteRoceMap
    | WriteInitOrder
    | WriteDecodeMeta
    | SetEntrance
    | DeleteEntrance
    | MarkRemoved
    | EraseInstance
    | ForgetLink
    | ClearRemoved
    | StartDrain
    | ClearDrain
)
