"""NPU allocation per node, as the Ascend device plugin does it: each pod gets specific NPUs.

The scheduler only counts (``huawei.com/Ascend910`` requests ≤ allocatable); the device plugin
picks *which* NPUs. We prefer the lowest free ids, contiguous when possible, and never give one
NPU to two pods. The grant is recorded on the pod (annotation, like the real plugin's
``huawei.com/Ascend910: Ascend910-0,Ascend910-1``) so a restarted emulator rebuilds its books.

A faulty NPU (xDeepServe §6.2) is never granted to a new pod; a pod already holding
one keeps it (recovery replaces that pod), so the books only change by grants and releases.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from matrixserve.api.kinds import NPU_RESOURCE

ANNOTATION = NPU_RESOURCE  # the real plugin records a grant under the resource's own name


class AllocationError(Exception):
    """The node has fewer free NPUs than the pod asks for (the scheduler over-committed)."""


def format_grant(npus: list[int]) -> str:
    return ",".join(f"Ascend910-{n}" for n in sorted(npus))


def parse_grant(text: str) -> list[int]:
    if not text.strip():
        return []
    out = []
    for part in text.split(","):
        name = part.strip()
        if not name.startswith("Ascend910-") or not name.removeprefix("Ascend910-").isdigit():
            raise ValueError(f"bad NPU grant entry {name!r} (expected Ascend910-<id>)")
        out.append(int(name.removeprefix("Ascend910-")))
    return sorted(out)


@dataclass
class NodeAllocator:
    npus: int
    owners: dict[int, str] = field(default_factory=dict)  # npu id -> pod uid

    def free(self, unhealthy: Collection[int] = ()) -> list[int]:
        """The NPUs granted to no pod, less the ``unhealthy`` ones."""
        return [n for n in range(self.npus) if n not in self.owners and n not in unhealthy]

    def held_by(self, pod_uid: str) -> list[int]:
        return sorted(n for n, owner in self.owners.items() if owner == pod_uid)

    def allocate(self, pod_uid: str, count: int, unhealthy: Collection[int] = ()) -> list[int]:
        """Grant ``count`` healthy NPUs to the pod (idempotent: a pod keeps what it already
        holds, faulty or not)."""
        held = self.held_by(pod_uid)
        if held:
            if len(held) != count:
                raise AllocationError(f"pod already holds NPUs {held}, asked for {count}")
            return held
        if count == 0:
            return []
        free = self.free(unhealthy)
        if len(free) < count:
            faulty = f" (faulty: {sorted(unhealthy)})" if unhealthy else ""
            raise AllocationError(
                f"asked for {count} NPUs, {len(free)} free and healthy of {self.npus}{faulty}"
            )
        chosen = _contiguous(free, count) or free[:count]
        for n in chosen:
            self.owners[n] = pod_uid
        return chosen

    def adopt(self, pod_uid: str, npus: list[int]) -> None:
        """Record a grant made before a restart; refuses double allocation."""
        for n in npus:
            if not 0 <= n < self.npus:
                raise AllocationError(f"NPU {n} does not exist on this node")
            owner = self.owners.get(n)
            if owner is not None and owner != pod_uid:
                raise AllocationError(f"NPU {n} is already granted to pod {owner}")
        for n in npus:
            self.owners[n] = pod_uid

    def release(self, pod_uid: str) -> list[int]:
        held = self.held_by(pod_uid)
        for n in held:
            del self.owners[n]
        return held


def _contiguous(free: list[int], count: int) -> list[int] | None:
    for start in range(len(free) - count + 1):
        window = free[start : start + count]
        if window[-1] - window[0] == count - 1:
            return window
    return None
