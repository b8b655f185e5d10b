"""The I/O layer alone, against scripted fakes: the shared ZooKeeper session
(``matrixserve.coordination``), the PDGroup's ZooKeeper store and the Kubernetes adapter, each
held to the rules the planner relies on (idempotent writes, 409/404/UID rules, no destructive
plan without coordination)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kazoo.client import KazooState
from kazoo.exceptions import BadVersionError, ConnectionLoss, NoNodeError, NotEmptyError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import RetryFailedError
from kubernetes import client

from fakes import FakeCore, FakeCustom, FakeKazoo, merge_patch
from matrixserve.adapters import kube as kube_adapter
from matrixserve.adapters.kube import KubeAdapter, status_patch
from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session, SessionState
from matrixserve.domain.observed import Taint, on_nodes
from matrixserve.domain.pdgroup.actions import DeleteEntrance, SetEntrance, WriteRoceMap

PATHS = zl.GroupPaths("ns", "g")


def session(fake: FakeKazoo | None = None, **kwargs: Any) -> Session:
    return Session("zk:2181", client=fake or FakeKazoo(), **kwargs)


# --------------------------------------------------------------------------- the session
def test_put_is_set_or_create_and_makes_parents_only_when_asked() -> None:
    fake = FakeKazoo()
    s = session(fake)
    with pytest.raises(NoNodeError):  # a deleted subtree is not brought back by a late write
        s.put("/a/b/c", b"1")
    s.put("/a/b/c", b"1", makepath=True)
    s.put("/a/b/c", b"2")
    assert fake.nodes["/a/b/c"][:2] == (b"2", 1)
    s.put("/a/b/e", b"x", ephemeral=True)
    assert fake.nodes["/a/b/e"][2] == fake.session


def test_an_owned_ephemeral_outlives_the_session_that_held_it_before() -> None:
    """A restarted engine finds its report held by its previous process's session, not expired
    yet: it takes the znode over, so that session's expiry does not take its report with it."""
    fake = FakeKazoo()
    fake.ensure_path("/g/reports")
    s = session(fake)
    fake.transition(KazooState.CONNECTED)
    fake.session = 41  # the previous process's session
    fake.create("/g/reports/e", b"old", ephemeral=True)
    fake.session = 42  # ours
    s.own("/g/reports/e", b"new")
    assert fake.nodes["/g/reports/e"] == (b"new", 0, 42)
    s.own("/g/reports/e", b"newer")  # ours already: a plain set
    assert fake.nodes["/g/reports/e"][:2] == (b"newer", 1)
    fake.expire(41)
    assert fake.nodes["/g/reports/e"][0] == b"newer"
    fake.expire()  # our own session: our ephemerals go with it
    assert "/g/reports/e" not in fake.nodes


def test_a_versioned_put_is_a_compare_and_set() -> None:
    fake = FakeKazoo()
    s = session(fake)
    s.put("/m", b"v1", makepath=True)
    s.put("/m", b"v2", version=0)
    with pytest.raises(BadVersionError):  # someone else wrote in between
        s.put("/m", b"v3", version=0)
    with pytest.raises(NoNodeError):  # a compare-and-set never creates
        s.put("/gone", b"x", version=0)
    assert fake.nodes["/m"][0] == b"v2"


def test_create_and_delete_are_idempotent() -> None:
    fake = FakeKazoo()
    s = session(fake)
    fake.ensure_path("/f")
    assert s.create("/f/link", b"first") is True
    assert s.create("/f/link", b"second") is False
    assert fake.nodes["/f/link"][0] == b"first"  # an existing znode is left as it is
    assert s.delete("/f/link") is True
    assert s.delete("/f/link") is False
    assert s.delete("/f", recursive=True) is True
    assert s.delete("/f", recursive=True) is False
    assert s.get("/f/link") is None
    assert s.children("/nowhere") == []


def test_apply_runs_layout_operations_in_order() -> None:
    fake = FakeKazoo()
    s = session(fake)
    s.apply([zl.Put("/x/y", b"1"), zl.Put("/x/y", b"2"), zl.Delete("/x/z"), zl.Delete("/x/y")])
    assert "/x/y" not in fake.nodes
    assert "/x" in fake.nodes
    s.apply([zl.Put("/x/y/z", b"1"), zl.Delete("/x", recursive=True)])
    assert "/x" not in fake.nodes


def test_states_reach_every_listener_and_connected_needs_connected() -> None:
    fake = FakeKazoo()
    s = session(fake)
    seen: list[SessionState] = []
    s.add_listener(seen.append)
    assert s.state is SessionState.CONNECTING
    assert not s.connected
    fake.transition(KazooState.CONNECTED)
    assert s.connected
    fake.transition(KazooState.SUSPENDED)
    assert not s.connected
    fake.expire()
    assert seen == [SessionState.CONNECTED, SessionState.SUSPENDED, SessionState.LOST]
    assert not s.connected


def test_retry_rides_out_connection_losses_until_its_deadline() -> None:
    fake = FakeKazoo()
    fake.ensure_path("/r")
    s = session(fake, retry_deadline=5.0)
    fake.fail["get"] = [ConnectionLoss(), ConnectionLoss()]
    assert s.retry(s.exists, "/r") is True  # exists does not fail: a plain call
    fake.nodes["/r"] = (b"data", 0, False)
    assert s.retry(s.get, "/r") == b"data"
    assert fake.calls.count(("get", "/r")) == 3
    short = session(fake, retry_deadline=0.3)
    fake.fail["get"] = [ConnectionLoss() for _ in range(100)]
    with pytest.raises(RetryFailedError):
        short.retry(short.get, "/r")


def test_a_session_suspended_past_its_timeout_starts_afresh_and_arms_its_watches_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ZooKeeper that lost its data refuses a client that saw a later zxid: the client stays
    SUSPENDED for ever. Past the session timeout the session is given up (LOST), a fresh client
    connects, and the watches still wanted are armed on it; a shorter suspension changes
    nothing."""
    first, fresh = FakeKazoo(), FakeKazoo(connect_on_start=False)  # the test connects it
    s = Session("zk:2181", timeout=0.3, client=first, client_factory=lambda: fresh)
    armed: list[tuple[Any, str]] = []
    monkeypatch.setattr(s, "_arm", lambda watch: armed.append((s.client, watch.path)))
    seen: list[SessionState] = []
    s.add_listener(seen.append)
    first.transition(KazooState.CONNECTED)
    s.watch_data("/g/roce-map", lambda data, stat: None)
    s.watch_children("/g/entrances", lambda children: None)
    s.watch_children("/g/gone", lambda children: False)  # a watch that stopped itself
    s._watches[-1].callback([])
    first.transition(KazooState.SUSPENDED)
    first.transition(KazooState.CONNECTED)  # back within the timeout: the same session
    time.sleep(0.5)
    assert s.client is first
    first.transition(KazooState.SUSPENDED)
    deadline = time.monotonic() + 3
    while s.client is first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.client is fresh
    assert s.renewals == 1
    while fresh.starts == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh.starts == 1
    assert seen[-1] is SessionState.LOST
    first.transition(KazooState.CONNECTED)  # the old client is not ours any more
    assert s.state is SessionState.LOST
    fresh.transition(KazooState.CONNECTED)
    deadline = time.monotonic() + 3
    while len(armed) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert armed[3:] == [(fresh, "/g/roce-map"), (fresh, "/g/entrances")]
    assert s.connected


async def test_connect_retries_until_it_works_each_try_on_a_fresh_client() -> None:
    """A try that did not connect in time gives its client up (stopped on a thread of its own,
    never waited on: kazoo's stop can block) and the next try starts a fresh one."""
    made_clients = [FakeKazoo() for _ in range(3)]
    made_clients[0].fail["start"] = [KazooTimeoutError("no server")]
    made_clients[1].fail["start"] = [KazooTimeoutError("no server")]
    fresh = iter(made_clients[1:])
    s = Session("zk:2181", client=made_clients[0], client_factory=lambda: next(fresh))
    retries: list[str] = []
    made: list[str] = []
    await s.connect(
        attempt_timeout=0.05,
        pause=0.01,
        then=lambda: made.append("folders"),
        on_retry=lambda exc: retries.append(str(exc)),
    )
    assert retries == ["ZooKeeper zk:2181: not connected within 0.05 s"] * 2
    assert [c.starts for c in made_clients] == [1, 1, 1]
    deadline = time.monotonic() + 3
    while [c.stops for c in made_clients] != [1, 1, 0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.stops for c in made_clients] == [1, 1, 0]
    assert s.client is made_clients[2]
    assert made == ["folders"]
    assert s.connected


async def test_connect_retries_when_the_first_step_after_connecting_fails() -> None:
    fake = FakeKazoo()
    s = session(fake)
    attempts = []

    def then() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionLoss()  # the session dropped right after connecting

    await s.connect(attempt_timeout=1, pause=0.01, then=then, on_retry=lambda exc: None)
    assert len(attempts) == 2


async def test_a_try_whose_next_step_failed_goes_on_with_a_fresh_client_the_old_one_lost() -> None:
    """The second reader of issue 31: a try whose ``then`` failed (the session dropped just
    after connecting) went on with the same, running client, and kazoo's ``start_async`` on a
    running client that is not live joins its thread for ever. Now that client is given up and
    said LOST, and the next try starts a fresh one; no client is started twice."""
    clients = [FakeKazoo(), FakeKazoo()]
    fresh = iter(clients[1:])
    s = Session("zk:2181", client=clients[0], client_factory=lambda: next(fresh))
    seen: list[SessionState] = []
    s.add_listener(seen.append)
    used: list[Any] = []

    def then() -> None:
        used.append(s.client)
        if len(used) == 1:
            raise ConnectionLoss()

    await s.connect(attempt_timeout=0.05, pause=0.01, then=then, on_retry=lambda exc: None)
    assert used == clients
    assert [c.starts for c in clients] == [1, 1]
    assert seen == [SessionState.CONNECTED, SessionState.LOST, SessionState.CONNECTED]
    assert s.connected


# --------------------------------------------------------------------------- the PDGroup store
def _report(name: str) -> zl.Report:
    return zl.Report(
        instance=name,
        podIP="127.64.0.2",
        port=8000,
        node="n",
        superpod="sp",
        dies=[0, 1],
        roceIps=["198.18.0.1", "198.18.0.2"],
        ts=0.0,
    )


def _connected_store() -> tuple[FakeKazoo, GroupStore]:
    fake = FakeKazoo()
    store = GroupStore(session(fake))
    fake.transition(KazooState.CONNECTED)
    return fake, store


async def test_a_snapshot_without_coordination_reads_nothing() -> None:
    fake = FakeKazoo()
    store = GroupStore(session(fake))
    view = await store.snapshot("ns", "g")
    assert view.connected is False
    assert fake.calls == []


async def test_a_snapshot_reads_the_subtree_and_skips_unreadable_znodes() -> None:
    fake, store = _connected_store()
    await store.ensure("ns", "g")
    fake.create(PATHS.report("g-p-0"), _report("g-p-0").dump())
    fake.create(PATHS.report("g-d-0"), b"{not json")
    assert (await store.snapshot("ns", "g")).entrances_present is False  # until the first one
    fake.create(PATHS.entrance("g-p-0"), b"", makepath=True)
    fake.create(PATHS.removed_of("g-d-1"), b"")
    view = await store.snapshot("ns", "g")
    assert view.connected is True
    assert view.present is True
    assert view.entrances_present is True
    assert set(view.reports) == {"g-p-0"}
    assert view.entrances == {"g-p-0"}
    assert view.removed == {"g-d-1"}
    assert view.roce_map is None
    assert view.decode_meta is None


async def test_a_connection_lost_mid_read_plans_as_disconnected() -> None:
    fake, store = _connected_store()
    await store.ensure("ns", "g")
    fake.fail["get_children"] = [ConnectionLoss()]
    assert (await store.snapshot("ns", "g")).connected is False


async def test_actions_write_their_znodes_and_refuse_without_coordination() -> None:
    fake, store = _connected_store()
    roce_map = zl.build_roce_map([_report("g-p-0")], {"g-p-0": zl.Role.PREFILL}, version=3)
    await store.apply("ns", "g", WriteRoceMap(roce_map, ("g-p-0",), ()))
    assert zl.RoceMap.parse(fake.nodes[PATHS.roce_map][0]).version == 3
    entrance = zl.Entrance(instance="g-p-0", podIP="127.64.0.2", port=8000)
    await store.apply("ns", "g", SetEntrance(entrance))
    assert PATHS.entrance("g-p-0") in fake.nodes
    await store.apply("ns", "g", DeleteEntrance("g-p-0"))
    await store.apply("ns", "g", DeleteEntrance("g-p-0"))  # already gone: fine
    assert PATHS.entrance("g-p-0") not in fake.nodes
    fake.transition(KazooState.SUSPENDED)
    with pytest.raises(ConnectionError):
        await store.apply("ns", "g", DeleteEntrance("g-p-0"))


async def test_deleting_a_group_prunes_its_namespace_folder_only_when_empty() -> None:
    fake, store = _connected_store()
    await store.ensure("ns", "g")
    await store.ensure("ns", "h")
    assert await store.delete("ns", "g") is True
    assert zl.group_path("ns", "h") in fake.nodes
    assert await store.delete("ns", "h") is True
    assert zl.group_path("ns", "h").rsplit("/", 1)[0] not in fake.nodes
    assert await store.delete("ns", "h") is False


async def test_a_group_deletion_goes_again_when_an_engine_wrote_meanwhile() -> None:
    """A still running engine's report lands between the listing and its folder's deletion
    (NotEmptyError): the deletion goes again at once, not after kopf's 60 s back-off."""
    fake, store = _connected_store()
    await store.ensure("ns", "g")
    fake.fail["delete"] = [NotEmptyError(), NotEmptyError()]
    assert await store.delete("ns", "g") is True
    assert zl.group_path("ns", "g") not in fake.nodes


def test_watches_end_at_unwatch_even_when_the_group_is_watched_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kazoo keeps a watcher until it returns False: an unwatched group's old watchers must
    stop, or every recreation of the group would add a set of them."""
    _, store = _connected_store()
    armed: list[Any] = []
    monkeypatch.setattr(
        store.session, "watch_children", lambda path, fn, send_event=False: armed.append(fn)
    )
    monkeypatch.setattr(store.session, "watch_data", lambda path, fn: armed.append(fn))
    woken: list[str] = []
    store.watch("ns", "g", lambda: woken.append("first"))
    first = list(armed)
    assert len(first) == 6  # five folders (health's own callback) and the map
    store.unwatch("ns", "g")
    armed.clear()
    store.watch("ns", "g", lambda: woken.append("second"))
    assert all(fire() is False for fire in first)
    assert woken == []
    assert armed[0]() is True
    assert woken == ["second"]


def test_a_health_turning_faulty_wakes_the_group_and_a_mere_refresh_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 17: a fault an engine reports in its health (a die down, a hang, a blocked link)
    must wake the operator at once, not at the next resync; a refresh (seq, ts) must not."""
    _, store = _connected_store()
    armed: dict[str, Any] = {}
    cancelled: list[str] = []

    def watch(path: str, fn: Any, send_event: bool = False) -> str:
        armed[path] = fn
        return path

    monkeypatch.setattr(store.session, "watch_children", watch)
    monkeypatch.setattr(store.session, "watch_data", watch)
    monkeypatch.setattr(store.session, "cancel", cancelled.append)
    woken: list[int] = []
    store.watch("ns", "g", lambda: woken.append(1))
    paths = zl.GroupPaths("ns", "g")
    assert armed[paths.health](["g-d-0"]) is True  # a member came: watched, and the group woken
    assert len(woken) == 1
    data = armed[paths.health_of("g-d-0")]

    def health(seq: int, state: zl.HealthState, **extra: Any) -> bytes:
        return zl.Health(
            instance="g-d-0", role=zl.Role.DECODE, state=state, seq=seq, ts=float(seq),
            podIP="127.0.0.2", port=8000, incarnation="i1", **extra,
        ).dump()  # fmt: skip

    assert data(health(1, zl.HealthState.SERVING), None) is True  # its first read
    assert data(health(2, zl.HealthState.SERVING), None) is True  # a refresh
    assert len(woken) == 1
    fault = zl.EngineFault(kind=zl.EngineFaultKind.DIE, since=3.0, dies=[1])
    assert data(health(3, zl.HealthState.FAULTY, faults=[fault]), None) is True
    assert len(woken) == 2
    assert armed[paths.health]([]) is True  # it left: its data watch ends
    assert cancelled == [paths.health_of("g-d-0")]
    store.unwatch("ns", "g")
    assert data(health(4, zl.HealthState.SERVING), None) is False  # kazoo drops it


# --------------------------------------------------------------------------- Kubernetes
def kube() -> tuple[KubeAdapter, FakeCore, FakeCustom]:
    adapter = KubeAdapter(client.ApiClient())
    core, custom = FakeCore(), FakeCustom()
    adapter.core, adapter.custom = core, custom
    return adapter, core, custom


def _pod(name: str, uid: str, group: str = "g", **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": {kinds.LABEL_GROUP: group, kinds.LABEL_INSTANCE: name},
            "creationTimestamp": datetime(2026, 1, 1, tzinfo=UTC),
            **extra.get("meta", {}),
        },
        "spec": {"nodeName": extra.get("node")},
        "status": {"phase": "Running", "conditions": extra.get("conditions", [])},
    }


async def test_creating_an_existing_pod_is_success_without_a_change() -> None:
    adapter, core, _ = kube()
    assert await adapter.create_pod("ns", _pod("p", "u1")) is True
    assert await adapter.create_pod("ns", _pod("p", "u2")) is False
    assert core.pods[("ns", "p")]["metadata"]["uid"] == "u1"


async def test_a_delete_carries_the_uid_so_a_recreated_pod_survives() -> None:
    adapter, core, _ = kube()
    core.pods[("ns", "p")] = _pod("p", "new-uid")
    assert await adapter.delete_pod("ns", "p", "old-uid") is False  # 409: not the one we meant
    assert ("ns", "p") in core.pods
    assert await adapter.delete_pod("ns", "p", "new-uid") is True
    assert await adapter.delete_pod("ns", "p", "new-uid") is False  # 404: already gone
    assert core.deletes[-1] == ("ns", "p", "new-uid")


async def test_get_of_a_missing_object_is_none_and_other_errors_raise() -> None:
    adapter, _, custom = kube()
    assert await adapter.get(kinds.PDGROUP, "ns", "g") is None
    key = (kinds.GROUP, kinds.VERSION, "ns", kinds.PDGROUP.plural, "g")
    custom.objects[key] = {"metadata": {"name": "g"}}
    assert await adapter.get(kinds.PDGROUP, "ns", "g") == {"metadata": {"name": "g"}}

    def broken(*_: Any, **__: Any) -> None:
        raise client.ApiException(status=500, reason="boom")

    custom.get_namespaced_custom_object = broken
    with pytest.raises(client.ApiException):
        await adapter.get(kinds.PDGROUP, "ns", "g")


async def test_status_patches_omit_empty_strings_and_tolerate_a_deleted_object() -> None:
    adapter, _, custom = kube()
    await adapter.patch_status(kinds.PDGROUP, "ns", "gone", {"x": 1})  # 404: deleted meanwhile
    key = (kinds.GROUP, kinds.VERSION, "ns", kinds.PDGROUP.plural, "g")
    custom.objects[key] = {}
    status = {"instances": [{"name": "a", "pod": "", "node": "n"}], "message": "", "n": 0}
    await adapter.patch_status(kinds.PDGROUP, "ns", "g", status)
    assert custom.patches[-1] == (
        key,
        {"status": {"instances": [{"name": "a", "node": "n"}], "n": 0}},
    )


def test_a_status_patch_carries_only_what_changed_and_deletes_what_a_record_no_longer_has() -> None:
    """A record rewritten with fewer keys (a relink's plan after a replacement's) must not keep
    the old keys: a plain merge patch of the new status would (issue 17's lastRecovery did)."""
    old = {
        "observedGeneration": 1,
        "kept": "as is",
        "lastRecovery": {"plan": {"action": "Replace", "terms": {"podStart": 1, "relink": 0}}},
        "entrances": ["g-p-0"],
    }
    new = {
        "observedGeneration": 1,
        "lastRecovery": {"plan": {"action": "Relink", "terms": {"relink": 0.5}}},
        "entrances": ["g-p-0"],
        "message": "",
    }
    patch = status_patch(old, new)
    assert patch == {
        "lastRecovery": {"plan": {"action": "Relink", "terms": {"podStart": None, "relink": 0.5}}}
    }
    stored = merge_patch(old, patch)
    assert stored["lastRecovery"] == new["lastRecovery"]
    assert stored["kept"] == "as is"  # a top-level key the status does not name is left alone
    assert status_patch(stored, new) == {}  # settled: nothing to patch
    assert status_patch(stored, {"kept": None}) == {"kept": None}  # None at the top deletes
    assert status_patch({"a": {"b": 1}}, {"a": {"b": 1, "c": ""}}) == {}  # "" is absent


async def test_pods_are_listed_by_labels_and_each_nodes_superpod_read_once() -> None:
    adapter, core, _ = kube()
    core.nodes["n1"] = {kinds.LABEL_SUPERPOD: "sp3"}
    ready = [{"type": "Ready", "status": "True"}]
    core.pods[("ns", "g-p-0")] = _pod("g-p-0", "u0", node="n1", conditions=ready)
    core.pods[("ns", "g-d-0")] = _pod(
        "g-d-0", "u1", node="n1", meta={"deletionTimestamp": datetime(2026, 1, 2, tzinfo=UTC)}
    )
    core.pods[("ns", "other")] = _pod("other", "u2", group="h")
    pods = await adapter.list_pods("ns", {kinds.LABEL_GROUP: "g"})
    assert sorted(pods) == ["g-d-0", "g-p-0"]
    assert core.selectors == [f"{kinds.LABEL_GROUP}=g"]
    p0, d0 = pods["g-p-0"], pods["g-d-0"]
    assert (p0.ready, p0.deleting, p0.superpod, p0.node) == (True, False, "sp3", "n1")
    assert (d0.ready, d0.deleting) == (False, True)
    assert p0.label(kinds.LABEL_INSTANCE) == "g-p-0"
    assert p0.created_at == datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    assert (p0.running_since, p0.ready_changed_at) == (None, None)
    await adapter.list_pods("ns", {kinds.LABEL_GROUP: "g"})
    assert core.node_reads == 1  # a node's SuperPod is fixed by its hardware


async def test_a_pods_container_start_and_its_last_ready_flip_are_read() -> None:
    """What tells a pod not probed yet since its engine started from one that failed its
    probe (:meth:`PodView.awaiting_first_probe`)."""
    adapter, core, _ = kube()
    flipped, started = (
        datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC),
        datetime(2026, 1, 1, 0, 0, 7, tzinfo=UTC),
    )
    body = _pod(
        "g-p-0",
        "u0",
        conditions=[{"type": "Ready", "status": "False", "lastTransitionTime": flipped}],
    )
    # the kubelet lists containers by name: a sidecar may come before the engine
    body["status"]["containerStatuses"] = [
        {"name": "a-sidecar", "startedAt": flipped},
        {"name": "engine", "startedAt": started},
    ]
    core.pods[("ns", "g-p-0")] = body
    pod = (await adapter.list_pods("ns", {kinds.LABEL_GROUP: "g"}))["g-p-0"]
    assert (pod.ready, pod.running_since, pod.ready_changed_at) == (
        False,
        started.timestamp(),
        flipped.timestamp(),
    )
    assert pod.awaiting_first_probe(started.timestamp() + 0.5)
    assert not pod.awaiting_first_probe(started.timestamp() - 0.5)  # an earlier engine's report
    body["status"]["containerStatuses"] = [{"name": "engine"}]  # exited: not running
    pod = (await adapter.list_pods("ns", {kinds.LABEL_GROUP: "g"}))["g-p-0"]
    assert pod.running_since is None
    assert not pod.awaiting_first_probe(started.timestamp() + 0.5)


@pytest.mark.parametrize(
    ("message", "backoff"),
    [
        ("back-off 10s restarting failed container=engine pod=g-d-0_ns(u0)", 10.0),
        ("back-off 2m40s restarting failed container=engine pod=g-d-0_ns(u0)", 160.0),
        ("back-off 0.5s restarting failed container=engine pod=g-d-0_ns(u0)", 0.5),
        ("something the kubelet never says", None),
    ],
)
async def test_an_exited_engine_is_seen_with_its_restarts_exit_and_the_kubelets_back_off(
    message: str, backoff: float | None
) -> None:
    """Issue 17's pod tier: the engine container's restarts, when it last ended, and the
    back-off the kubelet says it waits (a Go duration in its CrashLoopBackOff message): what
    a restart in place would cost."""
    adapter, core, _ = kube()
    finished = datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC)
    body = _pod("g-d-0", "u0")
    body["status"]["containerStatuses"] = [
        {
            "name": "engine",
            "restartCount": 2,
            "finishedAt": finished,
            "waiting": {"reason": "CrashLoopBackOff", "message": message},
        }
    ]
    core.pods[("ns", "g-d-0")] = body
    pod = (await adapter.list_pods("ns", {kinds.LABEL_GROUP: "g"}))["g-d-0"]
    assert (pod.restarts, pod.last_exit_at, pod.restart_backoff) == (
        2,
        finished.timestamp(),
        backoff,
    )


async def test_nodes_say_which_server_is_down_since_when_and_pods_are_seen_on_them() -> None:
    """Issue 17's node tier, read with the ``list`` the operator's ClusterRole grants (never
    ``nodes/status``): a server not Ready is down since its Ready condition flipped, and one
    list serves every group's pass while it is fresh enough."""
    adapter, core, _ = kube()
    core.nodes = {"n1": {}, "n2": {}}
    down_at = datetime(2026, 1, 1, 0, 0, 3, tzinfo=UTC)
    core.nodes_down = {"n2": down_at}
    core.pods[("ns", "g-p-0")] = _pod("g-p-0", "u0", node="n1")
    core.pods[("ns", "g-d-0")] = _pod("g-d-0", "u1", node="n2")
    nodes = await adapter.nodes()
    assert (nodes["n1"].ready, nodes["n1"].down_since) == (True, None)
    assert (nodes["n2"].ready, nodes["n2"].down_since) == (False, down_at.timestamp())
    pods = on_nodes(await adapter.list_pods("ns", {kinds.LABEL_GROUP: "g"}), nodes)
    assert pods["g-d-0"].node_down_since == down_at.timestamp()
    assert pods["g-p-0"].node_down_since is None
    core.nodes_down = {}
    assert (await adapter.nodes())["n2"].down_since is not None  # the shared list, still fresh
    assert (await adapter.nodes(max_age=0.0))["n2"].down_since is None  # read afresh


async def test_nodes_say_whether_they_are_cordoned_and_how_they_are_tainted() -> None:
    """Issue 31: recovery counts NPUs only where a new pod may go, so the view keeps what keeps
    pods off a server: a cordon, each taint (an NPU fault's among others'), and its labels."""
    adapter, core, _ = kube()
    core.nodes = {"n1": {kinds.LABEL_SUPERPOD: "sp1"}, "n2": {}, "n3": {}}
    core.node_specs = {
        "n2": client.V1NodeSpec(unschedulable=True),
        "n3": client.V1NodeSpec(
            taints=[
                client.V1Taint(key=kinds.TAINT_NPU_FAULT, value="npu-3", effect="NoSchedule"),
                client.V1Taint(key="example.com/soft", effect="PreferNoSchedule"),
            ]
        ),
    }
    nodes = await adapter.nodes()
    assert (nodes["n1"].cordoned, nodes["n1"].taints, nodes["n1"].schedulable) == (
        (False, (), True)
    )
    assert nodes["n1"].labels[kinds.LABEL_SUPERPOD] == "sp1"
    assert (nodes["n2"].cordoned, nodes["n2"].schedulable) == (True, False)
    assert nodes["n3"].taints == (
        Taint(kinds.TAINT_NPU_FAULT, "npu-3", "NoSchedule"),
        Taint("example.com/soft", "", "PreferNoSchedule"),
    )
    assert not nodes["n3"].schedulable


def test_the_fake_kazoo_keeps_zookeepers_rules() -> None:
    """The fake itself must refuse what ZooKeeper refuses, or the tests above prove nothing."""
    fake = FakeKazoo()
    with pytest.raises(NoNodeError):
        fake.create("/a/b", b"")
    fake.create("/a/b", b"", makepath=True)
    with pytest.raises(NotEmptyError):
        fake.delete("/a")
    fake.set("/a/b", b"x")
    with pytest.raises(BadVersionError):
        fake.set("/a/b", b"y", version=0)
    with pytest.raises(NoNodeError):
        fake.delete("/nowhere")
    fake.delete("/nowhere", recursive=True)  # as kazoo's: silent for an absent path


async def test_a_gated_pinned_pod_created_is_its_servers_reservation_in_the_cached_usage() -> None:
    """Gang placement: the next pass within the usage cache's age must not give the NPUs of a
    pod just created, gated and pinned, to someone else (the list it caches predates it)."""
    adapter, _, _ = kube()
    adapter._usage = (adapter._clock(), {"s1": 8})

    def pod(name: str, pinned: bool) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "containers": [{"resources": {"limits": {kinds.NPU_RESOURCE: "4"}}}],
            "schedulingGates": [{"name": kinds.GANG_GATE}],
        }
        if pinned:
            spec["nodeSelector"] = {kinds.LABEL_SERVER: "s2"}
        return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec}

    assert await adapter.create_pod("ns", pod("a", pinned=True))
    assert await adapter.npus_in_use() == {"s1": 8, "s2": 4}
    assert not await adapter.create_pod("ns", pod("a", pinned=True))  # 409: nothing new
    assert await adapter.create_pod("ns", pod("b", pinned=False))  # where: the scheduler's
    assert await adapter.npus_in_use() == {"s1": 8, "s2": 4}


def local_kubeconfig(path: Path, address: str) -> str:
    """A kubeconfig for an API server at ``address`` (host:port, plain HTTP, a token)."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://{address}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


async def test_every_api_call_is_bounded_when_the_api_server_stops_answering(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An API server that takes the connection and never answers: each call fails within its
    bound (the pass fails and is retried) instead of holding the pass and its thread for ever."""
    monkeypatch.setattr(kube_adapter, "REQUEST_TIMEOUT", (0.5, 1.0))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
    try:
        # the operator's own configuration (its retries: a read that timed out is not retried)
        kubeconfig = local_kubeconfig(
            tmp_path / "kubeconfig", f"127.0.0.1:{silent.getsockname()[1]}"
        )
        adapter = KubeAdapter(kube_adapter.api_client(kubeconfig))
        calls = {
            "get": adapter.get(kinds.PDGROUP, "ns", "g"),
            "objects": adapter.objects(kinds.PDGROUP, "ns"),
            "names": adapter.names(kinds.PDGROUP, ["ns"]),
            "list_pods": adapter.list_pods("ns", {"a": "b"}),
            "nodes": adapter.nodes(),
            "patch_status": adapter.patch_status(kinds.PDGROUP, "ns", "g", {"x": 1}),
            "delete_pod": adapter.delete_pod("ns", "p", "uid"),
        }
        for what, call in calls.items():
            began = time.monotonic()
            try:
                await asyncio.wait_for(call, 10)
            except TimeoutError:
                pytest.fail(f"{what} hung")
            except urllib3.exceptions.HTTPError:  # the read timed out: the pass fails
                pass
            else:
                pytest.fail(f"{what} returned without an answer")
            took = time.monotonic() - began
            assert took < 2.5, (what, took)  # one read's bound, not one per retry
    finally:
        silent.close()
