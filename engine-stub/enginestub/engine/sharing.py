"""Processor sharing in emulated time: concurrent jobs split a capacity equally (max-min fair,
with an optional per-job rate cap). Prefill compute uses it (concurrent prompts slow each other,
continuous batching), and so does a KV link (two pulls into one decode each take twice as long,
P/D-Serve §3.6 "several concurrent transmissions share the D2D bandwidth")."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from enginestub.engine.clock import Clock


@dataclass(eq=False)
class _Job:
    remaining: float
    cap: float


class SharedResource:
    def __init__(self, clock: Clock, capacity: float) -> None:
        if not capacity > 0:
            raise ValueError("capacity must be > 0")
        self.clock = clock
        self.capacity = capacity
        self._jobs: list[_Job] = []
        self._changed = asyncio.Event()

    @property
    def active(self) -> int:
        return len(self._jobs)

    def _rates(self) -> dict[_Job, float]:
        """Max-min fair split of the capacity, respecting each job's cap."""
        rates: dict[_Job, float] = {}
        left = self.capacity
        pending = sorted(self._jobs, key=lambda j: j.cap)
        while pending:
            share = left / len(pending)
            job = pending[0]
            if job.cap <= share:
                rates[job] = job.cap
                left -= job.cap
                pending.pop(0)
                continue
            for j in pending:
                rates[j] = share
            break
        return rates

    def share_for(self, cap: float = float("inf")) -> float:
        """The rate a new job capped at ``cap`` would get now, beside the running ones."""
        probe = _Job(1.0, cap)
        self._jobs.append(probe)
        try:
            return self._rates()[probe]
        finally:
            self._jobs.remove(probe)

    def _notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    async def consume(self, amount: float, cap: float = float("inf")) -> float:
        """Use ``amount`` units; returns the emulated seconds it took."""
        started = self.clock.now()
        if amount <= 0:
            return 0.0
        job = _Job(amount, cap)
        self._jobs.append(job)
        self._notify()
        try:
            while job.remaining > 1e-12 * amount:
                rate = self._rates()[job]
                changed = self._changed
                begin = self.clock.now()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.clock.to_wall(job.remaining / rate)):
                        await changed.wait()
                job.remaining -= (self.clock.now() - begin) * rate
        finally:
            self._jobs.remove(job)
            self._notify()
        return self.clock.now() - started
