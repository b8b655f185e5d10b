"""Processor sharing in emulated time: concurrent jobs split a capacity equally (max-min fair,
with an optional per-job rate cap). Prefill compute uses it (concurrent prompts slow each other,
continuous batching), and so does a KV link (two pulls into one decode each take twice as long,
P/D-Serve §3.6 "several concurrent transmissions share the D2D bandwidth").

``SharedResource.admits`` forecasts end times under equal shares (no further arrivals) so that
a prefill can refuse, at admission, a prompt whose first token would be late or that would make
a running prompt late (P/D-Serve §2.2.2's early intervention, moved to admission)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from enginestub.engine.clock import Clock


@dataclass(eq=False)
class _Job:
    remaining: float  # as of ``since``; it goes down at ``rate`` from then
    cap: float
    deadline: float | None = None  # emulated time it should end by, if it has one
    rate: float = 0.0
    since: float = 0.0

    def left(self, now: float) -> float:
        return max(0.0, self.remaining - (now - self.since) * self.rate)


def _finish_times(now: float, capacity: float, lefts: list[float]) -> list[float]:
    """When each of the jobs with these remaining amounts ends under equal shares of
    ``capacity``, if no other job arrives (uncapped jobs): in order of what is left, each ending
    job hands its share to the rest."""
    order = sorted(range(len(lefts)), key=lambda i: lefts[i])
    ends = [0.0] * len(lefts)
    t, done = now, 0.0
    for rank, i in enumerate(order):
        t += (lefts[i] - done) * (len(lefts) - rank) / capacity
        done = lefts[i]
        ends[i] = t
    return ends


class SharedResource:
    def __init__(self, clock: Clock, capacity: float) -> None:
        if not capacity > 0:
            raise ValueError("capacity must be > 0")
        self.clock = clock
        self.capacity = capacity
        self._jobs: list[_Job] = []
        self._changed = asyncio.Event()
        self._busy = 0.0  # emulated seconds with a job in it, until ``_busy_since``
        self._busy_since: float | None = None  # since when it has had one (None: idle)

    @property
    def active(self) -> int:
        return len(self._jobs)

    def busy_seconds(self) -> float:
        """Emulated seconds it has had at least one job in it (the prefill's throughput while busy
        is what it can serve)."""
        since = self._busy_since
        return self._busy + (self.clock.now() - since if since is not None else 0.0)

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

    def admits(self, amount: float, deadline: float) -> bool:
        """Whether a new job of ``amount`` would end by ``deadline`` and every running job with a
        deadline that it would meet alone still meets it beside the new one, if nothing else
        arrives. For uncapped jobs (prefill compute); a job that misses anyway does not count."""
        now = self.clock.now()
        lefts = [job.left(now) for job in self._jobs]
        before = _finish_times(now, self.capacity, lefts)
        after = _finish_times(now, self.capacity, [*lefts, amount])
        if after[-1] > deadline:
            return False
        return not any(
            job.deadline is not None and before[i] <= job.deadline < after[i]
            for i, job in enumerate(self._jobs)
        )

    def _notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    async def consume(
        self, amount: float, cap: float = float("inf"), deadline: float | None = None
    ) -> float:
        """Use ``amount`` units; returns the emulated seconds it took. ``deadline`` (emulated
        time) is what :meth:`admits` protects for this job."""
        started = self.clock.now()
        if amount <= 0:
            return 0.0
        job = _Job(amount, cap, deadline)
        if not self._jobs:
            self._busy_since = started
        self._jobs.append(job)
        self._notify()
        try:
            while job.remaining > 1e-12 * amount:
                rate = self._rates()[job]
                changed = self._changed
                job.rate, job.since = rate, self.clock.now()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.clock.to_wall(job.remaining / rate)):
                        await changed.wait()
                job.remaining -= (self.clock.now() - job.since) * rate
                job.rate = 0.0
        finally:
            self._jobs.remove(job)
            if not self._jobs and self._busy_since is not None:
                self._busy += self.clock.now() - self._busy_since
                self._busy_since = None
            self._notify()
        return self.clock.now() - started
