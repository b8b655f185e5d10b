"""Fault injection on emulated nodes: the fault-detection container's device status file
(P/D-Serve §3.4, Fig. 8) and the node-down fault (SYSTEM.md §5), driven by the control API
(:mod:`.control`).

A device fault (die, NPU, HBM, RoCE link) rewrites the node's device status file; the pods on
the node see it there, as on a real server. Each also makes its NPU faulty (xDeepServe
§6.2; a link fault as the Ascend device plugin's ``NetworkUnhealthy``): the Node's allocatable
drops by it, it is granted to no new pod, and the Node is tainted ``matrixserve.io/npu-fault``
NoSchedule (:meth:`.NodeLifecycle.publish`); healing gives it all back. A link fault leaves the
die itself up.

A node-down fault is what a dead server looks like to the control plane: its processes are
killed, its Lease and status stop, it turns ``Ready=Unknown`` with the unreachable taints, and its
pods turn not Ready (the node lifecycle controller's part, which the dev cluster does not run).
Then its kubelet does nothing for its pods until the node is back (:mod:`.podlifecycle`): a pod
deleted meanwhile stays Terminating, as with a real dead server.
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

    async def apply_device_faults(
        self, node: str, faults: list[devicestatus.Fault], heal: bool
    ) -> bool:
        """Inject (or heal) device faults together (an NPU's dies: one write, so no reader sees
        one die of a whole-NPU fault first); True if the device status file changed. The Node
        shows its faulty NPUs once this returns (published later if the node is down)."""
        state = self.shared.nodes[node]
        changed = False
        for fault in faults:
            if heal:
                changed |= state.devices.heal(fault.kind, fault.die, fault.peer_roce_ip)
            else:
                changed |= state.devices.inject(fault)
        if changed:
            state.write_device_file()
        if not state.down and state.devices.faulty_npus() != state.advertised_faulty:
            await self.node_lifecycle.publish(state)
        return changed

    async def set_node_down(self, node: str, down: bool) -> bool:
        """Take the node down (or bring it back); True if that changed anything."""
        state = self.shared.nodes[node]
        if state.down == down:
            return False
        state.down = down  # first: from now on its kubelet holds back (or acts again)
        if down:
            self.pod_lifecycle.node_down(node)
        if self.shared.full:
            await self.node_lifecycle.publish(state)
            if down:
                # The node lifecycle controller is off in the dev cluster: we mark the pods not
                # ready, as it would, and in its order: the Node's condition first, then its
                # pods (a controller woken by a pod then finds the server already down).
                await self.pod_lifecycle.mark_not_ready(node)
            await self.events.node(
                node,
                "NodeNotReady" if down else "NodeReady",
                f"Node {node} status is now: {'NodeNotReady (fault injected)' if down else 'NodeReady'}",
                "Warning" if down else "Normal",
            )
        if not down:
            self.pod_lifecycle.node_back(node)
        return True

    def find_pod(self, namespace: str, name: str) -> PodRecord | None:
        """The live pod of that name run here, for the hang fault."""
        for record in self.shared.pods.values():
            if record.namespace == namespace and record.name == name and not record.terminating:
                return record
        return None
