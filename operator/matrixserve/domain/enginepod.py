"""The engine container every kind runs (pure): how the platform starts engine stubs, and the
parts of an engine pod that do not depend on the kind (downward-API env, probes, NPU request).

A kind's own pod module adds what is its own (labels, owner, placement, the engine's role and
group); a PDGroup instance, a warm pod and an expert server all run this container.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matrixserve.api.kinds import NPU_RESOURCE

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
    time scale, prefill admission and where ZooKeeper is."""
    return [
        {"name": "ENGINE_LOAD_SOURCE", "value": settings.load_source},
        {"name": "ENGINE_HEALTH_INTERVAL", "value": settings.health_interval_seconds},
        {"name": "ENGINE_LINK_TIMEOUT", "value": settings.link_timeout_seconds},
        {"name": "MATRIXSERVE_TIME_SCALE", "value": settings.time_scale},
        {"name": "ENGINE_ADMISSION", "value": settings.admission},
    ]


def engine_container(image: str, env: list[dict[str, Any]], npus: int) -> dict[str, Any]:
    """The ``engine`` container: its port, readiness (``/readyz``: serving) and liveness
    (``/healthz``) probes, and its NPUs (extended resource, limits = requests)."""
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
            "limits": {NPU_RESOURCE: str(npus)},
            "requests": {NPU_RESOURCE: str(npus)},
        },
    }
