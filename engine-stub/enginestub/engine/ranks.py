"""Instances of several pods, one per server: the leader and its workers.

CloudMatrix-Infer deploys DeepSeek-R1 as prefills of 16 NPUs on 2 servers (EP32) and a decode of
160 NPUs on 20 servers (EP320) (§4.1, §5.1; notes 001 §2.2-2.3); DeepServe's TE "may span
multiple pods on multiple machines". Here an instance of ``ranks`` pods has one engine process per
pod, all with the same dies (``ENGINE_RANK``/``ENGINE_RANKS``; pod names ``<instance>``,
``<instance>-1``, ...):

- **The leader** (rank 0) is the instance to the group: it serves every request, timed for the
  whole instance's shape (every rank's dies: :attr:`EngineConfig.shape`), and reports under
  ``reports/<instance>`` once every worker holds its dies. Its report lists every rank (itself
  first, :class:`~matrixserve.api.zk_layout.RankEntry`) and its ``roceIps`` and ``dies`` are
  every rank's in rank order, so the RoCE map, the links and their sub-links are the whole
  instance's with nothing else changed (device k of the instance is the k-th).
- **A worker** (rank k >= 1, :class:`RankWorker`) holds its dies: TE-Pre-Load, TE-Load of its
  own dies' share of the weights (the same load model), then an ephemeral
  ``ranks/<instance>.<k>`` (:class:`~matrixserve.api.zk_layout.RankReport`) written by its own
  ZooKeeper session, refreshed every health interval (its ``ts``, a heartbeat) and rewritten at
  once when its state changes (a die, NPU or HBM fault of its own: ``Faulty``, typed as the
  leader types its own). It serves nothing: every engine request is refused 409, naming its
  leader. Its RoCE IPs are identities in the leader's report, never a connection target.
- **The leader watches its workers** (:class:`RankGang`): a rank's report gone, ``Faulty``, not
  refreshed within the operator's staleness bound (3 health intervals and 10 s,
  ``GroupView.stale``) or of another incarnation than the instance was formed with (a restarted
  worker: the communicator it was in is gone) makes the instance Faulty at once, as a die fault
  does (a :data:`~matrixserve.api.zk_layout.EngineFaultKind.RANK` fault naming that rank's pod,
  server and dies). When every rank serves again, the leader re-forms in its process
  (:meth:`enginestub.engine.resident.Resident.reform`): weights kept, KV dropped, a new
  incarnation, and it rejoins its group as a newcomer (report, map, link, serve), so only the
  worker's pod restarted.

No byte moves between a worker and its leader but ZooKeeper's: the expert-parallel traffic of the
instance (FusedDispatch and FusedCombine over UB, CloudMatrix-Infer §4.2.1; notes 001 §2.8) is
charged by the timing model of the leader's whole shape (:func:`enginestub.timing.decode_step_cost`),
not sent over loopback. An instance of several pods is no NPU-fork source (forking one is out of
scope): its leader writes no ``forksources/`` entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from enginestub.engine.bucket import ZkBucket
from enginestub.engine.config import EngineConfig, pod_identity
from enginestub.engine.core import Engine
from enginestub.engine.zkbridge import SessionBridge, join_group
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError
from matrixserve.coordination import Session

log = logging.getLogger("enginestub.ranks")

# The operator's staleness rule (matrixserve.domain.pdgroup.view: STALE_INTERVALS health
# intervals and STALE_GRACE_SECONDS more): a rank not refreshed for as long is lost to its leader.
STALE_INTERVALS = 3.0
STALE_GRACE_SECONDS = 10.0
CHECK_SECONDS = 1.0  # wall s between the leader's looks at its ranks' freshness


def stale_after(config: EngineConfig) -> float:
    """Wall seconds without a refresh after which a rank is lost (the operator's rule)."""
    interval = config.health_interval / config.time_scale
    return STALE_INTERVALS * interval + STALE_GRACE_SECONDS


def refused(config: EngineConfig) -> EngineError:
    """What a worker answers every engine request: the instance is served by its leader."""
    return EngineError(
        409,
        "not_the_leader",
        f"rank {config.rank} of {config.instance}: requests go to its leader {config.instance}",
    )


def own_entry(config: EngineConfig, incarnation: str) -> zl.RankEntry:
    """This pod as a rank of its instance."""
    return zl.RankEntry(
        rank=config.rank,
        pod=config.pod or config.instance,
        podUid=config.pod_uid,
        node=config.node,
        superpod=config.superpod,
        npus=config.npus,
        dies=config.dies,
        roceIps=config.own_roce_ips,
        incarnation=incarnation,
    )


# ---------------------------------------------------------------------------------- the leader
class RankGang:
    """The leader's view of its workers: each rank's report as ZooKeeper last said it, and the
    ranks the instance was formed with (their incarnations)."""

    def __init__(self, config: EngineConfig, paths: zl.GroupPaths) -> None:
        self.config = config
        self.paths = paths
        self.workers = range(1, config.ranks)
        self.reports: dict[int, zl.RankReport | None] = dict.fromkeys(self.workers)
        self.formed: dict[int, zl.RankEntry] = {}
        self.changed = asyncio.Event()
        self.stale_after = stale_after(config)
        self._since: dict[int, float] = {}  # rank -> wall time its fault was first seen

    def watch(self, zk: Session, bridge: SessionBridge) -> None:
        """Follow every worker's report (created, refreshed, deleted) on the event loop."""

        def follow(k: int) -> Callable[[bytes | None, object], None]:
            # two parameters exactly: kazoo passes a third (the event) to a callback taking one
            def on_report(data: bytes | None, _stat: object) -> None:
                bridge.call(self._set, k, data)

            return on_report

        for k in self.workers:
            zk.watch_data(self.paths.rank(self.config.instance, k), follow(k))

    def _set(self, k: int, data: bytes | None) -> None:
        report = None
        if data:
            try:
                report = zl.RankReport.parse(data)
            except ValueError:
                log.error("ignoring an unreadable report of rank %d", k)
        if report is not None and (report.instance, report.rank) != (self.config.instance, k):
            log.error(
                "ignoring rank %d's znode: it reports %s rank %d", k, report.instance, report.rank
            )
            report = None
        self.reports[k] = report
        self.changed.set()

    def why_not(self, k: int, now: float, formed: bool) -> str | None:
        """Why rank ``k`` is no member in good standing now (None: it is): no report, Faulty,
        stale; and, once ``formed``, of another incarnation than the instance was formed with."""
        report, entry = self.reports[k], self.formed.get(k)
        if report is None:
            return "its report is gone" if formed and entry is not None else "no report yet"
        if report.state is zl.HealthState.FAULTY:
            faults = "; ".join(f"{f.kind}: {f.detail}" for f in report.faults)
            return f"Faulty ({faults or 'no fault said'})"
        if now - report.ts > self.stale_after:
            return f"not refreshed for {now - report.ts:.1f} s (bound {self.stale_after:g} s)"
        if formed and entry is not None and report.incarnation != entry.incarnation:
            return (
                f"restarted (incarnation {report.incarnation}, the instance was formed with "
                f"{entry.incarnation}): its communicator is gone"
            )
        return None

    def waiting(self, now: float) -> dict[int, str]:
        """The ranks a formation waits for (none: every worker serves, fresh), with why."""
        whys = {k: self.why_not(k, now, formed=False) for k in self.workers}
        return {k: why for k, why in whys.items() if why is not None}

    def faults(self, now: float) -> dict[int, zl.EngineFault]:
        """The formed instance's lost or faulty ranks, each an engine fault of kind ``Rank``
        naming its pod, server and dies, since it was first seen."""
        found: dict[int, zl.EngineFault] = {}
        for k in self.workers:
            why = self.why_not(k, now, formed=True)
            if why is None:
                self._since.pop(k, None)
                continue
            known = self.formed.get(k) or self.reports[k]
            pod, node = (known.pod, known.node) if known is not None else ("?", "?")
            found[k] = zl.EngineFault(
                kind=zl.EngineFaultKind.RANK,
                since=self._since.setdefault(k, now),
                detail=f"rank {k} (pod {pod} on server {node}): {why}",
                dies=list(known.dies) if known is not None else [],
            )
        return found

    def form(self, leader: zl.RankEntry) -> list[zl.RankEntry]:
        """The instance as its ranks serve now (the caller has seen :meth:`waiting` empty):
        every rank in rank order, the leader first; remembered as the instance formed."""
        workers = [r.entry() for k in self.workers if (r := self.reports[k]) is not None]
        if len(workers) != len(self.workers):
            raise RuntimeError("a rank has no report: the instance cannot be formed")
        self.formed = {e.rank: e for e in workers}
        self._since.clear()
        return [leader, *workers]


def instance_roce_ips(entries: list[zl.RankEntry]) -> list[str]:
    """The instance's RoCE IPs by device: every rank's, in rank order."""
    return [ip for e in entries for ip in e.roce_ips]


# ---------------------------------------------------------------------------------- a worker
class RankWorker:
    """A worker's side of its instance: it holds its dies and keeps its rank report fresh.
    The same life as the resident process's (start, the task that ends only by failing, stop,
    ready) so the process runs either."""

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        if cfg.group is None or cfg.zookeeper is None or cfg.rank < 1:
            raise ValueError("a worker is a rank >= 1 of an instance in a group with ZooKeeper")
        self.engine = engine
        self.namespace, self.group = cfg.group.split("/", 1)
        self.paths = zl.GroupPaths(self.namespace, self.group)
        self.path = self.paths.rank(cfg.instance, cfg.rank)
        self.incarnation = uuid.uuid4().hex[:16]
        self.zk = Session(cfg.zookeeper, timeout=10.0, auth=cfg.zookeeper_auth)
        self.bridge = SessionBridge(self.zk)
        # its share of the weights, read from the shared file service with every other reader
        engine.bucket = ZkBucket(
            self.zk, self.bridge, f"{self.namespace}.{self.group}.{cfg.instance}.{cfg.rank}"
        )
        self.phase = "Starting"
        self.written = False  # a rank report of ours is in ZooKeeper
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        engine.on_health_change = self._dirty.set

    @property
    def ready(self) -> bool:
        """Its rank report written and not Faulty (``/readyz``, with the engine's own)."""
        return self.written and not self.engine.engine_faults()

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    async def start(self) -> None:
        self.bridge.start()
        self._task = asyncio.create_task(self._connect_and_run(), name="rank-worker")

    async def stop(self) -> None:
        """Stop, and close the session: the rank report goes at once (its leader sees the rank
        lost now, not after the session's timeout)."""
        self.engine.shutdown(f"rank {self.engine.config.rank} is stopping")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.zk.stop()

    async def _connect_and_run(self) -> None:
        def waiting(exc: Exception) -> None:
            self.phase = "WaitingForZooKeeper"
            log.warning("ZooKeeper %s unreachable (%s); retrying", self.zk.hosts, exc)

        await join_group(self.zk, self.paths, waiting)
        self.phase = "Loading"
        await self.engine.load_model()  # its own dies' share (the engine's load model)
        self.phase = "Holding"
        cfg = self.engine.config
        log.info(
            "rank %d of %s holds dies %s (RoCE %s); its leader %s serves",
            cfg.rank,
            cfg.instance,
            cfg.dies,
            ",".join(cfg.roce_ips),
            cfg.instance,
        )
        await self.bridge.until_written(self._write, "the rank report")
        interval = self.engine.clock.to_wall(cfg.health_interval)
        await asyncio.gather(
            self.bridge.keep_fresh(self._dirty, interval, self._write, "the rank report"),
            self.bridge.keep_registered(self._write, "the rank report"),
        )

    def report(self) -> zl.RankReport:
        cfg, faults = self.engine.config, self.engine.engine_faults()
        return zl.RankReport(
            **{**pod_identity(cfg), "pod": cfg.pod or f"{cfg.instance}-{cfg.rank}"},
            instance=cfg.instance,
            rank=cfg.rank,
            incarnation=self.incarnation,
            ts=time.time(),
            state=zl.HealthState.FAULTY if faults else zl.HealthState.SERVING,
            faults=faults,
        )

    async def _write(self) -> None:
        """Our rank report, owned by our session (a previous process's is replaced)."""
        if self.bridge.suspended.is_set():
            return
        await self.zk.run(self.zk.own, self.path, self.report().dump())
        self.written = True
