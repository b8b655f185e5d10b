"""The loop's appliers for custom objects a kind owns (``ObjectCreation``, ``ObjectPatch``:
what a scenario kind uses to create and change its PDGroups), on the real API server: a creation
is idempotent (a second is not reported), a patch holds to the resourceVersion it was planned
on (a stale one is refused and not reported), a gone object is no error."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from matrixserve.adapters.kube import KubeAdapter
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.api import kinds
from matrixserve.domain.effects import Event, ObjectCreation, ObjectPatch
from matrixserve.handlers.reconciler import Reconciler
from testkit.helpers import Groups, pdgroup_body


@dataclass(frozen=True)
class CreateGroup(ObjectCreation):
    kind: kinds.Kind
    manifest: Mapping[str, Any]

    def describe(self) -> Event:
        return Event("CreatedGroup", f"Created PDGroup {self.manifest['metadata']['name']}")


@dataclass(frozen=True)
class ScaleGroup(ObjectPatch):
    kind: kinds.Kind
    name: str
    patch: Mapping[str, Any]
    resource_version: str | None = None

    def describe(self) -> Event:
        return Event("ScaledGroup", f"Scaled PDGroup {self.name}")


def test_a_kinds_owned_objects_are_created_once_and_patched_only_as_planned(
    groups: Groups, api_client: client.ApiClient, crds_installed: list[str]
) -> None:
    posted: list[str] = []

    async def run() -> None:
        loop = Reconciler(
            kinds.PDGROUP,
            KubeAdapter(api_client),
            OperatorMetrics(),
            asyncio.get_running_loop(),
            poster=lambda _body, event: posted.append(event.reason) if event else None,
        )
        owner = {"metadata": {"namespace": groups.namespace, "name": "owner", "uid": "u"}}
        manifest = pdgroup_body("g1", prefill=1, decode=1)
        assert await loop.apply(owner, [CreateGroup(kinds.PDGROUP, manifest)])
        assert await loop.apply(owner, [CreateGroup(kinds.PDGROUP, manifest)])  # there: no Event
        assert posted == ["CreatedGroup"]
        stored = groups.get("g1")
        version = stored["metadata"]["resourceVersion"]
        two = {"spec": {"decode": {"replicas": 2}}}
        await loop.apply(owner, [ScaleGroup(kinds.PDGROUP, "g1", two, version)])
        assert groups.get("g1")["spec"]["decode"]["replicas"] == 2
        assert posted == ["CreatedGroup", "ScaledGroup"]
        three = {"spec": {"decode": {"replicas": 3}}}
        await loop.apply(owner, [ScaleGroup(kinds.PDGROUP, "g1", three, version)])  # stale
        assert groups.get("g1")["spec"]["decode"]["replicas"] == 2
        await loop.apply(owner, [ScaleGroup(kinds.PDGROUP, "gone", three)])  # no such object
        assert posted == ["CreatedGroup", "ScaledGroup"]

    asyncio.run(run())
