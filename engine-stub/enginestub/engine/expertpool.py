"""What an expert server and an attention client share of their pool in ZooKeeper: the session,
the map in force and, for a client, the servers' reports (EaaS §3.1, §4.4: "a central monitor
... broadcasts when a rank comes online or goes offline"; ZooKeeper is that monitor).

The map (``matrixserve.api.zk_layout.ExpertPoolPaths``) is read as its writer wrote it: the
pointer, then the whole version it names (``map/v<N>`` and every ``map/v<N>/<layer>``); a reader
never uses half a version. An expert server needs only its own rows: when the version's head
says they are unchanged since the version it last read (``rowsAt``), it reads the head alone
(the new table and phase; a failover's or a newcomer's versions leave every other server's rows
as they were), else the whole version. A version whose znodes are not all there yet, or no longer (it was
superseded and deleted while being read), is read again when the pointer moves or after a
second. The pointer also carries settings of the pool in force that need no new version (its
failover timeout, :attr:`PoolSession.failover_ms`), followed as it is rewritten. Callbacks come
to the event loop (:class:`~enginestub.engine.zkbridge.SessionBridge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from enginestub.engine.config import EngineConfig
from enginestub.engine.zkbridge import CONNECT_ATTEMPT_SECONDS, CONNECT_PAUSE_SECONDS, SessionBridge
from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session

log = logging.getLogger("enginestub.expertpool")
REREAD_SECONDS = 1.0  # wall s before a version read half is read again


Row = tuple[tuple[int, ...], tuple[int, ...]]  # one layer of a server: held, disabled


@dataclass(frozen=True)
class ExpertMap:
    """One version of the map: its server table and every layer's slots, or (``mine``) for
    one server, its rows alone (``layers`` empty)."""

    version: zl.ExpertMapVersion
    layers: tuple[zl.ExpertMapLayer, ...]
    mine: tuple[str, tuple[Row, ...]] | None = None

    @property
    def number(self) -> int:
        return self.version.version

    def index(self, server: str) -> int | None:
        servers = self.version.servers
        return servers.index(server) if server in servers else None

    def rows(self, server: str) -> tuple[Row, ...] | None:
        """Per layer, the experts ``server`` holds and those of them disabled; None when it is
        not in the table."""
        index = self.index(server)
        if index is None:
            return None
        if self.mine is not None:
            whose, rows = self.mine
            if whose != server:
                raise ValueError(f"map v{self.number} was read for {whose}, not {server}")
            return rows

        def row(lists: list[list[int]]) -> tuple[int, ...]:
            return tuple(lists[index]) if index < len(lists) else ()

        return tuple((row(layer.slots), row(layer.disabled)) for layer in self.layers)

    @cached_property
    def routes(self) -> tuple[list[list[int]], ...]:
        """Per layer, per expert, the server indices that hold it enabled."""
        if self.mine is not None:
            raise ValueError(f"map v{self.number} was read for {self.mine[0]} alone")
        return tuple(layer.routes(self.version.experts) for layer in self.layers)


class PoolSession:
    """The pool's paths and one ZooKeeper session, with the map in force followed."""

    def __init__(self, config: EngineConfig, own: str | None = None) -> None:
        """``own``: an expert server's id, whose rows alone it needs (a client: None)."""
        assert config.expert_pool is not None
        assert config.zookeeper is not None
        self.config = config
        self.own = own
        self.paths = zl.ExpertPoolPaths(*config.expert_pool.split("/"))
        self.zk = Session(config.zookeeper, timeout=10.0, auth=config.zookeeper_auth)
        self.bridge = SessionBridge(self.zk)
        self.map: ExpertMap | None = None
        self.map_changed = asyncio.Event()  # set when :attr:`map` is a new version
        self._pointer = 0  # the version the pointer names, as last seen
        self._pointer_at = 0.0  # and when that version was put in force (its ``at``)
        # The pointer deleted (or back at 0) after a map was in force: the pool is gone (its
        # ExpertPool deleted); the last map is kept (a held iteration ends in its bound)
        self.gone = False
        # the pool's failover timeout (emulated ms) the pointer carries; None: it carries none
        self.failover_ms: int | None = None
        self._pointer_moved = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self, waiting: Callable[[Exception], None]) -> None:
        """Connect (retrying: ZooKeeper may come later than the pod), the servers' folder made
        where missing as part of each try; then follow the map's pointer."""
        self.bridge.start()
        await self.zk.connect(
            attempt_timeout=CONNECT_ATTEMPT_SECONDS,
            pause=CONNECT_PAUSE_SECONDS,
            then=lambda: self.zk.ensure(self.paths.servers),
            on_retry=waiting,
        )

        def on_pointer(data: bytes | None, _stat: object) -> None:
            self.bridge.call(self._pointer_is, data)

        self.zk.watch_data(self.paths.map, on_pointer)
        self._tasks.append(asyncio.create_task(self._follow_map(), name="expert-map"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.zk.stop()

    def _pointer_is(self, data: bytes | None) -> None:
        pointer = zl.ExpertMapPointer(version=0)
        if data:
            try:
                pointer = zl.ExpertMapPointer.parse(data)
            except ValueError:
                log.error("ignoring an unreadable expert map pointer")
                return
        if pointer.failover_ms != self.failover_ms:
            log.info("the pool's failover timeout: %s ms", pointer.failover_ms)
        self.failover_ms = pointer.failover_ms
        self._pointer = pointer.version
        self._pointer_at = pointer.at
        gone = pointer.version == 0 and self.map is not None
        if gone and not self.gone:
            log.warning("the pool's map pointer is gone (its ExpertPool deleted?)")
        self.gone = gone
        self._pointer_moved.set()

    async def _follow_map(self) -> None:
        """Read each version the pointer names, whole; a half one again a second later."""
        while True:
            await self._pointer_moved.wait()
            self._pointer_moved.clear()
            wanted = self._pointer
            # the version in force already (a pointer rewritten for its settings); one of the
            # same number put in force at another time is another pool's (deleted, made again)
            if wanted == 0 or (
                self.map is not None
                and self.map.number == wanted
                and self.map.version.at == self._pointer_at
            ):
                continue
            try:
                read = await self.zk.run(self._read, wanted, self.map)
            except Exception as exc:  # the session's errors: read again later
                log.warning("expert map v%d not read (%s); again", wanted, type(exc).__name__)
                read = None
            if read is None:
                await asyncio.sleep(REREAD_SECONDS)
                self._pointer_moved.set()
                continue
            if self._pointer == wanted:  # not superseded while it was read
                self.map = read
                log.info("expert map v%d in force (%s)", wanted, read.version.reason or "-")
                self.map_changed.set()

    def _read(self, number: int, held: ExpertMap | None = None) -> ExpertMap | None:
        """Version ``number`` whole (or, for a server whose rows it leaves as ``held`` has them,
        its head with those rows), or None if any of its znodes is missing or unreadable."""
        raw = self.zk.get(self.paths.version(number))
        if raw is None:
            return None
        try:
            version = zl.ExpertMapVersion.parse(raw)
            if (own := self.own) is not None and own not in version.servers:
                return ExpertMap(version, ())  # out of the table: no rows to read
            # its rows as ``held`` has them: the same stamp, within one history of the map (its
            # numbers start again in another)
            since = version.rows_at.get(own or "", 0)
            if (
                own is not None
                and held is not None
                and since
                and held.version.origin == version.origin != 0
                and held.version.rows_at.get(own) == since
                and (rows := held.rows(own)) is not None
            ):
                return ExpertMap(version, (), (own, rows))
            layers = []
            for layer in range(version.layers):
                data = self.zk.get(self.paths.layer(number, layer))
                if data is None:
                    return None
                layers.append(zl.ExpertMapLayer.parse(data))
        except ValueError as exc:
            log.error("expert map v%d unreadable: %s", number, exc)
            return None
        if self.own is not None:  # a server keeps its rows alone
            whole = ExpertMap(version, tuple(layers))
            rows = whole.rows(self.own)
            return ExpertMap(version, (), (self.own, rows)) if rows is not None else whole
        return ExpertMap(version, tuple(layers))
