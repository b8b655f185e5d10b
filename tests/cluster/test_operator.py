"""The PDGroup operator on the local cluster, with real ZooKeeper and engine stubs on emulated
NPU servers: setup, scale-out and scale-in by dynamic RoCE construction, invalid specs, deletion,
an operator restart mid-setup."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient
from kubernetes import client, watch

from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.helpers import (
    Groups,
    absent,
    events_of,
    pdgroup_body,
    wait_for,
    zookeeper,
    zookeeper_auth,
)


def started_at(pod: client.V1Pod) -> str:
    state = pod.status.container_statuses[0].state
    return str(state.running.started_at) if state.running else ""


def identities(pods: dict[str, client.V1Pod]) -> dict[str, tuple[str, str, int]]:
    """Per pod: UID, container start time and restart count; equal means not restarted."""
    return {
        n: (p.metadata.uid, started_at(p), p.status.container_statuses[0].restart_count)
        for n, p in pods.items()
    }


def test_a_2p2d_group_reaches_ready_with_exactly_np_nd_k_links(
    api_client: client.ApiClient,
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    serving_group: Callable[..., Any],
) -> None:
    operator = serving_group(prefill=2, decode=2)
    status = groups.get("g")["status"]
    k = 2 * 2  # 2 NPUs per instance, 2 dies each, one RoCE IP per die
    assert status["links"] == {"expected": 2 * 2 * k, "verified": 2 * 2 * k, "summary": "16/16"}
    assert status["prefill"] == {"replicas": 2, "ready": 2, "summary": "2/2"}
    assert status["decode"] == {"replicas": 2, "ready": 2, "summary": "2/2"}
    assert status["observedGeneration"] == 1
    assert sorted(status["entrances"]) == ["g-p-0", "g-p-1"]
    assert {i["state"] for i in status["instances"]} == {"Serving"}
    with zookeeper(cluster.zookeeper) as zk:
        paths = zl.GroupPaths(namespace, "g")
        links = [
            zl.Link.parse(zk.get(f"{paths.links}/{c}")[0]) for c in zk.get_children(paths.links)
        ]
        assert len(links) == 4
        assert sum(len(link.sub_links) for link in links) == 16
        for link in links:
            assert [s.device for s in link.sub_links] == [0, 1, 2, 3]
        roce_map = zl.RoceMap.parse(zk.get(paths.roce_map)[0])
        assert roce_map.version == 1
        for instance in status["instances"]:
            entry = next(
                e for e in (*roce_map.prefill, *roce_map.decode) if e.instance == instance["name"]
            )
            assert entry.roce_ips == instance["roceIps"]
        assert sorted(zk.get_children(paths.entrances)) == ["g-p-0", "g-p-1"]
    # The pods carry the contract: owner, NPUs, role-less start.
    for pod in groups.pods("g").values():
        assert pod.metadata.owner_references[0].kind == "PDGroup"
        assert pod.spec.containers[0].resources.limits["huawei.com/Ascend910"] == "2"
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["ENGINE_ROLE"] == "auto"
        assert env["MATRIXSERVE_GROUP"] == f"{namespace}/g"
    # Decode instances were placed inside one SuperPod.
    superpods = {
        client.CoreV1Api(api_client)
        .read_node(p.spec.node_name)
        .metadata.labels["matrixserve.io/superpod"]
        for n, p in groups.pods("g").items()
        if "-d-" in n
    }
    assert len(superpods) == 1
    metrics = httpx.get(operator.metrics_url, trust_env=False).text
    assert (
        f'matrixserve_operator_links_verified{{group="g",namespace="{namespace}"}} 16.0' in metrics
    )
    assert 'matrixserve_operator_zookeeper_session_state{state="CONNECTED"} 1.0' in metrics
    assert 'matrixserve_operator_setup_phase_seconds_count{phase="serve"} 1.0' in metrics
    events = events_of(groups.core, namespace, "g")
    reasons = [e.reason for e in events]
    assert reasons.count("CreatedPod") == 4
    assert "InitOrder" in reasons
    assert "EntranceOpened" in reasons


def test_scaling_decode_adds_one_pod_and_restarts_nobody(
    groups: Groups, serving_group: Callable[..., Any]
) -> None:
    serving_group(prefill=2, decode=2)
    before = identities(groups.pods("g"))
    # kubectl scale goes through the scale subresource: it scales decode.
    scale = groups.custom.get_namespaced_custom_object_scale(*groups.where, "g")
    assert scale["spec"]["replicas"] == 2
    groups.custom.patch_namespaced_custom_object_scale(
        *groups.where, "g", {"spec": {"replicas": 3}}
    )
    wait_for(
        lambda: groups.get("g")["status"].get("decode", {}).get("ready") == 3 and groups.ready("g"),
        what="3 decodes Ready",
    )
    after = identities(groups.pods("g"))
    assert set(after) == set(before) | {"g-d-2"}
    for name, identity in before.items():
        assert after[name] == identity, f"{name} was restarted or replaced"
    status = groups.get("g")["status"]
    assert status["links"]["verified"] == status["links"]["expected"] == 2 * 3 * 4
    assert status["roceMapVersion"] == 2


def test_scaling_prefill_in_removes_the_map_entry_before_the_pod(
    cluster: ClusterInfo, namespace: str, groups: Groups, serving_group: Callable[..., Any]
) -> None:
    serving_group(prefill=2, decode=2)
    paths = zl.GroupPaths(namespace, "g")
    seen: dict[str, float] = {}
    zk = KazooClient(hosts=cluster.zookeeper, timeout=10, auth_data=zookeeper_auth())
    zk.start(timeout=15)

    def on_map(data: bytes | None, _stat: Any) -> None:
        if data and "g-p-1" not in [e.instance for e in zl.RoceMap.parse(data).prefill]:
            seen.setdefault("map", time.monotonic())

    zk.DataWatch(paths.roce_map, on_map)
    stream = watch.Watch()

    def on_pods() -> None:
        for event in stream.stream(
            groups.core.list_namespaced_pod,
            namespace,
            field_selector="metadata.name=g-p-1",
            timeout_seconds=60,
        ):
            if (
                event["object"].metadata.deletion_timestamp is not None
                or event["type"] == "DELETED"
            ):
                seen.setdefault("pod", time.monotonic())
                # causal, not a race of two watches: once the deletion is visible, ZooKeeper
                # (synced) must already have the map without it
                zk.sync(paths.roce_map)
                current = zl.RoceMap.parse(zk.get(paths.roce_map)[0])
                seen["in_map_at_deletion"] = "g-p-1" in [e.instance for e in current.prefill]
                return

    watcher = threading.Thread(target=on_pods, daemon=True)
    watcher.start()
    time.sleep(0.5)
    try:
        groups.patch("g", {"prefill": {"replicas": 1}})
        wait_for(
            lambda: "g-p-1" not in groups.pods("g") and groups.ready("g"), what="prefill scaled in"
        )
        watcher.join(10)
        assert "map" in seen, seen
        assert "pod" in seen, seen
        assert seen["in_map_at_deletion"] is False, "the pod went before its map entry"
        assert not zk.exists(paths.entrance("g-p-1"))
        assert not any("g-p-1" in c for c in zk.get_children(paths.links)), "its links were erased"
        wait_for(
            lambda: not zk.exists(paths.removed_of("g-p-1")),
            timeout=10,
            what="the removal marker cleared",
        )
    finally:
        stream.stop()
        zk.stop()
    status = groups.get("g")["status"]
    assert status["links"]["verified"] == status["links"]["expected"] == 1 * 2 * 4
    assert status["entrances"] == ["g-p-0"]


def test_the_webhook_rejects_an_invalid_spec_with_a_clear_message(
    namespace: str, groups: Groups, start_operator: Callable[..., Any]
) -> None:
    start_operator(namespace)
    bad = pdgroup_body("bad", 1, 1)
    bad["spec"]["decode"]["devicesPerInstance"] = 4
    with pytest.raises(client.ApiException) as rejected:
        groups.create(bad)
    assert rejected.value.status == 422
    # (a rule of the CRD's, CEL since issue 30: the API server's own refusal) A larger decode
    # whose TP (its 8 dies) does not divide the prefill's (4): the KV mapping cannot pair them.
    assert (
        "spec.decode.parallelism.tp: Invalid value: 8 does not divide the prefill's tp 4"
        in rejected.value.body
    )
    too_big = pdgroup_body("big", 1, 1)
    too_big["spec"]["model"]["name"] = "gpt3-175b"
    with pytest.raises(client.ApiException) as rejected_model:
        groups.create(too_big)
    assert "of weights do not fit 2 NPUs" in rejected_model.value.body


def test_an_invalid_update_leaves_the_running_group_untouched_with_invalid_spec(
    cluster: ClusterInfo, namespace: str, groups: Groups, serving_group: Callable[..., Any]
) -> None:
    """Without the webhook (or with it bypassed), the reconciler's own check stops the change
    (one the API server's own rules let through: a model whose weights do not fit, which only
    the operator's catalogue can tell)."""
    serving_group(prefill=1, decode=1, webhook=False)
    before = {n: p.metadata.uid for n, p in groups.pods("g").items()}
    paths = zl.GroupPaths(namespace, "g")
    with zookeeper(cluster.zookeeper) as zk:
        map_before = zk.get(paths.roce_map)
        groups.patch("g", {"decode": {"replicas": 3}, "model": {"name": "gpt3-175b"}})
        wait_for(
            lambda: groups.condition("g", "Ready").get("reason") == "InvalidSpec",
            what="InvalidSpec",
        )
        cond = groups.condition("g", "Ready")
        assert cond["status"] == "False"
        assert "of weights do not fit 2 NPUs" in cond["message"]
        assert cond["observedGeneration"] == 2
        time.sleep(2)  # give a wrong reconciler time to do damage
        assert {n: p.metadata.uid for n, p in groups.pods("g").items()} == before
        assert zk.get(paths.roce_map) == map_before
        assert sorted(zk.get_children(paths.entrances)) == ["g-p-0"]
    events = events_of(groups.core, namespace, "g")
    assert [e.type for e in events if e.reason == "InvalidSpec"] == ["Warning"]
    # Fixing the spec resumes reconciliation.
    groups.patch("g", {"decode": {"replicas": 1}, "model": {"name": "llama3-8b"}})
    groups.wait_ready("g", what="Ready again")


def test_deleting_a_group_leaves_no_pods_and_no_znodes(
    cluster: ClusterInfo, namespace: str, groups: Groups, serving_group: Callable[..., Any]
) -> None:
    serving_group(prefill=1, decode=1)
    groups.delete("g")

    wait_for(
        lambda: absent(lambda: groups.get("g")), what="the PDGroup to be deleted (finalizer done)"
    )
    wait_for(lambda: not groups.core.list_namespaced_pod(namespace).items, what="no pods left")
    with zookeeper(cluster.zookeeper) as zk:
        assert not zk.exists(zl.group_path(namespace, "g"))
        assert not zk.exists(f"{zl.ROOT}/groups/{namespace}"), (
            "the empty namespace folder was left behind"
        )


def test_restarting_the_operator_mid_setup_finishes_without_duplicates(
    namespace: str, groups: Groups, start_operator: Callable[..., Any]
) -> None:
    # Time scale 1: model loads take ~8 s, a window to kill the operator in (TE-Pre-Load, 20 s
    # more at this scale, is off: it would only make the test slower).
    operator = start_operator(namespace, time_scale="1", extra=("--engine-pre-load-seconds", "0"))
    groups.create(pdgroup_body("g", 2, 2))
    wait_for(
        lambda: (groups.get("g").get("status") or {}).get("roceMapVersion") == 1,
        what="the RoCE map",
    )
    assert not groups.ready("g")
    operator.kill()
    uids = {n: p.metadata.uid for n, p in groups.pods("g").items()}
    assert len(uids) == 4
    operator.start()
    groups.wait_ready("g", what="Ready after the restart")
    assert {n: p.metadata.uid for n, p in groups.pods("g").items()} == uids, "pods were recreated"
    status = groups.get("g")["status"]
    assert status["roceMapVersion"] == 1, "the map was rewritten"
    assert status["links"]["verified"] == status["links"]["expected"] == 16
    events = events_of(groups.core, namespace, "g")
    reasons = [e.reason for e in events]
    assert reasons.count("CreatedPod") == 4
    assert reasons.count("RoceMap") == 1
    assert copy.deepcopy(reasons).count("InitOrder") == 1


def test_without_zookeeper_the_operator_plans_nothing_destructive(
    namespace: str, groups: Groups, start_operator: Callable[..., Any]
) -> None:
    """No coordination, no destructive plan: pods are created, but no map, no deletions."""
    start_operator(namespace, extra=("--zookeeper", "127.0.0.1:9"))  # nothing listens there
    groups.create(pdgroup_body("g", 1, 2))
    wait_for(lambda: len(groups.pods("g")) == 3, what="the pods")
    wait_for(
        lambda: groups.condition("g", "Ready").get("reason") == "Blocked",
        what="Ready=False, Blocked",
    )
    assert "ZooKeeper is not connected" in groups.condition("g", "Ready")["message"]
    uids = {n: p.metadata.uid for n, p in groups.pods("g").items()}
    groups.patch("g", {"decode": {"replicas": 1}})  # a scale-in (a group keeps one decode)
    time.sleep(2)
    assert {n: p.metadata.uid for n, p in groups.pods("g").items()} == uids, (
        "a pod was deleted without coordination"
    )
    assert groups.get("g")["status"].get("roceMapVersion", 0) == 0


def test_a_dp_domain_says_no_controller_runs_it(
    namespace: str, api_client: client.ApiClient, start_operator: Callable[..., Any]
) -> None:
    """A DPDomain was accepted and nothing said that nothing runs it (ExpertPool has its
    controller now: tests/cluster/test_expertpool_serving.py). It says so in its status (Ready=False, NoController) and in a Warning Event; a new
    generation is said again, and nothing is created for it."""
    from matrixserve.api import kinds
    from testkit.helpers import CRDS, load

    start_operator(namespace, webhook=False)
    custom = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    for kind, sample in ((kinds.DPDOMAIN, "dpdomain"),):
        body = load(CRDS / "samples" / f"{sample}.yaml")
        name = body["metadata"]["name"]
        where = (kind.group, kind.version, namespace, kind.plural)
        custom.create_namespaced_custom_object(*where, body)

        def ready(generation: int) -> dict[str, Any] | None:
            obj = custom.get_namespaced_custom_object(*where, name)  # noqa: B023
            status = obj.get("status") or {}
            found = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
            if status.get("observedGeneration") != generation or found is None:
                return None
            return dict(found)

        said = wait_for(lambda: ready(1), 30, f"{kind.kind} Ready=False NoController")
        assert (said["status"], said["reason"]) == ("False", "NoController")
        assert f"no controller runs {kind.kind} objects" in said["message"]
        wait_for(
            lambda: "NoController" in [e.reason for e in events_of(core, namespace, name)],  # noqa: B023
            30,
            f"the {kind.kind}'s NoController Event",
        )
        # a new generation (a scale: the subresource the CRD declares) is said again
        custom.patch_namespaced_custom_object_scale(*where, name, {"spec": {"replicas": 3}})
        wait_for(lambda: ready(2), 30, f"{kind.kind} said at its new generation")
    assert not core.list_namespaced_pod(namespace).items  # nothing runs for them
