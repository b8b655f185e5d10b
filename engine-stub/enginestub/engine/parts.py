"""What the engine's parts (:mod:`.prefill`, :mod:`.to_decode`, :mod:`.kvpull`, :mod:`.decode`)
share: built once by :class:`enginestub.engine.core.Engine`, the facade that composes them."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig
from enginestub.engine.faults import DeviceFaults
from enginestub.engine.kvcache import KvBudget
from enginestub.engine.metrics import EngineMetrics


@dataclass(frozen=True)
class Shared:
    config: EngineConfig
    clock: Clock  # every time is emulated seconds
    metrics: EngineMetrics
    faults: DeviceFaults  # the slow factor, hangs, links down
    kv: KvBudget  # HBM for KV caches
    http: httpx.AsyncClient  # to the other engines


class Part:
    """One part of the engine, with the shared pieces under their own names."""

    def __init__(self, shared: Shared) -> None:
        self.config = shared.config
        self.clock = shared.clock
        self.metrics = shared.metrics
        self.faults = shared.faults
        self.kv = shared.kv
        self.http = shared.http
