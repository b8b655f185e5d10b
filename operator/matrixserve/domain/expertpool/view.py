"""What the ExpertPool planner knows: the pool's spec, its server pods, the servers' live
reports in ZooKeeper (EaaS §4.4: the monitor's registrations and heartbeats), the map in force
(and the pointer naming it) and the versions stored, the status it wrote last (its memory: the servers it drains, the last
failover, the autoscaler's sample) and the time. Frozen; built each pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.api.status import ExpertPoolStatus
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.expertpool.expertmap import ExpertMap
from matrixserve.domain.observed import PodView

ENDED = ("Failed", "Succeeded")


@dataclass(frozen=True)
class PoolView:
    namespace: str
    name: str
    uid: str
    generation: int
    resource_version: str
    spec: ExpertPoolSpec
    pods: Mapping[str, PodView]  # the pool's server pods, by name
    reports: Mapping[str, zl.ExpertServerReport]  # servers/<id>, by server id (pod name)
    current: ExpertMap | None  # the map in force (None: none yet)
    versions: tuple[int, ...]  # every version stored under map/
    engine: EngineSettings
    now: float
    connected: bool = True
    previous: ExpertPoolStatus = field(default_factory=ExpertPoolStatus)
    taken: frozenset[str] = frozenset()  # pod names a creation found held by someone else
    # The next phase of the change in force, stored ahead (``map/v<current+1>``; None: none).
    successor: ExpertMap | None = None
    # The servers' reports at the last token sample (``previous.tokenSample.at``): the start of
    # EPLB's window. Kept by the handler (per-expert counts are too big for the status); None
    # when it has none of that sample (a restarted operator waits one sample).
    sampled: Mapping[str, zl.ExpertServerReport] | None = None
    # Read only while a server is missing: the claimable warm pods (:mod:`.warm`) and their
    # engines' reports; and the claimed pods whose assignment (of their UID) is written.
    warm_pods: Mapping[str, PodView] = field(default_factory=dict)
    warm_reports: Mapping[str, zl.WarmReport] = field(default_factory=dict)
    assigned: frozenset[str] = frozenset()
    # The ``map`` pointer as read (None: none, or unreadable): the settings it carries to the
    # clients (its failover timeout) are rewritten when the spec's differ.
    pointer: zl.ExpertMapPointer | None = None

    def report(self, server: str) -> zl.ExpertServerReport | None:
        """The live report of ``server``'s pod as it is now (not an earlier pod of the name)."""
        report, pod = self.reports.get(server), self.pods.get(server)
        if report is None or pod is None or pod.deleting or pod.phase in ENDED:
            return None
        if report.pod_uid and report.pod_uid != pod.uid:
            return None
        return report

    def live(self) -> set[str]:
        """The servers up now: a report of their pod, not being deleted."""
        return {s for s in self.reports if self.report(s) is not None}

    def restarted(self, server: str) -> bool:
        """Its pod reports another engine than the map's member (a new process: its slots
        lost)."""
        report, members = self.report(server), self.previous.members
        return (
            report is not None
            and server in members
            and bool(report.incarnation)
            and members[server] != report.incarnation
        )

    def exited(self, server: str) -> bool:
        """The member's engine exited: its pod's container restarted since it entered the map
        (the kubelet says so before the restarted engine reports, and long before its session
        ends)."""
        pod, since = self.pods.get(server), self.previous.member_restarts.get(server)
        return pod is not None and since is not None and pod.restarts > since

    def next_version(self) -> int:
        return max((*self.versions, self.current.version if self.current else 0)) + 1
