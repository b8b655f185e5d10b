"""The ExpertPool's ZooKeeper store (EaaS §4.4: the monitor is ZooKeeper).

Under ``/matrixserve/v1/expertpools/<ns>/<pool>`` (:class:`~matrixserve.api.zk_layout.ExpertPoolPaths`):
the servers' ephemeral reports (``servers/<id>``), read every pass and watched (a server coming
or going wakes the pool at once: the failover's trigger), and the map: the pointer ``map`` and
the versions ``map/v<N>`` with one znode per layer. A version is written whole, then the pointer
switched (:class:`~matrixserve.domain.expertpool.plan.WriteMapVersion`; a change's later phases
are written ahead, before the pointer, and read back as the next step); reading goes the same
way round (pointer, version, layers), so a reader never sees half a version. A pool's subtree
goes with the pool (its finalizer), and the sweep removes those of pools that no longer exist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session
from matrixserve.domain.effects import ZnodeChange
from matrixserve.domain.expertpool.expertmap import ExpertMap

log = logging.getLogger("matrixserve.zookeeper")


CACHED_VERSIONS = 4  # [design] versions kept read per pool (the one in force, its successor)


class ExpertStore:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._watches: dict[tuple[str, str], list[Any]] = {}
        # per pool root, per version: the zxid that created its znode, its head's bytes and the
        # map read. A version's layers never change once written (only its head is rewritten,
        # when the walk's next phase is put in force): the same znode (its creating zxid), the
        # same layers, so a pass reads one znode per version, not one per layer; a pool made
        # again, or its map written again after ZooKeeper lost it, is another znode
        self._read: dict[str, dict[int, tuple[int, bytes, ExpertMap]]] = {}

    @property
    def connected(self) -> bool:
        return self.session.connected

    # ------------------------------------------------------------------ reads
    async def reports(self, namespace: str, pool: str) -> dict[str, zl.ExpertServerReport]:
        """The live servers' reports, by server id (an unreadable one left out, and said)."""
        paths = zl.ExpertPoolPaths(namespace, pool)

        def read() -> dict[str, zl.ExpertServerReport]:
            out = {}
            for server in self.session.children(paths.servers):
                raw = self.session.get(paths.server(server))
                if raw is None:
                    continue
                try:
                    out[server] = zl.ExpertServerReport.parse(raw)
                except ValueError:
                    log.warning("unreadable expert server report %s", paths.server(server))
            return out

        return await self.session.run(read)

    async def map_in_force(self, namespace: str, pool: str) -> tuple[ExpertMap | None, list[int]]:
        """The map the pointer names (None: no pointer yet, or it names nothing readable) and
        every version stored."""
        current, versions, _ = await self.in_force(namespace, pool)
        return current, versions

    async def in_force(
        self, namespace: str, pool: str
    ) -> tuple[ExpertMap | None, list[int], zl.ExpertMapPointer | None]:
        """:meth:`map_in_force` and the pointer it was read by (None: none, or unreadable):
        the settings in force the pointer carries to the clients."""
        paths = zl.ExpertPoolPaths(namespace, pool)

        def read() -> tuple[ExpertMap | None, list[int], zl.ExpertMapPointer | None]:
            versions = sorted(
                v
                for child in self.session.children(paths.map)
                if (v := zl.ExpertPoolPaths.version_of(child)) is not None
            )
            raw = self.session.get(paths.map)
            if raw is None:
                with self._lock:
                    self._read.pop(paths.root, None)  # no map: nothing of it to remember
                return None, versions, None
            try:
                pointer = zl.ExpertMapPointer.parse(raw)
            except ValueError as exc:
                log.warning("unreadable expert map pointer %s: %s", paths.map, exc)
                return None, versions, None
            if pointer.version == 0:
                return None, versions, pointer
            return self._version(paths, pointer.version), versions, pointer

        return await self.session.run(read)

    async def stored(self, namespace: str, pool: str, version: int) -> ExpertMap | None:
        """Version ``version`` as stored (a phase written ahead of the pointer), or None."""
        paths = zl.ExpertPoolPaths(namespace, pool)
        return await self.session.run(self._version, paths, version)

    def _version(self, paths: zl.ExpertPoolPaths, version: int) -> ExpertMap | None:
        raw, created = self.session.get_created(paths.version(version))
        if raw is None or created is None:
            log.warning("the expert map pointer %s names v%d, which is gone", paths.map, version)
            return None
        with self._lock:
            cached = self._read.get(paths.root, {}).get(version)
        if cached is not None and cached[0] == created:
            if cached[1] == raw:
                return cached[2]
            read = self._version_head(paths, version, raw, cached[2])
        else:
            read = self._version_whole(paths, version, raw)
        if read is not None:
            with self._lock:
                kept = self._read.setdefault(paths.root, {})
                kept[version] = (created, raw, read)
                for old in sorted(kept)[:-CACHED_VERSIONS]:
                    del kept[old]
        return read

    def _version_head(
        self, paths: zl.ExpertPoolPaths, version: int, raw: bytes, was: ExpertMap
    ) -> ExpertMap | None:
        """Version ``version`` with its head rewritten (``raw``) and its layers ``was``'s."""
        try:
            head = zl.ExpertMapVersion.parse(raw)
            layers = was.payloads()[1]
            return ExpertMap.of(head, layers)
        except ValueError as exc:
            log.warning("expert map v%d of %s unreadable: %s", version, paths.root, exc)
            return None

    def _version_whole(
        self, paths: zl.ExpertPoolPaths, version: int, raw: bytes
    ) -> ExpertMap | None:
        try:
            head = zl.ExpertMapVersion.parse(raw)
            layers = []
            for layer in range(head.layers):
                data = self.session.get(paths.layer(version, layer))
                if data is None:
                    log.warning("expert map v%d of %s has no layer %d", version, paths.root, layer)
                    return None
                layers.append(zl.ExpertMapLayer.parse(data))
            return ExpertMap.of(head, layers)
        except ValueError as exc:  # a pydantic error is one too
            log.warning("expert map v%d of %s unreadable: %s", version, paths.root, exc)
            return None

    async def warm(
        self, namespace: str, read_reports: bool, waiting: Sequence[str]
    ) -> tuple[dict[str, zl.WarmReport], dict[str, str]]:
        """The namespace's warm engines' reports (if ``read_reports``: a server may be
        obtained), and the assignments written for the claimed pods in ``waiting`` (pod -> the
        UID it is for)."""
        warm = zl.WarmPaths(namespace)

        def parsed(model: Any, path: str) -> Any:
            raw = self.session.get(path)
            try:
                return model.parse(raw) if raw else None
            except ValueError:
                log.warning("unreadable %s", path)
                return None

        def read() -> tuple[dict[str, zl.WarmReport], dict[str, str]]:
            pods = self.session.children(warm.pods) if read_reports else []
            reports = {p: r for p in pods if (r := parsed(zl.WarmReport, warm.pod(p)))}
            assigned = {
                p: a.pod_uid for p in waiting if (a := parsed(zl.Assignment, warm.assignment(p)))
            }
            return reports, assigned

        return await self.session.run(read)

    async def forget_assignments(self, namespace: str, pods: Sequence[str]) -> None:
        """Remove the assignments of a deleted pool's claimed pods (the namespace's WarmPool
        sweeps those of pods gone too; there may be none)."""
        warm = zl.WarmPaths(namespace)
        await self.session.run(
            self.session.apply, [zl.Delete(warm.assignment(pod)) for pod in pods]
        )

    # ------------------------------------------------------------------ writes
    async def apply(
        self, namespace: str, pool: str, change: ZnodeChange[zl.ExpertPoolPaths]
    ) -> None:
        """Write what a pool's plan asks (a version whole, the pointer, old versions pruned)."""
        if not self.connected:
            raise ConnectionError("ZooKeeper is not connected")
        ops = change.znodes(zl.ExpertPoolPaths(namespace, pool))
        await self.session.run(self.session.apply, ops)

    async def delete(self, namespace: str, pool: str) -> bool:
        """Remove the pool's subtree (its map; the servers' reports go with their sessions);
        True if it was there."""
        path = zl.ExpertPoolPaths(namespace, pool).root
        with self._lock:
            self._read.pop(path, None)
        return await self.session.run(self.session.delete, path, recursive=True)

    async def pools(self, namespaces: Sequence[str] = ()) -> list[tuple[str, str]]:
        """Every pool with a subtree, of ``namespaces`` (all if none)."""

        def listing() -> list[tuple[str, str]]:
            found = []
            for ns in self.session.children(zl.expert_pools_root()):
                if namespaces and ns not in namespaces:
                    continue
                found += [(ns, pool) for pool in self.session.children(zl.expert_pools_root(ns))]
            return found

        return await self.session.run(listing)

    async def prune_namespace(self, namespace: str) -> bool:
        """Remove a namespace's folder once it holds no pool."""
        return await self.session.run(self.session.prune, zl.expert_pools_root(namespace))

    # ------------------------------------------------------------------ watches
    async def arm(self, namespace: str, pool: str, wake: Callable[[], None]) -> bool:
        """Wake the pool when a server registers or goes, and when the pointer moves; False
        if not connected."""
        if not self.connected:
            return False
        paths = zl.ExpertPoolPaths(namespace, pool)
        await self.session.run(self.session.ensure, paths.servers)

        def fire(*_: Any) -> bool:
            wake()
            return True

        def watch() -> None:
            handles = [
                self.session.watch_children(paths.servers, fire),
                self.session.watch_data(paths.map, fire),
            ]
            with self._lock:
                old = self._watches.pop((namespace, pool), [])
                self._watches[(namespace, pool)] = handles
            for handle in old:
                self.session.cancel(handle)

        await self.session.run(watch)
        return True

    def disarm(self, namespace: str, pool: str) -> None:
        with self._lock:
            handles = self._watches.pop((namespace, pool), [])
        for handle in handles:
            self.session.cancel(handle)
