"""ExpertPool as a kind the loop runs (EaaS §3.1, §3.4, §4.4; xDeepServe §4.5): expert server
pods, the expert map in ZooKeeper, failover, fine-grained scaling and the autoscaler
(:mod:`matrixserve.domain.expertpool`).

Woken by its own events, its server pods' events, and the pool's ZooKeeper store: a server
registering or going (its ephemeral report: the failover's trigger) and the map's pointer. The
admission webhook refuses a spec the map cannot exist for, with the numbers (slots, distinct
servers, HBM), and a scale (``servers.replicas`` or the scale subresource) below the coverage
bound; the reconciler checks the same again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from matrixserve.adapters.expertpool_metrics import ExpertPoolMetrics
from matrixserve.adapters.zk_experts import ExpertStore
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.api.status import ExpertPoolStatus
from matrixserve.domain import expertpool as ep
from matrixserve.domain.effects import Effect
from matrixserve.domain.expertpool import validation, warm
from matrixserve.domain.expertpool.pods import LABEL_EXPERTPOOL, template_changes
from matrixserve.handlers.controller import Admission, Body, Invalid, Request, Watches
from matrixserve.handlers.reconciler import Reconciler
from matrixserve.handlers.runtime import Runtime

KIND = kinds.EXPERTPOOL
log = logging.getLogger("matrixserve.expertpool")


def check(request_spec: Mapping[str, Any], name: str) -> list[str]:
    """A spec as the reconciler would check it (what it refuses: nothing is created for it)."""
    _, errors = validation.parse_spec(request_spec, name)
    return errors


async def check_rules(pools: ExpertPools, request: Request) -> list[str]:
    """Create and update: the rules before the object is stored, and on an update the template
    its server pods run; an object being deleted passes."""
    if request.deleting:
        return []
    spec, errors = validation.parse_spec(request.body.get("spec") or {}, request.name)
    if spec is None or request.operation != "UPDATE":
        return errors
    return errors + await pools.running_changes(request.namespace, request.name, spec)


async def check_scale(pools: ExpertPools, request: Request) -> list[str]:
    """The scale subresource (``kubectl scale``; the request's object is an autoscaling/v1
    Scale): its ``spec.replicas`` applied to the stored pool's ``spec.servers.replicas``, and
    the result checked."""
    current = await pools.rt.kube.get(KIND, request.namespace, request.name)
    if current is None or current["metadata"].get("deletionTimestamp"):
        return []
    spec = dict(current.get("spec") or {})
    replicas = (request.body.get("spec") or {}).get("replicas", 0)
    spec["servers"] = {**(spec.get("servers") or {}), "replicas": replicas}
    return check(spec, request.name)


@dataclass
class ExpertPools:
    rt: Runtime
    loop: Reconciler
    store: ExpertStore
    metrics: ExpertPoolMetrics
    # Per pool, the servers' reports at its last token sample (when, the reports): the start
    # of EPLB's window. Per-expert counts are too big for the status; an operator restarted
    # starts from its first sample.
    samples: dict[tuple[str, str], tuple[float, Mapping[str, zl.ExpertServerReport]]] = field(
        default_factory=dict
    )
    kind: ClassVar[kinds.Kind] = KIND
    watches: ClassVar[Watches] = Watches(pods=LABEL_EXPERTPOOL, store=True)
    finalizer_id: ClassVar[str] = "cleanup-expert-map"
    admissions: ClassVar[tuple[Admission, ...]] = (
        Admission("expertpool-rules", ("CREATE", "UPDATE"), check_rules),
        Admission("expertpool-scale", ("UPDATE",), check_scale, subresource="scale"),
    )

    @classmethod
    def install(cls, rt: Runtime) -> ExpertPools:
        metrics = ExpertPoolMetrics(rt.metrics.registry)
        return cls(rt, rt.reconciler(KIND), ExpertStore(rt.session), metrics)

    def parse(self, body: Body) -> tuple[ExpertPoolSpec | None, list[str]]:
        return validation.parse(body)

    async def refused(self, body: Body, spec: ExpertPoolSpec) -> list[str]:
        meta = body["metadata"]
        return await self.running_changes(meta["namespace"], meta["name"], spec)

    async def running_changes(self, namespace: str, name: str, spec: ExpertPoolSpec) -> list[str]:
        """A template its server pods do not run (the webhook may be off)."""
        pods = await self.rt.kube.list_pods(namespace, {LABEL_EXPERTPOOL: name})
        return template_changes(spec, pods.values())

    async def observe(
        self, body: Body, spec: ExpertPoolSpec, logger: logging.Logger
    ) -> ep.PoolView:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        pods = await self.rt.kube.list_pods(namespace, {LABEL_EXPERTPOOL: name})
        changed = template_changes(spec, pods.values())
        if changed:
            raise Invalid(changed)
        connected = self.store.connected
        reports: Mapping[str, Any] = {}
        current: ep.ExpertMap | None = None
        successor: ep.ExpertMap | None = None
        versions: list[int] = []
        pointer: zl.ExpertMapPointer | None = None
        if connected:
            reports = await self.store.reports(namespace, name)
            current, versions, pointer = await self.store.in_force(namespace, name)
            if current is not None and not current.steady and current.version + 1 in versions:
                successor = await self.store.stored(namespace, name, current.version + 1)
        previous = ExpertPoolStatus.read(body.get("status"))
        at, sampled = self.samples.get((namespace, name), (None, None))
        sample = previous.token_sample
        view = ep.PoolView(
            namespace,
            name,
            meta["uid"],
            int(meta.get("generation") or 0),
            str(meta.get("resourceVersion") or ""),
            spec,
            pods,
            reports,
            current,
            tuple(versions),
            self.rt.engine,
            # to the microsecond: the stored times (RFC 3339) read back equal to the pass's
            now=round(time.time(), 6),
            connected=connected and self.store.connected,
            previous=previous,
            taken=frozenset(self.loop.taken.get((namespace, name), set())),
            successor=successor,
            # the same sample: its time as stored (RFC 3339, microseconds) against ours
            sampled=(
                sampled
                if sample is not None and at is not None and abs(sample.at - at) < 1e-3
                else None
            ),
            pointer=pointer,
        )
        return await self._warm(view)

    async def _warm(self, view: ep.PoolView) -> ep.PoolView:
        """The claimable warm pods and their reports when a server may be obtained or replaced,
        and the assignments of claimed pods that have not reported."""
        short, waiting = warm.needed(view)
        if not view.connected or not (short or waiting):
            return view
        pods = (
            await self.rt.kube.list_pods(view.namespace, {}, warm.claimable(view.spec))
            if short
            else {}
        )
        reports, assigned = await self.store.warm(view.namespace, bool(pods), waiting)
        uids = {p.name: p.uid for p in view.pods.values()}
        return dataclasses.replace(
            view,
            warm_pods=pods,
            warm_reports=reports,
            assigned=frozenset(p for p, uid in assigned.items() if uids.get(p) == uid),
        )

    def plan(self, view: ep.PoolView) -> ep.Plan:
        return ep.plan(view)

    async def admit(
        self, body: Body, view: ep.PoolView, planned: Sequence[Effect], logger: logging.Logger
    ) -> list[Effect]:
        for action in planned:
            event = action.describe()
            if event is not None and event.warning:
                logger.warning("%s: %s", event.reason, event.message)
        return await self.loop.guard_engines(view.namespace, planned, bool(view.pods), logger)

    def record(self, body: Body, view: ep.PoolView, plan: ep.Plan) -> None:
        """The reports of a pass that took a token sample, kept as EPLB's next window start.
        And the pool's metrics."""
        sample = plan.status.token_sample
        if sample is not None and sample.at == view.now:
            self.samples[(view.namespace, view.name)] = (view.now, dict(view.reports))
        self.metrics.record(view.namespace, view.name, plan.status)

    async def finalize(self, body: Body, logger: logging.Logger) -> None:
        """The pool's ZooKeeper subtree (its map) removed; its pods go by their owner
        references. ZooKeeper out of reach: left for the sweep."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if not self.store.connected:
            logger.warning(
                "ZooKeeper unreachable: the map of %s/%s is left to the sweep", namespace, name
            )
            return
        if await self.store.delete(namespace, name):
            logger.info("deleted the expert map of %s/%s", namespace, name)
        # the warm pods it claimed go with it (their owner); their assignments with it too
        claimed = await self.rt.kube.list_pods(namespace, {kinds.LABEL_CLAIMED_BY: name})
        ours = warm.claimer(name)  # not a PDGroup's claims of the same name
        await self.store.forget_assignments(
            namespace, sorted(n for n, p in claimed.items() if ours.claimed(p))
        )

    def forget(self, namespace: str, name: str) -> None:
        """The loop ended (deleted, or this replica stopped): the pool exports nothing."""
        self.metrics.forget(namespace, name)
        self.samples.pop((namespace, name), None)

    async def sweep(self) -> None:
        """Remove the subtrees of pools that no longer exist (ZooKeeper listed before
        Kubernetes: a pool created between the two is then in the second, never swept)."""
        namespaces = self.rt.config.namespaces
        try:
            in_zookeeper = await self.store.pools(namespaces)
            in_kubernetes = await self.rt.kube.names(KIND, namespaces)
        except Exception as exc:  # retried on the next sweep
            log.warning("sweep of expert pool subtrees failed: %s", exc)
            return
        for namespace, name in in_zookeeper:
            if (namespace, name) in in_kubernetes:
                continue
            try:
                await self.store.delete(namespace, name)
                await self.store.prune_namespace(namespace)
                log.info(
                    "swept the expert map of %s/%s: the pool no longer exists", namespace, name
                )
            except Exception as exc:  # the others go on
                log.warning("sweep of expert pool %s/%s failed: %s", namespace, name, exc)
