"""What the WarmPool planner knows: the pool's spec, the pods it made (warm or claimed), the warm
engines' reports in ZooKeeper, the host-DRAM plans there, and how the platform starts engines.
Frozen; built each pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import WarmPoolSpec, WarmShape
from matrixserve.api.status import WarmPoolStatus
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import PodView
from matrixserve.domain.warmpool.dram import Demand


def shape_name(shape: WarmShape, index: int) -> str:
    """A shape's name: its own, or ``<npuType>-<devicesPerPod>`` (lower-case) if it has none."""
    if shape.name:
        return shape.name
    return f"{shape.npu_type.lower()}-{shape.devices_per_pod}"[:63] or f"shape-{index}"


def starved(pods: Iterable[PodView]) -> int:
    """Serving engine pods (of ``pods``, the namespace's engine pods) the scheduler cannot place
    for want of NPUs; a warm pod is none, a claimed one is (its group's now)."""
    return sum(
        1
        for p in pods
        if p.phase == "Pending"
        and not p.deleting
        and (p.label(kinds.LABEL_WARMPOOL) is None or p.label(kinds.LABEL_CLAIMED_BY) is not None)
        and p.trouble is not None
        and p.trouble[0] == "Unschedulable"
        and kinds.NPU_RESOURCE in p.trouble[1]
    )


@dataclass(frozen=True)
class PoolView:
    namespace: str
    name: str
    uid: str
    generation: int
    spec: WarmPoolSpec
    pods: Mapping[str, PodView]  # every pod carrying the pool's label, claimed or not, by name
    reports: Mapping[str, zl.WarmReport]  # warm engines' reports in the namespace, by pod
    engine: EngineSettings
    now: float
    connected: bool = True  # ZooKeeper (the warm engines' reports) is readable
    previous: WarmPoolStatus = field(default_factory=WarmPoolStatus)  # as the object stores it
    # DRAM pre-loading: what to pre-load, in order, the servers that run the namespace's warm
    # pods (with their labels, for the pre-loads' node selectors), and the plans ZooKeeper holds
    # (by server; None: unreadable).
    dram_demand: tuple[Demand, ...] = ()
    nodes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    dram_written: Mapping[str, zl.DramPlan | None] = field(default_factory=dict)
    # Names a creation found taken by someone else's pod (not used again), and the namespace's
    # serving engine pods the scheduler cannot place for want of NPUs (the pool yields its own).
    taken: frozenset[str] = frozenset()
    starved: int = 0

    def shapes(self) -> dict[str, WarmShape]:
        return {shape_name(s, i): s for i, s in enumerate(self.spec.shapes)}

    @staticmethod
    def claimed(pod: PodView) -> bool:
        return pod.label(kinds.LABEL_CLAIMED_BY) is not None

    def warm(self, pod: PodView) -> bool:
        """Past TE-Pre-Load and claimable: Ready, not being deleted, its engine's report (of
        this pod, not an earlier one of the name) in ZooKeeper."""
        report = self.reports.get(pod.name)
        return (
            not self.claimed(pod)
            and not pod.deleting
            and pod.ready
            and report is not None
            and report.pod_uid == pod.uid
        )
