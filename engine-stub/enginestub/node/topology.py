"""Emulated SuperPod topology: servers, NPUs, dies, and each die's RoCE IP and UB address.

Shape from CloudMatrix-Infer (paper 001) §3: a CloudMatrix384 SuperPod is 48 servers of 8 Ascend
910C NPUs; each NPU is a dual-die package, so a server has 16 dies. Each die has its own RoCE
(RDMA plane) interface, 200 Gbps, and seven UB links. P/D-Serve §3.2 has each instance read its
dies' RoCE IPs (the "hccn tool") and report them ordered by device id.

RoCE IPs are identities, never connection targets: they come from 198.18.0.0/15, the range
RFC 2544 reserves for benchmarking, and no process ever sends a packet to one.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from matrixserve.api.catalog import DIES_PER_NPU
from matrixserve.api.kinds import (
    LABEL_EMULATED,
    LABEL_NPU_TYPE,
    LABEL_RACK,
    LABEL_SERVER,
    LABEL_SUPERPOD,
    NPU_RESOURCE,
)

ROCE_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
SERVERS_PER_RACK = 3  # 48 servers in 16 racks (001 §3.1)


class SuperPodSpec(BaseModel):
    """How many emulated servers of one SuperPod, and their shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=30)
    servers: int = Field(ge=1, le=48)
    npus_per_server: int = Field(default=8, ge=1, le=16)
    npu_type: str = "Ascend910C"
    cpu: str = "192"
    memory: str = "1536Gi"  # 1.5 TB host DRAM per server (DeepServe, paper 002)
    max_pods: int = Field(default=110, ge=1, le=1000)


class TopologySpec(BaseModel):
    """The emulator's topology config (YAML/JSON file or CLI flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    superpods: list[SuperPodSpec] = Field(min_length=1)

    @field_validator("superpods")
    @classmethod
    def _unique_names(cls, value: list[SuperPodSpec]) -> list[SuperPodSpec]:
        names = [sp.name for sp in value]
        if len(set(names)) != len(names):
            raise ValueError(f"superpod names must be unique, got {names}")
        return value


@dataclass(frozen=True)
class Die:
    """One NPU die. ``index`` is the device id within the server (0..15)."""

    index: int
    npu: int
    roce_ip: str
    ub_address: str


@dataclass(frozen=True)
class Server:
    """One emulated NPU server, registered as one Kubernetes Node."""

    node_name: str
    superpod: str
    superpod_index: int
    server_index: int
    rack: str
    npu_type: str
    npus: int
    cpu: str
    memory: str
    max_pods: int
    dies: tuple[Die, ...] = field(default=())

    @property
    def labels(self) -> dict[str, str]:
        return {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            LABEL_SUPERPOD: self.superpod,
            LABEL_RACK: self.rack,
            LABEL_SERVER: self.node_name,
            LABEL_NPU_TYPE: self.npu_type,
            LABEL_EMULATED: "true",
        }

    @property
    def capacity(self) -> dict[str, str]:
        return {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.max_pods),
            "ephemeral-storage": "1Ti",
            NPU_RESOURCE: str(self.npus),
        }

    def dies_of(self, npus: list[int]) -> list[Die]:
        """The dies of the given NPUs, ordered by device id (P/D-Serve §3.2's order)."""
        wanted = set(npus)
        return sorted((d for d in self.dies if d.npu in wanted), key=lambda d: d.index)


def node_name(superpod: str, server_index: int) -> str:
    """The Node name of a SuperPod's server: ``<superpod>-server-NN``."""
    return f"{superpod}-server-{server_index:02d}"


def roce_ip(superpod_index: int, server_index: int, die_index: int) -> str:
    """Deterministic RoCE identity: 198.18.<pod*64+server>.<die+1> (pod < 8, server < 64)."""
    if not (0 <= superpod_index < 8 and 0 <= server_index < 64 and 0 <= die_index < 254):
        raise ValueError("topology too large for the RoCE identity range")
    offset = ((superpod_index * 64 + server_index) << 8) + die_index + 1
    return str(ROCE_NETWORK.network_address + offset)


def build(spec: TopologySpec) -> list[Server]:
    servers: list[Server] = []
    for pod_index, pod in enumerate(spec.superpods):
        for server_index in range(pod.servers):
            dies = tuple(
                Die(
                    index=d,
                    npu=d // DIES_PER_NPU,
                    roce_ip=roce_ip(pod_index, server_index, d),
                    ub_address=f"ub://{pod.name}/{server_index}/{d}",
                )
                for d in range(pod.npus_per_server * DIES_PER_NPU)
            )
            servers.append(
                Server(
                    node_name=node_name(pod.name, server_index),
                    superpod=pod.name,
                    superpod_index=pod_index,
                    server_index=server_index,
                    rack=f"{pod.name}-rack-{server_index // SERVERS_PER_RACK:02d}",
                    npu_type=pod.npu_type,
                    npus=pod.npus_per_server,
                    cpu=pod.cpu,
                    memory=pod.memory,
                    max_pods=pod.max_pods,
                    dies=dies,
                )
            )
    return servers


def server_for_existing_node(node_name: str, labels: dict[str, str], npus: int = 8) -> Server:
    """Advertise mode (kind): describe a real node from its ``matrixserve.io/*`` labels.

    ``matrixserve.io/superpod: sp-<i>`` and ``matrixserve.io/server: ...-<j>`` give the RoCE
    identity's SuperPod and server indices; both default to 0.
    """
    superpod = labels.get(LABEL_SUPERPOD, "sp-0")
    server_label = labels.get(LABEL_SERVER, node_name)
    pod_index = _trailing_int(superpod)
    server_index = _trailing_int(server_label)
    dies = tuple(
        Die(
            index=d,
            npu=d // DIES_PER_NPU,
            roce_ip=roce_ip(pod_index % 8, server_index % 64, d),
            ub_address=f"ub://{superpod}/{server_index}/{d}",
        )
        for d in range(npus * DIES_PER_NPU)
    )
    return Server(
        node_name=node_name,
        superpod=superpod,
        superpod_index=pod_index,
        server_index=server_index,
        rack=labels.get(LABEL_RACK, f"{superpod}-rack-00"),
        npu_type=labels.get(LABEL_NPU_TYPE, "Ascend910C"),
        npus=npus,
        cpu="0",
        memory="0",
        max_pods=0,
        dies=dies,
    )


def _trailing_int(text: str) -> int:
    digits = ""
    for ch in reversed(text):
        if not ch.isdigit():
            break
        digits = ch + digits
    return int(digits) if digits else 0
