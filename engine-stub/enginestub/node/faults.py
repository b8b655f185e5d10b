"""Fault injection on emulated nodes: the fault-detection container's device status file
(P/D-Serve §3.4, Fig. 8) and the node-down fault (SYSTEM.md §5), driven by the control API
(:mod:`.control`).

A device fault (die, NPU, HBM, RoCE link) only rewrites the node's device status file; the pods
on the node see it there, as on a real server. A node-down fault is what a dead server looks like
to the control plane: its processes are killed, its Lease and status stop, it turns
``Ready=Unknown`` with the unreachable taints, and its pods turn not Ready.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from enginestub.node import devicestatus
from enginestub.node.events import Events
from enginestub.node.nodelifecycle import NodeLifecycle
from enginestub.node.podlifecycle import PodLifecycle
from enginestub.node.state import EmulatorState, PodRecord


@dataclass
class Faults:
    """Injects and heals faults on our nodes and pods."""

    shared: EmulatorState
    node_lifecycle: NodeLifecycle  # a node-down fault stops its status and taints it
    pod_lifecycle: PodLifecycle  # ... and turns its pods not Ready
    events: Events

    def device_status(self, node: str) -> dict[str, Any]:
        """The node's device status file, as its pods read it."""
        state = self.shared.nodes[node]
        content: dict[str, Any] = json.loads(state.device_file.read_text())
        return content

    def apply_device_fault(self, node: str, fault: devicestatus.Fault, heal: bool) -> bool:
        """Inject (or heal) one device fault; True if the device status file changed."""
        state = self.shared.nodes[node]
        if heal:
            changed = state.devices.heal(fault.kind, fault.die, fault.peer_roce_ip)
        else:
            changed = state.devices.inject(fault)
        if changed:
            state.write_device_file()
        return changed

    async def set_node_down(self, node: str, down: bool) -> bool:
        """Take the node down (or bring it back); True if that changed anything."""
        state = self.shared.nodes[node]
        if state.down == down:
            return False
        state.down = down
        records = [r for r in self.shared.pods.values() if r.node == node]
        for record in records:
            if record.runner is None:
                continue
            if down:
                record.runner.kill()
            else:
                record.runner.revive()
        if self.shared.full:
            # The node lifecycle controller is off in the dev cluster: we mark pods not ready
            # (as it would) by rendering them with node_ready=False.
            for record in records:
                self.pod_lifecycle.mark_dirty(record.uid)
            await self.node_lifecycle.post_status(state)
            await self.node_lifecycle.set_taints(state)
            await self.events.node(
                node,
                "NodeNotReady" if down else "NodeReady",
                f"Node {node} status is now: {'NodeNotReady (fault injected)' if down else 'NodeReady'}",
                "Warning" if down else "Normal",
            )
        return True

    def find_pod(self, namespace: str, name: str) -> PodRecord | None:
        """The live pod of that name run here, for the hang fault."""
        for record in self.shared.pods.values():
            if record.namespace == namespace and record.name == name and not record.terminating:
                return record
        return None
