"""The shared file service's bucket, shared by whoever reads from it now.

CloudMatrix-Infer Table 2 (001 T2): one DeepSeek-V3 instance cold-starts from the shared file
service in ≈320 s, eight together in ≈2,560 s: the bucket's effective bandwidth
(:data:`enginestub.calibration.SHARED_FILE_SERVICE_EFFECTIVE_BANDWIDTH`) is divided among the
instances loading at the time. So a load's time depends on who else loads *while it does*: a
fluid model. Each loader holds an ephemeral znode under
:func:`matrixserve.api.zk_layout.loaders_root` while it loads; each one watches their number and
moves ``1/n`` of a lone load's rate while ``n`` load. Eight members of a first setup that load
together each take eight lone loads; one of them restarted later loads alone.

(Until this module the operator put the number of instances it created together into each
pod's environment: a container restarted in place kept it and loaded eight times slower than it
would alone, and the recovery planner learned that slow load as a lone replacement's.)

Without ZooKeeper (an engine alone) the count is fixed: ``--concurrent-loaders``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from enginestub.engine.clock import Clock
from enginestub.engine.zkbridge import SessionBridge
from matrixserve import coordination
from matrixserve.api import zk_layout as zl

log = logging.getLogger("enginestub.bucket")


class Bucket:
    """A fixed number of loaders (this one included): an engine without ZooKeeper."""

    def __init__(self, loaders: int = 1) -> None:
        self.loaders = max(1, loaders)
        self.changed = asyncio.Event()  # set when :attr:`loaders` changes

    def set_loaders(self, n: int) -> None:
        n = max(1, n)
        if n != self.loaders:
            self.loaders = n
            self.changed.set()

    async def join(self) -> None:
        """This engine starts reading from the bucket."""

    async def leave(self) -> None:
        """This engine stopped reading (on every path: done, failed, cancelled)."""

    async def read(self, clock: Clock, alone: float) -> float:
        """Read what takes ``alone`` emulated seconds with the bucket to itself, sharing it
        with the other loaders as their number changes. Returns the mean number of loaders
        over the read (its time over ``alone``); 1 for nothing to read."""
        if alone <= 0:
            return 1.0
        await self.join()
        try:
            started, left = clock.now(), alone  # ``left`` in lone seconds
            while left > 1e-9:
                n = self.loaders
                self.changed.clear()
                since = clock.now()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), clock.to_wall(left * n))
                left -= (clock.now() - since) / n
            return (clock.now() - started) / alone
        finally:
            await self.leave()


class ZkBucket(Bucket):
    """The loaders are the znodes under :func:`zl.loaders_root`: ours (``name``) is owned by
    our session while we read; a watch keeps :attr:`loaders` their number. ZooKeeper failing
    does not stop a load: it goes on at the last number seen (at least ourselves)."""

    def __init__(self, zk: coordination.Session, bridge: SessionBridge, name: str) -> None:
        super().__init__(1)
        self.zk, self.bridge = zk, bridge
        self.path = zl.loader_path(name)
        self._watch: Any = None
        self._reading = False

    def _on_children(self, children: list[str]) -> None:
        if self._reading:  # ourselves at least, while our own znode is not seen yet
            self.set_loaders(len(children) + (0 if self.path.rsplit("/", 1)[1] in children else 1))

    async def join(self) -> None:
        self._reading = True

        def write() -> None:
            self.zk.ensure(zl.loaders_root())
            self.zk.own(self.path, b"")

        try:
            await self.zk.run(write)
        except coordination.ERRORS as exc:
            log.warning("not counted among the bucket's loaders (%s)", type(exc).__name__)
        if self._watch is None:
            self._watch = self.zk.watch_children(
                zl.loaders_root(), lambda c: self.bridge.call(self._on_children, list(c))
            )
        else:  # read the number afresh: it changed while we did not read
            with contextlib.suppress(*coordination.ERRORS):
                self._on_children(await self.zk.run(self.zk.children, zl.loaders_root()))

    async def leave(self) -> None:
        self._reading = False
        self.loaders = 1
        with contextlib.suppress(*coordination.ERRORS):
            await asyncio.shield(self.zk.run(self.zk.delete, self.path))
