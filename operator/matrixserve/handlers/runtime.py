"""Operator start-up and shut-down: explicit kopf settings, clients in the memo, metrics server.

Configuration comes from ``python -m matrixserve`` flags (:class:`OperatorConfig`), passed in
kopf's memo; nothing lives in module globals.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import kopf
from prometheus_client import start_http_server

from matrixserve.adapters.kube import KubeAdapter, api_client, credentials
from matrixserve.adapters.zookeeper import ZkAdapter
from matrixserve.domain.pods import EngineSettings
from matrixserve.handlers.metrics import OperatorMetrics
from matrixserve.handlers.pdgroup import Runtime

WEBHOOK_CONFIGURATION = "matrixserve.io"


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


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's own calls (watches, patches, Events) under the operator's identity: --kubeconfig
    if given, else the pod's service account (kopf's default would read $KUBECONFIG first)."""
    cfg: OperatorConfig = memo.config
    return kopf.ConnectionInfo(**credentials(cfg.kubeconfig))


@kopf.on.startup()
async def startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    cfg: OperatorConfig = memo.config
    settings.persistence.finalizer = "matrixserve.io/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="matrixserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="matrixserve.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.batching.worker_limit = cfg.worker_limit
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
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
    metrics = OperatorMetrics()
    zk = ZkAdapter(cfg.zookeeper)
    kube = KubeAdapter(api_client(cfg.kubeconfig))
    runtime = Runtime(
        kube=kube, zk=zk, engine=cfg.engine, metrics=metrics, loop=asyncio.get_running_loop()
    )
    memo.runtime = runtime

    def on_state(state: str) -> None:  # from a kazoo thread
        metrics.set_zk_state(state)
        if state == "CONNECTED":  # coordination is back: let every group re-plan now
            runtime.loop.call_soon_threadsafe(runtime.wake_all)

    zk.on_state = on_state
    metrics.set_zk_state("CONNECTING")
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_address, registry=metrics.registry)
    # Never block start-up on ZooKeeper: until it connects, reconcilers plan nothing destructive.
    runtime.background = asyncio.get_running_loop().create_task(_connect(zk, cfg.zookeeper, logger))


async def _connect(zk: ZkAdapter, hosts: str, logger: logging.Logger) -> None:
    while not zk.connected:
        try:
            await zk.start(timeout=5)
            logger.info("connected to ZooKeeper %s", hosts)
        except Exception as exc:  # kazoo raises its own timeout types
            logger.warning("ZooKeeper %s unreachable (%s); retrying", hosts, exc)
            await asyncio.sleep(2)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    runtime: Runtime | None = getattr(memo, "runtime", None)
    if runtime is not None:
        if runtime.background is not None:
            runtime.background.cancel()
        if runtime.zk.connected:
            await runtime.zk.stop()
    logger.info("operator stopped")
