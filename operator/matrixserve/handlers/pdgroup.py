"""kopf handlers for PDGroup: one level-based reconcile, run by a per-group daemon.

- ``@kopf.daemon`` per PDGroup: reconcile, then sleep until woken (ZooKeeper watches on the
  group's reports/links/health/map, pod events, spec changes) or a resync period passes.
- ``reconcile``: parse -> validate -> observe (pods, ZooKeeper) -> plan (pure) -> apply -> status.
  An invalid spec sets Ready=False/InvalidSpec with an Event and touches nothing.
- ``@kopf.on.validate``: the admission webhook, same rules as the reconciler.
- ``@kopf.on.delete``: the finalizer removes the group's ZooKeeper subtree; ownerReferences take
  the pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from matrixserve.adapters.kube import KubeAdapter
from matrixserve.adapters.zookeeper import ZkAdapter
from matrixserve.api.resources import PDGroupSpec
from matrixserve.domain import conditions as cond
from matrixserve.domain import pdgroup as pd
from matrixserve.domain.pods import EngineSettings, pod_manifest, role_label
from matrixserve.domain.validation import validate_pdgroup
from matrixserve.handlers.metrics import OperatorMetrics

GROUP, VERSION, PLURAL = "matrixserve.io", "v1alpha1", "pdgroups"


@dataclass
class Runtime:
    kube: KubeAdapter
    zk: ZkAdapter
    engine: EngineSettings
    metrics: OperatorMetrics
    loop: asyncio.AbstractEventLoop
    wakes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    setup: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    ready: set[tuple[str, str]] = field(default_factory=set)
    invalid_reported: dict[tuple[str, str], int] = field(default_factory=dict)
    background: asyncio.Task[None] | None = None
    resync_seconds: float = 10.0
    zk_watches: bool = True
    generations: dict[tuple[str, str], int] = field(
        default_factory=dict
    )  # off: a plain polling controller (the benchmark's baseline)

    def wake_event(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakes.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        event = self.wakes.get((namespace, name))
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in self.wakes.values():
            event.set()

    def wake_threadsafe(self, namespace: str, name: str) -> None:
        self.loop.call_soon_threadsafe(self.wake, namespace, name)


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def spec_errors(spec: Any, name: str) -> tuple[PDGroupSpec | None, list[str]]:
    try:
        parsed = PDGroupSpec.model_validate(dict(spec))
    except ValidationError as exc:
        return None, [f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return parsed, validate_pdgroup(parsed, name)


# --------------------------------------------------------------------------- admission
def validate(spec: kopf.Spec, name: str, **_: Any) -> None:
    """The validating admission webhook: the reconciler's rules, before the object is stored."""
    _parsed, errors = spec_errors(spec, name or "")
    if errors:
        raise kopf.AdmissionError("invalid PDGroup: " + "; ".join(errors), code=422)


def register_webhook() -> None:
    """Registered only when the webhook is served (kopf refuses admission handlers without a
    server); ``--no-webhook`` leaves the reconciler's own check as the only guard."""
    kopf.on.validate(GROUP, VERSION, PLURAL, id="pdgroup-rules", operations=["CREATE", "UPDATE"])(
        validate
    )


# --------------------------------------------------------------------------- wake-ups
@kopf.on.event(GROUP, VERSION, PLURAL)
def pdgroup_event(name: str, namespace: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    rt: Runtime = memo.runtime
    generation = int(meta.get("generation") or 0)
    # Event-driven: any change wakes the group. Polling (no watches): only a new spec does.
    if rt.zk_watches or rt.generations.get((namespace, name)) != generation:
        rt.generations[(namespace, name)] = generation
        rt.wake(namespace, name)


@kopf.on.event("", "v1", "pods", labels={"matrixserve.io/group": kopf.PRESENT})
def pod_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    if memo.runtime.zk_watches:
        memo.runtime.wake(namespace, labels["matrixserve.io/group"])


# --------------------------------------------------------------------------- reconcile
@kopf.daemon(GROUP, VERSION, PLURAL, id="reconciler", cancellation_timeout=10.0)
async def reconciler(
    name: str,
    namespace: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    rt: Runtime = memo.runtime
    key = (namespace, name)
    wake = rt.wake_event(namespace, name)
    rt.setup.setdefault(key, {"created": time.monotonic()})
    watching = False
    last = 0.0
    while not stopped:
        if rt.zk_watches and not watching and rt.zk.connected:
            await rt.zk.ensure_group(namespace, name)
            await asyncio.to_thread(
                rt.zk.watch_group, namespace, name, lambda: rt.wake_threadsafe(namespace, name)
            )
            watching = True
        wake.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        busy = False
        try:
            busy = await reconcile(rt, namespace, name, logger)
        except Exception as exc:  # reported, retried on the next pass; never kills the daemon
            rt.metrics.reconcile_errors.labels(kind="PDGroup").inc()
            logger.warning("reconcile of %s/%s failed: %s", namespace, name, exc)
            await asyncio.sleep(1.0)
        rt.metrics.reconcile_seconds.labels(kind="PDGroup").observe(time.perf_counter() - wall)
        rt.metrics.reconcile_cpu_seconds.labels(kind="PDGroup").inc(time.process_time() - cpu)
        last = time.monotonic()
        if busy:
            continue  # actions were applied: look again at once
        while not stopped and not wake.is_set() and time.monotonic() - last < rt.resync_seconds:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await wake.wait()
    rt.zk.unwatch_group(namespace, name)
    rt.wakes.pop(key, None)


async def reconcile(rt: Runtime, namespace: str, name: str, logger: logging.Logger) -> bool:
    """One pass; True if it applied actions (so another pass should follow soon)."""
    body = await rt.kube.get_pdgroup(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    key = (namespace, name)
    generation = int(body["metadata"].get("generation", 0))
    status: dict[str, Any] = body.get("status") or {}
    previous = status.get("conditions") or []
    spec, errors = spec_errors(body.get("spec") or {}, name)
    if spec is None or errors:
        message = "; ".join(errors)
        ready = cond.merge(
            previous,
            [cond.Condition("Ready", False, "InvalidSpec", message)],
            now_rfc3339(),
            generation,
        )
        kept = [c for c in previous if c.get("type") != "Ready"]
        await rt.kube.patch_status(
            namespace, name, {"conditions": [*kept, *ready], "observedGeneration": generation}
        )
        if rt.invalid_reported.get(key) != generation:
            rt.invalid_reported[key] = generation
            kopf.warn(
                body, reason="InvalidSpec", message=f"{message}; running instances left untouched"
            )
            logger.warning("invalid spec (generation %d): %s", generation, message)
        return False
    rt.invalid_reported.pop(key, None)
    pods = await rt.kube.list_group_pods(namespace, name)
    zk = await rt.zk.snapshot(namespace, name)
    view = pd.GroupView(namespace, name, generation, spec, pods, zk, now=time.time())
    plan = pd.plan(view)
    # Pod creations are independent of each other: issue them together; everything else in order.
    creates = [a for a in plan.actions if isinstance(a, pd.CreatePod)]
    await asyncio.gather(*(apply(rt, body, spec, a) for a in creates))
    for action in plan.actions:
        if not isinstance(action, pd.CreatePod):
            await apply(rt, body, spec, action)
    new_status = {
        **plan.status,
        "conditions": cond.merge(previous, plan.conditions, now_rfc3339(), generation),
    }
    if _differs(new_status, status):
        await rt.kube.patch_status(namespace, name, new_status)
    _track_setup(rt, key, plan)
    rt.metrics.links_verified.labels(namespace=namespace, group=name).set(
        plan.status["links"]["verified"]
    )
    return bool(plan.actions)


def _differs(new: dict[str, Any], old: dict[str, Any]) -> bool:
    return any(old.get(k) != v for k, v in new.items())


def _track_setup(rt: Runtime, key: tuple[str, str], plan: pd.Plan) -> None:
    marks = rt.setup.setdefault(key, {"created": time.monotonic()})
    now = time.monotonic()
    if plan.status["roceMapVersion"] and "mapped" not in marks:
        marks["mapped"] = now
        rt.metrics.setup_phase_seconds.labels(phase="gather").observe(now - marks["created"])
    links = plan.status["links"]
    if (
        "mapped" in marks
        and links["expected"]
        and links["verified"] == links["expected"]
        and "linked" not in marks
    ):
        marks["linked"] = now
        rt.metrics.setup_phase_seconds.labels(phase="link").observe(now - marks["mapped"])
    if plan.ready and "ready" not in marks and "linked" in marks:
        marks["ready"] = now
        rt.metrics.setup_phase_seconds.labels(phase="serve").observe(now - marks["linked"])
    if plan.ready:
        rt.ready.add(key)
    else:
        rt.ready.discard(key)
    rt.metrics.groups_ready.set(len(rt.ready))


async def apply(
    rt: Runtime, body: kopf.Body | dict[str, Any], spec: PDGroupSpec, action: pd.Action
) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    rt.metrics.actions.labels(action=type(action).__name__).inc()
    match action:
        case pd.CreatePod(name=pod, role=role):
            manifest = pod_manifest(namespace, name, meta["uid"], pod, role, spec, rt.engine)
            if await rt.kube.create_pod(namespace, manifest):
                kopf.info(
                    body,
                    reason="CreatedPod",
                    message=f"Created pod {pod} for a {role_label(role)} instance",
                )
        case pd.DeletePod(name=pod, uid=uid, reason=why):
            if await rt.kube.delete_pod(namespace, pod, uid):
                kopf.info(body, reason="DeletedPod", message=f"Deleted pod {pod}: {why}")
        case pd.WriteRoceMap(roce_map=m, added=added, removed=removed):
            await rt.zk.apply(namespace, name, action)
            change = ", ".join([*(f"+{a}" for a in added), *(f"-{r}" for r in removed)])
            kopf.info(
                body,
                reason="RoceMap",
                message=f"Wrote RoCE map v{m.version} ({change}); "
                f"{m.expected_links()} sub-links expected",
            )
        case pd.WriteInitOrder():
            await rt.zk.apply(namespace, name, action)
            kopf.info(
                body,
                reason="InitOrder",
                message="All instances reported their RoCE IPs; init order delivered",
            )
        case pd.WriteDecodeMeta(meta=m):
            await rt.zk.apply(namespace, name, action)
            kopf.info(
                body,
                reason="DecodeMeta",
                message=f"Pushed decode meta v{m.version} "
                f"({', '.join(d.instance for d in m.decodes) or 'no decodes'}) to the prefills",
            )
        case pd.SetEntrance(entrance=e):
            await rt.zk.apply(namespace, name, action)
            kopf.info(
                body, reason="EntranceOpened", message=f"Prefill {e.instance} is open for requests"
            )
        case pd.DeleteEntrance(name=inst):
            await rt.zk.apply(namespace, name, action)
            kopf.info(
                body, reason="EntranceClosed", message=f"Prefill {inst} no longer takes requests"
            )
        case pd.MarkRemoved(removal=r):
            await rt.zk.apply(namespace, name, action)
            kopf.info(
                body,
                reason="LogicallyRemoved",
                message=f"Removed {r.instance} from the group ({r.reason})",
            )
        case pd.EraseInstance(name=inst):
            await rt.zk.apply(namespace, name, action)
            kopf.info(body, reason="Erased", message=f"Erased the links of {inst}")
        case pd.ClearRemoved():
            await rt.zk.apply(namespace, name, action)


# --------------------------------------------------------------------------- deletion
@kopf.on.delete(GROUP, VERSION, PLURAL, id="cleanup-zookeeper")
async def deleted(
    name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    rt: Runtime = memo.runtime
    if not rt.zk.connected:
        raise kopf.TemporaryError(
            "ZooKeeper is not connected; the group's znodes are kept until it is", delay=5
        )
    removed = await rt.zk.delete_group(namespace, name)
    rt.setup.pop((namespace, name), None)
    rt.ready.discard((namespace, name))
    rt.metrics.groups_ready.set(len(rt.ready))
    logger.info(
        "deleted the ZooKeeper subtree of %s/%s" if removed else "no ZooKeeper subtree for %s/%s",
        namespace,
        name,
    )
