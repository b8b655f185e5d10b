"""HBM for KV caches (P/D-Serve §3.5-3.6): a prefill reserves a prompt's KV from admission until a
decode has pulled it; a decode reserves prompt and output for every request in its batch. What
does not fit is refused (429), never swapped. The weights' share of HBM is fixed at load."""

from __future__ import annotations

from enginestub import timing
from enginestub.engine.config import EngineConfig
from enginestub.engine.metrics import EngineMetrics


class KvBudget:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.reserved = 0.0  # bytes

    def bytes_for(self, tokens: int) -> float:
        return timing.kv_bytes(self.config.model, tokens)

    def reserve(self, tokens: int) -> bool:
        need = self.bytes_for(tokens)
        if self.reserved + need > self.config.kv_capacity_bytes:
            return False
        self.reserved += need
        self.metrics.hbm_used.set(self.config.weights_bytes + self.reserved)
        return True

    def release(self, tokens: int) -> None:
        self.reserved = max(0.0, self.reserved - self.bytes_for(tokens))
        self.metrics.hbm_used.set(self.config.weights_bytes + self.reserved)
