"""The ZooKeeper session (see :mod:`matrixserve.coordination` for its policy): one kazoo client
at a time, its state told to listeners, connecting with bounded tries, idempotent reads and
writes behind the fence, ACLs for what it makes, and watches armed again on a renewed client.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.recipe.watchers import ChildrenWatch, DataWatch
from kazoo.retry import KazooRetry
from kazoo.security import ACL, OPEN_ACL_UNSAFE

from matrixserve.api import zk_layout as zl
from matrixserve.coordination.acl import (
    CLOSE_WALKS,
    RESTRICT_BATCH,
    Restricted,
    is_open,
    restrict_tree,
)
from matrixserve.coordination.credentials import access

log = logging.getLogger("matrixserve.coordination")
T = TypeVar("T")

# What a ZooKeeper call raises when the session is not there (connection loss, timeout, ...):
# callers catch these without importing kazoo.
ERRORS: tuple[type[Exception], ...] = (KazooException, KazooTimeoutError)
ZooKeeperError = KazooException  # the base of what a call on a live client raises
CallTimeout = KazooTimeoutError  # a call that got no answer in time
# The longest a closing session is waited on (its ephemerals go at once when it answers; a
# stop that never returns is left to the daemon thread it runs on).
STOP_WAIT = 5.0


class SessionState(StrEnum):
    CONNECTING = "CONNECTING"
    CONNECTED = "CONNECTED"
    SUSPENDED = "SUSPENDED"
    LOST = "LOST"


_FROM_KAZOO = {
    KazooState.CONNECTED: SessionState.CONNECTED,
    KazooState.SUSPENDED: SessionState.SUSPENDED,
    KazooState.LOST: SessionState.LOST,
}


@dataclass(eq=False)
class _Watch:
    kind: str  # "children" | "data"
    path: str
    callback: Callable[..., Any]
    send_event: bool = False


class Session:
    """One kazoo client at a time, and what every user of it needs."""

    # Called before every write (raises to refuse it): the operator's leadership, so a standby
    # or a deposed leader changes nothing (None: every write goes, as for the gateway).
    fence: Callable[[], None] | None = None

    def __init__(
        self,
        hosts: str,
        timeout: float = 10.0,
        connection_retry: dict[str, Any] | None = None,
        retry_deadline: float = 10.0,
        client: Any = None,  # a kazoo client to own instead (tests script one)
        client_factory: Callable[[], Any] | None = None,  # a fresh client (tests script one)
        auth: zl.Credentials | None = None,  # the digest identity (None: open znodes)
    ) -> None:
        self.hosts = hosts
        self.timeout = timeout
        self.auth = auth

        def fresh_client() -> Any:  # every client, a renewed one too, with the same access
            return KazooClient(
                hosts=hosts,
                timeout=timeout,
                connection_retry=connection_retry or {"max_tries": -1, "max_delay": 5},
                **access(auth),
            )

        # An injected client is renewed only by an injected factory (a test's fake never turns
        # into a real client).
        self._factory: Callable[[], Any] | None = client_factory or (
            None if client is not None else fresh_client
        )
        self.client = client if client is not None else fresh_client()
        self._stopped = False
        self.state = SessionState.CONNECTING
        self.retry_deadline = retry_deadline
        self.renewals = 0  # fresh clients started after a server that lost its data
        self._listeners: list[Callable[[SessionState], None]] = []
        self._watches: list[_Watch] = []
        self._lock = threading.Lock()
        self._suspended_timer: threading.Timer | None = None
        self._fresh: Any = None  # a fresh client whose watches are armed once it connects
        # The client last started (by start, start_background or a renewal): never started
        # twice (kazoo's start_async on a running client that is not live joins its connection
        # thread, for ever), and set while it is connected (its CONNECTED said, not yet lost).
        self._started: Any = None
        self._live = threading.Event()
        # Group subtrees found closed: what is made in them gets our ACL without asking again
        # (a closed subtree is never opened again while we run; a renewed client asks afresh).
        self._closed_scopes: set[str] = set()
        self._adopt(self.client)

    def _fenced(self) -> None:
        if self.fence is not None:
            self.fence()

    def _adopt(self, client: Any) -> None:
        client.add_listener(lambda state: self._on_kazoo_state(client, state))

    # ------------------------------------------------------------------ state
    def add_listener(self, listener: Callable[[SessionState], None]) -> None:
        """Call ``listener(state)`` on every transition, from kazoo's thread (must not block or
        call ZooKeeper)."""
        self._listeners.append(listener)

    def _on_kazoo_state(self, client: Any, state: str) -> None:
        new = _FROM_KAZOO.get(state, SessionState.LOST)
        with self._lock:  # the check, the state and the timer together: no renewal in between
            if client is not self.client:
                return  # a client given up: what it says is no longer ours
            self.state = new
            if new is SessionState.CONNECTED:
                self._live.set()
            else:
                self._live.clear()
            if self._suspended_timer is not None:
                self._suspended_timer.cancel()
                self._suspended_timer = None
            if new is SessionState.SUSPENDED and self._factory is not None:
                timer = threading.Timer(self.timeout, self._renew, args=(client,))
                timer.daemon = True
                self._suspended_timer = timer
                timer.start()
            rearm = new is SessionState.CONNECTED and self._fresh is client
            if rearm:
                self._fresh = None
        self._tell(new)
        if rearm:
            threading.Thread(target=self._rearm, args=(client,), daemon=True).start()

    # ------------------------------------------------------------------ a server without our data
    def _renew(self, suspended: Any) -> None:
        """Still SUSPENDED a session timeout later: the session is gone for us; start afresh."""
        with self._lock:
            if (
                self._stopped
                or self._factory is None
                or self.client is not suspended
                or self.state is not SessionState.SUSPENDED
                or suspended.connected  # it came back just now
            ):
                return
            self.client = self._factory()
            self.renewals += 1
            self._fresh = self.client
            self._started = self.client
            self._live.clear()
            self._closed_scopes.clear()  # the server lost its data: the subtrees are made again
            self.state = SessionState.LOST
        log.warning(
            "ZooKeeper %s: suspended for over the session timeout (%.0f s), the server may have "
            "lost its data: starting a new session",
            self.hosts,
            self.timeout,
        )
        self._tell(SessionState.LOST)
        self._adopt(self.client)
        self.client.start_async()
        _stopping(suspended)

    def _rearm(self, client: Any) -> None:
        """Arm again, on a fresh client, every watch still wanted (a watch that could not be
        armed is tried again a second later, for as long as this client is ours)."""
        with self._lock:
            pending = list(self._watches)
        while pending and client is self.client and not self._stopped:
            failed = []
            for watch in pending:
                if watch not in self._watches:
                    continue  # cancelled meanwhile
                try:
                    self._arm(watch)
                except ERRORS as exc:
                    log.warning("watch on %s not armed again yet: %s", watch.path, exc)
                    failed.append(watch)
            pending = failed
            if pending:
                threading.Event().wait(1.0)

    def _set_state(self, state: SessionState) -> None:
        with self._lock:
            self.state = state
        self._tell(state)

    def _tell(self, state: SessionState) -> None:
        for listener in list(self._listeners):
            listener(state)

    @property
    def connected(self) -> bool:
        return bool(self.client.connected) and self.state is SessionState.CONNECTED

    # ------------------------------------------------------------------ connecting
    async def start(self, timeout: float) -> None:
        """One try at connecting, over within ``timeout`` seconds whatever the server does.

        A try that did not connect in time gives its client up without waiting for it to stop
        and takes a fresh one for the next try: kazoo 2.11's ``stop`` joins its connection
        thread and callback workers with no timeout, and its own ``start`` stops the client
        before raising, so a server that accepts and then says nothing held the caller for the
        socket's read timeout, and a worker that never returned held it for ever (a process
        that planned nothing until restarted). The client given up is stopped on a daemon
        thread (no half-started client keeps retrying behind the caller). A client already
        started (a try whose next step failed, a renewal) is waited on, never started again."""
        client = self.client
        try:
            if client is not self._started:
                self._started = client
                self._live.clear()
                await asyncio.to_thread(client.start_async)
            await asyncio.to_thread(self._live.wait, timeout)
        except BaseException:  # cancelled, or kazoo failed: nothing half-started stays ours
            self._give_up(client)
            raise
        with self._lock:  # kazoo's SUSPENDED or LOST said meanwhile is never overridden
            connected = client is self.client and client.connected and self._live.is_set()
        if not connected:
            self._give_up(client)
            raise CallTimeout(f"ZooKeeper {self.hosts}: not connected within {timeout:g} s")

    def _give_up(self, client: Any) -> None:
        """Take ``client`` out of use: with a factory, a fresh client (same listeners, same
        watches wanted) takes its place for the next try, and the session is said LOST if it
        had been connected; the client given up is stopped on a daemon thread, never waited
        on."""
        lost = injected = False
        with self._lock:
            if self._factory is not None and self.client is client and not self._stopped:
                self.client = self._factory()
                self._closed_scopes.clear()
                self._live.clear()
                if self._suspended_timer is not None:
                    self._suspended_timer.cancel()
                    self._suspended_timer = None
                if self._watches:
                    self._fresh = self.client  # armed again once it connects
                lost = self.state is not SessionState.CONNECTING
                if lost:
                    self.state = SessionState.LOST
                fresh: Any = self.client
            else:
                fresh = None
                injected = self._factory is None and self.client is client
                if injected:  # no factory (a test's client): stopped, to be started again
                    self._started = None
                    self._live.clear()
        if fresh is None and injected:
            with contextlib.suppress(Exception):
                client.stop()
            return
        if fresh is not None:
            self._adopt(fresh)
        _stopping(client)  # after the swap: what it says now is no longer ours
        if lost:
            self._tell(SessionState.LOST)

    async def connect(
        self,
        attempt_timeout: float,
        pause: float = 2.0,
        then: Callable[[], None] | None = None,
        on_retry: Callable[[Exception], None] | None = None,
    ) -> None:
        """Connect, retrying every ``pause`` seconds until it works; ``then`` (run in a worker
        thread) is part of each try, so a session that drops right after connecting retries
        it too."""
        while True:
            try:
                await self.start(attempt_timeout)
                if then is not None:
                    try:
                        await asyncio.to_thread(then)
                    except Exception:  # the session dropped meanwhile: the next try, afresh
                        self._give_up(self.client)
                        raise
                return
            except Exception as exc:  # kazoo raises its own timeout types
                if on_retry is not None:
                    on_retry(exc)
                else:
                    log.warning("ZooKeeper %s unreachable (%s); retrying", self.hosts, exc)
                await asyncio.sleep(pause)

    def start_background(self) -> None:
        """Start without waiting; kazoo keeps (re)connecting by ``connection_retry``."""
        self._started = self.client
        self.client.start_async()

    async def stop(self) -> None:
        """Close the session (its ephemerals go at once, not after the session timeout)."""
        with self._lock:
            self._stopped = True
            if self._suspended_timer is not None:
                self._suspended_timer.cancel()
        # waited on at most STOP_WAIT: a stop that never returns must not hold the process's exit
        await asyncio.to_thread(_stopping(self.client).join, STOP_WAIT)

    # ------------------------------------------------------------------ calls
    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking ZooKeeper call (or a function of several) in a worker thread."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def read(self, path: str) -> bytes | None:
        """:meth:`get` without a worker thread: kazoo's asynchronous read, its answer handed to
        the running event loop. For a read per request on a busy event loop (an engine's fork
        gate): many at once cost no thread each, nor the hops between them and the loop.
        Raises what :meth:`get` raises. While the connection is down kazoo holds the read until
        it is back (or the session ends), and a client being stopped may never answer it: the
        caller bounds its wait (``asyncio.timeout``); a caller that stopped waiting is not
        answered (the late answer is dropped)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes | None] = loop.create_future()

        def settle(result: Any) -> None:  # on kazoo's callback thread
            try:
                raw, _ = result.get_nowait()
                outcome: tuple[bytes | None, BaseException | None] = (
                    bytes(raw) if raw else None,
                    None,
                )
            except NoNodeError:
                outcome = (None, None)
            except Exception as exc:  # the session's error, raised in the caller
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, answer, *outcome)

        self.client.get_async(path).rawlink(settle)
        return await answer

    def retry(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` re-run through connection losses until it succeeds or ``retry_deadline``
        seconds have passed (then kazoo's ``RetryFailedError``)."""
        policy = KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0, deadline=self.retry_deadline)
        result: T = policy(fn, *args, **kwargs)
        return result

    # ------------------------------------------------------------------ reads (blocking)
    def get(self, path: str) -> bytes | None:
        """The znode's data; None when it is absent or empty."""
        try:
            raw, _ = self.client.get(path)
        except NoNodeError:
            return None
        return bytes(raw) if raw else None

    def get_created(self, path: str) -> tuple[bytes | None, int | None]:
        """:meth:`get`, and the zxid that created the znode (None when absent): the same
        zxid, the same znode, however often its data was set since."""
        try:
            raw, stat = self.client.get(path)
        except NoNodeError:
            return None, None
        return (bytes(raw) if raw else None), int(stat.czxid)

    def children(self, path: str) -> list[str]:
        try:
            return list(self.client.get_children(path))
        except NoNodeError:
            return []

    def exists(self, path: str) -> bool:
        return self.client.exists(path) is not None

    # ------------------------------------------------------------------ writes (blocking)
    def put(
        self,
        path: str,
        data: bytes,
        *,
        ephemeral: bool = False,
        version: int = -1,
        makepath: bool = False,
    ) -> None:
        """Set-or-create. ``version`` >= 0 makes it a compare-and-set of an existing znode
        (``BadVersionError`` when the version moved, ``NoNodeError`` when it is gone).
        ``makepath``: create missing parents too (off: a deleted subtree stays deleted)."""
        self._fenced()
        try:
            self.client.set(path, data, version=version)
            return
        except NoNodeError:
            if version >= 0:
                raise
        try:
            self.client.create(
                path, data, acl=self._acl(path), ephemeral=ephemeral, makepath=makepath
            )
        except NodeExistsError:  # created meanwhile (by us on a retried call, or by a peer)
            self.client.set(path, data)

    def create_or_set(self, path: str, data: bytes) -> None:
        """:meth:`put` (with parents) for a znode that most likely is absent: created first."""
        self._fenced()
        try:
            self.client.create(path, data, acl=self._acl(path), makepath=True)
        except NodeExistsError:
            self.client.set(path, data)

    @property
    def session_id(self) -> int | None:
        client_id = self.client.client_id
        return int(client_id[0]) if client_id else None

    def own(self, path: str, data: bytes, *, makepath: bool = False) -> None:
        """Write an ephemeral znode that this session owns: set it if it is ours, replace it if
        another session holds it (a previous process whose session has not expired yet:
        ZooKeeper would delete the znode, our data with it, when that session expires), create it
        if absent (with its missing parents if ``makepath``: a folder the operator's sweep
        removed as empty just before)."""
        self._fenced()
        stat = self.client.exists(path)
        if stat is not None and stat.ephemeralOwner == self.session_id:
            self.client.set(path, data)
            return
        acl = self._acl(path)
        if stat is None:
            self.client.create(path, data, acl=acl, ephemeral=True, makepath=makepath)
            return
        # Replaced in one transaction: nobody reading the group sees the member without it.
        transaction = self.client.transaction()
        transaction.delete(path, version=stat.version)
        transaction.create(path, data, acl=acl, ephemeral=True)
        failures = [r for r in transaction.commit() if isinstance(r, Exception)]
        if failures:  # expired or replaced meanwhile: the caller tries again
            raise failures[0]

    def owns(self, path: str) -> bool:
        """Whether the znode exists and is an ephemeral of this session."""
        stat = self.client.exists(path)
        return stat is not None and stat.ephemeralOwner == self.session_id

    def create(self, path: str, data: bytes, *, ephemeral: bool = False) -> bool:
        """Create if absent; False when it already existed (left as it is)."""
        self._fenced()
        try:
            self.client.create(path, data, acl=self._acl(path), ephemeral=ephemeral)
        except NodeExistsError:
            return False
        return True

    def delete(self, path: str, *, recursive: bool = False) -> bool:
        """Delete if present (with its children if ``recursive``); False when it was already
        gone (kazoo's recursive delete does not say, so it is asked first)."""
        self._fenced()
        if recursive and not self.exists(path):
            return False
        try:
            self.client.delete(path, recursive=recursive)
        except NoNodeError:
            return False
        return True

    def prune(self, path: str) -> bool:
        """Delete the znode if it is there and has no children; True if it went."""
        self._fenced()
        try:
            self.client.delete(path)
        except (NoNodeError, NotEmptyError):
            return False
        return True

    def ensure(self, *paths: str, open_acl: bool = False) -> None:
        """Make the znodes (and their missing parents) that are not there. ``open_acl``: open
        to every client, for a group subtree still open to engines without the credential (an
        upgrade), made again after the server lost its data."""
        self._fenced()
        for path in paths:
            acl = list(OPEN_ACL_UNSAFE) if open_acl and self.auth is not None else None
            self.client.ensure_path(path, acl=acl or self._acl(path))

    # ------------------------------------------------------------------ access
    def _acl(self, path: str) -> list[ACL] | None:
        """The ACL a znode made at ``path`` gets: None for the client's default (ours; open
        without credentials), open inside a group subtree that is still open (an upgrade: the
        group's engines started without the credential go on reading and writing there, and
        must read what we make there too, until the operator closes the subtree)."""
        if self.auth is None:
            return None
        scope = zl.group_root_of(path)
        if scope is None or scope == path or scope in self._closed_scopes:
            return None
        try:
            acls, _ = self.client.get_acls(scope)
        except NoNodeError:
            return None  # made together with this znode: closed from the start
        if is_open(acls):
            return list(OPEN_ACL_UNSAFE)
        self._closed_scopes.add(scope)
        return None

    def restrict(
        self,
        top: str = zl.TOP,
        batch: int = RESTRICT_BATCH,
        skip: Callable[[str], bool] | None = None,
    ) -> Restricted:
        """Give ``top`` and every znode under it our ACL where it has another (znodes created
        before credentials were configured: an upgrade), except the subtrees whose root
        ``skip`` names (left as they are). Level by level, ``batch`` znodes' ACLs and children
        asked at once (kazoo's asynchronous calls), so a large tree costs a few round trips per
        thousand znodes, not three each. A znode another identity owns is left as it is and
        named in the result. Connection losses raise: run it again (it only changes what still
        differs)."""
        if self.auth is None:
            raise ValueError("no credentials: there is no ACL to give")
        wanted = access(self.auth)["default_acl"]
        return restrict_tree(self.client, wanted, top, batch, skip, self._fenced)

    def close(self, top: str) -> Restricted:
        """Close a subtree that was kept open (see :meth:`_acl`): :meth:`restrict` again until a
        walk changes nothing (at most ``CLOSE_WALKS``), so a znode made open while the first
        walk ran is closed by the next; what is made there afterwards is ours from the start.
        Returns what the walks did together."""
        total = Restricted()
        for _ in range(CLOSE_WALKS):
            done = self.restrict(top)
            total = Restricted(done.seen, total.changed + done.changed, done.refused, done.examples)
            if not done.changed:
                break
        if not total.refused:
            self._closed_scopes.add(top)
        return total

    async def restrict_existing(
        self, top: str = zl.TOP, pause: float = 2.0, skip: Callable[[str], bool] | None = None
    ) -> Restricted:
        """:meth:`restrict` in a worker thread, run again after a connection loss until it
        completes (the operator's, once connected at start); what it did is logged."""
        while True:
            try:
                done = await self.run(self.restrict, top, RESTRICT_BATCH, skip)
                break
            except ERRORS as exc:
                log.warning("ZooKeeper ACLs on %s not all set yet (%s); retrying", top, exc)
                await asyncio.sleep(pause)
        if done.changed:
            log.info(
                "ZooKeeper: our ACL set on %d of %d znodes under %s", done.changed, done.seen, top
            )
        if done.refused:
            log.error(
                "ZooKeeper: %d znodes under %s belong to another identity (%s, ...): MatrixServe "
                "cannot use them; delete them (docs/zookeeper.md, 'Access': a leaf with our "
                "identity, one with children with its owner's)",
                done.refused,
                top,
                ", ".join(done.examples),
            )
        return done

    def apply(self, ops: Iterable[zl.ZnodeOp]) -> None:
        """Run layout operations in order (each idempotent; a Put creates missing parents)."""
        for op in ops:
            match op:
                case zl.Put(path=path, data=data, new=True):
                    self.create_or_set(path, data)
                case zl.Put(path=path, data=data):
                    self.put(path, data, makepath=True)
                case zl.Delete(path=path, recursive=recursive):
                    self.delete(path, recursive=recursive)

    # ------------------------------------------------------------------ watches
    def watch_children(
        self, path: str, callback: Callable[..., Any], *, send_event: bool = False
    ) -> _Watch:
        """kazoo's ``ChildrenWatch``: ``callback(children[, event])``; returning False (or
        :meth:`cancel`) stops it. On a znode that does not exist yet it starts once the znode is
        created."""
        return self._register(_Watch("children", path, callback, send_event))

    def watch_data(self, path: str, callback: Callable[..., Any]) -> _Watch:
        """kazoo's ``DataWatch``: ``callback(data, stat)`` (None, None while absent); returning
        False (or :meth:`cancel`) stops it."""
        return self._register(_Watch("data", path, callback))

    def cancel(self, watch: _Watch) -> None:
        """This watch is no longer wanted: never armed again, and stopped when it next fires."""
        with self._lock, contextlib.suppress(ValueError):
            self._watches.remove(watch)

    def _register(self, watch: _Watch) -> _Watch:
        original = watch.callback

        def callback(*args: Any) -> Any:
            with self._lock:
                wanted = watch in self._watches
            if not wanted:
                return False
            result = original(*args)
            if result is False:
                self.cancel(watch)
            return result

        watch.callback = callback
        with self._lock:
            self._watches.append(watch)
        self._arm(watch)
        return watch

    def _arm(self, watch: _Watch) -> None:
        client = self.client
        if watch.kind == "data":
            DataWatch(client, watch.path, watch.callback)
            return
        if self.retry(client.exists, watch.path) is not None:
            ChildrenWatch(client, watch.path, watch.callback, send_event=watch.send_event)
            return

        def created(_data: Any, stat: Any) -> bool:
            if stat is None or client is not self.client:
                return client is self.client  # keep waiting (or give up with the client)
            ChildrenWatch(client, watch.path, watch.callback, send_event=watch.send_event)
            return False

        DataWatch(client, watch.path, created)


def _stopping(client: Any) -> threading.Thread:
    """Stop and close a kazoo client on a daemon thread (started, returned): kazoo 2.11's
    ``stop`` joins its connection thread and callback workers with no timeout, so nobody that
    must go on waits on it unbounded."""

    def stop() -> None:
        with contextlib.suppress(Exception):
            client.stop()
        with contextlib.suppress(Exception):
            client.close()

    # kazoo's handler stops itself at exit too (atexit), taking a lock a stuck stop holds: the
    # process's exit would wait on it
    with contextlib.suppress(Exception):
        atexit.unregister(client.handler.stop)
    thread = threading.Thread(target=stop, daemon=True, name="zookeeper-stop")
    thread.start()
    return thread


def _settle(
    answer: asyncio.Future[bytes | None], value: bytes | None, error: BaseException | None
) -> None:
    """:meth:`Session.read`'s answer, on the loop, unless its caller stopped waiting."""
    if answer.done():
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(value)
