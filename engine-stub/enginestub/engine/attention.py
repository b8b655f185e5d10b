"""An attention client (``ENGINE_ROLE=attention``, or a P/D group's decode given an expert pool):
a decode whose MoE layers are served by the pool's expert servers (EaaS §3.1: "stateful
attention clients"; xDeepServe §5.2, §7.1).

It is a decode as any other (the same batch, streams and endpoints, :mod:`.decode`): a P/D
group's decode (its role ``decode``, from the RoCE map or given: KV from the prefills, links,
health and entrances as any decode's), or alone (no group: ``/v1/generate`` prefills here and
decodes through the experts, for benchmarks). What differs: its weights are the non-expert
ones; it is loaded (healthy, ready) only once its pool's map is in force with every expert
covered (:meth:`AttentionClient.in_force`: before, it could not step, and a group counting it
Ready would send it requests it cannot decode); and what a step costs
(:class:`AttentionClient` is the batch's :class:`~enginestub.engine.decode.StepModel`):

1. **Plan** (:mod:`enginestub.disaggregated`): the batch in microbatches (§5.2: two); per layer
   and microbatch the attention dies' roofline; per MoE layer the tokens each expert gets
   (popularity: uniform, Zipf or a trace), spread over the servers that hold it enabled in the
   map in force, rotating by token position (xDeepServe §4.5 step 4). A new map version is used
   from the next iteration on.
2. **One message per server per iteration** (EaaS §3.2: one buffer slot per client on each
   server): every layer's and microbatch's tokens for it, to ``/v1/expert/forward``.
3. **Time**: a layer ends at its slowest server (the combine barrier, notes 000 §3.6), A2E and
   E2A from the calibration (000 §3.3), the microbatches overlapping the hops (§7.1):
   :func:`enginestub.disaggregated.iteration_seconds`.

Failover (EaaS §3.4, Fig. 6 ①(a)/①(b)): a server whose report is gone (the monitor's offline
event), or that does not answer within the failover timeout, or refuses the connection, is
dropped from this client's routes (until it reports again) and its part of the iteration is
re-sent at once to replicas (one more message per replica that gets some). Tokens a server
says it does not hold (409, a map moving under it) go to a replica the same way. The failover
timeout is the pool's (``spec.failoverTimeoutMilliseconds``, carried by the map pointer, in force
from the next message on) when the pointer carries one, else the client's own
(``ENGINE_EXPERT_FAILOVER_MS``); never under a wall floor (a loopback round trip).

**An expert with no live copy** (its last server failed): the iteration is held, at most the
failover timeout, for a map or a server that covers it again; past that the batch fails with
``expert_uncovered`` (every request in it: with top-k of the experts over every MoE layer, each
request's tokens reach nearly every expert), and admission refuses with 503
``expert_uncovered`` while it lasts, so the gateway or the prefill sends elsewhere. Chosen over
failing at once because the controller's new map usually comes within the bound (a replica
elsewhere is made a route), and over holding without bound because a request's TPOT budget is
finite.

**Monolithic mode** (``ENGINE_EXPERT_MODE=monolithic``, the baseline: one static EP group,
EaaS §2.2 "bringing the entire serving instance to a halt"): when any server of the map's table
is gone or fails, no iteration runs until every one of them is back (registered and
``Serving``); the batch waits, it does not fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

from enginestub import calibration as cal
from enginestub import disaggregated as dis
from enginestub.engine.core import Engine
from enginestub.engine.decode import Sequence
from enginestub.engine.expertpool import ExpertMap, PoolSession
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError

log = logging.getLogger("enginestub.attention")

# a probe sent: at most this many tokens per MoE layer (a server takes at most 1e6 per entry)
MAX_SENT_TOKENS = 1_000_000
# (layer, microbatch) -> expert -> tokens: one server's part of an iteration
Work = dict[tuple[int, int], dict[int, int]]


@dataclass(frozen=True)
class Shape:
    """What one iteration carries: its microbatches' request counts, their mean context, and
    each request's tokens (a decode step's: 1, or 2 with MTP; a forward probe's: its own)."""

    sizes: tuple[int, ...]
    kv: float
    per_request: int
    probe: bool = False  # a forward probe: never held for coverage, kept out of the metrics


@dataclass
class Plan:
    """One iteration's work: the attention cost per layer and microbatch, each server's part,
    and the experts with tokens but no route."""

    attention: list[list[float]]
    parts: dict[int, Work] = field(default_factory=dict)  # server index -> its part
    uncovered: set[tuple[int, int]] = field(default_factory=set)  # (layer, expert)


def _message(client: str, iteration: int, version: int, part: Work, resend: bool) -> dict[str, Any]:
    return {
        "client": client,
        "iteration": iteration,
        "version": version,
        "resend": resend,
        "work": [
            {"layer": layer, "microbatch": mb, "experts": {str(e): c for e, c in experts.items()}}
            for (layer, mb), experts in sorted(part.items())
        ],
    }


def check_step(body: dict[str, Any]) -> tuple[int, float, int | None, bool]:
    """``/v1/attention/step``'s body, whatever engine reads it (a malformed body is a 400
    before a wrong role's 409): its batch, context, tokens per request (None: a decode
    step's) and whether to send it."""
    batch = body.get("batch")
    kv = body.get("kvTokens", 1024)
    per_request = body.get("tokensPerRequest")
    send = body.get("send", False)
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 100_000:
        raise EngineError(400, "invalid_request", "batch must be an integer in 1..100000", "batch")
    if isinstance(kv, bool) or not isinstance(kv, int | float) or not 0 <= kv <= 10_000_000:
        raise EngineError(400, "invalid_request", "kvTokens must be a number in 0..1e7", "kvTokens")
    if per_request is not None and (
        isinstance(per_request, bool)
        or not isinstance(per_request, int)
        or not 1 <= per_request <= 131_072
    ):
        raise EngineError(
            400,
            "invalid_request",
            "tokensPerRequest must be an integer in 1..131072",
            "tokensPerRequest",
        )
    if not isinstance(send, bool):
        raise EngineError(400, "invalid_request", "send must be a boolean", "send")
    if send and batch * (per_request or 2) > MAX_SENT_TOKENS:
        raise EngineError(
            400,
            "invalid_request",
            f"batch x tokensPerRequest must be at most {MAX_SENT_TOKENS} to send",
            "batch",
        )
    return batch, float(kv), per_request, send


def moe_seconds(moe: dict[tuple[int, int], float]) -> float:
    """An iteration's MoE part: each MoE layer's and microbatch's slowest server (the combine
    barrier), summed: what the experts' side of the forward takes, overlapped or not."""
    return sum(moe.values())


class AttentionClient:
    """The client's side of its pool, and its batch's step model."""

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        assert cfg.model.moe is not None
        self.engine = engine
        self.model = cfg.model
        self.moe = cfg.model.moe
        self.pool = PoolSession(cfg)
        self.id = cfg.pod or cfg.instance
        self.monolithic = cfg.expert_mode == "monolithic"
        self.popularity = dis.Popularity.parse(
            cfg.expert_popularity, self.moe.routed_experts, self.moe.moe_layers
        )
        self.reports: dict[str, zl.ExpertServerReport] = {}
        self.dropped: dict[str, float] = {}  # server -> wall time this client dropped it
        self.masked: set[tuple[str, int, int]] = set()  # (server, layer, expert) refused 409
        self._watched: set[str] = set()
        self.changed = asyncio.Event()  # a map or a report changed: a held iteration looks again
        self.iteration = 0
        self.uncovered: set[tuple[int, int]] = set()  # as the last plan found
        self.http = httpx.AsyncClient(
            trust_env=False, limits=httpx.Limits(max_keepalive_connections=256)
        )
        self._task: asyncio.Task[None] | None = None
        self._map_version = 0
        self._one_at_a_time = asyncio.Lock()  # the batch's iterations and probes
        engine.batch.cost = self
        engine.experts_in_force = self.in_force
        engine.experts_unavailable = self.unavailable

    # ------------------------------------------------------------------ life
    @property
    def ready(self) -> bool:
        """A map in force, and every expert of it with a live copy."""
        return self.unavailable() is None

    def unavailable(self) -> str | None:
        """Why this client cannot decode now (None: it can), cheap enough for every admission:
        no map in force or its pool gone (the pointer deleted), no server of the map live, or
        an expert the last iteration found without a live copy still without one. Its health
        says it (``Degraded``: the group takes it out of traffic, nothing to replace) and
        admission refuses with it."""
        current = self.pool.map
        if current is None:
            return "no expert map in force"
        if self.pool.gone:
            return (
                f"its expert pool {self.engine.config.expert_pool} is gone (the map pointer "
                f"deleted; v{current.number} was in force)"
            )
        if not self._live_servers(current):
            return f"no server of expert map v{current.number} is live"
        if self._still_uncovered():
            return self._uncovered_said(self.uncovered)
        return None

    async def in_force(self) -> None:
        """Until the pool's map is in force and every expert of the model has a live copy in it:
        what the engine's load waits for last (before, no iteration could be made)."""
        said = ""
        while True:
            self.changed.clear()  # before looking: a change meanwhile is seen at once
            current = self.pool.map
            gaps = self.gaps(current) if current is not None else None
            if current is not None and not gaps:
                log.info("expert map v%d in force, every expert covered", current.number)
                return
            why = "no expert map in force" if not gaps else self._uncovered_said(gaps)
            if why != said:
                log.info("not serving yet: %s", why)
                said = why
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.changed.wait()

    def gaps(self, current: ExpertMap) -> set[tuple[int, int]]:
        """The model's (MoE layer, expert) pairs without a live copy in ``current``."""
        servers = current.version.servers
        live = {i for i in range(len(servers)) if self._live(current, i)}
        routes = current.routes
        return {
            (layer, expert)
            for layer in range(self.moe.moe_layers)
            for expert in range(self.moe.routed_experts)
            if layer >= len(routes)
            or expert >= len(routes[layer])
            or live.isdisjoint(routes[layer][expert])
        }

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="attention-client")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.pool.stop()
        await self.http.aclose()

    async def _run(self) -> None:
        def waiting(exc: Exception) -> None:
            log.warning("ZooKeeper %s unreachable (%s); retrying", self.pool.zk.hosts, exc)

        await self.pool.connect(waiting)
        while True:
            await self.pool.map_changed.wait()
            self.pool.map_changed.clear()
            current = self.pool.map
            if current is None:
                continue
            for server in current.version.servers:
                if server not in self._watched:
                    self._watch(server)
            self.masked.clear()  # a new version: what a server holds is the map's word again
            # what it leaves without a live copy (a new pool's first versions enable nothing;
            # a failover may take a last copy): unavailable until covered, not only once an
            # iteration has found it (an idle client would say it serves, and hold its first)
            self.uncovered |= self.gaps(current)
            self._poke()

    def _watch(self, server: str) -> None:
        self._watched.add(server)

        def on_report(data: bytes | None, _stat: object) -> None:
            self.pool.bridge.call(self._report_is, server, data)

        self.pool.zk.watch_data(self.pool.paths.server(server), on_report)

    def _report_is(self, server: str, data: bytes | None) -> None:
        report = None
        if data:
            try:
                report = zl.ExpertServerReport.parse(data)
            except ValueError:
                log.error("ignoring an unreadable report of expert server %s", server)
        before = self.reports.get(server)
        if report is None:
            if before is not None:
                self.reports.pop(server, None)
                self._drop(server, "gone")
        else:
            self.reports[server] = report
            if server in self.dropped and report.ts > self.dropped[server]:
                log.info("expert server %s reports again: back in the routes", server)
                del self.dropped[server]
            if before is not None and before.loaded != report.loaded:
                self.masked = {m for m in self.masked if m[0] != server}
        self._poke()

    def _poke(self) -> None:
        self.changed.set()

    def _drop(self, server: str, why: str) -> None:
        if server not in self.dropped:
            log.warning("expert server %s dropped from the routes (%s)", server, why)
            self.engine.metrics.expert_failovers.labels(why=why).inc()
        self.dropped[server] = time.time()

    # ------------------------------------------------------------------ admission
    def _still_uncovered(self) -> set[tuple[int, int]]:
        """The experts the last plan found without a live copy that still have none: a server
        back in the routes or a new map covers them. Looked at here, not only by the next
        iteration's plan: while admission refuses, no request comes and no iteration runs."""
        current = self.pool.map
        if self.uncovered and current is not None:
            live = self._live_servers(current)
            self.uncovered = {
                (layer, expert)
                for layer, expert in self.uncovered
                if not self._replicas(current, live, layer, expert)
            }
        return self.uncovered

    @staticmethod
    def _uncovered_said(uncovered: set[tuple[int, int]]) -> str:
        pairs = sorted(uncovered)
        said = ", ".join(f"layer {layer} expert {e}" for layer, e in pairs[:6])
        more = f" and {len(pairs) - 6} more" if len(pairs) > 6 else ""
        return f"no live copy of {said}{more}"

    # ------------------------------------------------------------------ routing
    def _live(self, current: ExpertMap, index: int) -> bool:
        server = current.version.servers[index]
        report = self.reports.get(server)
        return report is not None and report.loaded > 0 and server not in self.dropped

    def _live_servers(self, current: ExpertMap) -> set[int]:
        return {i for i in range(len(current.version.servers)) if self._live(current, i)}

    def _replicas(self, current: ExpertMap, live: set[int], layer: int, expert: int) -> list[int]:
        """The servers (indices) an expert's tokens may go to: live, holding it enabled, not
        having refused it (409) since the map or its slots changed."""
        routes = current.routes[layer]
        servers = current.version.servers
        return [
            i
            for i in (routes[expert] if expert < len(routes) else [])
            if i in live and (servers[i], layer, expert) not in self.masked
        ]

    def shape(
        self, requests: int, kv: float, per_request: int | None = None, probe: bool = False
    ) -> Shape:
        """``requests`` in the client's microbatches, each of ``per_request`` tokens (default: a
        decode step's)."""
        cfg = self.engine.config
        sizes = dis.microbatches(max(requests, 1), cfg.microbatches)
        return Shape(tuple(sizes), kv, per_request or cfg.shape.tokens_per_step, probe)

    def _plan(self, current: ExpertMap, shape: Shape) -> Plan:
        cfg = self.engine.config
        sizes, kv, per_request = shape.sizes, shape.kv, shape.per_request
        dies = cfg.instance_dies
        dense = self.model.n_dense_layers
        plan = Plan(
            [
                [
                    dis.attention_layer_seconds(
                        self.model, math.ceil(n / dies), kv, per_request, layer < dense
                    )
                    for n in sizes
                ]
                for layer in range(self.model.layers)
            ]
        )
        live = self._live_servers(current)
        for layer in range(len(current.routes)):
            for mb, n in enumerate(sizes):
                tokens = n * per_request
                offset = (self.iteration * len(sizes) + mb) * tokens * self.moe.top_k
                counts = self.popularity.counts(layer, tokens, self.moe.top_k, offset)
                for expert, count in enumerate(counts):
                    if not count:
                        continue
                    replicas = self._replicas(current, live, layer, expert)
                    if not replicas:
                        plan.uncovered.add((layer, expert))
                        continue
                    for server, share in dis.rotate(expert, count, replicas):
                        part = plan.parts.setdefault(server, {})
                        part.setdefault((layer, mb), {})[expert] = share
        return plan

    # ------------------------------------------------------------------ the step
    def per_token(self, requests: int, kv_tokens: int) -> float:
        """Admission's estimate: the iteration predicted without sending (uniform load)."""
        seconds, _moe = self.predict(self.shape(requests, kv_tokens))
        return seconds / self.engine.config.shape.accepted_per_step

    def predict(self, shape: Shape) -> tuple[float, float]:
        """The iteration of ``shape`` as the map in force would time it, servers idle: its
        emulated s and its MoE part (:func:`moe_seconds`)."""
        current = self.pool.map
        if current is None:
            return dis.iteration_seconds([[0.0]], [[0.0]], self.engine.config.mtp), 0.0
        plan = self._plan(current, shape)
        moe: dict[tuple[int, int], float] = defaultdict(float)
        for index, part in plan.parts.items():
            for key, seconds in self._part_seconds(current, index, part).items():
                moe[key] = max(moe[key], seconds)
        return self._iteration(plan, shape, moe), moe_seconds(moe)

    def _part_seconds(
        self, current: ExpertMap, index: int, part: Work
    ) -> dict[tuple[int, int], float]:
        """A server's part timed as it would compute it, idle: per layer and microbatch."""
        report = self.reports.get(current.version.servers[index])
        dies = len(report.dies) if report is not None and report.dies else 1
        return {
            key: dis.expert_layer_seconds(self.model, experts.values(), dies)
            for key, experts in part.items()
        }

    def _check_probe(self, shape: Shape) -> None:
        """A probe that would keep a server busy for half the failover timeout or more is
        refused (400): every client would drop that healthy server when its own message waits
        behind it; one of an expert without a live copy, 503 at once (a probe is never held)."""
        current = self.pool.map
        assert current is not None
        plan = self._plan(current, shape)
        if plan.uncovered:
            raise EngineError(503, "expert_uncovered", self._uncovered_said(plan.uncovered))
        longest = max(
            (sum(self._part_seconds(current, i, part).values()) for i, part in plan.parts.items()),
            default=0.0,
        )
        limit = self._failover() / 2
        if longest >= limit:
            raise EngineError(
                400,
                "invalid_request",
                f"this probe would keep an expert server busy {1000 * longest:.0f} ms, not under "
                f"half the failover timeout ({1000 * limit:.0f} ms): every client would drop "
                "that healthy server; send fewer tokens",
                "batch",
            )

    def _iteration(self, plan: Plan, shape: Shape, moe: dict[tuple[int, int], float]) -> float:
        dense = self.model.n_dense_layers
        hops = [
            [
                0.0 if layer < dense else dis.hop_seconds(moe.get((layer - dense, mb), 0.0))
                for mb in range(len(shape.sizes))
            ]
            for layer in range(self.model.layers)
        ]
        return dis.iteration_seconds(plan.attention, hops, self.engine.config.mtp)

    async def attention_step(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/attention/step``: the iteration of ``batch`` requests (``kvTokens`` of context,
        ``tokensPerRequest`` each: a decode step's by default) predicted, nothing sent; or, with
        ``send``, made: planned on the map in force and sent to the servers as an iteration of
        its own (its messages between two of the batch's exchanges; its attention charged to
        no die), timed by their answers, kept out of the iteration metrics (its tokens count
        in the servers' reports). Refused when a server would take half the failover timeout
        on it, 503 at once when an expert has no live copy. Either way its MoE part
        (``moeSeconds``: each MoE layer's and microbatch's slowest server, summed) and the
        failover timeout in force."""
        batch, kv, per_request, send = check_step(body)
        if self.pool.map is None:
            raise EngineError(503, "no_expert_map", "no expert map in force yet")
        shape = self.shape(batch, kv, per_request, probe=send)
        if send:
            self._check_probe(shape)
            seconds, moe, _messages = await self._iterate(shape)
        else:
            seconds, moe = self.predict(shape)
        assert self.pool.map is not None
        return {
            "batch": batch,
            "tokensPerRequest": shape.per_request,
            "seconds": seconds,
            "moeSeconds": moe,
            "sent": send,
            "mapVersion": self.pool.map.number,
            "failoverSeconds": self._failover(),
        }

    def _failover(self) -> float:
        """Emulated s the failover timeout is: the pool's (its ``failoverTimeoutMilliseconds``,
        carried by the map pointer) wins over the client's own (``ENGINE_EXPERT_FAILOVER_MS``,
        for a client whose pointer carries none: a test's pool, an older controller)."""
        ms = self.pool.failover_ms
        return ms / 1000 if ms is not None else self.engine.config.expert_failover

    def _bound(self) -> float:
        """Wall s the failover timeout is (never under its floor)."""
        return max(
            self.engine.clock.to_wall(self._failover()), cal.EXPERT_FAILOVER_WALL_FLOOR_SECONDS
        )

    async def step(self, batch: list[Sequence]) -> tuple[float, float]:
        """One iteration through the experts: its emulated seconds and the tokens it accepts
        per request. Raises 503 ``expert_uncovered`` when an expert stayed without a live copy
        for the failover timeout."""
        kv = sum(s.kv_tokens for s in batch) / len(batch)
        seconds, _moe, _messages = await self._iterate(self.shape(len(batch), kv))
        return seconds, self.engine.config.shape.accepted_per_step

    async def _iterate(self, shape: Shape) -> tuple[float, float, int]:
        """One iteration of ``shape`` made (one at a time: the batch's and a probe's do not
        interleave, a server's one message per client per iteration): its emulated s, its MoE
        part and the messages it took."""
        async with self._one_at_a_time:
            while True:
                self.iteration += 1  # an iteration started over (monolithic) is another one
                await self._until_whole()
                current = self.pool.map
                assert current is not None
                outcome = await self._exchange(current, shape)
                if outcome is not None:
                    plan, moe, messages = outcome
                    break
        seconds = self._iteration(plan, shape, moe)
        if not shape.probe:  # the batch's iterations only
            metrics = self.engine.metrics
            metrics.expert_iteration.observe(seconds)
            metrics.expert_moe.observe(moe_seconds(moe))
            metrics.expert_messages.observe(messages)
        return seconds, moe_seconds(moe), messages

    async def _until_whole(self) -> None:
        """Monolithic mode: until every server of the map's table is registered, ``Serving``
        and not dropped; either mode: until there is a map."""
        held = False
        while True:
            current = self.pool.map
            if current is not None and (not self.monolithic or self._whole(current)):
                return
            if not held:
                held = True
                why = "no_map" if current is None else "monolithic"
                self.engine.metrics.expert_halts.labels(why=why).inc()
                log.warning(
                    "iterations held: %s",
                    "no expert map yet"
                    if current is None
                    else "a server of the static group is down (monolithic mode)",
                )
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.changed.wait()

    def _whole(self, current: ExpertMap) -> bool:
        for server in current.version.servers:
            report = self.reports.get(server)
            if (
                report is None
                or server in self.dropped
                or report.state is not zl.ExpertServerState.SERVING
            ):
                return False
        return True

    async def _exchange(
        self, current: ExpertMap, shape: Shape
    ) -> tuple[Plan, dict[tuple[int, int], float], int] | None:
        """Plan and send; re-send what failed to replicas. None: start over (monolithic mode
        after a failure, or a new map while held)."""
        current, plan = await self._covered(current, shape)
        moe: dict[tuple[int, int], float] = defaultdict(float)
        pending = plan.parts
        resend, messages = False, 0
        while pending:
            answers = await asyncio.gather(
                *(self._send(current, index, part, resend) for index, part in pending.items())
            )
            messages += len(pending)
            failed: list[tuple[int, Work]] = []
            for (index, part), answer in zip(pending.items(), answers, strict=True):
                if isinstance(answer, list):
                    for key, seconds in zip(sorted(part), answer, strict=True):
                        moe[key] = max(moe[key], seconds)
                else:
                    failed.append((index, part))
            if not failed:
                break
            if self.monolithic:
                return None  # the group is broken: held until it is whole, then again
            current, pending = await self._reroute(current, failed, shape)
            self.engine.metrics.expert_resends.inc(len(failed))
            resend = True
        return plan, moe, messages

    async def _covered(self, current: ExpertMap, shape: Shape) -> tuple[ExpertMap, Plan]:
        """The plan (and the map it is of), once every expert with tokens has a live copy:
        held at most the failover timeout for a map or a server that covers it, then 503
        ``expert_uncovered``."""
        plan = self._plan(current, shape)
        if not plan.uncovered:
            if not shape.probe:
                self.uncovered = set()
            return current, plan
        if shape.probe:  # never held: the batch waits behind it
            raise EngineError(503, "expert_uncovered", self._uncovered_said(plan.uncovered))
        self.uncovered = plan.uncovered
        self.engine.metrics.expert_halts.labels(why="uncovered").inc()
        log.warning("%s: held for a map that covers it", self._uncovered_said(plan.uncovered))
        deadline = asyncio.get_running_loop().time() + self._bound()
        while True:
            self.changed.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise EngineError(503, "expert_uncovered", self._uncovered_said(plan.uncovered))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.changed.wait()
            current = self.pool.map or current
            plan = self._plan(current, shape)
            if not plan.uncovered:
                self.uncovered = set()
                log.info("every expert has a live copy again (map v%d)", current.number)
                return current, plan
            self.uncovered = plan.uncovered

    async def _reroute(
        self, current: ExpertMap, failed: list[tuple[int, Work]], shape: Shape
    ) -> tuple[ExpertMap, dict[int, Work]]:
        """The failed parts' tokens over the replicas still live: one message per server (by
        its index in the map returned: a later one if the last copy of an expert was lost and
        a map that covers it came while held)."""
        live = self._live_servers(current)
        out: dict[int, Work] = {}
        lost: set[tuple[int, int]] = set()
        for _index, part in failed:
            for (layer, mb), experts in part.items():
                for expert, count in experts.items():
                    replicas = self._replicas(current, live, layer, expert)
                    if not replicas:
                        lost.add((layer, expert))
                        continue
                    for server, share in dis.rotate(expert, count, replicas):
                        row = out.setdefault(server, {}).setdefault((layer, mb), {})
                        row[expert] = row.get(expert, 0) + share
        if lost:  # the last copy went with the failure: held (bounded) for a map that covers it
            covering, _ = await self._covered(self.pool.map or current, shape)
            return await self._reroute(covering, failed, shape)
        return current, out

    async def _send(
        self, current: ExpertMap, index: int, part: Work, resend: bool
    ) -> list[float] | None:
        """One server's part; its per-entry seconds, or None when it failed (dropped, or the
        experts it refused masked)."""
        server = current.version.servers[index]
        report = self.reports.get(server)
        if report is None:
            self._drop(server, "gone")
            return None
        body = _message(self.id, self.iteration, current.number, part, resend)
        url = f"http://{report.pod_ip}:{report.port}/v1/expert/forward"
        try:
            async with asyncio.timeout(self._bound()):
                response = await self.http.post(url, json=body)
        except TimeoutError:
            self._drop(server, "timeout")
            return None
        except httpx.HTTPError as exc:
            log.info("expert server %s unreachable: %s", server, type(exc).__name__)
            self._drop(server, "unreachable")
            return None
        if response.status_code == 409:
            answer = response.json()
            if answer.get("error", {}).get("code") == "expert_not_held":
                for layer, expert in answer.get("missing", []):
                    self.masked.add((server, int(layer), int(expert)))
                return None
        if response.status_code != 200:
            log.info("expert server %s answered %d", server, response.status_code)
            self._drop(server, "unreachable")
            return None
        seconds = response.json().get("seconds")
        if not isinstance(seconds, list) or len(seconds) != len(part):
            self._drop(server, "unreachable")
            return None
        return [float(s) for s in seconds]
