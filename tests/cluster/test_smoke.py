"""Smoke tests proving the dev cluster's parts are real: API server validation, watches and
service-account tokens, controller-manager (Deployment → ReplicaSet → Pods), scheduler (extended
resources), RBAC, ZooKeeper ephemerals, helm."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kubernetes import client, watch

from matrixserve.devcluster import tools
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.helpers import install_crds, service_account_token, wait_for

SMOKE_GROUP = "smoke.matrixserve.io"
NPU = "huawei.com/Ascend910"
CHART = Path(__file__).resolve().parent.parent / "fixtures" / "charts" / "smoke"


@pytest.fixture(scope="module")
def widget_crd(api_client: client.ApiClient) -> Iterator[str]:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["mode"],
                "properties": {
                    "replicas": {"type": "integer", "minimum": 1, "maximum": 10},
                    "mode": {"type": "string", "enum": ["Fast", "Slow"]},
                },
            }
        },
    }
    body = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{SMOKE_GROUP}"},
        "spec": {
            "group": SMOKE_GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }
    (name,) = install_crds(api_client, [body])
    yield name
    client.ApiextensionsV1Api(api_client).delete_custom_resource_definition(name)


def test_crd_schema_rejects_invalid_object_with_api_server_message(
    api_client: client.ApiClient, widget_crd: str, namespace: str
) -> None:
    custom = client.CustomObjectsApi(api_client)

    def widget(name: str, spec: dict[str, object]) -> dict[str, object]:
        return {
            "apiVersion": f"{SMOKE_GROUP}/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": spec,
        }

    with pytest.raises(client.ApiException) as rejected:
        custom.create_namespaced_custom_object(
            SMOKE_GROUP,
            "v1",
            namespace,
            "widgets",
            widget("bad", {"replicas": 0, "mode": "Medium"}),
        )
    assert rejected.value.status == 422
    status = json.loads(rejected.value.body)
    causes = {c["field"]: c["message"] for c in status["details"]["causes"]}
    assert "should be greater than or equal to 1" in causes["spec.replicas"]
    assert causes["spec.mode"] == 'Unsupported value: "Medium": supported values: "Fast", "Slow"'
    assert status["message"].startswith('Widget.smoke.matrixserve.io "bad" is invalid')

    created = custom.create_namespaced_custom_object(
        SMOKE_GROUP, "v1", namespace, "widgets", widget("good", {"replicas": 3, "mode": "Fast"})
    )
    assert created["spec"] == {"replicas": 3, "mode": "Fast"}


def test_watch_sees_create_update_delete(api_client: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api_client)
    start_rv = core.list_namespaced_config_map(namespace).metadata.resource_version
    seen: list[tuple[str, str | None]] = []
    done = threading.Event()

    def watcher() -> None:
        stream = watch.Watch()
        for event in stream.stream(
            core.list_namespaced_config_map,
            namespace,
            resource_version=start_rv,
            timeout_seconds=20,
        ):
            obj = event["object"]
            if obj.metadata.name == "watched":
                seen.append((event["type"], (obj.data or {}).get("k")))
            if event["type"] == "DELETED":
                break
        stream.stop()
        done.set()

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="watched"), data={"k": "1"})
    )
    core.patch_namespaced_config_map("watched", namespace, {"data": {"k": "2"}})
    core.delete_namespaced_config_map("watched", namespace)
    assert done.wait(25), f"watch did not see the delete; saw {seen}"
    assert seen == [("ADDED", "1"), ("MODIFIED", "2"), ("DELETED", "2")]


@pytest.fixture
def npu_node(api_client: client.ApiClient) -> Iterator[str]:
    """A fake Node with 8 NPUs of extended-resource capacity, Ready and untainted."""
    core = client.CoreV1Api(api_client)
    name = f"smoke-npu-{secrets.token_hex(3)}"
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "20", NPU: "8"}
    core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name, labels={"kubernetes.io/hostname": name, "smoke": name}
            ),
            status=client.V1NodeStatus(capacity=capacity, allocatable=capacity),
        )
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(
        name,
        {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "SmokeTest",
                        "message": "fake node",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
            }
        },
    )
    # The TaintNodesByCondition admission plugin marks new nodes not-ready; a kubelet would lift it.
    node = core.read_node(name)
    assert any(t.key == "node.kubernetes.io/not-ready" for t in node.spec.taints or [])
    core.patch_node(name, {"spec": {"taints": None}})
    yield name
    core.delete_node(name)


def test_deployment_gets_replicaset_and_pods_bound_by_extended_resource(
    api_client: client.ApiClient, namespace: str, npu_node: str
) -> None:
    apps = client.AppsV1Api(api_client)
    core = client.CoreV1Api(api_client)
    labels = {"app": "npu-smoke"}
    container = client.V1Container(
        name="engine",
        image="matrixserve/engine-stub:dev",
        resources=client.V1ResourceRequirements(requests={NPU: "4"}, limits={NPU: "4"}),
    )
    apps.create_namespaced_deployment(
        namespace,
        client.V1Deployment(
            metadata=client.V1ObjectMeta(name="npu-smoke"),
            spec=client.V1DeploymentSpec(
                replicas=3,
                selector=client.V1LabelSelector(match_labels=labels),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels),
                    spec=client.V1PodSpec(
                        containers=[container], node_selector={"smoke": npu_node}
                    ),
                ),
            ),
        ),
    )

    def replicaset() -> object:
        sets = apps.list_namespaced_replica_set(namespace, label_selector="app=npu-smoke").items
        return [rs for rs in sets if rs.metadata.owner_references[0].name == "npu-smoke"]

    wait_for(replicaset, what="a ReplicaSet owned by the Deployment (controller-manager)")

    def settled() -> object:
        pods = core.list_namespaced_pod(namespace, label_selector="app=npu-smoke").items
        bound = [p for p in pods if p.spec.node_name]
        unschedulable = [
            p
            for p in pods
            if any(
                c.type == "PodScheduled" and c.reason == "Unschedulable"
                for c in (p.status.conditions or [])
            )
        ]
        return (
            (bound, unschedulable)
            if len(pods) == 3 and len(bound) == 2 and len(unschedulable) == 1
            else None
        )

    bound, unschedulable = wait_for(settled, what="2 pods bound and 1 unschedulable (scheduler)")
    assert {p.spec.node_name for p in bound} == {npu_node}
    message = next(
        c.message for c in unschedulable[0].status.conditions if c.type == "PodScheduled"
    )
    assert f"Insufficient {NPU}" in message
    # Every pod got the default service account's token mounted (ServiceAccount admission: a
    # token Secret's volume on 1.20, a projected service-account token on a current server).
    assert all(any(_token_volume(v) for v in p.spec.volumes or []) for p in bound)


def _token_volume(volume: client.V1Volume) -> bool:
    if tools.legacy():
        return volume.secret is not None and "token" in volume.secret.secret_name
    sources = volume.projected.sources if volume.projected is not None else []
    return any(s.service_account_token is not None for s in sources or [])


def test_token_without_rbac_rights_is_denied(
    api_client: client.ApiClient, cluster: ClusterInfo, namespace: str
) -> None:
    core = client.CoreV1Api(api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="nobody"))
    )

    token = service_account_token(core, namespace, "nobody")
    configuration = client.Configuration()
    configuration.host = cluster.server
    configuration.ssl_ca_cert = cluster.ca_file
    configuration.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(configuration) as limited:
        limited_core = client.CoreV1Api(limited)
        with pytest.raises(client.ApiException) as denied:
            limited_core.list_namespaced_pod(namespace)
        assert denied.value.status == 403
        message = json.loads(denied.value.body)["message"]
        assert (
            f'User "system:serviceaccount:{namespace}:nobody" cannot list resource "pods"'
            in message
        )

        # The same token works once RBAC grants the verb: the denial above was authorization.
        rbac = client.RbacAuthorizationV1Api(api_client)
        rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "read-configmaps"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "nobody-reads-configmaps"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "read-configmaps",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
            },
        )
        assert wait_for(
            lambda: _can_list_configmaps(limited_core, namespace), what="RBAC grant to apply"
        )
        with pytest.raises(client.ApiException) as still_denied:
            limited_core.list_namespaced_pod(namespace)
        assert still_denied.value.status == 403


def _can_list_configmaps(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.list_namespaced_config_map(namespace)
    except client.ApiException as exc:
        if exc.status == 403:
            return False
        raise
    return True


def test_ephemeral_znode_disappears_when_its_session_closes(
    cluster: ClusterInfo, zk: KazooClient
) -> None:
    zk.ensure_path("/smoke")
    root = zk.chroot
    owner = KazooClient(hosts=f"{cluster.zookeeper}{root}", timeout=10)
    owner.start(timeout=15)
    owner.create("/smoke/ephemeral", b"alive", ephemeral=True)
    owner.create("/smoke/persistent", b"stays")
    assert zk.get("/smoke/ephemeral")[0] == b"alive"
    assert zk.get("/smoke/ephemeral")[1].ephemeralOwner == owner.client_id[0]

    gone = threading.Event()
    zk.exists(
        "/smoke/ephemeral", watch=lambda event: gone.set() if event.type == "DELETED" else None
    )
    owner.stop()
    owner.close()
    assert gone.wait(10), "the ephemeral znode outlived its session"
    assert zk.exists("/smoke/ephemeral") is None
    assert zk.get("/smoke/persistent")[0] == b"stays"


def test_helm_template_and_install_work_against_the_cluster(
    api_client: client.ApiClient, namespace: str, run_tool: Callable[..., object]
) -> None:
    rendered = run_tool("helm", "template", "demo", str(CHART), "--set", "greeting=bonjour")
    assert "name: demo-greeting" in rendered.stdout  # type: ignore[attr-defined]
    assert 'greeting: "bonjour"' in rendered.stdout  # type: ignore[attr-defined]

    run_tool(
        "helm", "install", "demo", str(CHART), "-n", namespace, "--set", "greeting=hola", "--wait"
    )
    core = client.CoreV1Api(api_client)
    assert core.read_namespaced_config_map("demo-greeting", namespace).data == {"greeting": "hola"}
    listed = run_tool("helm", "list", "-n", namespace, "-o", "json")
    assert '"name":"demo"' in listed.stdout.replace(" ", "")  # type: ignore[attr-defined]

    run_tool("helm", "uninstall", "demo", "-n", namespace, "--wait")
    with pytest.raises(client.ApiException) as missing:
        core.read_namespaced_config_map("demo-greeting", namespace)
    assert missing.value.status == 404
