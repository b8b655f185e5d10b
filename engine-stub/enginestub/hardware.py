"""The hardware model: dies, NPUs, servers and SuperPods, with the three network planes.

CloudMatrix384 (001 §3): a SuperPod is 48 servers x 8 Ascend 910C NPUs; an NPU is two dies; a
die has 376 TFLOPS BF16 / 752 TOPS INT8, 64 GB of HBM at 1.6 TB/s, 196 GB/s of UB and 200 Gbps
of RoCE; a server has 400 Gbps of VPC. Pure: capacities and totals, no timing (see
:mod:`enginestub.timing` and :mod:`enginestub.fabric`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enginestub import calibration as cal
from enginestub.fabric import Plane
from matrixserve.api import catalog


@dataclass(frozen=True)
class DieSpec:
    bf16_flops: float = cal.DIE_BF16_FLOPS
    int8_ops: float = cal.DIE_INT8_OPS
    hbm_bytes: float = catalog.DIE_HBM_BYTES
    hbm_bandwidth: float = cal.DIE_HBM_BANDWIDTH
    ub_bandwidth: float = cal.UB_DIE_BANDWIDTH
    roce_bandwidth: float = cal.ROCE_DIE_BANDWIDTH

    def flops(self, precision: str) -> float:
        if precision == "int8":
            return self.int8_ops
        if precision in ("bf16", "fp16"):
            return self.bf16_flops
        raise ValueError(f"unknown precision {precision!r} (int8, bf16, fp16)")


@dataclass(frozen=True)
class NPUSpec:
    die: DieSpec = field(default_factory=DieSpec)
    dies: int = catalog.DIES_PER_NPU

    @property
    def hbm_bytes(self) -> float:
        return self.dies * self.die.hbm_bytes

    @property
    def roce_bandwidth(self) -> float:
        return self.dies * self.die.roce_bandwidth


@dataclass(frozen=True)
class ServerSpec:
    npu: NPUSpec = field(default_factory=NPUSpec)
    npus: int = catalog.NPUS_PER_SERVER
    host_dram_bytes: float = cal.HOST_DRAM_BYTES
    vpc_bandwidth: float = cal.VPC_NODE_BANDWIDTH

    @property
    def dies(self) -> int:
        return self.npus * self.npu.dies

    def plane_bandwidth(self, plane: Plane) -> float:
        """Aggregate bandwidth of the server on a plane, one direction."""
        if plane is Plane.UB:
            return self.dies * self.npu.die.ub_bandwidth
        if plane is Plane.ROCE:
            return self.dies * self.npu.die.roce_bandwidth
        return self.vpc_bandwidth


@dataclass(frozen=True)
class SuperPodSpec:
    server: ServerSpec = field(default_factory=ServerSpec)
    servers: int = catalog.SERVERS_PER_SUPERPOD

    @property
    def npus(self) -> int:
        return self.servers * self.server.npus

    @property
    def dies(self) -> int:
        return self.servers * self.server.dies

    @property
    def hbm_bytes(self) -> float:
        return self.npus * self.server.npu.hbm_bytes

    @property
    def int8_ops(self) -> float:
        return self.dies * self.server.npu.die.int8_ops


CLOUDMATRIX384 = SuperPodSpec()
