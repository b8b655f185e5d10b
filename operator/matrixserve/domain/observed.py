"""Kind-neutral observations: what the adapters saw of the world, as frozen values.

Every kind's planner reads these; none of them knows which kind it serves. A pod is seen through
its labels (which group, role and instance it belongs to is the kind's reading of them); an
instance is an ordered list of pods (one today; a multi-server instance later), the first of
which runs its engine's entry point. Engine and device fault views join here (recovery).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    labels: Mapping[str, str]
    phase: str
    ready: bool
    deleting: bool
    node: str | None
    superpod: str | None
    created_at: float
    annotations: Mapping[str, str] = field(default_factory=dict)
    # Why it cannot run, as the scheduler or the kubelet says: (reason, message), e.g.
    # ("Unschedulable", "0/4 nodes are available: ...") or ("ImagePullBackOff", ...).
    trouble: tuple[str, str] | None = None

    def label(self, key: str) -> str | None:
        return self.labels.get(key)


@dataclass(frozen=True)
class InstanceView:
    """One serving instance: its pods in order (the first is the leader, whose engine reports
    to the group). Every pod must be there and ready for the instance to be."""

    name: str
    pods: tuple[PodView, ...] = field(default_factory=tuple)

    @property
    def leader(self) -> PodView:
        return self.pods[0]

    @property
    def deleting(self) -> bool:
        return any(p.deleting for p in self.pods)

    @property
    def ready(self) -> bool:
        return bool(self.pods) and all(p.ready for p in self.pods)


def group_instances(
    pods: Mapping[str, PodView], instance_of: Callable[[PodView], str]
) -> dict[str, InstanceView]:
    """Pods gathered into instances by ``instance_of`` (the kind's reading of a pod's labels
    and name), each instance's pods in name order."""
    members: dict[str, list[PodView]] = {}
    for pod in pods.values():
        members.setdefault(instance_of(pod), []).append(pod)
    return {
        name: InstanceView(name, tuple(sorted(found, key=lambda p: p.name)))
        for name, found in members.items()
    }
