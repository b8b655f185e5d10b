"""Emulated time. ``scale`` emulated seconds pass per wall second; the engine reports, and
its timing model computes, emulated seconds only."""

from __future__ import annotations

import asyncio
import time


class Clock:
    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError("time scale must be > 0")
        self.scale = scale
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Emulated seconds since the clock started."""
        return (time.monotonic() - self._t0) * self.scale

    def to_wall(self, emulated: float) -> float:
        return emulated / self.scale

    async def sleep(self, emulated: float) -> None:
        """Wait ``emulated`` seconds; a wait already due still yields to the event loop once,
        so that a loop behind its schedule (a decode after a stall) never runs its steps back to
        back while its streams' readers and the server wait."""
        await asyncio.sleep(max(emulated, 0.0) / self.scale)

    async def sleep_until(self, emulated_deadline: float) -> None:
        await self.sleep(emulated_deadline - self.now())
