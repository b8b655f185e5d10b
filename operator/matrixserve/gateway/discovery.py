"""Where to send a scenario's requests: PDGroups from Kubernetes (scenario, TTFT SLO, prefill
slots), entrances from ZooKeeper (watched, not polled). A prefill leaving ``entrances/`` stops
getting new requests as soon as the watch fires.

Each PDGroup's spec is parsed once per event into :class:`PDGroupSpec`. A spec that does not
validate (the admission webhook can be off, and the operator keeps serving a group whose new spec
is invalid) does not drop a working route: the group keeps being routed by its last valid spec,
with its current entrances, and the gateway says so once per generation. A group this gateway
never saw valid (it started while the group's spec was invalid) is routed by what routing needs
of the spec (scenario, SLO, prefill slots) when those parse on their own: the operator keeps
that group serving, so the gateway keeps it reachable.

While the gateway has no ZooKeeper connection (suspended or lost session, or ZooKeeper not reached
yet), each group's entrances come from its PDGroup status instead (``status.entrances`` and the
instances' ``endpoint``): the last state the operator published, kept current by the same
Kubernetes watch. Once the session is back, kazoo re-arms the children watches and ZooKeeper
is the source again. The session is the shared one (:mod:`matrixserve.coordination`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from matrixserve import coordination
from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import PDGROUP
from matrixserve.api.resources import (
    DEFAULT_BATCH,
    SLO,
    BatchSize,
    DnsLabel,
    PDGroupSpec,
    field_errors,
)
from matrixserve.domain.gateway.routing import Entrance, entrances_from_status

log = logging.getLogger("matrixserve.gateway")


class _Slots(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    batch_size: BatchSize = Field(default=DEFAULT_BATCH, alias="batchSize")


class RoutingFields(BaseModel):
    """What routing needs of a PDGroup spec, with the API's own field rules, read on its own
    when the whole spec does not validate."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    scenario: DnsLabel
    slo: SLO = SLO()
    prefill: _Slots = Field(default_factory=_Slots)


@dataclass
class GroupRoute:
    namespace: str
    name: str
    scenario: str
    ttft_ms: int | None
    ttft_per_1k_ms: int  # spec.slo.ttftMillisecondsPer1kTokens
    prefill_batch: int  # spec.prefill.batchSize: slots per prefill
    entrances: list[Entrance] = field(default_factory=list)  # what requests use
    zk_entrances: list[Entrance] | None = None  # from the children watch; None: not (re)read yet
    status_entrances: list[Entrance] = field(default_factory=list)  # from the PDGroup status
    watched: bool = False
    generation: int = 0  # bumped when the session is lost: older watches then stop
    watch: Any = None  # the session's entrance watch, cancelled when replaced or the group goes

    def settle(self, spec: PDGroupSpec | RoutingFields) -> None:
        """Take the routing settings of a (valid) spec."""
        self.scenario = spec.scenario
        self.ttft_ms = spec.slo.ttft_milliseconds
        self.ttft_per_1k_ms = spec.slo.ttft_per_1k_tokens
        self.prefill_batch = spec.prefill.batch_size


def _routing_fields(raw: Any) -> RoutingFields | None:
    try:
        return RoutingFields.model_validate(raw or {})
    except ValidationError:
        return None


class Discovery:
    def __init__(
        self, api: client.ApiClient, zk: coordination.Session, namespace: str | None = None
    ) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.zk = zk
        self.namespace = namespace
        self.groups: dict[tuple[str, str], GroupRoute] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._arm = threading.Event()
        self.synced = threading.Event()
        self.zk_connected = False
        self._invalid: dict[tuple[str, str], object] = {}  # the generation last said invalid
        self.on_session_lost: Callable[[], None] = lambda: None  # from kazoo's thread
        zk.add_listener(self._zk_state)  # first, then the state: no transition goes unseen
        with self.lock:
            self.zk_connected = zk.connected

    def start(self) -> None:
        threading.Thread(target=self._watch_groups, daemon=True, name="pdgroup-watch").start()
        threading.Thread(target=self._arm_watches, daemon=True, name="entrance-watch").start()

    def stop(self) -> None:
        self._stop.set()
        self._arm.set()

    @property
    def source(self) -> str:
        return "zookeeper" if self.zk_connected else "status"

    def routes(self, scenario: str) -> list[GroupRoute]:
        with self.lock:
            return [g for g in self.groups.values() if g.scenario == scenario]

    def scenarios(self) -> list[str]:
        with self.lock:
            return sorted({g.scenario for g in self.groups.values()})

    # ------------------------------------------------------------------ Kubernetes
    def _list_call(self) -> tuple[Any, tuple[str, ...]]:
        """The list function and its arguments (for the listing and for the watch)."""
        kind = PDGROUP
        if self.namespace:
            return self.custom.list_namespaced_custom_object, (
                kind.group,
                kind.version,
                self.namespace,
                kind.plural,
            )
        return self.custom.list_cluster_custom_object, (kind.group, kind.version, kind.plural)

    def _watch_groups(self) -> None:
        func, args = self._list_call()
        while not self._stop.is_set():
            try:
                listing = func(*args, _request_timeout=(5.0, 30.0))
                seen = set()
                for obj in listing.get("items", []):
                    seen.add(self._upsert(obj))
                with self.lock:
                    for key in [k for k in self.groups if k not in seen]:
                        self._drop(key)
                self.synced.set()
                stream = watch.Watch()
                for event in stream.stream(
                    func,
                    *args,
                    resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=240,
                    # a connection that goes silent is dropped (then relisted), not waited on
                    _request_timeout=(5.0, 270.0),
                ):
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                        self._invalid.pop(key, None)
                        with self.lock:
                            self._drop(key)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._upsert(obj)
                    if self._stop.is_set():
                        stream.stop()
            except Exception as exc:  # API restarts, 410 Gone: relist
                if self._stop.is_set():
                    return
                log.warning("PDGroup watch restarting: %s", exc)
                time.sleep(1)

    def _drop(self, key: tuple[str, str]) -> None:
        """Forget a group that is gone (caller holds the lock), its entrance watch with it."""
        route = self.groups.pop(key, None)
        if route is not None and route.watch is not None:
            self.zk.cancel(route.watch)

    def _upsert(self, obj: dict[str, Any]) -> tuple[str, str]:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        spec = self._parse(key, meta.get("generation"), obj.get("spec"))
        with self.lock:
            route = self.groups.get(key)
            settings: PDGroupSpec | RoutingFields | None = spec
            if route is None and spec is None:  # never valid here: what routing needs of it
                settings = _routing_fields(obj.get("spec"))
                if settings is None:
                    return key  # not even a scenario to route it by
            if route is None:
                route = GroupRoute(key[0], key[1], "", None, 0, 0)
                self.groups[key] = route
            if settings is not None:
                route.settle(settings)
            route.status_entrances = entrances_from_status(obj.get("status"))
            self._refresh(route)
            if not route.watched:
                self._arm.set()
        return key

    def _parse(self, key: tuple[str, str], generation: object, raw: Any) -> PDGroupSpec | None:
        """The group's spec, or None if it does not validate (said once per generation)."""
        try:
            return PDGroupSpec.model_validate(raw or {})
        except ValidationError as exc:
            if self._invalid.get(key) != generation:
                self._invalid[key] = generation
                errors = "; ".join(field_errors(exc))
                with self.lock:
                    routed = key in self.groups
                log.warning(
                    "PDGroup %s/%s generation %s: invalid spec (%s); %s",
                    *key,
                    generation,
                    errors,
                    "still routed by its last valid spec"
                    if routed
                    else "routed by its scenario and SLO alone, if they are valid",
                )
            return None

    def _refresh(self, route: GroupRoute) -> None:
        """Pick the route's entrances from its current source (caller holds the lock)."""
        if self.zk_connected and route.zk_entrances is not None:
            route.entrances = route.zk_entrances
        else:
            route.entrances = route.status_entrances

    # ------------------------------------------------------------------ ZooKeeper
    def _zk_state(self, state: coordination.SessionState) -> None:
        """kazoo's connection listener (its own thread; must not block or call ZooKeeper)."""
        with self.lock:
            self.zk_connected = state is coordination.SessionState.CONNECTED
            for route in self.groups.values():
                if state is coordination.SessionState.LOST:
                    # The session's watches are gone, and kazoo's re-armed ChildrenWatch would
                    # not report unchanged children: arm a fresh watch (new generation) and
                    # route by status until it has read the entrances.
                    route.zk_entrances = None
                    route.watched = False
                    route.generation += 1
                self._refresh(route)
        if state is coordination.SessionState.LOST:
            self.on_session_lost()
        if self.zk_connected:
            self._arm.set()
            log.info("ZooKeeper connected: routing by ZooKeeper entrances")
        else:
            log.warning("ZooKeeper %s: routing by PDGroup status", state)

    def _arm_watches(self) -> None:
        """Arm the entrance watch of every group that has none, whenever ZooKeeper is connected."""
        while not self._stop.is_set():
            self._arm.wait()
            self._arm.clear()
            if self._stop.is_set():
                return
            with self.lock:
                pending = [r for r in self.groups.values() if not r.watched]
            for route in pending:
                if not self.zk_connected:
                    break
                try:
                    self._watch_entrances(route)
                    route.watched = True
                except coordination.ERRORS as exc:  # lost again mid-way: retried on reconnect
                    log.warning(
                        "entrance watch for %s/%s not armed: %s", route.namespace, route.name, exc
                    )

    def _watch_entrances(self, route: GroupRoute) -> None:
        paths = zl.GroupPaths(route.namespace, route.name)
        generation = route.generation

        def changed(children: list[str]) -> bool:
            if route.generation != generation:
                return False  # a newer watch (after a lost session) owns this route
            entrances = []
            for child in sorted(children):
                raw = self.zk.get(paths.entrance(child))
                try:
                    e = zl.Entrance.parse(raw or b"")
                except ValueError:  # gone meanwhile, or unreadable
                    continue
                entrances.append(Entrance(e.instance, f"{e.pod_ip}:{e.port}"))
            with self.lock:
                if route.generation != generation:
                    return False
                route.zk_entrances = entrances
                self._refresh(route)
                alive = self.groups.get((route.namespace, route.name)) is route
            return alive  # False stops the watch once the group is gone

        if route.watch is not None:
            self.zk.cancel(route.watch)  # the previous session's
        route.watch = self.zk.watch_children(paths.entrances, changed)
