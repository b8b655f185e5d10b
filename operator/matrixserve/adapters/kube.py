"""The Kubernetes adapter: the operator's only reads and writes of pods (and of the Secrets they
read, written before them) and of its custom objects, for every kind (the kind is an argument,
never a method name).

The synchronous ``kubernetes`` client runs in worker threads (``asyncio.to_thread``). Creates
are idempotent (409 is success), deletes carry a UID precondition so a recreated pod of the same
name is never deleted by mistake, status is written with a merge patch of the status subresource.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kubernetes import client, config

from matrixserve.api.kinds import LABEL_SUPERPOD, Kind
from matrixserve.domain.observed import PodView


def _configuration(kubeconfig: str | None) -> client.Configuration:
    """The given kubeconfig; else in-cluster (a pod's service-account token); else $KUBECONFIG
    or ~/.kube/config."""
    conf = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
        return conf
    try:
        config.load_incluster_config(client_configuration=conf)
    except config.ConfigException:
        config.load_kube_config(client_configuration=conf)
    return conf


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    return client.ApiClient(_configuration(kubeconfig))


def credentials(kubeconfig: str | None = None) -> dict[str, Any]:
    """The same identity as :func:`api_client`, as plain connection facts (for kopf's login: the
    framework's own calls must not run under other credentials than the operator's)."""
    conf = _configuration(kubeconfig)
    header = conf.get_api_key_with_prefix("BearerToken") or conf.get_api_key_with_prefix(
        "authorization"
    )
    scheme, token = header.split(" ", 1) if header else (None, None)
    return {
        "server": conf.host,
        "ca_path": conf.ssl_ca_cert,
        "insecure": not conf.verify_ssl,
        "scheme": scheme,
        "token": token,
        "certificate_path": conf.cert_file,
        "private_key_path": conf.key_file,
    }


class KubeAdapter:
    def __init__(
        self, api: client.ApiClient, pod_secrets: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        # Secrets every pod we create reads (the engines' ZooKeeper credential), written into
        # the pod's namespace before it: created if absent, else patched once per namespace.
        self.pod_secrets = list(pod_secrets)
        self._secrets_written: set[tuple[str, str]] = set()
        # A node's SuperPod is fixed by its hardware: read each node once, not every pass.
        self._superpods: dict[str, str] = {}

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as stored, or None once it is gone."""
        try:
            body: dict[str, Any] = await asyncio.to_thread(
                self.custom.get_namespaced_custom_object,
                kind.group,
                kind.version,
                namespace,
                kind.plural,
                name,
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return body

    async def names(self, kind: Kind, namespaces: Sequence[str] = ()) -> set[tuple[str, str]]:
        """(namespace, name) of every object of ``kind`` in ``namespaces`` (all if none)."""

        def listing() -> list[dict[str, Any]]:
            if not namespaces:
                found: dict[str, Any] = self.custom.list_cluster_custom_object(
                    kind.group, kind.version, kind.plural
                )
                return list(found.get("items") or [])
            items: list[dict[str, Any]] = []
            for namespace in namespaces:
                found = self.custom.list_namespaced_custom_object(
                    kind.group, kind.version, namespace, kind.plural
                )
                items += found.get("items") or []
            return items

        return {
            (o["metadata"]["namespace"], o["metadata"]["name"])
            for o in await asyncio.to_thread(listing)
        }

    async def list_pods(self, namespace: str, labels: Mapping[str, str]) -> dict[str, PodView]:
        """The namespace's pods carrying all of ``labels``, by name."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        pods = await asyncio.to_thread(
            self.core.list_namespaced_pod, namespace, label_selector=selector
        )
        nodes: dict[str, str | None] = {}
        out = {}
        for pod in pods.items:
            node = pod.spec.node_name
            if node and node not in nodes:
                nodes[node] = await self._superpod_of(node)
            conditions = {c.type: c.status for c in pod.status.conditions or []}
            created: datetime | None = pod.metadata.creation_timestamp
            out[pod.metadata.name] = PodView(
                name=pod.metadata.name,
                uid=pod.metadata.uid,
                labels=dict(pod.metadata.labels or {}),
                phase=pod.status.phase or "Pending",
                ready=conditions.get("Ready") == "True",
                deleting=pod.metadata.deletion_timestamp is not None,
                node=node,
                superpod=nodes.get(node) if node else None,
                created_at=created.timestamp() if created else 0.0,
                annotations=dict(pod.metadata.annotations or {}),
                trouble=_trouble(pod),
            )
        return out

    async def _superpod_of(self, node: str) -> str | None:
        if node in self._superpods:
            return self._superpods[node]
        try:
            obj = await asyncio.to_thread(self.core.read_node, node)
        except client.ApiException:
            return None
        labels: dict[str, str] = obj.metadata.labels or {}
        superpod = labels.get(LABEL_SUPERPOD)
        if superpod is not None:
            self._superpods[node] = superpod
        return superpod

    async def owner_of(self, namespace: str, name: str) -> str | None:
        """Who owns the pod of this name ("no owner" if none), or None if there is no pod."""
        try:
            pod = await asyncio.to_thread(self.core.read_namespaced_pod, name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        owners = pod.metadata.owner_references or []
        return ", ".join(f"{o.kind} {o.name}" for o in owners) or "no owner"

    async def create_pod(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """True if created, False if it already existed."""
        for secret in self.pod_secrets:
            await self._write_secret(namespace, secret)
        try:
            await asyncio.to_thread(self.core.create_namespaced_pod, namespace, body)
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def _write_secret(self, namespace: str, secret: Mapping[str, Any]) -> None:
        """Create the Secret; one already there gets our data (its labels are left: it may be
        the chart's own, in the release namespace), once per namespace. A deleted one is created
        again with the next pod."""
        key = (namespace, str(secret["metadata"]["name"]))
        try:
            await asyncio.to_thread(self.core.create_namespaced_secret, namespace, secret)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            if key in self._secrets_written:
                return
            data = {k: secret[k] for k in ("data", "stringData") if k in secret}
            await asyncio.to_thread(self.core.patch_namespaced_secret, key[1], namespace, data)
        self._secrets_written.add(key)

    async def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        try:
            await asyncio.to_thread(
                self.core.delete_namespaced_pod,
                name,
                namespace,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        """Merge-patch the status subresource. Empty strings are omitted (omitempty): the API
        server would otherwise see them as null and reject them against the schema."""
        status = omit_empty(status)
        try:
            await asyncio.to_thread(
                self.custom.patch_namespaced_custom_object_status,
                kind.group,
                kind.version,
                namespace,
                kind.plural,
                name,
                {"status": status},
            )
        except client.ApiException as exc:
            if exc.status != 404:  # deleted meanwhile
                raise


def omit_empty(value: Any) -> Any:
    """The value as the API server stores it from our patches: empty strings left out."""
    if isinstance(value, dict):
        return {k: omit_empty(v) for k, v in value.items() if v != ""}
    if isinstance(value, list):
        return [omit_empty(v) for v in value]
    return value


# Container waiting reasons that mean the pod will not run without a change (not a start-up).
BLOCKING_WAITS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)


def _trouble(pod: Any) -> tuple[str, str] | None:
    """Why a pod cannot run, in the scheduler's or the kubelet's words, or None."""
    for c in pod.status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return "Unschedulable", c.message or ""
    for status in pod.status.container_statuses or []:
        waiting = status.state.waiting if status.state else None
        if waiting is not None and waiting.reason in BLOCKING_WAITS:
            return waiting.reason, waiting.message or ""
    return None
