"""What a kind is to the loop: the :class:`Controller` protocol (no kopf here).

A kind is a value that says what it watches and how one pass over one of its objects goes;
:mod:`.reconciler` runs every kind's objects by it and :mod:`.kinds` registers it with kopf.
The split follows controller-runtime's ``For(...).Owns(...)`` builder and ``Reconcile``:

- :attr:`Controller.watches` — one declaration of what wakes an object's loop: events on the
  object itself, on its pods (a label naming the object), on custom objects it owns (of any
  kind, a label naming the owner), and its ZooKeeper store (armed once per object).
- a pass: ``parse(body) -> (spec, errors)`` (an invalid spec is reported once per generation and
  touches nothing; ``refused`` adds what the world refuses of it); ``observe(body, spec) -> view`` (reads the world; raises :class:`Invalid`
  for what only the world can refuse, such as a template its pods do not run); ``plan(view)``
  (pure: a value with actions, status, conditions and when to look again); the loop applies the
  actions through its table of appliers, writes the status if it changed, then ``record(body,
  plan)`` (metrics).
- ``finalize(body)`` — what deletion must remove outside Kubernetes (the object's finalizer
  waits for it); ``forget(namespace, name)`` when an object's loop ends; ``sweep()`` — what
  belongs to objects that are gone (run on every new ZooKeeper session and periodically).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from matrixserve.api.kinds import Kind
from matrixserve.domain.conditions import Condition
from matrixserve.domain.effects import Effect, ZnodeChange

Body = Mapping[str, Any]
Wake = Callable[[], None]
SpecT = TypeVar("SpecT")
ViewT = TypeVar("ViewT")
PlanT = TypeVar("PlanT", bound="Plan")


class Invalid(Exception):
    """Raised by ``observe``: the spec is refused by what runs (reported as ``InvalidSpec``)."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = list(errors)


class Retry(Exception):
    """Raised by ``finalize``: not done yet, try again in ``delay`` seconds."""

    def __init__(self, message: str, delay: float = 5.0) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass(frozen=True)
class Owns:
    """Custom objects of ``kind`` an object owns, each naming its owner in label ``label``."""

    kind: Kind
    label: str


@dataclass(frozen=True)
class Watches:
    """What wakes an object's loop besides its own events (and the resync)."""

    pods: str | None = None  # pods labelled with this key, its value the object's name
    owns: tuple[Owns, ...] = ()
    store: bool = False  # the controller's ZooKeeper store is armed per object


class Store(Protocol):
    """A kind's ZooKeeper data, as the loop sees it."""

    @property
    def connected(self) -> bool: ...

    async def arm(self, namespace: str, name: str, wake: Wake) -> bool:
        """Watch the object's znodes, calling ``wake`` (from any thread) on a change; False
        if that cannot be done now (not connected): asked again on the next pass."""

    def disarm(self, namespace: str, name: str) -> None: ...

    async def apply(self, namespace: str, name: str, change: ZnodeChange[Any]) -> None: ...


class Plan(Protocol):
    """What the loop needs of a kind's plan."""

    @property
    def actions(self) -> Sequence[Effect]: ...

    @property
    def conditions(self) -> Sequence[Condition]: ...

    @property
    def recheck_after(self) -> float | None:
        """Seconds until this plan is due to change with nothing else happening (a window's
        end, a cooldown, a deadline); None: only when something changes."""

    def stored_status(self) -> Mapping[str, Any]:
        """The status as the API server is to store it (no conditions: the loop merges them)."""


@dataclass(frozen=True)
class Request:
    """An admission request, as a kind's check reads it: ``body`` is the object sent (for a
    subresource, e.g. ``scale``, that subresource's object), ``old`` the stored one on an
    update."""

    operation: str
    namespace: str
    name: str
    body: Body
    old: Body | None = None

    @property
    def deleting(self) -> bool:
        return bool((self.body.get("metadata") or {}).get("deletionTimestamp"))


@dataclass(frozen=True)
class Admission:
    """A validating webhook of the kind: ``check(controller, request)`` returns what is wrong
    (empty: admitted), refused as ``invalid <Kind>: ...`` (422). It is served at ``/<id>``."""

    id: str
    operations: tuple[str, ...]
    check: Callable[[Any, Request], Awaitable[list[str]]]
    subresource: str | None = None


class Controller(Protocol[SpecT, ViewT, PlanT]):
    """One kind, as the loop runs it (see the module's docstring): its spec, view and plan
    types are its own."""

    @property
    def kind(self) -> Kind: ...

    @property
    def watches(self) -> Watches: ...

    @property
    def store(self) -> Store | None: ...

    def parse(self, body: Body) -> tuple[SpecT | None, list[str]]: ...

    async def refused(self, body: Body, spec: SpecT) -> list[str]:
        """What the world refuses of a spec already invalid by its rules (reported together;
        ``observe`` raises :class:`Invalid` for the same on a valid one)."""

    async def observe(self, body: Body, spec: SpecT, logger: logging.Logger) -> ViewT: ...

    def plan(self, view: ViewT) -> PlanT: ...

    async def admit(
        self, body: Body, view: ViewT, actions: Sequence[Effect], logger: logging.Logger
    ) -> list[Effect]:
        """What the world asks of this pass beyond the plan (at least the plan's actions)."""

    def record(self, body: Body, view: ViewT, plan: PlanT) -> None: ...

    async def finalize(self, body: Body, logger: logging.Logger) -> None: ...

    def forget(self, namespace: str, name: str) -> None: ...

    async def sweep(self) -> None: ...


AnyController = Controller[Any, Any, Any]  # a kind's controller, whichever its types
