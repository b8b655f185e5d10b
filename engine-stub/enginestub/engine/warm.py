"""A pre-warmed, model-agnostic engine (DeepServe §6.1: "a small pool of pre-warmed TEs
to minimize TE-Pre-Load time").

With ``--warm`` (``$ENGINE_WARM=1``) the process starts with no model, no role and no group:

1. it binds its pod's address (``/healthz`` 200; ``/readyz`` 503 until TE-Pre-Load is over,
   200 after; every other path 503 ``not_ready``) and emulates TE-Pre-Load;
2. it watches ``warm/<ns>/assignments/<pod>`` and, unless an assignment for this very pod (its
   UID) is already there, reports itself under ``warm/<ns>/pods/<pod>`` (ephemeral
   :class:`~matrixserve.api.zk_layout.WarmReport`): the watch and the report are registered
   through the session bridge's retry (:meth:`SessionBridge.keep_registered`), so a connection
   lost meanwhile delays them and a lost session writes them again; every write of the report
   is serialised (one lock), and none happens once the pod is claimed;
3. it watches its server's DRAM plan (``warm/<ns>/dram/<node>``, a
   :class:`~matrixserve.api.zk_layout.DramPlan` the operator writes: DeepServe §6.2's
   pre-loading "into DRAM page cache using pre-warmed TEs"): each model listed that the
   server's DRAM does not hold yet is loaded from the shared file service, one after another
   (:func:`enginestub.timing.dram_preload_seconds`, emulated), then listed in the report's
   ``dramModels``; a model the plan no longer lists leaves ``dramModels`` at once;
4. an :class:`~matrixserve.api.zk_layout.Assignment` whose ``podUid`` is not its own is one left
   for an earlier pod of that name: ignored. Its own claims it: the report is deleted (after any
   write under way), the session closed, the address let go, and the process becomes the
   engine the assignment describes (:func:`assigned`): its own environment (ZooKeeper, the
   credential file, devices, node, platform) with the instance's settings the assignment
   carries (only :data:`~matrixserve.api.zk_layout.ASSIGNMENT_ENV` keys), the group, the
   instance name (``ENGINE_INSTANCE``), the load source, the fork and its fallback.
   ``python -m enginestub`` then runs the normal group path on the same address, its TE-Pre-Load
   already paid (0 in its phases, ``warm: true`` in its health, readiness counted from the
   claim).

An assignment that does not make a valid engine, or not one of this pod, is logged and the
process exits 2, as on any bad configuration. A process restarted in a claimed pod (its
environment still says warm) pays TE-Pre-Load again, then finds its assignment at once (the
watch's first answer), never reports itself as warm, and applies it: its phases say the
TE-Pre-Load it paid, its readiness counts from its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from enginestub import timing
from enginestub.engine.clock import Clock
from enginestub.engine.config import (
    LOOPBACK,
    ConfigError,
    EngineConfig,
    WarmConfig,
    parse,
    pod_identity,
)
from enginestub.engine.fork import FORK_PLANES, LoadPlan
from enginestub.engine.metrics import EngineMetrics
from enginestub.engine.server import RETRY_AFTER, error_response
from enginestub.engine.zkbridge import SessionBridge
from enginestub.fabric import Plane
from matrixserve import coordination, httpserving
from matrixserve.api import catalog
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError
from matrixserve.api.engine_settings import EngineEnv
from matrixserve.coordination import Session

log = logging.getLogger("enginestub.warm")


@dataclass(frozen=True)
class Claim:
    """This pod's assignment, and when it came (wall time). ``restarted``: this process never
    said it was warm (its assignment was there at the watch's first answer: a process restarted
    in a claimed pod), so it paid ``pre_load_seconds`` of TE-Pre-Load for this engine, and its
    readiness counts from its own start, ``process_start``."""

    assignment: zl.Assignment
    at: float
    restarted: bool = False
    pre_load_seconds: float = 0.0
    process_start: float = 0.0

    @property
    def started(self) -> float:
        """When the claimed engine's readiness counts from (wall time)."""
        return self.process_start if self.restarted else self.at

    @property
    def pre_loaded(self) -> float:
        """The TE-Pre-Load the claimed engine paid in this process (emulated s)."""
        return self.pre_load_seconds if self.restarted else 0.0


class InvalidAssignment(Exception):
    """An assignment for this pod that cannot be read."""


class WarmEngine:
    """The warm process until its claim: its HTTP surface, TE-Pre-Load, its report, the watches,
    its server's DRAM pre-loading."""

    def __init__(self, cfg: WarmConfig) -> None:
        self.cfg = cfg
        self.started_wall = time.time()
        self.clock = Clock(cfg.time_scale)
        self.paths = zl.WarmPaths(cfg.namespace)
        self.incarnation = uuid.uuid4().hex[:16]
        self.metrics = EngineMetrics("warm")
        self.phase = "PreLoading"  # then Warm (waiting), then Claimed
        self.pre_load_seconds = 0.0
        self.zk = Session(cfg.zookeeper, timeout=10.0, auth=cfg.zookeeper_auth)
        self.bridge = SessionBridge(self.zk)
        self._claim: asyncio.Future[Claim] | None = None
        self._seen: bytes | None = None  # the last assignment ignored (logged once)
        self._writes = asyncio.Lock()  # one write of the report at a time
        self.reported = False  # this process wrote its report (it said it was warm)
        self.claimed = False  # set under the lock: no report is written after it
        self._watching: set[str] = set()  # the znodes watched
        # DeepServe §6.2 pre-loading: what the plan asks, what the server's DRAM holds.
        self.dram_plan: list[str] = []
        self.dram_models: list[str] = []
        self.dram_loading: str | None = None
        self._dram_changed = asyncio.Event()
        self._unknown: set[str] = set()  # planned models with no shape here (logged once)

    # ------------------------------------------------------------------ HTTP
    def info(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "warm": True,
            "phase": self.phase,
            "pod": cfg.pod,
            "podUid": cfg.pod_uid,
            "namespace": cfg.namespace,
            "node": cfg.node,
            "superpod": cfg.superpod,
            "npus": cfg.npus,
            "dies": cfg.dies,
            "roceIps": cfg.roce_ips,
            "timeScale": cfg.time_scale,
            "phases": {"TEPreLoad": self.pre_load_seconds} if self.phase != "PreLoading" else {},
            "dramPlan": list(self.dram_plan),
            "dramModels": list(self.dram_models),
            "dramLoading": self.dram_loading,
            "ssdModels": list(cfg.ssd_models),
        }

    def app(self) -> web.Application:
        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def readyz(_: web.Request) -> web.Response:
            ready = self.phase == "Warm"  # past TE-Pre-Load, not claimed yet
            return web.json_response(
                self.info(),
                status=200 if ready else 503,
                headers=None if ready else {"Retry-After": RETRY_AFTER[503]},
            )

        async def info(_: web.Request) -> web.Response:
            return web.json_response(self.info())

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.metrics.registry),
                headers={"Content-Type": CONTENT_TYPE_LATEST},
            )

        async def not_ready(_: web.Request) -> web.Response:
            return error_response(
                EngineError(
                    503,
                    "not_ready",
                    f"warm engine {self.cfg.pod} has no model yet ({self.phase}): it serves "
                    "once a group claims it",
                )
            )

        app = httpserving.application()
        app.add_routes(
            [
                web.get("/healthz", healthz),
                web.get("/readyz", readyz),
                web.get("/metrics", metrics),
                web.get("/v1/info", info),
                web.route("*", "/{tail:.*}", not_ready),
            ]
        )
        return app

    # ------------------------------------------------------------------ the warm life
    async def pre_load(self) -> None:
        """TE-Pre-Load (DeepServe §6.1), paid before any claim."""
        started = self.clock.now()
        await self.clock.sleep(self.cfg.pre_load_seconds)
        self.pre_load_seconds = round(self.clock.now() - started, 6)
        self.metrics.phase_seconds.labels(phase="TEPreLoad").set(self.pre_load_seconds)
        self.phase = "Warm"
        log.info(
            "warm engine %s past TE-Pre-Load (%.2f emulated s), waiting for an assignment",
            self.cfg.pod,
            self.pre_load_seconds,
        )

    async def until_claimed(self) -> Claim:
        """Connect; watch the assignment and the DRAM plan and report (unless claimed at once),
        retried through connection losses and again after a lost session; pre-load the DRAM
        plan's models meanwhile. The claim, once the report is gone."""
        self.bridge.start()
        self._claim = asyncio.get_running_loop().create_future()
        await self.zk.connect(
            attempt_timeout=15,
            pause=2,
            then=lambda: self.zk.ensure(self.paths.pods, self.paths.assignments),
        )
        tasks = [
            asyncio.create_task(
                self.bridge.keep_registered(self._register, "the warm report", now=True),
                name="warm-report",
            ),
            asyncio.create_task(self._keep_dram(), name="warm-dram"),
        ]
        try:
            claim = await self._claim
        finally:
            for task in tasks:  # a report write under way ends first: see _write
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._withdraw()
        return claim

    async def _withdraw(self) -> None:
        """Claimed: the report goes, never to come back. Its delete waits for a write under
        way (the lock: a write that landed after it would advertise a claimed pod again), and
        no write starts after it (``claimed``, read under the lock)."""
        async with self._writes:
            self.claimed = True
            self.phase = "Claimed"
            with contextlib.suppress(*coordination.ERRORS):
                await self.zk.run(self.zk.delete, self.paths.pod(self.cfg.pod))

    async def close(self) -> None:
        """Close the session: the warm report (ephemeral) goes with it at once."""
        await self.zk.stop()

    # ------------------------------------------------------------------ ZooKeeper
    async def _register(self) -> None:
        """What the session keeps: the watches (once; the session arms them again on a new
        client) and the report (unless claimed: the assignment's first answer comes before)."""
        watches: list[tuple[str, Callable[[bytes | None, Any], None]]] = [
            (self.paths.assignment(self.cfg.pod), self._watched),
            (self.paths.dram(self.cfg.node), self._dram_watched),
        ]
        for path, callback in watches:
            if path not in self._watching:
                await self.zk.run(self.zk.watch_data, path, callback)
                self._watching.add(path)
                await asyncio.sleep(0)  # its first answer (what is there now) is on the loop now
        await self._write_report()

    def _watched(self, data: bytes | None, _stat: Any) -> None:
        self.bridge.call(self._assignment, data)

    def _assignment(self, data: bytes | None) -> None:
        """An assignment for this pod name: ours (by UID) claims us; another pod's is ignored."""
        if not data or self._claim is None or self._claim.done():
            return
        try:
            assignment = zl.Assignment.parse(data)
        except ValidationError as exc:
            try:
                uid = json.loads(data).get("podUid")
            except (ValueError, AttributeError):
                uid = None
            if uid not in (None, self.cfg.pod_uid):
                return  # an unreadable assignment for another pod of this name
            self._claim.set_exception(
                InvalidAssignment(f"the assignment for pod {self.cfg.pod} is unreadable: {exc}")
            )
            return
        if assignment.pod_uid != self.cfg.pod_uid:
            if data != self._seen:
                self._seen = data
                log.info(
                    "ignoring the assignment for pod UID %s (this pod is %s): an earlier pod's",
                    assignment.pod_uid,
                    self.cfg.pod_uid,
                )
            return
        restarted = not self.reported
        log.info(
            "claimed%s: instance %s of group %s, load %s%s",
            " at start (a process restarted in a claimed pod)" if restarted else "",
            assignment.instance,
            assignment.group,
            assignment.load_source,
            f" by NPU-fork from {assignment.fork.instance}" if assignment.fork else "",
        )
        self._claim.set_result(
            Claim(assignment, time.time(), restarted, self.pre_load_seconds, self.started_wall)
        )

    def _report(self) -> zl.WarmReport:
        cfg = self.cfg
        return zl.WarmReport(
            **pod_identity(cfg),
            incarnation=self.incarnation,
            ts=time.time(),
            preLoadSeconds=self.pre_load_seconds,
            dramModels=list(self.dram_models),
            ssdModels=cfg.ssd_models,
        )

    async def _write_report(self) -> None:
        """Our warm report as it is now, owned by our session (a previous process's is
        replaced); never once claimed. Its folders too: a server that lost its data has none.
        One write at a time; the lock is held until the write has finished in ZooKeeper, even
        when the caller is cancelled, so the claim's delete always comes after it."""
        async with self._writes:
            if self.claimed or (self._claim is not None and self._claim.done()):
                return
            data = self._report().dump()
            path = self.paths.pod(self.cfg.pod)

            def write() -> None:
                self.zk.ensure(self.paths.pods, self.paths.assignments)
                self.zk.own(path, data)

            writing = asyncio.ensure_future(self.zk.run(write))
            try:
                await asyncio.shield(writing)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await writing
                raise
            self.reported = True

    # ------------------------------------------------------------------ DRAM pre-loading
    def _dram_watched(self, data: bytes | None, _stat: Any) -> None:
        self.bridge.call(self._dram_plan, data)

    def _dram_plan(self, data: bytes | None) -> None:
        """The server's DRAM plan changed (absent: nothing planned)."""
        try:
            plan = zl.DramPlan.parse(data) if data else None
        except ValueError:
            log.error("ignoring an unreadable DRAM plan for node %s", self.cfg.node)
            return
        models = list(dict.fromkeys(plan.models)) if plan is not None else []
        if models != self.dram_plan:
            log.info("node %s's DRAM plan: %s", self.cfg.node, ", ".join(models) or "nothing")
            self.dram_plan = models
            self._dram_changed.set()

    async def _keep_dram(self) -> None:
        """Load the plan's models into host DRAM one after another, each listed in the report
        once loaded; a model the plan drops leaves the list at once (a load under way of it is
        given up)."""
        while True:
            self._dram_changed.clear()  # before reading the plan: no change is missed
            await self._evict()
            todo = [
                m
                for m in self.dram_plan
                if m not in self.dram_models and m not in self._unknown and self._known(m)
            ]
            if not todo:
                await self._dram_changed.wait()
                continue
            model = todo[0]
            if await self._preload(model):
                held = {*self.dram_models, model}
                self.dram_models = [m for m in self.dram_plan if m in held]
                self.metrics.dram_preloads.labels(model=model).inc()
                await self._rewrite_report()

    def _known(self, model: str) -> bool:
        """Whether the engine knows the model's size (a catalogue preset); logged once if not."""
        if model in catalog.PRESETS:
            return True
        log.warning("cannot pre-load %s into host DRAM: not a model this engine knows", model)
        self._unknown.add(model)
        return False

    async def _evict(self) -> None:
        """Drop from DRAM (and the report) every model the plan no longer lists."""
        kept = [m for m in self.dram_models if m in self.dram_plan]
        if kept != self.dram_models:
            gone = [m for m in self.dram_models if m not in kept]
            self.dram_models = kept
            log.info("evicted %s from host DRAM: no longer in the plan", ", ".join(gone))
            await self._rewrite_report()

    async def _preload(self, model: str) -> bool:
        """Emulate loading ``model``'s weights from the shared file service into host DRAM;
        False when the plan dropped it meanwhile (other models dropped leave the report at
        once, the load goes on)."""
        seconds = timing.dram_preload_seconds(catalog.PRESETS[model])
        deadline = self.clock.now() + seconds
        self.dram_loading = model
        log.info("pre-loading %s into host DRAM (%.2f emulated s)", model, seconds)
        try:
            while True:
                left = deadline - self.clock.now()
                if left <= 0:
                    log.info("%s is in host DRAM", model)
                    return True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.clock.to_wall(left)):
                        await self._dram_changed.wait()
                if self._dram_changed.is_set():
                    self._dram_changed.clear()
                    await self._evict()
                    if model not in self.dram_plan:
                        log.info("pre-loading %s given up: no longer in the plan", model)
                        return False
        finally:
            self.dram_loading = None

    async def _rewrite_report(self) -> None:
        """The report again (its ``dramModels`` changed), retried until written; while the
        session is suspended, the reconnection's write carries the change."""
        await self.bridge.until_written(self._write_report, "the warm report")


async def wait_for_claim(cfg: WarmConfig, stop: asyncio.Event) -> Claim | None:
    """The warm life, on the pod's address: TE-Pre-Load, report, wait. Returns the claim with the
    address let go (the claimed engine binds it next), or None when stopped first. Raises
    :class:`ConfigError` for an assignment of ours that cannot be read."""
    warm = WarmEngine(cfg)
    runner = web.AppRunner(warm.app(), access_log=None)
    await httpserving.start(
        runner, cfg.host, cfg.port, cfg.connection_limits, warm.metrics.registry
    )
    log.info(
        "warm engine %s (uid %s) on %s:%d, %d dies, time scale %g",
        cfg.pod,
        cfg.pod_uid,
        cfg.host,
        cfg.port,
        len(cfg.dies),
        cfg.time_scale,
    )

    async def life() -> Claim:
        await warm.pre_load()
        return await warm.until_claimed()

    claiming = asyncio.create_task(life(), name="warm")
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({claiming, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not claiming.done():
            return None
        try:
            return claiming.result()
        except InvalidAssignment as exc:
            log.error("%s; exiting", exc)
            raise ConfigError(str(exc)) from None
    finally:
        for task in (claiming, stopping):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await warm.close()
        await runner.cleanup()


# ------------------------------------------------------------------ the claimed engine
# What an engine of this pod is, whatever its assignment: the pod's own (its devices, node,
# identity and address); an assignment that makes an engine with another is not of this pod.
POD_FIELDS = ("dies", "roce_ips", "node", "superpod", "npus", "pod_uid", "host", "port")


def assigned(
    cfg: WarmConfig, claim: Claim, argv: list[str] | None
) -> tuple[EngineConfig, LoadPlan]:
    """The engine a claim makes of this process: the configuration from the process environment
    (the pod's: ZooKeeper, credentials, devices, platform) with the assignment's instance
    settings (``ASSIGNMENT_ENV`` keys only), its group, instance and load source
    (``config.parse``, as a cold pod of that instance), and its load plan. Raises
    :class:`ConfigError` (logged) when the assignment does not make a valid engine of this pod."""
    a = claim.assignment
    where = f"assignment of pod {cfg.pod} (group {a.group!r}, instance {a.instance!r})"
    try:
        plan = load_plan(cfg, a)
        os.environ.update(assignment_env(a))
        try:
            config = parse(argv)
        except SystemExit as exc:  # argparse refused a value (it said which, above)
            raise ValueError(f"its environment is refused (exit {exc.code})") from None
        for name in POD_FIELDS:
            made, ours = getattr(config, name), getattr(cfg, name)
            if made != ours:
                raise ValueError(f"it makes an engine with {name} {made!r}, not the pod's {ours!r}")
    except (ConfigError, ValueError) as exc:
        log.error("invalid %s: %s; exiting", where, exc)
        raise ConfigError(f"{where}: {exc}") from None
    return config, plan


def assignment_env(a: zl.Assignment) -> dict[str, str]:
    """What the assignment sets in the process environment: its instance settings (only
    ``ASSIGNMENT_ENV`` keys: anything else, say a credential path or a ZooKeeper address, is the
    pod's own and refused), the group, the instance name and the load source."""
    foreign = sorted(set(a.env) - zl.ASSIGNMENT_ENV - zl.RETIRED_ASSIGNMENT_ENV)
    if foreign:
        raise ValueError(
            f"env {', '.join(foreign)}: not an instance setting (an assignment carries only "
            f"{', '.join(sorted(zl.ASSIGNMENT_ENV))})"
        )
    claimed = EngineEnv(group=a.group, instance=a.instance, load_source=a.load_source)
    return {
        **{k: v for k, v in a.env.items() if k not in zl.RETIRED_ASSIGNMENT_ENV},
        **claimed.to_dict(),
    }


def load_plan(cfg: WarmConfig, a: zl.Assignment) -> LoadPlan:
    """The assignment's load plan, or ValueError for one that makes no sense: a group of another
    namespace than the pod's, names ZooKeeper does not take, an unknown load source, an NPU-fork
    without a fork (or a fork loaded otherwise, or over another plane than its source says), a
    fallback that is itself a fork, a fork source not at a loopback IPv4 address and port."""
    namespace, _, group = a.group.partition("/")
    zl.GroupPaths(namespace, group).report(a.instance)  # names ZooKeeper takes
    if namespace != cfg.namespace:
        raise ValueError(f"group {a.group} is not in the pod's namespace {cfg.namespace}")
    source = timing.LoadSource(a.load_source)
    fallback = timing.LoadSource(a.fallback)
    if fallback in timing.FORK_PLANES:
        raise ValueError(f"fallback {fallback} is an NPU-fork: a fallback needs no source")
    ref = a.fork
    if ref is None:
        if source in timing.FORK_PLANES:
            raise ValueError(f"loadSource {source} names no fork to load from")
        return LoadPlan(source, None, fallback)
    if source not in timing.FORK_PLANES:
        raise ValueError(f"a fork with loadSource {source}: NPUForkUB or NPUForkRoCE expected")
    if ref.plane not in (str(p) for p in FORK_PLANES):
        raise ValueError(f"fork plane {ref.plane!r} is not UB or RoCE")
    if timing.FORK_PLANES[source] is not Plane(ref.plane):
        raise ValueError(f"loadSource {source} with a fork over {ref.plane}")
    source_namespace, _, source_group = ref.group.partition("/")
    zl.GroupPaths(source_namespace, source_group).report(ref.instance)
    try:
        address = ipaddress.ip_address(ref.pod_ip)
    except ValueError:
        address = None
    if not isinstance(address, ipaddress.IPv4Address) or address not in LOOPBACK:
        raise ValueError(f"fork podIP {ref.pod_ip!r} is not a loopback IPv4 address")
    if not 1 <= ref.port <= 65535:
        raise ValueError(f"fork port {ref.port} is not a port")
    return LoadPlan(source, ref, fallback)
