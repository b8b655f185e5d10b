"""The KV pull (P/D-Serve §3.6, "asynchronous retrieval"), both sides.

- **Prefill side** (:class:`KvHoldings`): after prefill, the prompt's KV (and its prefill slot)
  is held until a decode has pulled it (``POST /v1/kv/{id}/pull`` gives the decode what it needs
  to size the transfer, ``/release`` says it is done); the slot then frees.
- **Decode side** (:class:`KvPuller`): once a decode has a batch slot and HBM for the request, it
  pulls the KV over the fabric; the transfer shares the decode's ingress and the prefill's egress
  fairly (UB inside one SuperPod, else RoCE), over the sub-links of the DP group it decodes on
  (:func:`enginestub.timing.kv_pull_links`: the mapping's, whatever the two sizes). A link down
  to the prefill's dies fails the pull.

Both sides wait on the other at most :func:`kv_wait_bound`. The flows out of a prefill are counted
from what it holds (a pull asked for and not yet released), so an abandoned pull is never counted
for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from enginestub import timing
from enginestub.engine.config import EngineConfig
from enginestub.engine.parts import Part, Shared
from enginestub.engine.prefill import PrefillTicket
from enginestub.engine.sharing import SharedResource
from enginestub.fabric import Plane, link_bandwidth, link_latency
from matrixserve.api.engine_protocol import EngineError, PrefillRef

# The wall time a wait on another engine may take on top of the modelled transfer: loopback
# HTTP round trips and event-loop pauses on a loaded machine, which are wall time whatever the
# time scale (a second or two at worst on a busy 2-core machine; 5 s leaves room).
WAIT_FLOOR_WALL_SECONDS = 5.0


def kv_wait_bound(config: EngineConfig, slow_factor: float) -> float:
    """The KV-pull wait bound (emulated s): how long a request's KV may wait, with no sign of
    progress, for a decode to take the request and pull it (the prefill's side), and how long a
    decode's pull may take (the decode's side).

    Twice the time to move every byte of KV this instance can hold through its KV links at
    the slowest plane a pull may use (HBM bounds the KV in flight out of a prefill, and into a
    decode; every die of either side has a sub-link of each pair, :mod:`matrixserve.api.kvmapping`,
    so its own dies' links carry its own KV), slowed by any injected slow factor; never under
    :data:`WAIT_FLOOR_WALL_SECONDS` of wall time."""
    planes = {config.kv_plane, Plane.ROCE}  # UB reaches only inside a SuperPod: RoCE beyond
    link = min(link_bandwidth(p, same_node=False) for p in planes) * config.instance_dies
    transfer = 2.0 * config.kv_capacity_bytes / link * slow_factor
    return max(transfer, WAIT_FLOOR_WALL_SECONDS * config.time_scale)


@dataclass
class PendingKV:
    """KV a prefill holds for a decode to pull, with the prefill slot of its request."""

    request_id: str
    nbytes: float
    tokens: int
    ticket: PrefillTicket  # its slot and KV: given back once pulled, or when its stream ends
    released: asyncio.Event = field(default_factory=asyncio.Event)
    pulling: bool = False  # a decode asked for it and has not said it is done


class KvHoldings(Part):
    """The prefill's side: the KV it holds, by request, and the pulls under way."""

    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self.pending: dict[str, PendingKV] = {}
        # Told when the pulls under way change: an NPU-fork out of this instance shares its
        # links with them.
        self.on_flows_change: Callable[[], None] = lambda: None

    @property
    def egress_flows(self) -> int:
        """Pulls under way from this instance (derived, so an abandoned pull never counts)."""
        return sum(1 for p in self.pending.values() if p.pulling)

    def hold(self, ticket: PrefillTicket) -> PendingKV:
        """Hold the prompt's KV and its slot for a decode to pull."""
        req = ticket.request
        tokens = req.context_tokens  # the prompt and any output re-prefilled with it
        pending = PendingKV(req.request_id, self.kv.bytes_for(tokens), tokens, ticket)
        self.pending[req.request_id] = pending  # a later request of the same id replaces it
        return pending

    def drop(self, pending: PendingKV) -> None:
        """The request's stream ended: nothing is held for it any more."""
        if self.pending.get(pending.request_id) is pending:
            del self.pending[pending.request_id]
        self.unpulled(pending)
        pending.ticket.release()

    def unpulled(self, pending: PendingKV) -> None:
        """No pull of ``pending`` is under way (ended, or its decode was lost mid-pull: the
        KV stays held for the next decode, its link no longer used)."""
        if pending.pulling:
            pending.pulling = False
            self.on_flows_change()

    def pull_meta(self, request_id: str) -> dict[str, Any]:
        pending = self.pending.get(request_id)
        if pending is None or pending.released.is_set():
            raise EngineError(404, "unknown_request", f"no KV held for request {request_id}")
        if not pending.pulling:
            pending.pulling = True
            self.on_flows_change()
        pending.ticket.progressed()  # a decode is pulling it
        return {
            "bytes": pending.nbytes,
            "tokens": pending.tokens,
            "egressFlows": self.egress_flows,
            "roceIps": self.config.roce_ips,
            "node": self.config.node,
            "superpod": self.config.superpod,
        }

    def release(self, request_id: str) -> None:
        """The decode has the KV: free the slot (the prefill's own count of the bytes moved)."""
        pending = self.pending.get(request_id)
        if pending is None or pending.released.is_set():
            return
        pending.released.set()
        self.unpulled(pending)
        pending.ticket.release()
        self.metrics.kv_bytes.labels(plane=str(self.config.kv_plane), direction="out").inc(
            pending.nbytes
        )


@dataclass(frozen=True)
class _KvMeta:
    """What the prefill says of the KV a decode pulls (its ``/pull`` answer)."""

    nbytes: float
    egress_flows: int
    dies: int  # its RoCE addresses, one a die (0: not said)
    node: object
    superpod: object
    fork_flows: dict[str, int]  # NPU-fork broadcasts out of it, by plane

    @classmethod
    def parse(cls, meta: Any) -> _KvMeta:
        """Raises ValueError, TypeError or KeyError on an answer that is not one."""
        if not isinstance(meta, dict):
            raise TypeError("not an object")
        nbytes = float(meta["bytes"])
        if not 0 <= nbytes < float("inf"):
            raise ValueError("bytes out of range")
        ips = meta.get("roceIps")
        forks = meta.get("forkFlows") or {}
        if not isinstance(forks, dict):
            raise TypeError("forkFlows is not an object")
        return cls(
            nbytes,
            _flows(meta["egressFlows"], 1, MAX_EGRESS_FLOWS),
            len(ips) if isinstance(ips, list) else 0,
            meta.get("node"),
            meta.get("superpod"),
            {str(plane): _flows(n, 0, 1) for plane, n in forks.items()},
        )


# A prefill's pulls under way are at most its slots (EngineConfig.max_batch's bound), and a
# source broadcasts on a plane through one chain: counts beyond are not believed.
MAX_EGRESS_FLOWS = 4096


def _flows(value: Any, low: int, high: int) -> int:
    """A flow count from a peer's answer, clamped to ``[low, high]``; ValueError or TypeError
    when it is not a number (``inf`` and ``NaN`` included)."""
    try:
        count = int(value)
    except OverflowError:
        raise ValueError(f"flow count {value!r} out of range") from None
    return min(max(count, low), high)


class KvPuller(Part):
    """The decode's side: retrieve a request's KV from the prefill that holds it."""

    def __init__(self, shared: Shared, ingress: SharedResource) -> None:
        super().__init__(shared)
        self.ingress = ingress  # this instance's KV plane bandwidth, shared by its pulls

    async def pull(self, request_id: str, prefill: PrefillRef) -> float:
        """Retrieve the KV from the prefill over the fabric (P/D-Serve §3.6); emulated seconds.
        Bounded by :func:`kv_wait_bound` (a prefill that does not answer fails the pull with
        504 ``kv_pull_timeout``, and the request leaves the batch)."""
        bound = kv_wait_bound(self.config, self.faults.slow_factor)
        try:
            async with asyncio.timeout(self.clock.to_wall(bound)):
                return await self._pull(request_id, prefill)
        except TimeoutError:
            raise EngineError(
                504, "kv_pull_timeout", f"the KV pull took over {bound:.3f}s (the bound)"
            ) from None
        except httpx.InvalidURL:
            raise EngineError(400, "invalid_request", "prefill.address is not host:port") from None

    async def _pull(self, request_id: str, prefill: PrefillRef) -> float:
        address = prefill.address
        url = f"http://{address}/v1/kv/{quote(request_id, safe='')}"
        broken = [ip for ip in prefill.roce_ips if ip in self.faults.links_down]
        if broken:
            raise EngineError(
                502,
                "link_down",
                f"RoCE link to the prefill's device(s) {', '.join(broken)} is down",
            )
        response = await self.http.post(f"{url}/pull")
        if response.status_code != 200:
            raise EngineError(
                502,
                "kv_pull_failed",
                f"prefill answered {response.status_code}: {response.text[:200]}",
            )
        try:
            meta = _KvMeta.parse(response.json())
        except (ValueError, TypeError, KeyError, OverflowError):
            raise EngineError(
                502, "kv_pull_failed", "the prefill's KV metadata is not understood"
            ) from None
        nbytes = meta.nbytes
        plane = self.config.kv_plane
        if plane is Plane.UB and meta.superpod != self.config.superpod:
            plane = Plane.ROCE  # UB only reaches inside one SuperPod
        same_node = meta.node == self.config.node
        per_die = link_bandwidth(plane, same_node=same_node)
        # The prefill's egress, shared fairly by its pulls and any fork broadcast on this plane
        # (a share fixed at the pull's start).
        flows = meta.egress_flows + meta.fork_flows.get(str(plane), 0)
        # Its decode DP group's links, each from a distinct prefill die (the mapping's).
        links = timing.kv_pull_links(self.config.tp, meta.dies or self.config.instance_dies, flows)
        egress_cap = per_die * links
        await self.clock.sleep(link_latency(plane, same_node))
        seconds = await self.ingress.consume(nbytes * self.faults.slow_factor, cap=egress_cap)
        self.metrics.kv_bytes.labels(plane=str(plane), direction="in").inc(nbytes)
        self.metrics.kv_seconds.observe(seconds)
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(f"{url}/release", json={"bytes": nbytes})
        return seconds
