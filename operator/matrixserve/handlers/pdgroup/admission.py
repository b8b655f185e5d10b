"""The PDGroup admission webhook: the reconciler's rules before an object is stored, on create,
update and the scale subresource; metadata-only updates and objects being deleted always pass
(an invalid object can always be fixed or deleted)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from matrixserve.api import kinds
from matrixserve.domain.pdgroup.validation import admit, spec_changes, with_decode_replicas
from matrixserve.handlers.pdgroup.controller import API, KIND

WEBHOOK_RULES = "pdgroup-rules"  # create and update of PDGroups: the path /pdgroup-rules
WEBHOOK_SCALE = "pdgroup-scale"  # the scale subresource (kubectl scale): /pdgroup-scale


def _refuse(errors: list[str]) -> None:
    if errors:
        raise kopf.AdmissionError("invalid PDGroup: " + "; ".join(errors), code=422)


async def validate(
    spec: kopf.Spec,
    old: kopf.Body | None,
    operation: str,
    name: str,
    namespace: str,
    meta: kopf.Meta,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """The validating admission webhook: the reconciler's rules, before the object is stored.
    A spec change of an existing group is checked against the template its pods were made
    from (read only then)."""
    old_spec = None if old is None else old.get("spec")
    deleting = bool(meta.get("deletionTimestamp"))
    running: dict[str, Any] = {}
    if operation == "UPDATE" and not deleting and spec_changes(operation, old_spec, spec):
        running = await memo.runtime.kube.list_pods(namespace, {kinds.LABEL_GROUP: name})
    _refuse(admit(operation, old_spec, spec, deleting, name or "", running.values()))


async def validate_scale(
    body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """The scale subresource (``kubectl scale``; the request's object is an autoscaling/v1
    Scale): its ``spec.replicas`` applied to the stored group's ``spec.decode.replicas``, and
    the result checked as an update."""
    current = await memo.runtime.kube.get(KIND, namespace, name)
    if current is None:
        return  # gone: the API server answers the write with 404 itself
    spec = current.get("spec") or {}
    replicas = (body.get("spec") or {}).get("replicas", 0)
    deleting = bool(current["metadata"].get("deletionTimestamp"))
    _refuse(admit("UPDATE", spec, with_decode_replicas(spec, replicas), deleting, name))


class RefusalsAreWarnings(logging.Filter):
    """kopf logs an admission handler's every exception at ERROR, as the operator's failure; a
    refusal (``AdmissionError``, "failed permanently") is the user's error: WARNING, and said
    so. A real failure of a handler ("failed with an exception") stays at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            message = record.getMessage()
            for hook in (WEBHOOK_RULES, WEBHOOK_SCALE):
                prefix = f"Webhook {hook!r} failed permanently: "
                if message.startswith(prefix):
                    ref = getattr(record, "k8s_ref", None) or {}  # kopf's object logger's
                    of = f" of {ref['namespace']}/{ref['name']}" if ref.get("name") else ""
                    record.levelno, record.levelname = logging.WARNING, "WARNING"
                    record.msg = f"refused a change{of} ({hook}): {message[len(prefix) :]}"
                    record.args = ()
        return True


def register_webhook() -> None:
    """Registered only when the webhook is served (kopf refuses admission handlers without a
    server); ``--no-webhook`` leaves the reconciler's own check as the only guard."""
    kopf.on.validate(*API, id=WEBHOOK_RULES, operations=["CREATE", "UPDATE"])(validate)
    kopf.on.validate(*API, id=WEBHOOK_SCALE, operations=["UPDATE"], subresource="scale")(
        validate_scale
    )
    objects = logging.getLogger("kopf.objects")  # where kopf logs the handlers' outcomes
    if not any(isinstance(f, RefusalsAreWarnings) for f in objects.filters):
        objects.addFilter(RefusalsAreWarnings())
