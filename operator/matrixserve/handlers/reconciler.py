"""The per-object loop every kind runs (level-based, controller-runtime's habit in kopf).

A kind is a :class:`~matrixserve.handlers.controller.Controller`; the loop, run by the kind's
daemon (:mod:`.kinds`), for one object:

- arms the kind's ZooKeeper store for it (its watches wake the loop), then passes: fetch the
  object (gone or deleting: stop) -> ``parse`` -> an invalid spec reported once per generation
  (``Ready=False``, reason ``InvalidSpec``, a Warning Event; nothing touched) -> ``observe`` ->
  ``plan`` (pure) -> ``admit`` -> apply the actions (one applier per effect type: the table
  :data:`APPLIERS`) -> write the status if it changed -> ``record``;
- a pass that applied actions (``busy``) is followed by another at once; otherwise it sleeps
  until woken (its object, its pods, objects it owns, its store), its plan's ``recheck_after``
  (a window's end, a cooldown, a deadline) or the resync period, whichever comes first;
- never dies of a failed pass: the error is counted and logged, the loop holds a second, then
  waits 1, 2, 4, ... more seconds over consecutive failures (at most :data:`BACKOFF_MAX_SECONDS`,
  or the resync if longer) unless woken;
- never hangs on one: a pass still running after :data:`PASS_DEADLINE_SECONDS` (a call that
  never returns) is cancelled and counted as failed, its log naming where it was stuck (every
  API call is bounded too: :data:`~matrixserve.adapters.kube.REQUEST_TIMEOUT`);
- times every pass (wall and CPU) per kind;
- passes only while this replica leads (its :class:`Gate`, the Lease election of
  :mod:`.leadership`), and checks it again before every write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import kopf

from matrixserve.adapters.kube import KubeAdapter, status_patch
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.api import rfc3339
from matrixserve.api.kinds import Kind
from matrixserve.domain import conditions as cond
from matrixserve.domain.effects import (
    Effect,
    Event,
    Notice,
    ObjectCreation,
    ObjectPatch,
    PodClaim,
    PodCreation,
    PodDeletion,
    PodUngate,
    ZnodeChange,
)
from matrixserve.domain.enginepod import policy_taken
from matrixserve.domain.leadership import NotLeading
from matrixserve.handlers.controller import AnyController, Invalid, Store

Key = tuple[str, str]  # (namespace, name)


class Stopped(Protocol):
    """A daemon's stop flag (kopf's ``DaemonStopped``): truthy once the loop is to end."""

    def __bool__(self) -> bool: ...


BACKOFF_MAX_SECONDS = 60.0  # the longest back-off of a failing object (or the resync, if longer)
RECHECK_MIN_SECONDS = 0.1  # a plan due again "now" is looked at no sooner than this
# A pass still running after this long is stuck (a settled pass takes milliseconds, a busy one
# under load seconds): cancelled and retried, so one hung call never stops an object's loop.
PASS_DEADLINE_SECONDS = 90.0


class PassStuck(Exception):
    """A pass outlived its deadline: it was cancelled (where it waited is in the message)."""


@dataclass(frozen=True)
class Outcome:
    """How a pass ended: ``busy`` (actions applied: look again at once), ``failed``, and when
    the plan is due again (seconds; None: only on a change)."""

    busy: bool = False
    failed: bool = False
    recheck_after: float | None = None


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
    """Now, as a condition's ``lastTransitionTime`` (whole seconds)."""
    return rfc3339.format_seconds(time.time())


def post(body: Mapping[str, Any], event: Event | None) -> None:
    """Post a kind's Event on its object (kopf's posting queue)."""
    if event is None:
        return
    if event.warning:
        kopf.warn(body, reason=event.reason, message=event.message)
    else:
        kopf.info(body, reason=event.reason, message=event.message)


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
        self.pass_deadline = PASS_DEADLINE_SECONDS
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
        controller: AnyController,
        namespace: str,
        name: str,
        stopped: Stopped,
        logger: logging.Logger,
    ) -> None:
        """The object's loop, until ``stopped`` (its daemon's flag, truthy when set)."""
        key = (namespace, name)
        wake = self.wakes.setdefault(key, asyncio.Event())
        store = controller.store if controller.watches.store else None
        armed = store is None or not self.event_driven
        failures = 0
        try:
            while not stopped:
                if not await self.gate.wait(timeout=1.0):
                    continue
                if not armed:
                    assert store is not None
                    try:
                        armed = await self._arm(store, namespace, name)
                    except NotLeading:
                        continue  # deposed meanwhile: the gate above holds it
                    except Exception as exc:  # what it armed is let go; tried again next pass
                        store.disarm(namespace, name)
                        logger.warning("watches of %s/%s not armed: %s", namespace, name, exc)
                wake.clear()
                outcome = await self._pass(controller, namespace, name, logger)
                last = time.monotonic()
                failures = failures + 1 if outcome.failed else 0
                if outcome.busy:
                    continue  # actions were applied: look again at once
                await self._sleep(stopped, wake, last, self.next_pass(outcome, failures))
        finally:
            if store is not None and self.event_driven:  # also after an arm that failed midway
                store.disarm(namespace, name)
            self.wakes.pop(key, None)
            self.generations.pop(key, None)
            self.invalid_reported.pop(key, None)
            self.noticed.pop(key, None)
            self.taken.pop(key, None)

    async def _arm(self, store: Store, namespace: str, name: str) -> bool:
        if not store.connected:
            return False
        return await store.arm(namespace, name, lambda: self.wake_threadsafe(namespace, name))

    def next_pass(self, outcome: Outcome, failures: int) -> float:
        """Seconds until the next pass with nothing waking it: the resync, sooner if the plan
        is due again; after ``failures`` consecutive failures, 1, 2, 4, ... seconds instead."""
        if failures:
            cap = max(BACKOFF_MAX_SECONDS, self.resync_seconds)
            return min(cap, 2.0 ** min(failures - 1, 30))
        if outcome.recheck_after is None:
            return self.resync_seconds
        return min(self.resync_seconds, max(RECHECK_MIN_SECONDS, outcome.recheck_after))

    async def _sleep(
        self, stopped: Stopped, wake: asyncio.Event, last: float, delay: float
    ) -> None:
        while not stopped and not wake.is_set():
            left = delay - (time.monotonic() - last)
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(1.0, left)):
                    await wake.wait()

    async def _pass(
        self, controller: AnyController, namespace: str, name: str, logger: logging.Logger
    ) -> Outcome:
        kind = self.kind.kind
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = Outcome()
        try:
            outcome = await self._bounded(self.reconcile(controller, namespace, name, logger))
        except NotLeading:  # deposed mid-pass: nothing more written; the next leader goes on
            logger.info("pass of %s/%s stopped: not the leader", namespace, name)
        except Exception as exc:  # reported, retried with back-off; never kills the daemon
            self.metrics.reconcile_errors.labels(kind=kind).inc()
            logger.warning("reconcile of %s/%s failed: %s", namespace, name, exc)
            outcome = Outcome(failed=True)
            await asyncio.sleep(1.0)
        self.metrics.reconcile_seconds.labels(kind=kind).observe(time.perf_counter() - wall)
        self.metrics.reconcile_cpu_seconds.labels(kind=kind).inc(time.process_time() - cpu)
        return outcome

    async def _bounded(self, reconcile: Coroutine[Any, Any, Outcome]) -> Outcome:
        """The pass's outcome; :class:`PassStuck` once it has run :attr:`pass_deadline` s (the
        pass cancelled: a worker thread blocked in a call it made ends with that call)."""
        task = asyncio.ensure_future(reconcile)
        try:
            await asyncio.wait({task}, timeout=self.pass_deadline)
        except BaseException:  # the daemon itself stopped: its pass with it
            task.cancel()
            raise
        if task.done():
            return task.result()
        where = " -> ".join(_awaiting(task.get_coro()))
        task.cancel()
        # its unwinding (not raised here: the pass's cancellation, not the daemon's), bounded
        # in case the pass holds on to its cancellation
        await asyncio.wait({task}, timeout=5.0)
        raise PassStuck(
            f"still running after {self.pass_deadline:g} s, cancelled; it waited in {where}"
        )

    async def reconcile(
        self, controller: AnyController, namespace: str, name: str, logger: logging.Logger
    ) -> Outcome:
        """One pass over one object (see the module's docstring); raises what failed."""
        body = await self.kube.get(self.kind, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Outcome()
        spec, errors = controller.parse(body)
        try:
            if spec is not None and errors:  # reported with what the world refuses of it too
                errors += await controller.refused(body, spec)
            if spec is None or errors:
                raise Invalid(errors)
            view = await controller.observe(body, spec, logger)
        except Invalid as invalid:
            await self.report_invalid(body, invalid.errors, logger)
            return Outcome()
        self.spec_valid(namespace, name)
        plan = controller.plan(view)
        actions = await controller.admit(body, view, plan.actions, logger)
        busy = await self.apply(body, actions, controller.store)
        await self.write_status(body, plan.stored_status(), plan.conditions)
        controller.record(body, view, plan)
        return Outcome(busy=busy, recheck_after=plan.recheck_after)

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
        """The engines' NetworkPolicy in place in ``namespace`` for a pass that has
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
        self, body: Mapping[str, Any], actions: Sequence[Effect], store: Store | None = None
    ) -> bool:
        """Apply a plan's actions, each by its type's applier (:data:`APPLIERS`). Those marked
        independent (pod creations, warm pod claims: each claim is conditional on its own pod's
        resourceVersion) are issued together, so 64 instances cost about one API round trip,
        not 64; everything else in the plan's order. A notice is posted once while it holds (a
        plan repeats it every pass its cause lasts), again if it comes back. True if anything
        was to be changed."""
        self.gate.check()
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        said = self.noticed.get(key, set())
        current: set[tuple[str, str]] = set()
        changes: list[tuple[Effect, Applier]] = []
        for action in actions:
            applier = applier_of(action)
            if applier is None:
                event = action.describe()
                if event is not None:
                    current.add((event.reason, event.message))
                    if (event.reason, event.message) not in said:
                        self.post(body, event)
            else:
                changes.append((action, applier))
        self.noticed[key] = current
        together = [(a, f) for a, f in changes if f.independent or a.independent]
        # every one finished (its Event, its bookkeeping) before a failure is raised
        done = await asyncio.gather(
            *(self._apply(body, a, f, store) for a, f in together), return_exceptions=True
        )
        failed = next((r for r in done if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        for action, applier in changes:
            if not (applier.independent or action.independent):
                await self._apply(body, action, applier, store)
        return bool(changes)

    async def _apply(
        self, body: Mapping[str, Any], action: Effect, applier: Applier, store: Store | None
    ) -> None:
        self.gate.check()
        self.metrics.actions.labels(action=type(action).__name__).inc()
        if await applier.apply(self, body, action, store):
            self.post(body, action.describe())

    # ------------------------------------------------------------------ appliers
    async def create_pod(
        self, body: Mapping[str, Any], action: PodCreation, _: Store | None
    ) -> bool:
        meta = body["metadata"]
        changed = await self.kube.create_pod(meta["namespace"], action.manifest)
        pod = str(action.manifest["metadata"]["name"])
        # a name found taken (409): whose pod holds it is worth a look on the next passes
        taken = self.taken.setdefault((meta["namespace"], meta["name"]), set())
        if changed:
            taken.discard(pod)
        else:
            taken.add(pod)
        return changed

    async def delete_pod(
        self, body: Mapping[str, Any], action: PodDeletion, _: Store | None
    ) -> bool:
        return await self.kube.delete_pod(
            body["metadata"]["namespace"],
            action.name,
            action.uid,
            force=action.force,
            resource_version=action.resource_version,
        )

    async def claim_pod(self, body: Mapping[str, Any], action: PodClaim, _: Store | None) -> bool:
        return await self.kube.claim_pod(
            body["metadata"]["namespace"], action.name, action.resource_version, action.patch
        )

    async def ungate_pod(self, body: Mapping[str, Any], action: PodUngate, _: Store | None) -> bool:
        return await self.kube.ungate_pod(body["metadata"]["namespace"], action.name, action.uid)

    async def create_object(
        self, body: Mapping[str, Any], action: ObjectCreation, _: Store | None
    ) -> bool:
        meta = body["metadata"]
        changed = await self.kube.create_object(action.kind, meta["namespace"], action.manifest)
        # a name found taken, as for pods: the kind's plan reads it (no creation asked again)
        name = f"{action.kind.plural}/{action.manifest['metadata']['name']}"
        taken = self.taken.setdefault((meta["namespace"], meta["name"]), set())
        if changed:
            taken.discard(name)
        else:
            taken.add(name)
        return changed

    async def patch_object(
        self, body: Mapping[str, Any], action: ObjectPatch, _: Store | None
    ) -> bool:
        return await self.kube.patch_object(
            action.kind,
            body["metadata"]["namespace"],
            action.name,
            action.patch,
            resource_version=action.resource_version,
        )

    async def change_znodes(
        self, body: Mapping[str, Any], action: ZnodeChange[Any], store: Store | None
    ) -> bool:
        if store is None:
            raise TypeError(f"{self.kind.kind} has no ZooKeeper store for {action!r}")
        meta = body["metadata"]
        await store.apply(meta["namespace"], meta["name"], action)
        return True


@dataclass(frozen=True)
class Applier:
    """How one type of effect is applied: ``apply(loop, body, effect, store)`` returns whether
    it changed something (then its Event is posted); ``independent`` ones go together."""

    apply: Callable[[Reconciler, Mapping[str, Any], Any, Store | None], Awaitable[bool]]
    independent: bool = False


# The effect types the loop applies, by their base type in domain.effects; a Notice has none
# (it changes nothing: its Event is posted). A new kind of effect adds its row here.
APPLIERS: dict[type[Effect], Applier | None] = {
    PodCreation: Applier(Reconciler.create_pod, independent=True),
    PodClaim: Applier(Reconciler.claim_pod, independent=True),
    PodDeletion: Applier(Reconciler.delete_pod),
    PodUngate: Applier(Reconciler.ungate_pod),
    ObjectCreation: Applier(Reconciler.create_object),
    ObjectPatch: Applier(Reconciler.patch_object),
    ZnodeChange: Applier(Reconciler.change_znodes),
    Notice: None,
}


def applier_of(action: Effect) -> Applier | None:
    """The applier of ``action``'s nearest base type in the table; None for a notice."""
    for base in type(action).__mro__:
        if base in APPLIERS:
            return APPLIERS[base]
    raise TypeError(f"no applier for {action!r}")


def _awaiting(coro: object) -> list[str]:
    """Where a suspended coroutine waits: its chain of awaits, outermost first."""
    chain = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        chain.append(
            f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
        )
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain
