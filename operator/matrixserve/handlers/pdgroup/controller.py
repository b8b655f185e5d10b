"""The PDGroup controller (P/D-Serve §3.2-3.4): a pass reads the group's pods and its ZooKeeper
subtree (and, when a fault may be, the servers and the warm pods) and plans with the pure
:mod:`matrixserve.domain.pdgroup`. Beside the plan, a pass keeps the engines' ZooKeeper access:
their Secret in the namespace (checked by the applier before a pod is made), and the group's
znodes closed once every pod carries the credential. Deletion removes the group's subtree; a
sweep on every new ZooKeeper session removes those whose group is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from matrixserve.adapters import zk_groups
from matrixserve.adapters.kube import KubeAdapter
from matrixserve.adapters.pdgroup_metrics import PDGroupMetrics
from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.roles import Role
from matrixserve.api.status import PDGroupStatus
from matrixserve.domain import pdgroup as pd
from matrixserve.domain import warmclaim
from matrixserve.domain.effects import Effect, Event, PodCreation
from matrixserve.domain.enginepod import (
    ACCESS_OPEN,
    access_closed,
    secret_taken,
    without_credential,
)
from matrixserve.domain.observed import on_nodes
from matrixserve.domain.pdgroup import cleanup
from matrixserve.domain.pdgroup.validation import (
    admit,
    expert_pool_errors,
    parse_spec,
    running_template_changes,
    spec_changes,
    with_decode_replicas,
)
from matrixserve.handlers.controller import Admission, Body, Invalid, Request, Retry, Watches
from matrixserve.handlers.reconciler import Key, Reconciler
from matrixserve.handlers.runtime import Runtime

KIND = kinds.PDGROUP
log = logging.getLogger("matrixserve.pdgroup")
# A pass that may recover reads the servers afresh unless another group's pass just did.
NODES_FRESH_SECONDS = 0.25


async def check_rules(groups: PDGroups, request: Request) -> list[str]:
    """Create and update: the reconciler's rules before the object is stored. A spec change of
    an existing group is checked against the template its pods were made from (read only
    then); metadata-only updates and objects being deleted pass."""
    old = None if request.old is None else request.old.get("spec")
    spec = request.body.get("spec") or {}
    running: Mapping[str, Any] = {}
    if (
        request.operation == "UPDATE"
        and not request.deleting
        and spec_changes(request.operation, old, spec)
    ):
        running = await groups.rt.kube.list_pods(
            request.namespace, {kinds.LABEL_GROUP: request.name}
        )
    errors = admit(request.operation, old, spec, request.deleting, request.name, running.values())
    if errors or request.deleting:
        return errors
    parsed, _ = parse_spec(spec, request.name)
    if parsed is None:
        return errors
    errors += await pool_errors(groups.rt.kube, request.namespace, parsed)
    if errors or all(parsed.role_spec(r).pods_per_instance < 2 for r in Role):
        return errors
    # an instance of several pods no SuperPod of the cluster can hold: refused, not waiting
    return pd.larger_than_any_superpod(parsed, (await groups.rt.kube.nodes()).values())


async def pool_errors(kube: KubeAdapter, namespace: str, spec: PDGroupSpec) -> list[str]:
    """What the expert pool the group's decodes use refuses of it (none without one)."""
    if spec.moe is None or spec.moe.expert_pool_ref is None:
        return []
    pool = await kube.get(kinds.EXPERTPOOL, namespace, spec.moe.expert_pool_ref.name)
    return expert_pool_errors(spec, pool)


async def check_scale(groups: PDGroups, request: Request) -> list[str]:
    """The scale subresource (``kubectl scale``; the request's object is an autoscaling/v1
    Scale): its ``spec.replicas`` applied to the stored group's ``spec.decode.replicas``, and
    the result checked as an update."""
    current = await groups.rt.kube.get(KIND, request.namespace, request.name)
    if current is None:
        return []  # gone: the API server answers the write with 404 itself
    spec = current.get("spec") or {}
    replicas = (request.body.get("spec") or {}).get("replicas", 0)
    deleting = bool(current["metadata"].get("deletionTimestamp"))
    return admit("UPDATE", spec, with_decode_replicas(spec, replicas), deleting, request.name)


@dataclasses.dataclass
class PDGroups:
    """The PDGroup controller: its loop, its ZooKeeper store, its metrics."""

    rt: Runtime
    loop: Reconciler
    store: GroupStore
    metrics: PDGroupMetrics
    # Groups whose ZooKeeper subtree this run has closed (or found closed): not walked again.
    closed: set[Key] = dataclasses.field(default_factory=set)
    kind: ClassVar[kinds.Kind] = KIND
    watches: ClassVar[Watches] = Watches(pods=kinds.LABEL_GROUP, store=True)
    finalizer_id: ClassVar[str] = "cleanup-zookeeper"
    admissions: ClassVar[tuple[Admission, ...]] = (
        Admission("pdgroup-rules", ("CREATE", "UPDATE"), check_rules),
        Admission("pdgroup-scale", ("UPDATE",), check_scale, subresource="scale"),
    )

    @classmethod
    def install(cls, rt: Runtime) -> PDGroups:
        return cls(
            rt, rt.reconciler(KIND), GroupStore(rt.session), PDGroupMetrics(rt.metrics.registry)
        )

    def parse(self, body: Body) -> tuple[PDGroupSpec | None, list[str]]:
        meta = body["metadata"]
        # set-up is timed from the first pass (a standby's daemon waits long before its first)
        self.metrics.setup.start((meta["namespace"], meta["name"]), time.monotonic())
        return parse_spec(body.get("spec") or {}, meta["name"])

    async def refused(self, body: Body, spec: PDGroupSpec) -> list[str]:
        """A template its pods do not run, an expert pool of another model (the webhook may be
        off)."""
        meta = body["metadata"]
        pods = await self.rt.kube.list_pods(meta["namespace"], {kinds.LABEL_GROUP: meta["name"]})
        errors = running_template_changes(spec, pods.values())
        return errors + await pool_errors(self.rt.kube, meta["namespace"], spec)

    async def observe(self, body: Body, spec: PDGroupSpec, logger: logging.Logger) -> pd.GroupView:
        rt, meta = self.rt, body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        pods = await rt.kube.list_pods(namespace, {kinds.LABEL_GROUP: name})
        # the webhook may be off: a template the pods do not run is refused here too
        errors = running_template_changes(spec, pods.values())
        errors += await pool_errors(rt.kube, namespace, spec)
        if errors:
            raise Invalid(errors)
        # A pod holding one of the group's names that is not the group's: looked up (together)
        # for the names whose creation found a pod there, not on every pass.
        taken = self.loop.taken.get((namespace, name), set())
        absent = [p for p in pd.spec_pod_names(name, spec) if p not in pods and p in taken]
        owners = await asyncio.gather(*(rt.kube.owner_of(namespace, pod) for pod in absent))
        foreign = {pod: owner for pod, owner in zip(absent, owners, strict=True) if owner}
        zk = await self.store.snapshot(namespace, name)
        placing = pd.needs_servers(spec, pods.values())
        nodes = (
            await rt.kube.nodes(NODES_FRESH_SECONDS)
            if placing or pd.may_recover(pods.values(), zk)
            else {}
        )
        used = (
            await rt.kube.npus_in_use(rt.config.namespaces, NODES_FRESH_SECONDS) if placing else {}
        )
        view = pd.GroupView(
            namespace,
            name,
            int(meta.get("generation", 0)),
            spec,
            on_nodes(pods, nodes),
            zk,
            now=time.time(),
            uid=meta["uid"],
            engine=rt.engine,
            previous=PDGroupStatus.read(body.get("status")),
            foreign=foreign,
            nodes=nodes,
            npus_used=used,
        )
        view = await self._warm(view)
        if view.zk.connected and not view.zk.present:  # a server that lost the group's data
            # where the engines report again: open while some of them have no credential
            still_open = rt.engine.zookeeper_auth is not None and bool(
                without_credential(view.pods.values(), rt.engine)
            )
            await self.store.ensure(namespace, name, open_acl=still_open)
        return view

    async def _warm(self, view: pd.GroupView) -> pd.GroupView:
        """The warm pods and fork sources when an instance is missing or a fault may be (the
        recovery planner prices a warm replacement), the assignments of claimed pods that have
        not reported."""
        missing, waiting = pd.warm_needed(view)
        priced = missing or bool(view.nodes)
        if not view.zk.connected or not (priced or waiting):
            return view
        spec = view.spec
        warm_pods = (
            await self.rt.kube.list_pods(view.namespace, {}, pd.claimable(spec)) if priced else {}
        )
        reports, sources, assigned = await self.store.warm(
            view.namespace, spec.model.name if warm_pods or waiting else None, waiting
        )
        uids = {p.name: p.uid for p in view.pods.values()}
        return dataclasses.replace(
            view,
            warm_pods=warm_pods,
            warm_reports=reports,
            fork_sources=tuple(sources),
            assigned=frozenset(p for p, uid in assigned.items() if uids.get(p) == uid),
        )

    def plan(self, view: pd.GroupView) -> pd.Plan:
        return pd.plan(view)

    async def admit(
        self, body: Body, view: pd.GroupView, planned: Sequence[Effect], logger: logging.Logger
    ) -> list[Effect]:
        """The plan's actions, with what ZooKeeper's identity asks of this pass: the engines'
        Secret in place before any pod is created (a tenant's Secret of that name: no pod, a
        notice) and the group's znodes closed once every pod mounts the credential; until then
        they stay open for the pods made before it (an upgrade), and a notice says so. And the
        engines' NetworkPolicy kept in place where the group has pods."""
        rt = self.rt
        taken: list[str] = []
        if any(isinstance(a, PodCreation) for a in planned):  # a pass creating no pod asks none
            try:
                taken = await rt.kube.pod_secrets_taken(view.namespace)
            except Exception as exc:  # the API's trouble must not stall the rest of the pass
                logger.warning(
                    "the engines' Secrets in %s not checked (%s): no pod created this pass",
                    view.namespace,
                    exc,
                )
                return [a for a in planned if not isinstance(a, PodCreation)]
        actions = [a for a in planned if not (taken and isinstance(a, PodCreation))]
        actions += [secret_taken(view.namespace, secret) for secret in taken]
        actions = await self.loop.guard_engines(view.namespace, actions, bool(view.pods), logger)
        key = (view.namespace, view.name)
        if rt.engine.zookeeper_auth is None or not view.zk.connected or key in self.closed:
            return actions
        if without_credential(view.pods.values(), rt.engine):
            return [*actions, ACCESS_OPEN]
        done = await self.store.close(*key)
        if done.refused:  # another identity's znodes in the subtree: logged, tried again
            logger.warning("%d znodes of the group are not ours: %s", done.refused, done.examples)
            return actions
        self.closed.add(key)
        if done.changed:
            self.loop.post(body, access_closed(done.changed))
        return actions

    def record(self, body: Body, view: pd.GroupView, plan: pd.Plan) -> None:
        self.metrics.record((view.namespace, view.name), view.previous, plan)

    async def finalize(self, body: Body, logger: logging.Logger) -> None:
        """The group's ZooKeeper subtree removed (its pods go by their owner references), and
        the assignments of warm pods it claimed. ZooKeeper out of reach: retried, until
        :data:`cleanup.FINALIZER_WAIT_SECONDS` (then let go with a Warning; the sweep removes
        the subtree when it is back)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if not self.store.connected:
            if not cleanup.give_up_waiting(meta.get("deletionTimestamp"), time.time()):
                raise Retry("ZooKeeper is not connected; the group's znodes are kept until it is")
            self.loop.post(
                body,
                Event(
                    "ZooKeeperUnreachable",
                    f"ZooKeeper unreachable for {cleanup.FINALIZER_WAIT_SECONDS:.0f} s: the "
                    "group is let go; its znodes are removed when ZooKeeper is back",
                    warning=True,
                ),
            )
            self.deleted((namespace, name))
            return
        try:
            removed = await self.store.delete(namespace, name)
            claimed = await self.rt.kube.list_pods(namespace, {kinds.LABEL_CLAIMED_BY: name})
            ours = warmclaim.Claimer(kinds.PDGROUP.kind, name)  # not another kind's of the name
            await self.store.forget_assignments(
                namespace, sorted(n for n, p in claimed.items() if ours.claimed(p))
            )
        except zk_groups.UNAVAILABLE as exc:
            # lost mid-way: retried within the bound, not after kopf's minute of back-off
            raise Retry(f"ZooKeeper failed during the deletion: {exc}") from exc
        self.deleted((namespace, name))
        logger.info(
            "deleted the ZooKeeper subtree of %s/%s"
            if removed
            else "no ZooKeeper subtree for %s/%s",
            namespace,
            name,
        )

    def deleted(self, key: Key) -> None:
        self.closed.discard(key)
        self.metrics.forget_group(*key)

    def forget(self, namespace: str, name: str) -> None:
        """The loop ended (deleted, or this replica stopped): the metrics stay until deletion."""

    async def sweep(self) -> None:
        """Remove the subtrees of groups that no longer exist (ZooKeeper listed first: see
        :func:`cleanup.orphans`), and the fork-source folders their engines left empty (a
        source is an engine's ephemeral znode: its key's folder, and its namespace's, outlive
        it)."""
        namespaces = self.rt.config.namespaces
        try:
            in_zookeeper = await self.store.groups(namespaces)
            in_kubernetes = await self.rt.kube.names(KIND, namespaces)
            for namespace, name in cleanup.orphans(in_zookeeper, in_kubernetes):
                await self.store.delete(namespace, name)
                log.info(
                    "swept the ZooKeeper subtree of %s/%s: the group no longer exists",
                    namespace,
                    name,
                )
            for folder in await self.store.prune_fork_sources(namespaces):
                log.info("swept the empty fork-source folder %s", folder)
        except Exception as exc:  # retried on the next sweep
            log.warning("sweep of ZooKeeper subtrees failed: %s", exc)
