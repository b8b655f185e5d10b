"""The engine container every kind runs (pure): how the platform starts engine stubs, and the
parts of an engine pod that do not depend on the kind (downward-API env, probes, NPU request,
CPU and memory, the security context).

A kind's own pod module adds what is its own (labels, owner, placement, the engine's role and
group); a PDGroup instance, a warm pod and an expert server all run this container.

Least privilege (issue 16, finding 8): an engine runs as the engine image's non-root user, with
no privilege escalation, no capabilities, the runtime's default seccomp profile and a read-only
root filesystem (the engine writes no file), and without a service-account token (engines talk
to ZooKeeper and their peers, never to the Kubernetes API). It requests CPU and memory, so it is
not BestEffort (the first evicted under node pressure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import NPU_RESOURCE
from matrixserve.api.resources import EngineResources, quantity_value

ENGINE_PORT = 8000
# The engine image's user and group (Dockerfile: useradd --uid 10001); numeric, so the kubelet
# can check runAsNonRoot without reading the image's /etc/passwd.
ENGINE_UID = 10001
ENGINE_GID = 10001
# CPU and memory an engine gets where its spec says nothing (sized for the engine stub: ~60 MiB
# resident, well under a CPU; a real engine states its own in the PDGroup's resources).
DEFAULT_REQUESTS = {"cpu": "250m", "memory": "256Mi"}
DEFAULT_LIMITS = {"cpu": "2", "memory": "1Gi"}


@dataclass(frozen=True)
class EngineSettings:
    """How the operator starts engines (operator flags, not API: they describe the platform)."""

    zookeeper: str
    time_scale: str = "1"
    load_source: str = "SharedFileService"
    health_interval_seconds: str = "20"
    link_timeout_seconds: str = "60"
    admission: str = "reject"  # "queue" only for the gateway benchmark's baseline
    # POST/DELETE /v1/faults answered (tests, the demo) or refused with 403 (issue 16 finding 7)
    fault_injection: bool = False
    # ZooKeeper's digest identity (None: open znodes). Engines read it from a Secret of this name
    # in their own namespace (a secretKeyRef: pod readers do not see it), which the operator
    # writes there before it creates an engine pod.
    zookeeper_auth: zl.Credentials | None = None
    zookeeper_auth_secret: str = "matrixserve-zookeeper-auth"

    def secrets(self) -> list[dict[str, Any]]:
        """The Secrets every engine pod's namespace must hold before the pod is created."""
        if self.zookeeper_auth is None:
            return []
        return [
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {
                    "name": self.zookeeper_auth_secret,
                    # Owned by nothing (engines of several groups use it): found by these
                    # labels to clean up after MatrixServe is uninstalled.
                    "labels": {
                        "app.kubernetes.io/managed-by": "matrixserve-operator",
                        "app.kubernetes.io/component": "zookeeper-auth",
                    },
                },
                "stringData": {zl.CREDENTIALS_KEY: self.zookeeper_auth.text()},
            }
        ]


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def downward_env() -> list[dict[str, Any]]:
    """The pod's own name, UID, namespace and IP (the engine binds and reports the IP, and
    reports the UID as part of who it is)."""
    return [
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_UID", **_field("metadata.uid")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "POD_IP", **_field("status.podIP")},
    ]


def platform_env(settings: EngineSettings) -> list[dict[str, Any]]:
    """What every engine learns from the platform: load source, health period, link timeout,
    time scale, prefill admission, whether faults may be injected and its ZooKeeper identity."""
    env: list[dict[str, Any]] = [
        {"name": "ENGINE_LOAD_SOURCE", "value": settings.load_source},
        {"name": "ENGINE_HEALTH_INTERVAL", "value": settings.health_interval_seconds},
        {"name": "ENGINE_LINK_TIMEOUT", "value": settings.link_timeout_seconds},
        {"name": "MATRIXSERVE_TIME_SCALE", "value": settings.time_scale},
        {"name": "ENGINE_ADMISSION", "value": settings.admission},
        {"name": "ENGINE_FAULT_INJECTION", "value": "1" if settings.fault_injection else "0"},
    ]
    if settings.zookeeper_auth is not None:
        secret = {"name": settings.zookeeper_auth_secret, "key": zl.CREDENTIALS_KEY}
        env.append({"name": "MATRIXSERVE_ZK_AUTH", "valueFrom": {"secretKeyRef": secret}})
    return env


def engine_resources(given: EngineResources | None) -> dict[str, dict[str, str]]:
    """CPU and memory requests and limits from a spec's ``resources``: what it gives, else the
    defaults, a default request lowered to a given limit and a default limit raised to a given
    request (so what is left out never contradicts what is given). Limits below their request,
    both given, are the validation's to refuse."""
    spec = given or EngineResources()
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    for name in ("cpu", "memory"):
        request: str | None = getattr(spec.requests, name)
        limit: str | None = getattr(spec.limits, name)
        if request is None:
            request = DEFAULT_REQUESTS[name]
            if limit is not None and quantity_value(limit) < quantity_value(request):
                request = limit
        if limit is None:
            limit = DEFAULT_LIMITS[name]
            if quantity_value(limit) < quantity_value(request):
                limit = request
        requests[name], limits[name] = request, limit
    return {"requests": requests, "limits": limits}


def pod_security_context() -> dict[str, Any]:
    """The engine pod's: the image's non-root user and group, the runtime's seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_GID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The engine container's: nothing beyond an unprivileged process, nothing written to the
    image (it writes no file: no volume is needed)."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def engine_container(
    image: str,
    env: list[dict[str, Any]],
    npus: int,
    resources: EngineResources | None = None,
) -> dict[str, Any]:
    """The ``engine`` container: its port, readiness (``/readyz``: serving) and liveness
    (``/healthz``) probes, its NPUs (extended resource, limits = requests) beside its CPU and
    memory (:func:`engine_resources`), and its security context."""
    cpu_memory = engine_resources(resources)
    return {
        "name": "engine",
        "image": image,
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
            "limits": {**cpu_memory["limits"], NPU_RESOURCE: str(npus)},
            "requests": {**cpu_memory["requests"], NPU_RESOURCE: str(npus)},
        },
        "securityContext": container_security_context(),
    }
