"""``make demo``: what the project can show today on the local cluster.

Brings the cluster up (idempotent), lists the emulated NPU servers, then runs one engine-stub
pod that asks for 4 NPUs and prints what the node emulator granted it (NPUs, dies, RoCE IPs), as
answered by the pod's own process on its own loopback pod IP. Re-running it replaces the pod.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kubernetes import client, config

from matrixserve.devcluster.cluster import ClusterInfo, _http_get

NAMESPACE = "matrixserve-demo"
POD = "engine-stub-demo"


def _until(what: str, timeout: float, attempt: Any) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = attempt()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: {what} within {timeout:.0f}s")
        time.sleep(0.2)


def _demo_pod() -> dict[str, Any]:
    return {
        "metadata": {"name": POD, "labels": {"app": "engine-stub-demo"}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "engine",
                    "image": "matrixserve/engine-stub:dev",
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                        {
                            "name": "POD_NAMESPACE",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                        },
                        {"name": "MATRIXSERVE_TIME_SCALE", "value": "20"},
                    ],
                    "readinessProbe": {
                        "httpGet": {"path": "/readyz", "port": 8000},
                        "periodSeconds": 1,
                    },
                    "resources": {"limits": {"huawei.com/Ascend910": "4"}},
                }
            ],
        },
    }


def run(info: ClusterInfo, timeout: float = 60) -> int:
    with config.new_client_from_config(config_file=info.kubeconfig) as api:
        core = client.CoreV1Api(api)
        nodes = core.list_node(label_selector="matrixserve.io/emulated-node=true").items
        print(f"\n{'NODE':<18}{'SUPERPOD':<10}{'NPUS':>5}  {'POD CIDR':<16}READY")
        for node in nodes:
            ready = {c.type: c.status for c in node.status.conditions or []}.get("Ready")
            print(
                f"{node.metadata.name:<18}{node.metadata.labels.get('matrixserve.io/superpod', ''):<10}"
                f"{node.status.capacity.get('huawei.com/Ascend910', '0'):>5}  "
                f"{node.spec.pod_cidr or '':<16}{ready}"
            )

        try:
            core.create_namespace({"metadata": {"name": NAMESPACE}})
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        try:
            core.delete_namespaced_pod(POD, NAMESPACE, grace_period_seconds=0)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        _until("the previous demo pod to go", timeout, lambda: not _exists(core))

        def create() -> bool:
            try:
                core.create_namespaced_pod(NAMESPACE, _demo_pod())
            except client.ApiException as exc:
                if exc.status == 403:  # the namespace's service-account token is not there yet
                    return False
                raise
            return True

        _until("the demo pod to be created", timeout, create)

        def ready_pod() -> Any:
            pod = core.read_namespaced_pod(POD, NAMESPACE)
            conditions = {c.type: c.status for c in pod.status.conditions or []}
            return pod if conditions.get("Ready") == "True" else None

        pod = _until("the demo pod to become Ready", timeout, ready_pod)
    identity = json.loads(_http_get(f"http://{pod.status.pod_ip}:8000/v1/info"))
    print(
        f"\npod {NAMESPACE}/{POD} on {identity['node']} at {pod.status.pod_ip} (its own process):"
    )
    print(f"  NPUs granted : {', '.join(map(str, identity['npus']))}")
    print(f"  dies         : {', '.join(map(str, identity['dies']))}")
    print(f"  RoCE IPs     : {', '.join(identity['roceIps'])}  (identities only, never dialled)")
    print(f"  device file  : {identity['deviceStatusFile']}")
    return 0


def _exists(core: client.CoreV1Api) -> bool:
    try:
        core.read_namespaced_pod(POD, NAMESPACE)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True
