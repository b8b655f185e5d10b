"""The WarmPool's ZooKeeper store: the warm engines' reports of a namespace
(``/matrixserve/v1/warm/<ns>/pods``), watched so the namespace's pools wake when a warm pod comes
up or goes, the host-DRAM plans (``dram/``) read and changed by the pools' plans, and the
assignments left behind by pods that are gone (removed: an assignment is bound to its pod's UID,
so a later pod of the same name would ignore it anyway)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.coordination import NotEmptyError, Session
from matrixserve.domain.effects import ZnodeChange

log = logging.getLogger("matrixserve.zookeeper")


class WarmStore:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._watched: dict[str, list[Callable[[], None]]] = {}
        self._handles: dict[str, Any] = {}
        self._armed: dict[tuple[str, str], Callable[[], None]] = {}  # each pool's wake

    @property
    def connected(self) -> bool:
        return self.session.connected

    def _reports_sync(self, namespace: str) -> dict[str, zl.WarmReport]:
        paths = zl.WarmPaths(namespace)
        out = {}
        for pod in self.session.children(paths.pods):
            raw = self.session.get(paths.pod(pod))
            if raw is None:
                continue
            try:
                out[pod] = zl.WarmReport.parse(raw)
            except ValueError:
                log.warning("unreadable warm report %s", paths.pod(pod))
        return out

    async def reports(self, namespace: str) -> dict[str, zl.WarmReport]:
        return await self.session.run(self._reports_sync, namespace)

    async def ensure(self, namespace: str) -> None:
        paths = zl.WarmPaths(namespace)
        await self.session.run(self.session.ensure, paths.pods, paths.assignments)

    async def namespaces(self, namespaces: Sequence[str] = ()) -> list[str]:
        """The namespaces with a warm folder, of ``namespaces`` (all if none)."""

        def listing() -> list[str]:
            found = self.session.children(zl.warm_root())
            return [ns for ns in found if not namespaces or ns in namespaces]

        return await self.session.run(listing)

    async def delete_namespace(self, namespace: str) -> bool:
        """Remove the namespace's warm folder (reports, assignments, DRAM plans); True if it
        went. Not while one of its pools watches it (a pool created after the sweep listed the
        pools: its watch on the folder would end with it): the watch is armed under the same
        lock, so it is either seen here or armed after the folder went (and then waits for it).
        A report made during the deletion keeps the folder (the next sweep tries again)."""
        path = zl.WarmPaths(namespace).root

        def delete() -> bool:
            with self._lock:
                if namespace in self._watched:
                    return False
                try:
                    return self.session.delete(path, recursive=True)
                except NotEmptyError:
                    return False

        return await self.session.run(delete)

    async def sweep_assignments(self, namespace: str, pods: Mapping[str, str]) -> list[str]:
        """Delete the assignments whose pod (by name and UID, ``pods``: name -> UID of the
        namespace's engine pods) is gone; the pods whose assignment was removed."""
        paths = zl.WarmPaths(namespace)

        def sweep() -> list[str]:
            removed = []
            for pod in self.session.children(paths.assignments):
                raw = self.session.get(paths.assignment(pod))
                try:
                    uid = zl.Assignment.parse(raw).pod_uid if raw else None
                except ValueError:
                    uid = None
                if pods.get(pod) is None or pods.get(pod) != uid:
                    self.session.delete(paths.assignment(pod))
                    removed.append(pod)
            return removed

        return await self.session.run(sweep)

    async def dram_plans(self, namespace: str) -> dict[str, zl.DramPlan | None]:
        """The host-DRAM plans ``dram/`` holds, by server (None: unreadable, or gone meanwhile)."""
        paths = zl.WarmPaths(namespace)
        root = f"{paths.root}/dram"

        def read() -> dict[str, zl.DramPlan | None]:
            out: dict[str, zl.DramPlan | None] = {}
            for node in self.session.children(root):
                raw = self.session.get(f"{root}/{node}")
                try:
                    out[node] = zl.DramPlan.parse(raw) if raw else None
                except ValueError:
                    out[node] = None
            return out

        return await self.session.run(read)

    async def apply(self, namespace: str, pool: str, change: ZnodeChange[zl.WarmPaths]) -> None:
        """Write what a pool's plan asks of the namespace's warm folder (its host-DRAM plans)."""
        if not self.connected:
            raise ConnectionError("ZooKeeper is not connected")
        ops = change.znodes(zl.WarmPaths(namespace))
        await self.session.run(self.session.apply, ops)

    async def arm(self, namespace: str, pool: str, wake: Callable[[], None]) -> bool:
        """Wake the pool when a warm engine of its namespace reports or goes (:meth:`watch`);
        False if not connected."""
        if not self.connected:
            return False
        await self.ensure(namespace)
        self._armed[(namespace, pool)] = wake  # first: a watch that fails midway is disarmed
        await self.session.run(self.watch, namespace, wake)
        return True

    def disarm(self, namespace: str, pool: str) -> None:
        wake = self._armed.pop((namespace, pool), None)
        if wake is not None:
            self.unwatch(namespace, wake)

    def watch(self, namespace: str, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from a kazoo thread) when a warm engine reports or goes."""
        paths = zl.WarmPaths(namespace)
        with self._lock:
            if namespace in self._watched:
                self._watched[namespace].append(wake)
                return
            self._watched[namespace] = [wake]

        def fire(*_: Any) -> bool:
            with self._lock:
                callbacks = list(self._watched.get(namespace, []))
            for callback in callbacks:
                callback()
            return bool(callbacks)

        handle = self.session.watch_children(paths.pods, fire)
        with self._lock:
            self._handles[namespace] = handle

    def unwatch(self, namespace: str, wake: Callable[[], None]) -> None:
        with self._lock:
            callbacks = self._watched.get(namespace, [])
            if wake in callbacks:
                callbacks.remove(wake)
            if callbacks:
                return
            self._watched.pop(namespace, None)
            handle = self._handles.pop(namespace, None)
        if handle is not None:
            self.session.cancel(handle)
