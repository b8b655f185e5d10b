"""The kinds of effect a plan has on the world, for every kind (pure).

A kind's actions are frozen values that say *what* to do and carry everything the applier needs
(a pod's manifest, a znode's bytes), so applying them is generic: create a pod, delete a pod
(with a UID precondition), claim a pod, lift a pod's scheduling gates, create or patch a custom object the kind owns (of any
kind: a scenario's PDGroups), or change znodes in the kind's ZooKeeper subtree. Each action also
says how it is reported (:meth:`Effect.describe`: the Event's reason and message).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import Kind

Paths = TypeVar("Paths")


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the object (``Normal`` unless ``warning``)."""

    reason: str
    message: str
    warning: bool = False


class Effect:
    """Base of every action; ``describe`` is None for bookkeeping nobody needs to read.
    ``independent``: applied with the pass's other independent effects (pod creations and
    claims), before those in the plan's order, and not held back by their failure."""

    independent: ClassVar[bool] = False

    def describe(self) -> Event | None:
        return None


class PodCreation(Effect):
    """Create a pod from ``manifest`` (idempotent: an existing pod of that name is success, and
    is not reported)."""

    manifest: Mapping[str, Any]


class PodDeletion(Effect):
    """Delete pod ``name`` only if it is still the one with ``uid`` (a recreated pod of the same
    name is never deleted by mistake); an absent pod is success, and is not reported."""

    name: str
    uid: str
    force: bool  # grace period 0: its server is down, no kubelet will finish a graceful one
    # Also only while it is at this resourceVersion (None: any): a warm pod claimed meanwhile
    # is not deleted by its pool.
    resource_version: str | None = None


class PodClaim(Effect):
    """Claim pod ``name`` by merge-patching its metadata (labels, annotations, owner
    references) with its ``resource_version`` as precondition: of two claims on one pod, the
    API server lets one through and refuses the other (409), which is then not reported."""

    name: str
    resource_version: str
    patch: Mapping[str, Any]


class PodUngate(Effect):
    """Lift the scheduling gates of pod ``name`` (only while it is the one with ``uid``): the
    scheduler may place it from then on. A gone pod, or one no longer gated, is not reported."""

    name: str
    uid: str


class ObjectCreation(Effect):
    """Create a custom object of ``kind`` from ``manifest`` in the object's namespace
    (idempotent: one of that name already there is success, and is not reported)."""

    kind: Kind
    manifest: Mapping[str, Any]


class ObjectPatch(Effect):
    """Merge-patch the spec or metadata of custom object ``name`` of ``kind`` in the object's
    namespace, only while it is at ``resource_version`` (None: any); a gone object, or one
    changed meanwhile (409), is not reported."""

    kind: Kind
    name: str
    patch: Mapping[str, Any]
    resource_version: str | None = None


class Notice(Effect):
    """Nothing to change, something to say: applying it posts its Event."""


class ZnodeChange(Effect, Generic[Paths]):
    """Writes to the kind's ZooKeeper subtree (``Paths`` names its znodes), in order, each
    idempotent."""

    def znodes(self, paths: Paths) -> list[zl.ZnodeOp]:
        raise NotImplementedError
