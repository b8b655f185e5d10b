"""WarmPool's kopf handlers (issue 18, DeepServe §6.1): keep ``size`` warm, model-agnostic
engine pods per shape, refilled after claims, counted in status and metrics.

- ``@kopf.daemon`` per WarmPool runs the shared per-object loop (:mod:`.reconciler`), woken by
  its own events, its pods' events and the namespace's warm engines reporting in ZooKeeper.
- ``reconcile``: parse -> observe (the pool's pods, the warm reports, the host-DRAM plans) ->
  plan (pure, :mod:`matrixserve.domain.warmpool`) -> apply (pods; DRAM plans to the store) ->
  status; assignments whose pod is gone are removed on the way.
- A claim is not made here: a group claims a warm pod through the API server (the pod's labels
  and owner, with its resourceVersion as precondition), and the pool sees it claimed.
- Warm pods run at the serving pods' priority (a claimed pod keeps the priority it was made
  with); while serving engine pods of the namespace cannot be placed for want of NPUs, the pool
  gives up warm pods itself and does not refill.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Gauge

from matrixserve.adapters.zk_warm import WarmStore
from matrixserve.api import kinds
from matrixserve.api.status import WarmPoolStatus
from matrixserve.domain import warmpool as wp
from matrixserve.domain.warmpool import cleanup, dram, validation
from matrixserve.handlers.leadership import finalizer_pending, lead_or_gone
from matrixserve.handlers.reconciler import Reconciler, wake_on_events
from matrixserve.handlers.runtime import Runtime

KIND = kinds.WARMPOOL
API = (KIND.group, KIND.version, KIND.plural)
log = logging.getLogger("matrixserve.warmpool")


class WarmPoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pods = Gauge(
            "matrixserve_warmpool_pods",
            "Warm pods by pool, shape and state (ready: claimable; warming; claimed: a group's)",
            ["namespace", "pool", "shape", "state"],
            registry=registry,
        )
        self.forks = Gauge(
            "matrixserve_warmpool_fork_claims",
            "Claimed pods of the pool whose claim chose an NPU-fork path",
            ["namespace", "pool"],
            registry=registry,
        )
        self.shown: dict[tuple[str, str], set[str]] = {}  # shapes exported, by pool

    def record(self, namespace: str, pool: str, status: WarmPoolStatus) -> None:
        shapes = {row.name: row for row in status.shapes}
        for gone in self.shown.get((namespace, pool), set()) - set(shapes):
            for state in ("ready", "warming", "claimed"):
                self.pods.remove(namespace, pool, gone, state)
        for shape, row in shapes.items():
            for state in ("ready", "warming", "claimed"):
                self.pods.labels(namespace, pool, shape, state).set(getattr(row, state))
        self.shown[(namespace, pool)] = set(shapes)
        self.forks.labels(namespace, pool).set(status.forks_done)

    def forget(self, namespace: str, pool: str) -> None:
        """A pool that is gone exports nothing."""
        for shape in self.shown.pop((namespace, pool), set()):
            for state in ("ready", "warming", "claimed"):
                self.pods.remove(namespace, pool, shape, state)
        with contextlib.suppress(KeyError):
            self.forks.remove(namespace, pool)


@dataclass
class WarmPools:
    rt: Runtime
    loop: Reconciler
    store: WarmStore
    metrics: WarmPoolMetrics
    kind: kinds.Kind = KIND


def install(rt: Runtime) -> WarmPools:
    pools = WarmPools(
        rt, rt.reconciler(KIND), WarmStore(rt.session), WarmPoolMetrics(rt.metrics.registry)
    )
    rt.add_sweep(lambda: sweep(pools))
    return pools


async def sweep(pools: WarmPools) -> None:
    """Remove the warm folder of every namespace with no WarmPool and no pod of a pool left
    (ZooKeeper listed first: see :func:`cleanup.orphans`): its DRAM plans, assignments and
    empty folders belong to nothing (issue 31: a namespace deleted with everything in it)."""
    namespaces = pools.rt.config.namespaces
    try:
        in_zookeeper = await pools.store.namespaces(namespaces)
        with_pools = {ns for ns, _ in await pools.rt.kube.names(KIND, namespaces)}
        with_pods = [
            ns
            for ns in in_zookeeper
            if ns not in with_pools
            and await pools.rt.kube.list_pods(ns, {}, (kinds.LABEL_WARMPOOL,))
        ]
    except Exception as exc:  # retried on the next sweep
        log.warning("sweep of warm folders failed: %s", exc)
        return
    for namespace in cleanup.orphans(in_zookeeper, with_pools, with_pods):
        try:
            if await pools.store.delete_namespace(namespace):
                log.info(
                    "swept the warm folder of namespace %s: no WarmPool and no pool pod left",
                    namespace,
                )
        except Exception as exc:  # that namespace's (not ours: NoAuth), the others go on
            log.warning("sweep of the warm folder of namespace %s failed: %s", namespace, exc)


def pools_of(memo: kopf.Memo) -> WarmPools:
    pools: WarmPools = memo.runtime.controllers[KIND.kind]
    return pools


# --------------------------------------------------------------------------- wake-ups
wake_on_events(API, kinds.LABEL_WARMPOOL, lambda memo: pools_of(memo).loop)


@kopf.daemon(*API, id="reconciler", cancellation_timeout=10.0)
async def reconciler(
    name: str,
    namespace: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    pools = pools_of(memo)
    wakes: list[Any] = []

    async def reconcile_pool(ns: str, pool: str, log: logging.Logger) -> bool:
        return await reconcile(pools, ns, pool, log)

    async def arm(ns: str, pool: str, wake: Any) -> bool:
        if not pools.store.connected:
            return False
        await pools.store.ensure(ns)
        await pools.rt.session.run(pools.store.watch, ns, wake)
        wakes.append(wake)
        return True

    try:
        await pools.loop.run(namespace, name, stopped, logger, reconcile_pool, arm)
    finally:
        for wake in wakes:
            pools.store.unwatch(namespace, wake)
        pools.metrics.forget(namespace, name)


@kopf.on.delete(*API, id="leader-lets-go")
async def deleted(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A pool's finalizer (kopf's, for its daemon) goes when the leader's daemon has stopped:
    a standby's own daemon stops at once, and without this its kopf would let the pool go
    while the leader's last pass still runs. Nothing to clean up: the pool's pods are owned."""
    pools = pools_of(memo)

    await lead_or_gone(pools.rt.leadership, finalizer_pending(pools.rt.kube, KIND, namespace, name))


async def _dram_inputs(
    rt: Runtime, namespace: str
) -> tuple[tuple[dram.Demand, ...], dict[str, dict[str, str]]]:
    """What to pre-load in host DRAM, in order (:func:`dram.demand` over the namespace's pools
    and groups), and the servers that run the namespace's warm pods with their labels. Read the
    same by every pool of the namespace."""
    demand = dram.demand(
        await rt.kube.objects(KIND, namespace), await rt.kube.objects(kinds.PDGROUP, namespace)
    )
    warm = await rt.kube.list_pods(
        namespace, {}, (kinds.LABEL_WARMPOOL, f"!{kinds.LABEL_CLAIMED_BY}")
    )
    return demand, dram.servers(warm.values(), await rt.kube.nodes())


async def reconcile(pools: WarmPools, namespace: str, name: str, logger: logging.Logger) -> bool:
    rt = pools.rt
    body = await rt.kube.get(KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    meta = body["metadata"]
    spec, errors = validation.parse(body)
    if spec is None or errors:
        await pools.loop.report_invalid(body, errors, logger)
        return False
    pools.loop.spec_valid(namespace, name)
    pods = await rt.kube.list_pods(namespace, {kinds.LABEL_WARMPOOL: name})
    engines = await rt.kube.list_pods(namespace, {kinds.APP_NAME_LABEL: kinds.ENGINE_APP})
    connected = pools.store.connected
    reports = await pools.store.reports(namespace) if connected else {}
    if connected:
        swept = await pools.store.sweep_assignments(
            namespace, {p.name: p.uid for p in engines.values()}
        )
        if swept:
            logger.info("removed the assignments of pods that are gone: %s", ", ".join(swept))
    demand, nodes = await _dram_inputs(rt, namespace) if connected else ((), {})
    view = wp.PoolView(
        namespace,
        name,
        meta["uid"],
        int(meta.get("generation") or 0),
        spec,
        pods,
        reports,
        rt.engine,
        now=time.time(),
        connected=connected,
        previous=WarmPoolStatus.model_validate(body.get("status") or {}),
        dram_demand=demand,
        nodes=nodes,
        dram_written=await pools.store.dram_plans(namespace) if connected else {},
        taken=frozenset(pools.loop.taken.get((namespace, name), set())),
        starved=wp.starved(engines.values()),
    )
    plan = wp.plan(view)

    async def dram_plans(change: dram.WriteDramPlans) -> None:
        await pools.store.apply(namespace, change)
        logger.info("host DRAM pre-load plans changed on %s", ", ".join(change.nodes))

    actions = await pools.loop.guard_engines(namespace, plan.actions, bool(pods), logger)
    busy = await pools.loop.apply(body, actions, dram_plans)
    await pools.loop.write_status(body, plan.status.dump(), plan.conditions)
    pools.metrics.record(namespace, name, plan.status)
    return busy
