"""The PDGroup's ZooKeeper store: its subtree (``/matrixserve/v1/groups/<ns>/<group>``, P/D-Serve
§3.2-3.4; layout in :mod:`matrixserve.api.zk_layout`) read as one snapshot, changed by the
planner's znode actions, watched so the group's reconciler wakes, and removed on deletion.

Built on the shared session (:mod:`matrixserve.coordination`): while it is not connected
(SUSPENDED or LOST) a snapshot says ``connected=False`` and the planner plans nothing
destructive. The operator owns no ephemeral znodes, so LOST needs no re-registration here;
watches are re-armed by kazoo on reconnection. ExpertPool gets a store of its own beside this
one.

With ZooKeeper's identity configured, a group's subtree made before it stays open until the
handler closes it (:meth:`GroupStore.close`: once every pod of the group carries the credential).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.coordination import (
    CallTimeout,
    NotEmptyError,
    Restricted,
    Session,
    ZooKeeperError,
)
from matrixserve.domain.effects import ZnodeChange
from matrixserve.domain.pdgroup import ZkView

log = logging.getLogger("matrixserve.zookeeper")
DELETE_TRIES = 10
_UNSEEN = object()
# What a store call raises when ZooKeeper fails under it (worth a retry soon).
UNAVAILABLE = (ZooKeeperError, CallTimeout, ConnectionError)


def _verdict(data: bytes | None) -> Any:
    """What a health znode says that the plan acts on (state, faults, unhealthy sub-links,
    incarnation, a drain done), without what every refresh changes (``seq``, ``ts``,
    ``loopBeat``, the load counters)."""
    if data is None:
        return None
    try:
        health = zl.Health.parse(data)
    except ValueError:
        return b"unreadable"
    return (
        health.state,
        health.incarnation,
        health.draining and health.inflight == 0,  # drained, it may leave the map
        tuple((f.kind, tuple(f.dies)) for f in health.faults),
        tuple((link.peer, link.device, link.state, link.down_at) for link in health.links),
    )


def _parsed(model: Any, raw: bytes | None) -> Any:
    """A payload, or None if absent or unreadable (a newer writer's, a torn one)."""
    if raw is None:
        return None
    try:
        return model.parse(raw)
    except ValueError:
        return None


class GroupStore:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._watched: dict[str, list[Callable[[], None]]] = {}
        self._epochs: dict[str, int] = {}  # which watch registration is the live one
        self._handles: dict[str, list[Any]] = {}  # the session's watches, cancelled at unwatch
        # A data watch per health znode (by group, by instance), and the verdict each last
        # carried: a health turning Faulty wakes the group at once, a mere refresh does not.
        self._health: dict[str, dict[str, Any]] = {}
        self._verdicts: dict[str, dict[str, Any]] = {}
        self._epoch = 0

    @property
    def connected(self) -> bool:
        return self.session.connected

    # ------------------------------------------------------------------ reads
    def _read_sync(self, paths: zl.GroupPaths) -> ZkView:
        zk = self.session

        def parse(model: Any, path: str) -> Any:
            raw = zk.get(path)
            if raw is None:
                return None
            try:
                return model.parse(raw)
            except ValueError:
                log.warning("unreadable znode %s", path)
                return None

        reports = {
            n: r for n in zk.children(paths.reports) if (r := parse(zl.Report, paths.report(n)))
        }
        links = {}
        for child in zk.children(paths.links):
            if "--" in child and (link := parse(zl.Link, f"{paths.links}/{child}")):
                links[(link.prefill, link.decode)] = link
        health = {
            n: h for n in zk.children(paths.health) if (h := parse(zl.Health, paths.health_of(n)))
        }
        return ZkView(
            connected=True,
            reports=reports,
            roce_map=parse(zl.RoceMap, paths.roce_map),
            init_order=parse(zl.InitOrder, paths.init_order),
            links=links,
            health=health,
            decode_meta=parse(zl.DecodeMeta, paths.decode_meta),
            entrances=frozenset(zk.children(paths.entrances)),
            removed=frozenset(zk.children(paths.removed)),
            draining={
                n: d
                for n in zk.children(paths.draining)
                if (d := parse(zl.Drain, paths.draining_of(n)))
            },
            present=zk.exists(paths.reports),
            entrances_present=zk.exists(paths.entrances),
        )

    async def snapshot(self, namespace: str, group: str) -> ZkView:
        if not self.connected:
            return ZkView(connected=False)
        try:
            view = await self.session.run(self._read_sync, zl.GroupPaths(namespace, group))
        except Exception as exc:  # connection loss mid-read: plan as disconnected
            log.warning("ZooKeeper read of %s/%s failed: %s", namespace, group, exc)
            return ZkView(connected=False)
        return view if self.connected else ZkView(connected=False)

    # ------------------------------------------------------------------ writes
    async def apply(self, namespace: str, group: str, action: ZnodeChange[zl.GroupPaths]) -> None:
        if not self.connected:
            raise ConnectionError("ZooKeeper is not connected")
        ops = action.znodes(zl.GroupPaths(namespace, group))
        await self.session.run(self.session.apply, ops)

    # ------------------------------------------------------------------ warm pods
    def _warm_sync(
        self, namespace: str, model: str | None, waiting: Sequence[str]
    ) -> tuple[dict[str, zl.WarmReport], list[zl.ForkSource], dict[str, str]]:
        warm = zl.WarmPaths(namespace)
        reports: dict[str, zl.WarmReport] = {}
        sources: list[zl.ForkSource] = []
        if model is not None:
            for pod in self.session.children(warm.pods):
                found = _parsed(zl.WarmReport, self.session.get(warm.pod(pod)))
                if found is not None:
                    reports[pod] = found
            root = zl.fork_sources_root(namespace)
            for key in self.session.children(root):
                for leaf in self.session.children(f"{root}/{key}"):
                    source = _parsed(zl.ForkSource, self.session.get(f"{root}/{key}/{leaf}"))
                    if source is not None and source.model == model:
                        sources.append(source)
        assigned = {}
        for pod in waiting:
            found_assignment = _parsed(zl.Assignment, self.session.get(warm.assignment(pod)))
            if found_assignment is not None:
                assigned[pod] = found_assignment.pod_uid
        return reports, sources, assigned

    async def warm(
        self, namespace: str, model: str | None, waiting: Sequence[str]
    ) -> tuple[dict[str, zl.WarmReport], list[zl.ForkSource], dict[str, str]]:
        """The namespace's warm engines' reports and the live fork sources of ``model`` (if
        given: an instance is missing), and the assignments written for the claimed pods in
        ``waiting`` (pod -> the UID it is for)."""
        return await self.session.run(self._warm_sync, namespace, model, waiting)

    async def forget_assignments(self, namespace: str, pods: Sequence[str]) -> None:
        """Remove the assignments of a deleted group's claimed pods (the namespace's WarmPool
        would sweep them too, once the pods are gone; there may be no pool left)."""
        warm = zl.WarmPaths(namespace)

        def forget() -> None:
            for pod in pods:
                self.session.delete(warm.assignment(pod))

        await self.session.run(forget)

    async def ensure(self, namespace: str, group: str, open_acl: bool = False) -> None:
        """The group's folders, made again where missing (the server lost its data).
        ``open_acl``: the group is still open to pods without the credential (an upgrade):
        its folders are made open, its namespace's folder above them ours."""
        paths = zl.GroupPaths(namespace, group)
        if open_acl:
            await self.session.run(self.session.ensure, zl.groups_root(namespace))
        await self.session.run(self.session.ensure, *paths.all_folders(), open_acl=open_acl)

    async def close(self, namespace: str, group: str) -> Restricted:
        """Give the group's whole subtree MatrixServe's ACL (what was open: made before the
        identity was configured, or by engines without it); what it found and changed."""
        return await self.session.run(self.session.close, zl.group_path(namespace, group))

    async def groups(self, namespaces: Sequence[str] = ()) -> list[tuple[str, str]]:
        """(namespace, name) of every group with a subtree, in ``namespaces`` (all if none)."""

        def listing() -> list[tuple[str, str]]:
            spaces = list(namespaces) or self.session.children(zl.groups_root())
            return [(ns, g) for ns in spaces for g in self.session.children(zl.groups_root(ns))]

        return await self.session.run(listing)

    async def prune_fork_sources(self, namespaces: Sequence[str] = ()) -> list[str]:
        """Remove the fork-source folders with no source left (each source is an engine's
        ephemeral: a key's folder, and a namespace's, stay when the last goes), in
        ``namespaces`` (all if none); the folders removed. Only empty ones go: a source made
        meanwhile keeps its folder."""

        def prune() -> list[str]:
            spaces = list(namespaces) or self.session.children(zl.fork_sources_root())
            gone = []
            for namespace in spaces:
                root = zl.fork_sources_root(namespace)
                try:
                    folders = [f"{root}/{key}" for key in self.session.children(root)]
                    gone += [f for f in [*folders, root] if self.session.prune(f)]
                except ZooKeeperError as exc:  # (NoAuth: another identity's) the others go on
                    log.warning("fork-source folders of %s not swept: %s", namespace, exc)
            return gone

        return await self.session.run(prune)

    async def delete(self, namespace: str, group: str) -> bool:
        """Remove the group's whole subtree; True if there was one."""
        path = zl.group_path(namespace, group)

        def delete() -> bool:
            # Engines still running (their pods go after the group) write their report and
            # health into the folders being deleted: a child created between kazoo's listing
            # and its folder's deletion fails the folder's; go again (a running engine never
            # recreates a folder; one starting meanwhile may: the next sweep takes those).
            for _ in range(DELETE_TRIES - 1):
                with contextlib.suppress(NotEmptyError):
                    existed = self.session.delete(path, recursive=True)
                    break
            else:
                existed = self.session.delete(path, recursive=True)
            self.session.prune(path.rsplit("/", 1)[0])  # the namespace folder, once empty
            return existed

        return await self.session.run(delete)

    # ------------------------------------------------------------------ watches
    async def arm(self, namespace: str, group: str, wake: Callable[[], None]) -> bool:
        """The group's subtree made, and watched (:meth:`watch`); False if not connected."""
        if not self.connected:
            return False
        await self.ensure(namespace, group)
        await self.session.run(self.watch, namespace, group, wake)
        return True

    def disarm(self, namespace: str, group: str) -> None:
        self.unwatch(namespace, group)

    def watch(self, namespace: str, group: str, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from a kazoo thread) whenever reports, links, health, entrances,
        removals or the map change. The watches end at :meth:`unwatch`, also when the group is
        watched again later (a group recreated under the same name)."""
        paths = zl.GroupPaths(namespace, group)
        key = paths.root
        with self._lock:
            if key in self._watched:
                self._watched[key].append(wake)
                return
            self._watched[key] = [wake]
            self._epoch += 1
            epoch = self._epochs[key] = self._epoch

        def fire(*_: Any) -> bool:
            with self._lock:
                if self._epochs.get(key) != epoch:
                    return False  # unwatched: kazoo drops a watcher that returns False
                callbacks = list(self._watched.get(key, []))
            for callback in callbacks:
                callback()
            return True

        def health_children(children: Sequence[str] = (), *_: Any) -> bool:
            """Members come and go from health/: watch each one's data, and wake the group."""
            with self._lock:
                if self._epochs.get(key) != epoch:
                    return False
                watched = self._health.setdefault(key, {})
                seen = self._verdicts.setdefault(key, {})
                for name in [n for n in seen if n not in children]:
                    del seen[name]  # a later member of that name starts afresh
                gone = [watched.pop(n) for n in list(watched) if n not in children]
                new = [n for n in children if n not in watched]
            for handle in gone:
                self.session.cancel(handle)
            for name in new:
                handle = self.session.watch_data(paths.health_of(name), verdict_of(name))
                with self._lock:
                    if self._epochs.get(key) != epoch:
                        self.session.cancel(handle)
                        return False
                    self._health.setdefault(key, {})[name] = handle
            return fire()

        def verdict_of(name: str) -> Callable[[Any, Any], bool]:
            def changed(data: Any, _stat: Any) -> bool:
                verdict = _verdict(data)
                with self._lock:
                    if self._epochs.get(key) != epoch:
                        return False
                    seen = self._verdicts.setdefault(key, {})
                    before = seen.get(name, _UNSEEN)
                    seen[name] = verdict
                if before is _UNSEEN or before == verdict:
                    return True  # the first read, or a refresh that says nothing new
                return fire()

            return changed

        handles = [
            self.session.watch_children(folder, fire, send_event=True)
            for folder in (paths.reports, paths.links, paths.entrances, paths.removed)
        ]
        handles.append(self.session.watch_children(paths.health, health_children))
        handles.append(self.session.watch_data(paths.roce_map, fire))
        with self._lock:
            self._handles[key] = handles

    def unwatch(self, namespace: str, group: str) -> None:
        key = zl.group_path(namespace, group)
        with self._lock:
            self._watched.pop(key, None)
            self._epochs.pop(key, None)
            handles = self._handles.pop(key, [])
            handles += list(self._health.pop(key, {}).values())
            self._verdicts.pop(key, None)
        for handle in handles:  # a deleted group's watches are not armed again on a new session
            self.session.cancel(handle)
