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

    async def read(self, clock: Clock, alone: float) -> None:
        """Read what takes ``alone`` emulated seconds with the bucket to itself, sharing it
        with the other loaders as their number changes."""
        if alone <= 0:
            return
        try:
            await self.join()
            left = alone  # in lone seconds
            while left > 1e-9:
                n = self.loaders
                self.changed.clear()
                since = clock.now()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), clock.to_wall(left * n))
                left -= (clock.now() - since) / n
        finally:
            await self.leave()


class ZkBucket(Bucket):
    """The loaders are the znodes under :func:`zl.loaders_root`: ours (``name``) is owned by
    our session while we read; a watch keeps :attr:`loaders` their number. ZooKeeper failing
    does not stop a load: it goes on at the last number seen (at least ourselves). Our znode
    goes when the read ends, whatever ends it; a delete ZooKeeper did not take is retried
    until it is (or our session, and with it the znode, is gone): a reader left behind would
    slow every later load of the cluster."""

    def __init__(self, zk: coordination.Session, bridge: SessionBridge, name: str) -> None:
        super().__init__(1)
        self.zk, self.bridge = zk, bridge
        self.path = zl.loader_path(name)
        self._name = self.path.rsplit("/", 1)[1]
        self._watch: Any = None  # while we read
        self._reading = False
        self._rewrite: asyncio.Task[None] | None = None
        self._cleanup: asyncio.Task[None] | None = None

    def _on_children(self, children: list[str]) -> None:
        if self._reading:  # ourselves at least, while our own znode is not seen yet
            self.set_loaders(len(children) + (0 if self._name in children else 1))

    def _write(self) -> None:
        self.zk.ensure(zl.loaders_root())
        self.zk.own(self.path, b"")

    def _delete_own(self) -> None:
        """Delete our znode if it is ours (a process of the same instance name that came
        after us owns it otherwise: not ours to delete)."""
        stat = self.zk.client.exists(self.path)
        if stat is not None and stat.ephemeralOwner == self.zk.session_id:
            self.zk.client.delete(self.path, version=stat.version)

    async def join(self) -> None:
        self._reading = True
        if self._cleanup is not None:
            self._cleanup.cancel()
        try:
            await self.zk.run(self._write)
            # the number now (the watch's first call), then each change while we read
            self._watch = await self.zk.run(
                self.zk.watch_children,
                zl.loaders_root(),
                lambda c: self.bridge.call(self._on_children, list(c)),
            )
        except coordination.ERRORS as exc:
            log.warning("not counted among the bucket's loaders (%s)", type(exc).__name__)
        # a session renewed while we read has lost our znode: written again (as the resident
        # process's own ephemerals are)
        self._rewrite = asyncio.create_task(
            self.bridge.keep_registered(lambda: self.zk.run(self._write), "loader znode"),
            name="bucket-reader",
        )

    async def leave(self) -> None:
        self._reading = False
        self.loaders = 1
        if self._rewrite is not None:
            self._rewrite.cancel()
        if self._watch is not None:  # the other readers' comings and goings are not ours now
            self.zk.cancel(self._watch)
            self._watch = None
        try:
            await asyncio.shield(self.zk.run(self._delete_own))
        except coordination.ERRORS as exc:
            log.info("our loader znode not deleted yet (%s): retrying", type(exc).__name__)
            self._cleanup = asyncio.create_task(self._delete_later(), name="bucket-leave")

    async def _delete_later(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(*coordination.ERRORS):
                await self.zk.run(self._delete_own)
                return
