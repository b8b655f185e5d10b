"""The serving engine: prefill without a queue, KV pulled by decode, continuous-batching decode.

P/D-Serve §3.5-3.6 as the engine sees it. :class:`Engine` is the facade the HTTP server and the
resident process use: its lifecycle (start, model load, close), its health, and each request's
path through the parts, which live in their own modules:

- :mod:`.prefill` — prefill admission (accept or reject, never queue; the baselines' local
  queue) and prefill on the instance's shared compute;
- :mod:`.to_decode` — a prefilled request forwarded to a decode, whose stream is relayed;
- :mod:`.migration` — a request whose decode was lost mid-stream moves to another: the KV still held
  pulled by it, or a re-prefill here with the output so far;
- :mod:`.kvpull` — the KV pull: what a prefill holds for a decode, and the decode's transfer;
- :mod:`.decode` — decode admission and the continuous-batching loop;
- :mod:`.kvcache` — HBM for KV caches;
- :mod:`.faults` — the device status file (P/D-Serve §3.4) and injected faults: a die of this
  instance going unhealthy fails its in-flight requests with a clear error and stops admission;
- :mod:`.heartbeat` — the serving loop's heartbeat and the watchdog that declares a hang;
- :mod:`.linkprobe` — a prefill's probes of its decodes' sub-links (delayed or blocked), and
  the decode's answer;
- :mod:`.streams` — the streams served now, ended with a clear error when this instance is
  logically removed.

The fault-detection tiers the engine sees first (a device fault, a hang, a sub-link delayed or
blocked) are its :meth:`Engine.engine_faults` and :meth:`Engine.link_probes`, which the resident
process writes into the health at once; a faulty engine answers 503 and is not ready.

What a request takes (a prefill slot or a decode place, and its KV) is a
:class:`~enginestub.engine.parts.Hold`, given back once on every path; a hold kept without
progress for :data:`STUCK_BOUNDS` KV-pull wait bounds makes the engine unready (``stuckSlots``
in its health, 503 from ``/readyz``): slots nothing will free are not capacity.

The wire format (request bodies, stream events) is :mod:`matrixserve.api.engine_protocol`.
Every time here is emulated seconds (see :mod:`.clock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx

from enginestub import calibration as cal
from enginestub import timing
from enginestub.engine import fork
from enginestub.engine.bucket import Bucket
from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig
from enginestub.engine.decode import DecodeBatch, Sequence
from enginestub.engine.faults import DeviceFaults
from enginestub.engine.heartbeat import Heartbeat
from enginestub.engine.kvcache import KvBudget
from enginestub.engine.kvpull import KvHoldings, KvPuller, kv_wait_bound
from enginestub.engine.linkprobe import LinkProber, ProbeReceiver, ProbeTarget
from enginestub.engine.metrics import EngineMetrics
from enginestub.engine.parts import Hold, Shared
from enginestub.engine.prefill import Prefill, PrefillTicket
from enginestub.engine.progress import Progress
from enginestub.engine.sharing import SharedResource
from enginestub.engine.streams import OpenStreams
from enginestub.engine.to_decode import DecodeForwarder
from enginestub.fabric import Plane, link_bandwidth, link_latency
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import (
    EngineError,
    Event,
    GenerateRequest,
    PrefillRef,
    TtftBudget,
    error_event,
    synthetic_token,
    token_event,
)

__all__ = ["Engine", "EngineError"]

log = logging.getLogger("enginestub.engine")
_LATE_IN_QUEUE = (
    "waited {seconds:.3f}s in the prefill queue, over the {budget:.3f}s budget; not prefilled"
)
_LATE_FIRST_TOKEN = "first token after {seconds:.3f}s exceeds the {budget:.3f}s budget"


# A hold (prefill slot, decode place) idle for this many KV-pull wait bounds is stuck: every
# wait on another engine gives up after one bound, so one still held after two is held by
# nothing that will free it (such an engine must not look ready).
STUCK_BOUNDS = 2.0


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        metrics: EngineMetrics | None = None,
        clock: Clock | None = None,
        plan: fork.LoadPlan | None = None,
        warm: bool = False,
        started_wall: float | None = None,
        pre_loaded: float = 0.0,
    ) -> None:
        self.config = config
        # Wall time the process began serving us (an engine is built first thing after its
        # start or the zygote's fork; a claimed warm pod's is its claim, given): the health's
        # readyAfter counts from it.
        self.started_wall = time.time() if started_wall is None else started_wall
        # Where the weights come from, and whether this is a claimed warm pod (its
        # TE-Pre-Load paid before it is built: ``pre_loaded`` emulated s, said in its phases,
        # 0 for a pod claimed while warm); DeepServe's phases as they went (emulated s).
        self.plan = plan or fork.LoadPlan(config.load_source)
        self.warm = warm
        self.pre_loaded = pre_loaded
        self.closing: str | None = None  # why this engine is going away, once it is
        self.phases: dict[str, float] = {}
        self.load_source: str = ""  # where the weights actually came from
        # The shared file service's readers (the resident process counts them in ZooKeeper;
        # alone, ``--concurrent-loaders``) and its TE-Load over a lone load's (1: another source)
        self.bucket = Bucket(config.concurrent_loaders)
        self.load_share = 1.0
        self.clock = clock or Clock(config.time_scale)
        self.metrics = metrics or EngineMetrics(config.role)
        self._role: str = config.role  # an "auto" instance's role is set by the resident process
        self.shape = config.shape
        self.loaded = False
        self.load_seconds: float | None = None
        self.on_health_change: Callable[[], None] = lambda: None
        # An attention client (:mod:`.attention`): why it cannot decode now (its pool's map
        # gone, no live server, an expert without a live copy: admission refuses with it, its
        # health says it); and what its load waits for last: its pool's map in force, every
        # expert with a live copy (it could not step before)
        self.experts_unavailable: Callable[[], str | None] = lambda: None
        self.experts_in_force: Callable[[], Awaitable[None]] | None = None
        self.waiting_for: str | None = None  # what a load done waits for, said while not loaded
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), trust_env=False)
        plane_bw = link_bandwidth(config.kv_plane, same_node=False)
        self.kv_ingress = SharedResource(self.clock, plane_bw * config.instance_dies)
        self.compute = SharedResource(self.clock, 1.0)  # 1 emulated second of work per second
        self.decode_peers: list[str] = list(config.decode_peers)  # host:port (resident sets)
        self.decode_entries: list[zl.MapEntry] = []  # the decode meta's, when there is one
        self.removed: set[str] = set()  # host:port of logically removed instances
        self.removal: str | None = None  # why this instance is logically removed, if it is
        # Why it is draining (no new requests; it finishes those it has), if it is,
        # and the marker's time it answers (echoed in its health)
        self.draining: str | None = None
        self.drain_at = 0.0
        self.devices = DeviceFaults(config, self.metrics)
        self.heartbeat = Heartbeat(config, self.clock, self.devices.not_hung)
        self.heartbeat.on_change = self._health_changed
        self.kv = KvBudget(config)
        self._shared = shared = Shared(
            config, self.clock, self.metrics, self.devices, self.kv, self.http, self.heartbeat
        )
        self.prefill = Prefill(shared, self.compute)
        self.holdings = KvHoldings(shared)
        self.forwarder = DecodeForwarder(
            shared,
            self.prefill,
            self.holdings,
            self._open_decodes,
            lambda: self.decode_entries,
            lambda: self.serving,
        )
        self.puller = KvPuller(shared, self.kv_ingress)
        self.batch = DecodeBatch(shared)
        self.prober = LinkProber(
            shared,
            self._probe_targets,
            lambda: self.role == "prefill",
            lambda: self.holdings.egress_flows,
        )
        self.prober.on_change = self._health_changed
        self.receiver = ProbeReceiver(shared, self.kv_ingress, self._backpressure)
        self.streams = OpenStreams()
        # a draining instance says at once that it holds nothing more (it may then leave)
        self.streams.on_empty = lambda: self._health_changed() if self.draining else None
        self.forks = fork.ForkServer(
            config,
            self.clock,
            self.metrics,
            lambda: self.holdings.egress_flows,
            self._why_not_serving,
            lambda: self.devices.slow_factor,
        )
        self.holdings.on_flows_change = self.forks.poke  # a fork shares the KV links
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.hbm_capacity.set(config.kv_capacity_bytes + config.weights_bytes)
        # The gauges read the state at each scrape, so an emptied batch reads 0, not the last size
        # it was set to.
        self.metrics.batch_size.set_function(lambda: len(self.batch.running))
        self.metrics.prefill_slots.set_function(lambda: self.prefill.slots)
        self.metrics.hbm_used.set_function(
            lambda: (config.weights_bytes if self.loaded else 0.0) + self.kv.reserved
        )
        self.metrics.fork_targets.set_function(lambda: self.forks.active)

    @property
    def role(self) -> str:
        return self._role

    @role.setter
    def role(self, role: str) -> None:
        """The role, and the info gauge's one series with it (an "auto" instance learns its role
        from the RoCE map after start)."""
        if role != self._role:
            with contextlib.suppress(KeyError):  # metrics given by the caller, of another role
                self.metrics.info.remove(self._role)
            self.metrics.info.labels(role=role).set(1)
            self._role = role

    # ================================================================ lifecycle
    async def start(self) -> None:
        loops = {
            "decode-loop": self.batch.loop(),
            "loop-beat": self.heartbeat.tick(),
            "hang-watchdog": self.heartbeat.watch(),
            "link-probe": self.prober.loop(),
        }
        if self.config.device_status_file is not None:
            loops["device-file"] = self.devices.watch(
                self.config.device_status_file, self.batch.fail_all, self._devices_changed
            )
        self._tasks = [asyncio.create_task(loop, name=name) for name, loop in loops.items()]

    def shutdown(self, why: str) -> None:
        """The engine is going away (stopped, its resident process closing): it forks nobody
        any more, and the forks under way are aborted (their targets fall back at once)."""
        if self.closing is None:
            self.closing = why
        self.forks.shutdown(why)

    async def close(self) -> None:
        self.shutdown("the engine is closing")
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.forks.close()
        await self.http.aclose()
        await self.prober.client.aclose()

    # ================================================================ start-up (DeepServe §6)
    def _phase(self, name: str, seconds: float) -> None:
        self.phases[name] = round(seconds, 6)
        self.metrics.phase_seconds.labels(phase=name).set(seconds)

    async def pre_load(self) -> None:
        """TE-Pre-Load: Python libraries, NPU state, HCCL (DeepServe §6.1), emulated; nothing
        more for a claimed warm pod, which paid it before it was built (what it paid in this
        process is said: 0 for a pod claimed while warm, the whole for a process restarted in a
        claimed pod)."""
        if self.warm:
            self._phase("TEPreLoad", self.pre_loaded)
            return
        started = self.clock.now()
        await self.clock.sleep(self.config.pre_load_seconds)
        self._phase("TEPreLoad", self.clock.now() - started)

    async def load_model(self) -> float:
        """TE-Load as the plan says (a fork first if one is named, its fallback if it fails),
        then TE-Post-Load (offline-profiled block sizes and one dummy request, §6); the
        instance is loaded after both. Returns TE-Load's emulated seconds."""
        plan, cfg = self.plan, self.config
        started = self.clock.now()
        source, seconds = plan.source, None
        if plan.fork is not None:
            source, seconds = await self._fork_or_fallback(plan.fork, plan.fallback)
        else:
            await self._load_from(source)
        self.load_seconds = self.clock.now() - started if seconds is None else seconds
        self.load_source = str(source)
        if source is timing.LoadSource.SHARED_FILE_SERVICE:
            # TE-Load over a lone load's time: the readers it shared the bucket with, on
            # average (and a failed fork's attempt before it, which a lone load does not pay)
            self.load_share = self.load_seconds / max(self._load_time(source), 1e-9)
        self._phase("TELoad", self.load_seconds)
        self.metrics.load_seconds.labels(source=str(source)).set(self.load_seconds)
        log.info(
            "model %s loaded from %s in %.2f emulated s", cfg.model.name, source, self.load_seconds
        )
        await self.post_load()
        return self.load_seconds

    async def post_load(self) -> None:
        """TE-Post-Load, then the instance is loaded (an expert server has nothing more to load
        before it: its slots come with the expert map, :mod:`.experts`). An attention client is
        loaded once its pool's map is in force too: until then it could not step, so it says
        it is loading (no health, not ready) and its group is not Ready on it."""
        post = self.clock.now()
        await self.clock.sleep(cal.TE_POST_LOAD_SECONDS)
        self._phase("TEPostLoad", self.clock.now() - post)
        if self.experts_in_force is not None:
            self.waiting_for = f"its expert pool {self.config.expert_pool}'s map"
            await self.experts_in_force()
            self.waiting_for = None
        self.loaded = True
        self._health_changed()

    def _load_time(self, source: timing.LoadSource) -> float:
        """A load's emulated seconds from ``source`` alone (the bucket to itself): this pod's
        share of the instance's weights (all of them for an instance of one pod)."""
        seconds = timing.rank_load_seconds(self.config.model, self.shape, source, self.config.ranks)
        if self.role == "expert" or self.config.attention_client:  # its own, not the model's
            return seconds * self.config.weights_bytes / self.config.model.weight_bytes_total
        return seconds

    async def _load_from(self, source: timing.LoadSource) -> None:
        """Load from ``source``: the shared file service is read with whoever reads it now
        (:mod:`.bucket`), every other source alone."""
        if source is timing.LoadSource.SHARED_FILE_SERVICE:
            await self.bucket.read(self.clock, self._load_time(source))
        else:
            await self.clock.sleep(self._load_time(source))

    async def _fork_or_fallback(
        self, ref: zl.ForkRef, fallback: timing.LoadSource
    ) -> tuple[timing.LoadSource, float | None]:
        """NPU-fork from ``ref``'s source; on any failure, the fallback in full after the time
        lost. A fork is given up once it took as long as the fallback would. Returns where the
        weights came from and, for a fork, its TE-Load: the source's emulated transfer plus one
        link latency for its answer (the loopback round trip is wall time, not the model's: at
        a large time scale it would make a UB fork look slower than an SSD); None after a
        fallback (the time measured, the fork's attempt included)."""
        fallback_seconds = self._load_time(fallback)
        bound = max(self.clock.to_wall(fallback_seconds), cal.FORK_WAIT_WALL_FLOOR_SECONDS)
        began = self.clock.now()
        try:
            answer = await fork.fetch(self.http, self.config, ref, bound)
        except fork.ForkFailed as exc:
            log.warning(
                "NPU-fork from %s failed after %.3f emulated s (%s): loading from %s",
                ref.instance,
                self.clock.now() - began,
                exc,
                fallback,
            )
            await self._load_from(fallback)
            return fallback, None
        plane = Plane(ref.plane)
        seconds = float(answer["seconds"]) + link_latency(plane, same_node=False)
        log.info(
            "NPU-forked from %s over %s: %.3f emulated s at the source, position %s",
            ref.instance,
            plane,
            float(answer["seconds"]),
            answer.get("position"),
        )
        return timing.fork_source_for(plane), seconds

    def _check_experts(self) -> None:
        """Admission of an attention client: 503 ``expert_uncovered`` while it cannot decode."""
        why = self.experts_unavailable()
        if why is not None:
            raise EngineError(503, "expert_uncovered", why)

    # ================================================================ health
    @property
    def serving(self) -> bool:
        """Loaded, and neither faulty (a device fault, a hang declared) nor removed."""
        return (
            self.loaded
            and self.devices.healthy
            and self.heartbeat.hang is None
            and self.removal is None
        )

    @property
    def ready(self) -> bool:
        """Serving, and no request held without progress (``/readyz``)."""
        return self.serving and not self.stuck_holds()

    def stuck_bound(self) -> float:
        """Emulated seconds a hold may stay idle before it counts as stuck."""
        return STUCK_BOUNDS * kv_wait_bound(self.config, self.slow_factor)

    def stuck_holds(self) -> int:
        """Prefill slots and decode places held without progress past :meth:`stuck_bound`."""
        now, bound = self.clock.now(), self.stuck_bound()
        return sum(1 for hold in (*self.prefill.held, *self.batch.places) if hold.idle(now) > bound)

    def health(self) -> dict[str, Any]:
        return {
            "instance": self.config.instance,
            "role": self.role,
            "loaded": self.loaded,
            "waitingFor": self.waiting_for,  # what a load done still waits for (an expert map)
            "serving": self.serving,
            "warm": self.warm,
            "phases": dict(self.phases),
            "loadSource": self.load_source,
            "forkTargets": self.forks.active,
            "unhealthyDies": {str(k): v for k, v in sorted(self.unhealthy_dies.items())},
            "faults": self.faults,
            "prefillSlots": {"used": self.prefill.slots, "max": self.config.max_batch},
            "prefillQueue": self.prefill.queue,
            "decodeBatch": {
                "running": len(self.batch.running),
                "joining": len(self.batch.joining),
                "admitted": len(self.batch.places),
                "max": self.config.max_batch,
            },
            "kvReservedBytes": self.kv.reserved,
            "kvEgressFlows": self.holdings.egress_flows,
            "stuckSlots": self.stuck_holds(),
            "stuckAfterSeconds": self.stuck_bound(),
            "engineFaults": [f.model_dump(by_alias=True) for f in self.engine_faults()],
            "loopBeat": self.heartbeat.last_beat_wall,
            "hangAfterSeconds": self.heartbeat.bound,
            "links": [p.model_dump(by_alias=True) for p in self.link_probes()],
            "linkProbeRounds": self.prober.rounds,
            "removed": self.removal,
            "draining": self.draining,
            "streams": len(self.streams),
        }

    def engine_faults(self) -> list[zl.EngineFault]:
        """What makes this instance Faulty: its device faults and a declared hang."""
        hang = self.heartbeat.hang
        return [*self.devices.engine_faults(), *([hang] if hang is not None else [])]

    def link_probes(self) -> list[zl.LinkProbe]:
        """Its sub-links to decodes that probe Delayed or Blocked (a prefill's)."""
        return self.prober.probes()

    async def wait_serving_loop(self) -> None:
        """Until the serving loop runs (not hung), or its hang is declared."""
        await self.heartbeat.until_running_or_declared()

    def check_serving(self) -> None:
        """Raise the 503 of an instance that cannot serve: not loaded, logically removed, a
        device fault, a hang."""
        if not self.loaded:
            waiting = f": waiting for {self.waiting_for}" if self.waiting_for else ""
            raise EngineError(503, "not_ready", f"the model is not loaded yet{waiting}")
        if self.removal is not None:
            raise EngineError(503, "instance_removed", self.removal)
        self.devices.check()
        if self.heartbeat.hang is not None:
            raise EngineError(503, "engine_hung", self.heartbeat.hang.detail)

    def require_role(self, *roles: str) -> None:
        if self.role not in roles:
            raise EngineError(409, "wrong_role", f"this instance is a {self.role} instance")

    def _health_changed(self) -> None:
        self.forks.poke()  # a source that stops serving aborts its forks
        self.on_health_change()  # looked up now: the resident process sets it after start

    def _why_not_serving(self) -> str | None:
        """Why this instance cannot serve (or fork) now, or None. A draining instance forks
        nobody: its pod may go before a broadcast ends."""
        if self.closing is not None:
            return self.closing
        if self.draining is not None:
            return self.draining
        try:
            self.check_serving()
        except EngineError as exc:
            return exc.message
        return None

    def _devices_changed(self) -> None:
        """The device status changed: the health says it now, and the sub-links are probed
        again now (a port down on our side is known without a probe)."""
        self.prober.poke()
        self._health_changed()

    # ================================================================ faults
    @property
    def faults(self) -> dict[str, dict[str, Any]]:
        """Injected faults, by kind."""
        return self.devices.injected

    @property
    def unhealthy_dies(self) -> dict[int, str]:
        return self.devices.unhealthy_dies

    @property
    def device_links_down(self) -> set[str]:
        """Peer RoCE IPs our dies lost a link to."""
        return self.devices.links_down

    @property
    def slow_factor(self) -> float:
        return self.devices.slow_factor

    def rank_faults(self, faults: dict[int, zl.EngineFault]) -> None:
        """The leader of an instance of several pods: its lost or faulty ranks now. A rank
        newly lost is a fault of the instance's dies, taken as one of its own: the requests in
        the batch end with the error, admission refuses (503), the health says it at once."""
        newly = self.devices.set_ranks_lost(faults)
        if newly is not None:
            self.batch.fail_all(f"rank fault: {newly}")
        self._devices_changed()

    def form(self, roce_ips: list[str]) -> None:
        """The leader of an instance of several pods has gathered them: its RoCE IPs are every
        rank's from now on (what its peers link to, probe and pull KV over)."""
        self.config = self._shared.config = self.config.formed(roce_ips)

    def drop_streams(self, why: str) -> int:
        """End every stream this instance serves with ``why``, each giving back what it held
        (its slot, its KV); how many there were."""
        return self.streams.end_all(error_event("instance_reformed", why))

    def inject(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        self.devices.inject(kind, params)
        if kind in ("die-down", "hbm-error"):
            self.batch.fail_all(f"{kind} on this instance")
        self._devices_changed()
        return self.health()

    def heal(self, kind: str) -> dict[str, Any]:
        self.devices.heal(kind)
        self._devices_changed()
        return self.health()

    # ================================================================ prefill (entrance)
    def admit_prefill(self, req: GenerateRequest) -> PrefillTicket:
        """Accept (take a slot) or raise: P/D-Serve's prefill never queues. The caller holds
        the ticket in a ``with`` block around the whole exchange (it gives the slot back)."""
        self.check_serving()
        self.require_role("prefill", "colocated", "attention")
        self._check_not_draining()
        self._check_experts()
        stats = self.metrics.load
        stats.offered += 1
        if (
            self.role == "prefill"
            and req.remaining > 1
            and self.decode_peers
            and not self._open_decodes()
        ):
            # Every decode it knows removed or behind a blocked sub-link: refused
            # now, while the gateway can still try another prefill, rather than failed after the
            # prompt's prefill (a prefill told of no decode yet serves as it always did).
            stats.refused += 1
            raise EngineError(
                503, "no_decode", "no decode instance is available to this prefill now"
            )
        try:
            return self.prefill.admit(req)
        except EngineError as exc:
            if exc.code == "rejected":  # busy (a prompt too long is not the prefills' weakness)
                stats.refused += 1
            raise

    async def generate(self, ticket: PrefillTicket) -> AsyncGenerator[Event, None]:
        """A request accepted by :meth:`admit_prefill`: prefill, then decode (here or remote).
        The slot is given back here as soon as it is not needed, and by the ticket's owner
        on every other way out."""
        req, budget = ticket.request, ticket.request.ttft_budget
        progress = Progress(self.clock, self.config.instance, self.clock.now())
        if ticket.queued:  # time in the local queue counts toward TTFT, as in the baseline
            await self.prefill.wait_for_slot(ticket)
            # P/D-Serve §2.2.2 early intervention: checked before prefill too, so a prompt
            # whose budget ran out in the queue does not use the prefill.
            late = self._ttft_timeout(budget, progress.elapsed(), _LATE_IN_QUEUE)
            if late is not None:
                yield late
                return
        progress.prefill = await self.prefill.run(ticket)
        progress.ttft = ttft = progress.elapsed()
        if req.resume_at == 0:  # a stream resumed here had its first token: no TTFT, no prompt
            self.metrics.ttft.observe(ttft)
            ticket.prefilled(ttft)
        else:
            ticket.prefilled_at = self.clock.now()  # its slot's wait for a decode begins
        # P/D-Serve §3.3: timeouts are checked before and after prefill, not during.
        late = self._ttft_timeout(budget, ttft, _LATE_FIRST_TOKEN)
        if late is not None:
            yield late
            return
        # its first token, or, for a stream that continues here, the next one
        first = req.resume_at
        yield token_event(first, synthetic_token(req.seed, first), ttft)
        if req.remaining == 1:
            yield progress.done(req, req.max_tokens, [], 0.0, self.config.instance)
            return
        if self.role in ("colocated", "attention"):  # decoded here (an attention client alone)
            ticket.release()  # the prompt's KV moves into the decode's reservation
            try:
                hold = self.batch.admit(req.prompt_tokens + req.max_tokens - 1, limit=False)
            except EngineError:
                yield error_event("kv_exhausted", "no HBM left to decode this request")
                return
            seq = Sequence(
                req.request_id,
                req.context_tokens,
                req.remaining - 1,
                hold,
                req.seed,
                first + 1,
            )
            # Inner generators are closed here, not left to the collector: the sequence leaves
            # the batch the moment this stream is closed.
            with hold:
                async with contextlib.aclosing(
                    self.batch.stream(seq, req, progress, 0.0, self.config.instance, offset=1)
                ) as events:
                    async for event in events:
                        yield event
            return
        # The slot (and the KV) is held until a decode has pulled the KV (P/D-Serve §3.5: "a
        # prompt continuously occupies one slot in prefill if it is waiting for KVCache
        # transfer"); kv_release frees it then, while this stream relays the decode's tokens.
        async with contextlib.aclosing(self.forwarder.relay(ticket, progress)) as relay:
            async for event in relay:
                yield event

    def _ttft_timeout(self, budget: TtftBudget | None, seconds: float, why: str) -> Event | None:
        """The error that ends a request ``seconds`` from its arrival, if over its budget."""
        if budget is None or seconds <= budget.emulated_seconds:
            return None
        self.metrics.requests.labels(stage="prefill", outcome="timeout").inc()
        return error_event(
            "ttft_timeout", why.format(seconds=seconds, budget=budget.emulated_seconds)
        )

    # ================================================================ draining
    def _check_not_draining(self) -> None:
        """A draining instance takes no new request (503: the gateway tries another prefill,
        a prefill another decode); what it holds, KV pulls included, it finishes."""
        if self.draining is not None:
            raise EngineError(
                503, "draining", f"{self.draining}: finishing its requests, taking no new ones"
            )

    def drain(self, why: str, at: float) -> None:
        if self.draining is None or self.drain_at != at:
            self.draining, self.drain_at = why, at
            log.info("%s; %d stream(s) to finish", why, len(self.streams))
            self._health_changed()

    def undrain(self) -> None:
        if self.draining is not None:
            self.draining, self.drain_at = None, 0.0
            self._health_changed()

    # ================================================================ logical removal
    def withdraw(self, why: str) -> None:
        """This instance is logically removed: its entrance side closes (new requests get 503
        ``instance_removed``) and every stream it serves ends with that error, each giving back what
        it held."""
        if self.removal is not None:
            return
        self.removal = why
        ending = self.streams.end_all(error_event("instance_removed", why))
        log.warning("%s; ending %d stream(s)", why, ending)
        self._health_changed()

    def readmit(self) -> None:
        """The removal mark is gone (the operator took this instance back)."""
        if self.removal is not None:
            self.removal = None
            self._health_changed()

    # ================================================================ forwarding to decode
    def _probe_targets(self) -> list[ProbeTarget]:
        """The decodes to probe: those this prefill may forward to, blocked ones included (to
        see them come back), by name and RoCE IPs where the decode meta gives them."""
        known = {f"{e.pod_ip}:{e.port}": e for e in self.decode_entries}
        return [
            ProbeTarget(p, known[p].instance, tuple(known[p].roce_ips))
            if p in known
            else ProbeTarget(p)
            for p in self.decode_peers
            if p not in self.removed
        ]

    def _open_decodes(self) -> list[str]:
        """The decodes this prefill may forward to now: not removed, and no sub-link to them
        blocked (its KV moves over all of them)."""
        targets = self._probe_targets()
        blocked = self.prober.blocked(targets)
        return [t.address for t in targets if t.address not in blocked]

    def _backpressure(self) -> str:
        """Why this decode takes no KV now ("" if it does): a full batch pulls nothing until a
        place frees."""
        places, limit = len(self.batch.places), self.config.max_batch
        return f"decode batch full ({places}/{limit})" if places >= limit else ""

    # ================================================================ KV pull (prefill side)
    def kv_pull_meta(self, request_id: str) -> dict[str, Any]:
        meta = self.holdings.pull_meta(request_id)
        # A fork under way shares this instance's links on its plane: one flow more there.
        meta["forkFlows"] = {str(p): self.forks.flows(p) for p in fork.FORK_PLANES}
        return meta

    def kv_release(self, request_id: str) -> None:
        self.holdings.release(request_id)

    # ================================================================ decode
    def admit_decode(self, req: GenerateRequest) -> Hold:
        """A place in the batch and the request's KV, or raise; the caller holds it in a
        ``with`` block around the whole exchange."""
        self.check_serving()
        self.require_role("decode", "attention")
        self._check_not_draining()
        self._check_experts()
        # the KV of the context it starts from, and of every output token to come
        return self.batch.admit(req.prompt_tokens + req.max_tokens - 1)

    async def decode(
        self, hold: Hold, req: GenerateRequest, prefill: PrefillRef
    ) -> AsyncGenerator[Event, None]:
        """A request accepted by :meth:`admit_decode`: pull its KV, then decode it."""
        progress = Progress(self.clock, self.config.instance, self.clock.now())
        try:
            kv_seconds = await self.puller.pull(req.request_id, prefill)
            self.metrics.load.kv_pulls += 1
            self.metrics.load.kv_s += kv_seconds
        except EngineError as exc:
            yield error_event(exc.code, exc.message)
            return
        except httpx.HTTPError as exc:
            yield error_event("kv_pull_failed", f"prefill unreachable: {type(exc).__name__}")
            return
        # its KV: the prompt and the output before the last token made (which its first step
        # reads); its tokens from ``resume_at`` on
        seq = Sequence(
            req.request_id,
            req.context_tokens - 1,
            req.remaining,
            hold,
            req.seed,
            req.resume_at,
        )
        async with contextlib.aclosing(
            self.batch.stream(seq, req, progress, kv_seconds, self.config.instance, offset=0)
        ) as events:
            async for event in events:
                yield event
