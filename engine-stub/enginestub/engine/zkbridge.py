"""What the engine's ZooKeeper users share (the resident process, a worker of an instance of
several pods, a warm engine): kazoo calls back from its own threads, so callbacks are handed to
the event loop; SUSPENDED pauses writes; after LOST (our ephemerals are gone) or a reconnection,
what the user registered is written again, retried every second until it is
(:meth:`SessionBridge.keep_registered`); what it keeps fresh, written every interval and at once
when it changed (:meth:`SessionBridge.keep_fresh`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from matrixserve import coordination
from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session, SessionState

log = logging.getLogger("enginestub.zookeeper")
CONNECT_ATTEMPT_SECONDS = 15.0
CONNECT_PAUSE_SECONDS = 2.0


async def join_group(
    zk: Session, paths: zl.GroupPaths, waiting: Callable[[Exception], None]
) -> None:
    """Connect (retrying: ZooKeeper may come later than the pod, ``waiting`` told each time),
    and make the group's folders where missing as part of each try (a session may drop right
    away)."""
    await zk.connect(
        attempt_timeout=CONNECT_ATTEMPT_SECONDS,
        pause=CONNECT_PAUSE_SECONDS,
        then=lambda: zk.ensure(*paths.all_folders()),
        on_retry=waiting,
    )


RETRY_SECONDS = 1.0  # between two failed writes of what a user keeps registered


class SessionBridge:
    def __init__(self, zk: Session) -> None:
        self.zk = zk
        self.loop: asyncio.AbstractEventLoop | None = None
        self.suspended = threading.Event()  # no writes while set
        self.reregister = asyncio.Event()  # set (on the loop) when our ephemerals must be rewritten

    def start(self) -> None:
        """From the event loop that runs the user: state changes and callbacks come to it."""
        self.loop = asyncio.get_running_loop()
        self.zk.add_listener(self._on_state)

    def call(self, fn: Any, *args: Any) -> None:
        """Run a callback from a kazoo thread on our event loop."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def _on_state(self, state: SessionState) -> None:
        if state is SessionState.SUSPENDED:
            self.suspended.set()
        elif state is SessionState.LOST:
            self.suspended.set()
            self.call(self.reregister.set)
        else:
            self.suspended.clear()
            self.call(self.reregister.set)

    async def keep_registered(
        self, write: Callable[[], Awaitable[None]], what: str, *, now: bool = False
    ) -> None:
        """``write()`` (at once if ``now``, then) after every (re)connection, retried every
        second until it works (a folder may not be there yet: on a server that lost its data,
        the operator makes the group's folders again). While the session is suspended nothing is
        tried: the reconnection that ends it asks again."""
        if now:
            await self.until_written(write, what)
        while True:
            await self.reregister.wait()
            # Cleared after the wait, before the write: a reconnection during the write asks for
            # one more (the write reads the state afresh), none is lost.
            self.reregister.clear()
            await self.until_written(write, what)

    async def until_written(self, write: Callable[[], Awaitable[None]], what: str) -> None:
        """``write()``, retried every second until it works; given up while the session is
        suspended (the reconnection that ends it asks :meth:`keep_registered` to write)."""
        while not self.suspended.is_set():
            try:
                await write()
                return
            except Exception as exc:  # kazoo's errors, a folder not there yet
                log.info("%s not written yet (%s); retrying", what, type(exc).__name__)
                await asyncio.sleep(RETRY_SECONDS)

    async def keep_fresh(
        self,
        dirty: asyncio.Event,
        interval: float,
        write: Callable[[], Awaitable[None]],
        what: str,
    ) -> None:
        """``write()`` every ``interval`` wall s, and at once when ``dirty`` is set: the mark is
        cleared before the write reads the state, so a change during a write is written next,
        not left for the interval. A failed write is logged; the next one, or
        :meth:`keep_registered` after a reconnection, writes it again."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await dirty.wait()
            dirty.clear()
            try:
                await write()
            except coordination.ERRORS as exc:
                log.warning("%s not written (%s); retrying", what, type(exc).__name__)
