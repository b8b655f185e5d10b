"""What the engine's parts (:mod:`.prefill`, :mod:`.to_decode`, :mod:`.kvpull`, :mod:`.decode`)
share: built once by :class:`enginestub.engine.core.Engine`, the facade that composes them; and
:class:`Hold`, one request's hold on a place the engine has a fixed number of."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import httpx

from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig
from enginestub.engine.faults import DeviceFaults
from enginestub.engine.heartbeat import Heartbeat
from enginestub.engine.kvcache import KvBudget, KvLease
from enginestub.engine.metrics import EngineMetrics


@dataclass
class Shared:
    # the instance's configuration: replaced once, when the leader of an instance of several
    # pods has gathered them (its RoCE IPs become every rank's: Engine.form)
    config: EngineConfig
    clock: Clock  # every time is emulated seconds
    metrics: EngineMetrics
    faults: DeviceFaults  # the slow factor, hangs, links down
    kv: KvBudget  # HBM for KV caches
    http: httpx.AsyncClient  # to the other engines
    heartbeat: Heartbeat  # the serving loop's: decode steps and prefill completions beat


class Part:
    """One part of the engine, with the shared pieces under their own names."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self.clock = shared.clock
        self.metrics = shared.metrics
        self.faults = shared.faults
        self.kv = shared.kv
        self.http = shared.http
        self.heartbeat = shared.heartbeat

    @property
    def config(self) -> EngineConfig:
        """The instance's configuration now (see :class:`Shared`)."""
        return self._shared.config


class Releasable:
    """Something given back by :meth:`release` (once: a second call does nothing), also as a
    ``with`` block that gives it back on every way out."""

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Hold(Releasable):
    """One request's hold on a prefill slot or a place in the decode batch, and on its KV.

    Given back exactly once, whichever path ends the exchange (its end, an error, the caller gone
    before the response started, a cancellation): the HTTP exchange holds it in a ``with`` block,
    and every other owner calls :meth:`release`, which a second time does nothing. Stamped at each
    step of the request's progress, so a hold kept without progress shows (:meth:`idle`, the
    health's ``stuckSlots``)."""

    def __init__(
        self, clock: Clock, kv: KvLease | None, on_release: Callable[[Hold], None]
    ) -> None:
        self._clock = clock
        self.kv = kv
        self._on_release = on_release
        self.released = False
        self.working = False  # advancing on its own: its prompt in the prefill compute
        self.progressed_at = clock.now()

    def progressed(self) -> None:
        self.progressed_at = self._clock.now()

    def idle(self, now: float) -> float:
        """Emulated seconds since its last progress (0 while it is working)."""
        return 0.0 if self.working else now - self.progressed_at

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.kv is not None:
            self.kv.release()
        self._on_release(self)
