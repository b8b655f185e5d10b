"""The serving loop's heartbeat and its watchdog (detection tier "hang"; xDeepServe §6.1:
each DP master "only responds to heartbeats when the loop is active", so a stalled loop is a
fault even while the process and its HTTP server are alive).

- **Beats** come from the serving loop only: an emulated loop that ticks every
  ``--loop-beat-interval`` emulated s and stops while the loop is hung, every decode iteration
  and every prefill completion. Nothing else beats (not the HTTP server, not the health writer).
- **The watchdog** is a task of its own, outside the loop: once no beat has come for the hang
  bound (``--hang-bound`` emulated s, never under :data:`~enginestub.calibration.HANG_WALL_FLOOR_SECONDS`
  of wall time) it declares the engine hung, a :class:`~matrixserve.api.zk_layout.EngineFault`
  of kind ``hang``, and says so at once (``on_change``: the resident process writes the health).
  The next beat clears it, and says so too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from enginestub import calibration as cal
from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig
from matrixserve.api import zk_layout as zl

# Wall s the watchdog waits, on finding the beat late, before it believes it: the watchdog and
# the beat share one event loop, and after a pause of the whole loop (a collection, a starved
# CPU) the watchdog may run before a beat that is due; a loop that is not hung beats meanwhile.
RECHECK_WALL_SECONDS = 0.05


def hang_bound(config: EngineConfig) -> float:
    """Emulated seconds without a beat that make a hang: ``--hang-bound``, never under
    :data:`~enginestub.calibration.HANG_WALL_FLOOR_SECONDS` of wall time."""
    return max(config.hang_bound, cal.HANG_WALL_FLOOR_SECONDS * config.time_scale)


class Heartbeat:
    def __init__(self, config: EngineConfig, clock: Clock, not_hung: asyncio.Event) -> None:
        self.config = config
        self.clock = clock
        self.bound = hang_bound(config)
        self._not_hung = not_hung  # the serving loop runs while it is set
        self.last_beat = clock.now()  # emulated
        self.last_beat_wall = time.time()  # epoch s: the health's ``loopBeat``
        self.hang: zl.EngineFault | None = None  # set by the watchdog, cleared by a beat
        self.declared = asyncio.Event()  # set while :attr:`hang` is
        self.on_change: Callable[[], None] = lambda: None

    def beat(self) -> None:
        """The serving loop made progress."""
        self.last_beat = self.clock.now()
        self.last_beat_wall = time.time()
        if self.hang is not None:
            self.hang = None
            self.declared.clear()
            self.on_change()

    async def until_running_or_declared(self) -> None:
        """Until the serving loop runs, or its hang is declared: a request that comes to a hung
        loop waits, as on hardware, but once the engine knows it is hung it answers (503)."""
        if self._not_hung.is_set() or self.hang is not None:
            return
        waits = [asyncio.ensure_future(e.wait()) for e in (self._not_hung, self.declared)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    def silent_for(self) -> float:
        """Emulated seconds since the last beat."""
        return self.clock.now() - self.last_beat

    async def tick(self) -> None:
        """The emulated serving loop: one beat a beat interval, none while it is hung."""
        while True:
            await self._not_hung.wait()
            self.beat()
            await self.clock.sleep(self.config.loop_beat_interval)

    async def watch(self) -> None:
        """The watchdog: wakes when the bound after the last beat is due, and declares a hang if
        no beat came by then (after :data:`RECHECK_WALL_SECONDS`, see there)."""
        while True:
            left = self.bound - self.silent_for()
            if left > 0:
                await asyncio.sleep(self.clock.to_wall(left))
                continue
            if self.hang is not None:  # declared: a beat clears it; look again a bound later
                await asyncio.sleep(self.clock.to_wall(self.bound))
                continue
            await asyncio.sleep(RECHECK_WALL_SECONDS)
            silent = self.silent_for()
            if silent >= self.bound:
                self.hang = zl.EngineFault(
                    kind=zl.EngineFaultKind.HANG,
                    since=self.last_beat_wall,  # the loop stopped then: detection counts from it
                    detail=(
                        f"serving loop: no beat for {silent:.2f} s (emulated; the hang bound "
                        f"is {self.bound:g} s)"
                    ),
                )
                self.declared.set()
                self.on_change()
