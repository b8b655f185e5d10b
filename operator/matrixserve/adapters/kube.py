"""The Kubernetes adapter: the operator's only reads and writes of pods (and of the Secrets they
read, written before them) and of its custom objects, for every kind (the kind is an argument,
never a method name).

The synchronous ``kubernetes`` client runs in worker threads (``asyncio.to_thread``). Creates
are idempotent (409 is success), deletes carry a UID precondition so a recreated pod of the same
name is never deleted by mistake, status is written with a merge patch of the status subresource.

The Secrets pods read (the engines' ZooKeeper identity, issue 16 finding 7) are written into a
namespace before a pod there, then taken as in place for ``SECRET_RECHECK_SECONDS`` (a pass
costs no call); after that one read finds a deleted copy (made again) or a changed one (our
data put back). A Secret of that name that is not ours (without our labels) is never touched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from kubernetes import client, config

from matrixserve.api.kinds import LABEL_SUPERPOD, Kind
from matrixserve.domain.enginepod import ENGINE_CONTAINER
from matrixserve.domain.observed import PodView

SECRET_RECHECK_SECONDS = 60.0


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


class SecretTaken(Exception):
    """A Secret our pods read is, in that namespace, someone else's: no pod is created there."""

    def __init__(self, namespace: str, names: Sequence[str]) -> None:
        super().__init__(f"Secrets {', '.join(names)} in {namespace} are not ours")
        self.namespace = namespace
        self.names = list(names)


class KubeAdapter:
    def __init__(
        self,
        api: client.ApiClient,
        pod_secrets: Sequence[Mapping[str, Any]] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        # Secrets every pod we create reads (the engines' ZooKeeper credential), written into
        # the pod's namespace before it (:meth:`pod_secrets_taken`).
        self.pod_secrets = list(pod_secrets)
        self._secrets_checked: dict[tuple[str, str], float] = {}  # -> when found as we wrote it
        self._clock = clock
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
            ready_flip = next(
                (c.last_transition_time for c in pod.status.conditions or [] if c.type == "Ready"),
                None,
            )
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
                running_since=_running_since(pod),
                ready_changed_at=ready_flip.timestamp() if ready_flip else None,
                secret_volumes=frozenset(
                    v.secret.secret_name for v in pod.spec.volumes or [] if v.secret is not None
                ),
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
        """True if created, False if it already existed. The Secrets it reads first
        (:class:`SecretTaken` if one of them is someone else's there)."""
        taken = await self.pod_secrets_taken(namespace)
        if taken:
            raise SecretTaken(namespace, taken)
        try:
            await asyncio.to_thread(self.core.create_namespaced_pod, namespace, body)
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def pod_secrets_taken(self, namespace: str) -> list[str]:
        """Put the Secrets our pods read in place in ``namespace``: created if absent, our data
        put back if it differs. One found in place is not asked about again for
        ``SECRET_RECHECK_SECONDS``. Returns the names held there by a Secret that is not ours
        (without our labels: a tenant's, left as it is)."""
        taken = []
        for secret in self.pod_secrets:
            key = (namespace, str(secret["metadata"]["name"]))
            checked = self._secrets_checked.get(key)
            if checked is not None and self._clock() - checked < SECRET_RECHECK_SECONDS:
                continue
            if await self._write_secret(namespace, secret):
                self._secrets_checked[key] = self._clock()
            else:
                self._secrets_checked.pop(key, None)
                taken.append(key[1])
        return taken

    async def _write_secret(self, namespace: str, secret: Mapping[str, Any]) -> bool:
        """Create the Secret, or give ours our data; False if the one there is not ours."""
        name = str(secret["metadata"]["name"])
        found = await self._read_secret(namespace, name)
        if found is None:
            try:
                await asyncio.to_thread(self.core.create_namespaced_secret, namespace, secret)
                return True
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
            found = await self._read_secret(namespace, name)  # made meanwhile: whose is it?
            if found is None:  # and deleted meanwhile: the pass fails, the next one retries
                raise RuntimeError(f"Secret {namespace}/{name} came and went meanwhile")
        labels: Mapping[str, str] = found.metadata.labels or {}
        if any(labels.get(k) != v for k, v in secret["metadata"]["labels"].items()):
            return False
        if dict(found.data or {}) != secret["data"]:
            await asyncio.to_thread(
                self.core.patch_namespaced_secret, name, namespace, {"data": secret["data"]}
            )
        return True

    async def _read_secret(self, namespace: str, name: str) -> Any:
        try:
            return await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

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


def _running_since(pod: client.V1Pod) -> float | None:
    """When the pod's engine container started running (the kubelet lists containers by name:
    a sidecar may come first); None while it does not run."""
    statuses = pod.status.container_statuses or []
    engine = next((s for s in statuses if s.name == ENGINE_CONTAINER), None)
    if engine is None or engine.state is None or engine.state.running is None:
        return None
    started: datetime | None = engine.state.running.started_at
    return started.timestamp() if started else None


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
