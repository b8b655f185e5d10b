"""An expert server (``ENGINE_ROLE=expert``): stateless experts as a service (EaaS §2.4, §3.1,
§3.3; xDeepServe §5.2 "MoE NPUs run only A2E, MoE computation, and E2A").

- **Registers** (EaaS §4.4: "a new server only needs to register its availability"): an
  ephemeral :class:`~matrixserve.api.zk_layout.ExpertServerReport` at ``servers/<its pod name>``
  of its pool, rewritten every health interval (its heartbeat, with the tokens it computed per
  layer and expert: EPLB's input, xDeepServe §4.5 step 1) and at once when its state or the
  version it has loaded changes; written again after a lost session.
- **Follows the map** (:mod:`.expertpool`): in the version in force, the slots of its index in
  the server table are the experts it must hold per layer. It loads those it does not hold yet
  (emulated: their bytes over its load source's bandwidth, :func:`enginestub.disaggregated.
  slot_load_seconds`; nothing else is kept: stateless), reporting ``Loading``, then ``Serving``
  with ``loaded`` = that version. It computes the experts it holds and the version enables;
  a disabled slot (xDeepServe §4.5 step 3: being replaced) is in no route. Taken out of the
  server table after being in it: ``Draining`` (what it was sent is finished; it stays so until
  its pod goes; a later version that names it again brings it back).
- **Serves** ``POST /v1/expert/forward``: one message per client per iteration with, for each
  layer and microbatch, the tokens per expert to compute. Each layer is a grouped GEMM
  (:func:`enginestub.disaggregated.expert_layer_seconds`). The device is one resource:
  concurrent clients' messages queue on it in emulated time, and each layer is answered with
  its time stretched by the wait (its layers interleave with the queued ones). Tokens for an expert it does not hold
  enabled are refused whole, 409 ``expert_not_held`` naming them: the client re-sends them to a
  replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from enginestub import disaggregated
from enginestub.engine.config import pod_identity
from enginestub.engine.core import Engine
from enginestub.engine.expertpool import ExpertMap, PoolSession
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError

log = logging.getLogger("enginestub.experts")

MAX_WORK = 16384  # (layer, microbatch) entries in one message: 61 layers x a few microbatches
MAX_TOKENS = 1_000_000  # tokens for one expert in one entry
MAX_LAYERS = 4096  # a layer index any model may have (the server checks its own)


class NotHeld(EngineError):
    """Tokens for experts this server does not hold enabled: 409 naming them (``missing``:
    ``[layer, expert]`` pairs), so the client re-sends them elsewhere."""

    def __init__(self, server: str, missing: list[tuple[int, int]]) -> None:
        said = ", ".join(f"layer {layer} expert {e}" for layer, e in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        super().__init__(
            409,
            "expert_not_held",
            f"server {server} does not hold enabled: {said}{more}; send them to a replica",
            param="work",
        )
        self.missing = missing

    def body(self) -> dict[str, Any]:
        return {**super().body(), "missing": [list(pair) for pair in self.missing]}


def _int(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EngineError(400, "invalid_request", f"{what} must be an integer in {low}..{high}")
    return value


def parse_work(body: dict[str, Any], layers: int) -> list[tuple[int, int, dict[int, int]]]:
    """A forward message's ``work``: ``(layer, microbatch, {expert: tokens})`` entries."""
    work = body.get("work")
    if not isinstance(work, list) or not 0 < len(work) <= MAX_WORK:
        raise EngineError(
            400, "invalid_request", f"work must be a list of 1..{MAX_WORK} entries", "work"
        )
    out = []
    for entry in work:
        if not isinstance(entry, dict) or not isinstance(entry.get("experts"), dict):
            raise EngineError(
                400, "invalid_request", "each work entry is {layer, microbatch, experts}", "work"
            )
        layer = _int(entry.get("layer"), 0, layers - 1, "work[].layer")
        microbatch = _int(entry.get("microbatch", 0), 0, 1024, "work[].microbatch")
        experts: dict[int, int] = {}
        for key, count in entry["experts"].items():
            if not isinstance(key, str) or not key.isdigit() or len(key) > 6:
                raise EngineError(400, "invalid_request", "experts are keyed by index", "work")
            experts[int(key)] = _int(count, 0, MAX_TOKENS, "a token count")
        out.append((layer, microbatch, experts))
    return out


def check_forward(body: dict[str, Any]) -> tuple[str, int]:
    """A forward message's shape, whatever engine reads it (a malformed body is a 400 before a
    wrong role's 409): its client and iteration."""
    client = body.get("client")
    if not isinstance(client, str) or not client:
        raise EngineError(400, "invalid_request", "client (its name) is required", "client")
    iteration = _int(body.get("iteration", 0), 0, 1 << 62, "iteration")
    parse_work(body, MAX_LAYERS)
    return client, iteration


class ExpertServer:
    """The server's side of its pool: the same life as the resident process's (start, the
    task that ends only by failing, stop, ready) so the process runs either."""

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        self.engine = engine
        self.id = cfg.pod or cfg.instance
        self.pool = PoolSession(cfg, own=self.id)
        self.path = self.pool.paths.server(self.id)
        self.incarnation = uuid.uuid4().hex[:16]
        self.state = zl.ExpertServerState.LOADING
        self.loaded = 0  # the map version whose slots it has loaded
        self.index: int | None = None  # its index in the server table in force
        self.held: dict[int, set[int]] = {}  # layer -> experts whose weights it holds
        self.enabled: dict[int, set[int]] = {}  # layer -> experts it computes
        self.tokens: dict[int, dict[int, int]] = {}
        self.in_flight = 0
        self.busy_until = 0.0  # emulated time its device is busy until
        self.written = False
        self._last_iteration: dict[str, int] = {}  # client -> its last first-send iteration
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        engine.on_health_change = self._dirty.set

    # ------------------------------------------------------------------ life
    @property
    def ready(self) -> bool:
        return self.written and self.state is zl.ExpertServerState.SERVING

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="expert-server")

    async def stop(self) -> None:
        """Stop, and close the session: the report goes at once (clients drop this server now,
        not after the session's timeout)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.pool.stop()

    async def _run(self) -> None:
        def waiting(exc: Exception) -> None:
            log.warning("ZooKeeper %s unreachable (%s); retrying", self.pool.zk.hosts, exc)

        await self.pool.connect(waiting)
        await self.engine.post_load()  # nothing but its slots to load, as the map says
        bridge = self.pool.bridge
        await bridge.until_written(self._write, "the expert server report")
        interval = self.engine.clock.to_wall(self.engine.config.health_interval)
        await asyncio.gather(
            bridge.keep_fresh(self._dirty, interval, self._write, "the expert server report"),
            bridge.keep_registered(self._write, "the expert server report"),
            self._follow(),
        )

    def _set_state(self, state: zl.ExpertServerState) -> None:
        if state is not self.state:
            log.info("expert server %s: %s -> %s", self.id, self.state, state)
            self.state = state
            self._dirty.set()

    # ------------------------------------------------------------------ the map
    async def _follow(self) -> None:
        while True:
            await self.pool.map_changed.wait()
            self.pool.map_changed.clear()
            current = self.pool.map
            if current is not None:
                await self._apply(current)

    async def _apply(self, current: ExpertMap) -> None:
        """The version in force: hold and compute what it gives this server."""
        index, was = current.index(self.id), self.index
        self.index = index
        rows = current.rows(self.id)
        if index is None or rows is None:
            if was is not None:  # out of the table: finish what it was sent, take no more
                self._set_state(zl.ExpertServerState.DRAINING)
            return
        wanted = {layer: set(held) for layer, (held, _) in enumerate(rows)}
        disabled = {layer: set(off) for layer, (_, off) in enumerate(rows)}
        slots = self.engine.config.slots
        for layer, experts in wanted.items():
            if len(experts) > slots:
                log.error(
                    "map v%d gives %s %d experts in layer %d, over its %d slots: kept the first",
                    current.number,
                    self.id,
                    len(experts),
                    layer,
                    slots,
                )
                wanted[layer] = set(sorted(experts)[:slots])
        # what it holds and the new version enables is computed at once; the new slots once loaded
        enabled_now = {
            layer: (experts - disabled[layer]) & self.held.get(layer, set())
            for layer, experts in wanted.items()
        }
        self.enabled = enabled_now
        new = sum(len(experts - self.held.get(layer, set())) for layer, experts in wanted.items())
        if new:
            self._set_state(zl.ExpertServerState.LOADING)
            cfg = self.engine.config
            seconds = disaggregated.slot_load_seconds(cfg.model, new, cfg.shape, cfg.load_source)
            log.info(
                "expert server %s loads %d slot(s) of map v%d: %.3f emulated s",
                self.id,
                new,
                current.number,
                seconds,
            )
            await self.engine.clock.sleep(seconds)
            if self.pool.map is not current:  # superseded meanwhile: the next one decides
                self.held = {layer: self.held.get(layer, set()) | wanted[layer] for layer in wanted}
                return
        self.held = wanted
        self.enabled = {layer: experts - disabled[layer] for layer, experts in wanted.items()}
        self.loaded = current.number
        self._set_state(zl.ExpertServerState.SERVING)
        self._dirty.set()

    # ------------------------------------------------------------------ the report
    def report(self) -> zl.ExpertServerReport:
        cfg = self.engine.config
        return zl.ExpertServerReport(
            **pod_identity(cfg),
            incarnation=self.incarnation,
            ts=time.time(),
            pool=cfg.expert_pool or "",
            slots=cfg.slots,
            loaded=self.loaded,
            state=self.state,
            inFlight=self.in_flight,
            tokens={layer: dict(row) for layer, row in self.tokens.items()},
        )

    async def _write(self) -> None:
        """Our report, owned by our session (a previous process's is replaced)."""
        if self.pool.bridge.suspended.is_set():
            return
        zk = self.pool.zk
        await zk.run(zk.own, self.path, self.report().dump())
        self.written = True

    # ------------------------------------------------------------------ forward
    async def forward(self, body: dict[str, Any]) -> dict[str, Any]:
        """One client's message of one iteration: each entry's grouped GEMM, timed on the
        device beside whatever else it computes now."""
        cfg = self.engine.config
        assert cfg.model.moe is not None
        client, iteration = check_forward(body)
        resend = body.get("resend", False) is True
        work = parse_work(body, cfg.model.moe.moe_layers)
        metrics = self.engine.metrics
        missing = sorted(
            {
                (layer, expert)
                for layer, _mb, experts in work
                for expert, count in experts.items()
                if count and expert not in self.enabled.get(layer, ())
            }
        )
        if missing:
            metrics.expert_messages_received.labels(outcome="not_held").inc()
            raise NotHeld(self.id, missing)
        if not resend:
            if self._last_iteration.get(client) == iteration:
                metrics.expert_repeats.inc()
            self._last_iteration[client] = iteration
        dies = cfg.instance_dies
        slow = self.engine.slow_factor
        seconds = [
            disaggregated.expert_layer_seconds(cfg.model, experts.values(), dies) * slow
            for _layer, _mb, experts in work
        ]
        compute = sum(seconds)
        # The device computes one message at a time, in arrival order, in emulated time: the
        # wait is what is queued before this one (arithmetic, so the loop's wall-time jitter at
        # a large time scale is no part of it); the answer leaves when its compute ends.
        now = self.engine.clock.now()
        start = max(now, self.busy_until)
        self.busy_until = start + compute
        wait = start - now
        self.in_flight += 1
        try:
            await self.engine.clock.sleep_until(self.busy_until if compute else now)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self.state is zl.ExpertServerState.DRAINING:
                self._dirty.set()  # the controller may delete the pod now
        # Its layers interleave with the queued work on the device: each is stretched by it.
        stretch = (compute + wait) / compute if compute > 0 else 1.0
        tokens = 0
        for layer, _mb, experts in work:
            row = self.tokens.setdefault(layer, {})
            for expert, count in experts.items():
                row[expert] = row.get(expert, 0) + count
                tokens += count
        metrics.expert_tokens.inc(tokens)
        metrics.expert_queue_wait.observe(wait)
        metrics.expert_messages_received.labels(outcome="served").inc()
        return {
            "server": self.id,
            "version": self.loaded,
            "seconds": [s * stretch for s in seconds],
            "queueWait": wait,
        }
