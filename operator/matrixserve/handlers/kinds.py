"""The one module that registers the kinds with kopf, on an explicit registry.

Each kind is a :class:`~matrixserve.handlers.controller.Controller` class (its ``install(rt)``
builds it at start-up); for each, from its declarations alone:

- an event handler on its objects (any change wakes the object's loop: :mod:`.reconciler`);
- its ``watches``: an event handler on pods labelled with its pod label, and one per kind of
  custom object it owns, each waking the object the label names;
- a daemon per object running the loop, its ``forget`` when the loop ends;
- a delete handler (its finalizer), which the leader runs: the kind's ``finalize``, a
  :class:`~matrixserve.handlers.controller.Retry` becoming kopf's temporary error;
- its admission webhooks, when the webhook is served (kopf refuses admission handlers
  without a server): a refusal is a 422 with what is wrong, logged as the user's error.

Kinds whose controllers are not built yet get the event handler of :mod:`.unserved`. The
operator's start-up, login and clean-up (:mod:`.runtime`) are registered here too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import kopf

from matrixserve.api.kinds import Kind
from matrixserve.handlers import runtime, unserved
from matrixserve.handlers.controller import Admission, AnyController, Request, Retry, Watches
from matrixserve.handlers.leadership import finalizer_pending, lead_or_gone
from matrixserve.handlers.reconciler import Reconciler
from matrixserve.handlers.runtime import Runtime


class KindClass(Protocol):
    """A kind's controller class, as registered (its declarations are class attributes)."""

    kind: Kind
    watches: Watches
    admissions: tuple[Admission, ...]
    finalizer_id: str

    @classmethod
    def install(cls, rt: Runtime) -> AnyController: ...


def _api(kind: Kind) -> tuple[str, str, str]:
    return kind.group, kind.version, kind.plural


def _runtime(memo: kopf.Memo) -> Runtime:
    rt: Runtime = memo.runtime
    return rt


def _loop(memo: kopf.Memo, kind: Kind) -> Reconciler:
    return _runtime(memo).loops[kind]


def register(
    classes: Sequence[KindClass], webhook: bool, registry: kopf.OperatorRegistry
) -> kopf.OperatorRegistry:
    """Every handler of the operator on ``registry`` (pass it to ``kopf.run``)."""
    kopf.on.login(registry=registry)(runtime.login)
    kopf.on.startup(registry=registry)(runtime.startup)
    kopf.on.cleanup(registry=registry)(runtime.cleanup)
    for cls in classes:
        _wake_ups(cls.kind, cls.watches, registry)
        _daemon(cls.kind, registry)
        _finalizer(cls.kind, cls.finalizer_id, registry)
        if webhook:
            for admission in cls.admissions:
                kopf.on.validate(
                    *_api(cls.kind),
                    id=admission.id,
                    operations=list(admission.operations),
                    subresource=admission.subresource,
                    registry=registry,
                )(admission_handler(cls.kind, admission))
    for kind in unserved.UNSERVED:
        _unserved(kind, registry)
    if webhook:
        hooks = [a.id for cls in classes for a in cls.admissions]
        objects = logging.getLogger("kopf.objects")  # where kopf logs the handlers' outcomes
        objects.filters = [f for f in objects.filters if not isinstance(f, RefusalsAreWarnings)]
        objects.addFilter(RefusalsAreWarnings(hooks))
    return registry


def _wake_ups(kind: Kind, watches: Watches, registry: kopf.OperatorRegistry) -> None:
    @kopf.on.event(*_api(kind), id=f"{kind.plural}-event", registry=registry)
    async def object_event(
        name: str, namespace: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any
    ) -> None:  # async: on the loop, whose wake-up events are not thread-safe
        _loop(memo, kind).object_changed(namespace, name, int(meta.get("generation") or 0))

    owned: list[tuple[tuple[str, str, str], str, str]] = (
        [(("", "v1", "pods"), watches.pods, f"{kind.plural}-pod-event")] if watches.pods else []
    )
    owned += [(_api(o.kind), o.label, f"{kind.plural}-{o.kind.plural}-event") for o in watches.owns]
    for api, label, handler_id in owned:
        _wake_on(kind, api, label, handler_id, registry)


def _wake_on(
    kind: Kind,
    api: tuple[str, str, str],
    label: str,
    handler_id: str,
    registry: kopf.OperatorRegistry,
) -> None:
    @kopf.on.event(*api, labels={label: kopf.PRESENT}, id=handler_id, registry=registry)
    async def related_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        _loop(memo, kind).related_changed(namespace, labels[label])


def _daemon(kind: Kind, registry: kopf.OperatorRegistry) -> None:
    @kopf.daemon(*_api(kind), id="reconciler", cancellation_timeout=10.0, registry=registry)
    async def reconciler(
        name: str,
        namespace: str,
        stopped: kopf.DaemonStopped,
        memo: kopf.Memo,
        logger: logging.Logger,
        **_: Any,
    ) -> None:
        rt = _runtime(memo)
        controller = rt.controllers[kind]
        try:
            await rt.loops[kind].run(controller, namespace, name, stopped, logger)
        finally:
            controller.forget(namespace, name)


def _finalizer(kind: Kind, handler_id: str, registry: kopf.OperatorRegistry) -> None:
    @kopf.on.delete(*_api(kind), id=handler_id, registry=registry)
    async def deleted(
        name: str,
        namespace: str,
        body: kopf.Body,
        memo: kopf.Memo,
        logger: logging.Logger,
        **_: Any,
    ) -> None:
        rt = _runtime(memo)
        # The leader finalizes; a standby's handler holds (its kopf writes nothing meanwhile)
        # until it leads, or the object is gone (the leader removed the finalizer): without
        # this a standby's kopf would let the object go while the leader's last pass runs.
        if not await lead_or_gone(rt.leadership, finalizer_pending(rt.kube, kind, namespace, name)):
            return
        try:
            await rt.controllers[kind].finalize(body, logger)
        except Retry as retry:
            raise kopf.TemporaryError(str(retry), delay=retry.delay) from retry


def admission_handler(kind: Kind, admission: Admission) -> Any:
    """kopf's validating handler for one of a kind's webhooks."""

    async def validate(
        body: kopf.Body,
        name: str,
        namespace: str,
        memo: kopf.Memo,
        old: kopf.Body | None = None,
        operation: str = "UPDATE",
        **_: Any,
    ) -> None:
        request = Request(operation, namespace, name or "", body, old)
        errors = await admission.check(_runtime(memo).controllers[kind], request)
        if errors:
            raise kopf.AdmissionError(f"invalid {kind.kind}: " + "; ".join(errors), code=422)

    return validate


class RefusalsAreWarnings(logging.Filter):
    """kopf logs an admission handler's every exception at ERROR, as the operator's failure; a
    refusal (``AdmissionError``, "failed permanently") is the user's error: WARNING, and said
    so. A real failure of a handler ("failed with an exception") stays at ERROR."""

    def __init__(self, hooks: Sequence[str]) -> None:
        super().__init__()
        self.hooks = list(hooks)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            message = record.getMessage()
            for hook in self.hooks:
                prefix = f"Webhook {hook!r} failed permanently: "
                if message.startswith(prefix):
                    ref = getattr(record, "k8s_ref", None) or {}  # kopf's object logger's
                    of = f" of {ref['namespace']}/{ref['name']}" if ref.get("name") else ""
                    record.levelno, record.levelname = logging.WARNING, "WARNING"
                    record.msg = f"refused a change{of} ({hook}): {message[len(prefix) :]}"
                    record.args = ()
        return True


def _unserved(kind: Kind, registry: kopf.OperatorRegistry) -> None:
    @kopf.on.event(*_api(kind), id=f"{kind.plural}-no-controller", registry=registry)
    async def said(
        type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
    ) -> None:
        await unserved.say(_runtime(memo), kind, type, body, logger)
