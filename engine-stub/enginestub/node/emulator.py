"""The node emulator: kubelet + Ascend device plugin + fault detector for emulated NPU servers
(SYSTEM.md §5; the fault file is P/D-Serve §3.4's).

``Emulator.run()`` composes the parts, which share one :class:`.state.EmulatorState`:

1. :mod:`.nodelifecycle` registers one Node per emulated server, keeps it Ready (status, taints,
   a Lease in ``kube-node-lease``) and removes it on exit;
2. :mod:`.podlifecycle` watches the pods bound to its nodes, grants NPUs, gives each pod a
   loopback IP and its environment (:mod:`.podenv`), runs its containers as processes
   (:mod:`.runner`), writes ``status`` back as the kubelet would, and on deletion stops them
   within the grace period and finalises the delete; it keeps the pods' cluster DNS names in
   hosts files (:mod:`.hosts`), those of other kubelets' pods included;
3. :mod:`.faults` keeps each node's device status file (:mod:`.devicestatus`) and applies the
   faults the control API (:mod:`.control`) asks for;
4. :mod:`.events` posts the kubelet's Events for all of them.

This module starts them, the engine zygote (:mod:`.zygote`) and, with ``service_proxy``, the
Service proxy (:mod:`.services`), and stops them in order. In ``advertise`` mode (kind, where
real kubelets run containers) only the device-plugin and fault-file parts run, for existing nodes.

Kubernetes calls use the synchronous client in worker threads; everything else is asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Mapping

from kubernetes import client

from enginestub.node import devicestatus, podstatus, services
from enginestub.node.events import Events
from enginestub.node.faults import Faults
from enginestub.node.nodelifecycle import NodeLifecycle
from enginestub.node.podlifecycle import PodLifecycle
from enginestub.node.runner import Zygote
from enginestub.node.state import (
    DEFAULT_IMAGE_MAP,
    EmulatorConfig,
    EmulatorState,
    NodeState,
    PodRecord,
)

__all__ = ["DEFAULT_IMAGE_MAP", "Emulator", "EmulatorConfig", "NodeState", "PodRecord"]

log = logging.getLogger("enginestub.node")


class Emulator:
    """One emulator process: its nodes, the pods bound to them, their faults."""

    def __init__(self, config: EmulatorConfig, api: client.ApiClient) -> None:
        self.state = EmulatorState(config, api)
        self.events = Events(self.state.core)
        self.proxy: services.ServiceProxy | None = None
        if config.service_proxy and config.apiserver_host and config.apiserver_port:
            self.proxy = services.ServiceProxy(
                api, self._backends, (config.apiserver_host, config.apiserver_port)
            )
        self.node_lifecycle = NodeLifecycle(self.state, self.events)
        self.pod_lifecycle = PodLifecycle(self.state, self.events, self.proxy)
        self.faults = Faults(self.state, self.node_lifecycle, self.pod_lifecycle, self.events)
        self.control_url: str | None = None
        self._zygote_proc: asyncio.subprocess.Process | None = None

    async def run(self) -> None:
        from enginestub.node.control import ControlServer

        config = self.state.config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        if self.state.full and config.zygote:
            # The zygote warms up while the nodes register; pods wait for both.
            await asyncio.gather(self._start_zygote(), self.node_lifecycle.register())
        else:
            await self.node_lifecycle.register()
        control = ControlServer(self.state, self.faults)
        self.control_url = await control.start(config.control_host, config.control_port)
        # atomically: scripts and tests poll for this file and read it as soon as it exists
        devicestatus.write_atomically(
            config.state_dir / "emulator.json",
            {
                "pid": os.getpid(),
                "identity": self.state.identity,
                "control": self.control_url,
                "mode": config.mode,
                "nodes": sorted(self.state.nodes),
            },
        )
        tasks = [asyncio.create_task(self.node_lifecycle.heartbeats(), name="heartbeats")]
        if self.state.full:
            tasks.append(
                asyncio.create_task(self.pod_lifecycle.status_writer(), name="status-writer")
            )
            tasks.append(asyncio.create_task(self.pod_lifecycle.watch(), name="pod-events"))
            tasks.append(asyncio.create_task(self.pod_lifecycle.hosts_writer(), name="hosts"))
            if self.proxy is not None:
                tasks.append(asyncio.create_task(self.proxy.run(), name="service-proxy"))
        log.info(
            "node emulator %s: %d nodes, control %s",
            self.state.identity,
            len(self.state.nodes),
            self.control_url,
        )
        try:
            await self.state.stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._shutdown()
            await control.stop()

    def request_stop(self) -> None:
        self.state.stop.set()

    def _backends(self, namespace: str, selector: Mapping[str, str]) -> list[services.Backend]:
        """Ready pods of ours in the namespace whose labels match the selector."""
        found = []
        for record in list(self.state.pods.values()):
            labels = (record.pod.get("metadata") or {}).get("labels")
            if (
                record.namespace != namespace
                or record.terminating
                or not record.ip
                or record.runner is None
                or not services.matches(selector, labels)
                or not podstatus.is_ready(record.conditions)
            ):
                continue
            # the named ports the pod's container plans already hold
            ports = {n: p for plan in record.runner.plans for n, p in plan.ports.items()}
            found.append(services.Backend(record.ip, ports))
        return found

    async def _start_zygote(self) -> None:
        state_dir = self.state.config.state_dir
        path = state_dir / "zygote.sock"
        path.unlink(missing_ok=True)
        output = (state_dir / "zygote.log").open("ab")
        self._zygote_proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "enginestub.node.zygote",
            str(path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
        )
        output.close()
        for _ in range(200):  # it imports the engine first: ~0.3 s
            if path.exists():
                self.pod_lifecycle.zygote = Zygote(str(path))
                return
            if self._zygote_proc.returncode is not None:
                break
            await asyncio.sleep(0.025)
        log_text = (state_dir / "zygote.log").read_text()[-500:]
        log.warning("engine zygote unavailable; fresh interpreters instead: %s", log_text)

    async def _shutdown(self) -> None:
        await self.pod_lifecycle.stop_all(self.state.config.stop_grace_on_exit)
        if self._zygote_proc is not None and self._zygote_proc.returncode is None:
            self._zygote_proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._zygote_proc.wait(), 5)
        await self.node_lifecycle.delete_nodes()
