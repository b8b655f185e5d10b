"""Kind-neutral observations: what the adapters saw of the world, as frozen values.

Every kind's planner reads these; none of them knows which kind it serves. A pod is seen through
its labels (which group, role and instance it belongs to is the kind's reading of them); an
instance is an ordered list of pods (one today; a multi-server instance later), the first of
which runs its engine's entry point. A fault is what a detection tier saw, typed; the
servers the pods run on are seen as :class:`NodeView`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any


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
    # Faults: how often its engine container restarted, when it last ended (the kubelet's
    # lastState.terminated.finishedAt), and since when its server is not Ready (None: Ready or
    # not known; a server that stopped reporting is as down as one that says so).
    restarts: int = 0
    last_exit_at: float | None = None
    node_down_since: float | None = None
    # The back-off the kubelet says it waits before restarting the engine container (its
    # CrashLoopBackOff message, "back-off 20s restarting failed container=..."); None when it
    # is not waiting in one.
    restart_backoff: float | None = None
    # Warm pods: the pod's resourceVersion (a claim's precondition) and its controller owner
    # ("Kind/name", None if none).
    resource_version: str = ""
    owner: str | None = None
    # Gang placement: the pod still carries scheduling gates (the scheduler leaves it alone),
    # and the server its node selector pins it to (``matrixserve.io/server``), if any.
    gated: bool = False
    pinned: str | None = None

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


# --------------------------------------------------------------------------- faults
class FaultKind(StrEnum):
    """What failed, as recovery plans for it (P/D-Serve §3.4, xDeepServe §6.1-6.2)."""

    DIE = "die"  # one die of an instance (the node's device status, as its engine reports it)
    NPU = "npu"  # a whole NPU of an instance
    HBM = "hbm"  # an uncorrectable HBM error
    NODE = "node"  # the server is down: every instance on it
    LINK = "link"  # a sub-link between a prefill and a decode blocked
    HANG = "hang"  # the engine is alive but its serving loop stopped
    KILL = "kill"  # the engine process exited (the kubelet restarts its container)
    SESSION = "session"  # the engine's ZooKeeper session ended while its pod still runs
    STALE = "stale"  # its health report stopped being refreshed (a frozen process)
    RANK = "rank"  # a rank (a pod but the leader) of a multi-pod instance lost, faulty or silent


class Tier(StrEnum):
    """The detection tier that saw a fault."""

    DEVICE_STATUS = "device-status"  # the node's fault-detection file, via the engine (§3.4)
    HEARTBEAT = "heartbeat"  # the serving loop's heartbeat (xDeepServe §6.1)
    LINK_PROBE = "link-probe"  # dummy payloads over the sub-links (xDeepServe §6.1)
    SESSION = "zookeeper-session"  # ephemeral registration gone (P/D-Serve §3.2)
    STALENESS = "staleness"  # health not refreshed within its bound
    POD = "pod"  # the kubelet's container status (process exit)
    NODE = "node"  # the Node's Ready condition


@dataclass(frozen=True)
class Fault:
    """One detected fault: what, on which instances (several for a server), seen by which tier,
    since when (wall epoch s, as best known: the detection latency counts from it)."""

    kind: FaultKind
    instances: tuple[str, ...]
    tier: Tier
    since: float
    detail: str = ""
    node: str | None = None
    peer: str | None = None  # the other end of a link fault
    on_device: bool = False  # a link fault the device status names (the port is down)
    # The pods at fault, when not every pod of the instance is (a worker of a multi-pod
    # instance): what a restart in place restarts.
    pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Taint:
    """A taint on a server (``spec.taints``): ``NoSchedule`` and ``NoExecute`` keep every new pod
    that does not tolerate them off it (``PreferNoSchedule`` only discourages)."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    @property
    def keeps_off(self) -> bool:
        return self.effect in ("NoSchedule", "NoExecute")

    def tolerated_by(self, tolerations: Sequence[Mapping[str, Any]]) -> bool:
        """Kubernetes' rule: a toleration with no key and ``Exists`` tolerates every taint;
        otherwise its key is the taint's and it says ``Exists`` or ``Equal`` the taint's value,
        its effect empty (all) or the taint's."""
        for toleration in tolerations:
            if (toleration.get("effect") or self.effect) != self.effect:
                continue
            exists = (toleration.get("operator") or "Equal") == "Exists"
            key = toleration.get("key") or ""
            if not key:
                if exists:
                    return True
                continue
            if key == self.key and (exists or (toleration.get("value") or "") == self.value):
                return True
        return False

    def __str__(self) -> str:
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


@dataclass(frozen=True)
class NodeView:
    """A server as the scheduler sees it: NPUs it can still give, whether it takes pods."""

    name: str
    ready: bool
    allocatable_npus: int
    cordoned: bool = False  # spec.unschedulable (kubectl cordon, a drain)
    taints: tuple[Taint, ...] = ()
    down_since: float | None = None  # its Ready condition's last flip, while not Ready
    # Its labels: the SuperPod, the NPU type (DRAM pre-load selectors; where a new pod may go)
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def schedulable(self) -> bool:
        """It takes new pods at all: not cordoned, no taint keeping pods off it."""
        return not self.cordoned and not any(t.keeps_off for t in self.taints)

    def refuses(
        self, node_selector: Mapping[str, str], tolerations: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """Why the scheduler would not place a new pod with this node selector and these
        tolerations here, NPUs aside (a recovery counts only NPUs its new pod can use); empty
        if it would."""
        if not self.ready:
            return f"{self.name} is not Ready"
        if self.cordoned:
            return f"{self.name} is cordoned"
        for taint in self.taints:
            if taint.keeps_off and not taint.tolerated_by(tolerations):
                return f"{self.name} is tainted {taint}"
        for key, value in sorted(node_selector.items()):
            if self.labels.get(key) != value:
                return f"{self.name} is not {key}={value}"
        return ""


def on_nodes(pods: Mapping[str, PodView], nodes: Mapping[str, NodeView]) -> dict[str, PodView]:
    """The pods with their server's state (since when it is not Ready), as the nodes say."""
    out = {}
    for name, pod in pods.items():
        node = nodes.get(pod.node or "")
        down = node.down_since if node is not None else None
        out[name] = pod if down == pod.node_down_since else replace(pod, node_down_since=down)
    return out
