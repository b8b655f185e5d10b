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
    # The Secrets its volumes mount (a pod's spec never changes: what it was created with).
    secret_volumes: frozenset[str] = frozenset()
    # When its (first) container started running, None while it does not run; and when its
    # Ready condition last flipped (the API's times, whole seconds).
    running_since: float | None = None
    ready_changed_at: float | None = None

    def label(self, key: str) -> str | None:
        return self.labels.get(key)

    def awaiting_first_probe(self, reported_at: float) -> bool:
        """Not Ready only because the kubelet has not yet seen its container's readiness probe
        pass: the container runs, its Ready condition has not flipped since it started (it was
        never Ready in it), and the engine that reported at ``reported_at`` runs in it (reported
        after it started). A container that was Ready and then failed its probe, or an engine
        of an earlier container (killed, restarted), is not this."""
        return (
            not self.ready
            and self.running_since is not None
            and self.ready_changed_at is not None
            and self.ready_changed_at <= self.running_since <= reported_at
        )


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

    def serving(self, reported_at: float) -> bool:
        """Its pods Ready, or waiting only for their first readiness probe while the engine
        that reported at ``reported_at`` (which runs in them) says it serves: a group whose
        engines serve is not held back by the kubelet's probe period (up to ``periodSeconds``
        per pod, the slowest of all of them at setup)."""
        return bool(self.pods) and all(
            p.ready or p.awaiting_first_probe(reported_at) for p in self.pods
        )


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
