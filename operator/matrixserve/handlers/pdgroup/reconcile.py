"""PDGroup's kopf handlers (P/D-Serve §3.2-3.4): wake-ups, the per-group daemon running
``reconcile`` (parse -> validate -> observe -> plan -> apply -> status), and the finalizer.
Beside the plan, each pass keeps the engines' ZooKeeper access (issue 16 finding 7): their
Secret in the namespace, and the group's znodes closed once every pod carries the credential."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from matrixserve import coordination
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.status import (
    FaultStatus,
    LinksStatus,
    OptionStatus,
    PDGroupStatus,
    RatioStatus,
    ScaleRecord,
)
from matrixserve.domain import pdgroup as pd
from matrixserve.domain.effects import Effect, PodCreation, ZnodeChange
from matrixserve.domain.enginepod import (
    ACCESS_OPEN,
    access_closed,
    secret_taken,
    without_credential,
)
from matrixserve.domain.observed import on_nodes
from matrixserve.domain.pdgroup import cleanup
from matrixserve.domain.pdgroup.actions import ReportRatioChange, ReportRecovery
from matrixserve.domain.pdgroup.validation import parse_spec, running_template_changes
from matrixserve.domain.scaleout import Path, Phase
from matrixserve.handlers.leadership import finalizer_pending, lead_or_gone
from matrixserve.handlers.pdgroup.controller import API, KIND, PDGroups, groups_of
from matrixserve.handlers.reconciler import Key, wake_on_events

# --------------------------------------------------------------------------- wake-ups
wake_on_events(API, kinds.LABEL_GROUP, lambda memo: groups_of(memo).loop)


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
    groups = groups_of(memo)

    async def reconcile_group(ns: str, group: str, log: logging.Logger) -> bool:
        # set-up is timed from the first pass (a standby's daemon waits long before its first)
        groups.metrics.setup.start((ns, group), time.monotonic())
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


# A pass that may recover reads the servers afresh unless another group's pass just did.
NODES_FRESH_SECONDS = 0.25


def _may_recover(pods: Mapping[str, Any], zk: pd.ZkView) -> bool:
    """Whether this pass may detect a fault, and so needs the servers (which are down, how
    many NPUs are free): a pod not Ready (a process exit, a server down: the node lifecycle
    controller marks its pods not Ready after the Node), or a member's health saying a fault
    or a blocked sub-link. The usual pass of a healthy group reads no node."""
    if any(not p.ready for p in pods.values()):
        return True
    return any(
        h.state is not zl.HealthState.SERVING
        or any(link.state is zl.LinkState.BLOCKED for link in h.links)
        for h in zk.health.values()
    )


async def reconcile(groups: PDGroups, namespace: str, name: str, logger: logging.Logger) -> bool:
    """One pass; True if it applied actions (so another pass should follow soon)."""
    rt = groups.rt
    body = await rt.kube.get(KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    meta = body["metadata"]
    pods = await rt.kube.list_pods(namespace, {kinds.LABEL_GROUP: name})
    spec, errors = parse_spec(body.get("spec") or {}, name)
    if spec is not None:  # the webhook may be off: a template the pods do not run is refused too
        errors += running_template_changes(spec, pods.values())
    if spec is None or errors:
        await groups.loop.report_invalid(body, errors, logger)
        return False
    groups.loop.spec_valid(namespace, name)
    # A pod holding one of the group's names that is not the group's: looked up (together) for
    # the names whose creation found a pod there, not on every pass.
    taken = groups.loop.taken.get((namespace, name), set())
    absent = [pod for pod in pd.spec_pod_names(name, spec) if pod not in pods and pod in taken]
    owners = await asyncio.gather(*(rt.kube.owner_of(namespace, pod) for pod in absent))
    foreign = {pod: owner for pod, owner in zip(absent, owners, strict=True) if owner}
    zk = await groups.store.snapshot(namespace, name)
    nodes = await rt.kube.nodes(NODES_FRESH_SECONDS) if _may_recover(pods, zk) else {}
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
    )
    missing, waiting = pd.warm_needed(view)
    # Issue 18: the warm pods and fork sources when an instance is missing or a fault may be
    # (the recovery planner prices a warm replacement), the assignments of claimed pods that
    # have not reported.
    priced = missing or bool(nodes)
    if view.zk.connected and (priced or waiting):
        warm_pods = await rt.kube.list_pods(namespace, {}, pd.claimable(spec)) if priced else {}
        reports, sources, assigned = await groups.store.warm(
            namespace, spec.model.name if warm_pods or waiting else None, waiting
        )
        uids = {p.name: p.uid for p in view.pods.values()}
        view = dataclasses.replace(
            view,
            warm_pods=warm_pods,
            warm_reports=reports,
            fork_sources=tuple(sources),
            assigned=frozenset(p for p, uid in assigned.items() if uids.get(p) == uid),
        )
    if view.zk.connected and not view.zk.present:  # a server that lost the group's data
        # where the engines report again: open while some of them have no credential
        still_open = rt.engine.zookeeper_auth is not None and bool(
            without_credential(view.pods.values(), rt.engine)
        )
        await groups.store.ensure(namespace, name, open_acl=still_open)
    plan = pd.plan(view)
    actions = await _engine_access(groups, body, view, plan.actions, logger)

    async def znodes(action: ZnodeChange[Any]) -> None:
        await groups.store.apply(namespace, name, action)

    busy = await groups.loop.apply(body, actions, znodes)
    await groups.loop.write_status(body, plan.status.dump(), plan.conditions)
    _track_setup(groups, (namespace, name), plan)
    _track_recovery(groups, plan.actions)
    _track_scale(groups, view.previous, plan.status)
    _track_ratio(groups, namespace, name, plan)
    groups.metrics.links_verified.labels(namespace=namespace, group=name).set(
        (plan.status.links or LinksStatus()).verified
    )
    return busy


async def _engine_access(
    groups: PDGroups,
    body: Mapping[str, Any],
    view: pd.GroupView,
    planned: Sequence[Effect],
    logger: logging.Logger,
) -> list[Effect]:
    """The plan's actions, with what ZooKeeper's identity asks of this pass: the engines'
    Secret in place before any pod is created (a tenant's Secret of that name: no pod, a
    notice), and the group's znodes closed once every pod mounts the credential; until then
    they stay open for the pods made before it (an upgrade), and a notice says so. And the
    engines' NetworkPolicy kept in place where the group has pods (issue 31)."""
    rt = groups.rt
    taken: list[str] = []
    if any(isinstance(a, PodCreation) for a in planned):  # a pass creating no pod asks nothing
        try:
            taken = await rt.kube.pod_secrets_taken(view.namespace)
        except Exception as exc:  # the API's trouble must not stall the rest of the pass
            logger.warning(
                "the engines' Secrets in %s not checked (%s): no pod created this pass",
                view.namespace,
                exc,
            )
            return [a for a in planned if not isinstance(a, PodCreation)]
    actions: list[Effect] = [a for a in planned if not (taken and isinstance(a, PodCreation))]
    actions += [secret_taken(view.namespace, secret) for secret in taken]
    actions = await groups.loop.guard_engines(view.namespace, actions, bool(view.pods), logger)
    key = (view.namespace, view.name)
    if rt.engine.zookeeper_auth is None or not view.zk.connected or key in groups.closed:
        return actions
    if without_credential(view.pods.values(), rt.engine):
        return [*actions, ACCESS_OPEN]
    done = await groups.store.close(*key)
    if done.refused:  # another identity's znodes in the subtree: logged, tried again
        logger.warning("%d znodes of the group are not ours: %s", done.refused, done.examples)
        return actions
    groups.closed.add(key)
    if done.changed:
        groups.loop.post(body, access_closed(done.changed))
    return actions


def _track_recovery(groups: PDGroups, actions: Sequence[Effect]) -> None:
    """Recovery metrics (issue 17), from this pass's recovery steps, each with its record: a
    plan is a detection, a restore is a time to restore and the capacity lost meanwhile (the
    plan's weighted capacity fraction out x the seconds until restored), a failure a count."""
    m = groups.metrics
    for action in actions:
        if not isinstance(action, ReportRecovery) or action.record is None:
            continue
        record = action.record
        fault, plan = record.fault or FaultStatus(), record.plan or OptionStatus()
        kind, how = fault.kind, plan.action
        if action.reason == "RecoveryPlanned":
            m.detection_seconds.labels(kind, fault.detected_by).observe(
                record.detected_after_seconds
            )
            m.recoveries.labels(kind, how, "planned").inc()
        elif action.reason == "Recovered":
            seconds = float(record.restored_after_seconds or 0.0)
            m.restore_seconds.labels(kind, how).observe(seconds)
            m.capacity_lost.labels(kind).inc(float(plan.lost_fraction or 0.0) * seconds)
            m.recoveries.labels(kind, how, "restored").inc()
        elif action.reason == "RecoveryFailed":
            m.recoveries.labels(kind, how, "failed").inc()


def _track_ratio(groups: PDGroups, namespace: str, name: str, plan: pd.Plan) -> None:
    """The split's metrics (issue 19): serving and target counts, Φ, and each change."""
    m, ratio = groups.metrics, plan.status.ratio or RatioStatus()
    for which, split in (("current", ratio.current), ("target", ratio.target)):
        if split is not None:
            for role, value in (("prefill", split.prefill), ("decode", split.decode)):
                m.ratio_instances.labels(namespace, name, role, which).set(value)
    if ratio.phi is not None:
        m.ratio_phi.labels(namespace, name).set(ratio.phi)
    else:  # no window observed under this policy (Fixed observes none): no Φ to show
        with contextlib.suppress(KeyError):
            m.ratio_phi.remove(namespace, name)
    changes = sum(1 for a in plan.actions if isinstance(a, ReportRatioChange))
    if changes:
        m.ratio_changes.labels(namespace, name, str(ratio.policy or "")).inc(changes)


def _track_scale(groups: PDGroups, before: PDGroupStatus, after: PDGroupStatus) -> None:
    """A new ``lastScale`` record (issue 18): its engine phases and its wall total."""
    record = after.last_scale
    if record is None or not record.dump():
        return
    if (before.last_scale or ScaleRecord()).pod_uid == record.pod_uid:
        return
    path = str(record.path or "")
    if path not in set(Path):  # a label value from a pod's annotation: only the known ones
        path = "Unknown"
    for phase, seconds in (record.phases or {}).items():
        if phase in set(Phase):  # the engine's keys: only DeepServe's phases
            groups.metrics.scale_phase_seconds.labels(phase, path).observe(float(seconds))
    groups.metrics.scale_seconds.labels(path).observe(float(record.wall_seconds or 0.0))


def _track_setup(groups: PDGroups, key: Key, plan: pd.Plan) -> None:
    """The setup phases' wall times (gather, link, serve), and the count of Ready groups."""
    links = plan.status.links or LinksStatus()
    reached = {
        "mapped": bool(plan.status.roce_map_version),
        "linked": bool(links.expected) and links.verified == links.expected,
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
    name: str,
    namespace: str,
    meta: kopf.Meta,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    groups = groups_of(memo)
    # The leader cleans up; a standby's handler holds (its kopf writes nothing meanwhile) until
    # it leads, or the object is gone (the leader removed the finalizer).
    pending = finalizer_pending(groups.rt.kube, KIND, namespace, name)
    if not await lead_or_gone(groups.rt.leadership, pending):
        return
    if not groups.store.connected:
        if not cleanup.give_up_waiting(meta.get("deletionTimestamp"), time.time()):
            raise kopf.TemporaryError(
                "ZooKeeper is not connected; the group's znodes are kept until it is", delay=5
            )
        kopf.warn(
            body,
            reason="ZooKeeperUnreachable",
            message=f"ZooKeeper unreachable for {cleanup.FINALIZER_WAIT_SECONDS:.0f} s: the "
            "group is let go; its znodes are removed when ZooKeeper is back",
        )
        groups.forget((namespace, name))
        return
    try:
        removed = await groups.store.delete(namespace, name)
        claimed = await groups.rt.kube.list_pods(namespace, {kinds.LABEL_CLAIMED_BY: name})
        await groups.store.forget_assignments(namespace, sorted(claimed))
    except (coordination.ZooKeeperError, coordination.CallTimeout, ConnectionError) as exc:
        # lost mid-way: retried within the bound, not after kopf's minute of back-off
        raise kopf.TemporaryError(f"ZooKeeper failed during the deletion: {exc}", delay=5) from exc
    groups.forget((namespace, name))
    logger.info(
        "deleted the ZooKeeper subtree of %s/%s" if removed else "no ZooKeeper subtree for %s/%s",
        namespace,
        name,
    )
