"""WarmPool as a kind the loop runs (DeepServe §6.1): keep ``size`` warm, model-agnostic engine
pods per shape, refilled after claims, counted in status and metrics.

- Woken by its own events, its pods' events and the namespace's warm engines reporting in
  ZooKeeper (its store).
- A pass: parse -> observe (the pool's pods, the warm reports, what to pre-load in host DRAM)
  -> plan (pure, :mod:`matrixserve.domain.warmpool`) -> apply -> status; assignments whose pod
  is gone are removed on the way.
- A claim is not made here: a group claims a warm pod through the API server (the pod's labels
  and owner, with its resourceVersion as precondition), and the pool sees it claimed.
- Warm pods run at the serving pods' priority (a claimed pod keeps the priority it was made
  with); while serving engine pods of the namespace cannot be placed for want of NPUs, the pool
  gives up warm pods itself and does not refill.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import ValidationError

from matrixserve.adapters.warmpool_metrics import WarmPoolMetrics
from matrixserve.adapters.zk_warm import WarmStore
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import RefillPolicy, WarmPoolSpec, field_errors
from matrixserve.domain import warmpool as wp
from matrixserve.domain.effects import Effect
from matrixserve.domain.observed import PodView
from matrixserve.domain.warmpool import cleanup, dram
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
        return cls(
            rt, rt.reconciler(KIND), WarmStore(rt.session), WarmPoolMetrics(rt.metrics.registry)
        )

    def parse(self, body: Body) -> tuple[WarmPoolSpec | None, list[str]]:
        try:
            spec = WarmPoolSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            return None, field_errors(exc)
        return spec, problems(body["metadata"]["name"], spec)

    async def observe(self, body: Body, spec: WarmPoolSpec, logger: logging.Logger) -> wp.PoolView:
        rt, meta = self.rt, body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        pods = await rt.kube.list_pods(namespace, {kinds.LABEL_WARMPOOL: name})
        engines = await rt.kube.list_pods(namespace, {kinds.APP_NAME_LABEL: kinds.ENGINE_APP})
        connected = self.store.connected
        reports = await self.store.reports(namespace) if connected else {}
        if connected:
            swept = await self.store.sweep_assignments(
                namespace, {p.name: p.uid for p in engines.values()}
            )
            if swept:
                logger.info("removed the assignments of pods that are gone: %s", ", ".join(swept))
        demand, nodes = await _dram_inputs(rt, namespace) if connected else ((), {})
        return wp.PoolView(
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
            previous=body.get("status") or {},
            dram_demand=demand,
            nodes=nodes,
            taken=frozenset(self.loop.taken.get((namespace, name), set())),
            starved=_starved(engines),
        )

    def plan(self, view: wp.PoolView) -> wp.Plan:
        return wp.plan(view)

    async def admit(
        self, body: Body, view: wp.PoolView, planned: Sequence[Effect], logger: logging.Logger
    ) -> list[Effect]:
        if view.connected:  # the DRAM pre-load plans (before the pods, as they always were)
            now = time.time()
            written = await self.store.write_dram(
                view.namespace,
                {
                    node: zl.DramPlan(
                        node=node,
                        models=list(p.models),
                        bytes=p.bytes,
                        capacityBytes=p.capacity,
                        ts=now,
                    )
                    for node, p in wp.plan(view).dram.items()
                },
            )
            if written:
                logger.info("host DRAM pre-load plans changed on %s", ", ".join(sorted(written)))
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
        namespaces = self.rt.config.namespaces
        try:
            in_zookeeper = await self.store.namespaces(namespaces)
            with_pools = {ns for ns, _ in await self.rt.kube.names(KIND, namespaces)}
            with_pods = [
                ns
                for ns in in_zookeeper
                if ns not in with_pools
                and await self.rt.kube.list_pods(ns, {}, (kinds.LABEL_WARMPOOL,))
            ]
        except Exception as exc:  # retried on the next sweep
            log.warning("sweep of warm folders failed: %s", exc)
            return
        for namespace in cleanup.orphans(in_zookeeper, with_pools, with_pods):
            try:
                if await self.store.delete_namespace(namespace):
                    log.info(
                        "swept the warm folder of namespace %s: no WarmPool and no pool pod left",
                        namespace,
                    )
            except Exception as exc:  # that namespace's (not ours: NoAuth), the others go on
                log.warning("sweep of the warm folder of namespace %s failed: %s", namespace, exc)


async def _dram_inputs(
    rt: Runtime, namespace: str
) -> tuple[tuple[dram.Demand, ...], dict[str, dict[str, str]]]:
    """What to pre-load in host DRAM, in order (every pool's ``dramPreload`` of the namespace,
    then its PDGroups' models, the biggest group first), and the servers that run the
    namespace's warm pods with their labels. Read the same by every pool of the namespace."""
    demand: list[dram.Demand] = []
    for pool in sorted(await rt.kube.objects(KIND, namespace), key=lambda o: o["metadata"]["name"]):
        try:
            spec = WarmPoolSpec.model_validate(pool.get("spec") or {})
        except ValidationError:
            continue
        for entry in spec.dram_preload:
            size = dram.model_bytes(entry.model)
            if size is not None:
                why = f"WarmPool {pool['metadata']['name']}"
                demand.append(dram.Demand(entry.model, size, entry.node_selector, why))
    groups = []
    for group in await rt.kube.objects(kinds.PDGROUP, namespace):
        spec_body = group.get("spec") or {}
        model = spec_body.get("model") or {}
        replicas = sum(
            int((spec_body.get(role) or {}).get("replicas") or 0) for role in ("prefill", "decode")
        )
        size = dram.model_bytes(str(model.get("name") or ""), model.get("sizeBytes"))
        if size is not None:
            groups.append((-replicas, group["metadata"]["name"], str(model["name"]), size))
    demand += [dram.Demand(m, size, None, f"PDGroup {g}") for _, g, m, size in sorted(groups)]
    warm = await rt.kube.list_pods(
        namespace, {}, (kinds.LABEL_WARMPOOL, f"!{kinds.LABEL_CLAIMED_BY}")
    )
    servers = await rt.kube.nodes()
    nodes = {
        p.node: dict(servers[p.node].labels) if p.node in servers else {}
        for p in warm.values()
        if p.node and not p.deleting
    }
    return tuple(demand), nodes


LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def problems(name: str, spec: WarmPoolSpec) -> list[str]:
    """What the schema cannot say about a WarmPool: its name and NPU types become label values,
    its shapes' names parts of pod names, and a model to pre-load must be one the platform
    knows the size of."""
    out = []
    if len(name) > 63:
        out.append(
            f"metadata.name: {len(name)} characters; a WarmPool's name is a label value (at most 63)"
        )
    shapes = [wp.view.shape_name(s, i) for i, s in enumerate(spec.shapes)]
    if len(set(shapes)) != len(shapes):
        out.append(f"spec.shapes: names must differ (they are {', '.join(shapes)})")
    for i, (shape, s) in enumerate(zip(shapes, spec.shapes, strict=True)):
        if not DNS_LABEL.fullmatch(shape) or len(shape) > 40:
            out.append(f"spec.shapes[{i}]: its name {shape!r} is no DNS label: give it a name")
        if len(s.npu_type) > 63 or not LABEL_VALUE.fullmatch(s.npu_type):
            out.append(f"spec.shapes[{i}].npuType: {s.npu_type!r} is no label value")
    if spec.refill_policy is RefillPolicy.SCHEDULED:  # the CRD's rule (issue 31)
        out.append(
            "spec.refillPolicy: Scheduled is not implemented (there is no schedule to refill "
            "by): use Immediate (refill at once) or Manual (refill on a new generation)"
        )
    for i, entry in enumerate(spec.dram_preload):
        if dram.model_bytes(entry.model) is None:
            out.append(
                f"spec.dramPreload[{i}].model: {entry.model!r} is not a model the platform knows "
                "the size of"
            )
    return out


def _starved(pods: dict[str, PodView]) -> int:
    """Serving engine pods the scheduler cannot place for want of NPUs (not warm pods)."""
    return sum(
        1
        for p in pods.values()
        if p.phase == "Pending"
        and not p.deleting
        and (p.label(kinds.LABEL_WARMPOOL) is None or p.label(kinds.LABEL_CLAIMED_BY) is not None)
        and p.trouble is not None
        and p.trouble[0] == "Unschedulable"
        and kinds.NPU_RESOURCE in p.trouble[1]
    )
