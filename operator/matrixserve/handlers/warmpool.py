"""WarmPool as a kind the loop runs (DeepServe §6.1): keep ``size`` warm, model-agnostic engine
pods per shape, refilled after claims, counted in status and metrics; the namespace's host-DRAM
pre-load plans written where they changed (:mod:`matrixserve.domain.warmpool`).

Woken by its own events, its pods' events and the namespace's warm engines reporting in
ZooKeeper. A claim is not made here: a group claims a warm pod through the API server (the
pod's labels and owner, with its resourceVersion as precondition), and the pool sees it claimed.
Warm pods run at the serving pods' priority; while serving engine pods of the namespace cannot
be placed for want of NPUs, the pool gives up warm pods itself and does not refill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from matrixserve.adapters.warmpool_metrics import WarmPoolMetrics
from matrixserve.adapters.zk_warm import WarmStore
from matrixserve.api import kinds
from matrixserve.api.resources import WarmPoolSpec
from matrixserve.api.status import WarmPoolStatus
from matrixserve.domain import warmpool as wp
from matrixserve.domain.effects import Effect
from matrixserve.domain.warmpool import cleanup, dram, validation
from matrixserve.handlers.controller import Admission, Body, Watches
from matrixserve.handlers.reconciler import Reconciler
from matrixserve.handlers.runtime import Runtime

KIND = kinds.WARMPOOL
log = logging.getLogger("matrixserve.warmpool")


@dataclass
class WarmPools:
    rt: Runtime
    loop: Reconciler
    store: WarmStore
    metrics: WarmPoolMetrics
    kind: ClassVar[kinds.Kind] = KIND
    watches: ClassVar[Watches] = Watches(pods=kinds.LABEL_WARMPOOL, store=True)
    finalizer_id: ClassVar[str] = "leader-lets-go"  # nothing to clean up: the pods are owned
    admissions: ClassVar[tuple[Admission, ...]] = ()

    @classmethod
    def install(cls, rt: Runtime) -> WarmPools:
        metrics = WarmPoolMetrics(rt.metrics.registry)
        return cls(rt, rt.reconciler(KIND), WarmStore(rt.session), metrics)

    def parse(self, body: Body) -> tuple[WarmPoolSpec | None, list[str]]:
        return validation.parse(body)

    async def refused(self, body: Body, spec: WarmPoolSpec) -> list[str]:
        return []

    async def observe(self, body: Body, spec: WarmPoolSpec, logger: logging.Logger) -> wp.PoolView:
        kube, meta = self.rt.kube, body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        pods = await kube.list_pods(namespace, {kinds.LABEL_WARMPOOL: name})
        engines = await kube.list_pods(namespace, {kinds.APP_NAME_LABEL: kinds.ENGINE_APP})
        connected = self.store.connected
        demand: tuple[dram.Demand, ...] = ()
        nodes: dict[str, dict[str, str]] = {}
        if connected:
            uids = {p.name: p.uid for p in engines.values()}
            swept = await self.store.sweep_assignments(namespace, uids)
            if swept:
                logger.info("removed the assignments of pods that are gone: %s", ", ".join(swept))
            # what to pre-load in host DRAM, and the servers of the namespace's warm pods
            objects = (
                await kube.objects(KIND, namespace),
                await kube.objects(kinds.PDGROUP, namespace),
            )
            demand = dram.demand(*objects)
            warm = await kube.list_pods(
                namespace, {}, (kinds.LABEL_WARMPOOL, f"!{kinds.LABEL_CLAIMED_BY}")
            )
            nodes = dram.servers(warm.values(), await kube.nodes())
        return wp.PoolView(
            namespace,
            name,
            meta["uid"],
            int(meta.get("generation") or 0),
            spec,
            pods,
            await self.store.reports(namespace) if connected else {},
            self.rt.engine,
            now=time.time(),
            connected=connected,
            previous=WarmPoolStatus.model_validate(body.get("status") or {}),
            dram_demand=demand,
            nodes=nodes,
            dram_written=await self.store.dram_plans(namespace) if connected else {},
            taken=frozenset(self.loop.taken.get((namespace, name), set())),
            starved=wp.starved(engines.values()),
        )

    def plan(self, view: wp.PoolView) -> wp.Plan:
        return wp.plan(view)

    async def admit(
        self, body: Body, view: wp.PoolView, planned: Sequence[Effect], logger: logging.Logger
    ) -> list[Effect]:
        for change in planned:
            if isinstance(change, dram.WriteDramPlans):
                logger.info("host DRAM pre-load plans changed on %s", ", ".join(change.nodes))
        return await self.loop.guard_engines(view.namespace, planned, bool(view.pods), logger)

    def record(self, body: Body, view: wp.PoolView, plan: wp.Plan) -> None:
        self.metrics.record(view.namespace, view.name, plan.status)

    async def finalize(self, body: Body, logger: logging.Logger) -> None:
        """Nothing outside Kubernetes: the finalizer only waits for the leader's last pass."""

    def forget(self, namespace: str, name: str) -> None:
        self.metrics.forget(namespace, name)

    async def sweep(self) -> None:
        """Remove the warm folder of every namespace with no WarmPool and no pod of a pool left
        (ZooKeeper listed first: see :func:`cleanup.orphans`): its DRAM plans, assignments and
        empty folders belong to nothing (a namespace deleted with everything in it)."""
        namespaces, kube = self.rt.config.namespaces, self.rt.kube
        try:
            in_zookeeper = await self.store.namespaces(namespaces)
            with_pools = {ns for ns, _ in await kube.names(KIND, namespaces)}
            left = [ns for ns in in_zookeeper if ns not in with_pools]
            with_pods = [ns for ns in left if await kube.list_pods(ns, {}, (kinds.LABEL_WARMPOOL,))]
        except Exception as exc:  # retried on the next sweep
            log.warning("sweep of warm folders failed: %s", exc)
            return
        for namespace in cleanup.orphans(in_zookeeper, with_pools, with_pods):
            try:
                if await self.store.delete_namespace(namespace):
                    log.info(
                        "swept the warm folder of %s: no WarmPool, no pool pod left", namespace
                    )
            except Exception as exc:  # that namespace's (not ours: NoAuth), the others go on
                log.warning("sweep of the warm folder of namespace %s failed: %s", namespace, exc)
