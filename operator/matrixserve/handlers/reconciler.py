"""The per-object loop every kind runs (level-based, controller-runtime's habit in kopf).

A kind hands in its ``reconcile(namespace, name, logger) -> busy`` and, if it watches something
outside Kubernetes, an ``arm(namespace, name, wake) -> armed`` that registers the wake-up. The
loop, run by the kind's ``@kopf.daemon``:

- reconciles, then sleeps until woken (a watch, a pod event, a spec change) or a resync period
  passes; a pass that applied actions (``busy``) is followed by another at once;
- never dies of a failed pass: the error is counted and logged, and the next pass (a wake-up or
  the resync) tries again, no sooner than a second later;
- times every pass (wall and CPU) per kind;
- passes only while this replica leads (its :class:`Gate`, the Lease election of
  :mod:`.leadership`), and checks it again before every write.

Two helpers every kind's reconcile uses: :meth:`Reconciler.report_invalid` (``Ready=False``,
reason ``InvalidSpec``, a Warning Event once per generation, nothing touched) and
:meth:`Reconciler.write_status` (conditions merged, the status patched only if it changed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import kopf

from matrixserve.adapters.kube import KubeAdapter, status_patch
from matrixserve.api.kinds import Kind
from matrixserve.domain import conditions as cond
from matrixserve.domain.effects import (
    Effect,
    Event,
    Notice,
    PodClaim,
    PodCreation,
    PodDeletion,
    ZnodeChange,
)
from matrixserve.domain.enginepod import policy_taken
from matrixserve.domain.leadership import NotLeading
from matrixserve.handlers.metrics import OperatorMetrics

Key = tuple[str, str]  # (namespace, name)
ReconcileFn = Callable[[str, str, logging.Logger], Awaitable[bool]]
ArmFn = Callable[[str, str, Callable[[], None]], Awaitable[bool]]
ZnodesFn = Callable[[Any], Awaitable[None]]  # applies a ZnodeChange to the kind's store


class Gate(Protocol):
    """Whether this replica may act (:class:`~matrixserve.handlers.leadership.Leadership`)."""

    def check(self) -> None:
        """Raises :class:`NotLeading` unless this replica may write now."""

    async def wait(self, timeout: float | None = None) -> bool:
        """Until this replica may act (True), or ``timeout`` seconds pass (False)."""


class Always:
    """The gate of a lone operator (no election): it always may."""

    def check(self) -> None:
        return None

    async def wait(self, timeout: float | None = None) -> bool:
        return True


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def post(body: Mapping[str, Any], event: Event | None) -> None:
    """Post a kind's Event on its object (kopf's posting queue)."""
    if event is None:
        return
    if event.warning:
        kopf.warn(body, reason=event.reason, message=event.message)
    else:
        kopf.info(body, reason=event.reason, message=event.message)


def wake_on_events(
    api: tuple[str, str, str], pod_label: str, loop_of: Callable[[kopf.Memo], Reconciler]
) -> None:
    """Register a kind's wake-ups with kopf: an event on one of its objects (``api``: group,
    version, plural) wakes that object's loop, a new generation or not; an event on a pod
    labelled ``pod_label`` wakes the object the label names."""
    kind = api[2]

    @kopf.on.event(*api, id=f"{kind}-event")
    def object_event(name: str, namespace: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
        loop_of(memo).object_changed(namespace, name, int(meta.get("generation") or 0))

    @kopf.on.event("", "v1", "pods", labels={pod_label: kopf.PRESENT}, id=f"{kind}-pod-event")
    def pod_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        loop_of(memo).related_changed(namespace, labels[pod_label])


class Reconciler:
    def __init__(
        self,
        kind: Kind,
        kube: KubeAdapter,
        metrics: OperatorMetrics,
        loop: asyncio.AbstractEventLoop,
        resync_seconds: float = 10.0,
        event_driven: bool = True,  # off: a plain polling controller (the benchmark's baseline)
        poster: Callable[[Mapping[str, Any], Event | None], None] = post,
        gate: Gate | None = None,
    ) -> None:
        self.kind = kind
        self.kube = kube
        self.metrics = metrics
        self.loop = loop
        self.resync_seconds = resync_seconds
        self.event_driven = event_driven
        self.post = poster
        # Only the leader passes and writes: a standby's loop waits here (its watches armed
        # only once it leads), and every write is checked again (a deposed leader's pass stops
        # at its next write).
        self.gate: Gate = gate or Always()
        self.wakes: dict[Key, asyncio.Event] = {}
        self.generations: dict[Key, int] = {}
        self.invalid_reported: dict[Key, int] = {}
        self.noticed: dict[Key, set[tuple[str, str]]] = {}  # each object's notices posted
        # Pods whose creation found one of that name already there (409), per object: whose
        # they are is worth a look (another owner's pod holding the name?).
        self.taken: dict[Key, set[str]] = {}

    # ------------------------------------------------------------------ wake-ups
    def wake(self, namespace: str, name: str) -> None:
        event = self.wakes.get((namespace, name))
        if event is not None:
            event.set()

    def wake_threadsafe(self, namespace: str, name: str) -> None:
        self.loop.call_soon_threadsafe(self.wake, namespace, name)

    def wake_all(self) -> None:
        for event in self.wakes.values():
            event.set()

    def object_changed(self, namespace: str, name: str, generation: int) -> None:
        """An event on the object itself. Event-driven: any change wakes it. Polling: only a
        new spec (generation) does."""
        key = (namespace, name)
        if self.event_driven or self.generations.get(key) != generation:
            self.generations[key] = generation
            self.wake(namespace, name)

    def related_changed(self, namespace: str, name: str) -> None:
        """An event on something the object owns or watches (its pods)."""
        if self.event_driven:
            self.wake(namespace, name)

    # ------------------------------------------------------------------ the loop
    async def run(
        self,
        namespace: str,
        name: str,
        stopped: kopf.DaemonStopped,
        logger: logging.Logger,
        reconcile: ReconcileFn,
        arm: ArmFn | None = None,
    ) -> None:
        key = (namespace, name)
        wake = self.wakes.setdefault(key, asyncio.Event())
        armed = arm is None or not self.event_driven
        try:
            while not stopped:
                if not await self.gate.wait(timeout=1.0):
                    continue
                if not armed:
                    assert arm is not None
                    try:
                        armed = await arm(namespace, name, lambda: self.wake_threadsafe(*key))
                    except NotLeading:
                        continue  # deposed meanwhile: the gate above holds it
                wake.clear()
                busy = await self._pass(namespace, name, logger, reconcile)
                last = time.monotonic()
                if busy:
                    continue  # actions were applied: look again at once
                while (
                    not stopped
                    and not wake.is_set()
                    and time.monotonic() - last < self.resync_seconds
                ):
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await wake.wait()
        finally:
            self.wakes.pop(key, None)
            self.generations.pop(key, None)
            self.invalid_reported.pop(key, None)
            self.noticed.pop(key, None)
            self.taken.pop(key, None)

    async def _pass(
        self, namespace: str, name: str, logger: logging.Logger, reconcile: ReconcileFn
    ) -> bool:
        kind = self.kind.kind
        wall, cpu = time.perf_counter(), time.process_time()
        busy = False
        try:
            busy = await reconcile(namespace, name, logger)
        except NotLeading:  # deposed mid-pass: nothing more written; the next leader goes on
            logger.info("pass of %s/%s stopped: not the leader", namespace, name)
        except Exception as exc:  # reported, retried on the next pass; never kills the daemon
            self.metrics.reconcile_errors.labels(kind=kind).inc()
            logger.warning("reconcile of %s/%s failed: %s", namespace, name, exc)
            await asyncio.sleep(1.0)
        self.metrics.reconcile_seconds.labels(kind=kind).observe(time.perf_counter() - wall)
        self.metrics.reconcile_cpu_seconds.labels(kind=kind).inc(time.process_time() - cpu)
        return busy

    # ------------------------------------------------------------------ status
    async def report_invalid(
        self, body: Mapping[str, Any], errors: Sequence[str], logger: logging.Logger
    ) -> None:
        """``Ready=False, reason=InvalidSpec`` with the message (other conditions kept), a
        Warning Event once per generation; what runs is left untouched."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        generation = int(meta.get("generation") or 0)
        message = "; ".join(errors)
        self.gate.check()
        previous = (body.get("status") or {}).get("conditions") or []
        ready = cond.merge(
            previous,
            [cond.Condition("Ready", False, "InvalidSpec", message)],
            now_rfc3339(),
            generation,
        )
        kept = [c for c in previous if c.get("type") != "Ready"]
        await self.kube.patch_status(
            self.kind,
            key[0],
            key[1],
            {"conditions": [*kept, *ready], "observedGeneration": generation},
        )
        if self.invalid_reported.get(key) != generation:
            self.invalid_reported[key] = generation
            self.post(
                body,
                Event("InvalidSpec", f"{message}; running instances left untouched", warning=True),
            )
            logger.warning("invalid spec (generation %d): %s", generation, message)

    def spec_valid(self, namespace: str, name: str) -> None:
        self.invalid_reported.pop((namespace, name), None)

    async def write_status(
        self,
        body: Mapping[str, Any],
        status: Mapping[str, Any],
        conditions: Sequence[cond.Condition],
    ) -> None:
        """Merge the conditions into the object's (``lastTransitionTime`` moves only on a
        flip) and patch the status subresource with what changed, if anything did (compared as
        the API server stores it, or a settled object would be patched on every pass; a nested
        key the new status no longer has is deleted: :func:`~matrixserve.adapters.kube.status_patch`)."""
        meta = body["metadata"]
        old: Mapping[str, Any] = body.get("status") or {}
        # The conditions are as current as the status they come with (a kept status keeps its
        # generation).
        generation = int(status.get("observedGeneration", meta.get("generation") or 0))
        new = {
            **status,
            "conditions": cond.merge(
                old.get("conditions") or [], conditions, now_rfc3339(), generation
            ),
        }
        patch = status_patch(old, new)
        if patch:
            self.gate.check()
            await self.kube.patch_status(self.kind, meta["namespace"], meta["name"], patch)

    # ------------------------------------------------------------------ actions
    async def guard_engines(
        self,
        namespace: str,
        actions: Sequence[Effect],
        engines: bool,
        logger: logging.Logger,
    ) -> list[Effect]:
        """The engines' NetworkPolicy in place in ``namespace`` (issue 31) for a pass that has
        engine pods there or creates one: re-checked at most once a ``SECRET_RECHECK_SECONDS``
        (a deleted or changed policy put back), written before the first pod. One of that name
        that is not ours is left alone (a notice says so, unless it is the chart's own). Where
        it cannot be checked, the pass creates no pod: an engine is never made unguarded where
        the operator was asked to guard them."""
        creates = any(isinstance(a, PodCreation) for a in actions)
        if not self.kube.pod_policies or not (engines or creates):
            return list(actions)
        try:
            theirs = await self.kube.pod_policies_taken(namespace)
        except NotLeading:  # a write refused by the fence: the pass ends here
            raise
        except Exception as exc:  # the API's trouble must not stall the rest of the pass
            logger.warning(
                "the engines' NetworkPolicy in %s not checked (%s): no pod created this pass",
                namespace,
                exc,
            )
            return [a for a in actions if not isinstance(a, PodCreation)]
        notices = [policy_taken(namespace, name, labels) for name, labels in theirs.items()]
        return [*actions, *(n for n in notices if n is not None)]

    async def apply(
        self, body: Mapping[str, Any], actions: Sequence[Effect], znodes: ZnodesFn
    ) -> bool:
        """Pod creations and warm pod claims are independent of each other (each claim is
        conditional on its own pod's resourceVersion): issued together, so 64 instances cost
        about one API round trip, not 64; everything else in the plan's order. A notice is posted once while it holds (a plan repeats it every pass
        its cause lasts), again if it comes back. True if anything was to be changed."""
        self.gate.check()
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        notices = [a for a in actions if isinstance(a, Notice)]
        said = self.noticed.get(key, set())
        current: set[tuple[str, str]] = set()
        for notice in notices:
            event = notice.describe()
            if event is None:
                continue
            current.add((event.reason, event.message))
            if (event.reason, event.message) not in said:
                self.post(body, event)
        self.noticed[key] = current
        actions = [a for a in actions if not isinstance(a, Notice)]
        together = [a for a in actions if isinstance(a, PodCreation | PodClaim)]
        # every one finished (its Event, its bookkeeping) before a failure is raised
        done = await asyncio.gather(
            *(self._apply(body, a, znodes) for a in together), return_exceptions=True
        )
        failed = next((r for r in done if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        for action in actions:
            if not isinstance(action, PodCreation | PodClaim):
                await self._apply(body, action, znodes)
        return bool(actions)

    async def _apply(self, body: Mapping[str, Any], action: Effect, znodes: ZnodesFn) -> None:
        namespace = body["metadata"]["namespace"]
        self.gate.check()
        self.metrics.actions.labels(action=type(action).__name__).inc()
        if isinstance(action, PodCreation):
            changed = await self.kube.create_pod(namespace, action.manifest)
            pod = str(action.manifest["metadata"]["name"])
            taken = self.taken.setdefault((namespace, body["metadata"]["name"]), set())
            if changed:
                taken.discard(pod)
            else:
                taken.add(pod)
        elif isinstance(action, PodDeletion):
            changed = await self.kube.delete_pod(
                namespace,
                action.name,
                action.uid,
                force=action.force,
                resource_version=action.resource_version,
            )
        elif isinstance(action, PodClaim):
            changed = await self.kube.claim_pod(
                namespace, action.name, action.resource_version, action.patch
            )
        elif isinstance(action, ZnodeChange):
            await znodes(action)
            changed = True
        else:
            raise TypeError(f"no applier for {action!r}")
        if changed:
            self.post(body, action.describe())
