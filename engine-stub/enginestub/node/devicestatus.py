"""The per-node device status file: P/D-Serve §3.4's fault-detection output (Fig. 8 ①②).

"a customized container (with resident process) upon Ascend Device Plugin is deployed per node
... The resident process regularly detects the faults and records the results (xPU status) to a
file. Such file is mounted to all instances per node. Further, the faults are classified into
multiple levels, in which some are recoverable without node-level recovery."

The paper does not list the levels; we use the Ascend device plugin's vocabulary (external to
the papers: MindCluster ``ascend_device_plugin`` docs) for fault types and handling levels.

The file is JSON, rewritten atomically (write + rename) so a reader never sees half a file::

    {"node": ..., "generation": 7, "updatedAt": "...",
     "npus": [{"id": 0, "health": "Healthy", "dies": [
        {"id": 0, "roceIp": "198.18.0.1", "ubAddress": "ub://sp0/0/0", "health": "Healthy",
         "faults": [{"type": "CardUnhealthy", "level": "SeparateNPU", "code": "DIE_DOWN", ...}]},
        ...]}],
     "links": [{"die": 3, "peerRoceIp": "198.18.1.4", "plane": "RoCE", "health": "Down", ...}]}

Engines read it to stop using a failed die; the operator reads it (through the emulator's
``GET /nodes/<node>/device-status``, the paper's "Flask request", ③) to plan recovery.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from enginestub.node.topology import Server


class FaultKind(StrEnum):
    DIE_DOWN = "die-down"
    NPU_DOWN = "npu-down"
    LINK_DOWN = "link-down"
    HBM_ERROR = "hbm-error"


# kind -> (fault type, handling level, code)
FAULT_CLASS: dict[FaultKind, tuple[str, str, str]] = {
    FaultKind.DIE_DOWN: ("CardUnhealthy", "SeparateNPU", "DIE_DOWN"),
    FaultKind.NPU_DOWN: ("CardUnhealthy", "SeparateNPU", "NPU_DOWN"),
    # MindCluster's own example of a chip network fault: CardNetworkUnhealthy, PreSeparateNPU.
    FaultKind.LINK_DOWN: ("CardNetworkUnhealthy", "PreSeparateNPU", "LINK_DOWN"),
    FaultKind.HBM_ERROR: ("CardUnhealthy", "RestartBusiness", "HBM_UNCORRECTABLE_ECC"),
}


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    die: int
    since: str
    peer_roce_ip: str | None = None  # link faults only

    def to_json(self) -> dict[str, Any]:
        fault_type, level, code = FAULT_CLASS[self.kind]
        out: dict[str, Any] = {
            "kind": str(self.kind),
            "type": fault_type,
            "level": level,
            "code": code,
            "since": self.since,
        }
        if self.peer_roce_ip is not None:
            out["peerRoceIp"] = self.peer_roce_ip
        return out


@dataclass
class DeviceStatus:
    """The fault state of one node; :meth:`render` is the file's content."""

    server: Server
    faults: list[Fault] = field(default_factory=list)
    generation: int = 0

    def inject(self, fault: Fault) -> bool:
        """Add a fault; False (no change) if the same fault is already present."""
        if self._find(fault) is not None:
            return False
        self.faults.append(fault)
        self.generation += 1
        return True

    def heal(self, kind: FaultKind, die: int, peer_roce_ip: str | None = None) -> bool:
        before = len(self.faults)
        self.faults = [
            f
            for f in self.faults
            if not (f.kind == kind and f.die == die and f.peer_roce_ip == peer_roce_ip)
        ]
        changed = len(self.faults) != before
        if changed:
            self.generation += 1
        return changed

    def heal_all(self) -> bool:
        if not self.faults:
            return False
        self.faults = []
        self.generation += 1
        return True

    def _find(self, fault: Fault) -> Fault | None:
        for f in self.faults:
            if (f.kind, f.die, f.peer_roce_ip) == (fault.kind, fault.die, fault.peer_roce_ip):
                return f
        return None

    def unhealthy_dies(self) -> set[int]:
        return {f.die for f in self.faults if f.kind != FaultKind.LINK_DOWN}

    def faulty_npus(self) -> frozenset[int]:
        """The NPUs holding a die with any fault (xDeepServe §6.2): no longer allocatable. A die
        whose RoCE link is down makes its NPU faulty too: the Ascend device plugin lists it
        ``NetworkUnhealthy`` (``PreSeparateNPU``) and the scheduler keeps new work off it, so a
        replacement never lands on the port that failed."""
        npu_of = {die.index: die.npu for die in self.server.dies}
        return frozenset(npu_of[f.die] for f in self.faults if f.die in npu_of)

    def faults_of_npu(self, npu: int) -> list[Fault]:
        """The faults on the NPU's dies (what makes it faulty)."""
        dies = {die.index for die in self.server.dies if die.npu == npu}
        return [f for f in self.faults if f.die in dies]

    def render(self, now: str) -> dict[str, Any]:
        die_faults: dict[int, list[dict[str, Any]]] = {}
        links = []
        for f in self.faults:
            if f.kind == FaultKind.LINK_DOWN:
                fault_type, level, code = FAULT_CLASS[f.kind]
                links.append(
                    {
                        "die": f.die,
                        "peerRoceIp": f.peer_roce_ip,
                        "plane": "RoCE",
                        "health": "Down",
                        "type": fault_type,
                        "level": level,
                        "code": code,
                        "since": f.since,
                    }
                )
            else:
                die_faults.setdefault(f.die, []).append(f.to_json())
        npus = []
        for npu in range(self.server.npus):
            dies = []
            for die in self.server.dies:
                if die.npu != npu:
                    continue
                faults = die_faults.get(die.index, [])
                dies.append(
                    {
                        "id": die.index,
                        "roceIp": die.roce_ip,
                        "ubAddress": die.ub_address,
                        "health": "Unhealthy" if faults else "Healthy",
                        "faults": faults,
                    }
                )
            npus.append(
                {
                    "id": npu,
                    "health": "Unhealthy" if any(d["faults"] for d in dies) else "Healthy",
                    "dies": dies,
                }
            )
        return {
            "node": self.server.node_name,
            "superpod": self.server.superpod,
            "generation": self.generation,
            "updatedAt": now,
            "npus": npus,
            "links": links,
        }


def write_atomically(path: Path, content: dict[str, Any]) -> None:
    write_text_atomically(path, json.dumps(content, indent=1))


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
