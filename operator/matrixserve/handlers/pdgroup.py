"""kopf handlers for PDGroup (P/D-Serve §3.2-3.4): decorators, reconcile, and the kind's set-up.

- ``@kopf.daemon`` per PDGroup runs the shared per-object loop (:mod:`.reconciler`), woken by
  ZooKeeper watches on the group's subtree, pod events and spec changes.
- ``reconcile``: parse -> validate -> observe (pods, ZooKeeper) -> plan (pure,
  :mod:`matrixserve.domain.pdgroup`) -> apply -> status. An invalid spec sets
  ``Ready=False/InvalidSpec`` with an Event and touches nothing.
- ``@kopf.on.validate``: the admission webhook, the same rules as the reconciler.
- ``@kopf.on.delete``: the finalizer removes the group's ZooKeeper subtree; ownerReferences take
  the pods.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Gauge, Histogram

from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.domain import pdgroup as pd
from matrixserve.domain.effects import ZnodeChange
from matrixserve.domain.pdgroup.validation import parse_spec
from matrixserve.handlers.metrics import Milestones
from matrixserve.handlers.reconciler import Key, Reconciler
from matrixserve.handlers.runtime import Runtime

KIND = kinds.PDGROUP
API = (KIND.group, KIND.version, KIND.plural)


class PDGroupMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.setup_phase_seconds = Histogram(
            "matrixserve_operator_setup_phase_seconds",
            "PDGroup setup phases (wall seconds): gather (created -> RoCE map), "
            "link (map -> all links), serve (links -> Ready)",
            ["phase"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self.links_verified = Gauge(
            "matrixserve_operator_links_verified",
            "Verified P-D sub-links per group",
            ["namespace", "group"],
            registry=registry,
        )
        self.groups_ready = Gauge(
            "matrixserve_operator_groups_ready", "PDGroups with Ready=True", registry=registry
        )
        self.setup = Milestones(
            self.setup_phase_seconds, [("mapped", "gather"), ("linked", "link"), ("ready", "serve")]
        )


@dataclass
class PDGroups:
    """The PDGroup controller: its loop, its ZooKeeper store, its metrics."""

    rt: Runtime
    loop: Reconciler
    store: GroupStore
    metrics: PDGroupMetrics
    ready: set[Key] = field(default_factory=set)
    kind: kinds.Kind = KIND

    def forget(self, key: Key) -> None:
        self.metrics.setup.forget(key)
        self.ready.discard(key)
        self.metrics.groups_ready.set(len(self.ready))


def install(rt: Runtime) -> PDGroups:
    return PDGroups(
        rt, rt.reconciler(KIND), GroupStore(rt.session), PDGroupMetrics(rt.metrics.registry)
    )


def _groups(memo: kopf.Memo) -> PDGroups:
    groups: PDGroups = memo.runtime.controllers[KIND.kind]
    return groups


# --------------------------------------------------------------------------- admission
def validate(spec: kopf.Spec, name: str, **_: Any) -> None:
    """The validating admission webhook: the reconciler's rules, before the object is stored."""
    _parsed, errors = parse_spec(spec, name or "")
    if errors:
        raise kopf.AdmissionError("invalid PDGroup: " + "; ".join(errors), code=422)


def register_webhook() -> None:
    """Registered only when the webhook is served (kopf refuses admission handlers without a
    server); ``--no-webhook`` leaves the reconciler's own check as the only guard."""
    kopf.on.validate(*API, id="pdgroup-rules", operations=["CREATE", "UPDATE"])(validate)


# --------------------------------------------------------------------------- wake-ups
@kopf.on.event(*API)
def pdgroup_event(name: str, namespace: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    _groups(memo).loop.object_changed(namespace, name, int(meta.get("generation") or 0))


@kopf.on.event("", "v1", "pods", labels={kinds.LABEL_GROUP: kopf.PRESENT})
def pod_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    _groups(memo).loop.related_changed(namespace, labels[kinds.LABEL_GROUP])


# --------------------------------------------------------------------------- reconcile
@kopf.daemon(*API, id="reconciler", cancellation_timeout=10.0)
async def reconciler(
    name: str,
    namespace: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    groups = _groups(memo)
    groups.metrics.setup.start((namespace, name), time.monotonic())

    async def reconcile_group(ns: str, group: str, log: logging.Logger) -> bool:
        return await reconcile(groups, ns, group, log)

    async def arm(ns: str, group: str, wake: Any) -> bool:
        if not groups.store.connected:
            return False
        await groups.store.ensure(ns, group)
        await groups.rt.session.run(groups.store.watch, ns, group, wake)
        return True

    try:
        await groups.loop.run(namespace, name, stopped, logger, reconcile_group, arm)
    finally:
        groups.store.unwatch(namespace, name)


async def reconcile(groups: PDGroups, namespace: str, name: str, logger: logging.Logger) -> bool:
    """One pass; True if it applied actions (so another pass should follow soon)."""
    rt = groups.rt
    body = await rt.kube.get(KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    meta = body["metadata"]
    spec, errors = parse_spec(body.get("spec") or {}, name)
    if spec is None or errors:
        await groups.loop.report_invalid(body, errors, logger)
        return False
    groups.loop.spec_valid(namespace, name)
    view = pd.GroupView(
        namespace,
        name,
        int(meta.get("generation", 0)),
        spec,
        await rt.kube.list_pods(namespace, {kinds.LABEL_GROUP: name}),
        await groups.store.snapshot(namespace, name),
        now=time.time(),
        uid=meta["uid"],
        engine=rt.engine,
    )
    plan = pd.plan(view)

    async def znodes(action: ZnodeChange[Any]) -> None:
        await groups.store.apply(namespace, name, action)

    await groups.loop.apply(body, plan.actions, znodes)
    await groups.loop.write_status(body, plan.status, plan.conditions)
    _track_setup(groups, (namespace, name), plan)
    groups.metrics.links_verified.labels(namespace=namespace, group=name).set(
        plan.status["links"]["verified"]
    )
    return bool(plan.actions)


def _track_setup(groups: PDGroups, key: Key, plan: pd.Plan) -> None:
    """The setup phases' wall times (gather, link, serve), and the count of Ready groups."""
    links = plan.status["links"]
    reached = {
        "mapped": bool(plan.status["roceMapVersion"]),
        "linked": bool(links["expected"]) and links["verified"] == links["expected"],
        "ready": plan.ready,
    }
    groups.metrics.setup.update(key, reached, time.monotonic())
    if plan.ready:
        groups.ready.add(key)
    else:
        groups.ready.discard(key)
    groups.metrics.groups_ready.set(len(groups.ready))


# --------------------------------------------------------------------------- deletion
@kopf.on.delete(*API, id="cleanup-zookeeper")
async def deleted(
    name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    groups = _groups(memo)
    if not groups.store.connected:
        raise kopf.TemporaryError(
            "ZooKeeper is not connected; the group's znodes are kept until it is", delay=5
        )
    removed = await groups.store.delete(namespace, name)
    groups.forget((namespace, name))
    logger.info(
        "deleted the ZooKeeper subtree of %s/%s" if removed else "no ZooKeeper subtree for %s/%s",
        namespace,
        name,
    )
