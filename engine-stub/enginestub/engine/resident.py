"""The P/D-Serve resident process (§3.2-3.4): the engine's side of the group protocol.

1. **Report** its RoCE IPs, ordered by device id (the node's "hccn tool": the node emulator's
   environment), under ``reports/<instance>`` (ephemeral).
2. **Wait** for ``init-order`` and for the ``roce-map`` to list it; its role comes from the map
   (a role-less container learns it there: dynamic RoCE construction, Fig. 7).
3. **Link** to every peer of the opposite role in the map: an HTTP handshake to the peer pod,
   which checks that the caller is in its map with the opposite role and the same device count,
   then the verified sub-links (device k <-> device k) are written to ``links/<p>--<d>``. Waits
   for all its links (a peer may create them) until ``link_timeout`` (emulated) and at least
   ``LINK_WALL_FLOOR_SECONDS`` of wall time have passed; then the process exits with an error
   (P/D-Serve §3.2: a linking timeout fails the instance), so its container restarts.
4. **Load** the model (time = bytes / bandwidth of the source).
5. **Health**: an ephemeral ``health/<instance>``, refreshed every ``health_interval``, and
   written again at once whenever what it says changes.
6. Keeps watching: a peer added to the map later links to this instance itself (the newcomer
   initiates, Fig. 7; a serving instance only confirms the handshake and never relinks or
   restarts); ``decode-meta`` tells a prefill where to forward (and which decodes' sub-links it
   probes); ``removed/`` stops traffic to logically removed instances, and when it names this
   one, closes its entrance side and ends its streams.
7. **Fork source** (DeepServe §6.2): while it serves (loaded, not faulty, not removed,
   not closing), an ephemeral ``forksources/<ns>/<key>/<group>.<instance>`` names it as a
   source warm targets may fork from; written with each health write, so it goes as soon as the
   instance stops qualifying. An instance of several pods is none.

The leader of an instance of several pods (:mod:`.ranks`) gathers its ranks before step 1 (its
report lists them, its RoCE IPs are all of theirs), watches them while it serves (a rank lost is
a fault of the instance), and re-forms in this process when they are all back (:meth:`reform`).

Health rule on faults (Faulty, not silent): a die, NPU or HBM fault on this instance, or a hang of
its serving loop, makes it ``state: Faulty`` with the typed faults (kind, since when, dies); slots
held without progress make it ``Degraded``. A sub-link that probes Delayed or Blocked (or a RoCE
link down) leaves it ``Serving``: it is said in ``links`` (with ``downAt`` when a device status says
the port is down), the prefill keeps off that decode, and the operator plans for a blocked one.
Every health carries the serving loop's last beat (``loopBeat``). The znode is deleted only while
the model is not loaded, so the operator always reads why, never a silence.

Sessions (:mod:`matrixserve.coordination`, the one session owner): SUSPENDED pauses writes; LOST
means our ephemerals are gone, so on reconnection the report and health znodes are written
again. Every write is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import httpx

from enginestub.engine.bucket import ZkBucket
from enginestub.engine.core import Engine
from enginestub.engine.fork import artifacts, fork_key
from enginestub.engine.ranks import CHECK_SECONDS, RankGang, instance_roce_ips, own_entry
from enginestub.engine.zkbridge import SessionBridge, join_group
from matrixserve import coordination
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError
from matrixserve.coordination import Session

log = logging.getLogger("enginestub.resident")
LINK_WALL_FLOOR_SECONDS = 30.0
# How long a serving prefill leaves the link to a newcomer to the newcomer (wall s): it
# initiates its own links as soon as the map names it; two initiators would race
NEWCOMER_GRACE_SECONDS = 2.0
FORK_GATE_SECONDS = 5.0  # wall s the fork gate waits for ZooKeeper to answer (then 503)


class LinkError(Exception):
    pass


class Resident:
    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        if cfg.group is None or cfg.zookeeper is None:
            raise ValueError("the resident process needs a group and a ZooKeeper address")
        self.engine = engine
        self.namespace, self.group = cfg.group.split("/", 1)
        self.paths = zl.GroupPaths(self.namespace, self.group)
        self.instance = cfg.instance
        # While it serves, this instance is a fork source under its content key.
        self.fork_key = fork_key(cfg)
        self.fork_source_path = zl.fork_source_path(
            self.namespace, self.fork_key, self.group, self.instance
        )
        self.closing = False
        # This process's incarnation: a restarted engine (same pod, same IPs) is someone else
        # to its peers, since every link it had is gone.
        self.incarnation = uuid.uuid4().hex[:16]
        self.zk = Session(cfg.zookeeper, timeout=10.0, auth=cfg.zookeeper_auth)
        self.bridge = SessionBridge(self.zk)
        # the shared file service's readers, counted in ZooKeeper (not a number
        # fixed at the pod's creation, which a restart in place would keep)
        engine.bucket = ZkBucket(
            self.zk, self.bridge, f"{self.namespace}.{self.group}.{self.instance}"
        )
        self.roce_map: zl.RoceMap | None = None
        self.init_order: zl.InitOrder | None = None
        self.role: zl.Role | None = None
        self.phase = "Starting"
        self.health_seq = 0
        self.ready_after = 0.0  # wall s from the process's start to its first Serving health
        self.gathered_after = 0.0  # ... and to the map that names it (the rest: link + load)
        self.ready = False
        self._map_changed = asyncio.Event()
        self._health_dirty = asyncio.Event()
        self._writes = asyncio.Lock()  # our ephemerals are written by one writer at a time
        self._task: asyncio.Task[None] | None = None
        self._removed_names: set[str] = set()
        # the peers (instance, incarnation) a map named when we last had every link: one a later
        # map adds is a newcomer, which links itself (Fig. 7) before we repair anything to it
        self._seen_peers: set[tuple[str, str]] = set()
        # An instance of several pods: its workers as this leader sees them, the ranks it was
        # formed with (itself first), and whether it is re-forming now
        self.gang = RankGang(cfg, self.paths) if cfg.ranks > 1 else None
        self.rank_entries: list[zl.RankEntry] = []
        self.reforms = 0
        self._forming = False
        engine.on_health_change = self._health_dirty.set
        engine.forks.gate = self.check_fork_target

    # ------------------------------------------------------------------ main
    async def start(self) -> None:
        self.bridge.start()
        self._task = asyncio.create_task(self._connect_and_run(), name="resident")

    async def _connect_and_run(self) -> None:
        """Connect (retrying: ZooKeeper may come later than the pod), then run the protocol."""

        def waiting(exc: Exception) -> None:
            self.phase = "WaitingForZooKeeper"
            log.warning("ZooKeeper %s unreachable (%s); retrying", self.zk.hosts, exc)

        await join_group(self.zk, self.paths, waiting)
        await self._run()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The protocol's task: it ends only by failing (or by :meth:`stop`)."""
        return self._task

    async def stop(self) -> None:
        """Stop the protocol (whether it runs or has failed) and close the ZooKeeper session, so
        its ephemeral report and health go at once, not after the session timeout (a restarted
        container would otherwise find them and lose them again when the old session expires).
        The forks under way are aborted and the fork source entry goes first: a closing
        instance forks nobody."""
        self.closing = True
        self.engine.shutdown(f"instance {self.instance} is closing")
        if self.zk.connected:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0), self._writes:
                    await self.zk.run(self.zk.delete, self.fork_source_path)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):  # cancelled, or the failure already logged
                await self._task
        await self.zk.stop()

    def _report(self) -> zl.Report:
        cfg = self.engine.config
        role = (
            None
            if cfg.role == "auto"
            else (zl.Role.PREFILL if cfg.role == "prefill" else zl.Role.DECODE)
        )
        entries = self.rank_entries
        return zl.Report(
            instance=self.instance,
            role=role,
            podIP=cfg.host,
            port=cfg.port,
            node=cfg.node,
            superpod=cfg.superpod,
            # every rank's devices, in rank order (the instance's RoCE IPs are: Engine.form)
            dies=[d for e in entries for d in e.dies] if entries else cfg.dies,
            roceIps=cfg.roce_ips,
            ts=time.time(),
            podUid=cfg.pod_uid,
            incarnation=self.incarnation,
            tp=cfg.tp,
            ranks=entries,
        )

    async def _write_report(self) -> None:
        """Our report, owned by our session (a previous process's, not yet expired, is
        replaced: ZooKeeper would otherwise delete it when that session expires)."""
        data = self._report().dump()
        async with self._writes:
            await self.zk.run(self.zk.own, self.paths.report(self.instance), data)

    def _me(self) -> zl.MapEntry | None:
        """Our entry in the RoCE map, if the map names this incarnation (not a previous one)."""
        entry = self.roce_map.entry(self.instance) if self.roce_map is not None else None
        return entry if entry is not None and entry.incarnation == self.incarnation else None

    async def _run(self) -> None:
        clock = self.engine.clock
        t0 = clock.now()
        self.phase = "Gathering"
        if self.gang is not None:
            self.gang.watch(self.zk, self.bridge)
            await self._gather_ranks()
        await self._write_report()
        self._watch()
        # Re-registration from the start, not once serving: a report lost while gathering (a
        # session lost or renewed) is written again, or engine and operator would wait on
        # each other for ever.
        registered = asyncio.create_task(self._keep_registered(), name="re-register")
        await self._wait(lambda: self.init_order is not None and self._me() is not None)
        self.gathered_after = round(time.time() - self.engine.started_wall, 3)
        assert self.roce_map is not None
        self.role = self.roce_map.role_of(self.instance)
        if self.role is zl.Role.PREFILL and self.engine.config.attention_client:
            raise ValueError(  # its weights are the non-expert ones: it could not prefill
                f"the RoCE map makes {self.instance} a prefill, but it is its expert pool's "
                "attention client: a pool's clients are decodes (EaaS §5.1)"
            )
        self.engine.role = "prefill" if self.role is zl.Role.PREFILL else "decode"
        self.engine.metrics.phase_seconds.labels(phase="gather").set(clock.now() - t0)
        t1 = clock.now()
        self.phase = "Linking"
        await self._link_all()
        self._seen_peers = self._peer_keys()
        self.engine.metrics.phase_seconds.labels(phase="link").set(clock.now() - t1)
        self.phase = "Loading"
        await self.engine.load_model()
        self.engine.metrics.phase_seconds.labels(phase="load").set(self.engine.load_seconds or 0.0)
        self.phase = "Serving"
        self.ready = True
        try:
            await self._write_health()
        except coordination.ERRORS as exc:  # _keep_health writes it again
            log.warning("first health report not written (%s)", type(exc).__name__)
        await asyncio.gather(
            self._keep_health(),
            self._keep_links(),
            registered,
            *([self._keep_ranks()] if self.gang is not None else []),
        )

    async def _wait(self, condition: Any) -> None:
        while not condition():
            self._map_changed.clear()
            if condition():
                return
            await self._map_changed.wait()

    # ------------------------------------------------------------------ watches
    def _watch(self) -> None:
        def on_init(data: bytes | None, _stat: Any) -> None:
            self.bridge.call(self._set_init, data)

        def on_map(data: bytes | None, _stat: Any) -> None:
            self.bridge.call(self._set_map, data)

        def on_meta(data: bytes | None, _stat: Any) -> None:
            self.bridge.call(self._set_meta, data)

        def on_removed(children: list[str]) -> None:
            self.bridge.call(self._set_removed, children)

        def on_drain(data: bytes | None, _stat: Any) -> None:
            self.bridge.call(self._set_drain, data)

        self.zk.watch_data(self.paths.init_order, on_init)
        self.zk.watch_data(self.paths.roce_map, on_map)
        self.zk.watch_data(self.paths.decode_meta, on_meta)
        self.zk.watch_children(self.paths.removed, on_removed)
        self.zk.watch_data(self.paths.draining_of(self.instance), on_drain)

    def _set_init(self, data: bytes | None) -> None:
        self.init_order = zl.InitOrder.parse(data) if data else None
        self._map_changed.set()

    def _set_map(self, data: bytes | None) -> None:
        """A new map. An absent one changes nothing: the group is being deleted (this pod goes
        with it) or ZooKeeper lost its data (the operator rebuilds the map, and meanwhile peers
        still handshake against the last one)."""
        if not data:
            return
        try:
            self.roce_map = zl.RoceMap.parse(data)
        except ValueError:
            log.error("ignoring an unreadable roce-map")
            return
        self._map_changed.set()

    def _set_meta(self, data: bytes | None) -> None:
        if not data:
            return
        meta = zl.DecodeMeta.parse(data)
        self.engine.decode_entries = list(meta.decodes)
        self.engine.decode_peers = [f"{d.pod_ip}:{d.port}" for d in meta.decodes]
        self._removed_addresses()

    def _set_removed(self, children: list[str]) -> None:
        self._removed_names = set(children)
        if self.instance in self._removed_names:
            self.engine.withdraw(
                f"instance {self.instance} is logically removed from group "
                f"{self.namespace}/{self.group}"
            )
        else:
            self.engine.readmit()
        self._removed_addresses()

    def _set_drain(self, data: bytes | None) -> None:
        """Named under ``draining/``, this instance takes no new request and finishes those it has
        (its health says how many are left, and which drain it answers: the marker's ``at``)."""
        try:
            drain = zl.Drain.parse(data) if data else None
        except ValueError:
            log.error("ignoring an unreadable drain marker")
            return
        if drain is None:
            self.engine.undrain()
            return
        self.engine.drain(
            f"instance {self.instance} is draining out of group {self.namespace}/{self.group}"
            f" ({drain.reason})",
            drain.at,
        )

    def _removed_addresses(self) -> None:
        names = self._removed_names
        if self.roce_map is None:
            return
        entries = self.roce_map.decode + self.roce_map.prefill
        self.engine.removed = {f"{e.pod_ip}:{e.port}" for e in entries if e.instance in names}

    # ------------------------------------------------------------------ links
    def check_handshake(self, body: dict[str, Any]) -> dict[str, Any]:
        """The peer side of a link: the caller must be in our map as it is (the same RoCE IPs
        and incarnation: a map that still names its previous incarnation is not proof), with
        the opposite role, and its dies must pair with ours (the same number, or two shapes
        CloudMatrix-Infer §4.3.3's mapping pairs: ``zk_layout.verify_sub_links``)."""
        if self.roce_map is None or self.role is None:
            raise EngineError(409, "not_linked", "this instance has no RoCE map yet")
        caller = body["instance"]
        caller_role = self.roce_map.role_of(caller)
        entry = self.roce_map.entry(caller)
        if caller_role is None or entry is None:
            raise EngineError(
                403,
                "unknown_peer",
                f"{caller} is not in this group's RoCE map v{self.roce_map.version}",
            )
        if (body.get("roceIps"), body.get("incarnation", "")) != (
            entry.roce_ips,
            entry.incarnation,
        ):
            raise EngineError(
                409,
                "stale_peer",
                f"{caller} (incarnation {body.get('incarnation')}) is not the one RoCE map "
                f"v{self.roce_map.version} names (incarnation {entry.incarnation})",
            )
        if caller_role == self.role:
            raise EngineError(
                409, "same_role", f"{caller} has the same role {self.role}; links join P and D"
            )
        cfg = self.engine.config
        me = zl.MapEntry(
            instance=self.instance, podIP=cfg.host, port=cfg.port, roceIps=cfg.roce_ips, tp=cfg.tp
        )
        pair = (entry, me) if caller_role is zl.Role.PREFILL else (me, entry)
        try:
            zl.verify_sub_links(*pair)
        except ValueError as exc:
            raise EngineError(409, "device_mismatch", str(exc)) from None
        return {
            "instance": self.instance,
            "role": str(self.role),
            "roceIps": self.engine.config.roce_ips,
            "incarnation": self.incarnation,
        }

    async def _link_one(self, peer: zl.MapEntry) -> None:
        """A verified link to ``peer`` between our current incarnations: one already there is
        proof only if it joins exactly these two (else it is verified again and replaced)."""
        me = self._me()
        if me is None or self.role is None:
            raise LinkError("the RoCE map does not name this incarnation (yet)")
        p, d = (me, peer) if self.role is zl.Role.PREFILL else (peer, me)
        path = self.paths.link(p.instance, d.instance)
        raw = await self.zk.run(self.zk.get, path)
        with contextlib.suppress(ValueError):
            if raw is not None and zl.Link.parse(raw).joins(p, d):
                return
        body = {
            "instance": self.instance,
            "role": str(self.role),
            "roceIps": self.engine.config.roce_ips,
            "incarnation": self.incarnation,
        }
        response = await self.engine.http.post(
            f"http://{peer.pod_ip}:{peer.port}/v1/link/handshake", json=body, timeout=5.0
        )
        if response.status_code != 200:
            raise LinkError(
                f"{peer.instance} refused the link: {response.status_code} {response.text[:200]}"
            )
        answer = response.json()
        if (answer.get("roceIps"), answer.get("incarnation", "")) != (
            peer.roce_ips,
            peer.incarnation,
        ):
            raise LinkError(
                f"{peer.instance} answered RoCE IPs {answer.get('roceIps')} incarnation "
                f"{answer.get('incarnation')}, the map {peer.roce_ips} {peer.incarnation}"
            )
        down = [ip for ip in peer.roce_ips if ip in self.engine.device_links_down]
        if down:
            raise LinkError(f"RoCE link to {peer.instance} device(s) {down} is down")
        link = zl.Link(
            prefill=p.instance,
            decode=d.instance,
            subLinks=zl.verify_sub_links(p, d),
            verifiedAt=time.time(),
            initiator=self.instance,
            prefillIncarnation=p.incarnation,
            decodeIncarnation=d.incarnation,
        )
        await self.zk.run(self.zk.put, path, link.dump())

    async def _link_all(self) -> None:
        """Link to every opposite-role peer; wait until every such link exists (ours or theirs)."""
        clock = self.engine.clock
        deadline = clock.now() + self.engine.config.link_timeout
        # Peers here are real processes whose start-up takes wall time, not emulated time: at a
        # large time scale the emulated timeout alone would be a few wall seconds.
        wall_deadline = time.monotonic() + LINK_WALL_FLOOR_SECONDS
        while True:
            assert self.roce_map is not None
            peers = self.roce_map.peers_of(self.instance)
            missing = []
            for peer in peers:
                try:
                    await self._link_one(peer)
                except (LinkError, httpx.HTTPError) as exc:
                    missing.append(f"{peer.instance}: {exc}")
            if not missing:
                return
            if clock.now() > deadline and time.monotonic() > wall_deadline:
                raise LinkError("links not verified before the timeout: " + "; ".join(missing))
            await asyncio.sleep(max(clock.to_wall(0.5), 0.1))  # no busy loop at large scales

    async def _keep_links(self) -> None:
        """Dynamic RoCE construction (Fig. 7): a newcomer initiates its links (at start); a
        serving instance confirms them (its handshake check reads the map it watches) and never
        restarts. A serving prefill also repairs, at each map change, a link to a decode that is
        missing or joins other incarnations than the map's (one lost with ZooKeeper's data, or
        one a newcomer did not finish): verifying a link again interrupts nothing."""
        while True:
            await self._map_changed.wait()
            self._map_changed.clear()  # before the work: a change during it is seen next round
            self._removed_addresses()
            if self.role is zl.Role.PREFILL and self._me() is not None and not self._forming:
                await self._repair_links()

    def _peer_keys(self) -> set[tuple[str, str]]:
        assert self.roce_map is not None
        return {(p.instance, p.incarnation) for p in self.roce_map.peers_of(self.instance)}

    async def _repair_links(self) -> None:
        """Every link to a decode the map names, verified again where it is missing or stale;
        retried (a peer may not have the new map yet) until all join or the map changes. A
        peer the map newly names is a newcomer: it initiates its own links (Fig. 7), so ours to
        it is left alone for :data:`NEWCOMER_GRACE_SECONDS` (wall), then repaired if missing
        (a newcomer that did not finish)."""
        delay = 0.2
        since = time.monotonic()
        while not self._map_changed.is_set():
            assert self.roce_map is not None
            pending = []
            newcomers_wait = time.monotonic() - since < NEWCOMER_GRACE_SECONDS
            for peer in self.roce_map.peers_of(self.instance):
                if newcomers_wait and (peer.instance, peer.incarnation) not in self._seen_peers:
                    pending.append(f"{peer.instance}: a newcomer, linking itself")
                    continue
                try:
                    await self._link_one(peer)
                except (LinkError, httpx.HTTPError, coordination.ZooKeeperError) as exc:
                    pending.append(f"{peer.instance}: {exc}")
            if not pending:
                self._seen_peers = self._peer_keys()
                return
            log.info("links not repaired yet (%s); again in %.1fs", "; ".join(pending), delay)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._map_changed.wait()
            delay = min(delay * 2, 5.0)

    # ------------------------------------------------------------------ health
    def _health(self) -> zl.Health | None:
        """What the health znode says now; None (no znode) only while the model is not loaded."""
        engine = self.engine
        if not engine.loaded:
            return None
        faults, links = engine.engine_faults(), engine.link_probes()
        state, message = zl.HealthState.SERVING, ""
        # A sub-link that probes late (the decode saturated) or blocked (a link
        # fault) is said in ``links`` and leaves the instance serving: a prefill forwards over
        # its other decodes (and refuses at admission when none is left), the operator plans
        # for a blocked one. Closing the instance for it would turn one link into a whole
        # instance out, or, under load, every prefill out as their probes run late.
        if engine.device_links_down:
            message = "RoCE link down to " + ", ".join(sorted(engine.device_links_down))
        if links:  # xDeepServe's link probing, saturation told from a link fault
            message = "sub-link(s) " + ", ".join(f"{p.peer}#{p.device} {p.state}" for p in links)
        stuck = engine.stuck_holds()
        if stuck:  # slots nothing will free are not capacity
            state = zl.HealthState.DEGRADED
            message = (
                f"{stuck} request(s) held without progress for over "
                f"{engine.stuck_bound():g} s (emulated)"
            )
        experts = engine.experts_unavailable()
        if experts is not None:  # an attention client without its experts serves nothing
            state, message = zl.HealthState.DEGRADED, experts
        if faults:  # faulty, and why, never a silence
            state = zl.HealthState.FAULTY
            message = "; ".join(f"{f.kind}: {f.detail}" for f in faults)
        assert self.role is not None
        if state is zl.HealthState.SERVING and not self.ready_after:
            self.ready_after = round(time.time() - engine.started_wall, 3)
        self.health_seq += 1
        return zl.Health(
            instance=self.instance,
            role=self.role,
            state=state,
            seq=self.health_seq,
            ts=time.time(),
            message=message,
            podIP=engine.config.host,
            port=engine.config.port,
            incarnation=self.incarnation,
            faults=faults,
            links=links,
            loopBeat=engine.heartbeat.last_beat_wall,
            readyAfter=self.ready_after,
            gatheredAfter=self.gathered_after,
            phases=engine.phases,
            loadSource=engine.load_source,
            loadShare=round(engine.load_share, 3),
            warm=engine.warm,
            load=engine.metrics.load.report(engine.prefill.compute.busy_seconds()),
            draining=engine.draining is not None,
            drainAt=engine.drain_at,
            inflight=len(engine.streams),
        )

    async def _write_health(self) -> None:
        """Our health, owned by our session (see :meth:`_write_report`); deleted while the
        model is not loaded."""
        if self.bridge.suspended.is_set() or not self.ready:
            return
        path = self.paths.health_of(self.instance)
        health = self._health()
        async with self._writes:
            if health is None:
                await self.zk.run(self.zk.delete, path)
                return
            await self.zk.run(self.zk.own, path, health.dump())
            await self._write_fork_source()

    # ------------------------------------------------------------------ fork source
    async def check_fork_target(self, pod: str, pod_uid: str) -> None:
        """The fork gate: a target is served only if the operator sent it here, i.e. the
        assignment of its pod (in this group's namespace, read by our own session) is of that
        pod's UID and names this instance of this group as its fork source. Raises 403
        ``fork_not_assigned``, or 503 ``not_ready`` while ZooKeeper cannot say."""
        group = f"{self.namespace}/{self.group}"
        try:
            path = zl.WarmPaths(self.namespace).assignment(pod)
        except ValueError:
            raise EngineError(403, "fork_not_assigned", "no such pod", "pod") from None
        unanswered = EngineError(
            503, "not_ready", f"this source cannot read pod {pod}'s assignment now"
        )
        try:
            async with asyncio.timeout(FORK_GATE_SECONDS):
                raw = await self.zk.read(path)  # no worker thread: 32 targets ask at once
        except TimeoutError:
            raise unanswered from None
        except coordination.ERRORS:
            raise unanswered from None
        try:
            assignment = zl.Assignment.parse(raw) if raw else None
        except ValueError:
            assignment = None
        fork = assignment.fork if assignment is not None else None
        if (
            assignment is None
            or assignment.pod_uid != pod_uid
            or fork is None
            or (fork.group, fork.instance) != (group, self.instance)
        ):
            raise EngineError(
                403,
                "fork_not_assigned",
                f"no assignment of pod {pod} (this UID) names {group}/{self.instance} as its "
                "fork source",
                "pod",
            )

    def _fork_source(self) -> zl.ForkSource | None:
        """What this instance says as a fork source: only while it serves (loaded, not faulty,
        not removed) and is not closing."""
        engine, cfg = self.engine, self.engine.config
        if self.closing or engine.closing is not None or not engine.serving or cfg.ranks > 1:
            return None
        return zl.ForkSource(
            key=self.fork_key,
            model=cfg.model.name,
            artifacts=artifacts(cfg),
            group=f"{self.namespace}/{self.group}",
            instance=self.instance,
            podIP=cfg.host,
            port=cfg.port,
            node=cfg.node,
            superpod=cfg.superpod,
            dies=len(cfg.dies),
            incarnation=self.incarnation,
            ts=time.time(),
        )

    async def _write_fork_source(self) -> None:
        """Our fork source entry (ephemeral, ours), or none when we do not qualify; with every
        health write, so a fault or a removal takes it away at once."""
        source = self._fork_source()
        if source is None:
            await self.zk.run(self.zk.delete, self.fork_source_path)
            return

        def write() -> None:
            self.zk.ensure(self.fork_source_path.rsplit("/", 1)[0])
            # makepath too: the operator's sweep prunes a key's folder once it is empty, which
            # it may be between the two calls
            self.zk.own(self.fork_source_path, source.dump(), makepath=True)

        await self.zk.run(write)

    async def _keep_health(self) -> None:
        """The health every interval, and at once when it changed (a fault, a hang, a probe)."""

        async def write() -> None:
            # The report too, if it is not ours: a restarted container converges without
            # help even if a previous process's session took ours with it
            # (re-registration is not only at start or on a lost session).
            if not await self.zk.run(self.zk.owns, self.paths.report(self.instance)):
                await self._write_report()
            await self._write_health()

        interval = self.engine.clock.to_wall(self.engine.config.health_interval)
        await self.bridge.keep_fresh(self._health_dirty, interval, write, "health report")

    async def _keep_registered(self) -> None:
        """After a (re)connection, our report and health again (an engine never creates the
        group's folders: a deleted group stays deleted)."""

        async def write() -> None:
            await self._write_report()
            await self._write_health()

        await self.bridge.keep_registered(write, "the report and health")

    # ------------------------------------------------------------------ ranks (several pods)
    async def _gather_ranks(self) -> None:
        """Until every worker holds its dies (its rank report Serving and fresh); then the
        instance is formed of them: its RoCE IPs every rank's, in rank order."""
        assert self.gang is not None
        self.phase = "WaitingForRanks"
        said: dict[int, str] = {}
        while waiting := self.gang.waiting(time.time()):
            if waiting != said:
                log.info(
                    "instance %s waits for rank(s) %s",
                    self.instance,
                    "; ".join(f"{k}: {why}" for k, why in sorted(waiting.items())),
                )
                said = waiting
            self.gang.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CHECK_SECONDS):
                    await self.gang.changed.wait()
        self.rank_entries = self.gang.form(own_entry(self.engine.config, self.incarnation))
        self.engine.form(instance_roce_ips(self.rank_entries))
        log.info(
            "instance %s formed of %d ranks: %s",
            self.instance,
            len(self.rank_entries),
            ", ".join(f"{e.rank}={e.pod}@{e.node}" for e in self.rank_entries),
        )
        self.phase = "Gathering"

    async def _keep_ranks(self) -> None:
        """While it serves, the instance's ranks: one lost, Faulty, stale or restarted makes the
        instance Faulty at once (as a die fault does); when every rank serves again, the
        instance re-forms (:meth:`reform`)."""
        assert self.gang is not None
        while True:
            now = time.time()
            faults = self.gang.faults(now)
            if faults or self.engine.devices.ranks_lost:
                # the ones seen before stay until the instance re-forms: its communicator is gone
                lost = {**self.engine.devices.ranks_lost, **faults}
                if lost != self.engine.devices.ranks_lost:
                    for fault in faults.values():
                        if fault not in self.engine.devices.ranks_lost.values():
                            log.warning("instance %s is faulty: %s", self.instance, fault.detail)
                    self.engine.rank_faults(lost)
                if not self.gang.waiting(now):
                    await self.reform()
                    continue
            self.gang.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CHECK_SECONDS):
                    await self.gang.changed.wait()

    async def reform(self) -> None:
        """Re-form the instance in this process once every rank serves again: the weights stay
        (the rank that restarted loaded its own share), the KV goes (every stream still open
        ends), and the leader takes a new incarnation, so its group sees someone else: it
        rejoins by the dynamic RoCE construction as a newcomer (report, map, links, serve).
        Meanwhile it is not ready and has no health (as a restarted engine has none)."""
        assert self.gang is not None
        # formed of the ranks as they are now, before anything awaits (they may change meanwhile:
        # the watch sees it once this instance serves again)
        self.incarnation = uuid.uuid4().hex[:16]
        self.rank_entries = self.gang.form(own_entry(self.engine.config, self.incarnation))
        self.engine.form(instance_roce_ips(self.rank_entries))
        self._forming = True
        self.ready = False
        self.phase = "Reforming"
        t0 = time.monotonic()
        try:
            dropped = self.engine.drop_streams(f"instance {self.instance} is re-forming")
            async with self._writes:
                await self.zk.run(self.zk.delete, self.paths.health_of(self.instance))
            log.info(
                "instance %s re-forms as incarnation %s (%d stream(s) ended): %s",
                self.instance,
                self.incarnation,
                dropped,
                ", ".join(f"{e.rank}={e.pod}@{e.node}" for e in self.rank_entries),
            )
            self.phase = "Gathering"
            await self._write_report()
            await self._wait(lambda: self._me() is not None)
            self.phase = "Linking"
            await self._link_all()
            self._seen_peers = self._peer_keys()
            self.engine.rank_faults({})
        finally:
            self._forming = False
        self.phase = "Serving"
        self.reforms += 1
        self.ready = True
        log.info(
            "instance %s serves again, re-formed in %.2f wall s",
            self.instance,
            time.monotonic() - t0,
        )
        await self._write_health()
