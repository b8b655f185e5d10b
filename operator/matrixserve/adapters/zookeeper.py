"""The ZooKeeper adapter: one kazoo client for the operator, a snapshot per group, idempotent
writes, watches that wake the group's reconciler, and subtree cleanup.

Session handling (Patroni's habit: step down when the store is unreachable): the adapter tracks
the kazoo state; while SUSPENDED or LOST the snapshot says ``connected=False`` and the planner
does nothing destructive. The operator owns no ephemeral znodes, so LOST needs no re-registration
on the operator side; watches are re-armed by kazoo on reconnection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError, NotEmptyError
from kazoo.recipe.watchers import ChildrenWatch

from matrixserve.api import zk_layout as zl
from matrixserve.domain import pdgroup as pd

log = logging.getLogger("matrixserve.zookeeper")


class ZkAdapter:
    def __init__(self, hosts: str, timeout: float = 10.0) -> None:
        self.hosts = hosts
        self.client = KazooClient(hosts=hosts, timeout=timeout)
        self.state = "CONNECTING"
        self._lock = threading.Lock()
        self._watched: dict[str, list[Any]] = {}
        self.on_state: Callable[[str], None] = lambda state: None
        self.client.add_listener(self._listener)

    def _listener(self, state: str) -> None:
        self.state = {KazooState.CONNECTED: "CONNECTED", KazooState.SUSPENDED: "SUSPENDED"}.get(
            state, "LOST"
        )
        self.on_state(self.state)

    @property
    def connected(self) -> bool:
        return self.client.connected and self.state == "CONNECTED"

    async def start(self, timeout: float = 15.0) -> None:
        try:
            await asyncio.to_thread(self.client.start, timeout)
        except Exception:
            await asyncio.to_thread(self.client.stop)  # leave no half-started client retrying
            raise
        self.state = "CONNECTED"
        self.on_state(self.state)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.stop)
            await asyncio.to_thread(self.client.close)

    # ------------------------------------------------------------------ reads
    def _read_sync(self, paths: zl.GroupPaths) -> pd.ZkView:
        zk = self.client

        def children(path: str) -> list[str]:
            try:
                return list(zk.get_children(path))
            except NoNodeError:
                return []

        def data(path: str) -> bytes | None:
            try:
                raw, _ = zk.get(path)
            except NoNodeError:
                return None
            return raw if raw else None

        def parse(model: Any, path: str) -> Any:
            raw = data(path)
            if raw is None:
                return None
            try:
                return model.parse(raw)
            except ValueError:
                log.warning("unreadable znode %s", path)
                return None

        reports = {
            n: r for n in children(paths.reports) if (r := parse(zl.Report, paths.report(n)))
        }
        links = {}
        for child in children(paths.links):
            if "--" in child and (link := parse(zl.Link, f"{paths.links}/{child}")):
                links[(link.prefill, link.decode)] = link
        health = {
            n: h for n in children(paths.health) if (h := parse(zl.Health, paths.health_of(n)))
        }
        return pd.ZkView(
            connected=True,
            reports=reports,
            roce_map=parse(zl.RoceMap, paths.roce_map),
            init_order=parse(zl.InitOrder, paths.init_order),
            links=links,
            health=health,
            decode_meta=parse(zl.DecodeMeta, paths.decode_meta),
            entrances=frozenset(children(paths.entrances)),
            removed=frozenset(children(paths.removed)),
        )

    async def snapshot(self, namespace: str, group: str) -> pd.ZkView:
        if not self.connected:
            return pd.ZkView(connected=False)
        try:
            view = await asyncio.to_thread(self._read_sync, zl.GroupPaths(namespace, group))
        except Exception as exc:  # connection loss mid-read: plan as disconnected
            log.warning("ZooKeeper read of %s/%s failed: %s", namespace, group, exc)
            return pd.ZkView(connected=False)
        return view if self.connected else pd.ZkView(connected=False)

    # ------------------------------------------------------------------ writes
    def _put(self, path: str, value: bytes) -> None:
        try:
            self.client.set(path, value)
        except NoNodeError:
            try:
                self.client.create(path, value, makepath=True)
            except NodeExistsError:
                self.client.set(path, value)

    def _delete(self, path: str, recursive: bool = False) -> None:
        with contextlib.suppress(NoNodeError):
            self.client.delete(path, recursive=recursive)

    def _apply_sync(self, paths: zl.GroupPaths, action: pd.Action) -> None:
        match action:
            case pd.WriteRoceMap(roce_map=m):
                self._put(paths.roce_map, m.dump())
            case pd.WriteInitOrder(order=o):
                self._put(paths.init_order, o.dump())
            case pd.WriteDecodeMeta(meta=m):
                self._put(paths.decode_meta, m.dump())
            case pd.SetEntrance(entrance=e):
                self._put(paths.entrance(e.instance), e.dump())
            case pd.DeleteEntrance(name=n):
                self._delete(paths.entrance(n))
            case pd.MarkRemoved(removal=r):
                self._put(paths.removed_of(r.instance), r.dump())
            case pd.EraseInstance(links=links):
                for p, d in links:
                    self._delete(paths.link(p, d))
            case pd.ClearRemoved(name=n):
                self._delete(paths.removed_of(n))
            case _:
                raise TypeError(f"not a ZooKeeper action: {action!r}")

    async def apply(self, namespace: str, group: str, action: pd.Action) -> None:
        if not self.connected:
            raise ConnectionError("ZooKeeper is not connected")
        await asyncio.to_thread(self._apply_sync, zl.GroupPaths(namespace, group), action)

    async def ensure_group(self, namespace: str, group: str) -> None:
        paths = zl.GroupPaths(namespace, group)

        def make() -> None:
            for folder in paths.all_folders():
                self.client.ensure_path(folder)

        await asyncio.to_thread(make)

    async def delete_group(self, namespace: str, group: str) -> bool:
        """Remove the group's whole subtree; True if there was one."""
        path = zl.group_path(namespace, group)

        def delete() -> bool:
            existed = bool(self.client.exists(path))
            if existed:
                self.client.delete(path, recursive=True)
            parent = path.rsplit("/", 1)[0]  # the namespace folder: pruned once empty
            with contextlib.suppress(NoNodeError, NotEmptyError):
                self.client.delete(parent)
            return existed

        return await asyncio.to_thread(delete)

    # ------------------------------------------------------------------ watches
    def watch_group(self, namespace: str, group: str, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from a kazoo thread) whenever reports, links, health or the map change."""
        paths = zl.GroupPaths(namespace, group)
        key = paths.root
        with self._lock:
            if key in self._watched:
                self._watched[key].append(wake)
                return
            self._watched[key] = [wake]

        def fire(*_: Any) -> bool:
            with self._lock:
                callbacks = list(self._watched.get(key, []))
            for callback in callbacks:
                callback()
            return key in self._watched

        for folder in (paths.reports, paths.links, paths.health, paths.entrances, paths.removed):
            self.client.ensure_path(folder)
            ChildrenWatch(self.client, folder, fire, send_event=True)
        self.client.DataWatch(paths.roce_map, fire)

    def unwatch_group(self, namespace: str, group: str) -> None:
        with self._lock:
            self._watched.pop(zl.group_path(namespace, group), None)
