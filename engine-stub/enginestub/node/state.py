"""What the node emulator's parts share: its configuration, one record per node and per pod, and
the API clients (SYSTEM.md §5).

The parts (:mod:`.nodelifecycle`, :mod:`.podlifecycle`, :mod:`.faults`, :mod:`.events`) each
hold a reference to one :class:`EmulatorState`; :class:`.emulator.Emulator` builds it and them.
Nothing here does I/O except writing a node's device status file.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from enginestub.node import allocator, devicestatus
from enginestub.node.network import NodeAddresses
from enginestub.node.runner import ENGINE_ARGV, PodRunner
from enginestub.node.topology import Server
from matrixserve.api import rfc3339

DEFAULT_IMAGE_MAP: dict[str, list[str]] = {
    "matrixserve/engine-stub": ENGINE_ARGV,  # forked from the zygote (runner.py)
    # The operator/gateway image: its entrypoint is "python -m"; the chart's args name the module.
    "matrixserve/matrixserve": [sys.executable, "-m"],
    # The chart's bundled ZooKeeper: Debian's ZooKeeper on the pod's IP.
    "zookeeper": [sys.executable, "-m", "enginestub.node.zookeeper"],
    # Sleep-like pods for tests and scale runs: the container's command runs on the host.
    "busybox": [],
    "matrixserve/host-command": [],
}


@dataclass
class EmulatorConfig:
    servers: list[Server]
    state_dir: Path
    mode: str = "full"  # "full" or "advertise"
    image_map: dict[str, list[str]] = field(default_factory=lambda: dict(DEFAULT_IMAGE_MAP))
    lease_interval: float = 10.0
    status_interval: float = 60.0
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    control_host: str = "127.0.0.1"
    control_port: int = 0
    apiserver_host: str | None = None
    apiserver_port: int | None = None
    apiserver_ca: str | None = None  # CA bundle file of the API server (for pods' kubeconfigs)
    service_proxy: bool = False  # route Services' ClusterIPs (loopback range) to pods
    delete_nodes_on_exit: bool = False
    stop_grace_on_exit: float = 5.0
    zygote: bool = True  # fork engine-stub containers from a warm process (see .zygote)
    # The models every server's local SSD holds (DeepServe §6.2's local SSD path):
    # a property of the emulated servers, given to every pod as $MATRIXSERVE_SSD_MODELS.
    ssd_models: tuple[str, ...] = ()


@dataclass
class PodRecord:
    """One pod bound to one of our nodes."""

    uid: str
    namespace: str
    name: str
    node: str
    pod: dict[str, Any]
    ip: str | None = None
    npus: list[int] = field(default_factory=list)
    runner: PodRunner | None = None
    fixed_status: dict[str, Any] | None = None  # pods we cannot run (image, config, admission)
    mounting: float = 0.0  # waiting for a volume: the pause before the next try (0: not waiting)
    workdir: Path | None = None  # its folder: logs, credentials, volumes
    conditions: list[dict[str, Any]] = field(default_factory=list)
    terminating: bool = False
    events_sent: set[str] = field(default_factory=set)


@dataclass
class NodeState:
    """One emulated server: its addresses, its NPUs' owners, its devices' health."""

    server: Server
    addresses: NodeAddresses
    allocator: allocator.NodeAllocator
    devices: devicestatus.DeviceStatus
    device_file: Path
    down: bool = False
    advertised_faulty: frozenset[int] = frozenset()  # the faulty NPUs its Node shows
    unpublished: bool = False  # the Node does not show its state yet (an API call failed)

    def write_device_file(self) -> None:
        """Rewrite the node's device status file (atomically: pods read it at any moment)."""
        devicestatus.write_atomically(
            self.device_file, self.devices.render(rfc3339.format_seconds(time.time()))
        )


class EmulatorState:
    """The configuration, the API clients, and the nodes and pods this emulator process serves."""

    def __init__(self, config: EmulatorConfig, api: client.ApiClient) -> None:
        self.config = config
        self.api = api
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.identity = f"node-emulator-{os.getpid()}-{secrets.token_hex(3)}"
        self.nodes: dict[str, NodeState] = {}
        self.pods: dict[str, PodRecord] = {}
        self.stop = asyncio.Event()  # set once: the emulator is shutting down

    @property
    def full(self) -> bool:
        """Full mode plays the kubelet too; advertise mode (kind) only the device plugin."""
        return self.config.mode == "full"
