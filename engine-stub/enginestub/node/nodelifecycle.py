"""The emulated kubelet's node side (SYSTEM.md §5): register one Node per emulated server, keep
it Ready (node status, taints, a Lease in ``kube-node-lease``), and remove it on exit.

Registration gives each Node the SuperPod/rack/server/NPU-type labels, capacity with the NPU
resource, a free loopback /24 as ``spec.podCIDR`` (held with a machine-wide lock so two clusters
on one machine never share pod addresses), and lifts the ``node.kubernetes.io/not-ready`` taint
that admission puts on new nodes. In advertise mode (kind, where real kubelets own the Nodes)
it only labels existing Nodes and patches the NPU resource into their capacity, as the Ascend
device plugin would.

:meth:`NodeLifecycle.publish` shows a node's state on its Node in one go: its status
(allocatable without the faulty NPUs), its taints (computed in one place,
:func:`.nodestatus.node_taints`: unreachable while down, ``matrixserve.io/npu-fault`` while an
NPU is faulty, others' kept) and an ``NPUUnhealthy``/``NPUHealthy`` Event per NPU that changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import defaultdict
from typing import Any

import urllib3
from kubernetes import client

from enginestub.node import allocator, devicestatus
from enginestub.node.events import Events
from enginestub.node.network import (
    POD_LOCKS,
    AddressExhausted,
    NodeAddresses,
    candidate_cidrs,
    lock_cidr,
)
from enginestub.node.nodestatus import (
    UNKNOWN_VERSION,
    allocatable,
    node_status,
    node_taints,
    npu_fault_taint_value,
)
from enginestub.node.state import EmulatorState, NodeState
from matrixserve.api import rfc3339
from matrixserve.api.kinds import (
    ANNOTATION_NODE_EMULATOR,
    LABEL_EMULATED,
    LABEL_PREFIX,
    NPU_RESOURCE,
    TAINT_NPU_FAULT,
)

log = logging.getLogger("enginestub.node")

LEASE_NAMESPACE = "kube-node-lease"
TAINT_ATTEMPTS = 5  # a taint patch is conditional on the Node's resourceVersion: retried on 409


class NodeLifecycle:
    """Registers our Nodes and keeps their status, taints and Leases current."""

    def __init__(self, shared: EmulatorState, events: Events) -> None:
        self.shared = shared
        self.events = events
        self._cidr_locks: list[Any] = []
        # one taint patch at a time per node: each computes the whole list from what it read
        self._taint_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._server_version: str | None = None  # the API server's gitVersion, read once

    async def server_version(self) -> str:
        """The API server's version, which the emulated kubelets report (a kubelet of the
        server's own release: no version skew)."""
        if self._server_version is None:
            try:
                info = await asyncio.to_thread(
                    client.VersionApi(self.shared.core.api_client).get_code
                )
                self._server_version = str(info.git_version)
            except (client.ApiException, urllib3.exceptions.HTTPError) as exc:
                log.warning("the API server's version not read (tried again soon): %s", exc)
                return UNKNOWN_VERSION
        return self._server_version

    def _lock_cidr(self, cidr: str) -> bool:
        """Hold a machine-wide lock on a pod /24 for this process's lifetime; False if held elsewhere."""
        handle = lock_cidr(POD_LOCKS, cidr)
        if handle is None:
            return False
        self._cidr_locks.append(handle)
        return True

    async def register(self) -> None:
        """Create (or take over our own earlier) Nodes, or in advertise mode decorate existing
        ones; every node's device status file is written before its NPUs are advertised."""
        shared = self.shared
        existing = await asyncio.to_thread(shared.core.list_node)
        ours = {s.node_name for s in shared.config.servers}
        by_name = {n.metadata.name: n for n in existing.items}
        taken = [
            n.spec.pod_cidr
            for n in existing.items
            if n.metadata.name not in ours and n.spec.pod_cidr
        ]
        if shared.config.mode == "advertise":
            missing = sorted(ours - set(by_name))
            if missing:
                raise RuntimeError(f"advertise mode: nodes {missing} do not exist")
        else:
            for name in ours & set(by_name):
                labels = by_name[name].metadata.labels or {}
                if labels.get(LABEL_EMULATED) != "true":
                    raise RuntimeError(
                        f"node {name} already exists and is not an emulated node; "
                        "choose another superpod name"
                    )
        fresh = candidate_cidrs(taken)
        for server in shared.config.servers:
            prior = by_name.get(server.node_name)
            if prior is not None and prior.spec.pod_cidr and self._lock_cidr(prior.spec.pod_cidr):
                cidr = prior.spec.pod_cidr
            else:
                cidr = next((c for c in fresh if self._lock_cidr(c)), "")
                if not cidr:
                    raise AddressExhausted("no free pod /24 left in 127.64.0.0/10 on this machine")
            folder = shared.config.state_dir / "nodes" / server.node_name
            state = NodeState(
                server=server,
                addresses=NodeAddresses(cidr),
                allocator=allocator.NodeAllocator(server.npus),
                devices=devicestatus.DeviceStatus(server),
                device_file=folder / "device-status.json",
            )
            shared.nodes[server.node_name] = state
            state.write_device_file()
            if shared.full:
                await self._upsert(state, prior is not None)
            else:
                await self._advertise(state)

    async def _upsert(self, state: NodeState, exists: bool) -> None:
        server = state.server
        meta = {
            "name": server.node_name,
            "labels": server.labels,
            "annotations": {ANNOTATION_NODE_EMULATOR: self.shared.identity},
        }
        spec = {"podCIDR": state.addresses.cidr, "podCIDRs": [state.addresses.cidr]}
        core = self.shared.core
        if not exists:
            await asyncio.to_thread(core.create_node, {"metadata": meta, "spec": spec})
        else:
            await asyncio.to_thread(core.patch_node, server.node_name, {"metadata": meta})
        await self.publish(state)

    async def _advertise(self, state: NodeState) -> None:
        server = state.server
        # Labels first: once the NPUs are allocatable the scheduler may place pods that select
        # on the SuperPod/server labels, so those must already be there.
        labels = {k: v for k, v in server.labels.items() if k.startswith(f"{LABEL_PREFIX}/")}
        labels[LABEL_EMULATED] = "advertised"
        core = self.shared.core
        await asyncio.to_thread(core.patch_node, server.node_name, {"metadata": {"labels": labels}})
        await self.publish(state)

    async def publish(self, state: NodeState) -> None:
        """Show the node's state on its Node: status (allocatable without the faulty NPUs; in
        advertise mode only the NPU resource), taints, and an Event for each NPU that turned
        faulty or healthy since the last publish. An API failure is logged and left to the
        heartbeat loop, which publishes again."""
        faulty = state.devices.faulty_npus()
        turned_faulty = sorted(faulty - state.advertised_faulty)
        turned_healthy = sorted(state.advertised_faulty - faulty)
        state.advertised_faulty = faulty  # before any await: each change is told once
        state.unpublished = True
        name = state.server.node_name
        try:
            if self.shared.full:
                await self.post_status(state)
            else:
                npus = allocatable(state.server.capacity, faulty)[NPU_RESOURCE]
                status = {"capacity": {NPU_RESOURCE: str(state.server.npus)}}
                status["allocatable"] = {NPU_RESOURCE: npus}
                await asyncio.to_thread(
                    self.shared.core.patch_node_status, name, {"status": status}
                )
            await self.set_taints(state)
            state.unpublished = False
        except (client.ApiException, urllib3.exceptions.HTTPError) as exc:
            log.warning("node %s not published (tried again soon): %s", name, exc)
        taint = f"{TAINT_NPU_FAULT}={npu_fault_taint_value(faulty)}:NoSchedule"
        for npu in turned_faulty:
            why = ", ".join(f"{f.kind} on die {f.die}" for f in state.devices.faults_of_npu(npu))
            message = f"NPU {npu} is unhealthy ({why}): no longer allocatable; node tainted {taint}"
            await self.events.node(name, "NPUUnhealthy", message, "Warning")
        for npu in turned_healthy:
            message = f"NPU {npu} is healthy again: allocatable" + (
                f"; node still tainted {taint}" if faulty else "; npu-fault taint removed"
            )
            await self.events.node(name, "NPUHealthy", message, "Normal")

    async def post_status(self, state: NodeState) -> None:
        """Post the node's status, keeping each condition's transition time unless it flipped."""
        name = state.server.node_name
        core = self.shared.core
        current = await asyncio.to_thread(core.read_node_status, name)
        status = node_status(
            state.server,
            state.addresses.host_ip,
            down=state.down,
            faulty=state.devices.faulty_npus(),
            boot_id=self.shared.identity,
            now=time.time(),
            server_version=await self.server_version(),
        )
        before = {c.type: c for c in (current.status.conditions or [])}
        for cond in status["conditions"]:
            old = before.get(cond["type"])
            if old is not None and old.status == cond["status"] and old.last_transition_time:
                cond["lastTransitionTime"] = rfc3339.format_seconds(
                    old.last_transition_time.timestamp()
                )
        await asyncio.to_thread(core.patch_node_status, name, {"status": status})

    async def set_taints(self, state: NodeState) -> None:
        """Put on the Node the taints its state calls for (:func:`.nodestatus.node_taints`),
        keeping everyone else's. The patch is conditional on the resourceVersion read, so a
        taint someone adds meanwhile is never dropped (a conflict reads again)."""
        name = state.server.node_name
        core = self.shared.core
        async with self._taint_locks[name]:
            for attempt in range(TAINT_ATTEMPTS):
                raw = await asyncio.to_thread(core.read_node, name, _preload_content=False)
                node = json.loads(raw.data)
                current = node.get("spec", {}).get("taints") or []
                wanted = node_taints(
                    current,
                    full=self.shared.full,
                    down=state.down,
                    faulty=state.devices.faulty_npus(),
                    now=time.time(),
                )
                if wanted == current:
                    return
                body = {
                    "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                    "spec": {"taints": wanted or None},
                }
                try:
                    await asyncio.to_thread(core.patch_node, name, body)
                    return
                except client.ApiException as exc:
                    if exc.status != 409 or attempt == TAINT_ATTEMPTS - 1:
                        raise

    async def heartbeats(self) -> None:
        """Renew every live node's Lease each ``lease_interval``; re-post node status each
        ``status_interval`` (a down node sends neither: that is what makes it look down); a
        node whose last publish failed is published again."""
        shared = self.shared
        last_status = time.monotonic()
        while True:
            for state in list(shared.nodes.values()):
                if state.down:
                    continue
                if state.unpublished:
                    await self.publish(state)
                if not shared.full:
                    continue
                try:
                    await self._renew_lease(state.server.node_name)
                except client.ApiException as exc:
                    log.warning(
                        "lease renewal for %s failed: %s", state.server.node_name, exc.reason
                    )
            if shared.full and time.monotonic() - last_status >= shared.config.status_interval:
                last_status = time.monotonic()
                for state in list(shared.nodes.values()):
                    if not state.down:
                        with contextlib.suppress(client.ApiException):
                            await self.post_status(state)
            await asyncio.sleep(shared.config.lease_interval)

    async def _renew_lease(self, name: str) -> None:
        now = time.time()
        micro = rfc3339.format(now)
        body = {
            "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": micro},
        }
        coordination = self.shared.coordination
        try:
            await asyncio.to_thread(
                coordination.patch_namespaced_lease, name, LEASE_NAMESPACE, {"spec": body["spec"]}
            )
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            await asyncio.to_thread(coordination.create_namespaced_lease, LEASE_NAMESPACE, body)

    async def delete_nodes(self) -> None:
        """Remove our Nodes and their Leases (``--delete-nodes-on-exit``; full mode only)."""
        shared = self.shared
        if not (shared.config.delete_nodes_on_exit and shared.full):
            return
        for name in shared.nodes:
            with contextlib.suppress(client.ApiException):
                await asyncio.to_thread(shared.core.delete_node, name)
            with contextlib.suppress(client.ApiException):
                await asyncio.to_thread(
                    shared.coordination.delete_namespaced_lease, name, LEASE_NAMESPACE
                )
