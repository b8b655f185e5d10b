"""Where to send a scenario's requests: PDGroups from Kubernetes (scenario, TTFT SLO), entrances
from ZooKeeper (watched, not polled). A prefill leaving ``entrances/`` stops getting new requests
as soon as the watch fires."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.recipe.watchers import ChildrenWatch
from kubernetes import client, watch

from matrixserve.api import zk_layout as zl
from matrixserve.domain.forwarding import Entrance

log = logging.getLogger("matrixserve.gateway")


@dataclass
class GroupRoute:
    namespace: str
    name: str
    scenario: str
    ttft_ms: int | None
    entrances: list[Entrance] = field(default_factory=list)


class Discovery:
    def __init__(
        self, api: client.ApiClient, zk: KazooClient, namespace: str | None = None
    ) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.zk = zk
        self.namespace = namespace
        self.groups: dict[tuple[str, str], GroupRoute] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.synced = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch_groups, daemon=True, name="pdgroup-watch").start()

    def stop(self) -> None:
        self._stop.set()

    def routes(self, scenario: str) -> list[GroupRoute]:
        with self._lock:
            return [g for g in self.groups.values() if g.scenario == scenario]

    def scenarios(self) -> list[str]:
        with self._lock:
            return sorted({g.scenario for g in self.groups.values()})

    # ------------------------------------------------------------------ Kubernetes
    def _list(self) -> Any:
        if self.namespace:
            return self.custom.list_namespaced_custom_object(
                "matrixserve.io", "v1alpha1", self.namespace, "pdgroups"
            )
        return self.custom.list_cluster_custom_object("matrixserve.io", "v1alpha1", "pdgroups")

    def _watch_groups(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self._list()
                seen = set()
                for obj in listing.get("items", []):
                    seen.add(self._upsert(obj))
                with self._lock:
                    for key in [k for k in self.groups if k not in seen]:
                        del self.groups[key]
                self.synced.set()
                func = (
                    self.custom.list_namespaced_custom_object
                    if self.namespace
                    else self.custom.list_cluster_custom_object
                )
                args = (
                    ("matrixserve.io", "v1alpha1", self.namespace, "pdgroups")
                    if self.namespace
                    else ("matrixserve.io", "v1alpha1", "pdgroups")
                )
                stream = watch.Watch()
                for event in stream.stream(
                    func,
                    *args,
                    resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=240,
                ):
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        with self._lock:
                            self.groups.pop(
                                (obj["metadata"]["namespace"], obj["metadata"]["name"]), None
                            )
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._upsert(obj)
                    if self._stop.is_set():
                        stream.stop()
            except Exception as exc:  # API restarts, 410 Gone: relist
                if self._stop.is_set():
                    return
                log.warning("PDGroup watch restarting: %s", exc)
                time.sleep(1)

    def _upsert(self, obj: dict[str, Any]) -> tuple[str, str]:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        key = (meta["namespace"], meta["name"])
        ttft = (spec.get("slo") or {}).get("ttftMilliseconds")
        new = False
        with self._lock:
            route = self.groups.get(key)
            if route is None:
                route = GroupRoute(key[0], key[1], spec.get("scenario", ""), ttft)
                self.groups[key] = route
                new = True
            route.scenario, route.ttft_ms = spec.get("scenario", ""), ttft
        if new:  # outside the lock: kazoo calls the watch back at once, in this thread
            self._watch_entrances(route)
        return key

    # ------------------------------------------------------------------ ZooKeeper
    def _watch_entrances(self, route: GroupRoute) -> None:
        paths = zl.GroupPaths(route.namespace, route.name)
        self.zk.ensure_path(paths.entrances)

        def changed(children: list[str]) -> bool:
            entrances = []
            for child in sorted(children):
                try:
                    raw, _ = self.zk.get(paths.entrance(child))
                    e = zl.Entrance.parse(raw)
                    entrances.append(Entrance(e.instance, f"{e.pod_ip}:{e.port}"))
                except (NoNodeError, ValueError):
                    continue
            with self._lock:
                route.entrances = entrances
                alive = (route.namespace, route.name) in self.groups
            return alive  # False stops the watch once the group is gone

        ChildrenWatch(self.zk, paths.entrances, changed)
