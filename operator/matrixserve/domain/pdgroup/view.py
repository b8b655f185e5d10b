"""What the PDGroup planner knows: the group's spec, its pods (as instances), its ZooKeeper
subtree, and how the platform starts engines. Frozen; built by the handler each pass."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec, WarmClaim
from matrixserve.api.status import PDGroupStatus
from matrixserve.domain import warmclaim
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import InstanceView, NodeView, PodView, group_instances
from matrixserve.domain.pdgroup.pods import pod_names, role_of

STALE_INTERVALS = 3.0  # health intervals without a refresh before a frozen engine is assumed
STALE_GRACE_SECONDS = 10.0  # ... and this much more (a loaded machine's late write)


@dataclass(frozen=True)
class ZkView:
    """The group's subtree as read in one pass (P/D-Serve §3.2-3.4); ``connected=False``: no
    coordination, so nothing destructive may be planned."""

    connected: bool
    reports: Mapping[str, zl.Report] = field(default_factory=dict)
    roce_map: zl.RoceMap | None = None
    init_order: zl.InitOrder | None = None
    links: Mapping[tuple[str, str], zl.Link] = field(default_factory=dict)
    health: Mapping[str, zl.Health] = field(default_factory=dict)
    decode_meta: zl.DecodeMeta | None = None
    entrances: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()
    draining: Mapping[str, zl.Drain] = field(default_factory=dict)  # leaving in order
    present: bool = True  # the group's subtree exists (it is gone after a server lost its data)
    entrances_present: bool = True  # entrances/ exists (it appears with the first entrance)


@dataclass(frozen=True)
class GroupView:
    namespace: str
    name: str
    generation: int
    spec: PDGroupSpec
    pods: Mapping[str, PodView]  # by pod name
    zk: ZkView
    now: float
    uid: str  # the PDGroup's, for its pods' owner reference
    engine: EngineSettings
    # The status the object has now: what was last known, kept while ZooKeeper is out of reach.
    previous: PDGroupStatus = field(default_factory=PDGroupStatus)
    # Pods that hold one of the group's pod names and are not the group's: name -> whose.
    foreign: Mapping[str, str] = field(default_factory=dict)
    # The servers the scheduler may place on (read for recovery: free NPUs), by name.
    nodes: Mapping[str, NodeView] = field(default_factory=dict)
    # Read only when an instance is missing: the namespace's unclaimed warm pods (by
    # name), their engines' reports, and the live instances that can fork the group's model.
    warm_pods: Mapping[str, PodView] = field(default_factory=dict)
    warm_reports: Mapping[str, zl.WarmReport] = field(default_factory=dict)
    fork_sources: tuple[zl.ForkSource, ...] = ()
    # The group's claimed pods whose assignment (of that pod's UID) is written.
    assigned: frozenset[str] = frozenset()
    # NPUs every pod (of the cluster, or the watched namespaces) holds or has reserved, by
    # server (read with the nodes, for gang placement: what a server can still give is its
    # allocatable NPUs less these).
    npus_used: Mapping[str, int] = field(default_factory=dict)

    def missing_pods(self, instance: str, role: zl.Role) -> list[str]:
        """The instance's pods that do not exist, in rank order (none once a claimed warm pod
        is the instance)."""
        found = self.instances.get(instance)
        if found is not None and any(self.claimed(p) for p in found.pods):
            return []
        wanted = pod_names(instance, self.spec.role_spec(role).pods_per_instance)
        return [p for p in wanted if p not in self.pods]

    def learned_pod_start(self, default: float) -> float:
        """A pod's start as the group's pods showed it (created -> its container running; the
        median of those never restarted), else ``default``."""
        starts = [
            p.running_since - p.created_at
            for p in self.pods.values()
            if p.running_since is not None and p.restarts == 0 and p.running_since >= p.created_at
        ]
        return statistics.median(starts) if starts else default

    def started_at(self, pod: PodView) -> float:
        """When the pod began to be this group's: its claim (a claimed warm pod was created
        long before, for a pool) or its creation."""
        if self.claimed(pod):
            at = WarmClaim.of(pod.annotations).at
            if at > 0:
                return at
        return pod.created_at

    @property
    def claimer(self) -> warmclaim.Claimer:
        """This group as the claimer of warm pods."""
        return warmclaim.Claimer(kinds.PDGROUP.kind, self.name)

    def claimed(self, pod: PodView) -> bool:
        """A warm pod this group claimed (it keeps the warm pod's name); not an ExpertPool's
        claim of the same name."""
        return self.claimer.claimed(pod)

    @cached_property
    def instances(self) -> dict[str, InstanceView]:
        """The group's pods gathered into instances: a pod belongs to the instance its label
        names only if its name is one of that instance's pod names, or it is a warm pod the
        group claimed for that instance; any other pod (a stray carrying the group's label) is an
        instance of its own, which the plan releases."""
        return group_instances(self.pods, self._instance_of)

    def _instance_of(self, pod: PodView) -> str:
        instance = pod.label(kinds.LABEL_INSTANCE)
        if instance is None:
            return pod.name
        if self.claimed(pod):
            return instance
        role = self.spec.role_spec(role_of(pod))
        return instance if pod.name in pod_names(instance, role.pods_per_instance) else pod.name

    @cached_property
    def reports(self) -> dict[str, zl.Report]:
        """The reports of the group's current pods. Identity is the pod and what it reported,
        not the name: a report of a pod that is gone (its session not expired yet) or of an
        earlier pod of the same name is not one."""
        return {
            name: report
            for name, report in self.zk.reports.items()
            if (instance := self.instances.get(name)) is not None
            # an engine of an older image does not say its pod: known by name, as before
            and report.pod_uid in (instance.leader.uid, "")
        }

    def current(self, entry: zl.MapEntry) -> bool:
        """The map names this member as it is now (pod IP, RoCE IPs, engine incarnation)."""
        report = self.reports.get(entry.instance)
        return report is not None and report.identity() == entry.identity()

    def healthy(self, instance: str) -> bool:
        """Its current engine reports itself serving (ZooKeeper health, P/D-Serve §3.2): a
        previous incarnation's health is not this one's, nor is one it stopped refreshing. An
        instance of several pods also needs every worker's pod Ready (or waiting only for its
        first probe since the leader reported): a worker whose engine exited takes its instance
        out of traffic at once, before its leader has seen the rank go (its session's timeout)."""
        health = self.zk.health.get(instance)
        report = self.reports.get(instance)
        found = self.instances.get(instance)
        return (
            health is not None
            and report is not None
            and health.incarnation == report.incarnation
            and health.state is zl.HealthState.SERVING
            and not self.stale(health)
            and (
                found is None
                or all(p.ready or p.awaiting_first_probe(report.ts) for p in found.pods[1:])
            )
        )

    @property
    def health_interval(self) -> float:
        """Wall seconds between an engine's health refreshes."""
        return float(self.engine.health_interval_seconds) / float(self.engine.time_scale)

    def stale(self, health: zl.Health) -> bool:
        """Not refreshed for ``STALE_INTERVALS`` health intervals and a grace (the
        staleness tier: a frozen process whose session lives on)."""
        bound = STALE_INTERVALS * self.health_interval + STALE_GRACE_SECONDS
        return self.now - health.ts > bound


def may_recover(pods: Iterable[PodView], zk: ZkView) -> bool:
    """Whether this pass may detect a fault, and so needs the servers (which are down, how
    many NPUs are free): a pod not Ready (a process exit, a server down: the node lifecycle
    controller marks its pods not Ready after the Node), or a member's health saying a fault
    or a blocked sub-link. The usual pass of a healthy group reads no node."""
    if any(not p.ready for p in pods):
        return True
    return any(
        h.state is not zl.HealthState.SERVING
        or any(link.state is zl.LinkState.BLOCKED for link in h.links)
        for h in zk.health.values()
    )
