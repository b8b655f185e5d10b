"""Link probing (detection tier "link"; xDeepServe §6.1, notes/000.md B30): a delayed
sub-link told from a blocked one.

"Failures in this path, such as a KV cache failing to transfer, are often due to resource
saturation rather than transport errors ... injecting dummy payloads into the channel, we
differentiate between decode-side saturation (which delays dummy data) and link-level faults
(which block all transmission)." Both sides live here:

- **The prefill** (:class:`LinkProber`) sends each decode it may forward to (the decode meta,
  less the logically removed) one small request every ``--link-probe-interval`` emulated s
  (:data:`~enginestub.calibration.LINK_PROBE_INTERVAL_SECONDS`, never more often than
  :data:`~enginestub.calibration.LINK_PROBE_WALL_FLOOR_SECONDS` of wall time): one dummy payload
  over all the sub-links of the pair it can send on, as KV goes: one per decode die, named by
  its index, from the prefill die :mod:`matrixserve.api.kvmapping` pairs it with (device k <->
  device k for the same size; CloudMatrix-Infer §4.3.3's mapping otherwise). A
  sub-link is **Blocked** when it was never delivered: down on our side (we cannot send on it),
  down on the decode's (the decode says so), or no answer within
  :data:`~enginestub.calibration.LINK_PROBE_TIMEOUT_WALL_SECONDS`; **Delayed** when delivered
  later than :data:`~enginestub.calibration.PROBE_DELAY_FACTOR` times its transfer alone (the
  decode's KV ingress shared with its pulls, a slow device) or held back by the decode's
  backpressure (its batch full: it takes no KV until a place frees). A decode that refuses the
  connection (nothing listens) says nothing of the link: its process is gone, which other tiers
  see. Each round is bounded by the timeout and keeps no task past it, whatever the meta does.
- **The decode** (:class:`ProbeReceiver`) answers from the fabric model, never from the wall
  clock (whose jitter on a loaded machine, times the time scale, would read as a busy link): the
  dummy's share of its KV ingress beside the pulls under way (max-min fair, one more flow out
  of the prefill), its sub-links down, its backpressure. The answer comes from the transport,
  not the serving loop (RDMA is one-sided): a hung decode's links still probe healthy.

A prefill never forwards to a decode with a Blocked sub-link (its KV moves over all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from enginestub import calibration as cal
from enginestub.engine.parts import Part, Shared
from enginestub.engine.sharing import SharedResource
from enginestub.fabric import link_bandwidth, link_latency
from matrixserve.api import kvmapping
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError

log = logging.getLogger("enginestub.engine")
PROBE_PATH = "/v1/link/probe"
UNANSWERED_ROUNDS = 2  # probes in a row a decode must leave unanswered for Blocked
PROBE_CONNECTIONS = 64  # the prober's own pool: one probe per decode at a time


@dataclass(frozen=True)
class ProbeTarget:
    """A decode to probe: where it listens and, when the decode meta says, who it is."""

    address: str  # host:port
    instance: str = ""
    roce_ips: tuple[str, ...] = ()  # by device index


@dataclass(frozen=True)
class Probe:
    """A probe as the decode receives it."""

    instance: str  # the prefill
    roce_ips: tuple[str, ...]  # the prefill's, by device index
    devices: tuple[int, ...]  # the sub-links it sent on (by decode die)
    nbytes: float
    egress_flows: int  # KV pulls out of the prefill now: the dummy is one more
    tp: int | None = None  # the prefill's (None: its dies, an engine from before it was said)

    def body(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "roceIps": list(self.roce_ips),
            "devices": list(self.devices),
            "bytes": self.nbytes,
            "egressFlows": self.egress_flows,
            **({} if self.tp is None else {"tp": self.tp}),
        }


# A sub-link's verdict: its state, the peer's RoCE IP on it, and the instance whose device status
# says its port is down ("" when none says so).
_Verdicts = dict[int, tuple[zl.LinkState, str, str]]


class ProbeReceiver(Part):
    """The decode's side: where a probe's dummy payload lands, and when (modelled)."""

    def __init__(
        self, shared: Shared, ingress: SharedResource, backpressure: Callable[[], str]
    ) -> None:
        super().__init__(shared)
        self.ingress = ingress  # the KV plane into this instance, shared by its pulls
        self._backpressure = backpressure  # why this instance takes no KV now ("" if it does)

    def receive(self, probe: Probe) -> dict[str, Any]:
        cfg = self.config
        try:
            sources = kvmapping.source_dies(
                kvmapping.Side.of(len(probe.roce_ips), probe.tp),
                kvmapping.Side.of(len(cfg.roce_ips), cfg.tp),
            )
        except ValueError as exc:
            raise EngineError(409, "device_mismatch", str(exc)) from None
        down = self.faults.links_down
        blocked = {
            j: f"RoCE link down to {probe.roce_ips[sources[j]]}"
            for j in probe.devices
            if j < len(sources) and probe.roce_ips[sources[j]] in down
        }
        # The pair's sub-links run from every die of the smaller side (the mapping spreads them):
        # its dies' links bound the dummy's rate.
        dies = min(cfg.instance_dies, len(probe.roce_ips))
        link = link_bandwidth(cfg.kv_plane, same_node=False) * dies
        latency = link_latency(cfg.kv_plane, same_node=False)
        # The dummy is one more flow out of the prefill and one more into this instance.
        share = self.ingress.share_for(link / (probe.egress_flows + 1))
        return {
            "instance": cfg.instance,
            "roceIps": cfg.roce_ips,
            "tp": cfg.tp,
            "blocked": {str(k): why for k, why in blocked.items()},
            "seconds": latency + probe.nbytes * self.faults.slow_factor / share,
            "aloneSeconds": latency + probe.nbytes / link,
            "latencySeconds": latency,
            "shareOfLink": share / link,
            "backpressure": self._backpressure(),
        }


def verdicts(
    answer: dict[str, Any], devices: tuple[int, ...], peer_ips: tuple[str, ...]
) -> _Verdicts:
    """The decode's answer as each probed sub-link's state (the unhealthy ones only); a
    sub-link it says is down is down at its end (its device status says so)."""
    peer = str(answer.get("instance") or "?")
    blocked = {int(k) for k in answer.get("blocked", {})}
    latency = float(answer.get("latencySeconds", 0.0))  # the same either way: not a delay
    late = bool(answer.get("backpressure")) or float(answer["seconds"]) - latency > (
        cal.PROBE_DELAY_FACTOR * (float(answer["aloneSeconds"]) - latency)
    )
    out: _Verdicts = {}
    for k in devices:
        if peer_ips and k >= len(peer_ips):  # sent before the decode's dies were known
            continue
        ip = peer_ips[k] if k < len(peer_ips) else ""
        if k in blocked:
            out[k] = (zl.LinkState.BLOCKED, ip, peer)
        elif late:
            out[k] = (zl.LinkState.DELAYED, ip, "")
    return out


class LinkProber(Part):
    """The prefill's side: its decodes' sub-links, probed every interval."""

    def __init__(
        self,
        shared: Shared,
        targets: Callable[[], list[ProbeTarget]],
        active: Callable[[], bool],
        egress_flows: Callable[[], int],
    ) -> None:
        super().__init__(shared)
        self._targets = targets  # the decodes this prefill may forward to, removed ones not
        self._active = active  # a prefill now (an "auto" instance learns its role later)
        self._egress_flows = egress_flows
        self.on_change: Callable[[], None] = lambda: None
        self.states: dict[str, dict[int, zl.LinkProbe]] = {}  # by decode address: unhealthy
        self._learned: dict[str, tuple[str, ...]] = {}  # RoCE IPs a decode answered with
        self._unanswered: dict[str, int] = {}  # consecutive probes a decode did not answer
        self._poked = asyncio.Event()
        self.rounds = 0
        # Probes have a client of their own: the engine's carries one long-lived relay stream
        # per request in flight, and a probe queued behind them for a connection would read as
        # a link that delivers nothing.
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=PROBE_CONNECTIONS), trust_env=False
        )

    # ------------------------------------------------------------------ what it found
    def probes(self) -> list[zl.LinkProbe]:
        """Every sub-link that probed unhealthy, with since when."""
        return [p for address in sorted(self.states) for p in self.states[address].values()]

    def _peer_ips(self, target: ProbeTarget) -> tuple[str, ...]:
        return target.roce_ips or self._learned.get(target.address, ())

    def blocked(self, targets: list[ProbeTarget]) -> set[str]:
        """The addresses of ``targets`` with a sub-link blocked: probed so, or down on our side
        now (we cannot send on it; no need to wait for a probe to know)."""
        down = self.faults.links_down
        return {
            t.address
            for t in targets
            if any(p.state is zl.LinkState.BLOCKED for p in self.states.get(t.address, {}).values())
            or any(ip in down for ip in self._peer_ips(t))
        }

    # ------------------------------------------------------------------ probing
    def poke(self) -> None:
        """Probe again now: our device status changed (a port down on our side needs no probe
        to be known, and must not wait for the next round to be said)."""
        self._poked.set()

    async def loop(self) -> None:
        interval = self.config.link_probe_interval
        while True:
            began = time.monotonic()
            self._poked.clear()
            await self.round()
            pause = max(self.clock.to_wall(interval), cal.LINK_PROBE_WALL_FLOOR_SECONDS)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(pause - (time.monotonic() - began), 0.0)):
                    await self._poked.wait()

    async def round(self) -> None:
        """Probe every target once (together; each bounded by the timeout); keep the states of
        the targets probed, since when each has been so."""
        targets = self._targets() if self._active() else []
        found = await asyncio.gather(*(self._probe(t) for t in targets))
        now = time.time()
        states: dict[str, dict[int, zl.LinkProbe]] = {}
        for target, verdict in zip(targets, found, strict=True):
            if verdict is None:  # nothing to say of this decode's links this round
                continue
            before = self.states.get(target.address, {})
            states[target.address] = {
                k: (
                    before[k]
                    if k in before and (before[k].state, before[k].down_at) == (state, down_at)
                    else zl.LinkProbe(
                        peer=verdict.peer,
                        device=k,
                        peerRoceIp=ip,
                        state=state,
                        since=now,
                        downAt=down_at,
                    )
                )
                for k, (state, ip, down_at) in sorted(verdict.subs.items())
            }
        changed = _shape(states) != _shape(self.states)
        self.states = states
        self.rounds += 1
        if changed:
            self.on_change()

    async def _probe(self, target: ProbeTarget) -> _Verdict | None:
        """One decode's sub-links: what our side cannot send, and what the decode says of the
        rest; all Blocked without an answer in time; None if the decode is not there."""
        cfg = self.config
        peer_ips = self._peer_ips(target)
        # One sub-link per decode die (kvmapping); its dies not known yet, as many as ours (the
        # decode answers for those it has).
        count = len(peer_ips) or len(cfg.roce_ips)
        ours = {
            k for k in range(count) if k < len(peer_ips) and peer_ips[k] in self.faults.links_down
        }
        subs: _Verdicts = {
            k: (zl.LinkState.BLOCKED, peer_ips[k], cfg.instance) for k in sorted(ours)
        }
        devices = tuple(k for k in range(count) if k not in ours)
        name = target.instance or target.address
        if not devices:
            return _Verdict(name, subs)
        probe = Probe(
            cfg.instance,
            tuple(cfg.roce_ips),
            devices,
            cal.LINK_PROBE_BYTES,
            self._egress_flows(),
            cfg.tp,
        )
        try:
            async with asyncio.timeout(cal.LINK_PROBE_TIMEOUT_WALL_SECONDS):
                response = await self.client.post(
                    f"http://{target.address}{PROBE_PATH}", json=probe.body()
                )
            self._unanswered.pop(target.address, None)
            if response.status_code != 200:
                log.warning(
                    "link probe to %s answered %s: %s",
                    name,
                    response.status_code,
                    response.text[:200],
                )
                return None
            answer = response.json()
            learned = tuple(str(ip) for ip in answer.get("roceIps", []))
            self._learned[target.address] = learned
            subs.update(verdicts(answer, devices, target.roce_ips or learned))
            return _Verdict(target.instance or str(answer.get("instance") or name), subs)
        except (TimeoutError, httpx.TimeoutException):
            # never delivered within the probe timeout: blocked, as a link that carries nothing,
            # once it happened UNANSWERED_ROUNDS times in a row (one late answer on a loaded
            # machine is no link fault)
            missed = self._unanswered[target.address] = self._unanswered.get(target.address, 0) + 1
            if missed < UNANSWERED_ROUNDS:
                return _Verdict(name, subs) if subs else None
            subs.update(
                {
                    k: (zl.LinkState.BLOCKED, peer_ips[k] if k < len(peer_ips) else "", "")
                    for k in devices
                }
            )
            return _Verdict(name, subs)
        except httpx.HTTPError as exc:  # refused: no process there (not a link's doing)
            log.info("link probe to %s: %s", name, type(exc).__name__)
            return None
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("link probe to %s: an answer that is not one", name)
            return None


@dataclass(frozen=True)
class _Verdict:
    peer: str  # the decode instance (its address, when not known by name)
    subs: _Verdicts


def _shape(
    states: dict[str, dict[int, zl.LinkProbe]],
) -> set[tuple[str, int, zl.LinkState, str]]:
    return {(a, k, p.state, p.down_at) for a, subs in states.items() for k, p in subs.items()}
