"""Operator start-up and shut-down: explicit kopf settings, clients in the memo, metrics server.

Configuration comes from ``python -m matrixserve`` flags (:class:`OperatorConfig`), passed in
kopf's memo with the kinds to run (``memo.kinds``: each kind's controller class, whose
``install(runtime)`` builds its controller); nothing lives in module globals. The
:class:`Runtime` holds what every kind shares: the Kubernetes adapter, the one ZooKeeper
session, the engine settings, the metrics, each kind's loop and controller. The functions here
are registered with kopf by :mod:`.kinds`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import start_http_server

from matrixserve.adapters.kube import KubeAdapter, api_client, credentials
from matrixserve.adapters.lease import LeaseAdapter
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.zk_layout import Credentials
from matrixserve.coordination import Session, SessionState
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.leadership import Timing
from matrixserve.handlers.controller import AnyController
from matrixserve.handlers.leadership import Leadership
from matrixserve.handlers.reconciler import Reconciler

WEBHOOK_CONFIGURATION = kinds.GROUP
log = logging.getLogger("matrixserve.runtime")


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None
    zookeeper: str
    engine: EngineSettings
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 8080
    webhook: bool = True
    webhook_address: str = "127.0.0.1"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_ca: str | None = None
    webhook_managed: bool = True  # kopf creates/patches the configuration (off: the chart owns it)
    worker_limit: int = 64
    resync_seconds: float = 10.0
    zk_watches: bool = True
    sweep_seconds: float = 60.0  # the kinds' sweeps of ZooKeeper data nothing owns any more
    namespaces: tuple[str, ...] = ()  # watched namespaces (none: the whole cluster)
    zookeeper_auth: Credentials | None = None  # the digest identity (None: open znodes)
    # Leader election: the Lease "<namespace>/<name>" replicas elect on (None: no
    # election, this operator always acts), this replica's identity in it, the timing.
    leader_lease: str | None = None
    leader_identity: str = ""
    leader_timing: Timing = field(default_factory=Timing)


@dataclass
class Runtime:
    config: OperatorConfig
    kube: KubeAdapter
    session: Session
    metrics: OperatorMetrics
    loop: asyncio.AbstractEventLoop
    controllers: dict[kinds.Kind, AnyController] = field(default_factory=dict)  # built at start-up
    loops: dict[kinds.Kind, Reconciler] = field(default_factory=dict)
    background: asyncio.Task[None] | None = None
    sweeping: asyncio.Task[None] | None = None
    sweep_again: bool = False
    ticker: asyncio.Task[None] | None = None
    leadership: Leadership | None = None
    electing: asyncio.Task[None] | None = None

    @property
    def engine(self) -> EngineSettings:
        return self.config.engine

    def reconciler(self, kind: kinds.Kind) -> Reconciler:
        """A new per-object loop for ``kind``, woken with the others when ZooKeeper is back."""
        loop = Reconciler(
            kind,
            self.kube,
            self.metrics,
            self.loop,
            resync_seconds=self.config.resync_seconds,
            event_driven=self.config.zk_watches,
            gate=self.leadership,
        )
        self.loops[kind] = loop
        return loop

    @property
    def reconcilers(self) -> list[Reconciler]:
        return list(self.loops.values())

    def wake_all(self) -> None:
        for loop in self.loops.values():
            loop.wake_all()

    # ------------------------------------------------------------------ sweeps
    def sweep(self) -> None:
        """Start the kinds' sweeps of ZooKeeper data that belongs to nothing that exists any
        more (a deletion while ZooKeeper was away, a namespace deleted with everything in it,
        what engines left when they went), one after another: on every new ZooKeeper session
        (start-up included) and every ``sweep_seconds`` while connected. A sweep logs its own
        failures; asked while they run, they run once more after (a new session's sweep is
        never dropped). The leader's alone: a standby's sweep
        would delete what the leader has just made (a new group's subtree before its object
        reached the standby's view)."""
        if self.leadership is not None and not self.leadership.may_act():
            return
        if self.sweeping is None or self.sweeping.done():
            self.sweeping = self.loop.create_task(self._sweep_all())
        else:
            self.sweep_again = True

    async def _sweep_all(self) -> None:
        while True:
            self.sweep_again = False
            for controller in list(self.controllers.values()):
                try:
                    await controller.sweep()
                except Exception:  # one kind's failure never skips the others' sweeps
                    log.exception("a sweep failed")
            if not self.sweep_again:
                return

    async def sweep_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_seconds)
            if self.session.connected:
                self.sweep()


def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's own calls (watches, patches, Events) under the operator's identity: --kubeconfig
    if given, else the pod's service account (kopf's default would read $KUBECONFIG first)."""
    cfg: OperatorConfig = memo.config
    return kopf.ConnectionInfo(**credentials(cfg.kubeconfig))


def configure(settings: kopf.OperatorSettings, cfg: OperatorConfig) -> None:
    """kopf's settings: where it keeps its marks, who its Events say wrote them, how long its
    own calls may take, the webhook server."""
    settings.persistence.finalizer = kinds.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=kinds.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=kinds.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # Events say who wrote them (`kubectl describe`'s From column), not the framework
    settings.posting.reporting_component = "matrixserve-operator"
    settings.posting.reporting_instance = cfg.leader_identity or "matrixserve-operator"
    settings.posting.event_name_prefix = "matrixserve-"
    settings.queueing.worker_limit = cfg.worker_limit
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 5
    # kopf's own calls (Events, finalizers) bounded as ours are (adapters.kube.REQUEST_TIMEOUT),
    # not aiohttp's five minutes
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 5
    if cfg.webhook:
        settings.admission.server = kopf.WebhookServer(
            addr=cfg.webhook_address,
            port=cfg.webhook_port,
            host=cfg.webhook_host or cfg.webhook_address,
            certfile=cfg.webhook_cert,
            pkeyfile=cfg.webhook_key,
            cafile=cfg.webhook_ca,
        )
        if cfg.webhook_managed:
            settings.admission.managed = WEBHOOK_CONFIGURATION


async def startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    cfg: OperatorConfig = memo.config
    configure(settings, cfg)
    metrics = OperatorMetrics()
    session = Session(cfg.zookeeper, auth=cfg.zookeeper_auth)
    api = api_client(cfg.kubeconfig)
    lease = None
    if cfg.leader_lease:
        lease_namespace, lease_name = cfg.leader_lease.split("/", 1)
        lease = LeaseAdapter(api, lease_namespace, lease_name)
    leadership = Leadership(cfg.leader_identity, lease, cfg.leader_timing, metrics.registry)
    runtime = Runtime(
        config=cfg,
        kube=KubeAdapter(api, pod_secrets=cfg.engine.secrets(), pod_policies=cfg.engine.policies()),
        session=session,
        metrics=metrics,
        loop=asyncio.get_running_loop(),
        leadership=leadership,
    )
    memo.runtime = runtime
    for kind in memo.kinds:  # each kind's controller class
        runtime.controllers[kind.kind] = kind.install(runtime)

    last = [SessionState.CONNECTING]

    def on_state(state: SessionState) -> None:  # from a kazoo thread
        metrics.set_zk_state(state)
        # Every transition changes what may be planned: back, every object re-plans; gone, every
        # object says so at once (its last known status kept) rather than at the next resync.
        runtime.loop.call_soon_threadsafe(runtime.wake_all)
        if state is SessionState.CONNECTED and last[0] in (
            SessionState.CONNECTING,
            SessionState.LOST,
        ):  # a new session: sweep what deletions could not remove
            runtime.loop.call_soon_threadsafe(runtime.sweep)
        last[0] = state

    session.add_listener(on_state)
    metrics.set_zk_state(SessionState.CONNECTING)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_address, registry=metrics.registry)
    # Never block start-up on ZooKeeper: until it connects, reconcilers plan nothing destructive.
    runtime.background = asyncio.get_running_loop().create_task(
        _connect(session, leadership, logger)
    )
    runtime.ticker = asyncio.get_running_loop().create_task(runtime.sweep_periodically())
    if leadership.elected:
        # Leading: every object looks again at once and what nothing owns is swept. Lost (a
        # renewal overdue): the process stops, as controller-runtime's do, and its pod
        # restarts it as a candidate with nothing of the old term in memory.
        leadership.on_gained.append(runtime.wake_all)
        leadership.on_gained.append(runtime.sweep)
        leadership.on_lost.append(lambda: _stop_self(memo))
        # No write from a replica that does not lead, wherever it is made from.
        runtime.kube.fence = leadership.check
        session.fence = leadership.check
        runtime.electing = asyncio.get_running_loop().create_task(leadership.run())

        def ended(task: asyncio.Task[None]) -> None:  # the election must not die unseen
            if not task.cancelled() and not leadership.lost:
                log.error("the leader election stopped: %r", task.exception())
                leadership.lost = True
                _stop_self(memo)

        runtime.electing.add_done_callback(ended)
        logger.info(
            "electing on the Lease %s as %s: a standby until it leads (it serves the webhook)",
            cfg.leader_lease,
            cfg.leader_identity,
        )


def _stop_self(memo: kopf.Memo) -> None:
    """kopf's own graceful stop (its SIGTERM handler); ``main`` then exits 1."""
    memo.leadership_lost = True
    os.kill(os.getpid(), signal.SIGTERM)


async def _connect(session: Session, leadership: Leadership, logger: logging.Logger) -> None:
    await session.connect(attempt_timeout=5, pause=2)
    logger.info("connected to ZooKeeper %s", session.hosts)
    await leadership.wait()  # the ACLs below are a write: the leader's
    # Znodes made before the identity was configured (an upgrade) are ours now, except the
    # groups' subtrees: their engines, started before, have no credential and still write there.
    # Each group's is closed once its pods carry the credential (its reconciler's business).
    if session.auth is not None:
        await session.restrict_existing(skip=zl.is_group_root)


async def cleanup(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is not None:
        for task in (runtime.background, runtime.ticker, runtime.sweeping, runtime.electing):
            if task is not None:
                task.cancel()
        if runtime.electing is not None:  # no renewal in flight when the Lease is released
            await asyncio.gather(runtime.electing, return_exceptions=True)
        if runtime.leadership is not None:
            await runtime.leadership.release()
        if runtime.session.connected:
            await runtime.session.stop()
    logger.info("operator stopped")
