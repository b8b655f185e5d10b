"""The emulator's control API on 127.0.0.1: fault injection for tests, and the per-node device
status that P/D-Serve's MLOps polls "via a Flask request" (§3.4, Fig. 8 ③).

=========================  ==========================================================
``GET /healthz``           ok
``GET /nodes``             emulated nodes: name, superpod, pod CIDR, down, faults, faulty
                           NPUs, allocatable, the taints the emulator keeps on the Node
``GET /nodes/{n}/device-status``  the node's device status file
``GET /pods``              pods run here: node, uid, IP, NPUs, phase, restarts, container
                           pids (what chaos tests count restarts by and kill engines by)
``POST /faults``           inject: body ``{"kind": ..., ...}`` (see :class:`FaultRequest`)
``DELETE /faults``         heal: the same body
=========================  ==========================================================

Kinds and the fields each takes: ``die-down``/``hbm-error`` (``node``, ``die``), ``npu-down``
(``node``, ``npu``: both its dies), ``link-down`` (``node``, ``die`` and ``peerNode`` +
``peerDie``, or ``peerRoceIp``: a RoCE IP in 198.18.0.0/15), ``node-down`` (``node``),
``hang`` (``namespace``, ``pod``). Bad requests (a field the kind does not take included) get
400/404 with a message; nothing is half-applied.
"""

from __future__ import annotations

import ipaddress
import time
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from enginestub.node import podstatus
from enginestub.node.devicestatus import Fault, FaultKind
from enginestub.node.nodestatus import allocatable, node_taints
from enginestub.node.topology import ROCE_NETWORK
from matrixserve.api import rfc3339

if TYPE_CHECKING:
    from enginestub.node.faults import Faults
    from enginestub.node.state import EmulatorState


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["die-down", "npu-down", "link-down", "hbm-error", "node-down", "hang"]
    node: str | None = None
    die: int | None = Field(default=None, ge=0)
    npu: int | None = Field(default=None, ge=0)
    peer_node: str | None = Field(default=None, alias="peerNode")
    peer_die: int | None = Field(default=None, alias="peerDie", ge=0)
    peer_roce_ip: str | None = Field(default=None, alias="peerRoceIp")
    namespace: str | None = None
    pod: str | None = None

    def unused_fields(self) -> list[str]:
        """The fields given that this kind of fault does not take (by their JSON names)."""
        takes = FIELDS_BY_KIND[self.kind]
        given = self.model_fields_set - {"kind"}
        return sorted(FaultRequest.model_fields[f].alias or f for f in given - takes)


FIELDS_BY_KIND: dict[str, frozenset[str]] = {
    "die-down": frozenset({"node", "die"}),
    "hbm-error": frozenset({"node", "die"}),
    "npu-down": frozenset({"node", "npu"}),
    "link-down": frozenset({"node", "die", "peer_node", "peer_die", "peer_roce_ip"}),
    "node-down": frozenset({"node"}),
    "hang": frozenset({"namespace", "pod"}),
}


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ControlServer:
    def __init__(self, state: EmulatorState, faults: Faults) -> None:
        self.state = state
        self.faults = faults
        self.app = web.Application()
        self.app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.get("/nodes", self.list_nodes),
                web.get("/nodes/{node}/device-status", self.device_status),
                web.get("/pods", self.list_pods),
                web.post("/faults", self.inject),
                web.delete("/faults", self.heal),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        addresses = self._runner.addresses
        host_bound, port_bound = addresses[0][0], addresses[0][1]
        return f"http://{host_bound}:{port_bound}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---------------------------------------------------------------- handlers
    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def list_nodes(self, _: web.Request) -> web.Response:
        out = []
        for name, state in sorted(self.state.nodes.items()):
            faulty = state.devices.faulty_npus()
            out.append(
                {
                    "name": name,
                    "superpod": state.server.superpod,
                    "podCIDR": state.addresses.cidr,
                    "hostIP": state.addresses.host_ip,
                    "npus": state.server.npus,
                    "freeNpus": state.allocator.free(),  # granted to no pod (faulty or not)
                    "faultyNpus": sorted(faulty),
                    "allocatable": allocatable(state.server.capacity, faulty),
                    # the taints this emulator keeps on the Node (others' are the API's)
                    "taints": node_taints(
                        [], full=self.state.full, down=state.down, faulty=faulty, now=time.time()
                    ),
                    "down": state.down,
                    "deviceStatusFile": str(state.device_file),
                    "faults": [f.to_json() | {"die": f.die} for f in state.devices.faults],
                }
            )
        return web.json_response(out)

    async def device_status(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        if node not in self.state.nodes:
            return _error(404, f"node {node!r} is not emulated here")
        return web.json_response(self.faults.device_status(node))

    async def list_pods(self, _: web.Request) -> web.Response:
        out = []
        for record in self.state.pods.values():
            runner = record.runner
            containers = list(runner.containers.values()) if runner else []
            if runner is not None:
                phase = podstatus.pod_phase(containers, runner.restart_policy)
            else:
                phase = (record.fixed_status or {}).get("phase", "Pending")
            out.append(
                {
                    "namespace": record.namespace,
                    "name": record.name,
                    "uid": record.uid,
                    "node": record.node,
                    "podIP": record.ip,
                    "npus": record.npus,
                    "phase": phase,
                    "terminating": record.terminating,
                    "restarts": sum(c.restart_count for c in containers),
                    "pids": runner.pids() if runner else {},
                    "containers": {
                        c.name: {"phase": c.phase, "ready": c.ready, "restarts": c.restart_count}
                        for c in containers
                    },
                }
            )
        return web.json_response(out)

    async def inject(self, request: web.Request) -> web.Response:
        return await self._apply(request, heal=False)

    async def heal(self, request: web.Request) -> web.Response:
        return await self._apply(request, heal=True)

    async def _apply(self, request: web.Request, heal: bool) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body must be a JSON object")
        try:
            fault = FaultRequest.model_validate(body)
            result = await self._dispatch(fault, heal)
        except ValidationError as exc:
            return _error(
                400,
                "invalid fault: "
                + "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
                ),
            )
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        return web.json_response(result, status=200 if heal else 201)

    async def _dispatch(self, req: FaultRequest, heal: bool) -> dict[str, Any]:
        faults = self.faults
        unused = req.unused_fields()
        if unused:
            takes = ", ".join(
                FaultRequest.model_fields[f].alias or f for f in sorted(FIELDS_BY_KIND[req.kind])
            )
            raise BadRequest(400, f"{req.kind} takes {takes}; not {', '.join(unused)}")
        if req.kind == "hang":
            if not req.namespace or not req.pod:
                raise BadRequest(400, "hang needs namespace and pod")
            record = faults.find_pod(req.namespace, req.pod)
            if record is None or record.runner is None:
                raise BadRequest(404, f"pod {req.namespace}/{req.pod} is not running here")
            pids = record.runner.hang(stopped=not heal)
            return {"kind": req.kind, "healed": heal, "pids": pids}
        node = self._node(req.node)
        if req.kind == "node-down":
            changed = await faults.set_node_down(node, down=not heal)
            return {"kind": req.kind, "node": node, "healed": heal, "changed": changed}
        server = self.state.nodes[node].server
        dies: list[int]
        if req.kind == "npu-down":
            if req.npu is None or req.npu >= server.npus:
                raise BadRequest(400, f"npu-down needs npu in 0..{server.npus - 1}")
            dies = [d.index for d in server.dies if d.npu == req.npu]
        else:
            if req.die is None or req.die >= len(server.dies):
                raise BadRequest(400, f"{req.kind} needs die in 0..{len(server.dies) - 1}")
            dies = [req.die]
        since = rfc3339.format_seconds(time.time())
        kind = FaultKind(req.kind)
        changed = False
        if kind == FaultKind.LINK_DOWN:
            peer_ip, peer = self._peer(req)
            fault = Fault(kind, dies[0], since, peer_ip)
            changed |= await faults.apply_device_faults(node, [fault], heal)
            if peer is not None:
                own_ip = server.dies[dies[0]].roce_ip
                fault = Fault(kind, peer[1], since, own_ip)
                changed |= await faults.apply_device_faults(peer[0], [fault], heal)
        else:
            batch = [Fault(kind, die, since) for die in dies]
            changed |= await faults.apply_device_faults(node, batch, heal)
        return {
            "kind": req.kind,
            "node": node,
            "dies": dies,
            "healed": heal,
            "changed": changed,
            "generation": self.state.nodes[node].devices.generation,
        }

    def _node(self, name: str | None) -> str:
        if not name:
            raise BadRequest(400, "node is required")
        if name not in self.state.nodes:
            raise BadRequest(404, f"node {name!r} is not emulated here")
        return name

    def _peer(self, req: FaultRequest) -> tuple[str, tuple[str, int] | None]:
        by_node = req.peer_node is not None or req.peer_die is not None
        if by_node and req.peer_roce_ip is not None:
            raise BadRequest(400, "link-down takes peerNode and peerDie, or peerRoceIp: not both")
        if by_node:
            if req.peer_node is None:
                raise BadRequest(400, "link-down needs peerNode with peerDie")
            peer_node = self._node(req.peer_node)
            server = self.state.nodes[peer_node].server
            if req.peer_die is None or req.peer_die >= len(server.dies):
                raise BadRequest(400, f"link-down needs peerDie in 0..{len(server.dies) - 1}")
            return server.dies[req.peer_die].roce_ip, (peer_node, req.peer_die)
        if req.peer_roce_ip is not None:
            try:
                address = ipaddress.ip_address(req.peer_roce_ip)
            except ValueError:
                address = None
            if address is None or address not in ROCE_NETWORK:
                raise BadRequest(
                    400, f"peerRoceIp {req.peer_roce_ip!r} is not a RoCE IP (in {ROCE_NETWORK})"
                )
            return str(address), None
        raise BadRequest(400, "link-down needs peerNode and peerDie, or peerRoceIp")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
