"""The registration (``handlers/kinds.py``) builds every kopf handler of a kind from its
declarations alone: a kind that owns custom objects of another kind is woken by their events
(the object the label names), its pods' events wake it, its webhooks are registered only when
the webhook is served."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import kopf
import pytest

from matrixserve.api import kinds
from matrixserve.handlers import kinds as registration
from matrixserve.handlers.controller import Admission, Owns, Request, Watches

SCENARIO = kinds.Kind("Scenario", "scenarios")


async def _nothing_wrong(_: Any, request: Request) -> list[str]:
    return [] if request.name else ["no name"]


class Scenarios:
    """A kind that owns PDGroups (labelled with its name) and pods."""

    kind: ClassVar[kinds.Kind] = SCENARIO
    watches: ClassVar[Watches] = Watches(
        pods="example.com/scenario", owns=(Owns(kinds.PDGROUP, "example.com/scenario"),)
    )
    finalizer_id: ClassVar[str] = "scenario-cleanup"
    admissions: ClassVar[tuple[Admission, ...]] = (
        Admission("scenario-rules", ("CREATE",), _nothing_wrong),
    )

    @classmethod
    def install(cls, rt: Any) -> Any:
        return cls()


def _handlers(registry: kopf.OperatorRegistry) -> dict[str, Any]:
    return {str(h.id): h for h in registry._watching.get_all_handlers()}


def _webhooks(registry: kopf.OperatorRegistry) -> list[Any]:
    return list(registry._webhooks.get_all_handlers())


def test_owned_objects_and_pods_wake_the_object_their_label_names() -> None:
    registry = registration.register([Scenarios], False, kopf.OperatorRegistry())
    handlers = _handlers(registry)
    owned = handlers["scenarios-pdgroups-event"]
    assert owned.selector.any_name == "pdgroups"
    assert owned.labels == {"example.com/scenario": kopf.PRESENT}
    pods = handlers["scenarios-pod-event"]
    assert pods.selector.any_name == "pods"
    woken: list[tuple[str, str]] = []
    loop = SimpleNamespace(related_changed=lambda ns, name: woken.append((ns, name)))
    memo = SimpleNamespace(runtime=SimpleNamespace(loops={SCENARIO: loop}))
    labels = {"example.com/scenario": "s1"}
    # on the event loop (its wake-up events are not thread-safe), not in kopf's thread pool
    assert asyncio.iscoroutinefunction(owned.fn)
    assert asyncio.iscoroutinefunction(pods.fn)
    asyncio.run(owned.fn(labels=labels, namespace="ns", memo=memo))
    asyncio.run(pods.fn(labels=labels, namespace="ns", memo=memo))
    assert woken == [("ns", "s1"), ("ns", "s1")]
    assert "scenarios-event" in handlers  # its own objects
    assert not _webhooks(registry)  # no webhook served: none


def test_a_kinds_webhooks_refuse_with_its_checks_errors_as_a_422() -> None:
    registry = registration.register([Scenarios], True, kopf.OperatorRegistry())
    (hook,) = _webhooks(registry)
    assert hook.id == "scenario-rules"
    memo = SimpleNamespace(runtime=SimpleNamespace(controllers={SCENARIO: Scenarios()}))
    body = kopf.Body(cast(Any, {"metadata": {"name": ""}}))
    with pytest.raises(kopf.AdmissionError) as refused:
        asyncio.run(hook.fn(body=body, name="", namespace="ns", memo=memo, operation="CREATE"))
    assert refused.value.code == 422
    assert str(refused.value) == "invalid Scenario: no name"
    asyncio.run(hook.fn(body=body, name="s1", namespace="ns", memo=memo, operation="CREATE"))
    objects = logging.getLogger("kopf.objects")
    objects.filters = [
        f for f in objects.filters if not isinstance(f, registration.RefusalsAreWarnings)
    ]
