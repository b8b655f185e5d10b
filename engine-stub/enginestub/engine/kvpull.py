"""The KV pull (P/D-Serve §3.6, "asynchronous retrieval"), both sides.

- **Prefill side** (:class:`KvHoldings`): after prefill, the prompt's KV (and its prefill slot)
  is held until a decode has pulled it (``POST /v1/kv/{id}/pull`` gives the decode what it needs
  to size the transfer, ``/release`` says it is done); the slot then frees.
- **Decode side** (:class:`KvPuller`): once a decode has a batch slot and HBM for the request, it
  pulls the KV over the fabric; the transfer shares the decode's ingress and the prefill's egress
  fairly (UB inside one SuperPod, else RoCE). A link down to the prefill's dies fails the pull.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from enginestub.engine.parts import Part, Shared
from enginestub.engine.sharing import SharedResource
from enginestub.fabric import Plane, link_bandwidth, link_latency
from matrixserve.api.engine_protocol import EngineError, GenerateRequest, PrefillRef


@dataclass
class PendingKV:
    """KV a prefill holds for a decode to pull."""

    request_id: str
    nbytes: float
    tokens: int
    released: asyncio.Event = field(default_factory=asyncio.Event)
    request: GenerateRequest | None = None  # whose prefill slot is held until the pull is done


class KvHoldings(Part):
    """The prefill's side: the KV it holds, by request, and the pulls under way."""

    def __init__(self, shared: Shared, free_slot: Callable[[GenerateRequest], None]) -> None:
        super().__init__(shared)
        self._free_slot = free_slot  # the prefill slot a pulled (or abandoned) request held
        self.pending: dict[str, PendingKV] = {}
        self.egress_flows = 0  # pulls under way from this instance

    def hold(self, req: GenerateRequest) -> PendingKV:
        """Hold the prompt's KV and its slot for a decode to pull."""
        pending = PendingKV(
            req.request_id, self.kv.bytes_for(req.prompt_tokens), req.prompt_tokens, request=req
        )
        self.pending[req.request_id] = pending
        return pending

    def drop(self, pending: PendingKV) -> None:
        """The request's stream ended: nothing is held for it any more."""
        self.pending.pop(pending.request_id, None)
        self._free_pending_slot(pending)

    def _free_pending_slot(self, pending: PendingKV) -> None:
        if pending.request is not None:
            self._free_slot(pending.request)
            pending.request = None

    def pull_meta(self, request_id: str) -> dict[str, Any]:
        pending = self.pending.get(request_id)
        if pending is None:
            raise EngineError(404, "unknown_request", f"no KV held for request {request_id}")
        self.egress_flows += 1
        return {
            "bytes": pending.nbytes,
            "tokens": pending.tokens,
            "egressFlows": self.egress_flows,
            "roceIps": self.config.roce_ips,
            "node": self.config.node,
            "superpod": self.config.superpod,
        }

    def release(self, request_id: str, nbytes: float) -> None:
        self.egress_flows = max(0, self.egress_flows - 1)
        pending = self.pending.get(request_id)
        if pending is not None:
            pending.released.set()
            self._free_pending_slot(pending)
        self.metrics.kv_bytes.labels(plane=str(self.config.kv_plane), direction="out").inc(nbytes)


class KvPuller(Part):
    """The decode's side: retrieve a request's KV from the prefill that holds it."""

    def __init__(self, shared: Shared, ingress: SharedResource) -> None:
        super().__init__(shared)
        self.ingress = ingress  # this instance's KV plane bandwidth, shared by its pulls

    async def pull(self, request_id: str, prefill: PrefillRef) -> float:
        """Retrieve the KV from the prefill over the fabric (P/D-Serve §3.6); emulated seconds."""
        address = prefill.address
        broken = [ip for ip in prefill.roce_ips if ip in self.faults.links_down]
        if broken:
            raise EngineError(
                502,
                "link_down",
                f"RoCE link to the prefill's device(s) {', '.join(broken)} is down",
            )
        response = await self.http.post(f"http://{address}/v1/kv/{request_id}/pull")
        if response.status_code != 200:
            raise EngineError(
                502,
                "kv_pull_failed",
                f"prefill answered {response.status_code}: {response.text[:200]}",
            )
        meta = response.json()
        nbytes = float(meta["bytes"])
        plane = self.config.kv_plane
        if plane is Plane.UB and meta.get("superpod") != self.config.superpod:
            plane = Plane.ROCE  # UB only reaches inside one SuperPod
        per_die = link_bandwidth(plane, same_node=meta.get("node") == self.config.node)
        egress_cap = (
            per_die
            * len(meta.get("roceIps") or self.config.dies)
            / max(int(meta["egressFlows"]), 1)
        )
        await self.clock.sleep(link_latency(plane, meta.get("node") == self.config.node))
        seconds = await self.ingress.consume(nbytes * self.faults.slow_factor, cap=egress_cap)
        self.metrics.kv_bytes.labels(plane=str(plane), direction="in").inc(nbytes)
        self.metrics.kv_seconds.observe(seconds)
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(
                f"http://{address}/v1/kv/{request_id}/release", json={"bytes": nbytes}
            )
        return seconds
