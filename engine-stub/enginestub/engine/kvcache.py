"""HBM for KV caches (P/D-Serve §3.5-3.6): a prefill reserves a prompt's KV from admission until a
decode has pulled it; a decode reserves prompt and output for every request in its batch. What
does not fit is refused (429), never swapped. The weights' share of HBM is fixed at load.

A reservation is a :class:`KvLease`, given back exactly once whichever path ends the request
(a lease, not a count that every path must remember to decrement)."""

from __future__ import annotations

from enginestub import timing
from enginestub.engine.config import EngineConfig


class KvBudget:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.reserved = 0.0  # bytes

    def bytes_for(self, tokens: int) -> float:
        return timing.kv_bytes(self.config.model, tokens)

    def lease(self, tokens: int) -> KvLease | None:
        """Reserve the KV of ``tokens`` tokens, or None if it does not fit."""
        need = self.bytes_for(tokens)
        if self.reserved + need > self.config.kv_capacity_bytes:
            return None
        self.reserved += need
        return KvLease(self, need)

    def _give_back(self, nbytes: float) -> None:
        # Float sums of many leases drift by ulps: clamp, so idle reads exactly 0.
        self.reserved = max(0.0, self.reserved - nbytes)
        if self.reserved < 1.0:
            self.reserved = 0.0


class KvLease:
    """KV reserved for one request."""

    def __init__(self, budget: KvBudget, nbytes: float) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self.held = True

    def release(self) -> None:
        """Give the KV back; a second call does nothing."""
        if self.held:
            self.held = False
            self._budget._give_back(self.nbytes)
