"""The pod of one P/D instance (pure): deterministic name, labels, owner, NPUs, placement, env.

Every pod starts role-less (``ENGINE_ROLE=auto``): its role is bound in the RoCE map when it joins
(P/D-Serve §3.3: "newly added containers (stateless and no P/D role)"). Placement: a group's decode
instances are tightly coupled and stay inside one SuperPod (required pod affinity on the SuperPod
label, 001 §6.1.2); prefill prefers the same SuperPod but may go elsewhere over RoCE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec

NPU_RESOURCE = "huawei.com/Ascend910"
LABEL_GROUP = "matrixserve.io/group"
LABEL_ROLE = "matrixserve.io/role"
LABEL_INSTANCE = "matrixserve.io/instance"
LABEL_SUPERPOD = "matrixserve.io/superpod"
LABEL_NPU_TYPE = "matrixserve.io/npu-type"
ENGINE_PORT = 8000


@dataclass(frozen=True)
class EngineSettings:
    """How the operator starts engines (operator flags, not API: they describe the platform)."""

    zookeeper: str
    time_scale: str = "1"
    load_source: str = "SharedFileService"
    health_interval_seconds: str = "20"
    link_timeout_seconds: str = "60"
    admission: str = "reject"  # "queue" only for the gateway benchmark's baseline


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def role_label(role: zl.Role) -> str:
    return "prefill" if role is zl.Role.PREFILL else "decode"


def pod_labels(group: str, role: zl.Role, name: str) -> dict[str, str]:
    return {
        LABEL_GROUP: group,
        LABEL_ROLE: role_label(role),
        LABEL_INSTANCE: name,
        "app.kubernetes.io/name": "matrixserve-engine",
        "app.kubernetes.io/managed-by": "matrixserve-operator",
    }


def _affinity(group: str, role: zl.Role) -> dict[str, Any]:
    term = {
        "labelSelector": {"matchLabels": {LABEL_GROUP: group, LABEL_ROLE: "decode"}},
        "topologyKey": LABEL_SUPERPOD,
    }
    if role is zl.Role.DECODE:
        return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 50, "podAffinityTerm": term}
            ]
        }
    }


def pod_manifest(
    namespace: str,
    group: str,
    group_uid: str,
    name: str,
    role: zl.Role,
    spec: PDGroupSpec,
    settings: EngineSettings,
) -> dict[str, Any]:
    r = spec.prefill if role is zl.Role.PREFILL else spec.decode
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "POD_IP", **_field("status.podIP")},
        {"name": "ENGINE_ROLE", "value": "auto"},
        {"name": "ENGINE_MODEL", "value": spec.model.name},
        {"name": "ENGINE_MAX_BATCH", "value": str(r.batch_size)},
        {"name": "ENGINE_MAX_PROMPT_TOKENS", "value": str(spec.model.max_context_tokens)},
        {"name": "ENGINE_MAX_OUTPUT_TOKENS", "value": str(spec.model.max_context_tokens)},
        {"name": "ENGINE_LOAD_SOURCE", "value": settings.load_source},
        {"name": "ENGINE_HEALTH_INTERVAL", "value": settings.health_interval_seconds},
        {"name": "ENGINE_LINK_TIMEOUT", "value": settings.link_timeout_seconds},
        {"name": "MATRIXSERVE_TIME_SCALE", "value": settings.time_scale},
        {"name": "ENGINE_ADMISSION", "value": settings.admission},
        {"name": "MATRIXSERVE_GROUP", "value": f"{namespace}/{group}"},
        {"name": "MATRIXSERVE_ZK", "value": settings.zookeeper},
    ]
    if r.parallelism.tp:
        env.append({"name": "ENGINE_TP", "value": str(r.parallelism.tp)})
    if r.parallelism.ep:
        env.append({"name": "ENGINE_EP", "value": str(r.parallelism.ep)})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": pod_labels(group, role, name),
            "annotations": {
                "matrixserve.io/service": spec.service,
                "matrixserve.io/scenario": spec.scenario,
            },
            "ownerReferences": [
                {
                    "apiVersion": "matrixserve.io/v1alpha1",
                    "kind": "PDGroup",
                    "name": group,
                    "uid": group_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 10,
            # Engines talk to ZooKeeper and their peers, never to the Kubernetes API.
            "automountServiceAccountToken": False,
            "nodeSelector": {LABEL_NPU_TYPE: r.npu_type},
            "affinity": _affinity(group, role),
            "containers": [
                {
                    "name": "engine",
                    "image": r.image,
                    "env": env,
                    "ports": [{"name": "engine", "containerPort": ENGINE_PORT}],
                    "readinessProbe": {
                        "httpGet": {"path": "/readyz", "port": ENGINE_PORT},
                        "periodSeconds": 1,
                    },
                    "livenessProbe": {
                        "httpGet": {"path": "/healthz", "port": ENGINE_PORT},
                        "periodSeconds": 5,
                        "timeoutSeconds": 2,
                        "failureThreshold": 3,
                    },
                    "resources": {
                        "limits": {NPU_RESOURCE: str(r.devices_per_instance)},
                        "requests": {NPU_RESOURCE: str(r.devices_per_instance)},
                    },
                }
            ],
        },
    }
