"""The engine container every kind runs (pure): how the platform starts engine stubs, and the
parts of an engine pod that do not depend on the kind (the platform's engine settings, probes,
NPU request, CPU and memory, the security context). Every engine setting is written through the
engine's environment contract (:mod:`matrixserve.api.engine_settings`), which the engine reads.

A kind's own pod module adds what is its own (labels, owner, placement, the engine's role and
group); a PDGroup instance, a warm pod and an expert server all run this container.

Least privilege: an engine runs as the engine image's non-root user, with no privilege escalation,
no capabilities, the runtime's default seccomp profile and a read-only root filesystem (its one
writable place a small /tmp: :func:`scratch_volumes`), and without a service-account token (engines
talk to ZooKeeper and their peers, never to the Kubernetes API). It requests CPU and memory, so it
is not BestEffort (the first evicted under node pressure).

ZooKeeper's identity: an engine reads it from a file, its namespace's Secret mounted read-only
(:func:`credential_volumes`), never from its environment or its spec. A group's znodes stay open
until every pod of the group carries that volume (:func:`without_credential`): pods made before the
identity existed have none and still write there (an upgrade); :class:`EngineNotice` says so on the
group.

Who may reach an engine: the engines' NetworkPolicy, written by the operator into each
namespace where it creates engine pods, before the first (:func:`engine_network_policy`): the
rules the chart gives it (its own engines' policy, rendered for any namespace: the gateway, the
operator and other engines on the engine port), owned by nothing like the Secret and labelled
as the operator's; one of that name without those labels (the chart's own where its values list
the namespace, or a tenant's) is left alone.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_settings import EngineEnv, LoadSource, switch
from matrixserve.api.kinds import (
    API_VERSION,
    APP_NAME_LABEL,
    ENGINE_APP,
    MANAGED_BY_LABEL,
    NPU_RESOURCE,
    OPERATOR_MANAGER,
)
from matrixserve.api.resources import EngineResources, quantity_value
from matrixserve.domain.effects import Event, Notice
from matrixserve.domain.observed import PodView

ENGINE_PORT = 8000
ENGINE_CONTAINER = "engine"
READINESS_PERIOD_SECONDS = 1
# An engine serving is seen Ready by the kubelet at its next readiness probe, at most a period
# later (plus the probe's 1 s timeout and a second for the status to reach the API): a pod not
# Ready that long after its engine began serving fails its probe, whatever the engine says.
FIRST_PROBE_GRACE_SECONDS = 2.0 * READINESS_PERIOD_SECONDS + 1.0
# The engine image's user and group (Dockerfile: useradd --uid 10001); numeric, so the kubelet
# can check runAsNonRoot without reading the image's /etc/passwd.
ENGINE_UID = 10001
ENGINE_GID = 10001
# CPU and memory an engine gets where its spec says nothing (sized for the engine stub: ~60 MiB
# resident, well under a CPU; a real engine states its own in the PDGroup's resources).
DEFAULT_REQUESTS = {"cpu": "250m", "memory": "256Mi"}
DEFAULT_LIMITS = {"cpu": "2", "memory": "1Gi"}
# Where an engine finds ZooKeeper's identity: its Secret's key, as a file (mode 0440, group
# ENGINE_GID by the pod's fsGroup: the kubelet writes Secret files as root).
CREDENTIALS_DIR = "/var/run/secrets/matrixserve.io/zookeeper"
CREDENTIALS_FILE = f"{CREDENTIALS_DIR}/{zl.CREDENTIALS_KEY}"
CREDENTIALS_VOLUME = "zookeeper-auth"
CREDENTIALS_MODE = 0o440
# The engine's one writable place, on a read-only root: /tmp (Python's, or a real engine's,
# temporary files; without it an engine that writes one crashes), an emptyDir of at most
# TMP_SIZE_LIMIT: the kubelet evicts a pod that writes more rather than let it fill the node's
# disk. 64Mi: scratch files, not model weights or caches, which belong on volumes of their own.
TMP_VOLUME = "tmp"
TMP_SIZE_LIMIT = "64Mi"
# The engines' Secret is owned by nothing (engines of several groups read it): these labels say
# it is ours (a Secret of that name without them is a tenant's, never overwritten) and find it
# for a clean-up after an uninstall.
SECRET_LABELS = {
    MANAGED_BY_LABEL: OPERATOR_MANAGER,
    "app.kubernetes.io/component": "zookeeper-auth",
}
# The engines' NetworkPolicy, like the Secret: owned by nothing, ours by these labels.
POLICY_LABELS = {
    MANAGED_BY_LABEL: OPERATOR_MANAGER,
    "app.kubernetes.io/component": "engine-network-policy",
}
ENGINE_SELECTOR = {"matchLabels": {APP_NAME_LABEL: ENGINE_APP}}  # every engine pod's label
CHART_APP = "matrixserve"  # app.kubernetes.io/name of the chart's own objects


@dataclass(frozen=True)
class EngineSettings:
    """How the operator starts engines (operator flags, not API: they describe the platform)."""

    zookeeper: str
    time_scale: str = "1"
    load_source: LoadSource = LoadSource.SHARED_FILE_SERVICE
    health_interval_seconds: str = "20"
    link_timeout_seconds: str = "60"
    admission: str = "reject"  # "queue" only for the gateway benchmark's baseline
    # POST/DELETE /v1/faults answered (tests, the demo) or refused with 403 (so no pod may break
    # an engine at will)
    fault_injection: bool = False
    # Warm pods: TE-Pre-Load's emulated seconds (None: the engine's calibrated value), and the
    # scale-out paths the planner may take (empty: all; scaleout.Path values).
    pre_load_seconds: str | None = None
    scale_out_paths: tuple[str, ...] = ()
    # ZooKeeper's digest identity (None: open znodes). Engines read it from a Secret of this name
    # in their own namespace, mounted as a file (pod readers see the name, never the value),
    # which the operator writes there before it creates an engine pod. A distinctive name: a
    # tenant's Secret of the same name is left alone (and no engine pod created there).
    zookeeper_auth: zl.Credentials | None = None
    zookeeper_auth_secret: str = "matrixserve-engine-zookeeper-auth"
    # The engines' NetworkPolicy's spec as JSON (empty: the operator writes none) and
    # its name (the chart passes its own engines' policy's, and the same name).
    network_policy: str = ""
    network_policy_name: str = "matrixserve-engines"

    def secrets(self) -> list[dict[str, Any]]:
        """The Secrets every engine pod's namespace must hold before the pod is created."""
        if self.zookeeper_auth is None:
            return []
        value = base64.b64encode(self.zookeeper_auth.text().encode()).decode()
        return [
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {"name": self.zookeeper_auth_secret, "labels": dict(SECRET_LABELS)},
                "data": {zl.CREDENTIALS_KEY: value},
            }
        ]

    def policies(self) -> list[dict[str, Any]]:
        """The NetworkPolicies every engine pod's namespace must hold before the pod is created
        (none unless the operator was given the engines' policy)."""
        if not self.network_policy:
            return []
        return [engine_network_policy(self.network_policy_name, json.loads(self.network_policy))]


def engine_network_policy(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engines' NetworkPolicy: ``spec`` (a NetworkPolicySpec: who may reach the
    engines, the chart's engines' policy rendered for any namespace) selecting every engine pod,
    as the API server stores it (``policyTypes`` and each port's protocol written out, so that
    what is read back compares equal). ValueError if it selects other pods or restricts no
    ingress: a policy under the engines' name must guard the engines."""
    if not isinstance(spec, Mapping):
        raise ValueError("the engines' NetworkPolicy spec must be a JSON object")
    selector = spec.get("podSelector", ENGINE_SELECTOR)
    if selector != ENGINE_SELECTOR:
        raise ValueError(
            f"the engines' NetworkPolicy must select the engine pods ({json.dumps(ENGINE_SELECTOR)}"
            f" or no podSelector), not {json.dumps(selector)}"
        )
    types = list(spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])])
    if "Ingress" not in types or "ingress" not in spec:
        raise ValueError(
            "the engines' NetworkPolicy must restrict Ingress (give its ingress rules)"
        )

    def rules(key: str) -> list[dict[str, Any]]:
        return [
            {
                **rule,
                **(
                    {"ports": [{"protocol": "TCP", **port} for port in rule["ports"]]}
                    if rule.get("ports")
                    else {}
                ),
            }
            for rule in spec.get(key) or []
        ]

    body: dict[str, Any] = {**spec, "podSelector": ENGINE_SELECTOR, "policyTypes": types}
    body["ingress"] = rules("ingress")
    if "egress" in spec:
        body["egress"] = rules("egress")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": dict(POLICY_LABELS)},
        "spec": body,
    }


def platform_settings(settings: EngineSettings) -> EngineEnv:
    """What every engine learns from the platform: load source, health period, link timeout,
    time scale, prefill admission, whether faults may be injected and its ZooKeeper identity."""
    return EngineEnv(
        load_source=str(settings.load_source),
        health_interval=settings.health_interval_seconds,
        link_timeout=settings.link_timeout_seconds,
        time_scale=settings.time_scale,
        admission=settings.admission,
        fault_injection=switch(settings.fault_injection),
        pre_load_seconds=settings.pre_load_seconds,
        # the file the credential volume holds
        zookeeper_auth_file=None if settings.zookeeper_auth is None else CREDENTIALS_FILE,
    )


def platform_env(settings: EngineSettings) -> list[dict[str, Any]]:
    """:func:`platform_settings` as a container's ``env`` entries."""
    return platform_settings(settings).to_env()


def credential_volumes(settings: EngineSettings) -> list[dict[str, Any]]:
    """The pod's volume with ZooKeeper's identity (its namespace's Secret), if there is one."""
    if settings.zookeeper_auth is None:
        return []
    secret = {
        "secretName": settings.zookeeper_auth_secret,
        "items": [{"key": zl.CREDENTIALS_KEY, "path": zl.CREDENTIALS_KEY}],
        "defaultMode": CREDENTIALS_MODE,
    }
    return [{"name": CREDENTIALS_VOLUME, "secret": secret}]


def scratch_volumes() -> list[dict[str, Any]]:
    """The pod's /tmp volume (:data:`TMP_SIZE_LIMIT`), which :func:`engine_container` mounts."""
    return [{"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}]


def credential_mounts(settings: EngineSettings) -> list[dict[str, Any]]:
    """Where the engine container sees :func:`credential_volumes` (read-only)."""
    if settings.zookeeper_auth is None:
        return []
    return [{"name": CREDENTIALS_VOLUME, "mountPath": CREDENTIALS_DIR, "readOnly": True}]


def without_credential(pods: Iterable[PodView], settings: EngineSettings) -> list[str]:
    """The pods (terminating ones too: they still write) that do not mount the engines' Secret:
    made before the identity was configured. While there is one, its group's znodes stay open."""
    if settings.zookeeper_auth is None:
        return []
    secret = settings.zookeeper_auth_secret
    return sorted(p.name for p in pods if secret not in p.secret_volumes)


@dataclass(frozen=True)
class EngineNotice(Notice):
    """Something about a kind's engine pods that its owner must act on (a Warning Event,
    posted once while it holds)."""

    reason: str
    message: str

    def describe(self) -> Event:
        return Event(self.reason, self.message, warning=True)


# The group's znodes are kept open for pods without the credential: one message for as long as
# any is left (one Event, not one per pod replaced; the operator logs their names).
ACCESS_OPEN = EngineNotice(
    "ZooKeeperAccessOpen",
    "ZooKeeper access is open for this group until its pods are recreated with the credential: "
    "pods made before ZooKeeper auth was turned on cannot use closed znodes. Delete them one at "
    "a time (the operator recreates each with the credential; the group serves from the others "
    "meanwhile); once the last is replaced, the group's znodes are closed to everyone but "
    "MatrixServe",
)


def access_closed(changed: int) -> Event:
    """The group's last pod without the credential is gone: its subtree is closed now."""
    return Event(
        "ZooKeeperAccessClosed",
        f"Every pod of the group carries the ZooKeeper credential: {changed} znode(s) of the "
        "group made open before are closed to everyone but MatrixServe now",
    )


def secret_taken(namespace: str, name: str) -> EngineNotice:
    """A Secret of the engines' Secret's name that is not ours: left alone, no engine pod made."""
    labels = ", ".join(f"{k}={v}" for k, v in SECRET_LABELS.items())
    return EngineNotice(
        "EngineSecretTaken",
        f"Secret {namespace}/{name} is not MatrixServe's (it lacks the labels {labels}): engine "
        "pods read their ZooKeeper credential from a Secret of that name, so none is created "
        "here and that Secret is left as it is; rename or delete it, or start the operator "
        "with another --engine-zookeeper-auth-secret",
    )


def policy_taken(namespace: str, name: str, labels: Mapping[str, str]) -> EngineNotice | None:
    """A NetworkPolicy of the engines' policy's name that is not ours, left as it is: it decides
    who reaches the engines there. Said, unless it is the chart's own (the chart writes the
    engines' policy in the namespaces its values list, under the same name)."""
    if labels.get(APP_NAME_LABEL) == CHART_APP:
        return None
    mine = ", ".join(f"{k}={v}" for k, v in POLICY_LABELS.items())
    return EngineNotice(
        "EnginePolicyTaken",
        f"NetworkPolicy {namespace}/{name} is not MatrixServe's (it lacks the labels {mine}): "
        "the operator leaves it as it is, and it decides who may reach the engines here; delete "
        "it for the operator to write the engines' policy, or start the operator with another "
        "--engine-network-policy-name",
    )


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
    """The engine pod's: the image's non-root user and group, the runtime's seccomp profile,
    and the group its volumes' files belong to (the credential's, readable by the group)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_GID,
        "fsGroup": ENGINE_GID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The engine container's: nothing beyond an unprivileged process, nothing written to the
    image (it writes only its /tmp volume; the credential's is read-only)."""
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
    mounts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``engine`` container: its port, readiness (``/readyz``: serving) and liveness
    (``/healthz``) probes, its NPUs (extended resource, limits = requests) beside its CPU and
    memory (:func:`engine_resources`), its security context, its /tmp
    (:func:`scratch_volumes`) and ``mounts`` if any."""
    cpu_memory = engine_resources(resources)
    extra = {"volumeMounts": [{"name": TMP_VOLUME, "mountPath": "/tmp"}, *(mounts or [])]}
    return {
        "name": ENGINE_CONTAINER,
        "image": image,
        "env": env,
        "ports": [{"name": "engine", "containerPort": ENGINE_PORT}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": ENGINE_PORT},
            "periodSeconds": READINESS_PERIOD_SECONDS,
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
        **extra,
    }


def owner_reference(kind: str, name: str, uid: str) -> dict[str, Any]:
    """Object ``name`` of ``kind`` (its UID) as an engine pod's controlling owner: the pod goes
    with it (a claimed warm pod too, from its claim on)."""
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def engine_pod(
    namespace: str,
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    owner: tuple[str, str, str],
    container: dict[str, Any],
    settings: EngineSettings,
    **spec: Any,
) -> dict[str, Any]:
    """An engine pod of one container: owned by ``owner`` (kind, name, UID; its controller, so
    it goes with it), restarted in place, no service-account token, the engine's security
    context and volumes (/tmp, ZooKeeper's identity); ``spec`` adds the kind's own fields (a
    node selector, affinity)."""
    kind, owner_name, uid = owner
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": dict(annotations),
            "ownerReferences": [owner_reference(kind, owner_name, uid)],
        },
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 10,
            "automountServiceAccountToken": False,
            **spec,
            "securityContext": pod_security_context(),
            "containers": [container],
            "volumes": [*scratch_volumes(), *credential_volumes(settings)],
        },
    }
