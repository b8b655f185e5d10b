"""The Kubernetes adapter: the operator's only reads and writes of pods (and of the Secrets they
read, written before them) and of its custom objects, for every kind (the kind is an argument,
never a method name).

The synchronous ``kubernetes`` client runs in worker threads (``asyncio.to_thread``), every call
bounded (:data:`REQUEST_TIMEOUT`: an API server that stops answering fails the pass, never hangs
it and its thread). Creates
are idempotent (409 is success), deletes carry a UID precondition so a recreated pod of the same
name is never deleted by mistake, status is written with a merge patch of the status subresource.

The Secrets pods read (the engines' ZooKeeper identity) and the engines' NetworkPolicy are
written into a namespace before a pod there, then taken as in place
for ``SECRET_RECHECK_SECONDS`` (a pass costs no call); after that one read finds a deleted copy
(made again) or a changed one (ours put back: the Secret's data, the policy's spec). One of that
name that is not ours (without our labels) is never touched: a Secret so taken keeps every
engine pod out of its namespace (they would mount it), a policy does not (it guards them).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import urllib3
from kubernetes import client, config

from matrixserve.api.kinds import (
    LABEL_SERVER,
    LABEL_SUPERPOD,
    NPU_RESOURCE,
    Kind,
)
from matrixserve.domain.enginepod import ENGINE_CONTAINER
from matrixserve.domain.observed import NodeView, PodView, Taint

SECRET_RECHECK_SECONDS = 60.0
# (connect, read) seconds of every API call: a read waits at most this long for the next bytes.
REQUEST_TIMEOUT = (5.0, 30.0)
# A connection refused or reset is tried again (3 times, at once); a read that timed out is not
# (urllib3 would try a GET or DELETE 4 times: 4 x REQUEST_TIMEOUT's read before a pass failed).
RETRIES = urllib3.Retry(total=3, read=0, redirect=0)
NODES_TTL_SECONDS = 2.0


def _configuration(kubeconfig: str | None) -> client.Configuration:
    """The given kubeconfig; else in-cluster (a pod's service-account token); else $KUBECONFIG
    or ~/.kube/config. Retried as :data:`RETRIES` says."""
    conf = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
    else:
        try:
            config.load_incluster_config(client_configuration=conf)
        except config.ConfigException:
            config.load_kube_config(client_configuration=conf)
    conf.retries = RETRIES
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


@dataclass(frozen=True)
class _Kept:
    """How one kind of object a namespace's engine pods need is read, made and put back:
    ``field`` is what must be as we wrote it (a Secret's data, a NetworkPolicy's spec)."""

    kind: str
    field: str
    # each also takes the client's options (``_request_timeout``)
    read: Callable[..., Any]  # (name, namespace)
    create: Callable[..., Any]  # (namespace, body)
    patch: Callable[..., Any]  # (name, namespace, merge patch)


class KubeAdapter:
    # Called before every write (raises to refuse it): the operator's leadership, so a standby
    # or a deposed leader changes nothing (None: every write goes, as for the gateway).
    fence: Callable[[], None] | None = None

    def __init__(
        self,
        api: client.ApiClient,
        pod_secrets: Sequence[Mapping[str, Any]] = (),
        clock: Callable[[], float] = time.monotonic,
        pod_policies: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.networking = client.NetworkingV1Api(api)
        # Secrets every pod we create reads (the engines' ZooKeeper credential), and the
        # NetworkPolicies that guard them, written into the pod's namespace before
        # it (:meth:`pod_secrets_taken`, :meth:`pod_policies_taken`).
        self.pod_secrets = list(pod_secrets)
        self.pod_policies = list(pod_policies)
        # (kind, namespace, name) -> when found as we wrote it
        self._checked: dict[tuple[str, str, str], float] = {}
        self._clock = clock
        # A node's SuperPod is fixed by its hardware: read each node once, not every pass.
        self._superpods: dict[str, str] = {}
        self._nodes: tuple[float, dict[str, NodeView]] | None = None
        self._usage: tuple[float, dict[str, int]] | None = None

    async def _custom(
        self, call: Callable[..., Any], kind: Kind, namespace: str, *rest: Any, **options: Any
    ) -> Any:
        """A CustomObjectsApi ``call`` on ``kind`` in ``namespace``, on a worker thread."""
        return await self._call(
            call, kind.group, kind.version, namespace, kind.plural, *rest, **options
        )

    async def _call(self, call: Callable[..., Any], *args: Any, **options: Any) -> Any:
        """``call`` on a worker thread, bounded by :data:`REQUEST_TIMEOUT`."""
        return await asyncio.to_thread(call, *args, _request_timeout=REQUEST_TIMEOUT, **options)

    def _fenced(self) -> None:
        if self.fence is not None:
            self.fence()

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as stored, or None once it is gone."""
        try:
            body: dict[str, Any] = await self._custom(
                self.custom.get_namespaced_custom_object,
                kind,
                namespace,
                name,
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return body

    async def objects(self, kind: Kind, namespace: str) -> list[dict[str, Any]]:
        """Every object of ``kind`` in ``namespace``, as stored."""
        found: dict[str, Any] = await self._custom(
            self.custom.list_namespaced_custom_object,
            kind,
            namespace,
        )
        return list(found.get("items") or [])

    async def names(self, kind: Kind, namespaces: Sequence[str] = ()) -> set[tuple[str, str]]:
        """(namespace, name) of every object of ``kind`` in ``namespaces`` (all if none)."""

        def listing() -> list[dict[str, Any]]:
            if not namespaces:
                found: dict[str, Any] = self.custom.list_cluster_custom_object(
                    kind.group, kind.version, kind.plural, _request_timeout=REQUEST_TIMEOUT
                )
                return list(found.get("items") or [])
            items: list[dict[str, Any]] = []
            for namespace in namespaces:
                found = self.custom.list_namespaced_custom_object(
                    kind.group,
                    kind.version,
                    namespace,
                    kind.plural,
                    _request_timeout=REQUEST_TIMEOUT,
                )
                items += found.get("items") or []
            return items

        return {
            (o["metadata"]["namespace"], o["metadata"]["name"])
            for o in await asyncio.to_thread(listing)  # its calls bounded
        }

    async def list_pods(
        self, namespace: str, labels: Mapping[str, str], also: Sequence[str] = ()
    ) -> dict[str, PodView]:
        """The namespace's pods carrying all of ``labels`` (and matching the selector terms in
        ``also``, e.g. ``"!key"``), by name."""
        selector = ",".join([*(f"{k}={v}" for k, v in labels.items()), *also])
        pods = await self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
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
                restarts=_engine_status(pod).restart_count if _engine_status(pod) else 0,
                last_exit_at=_last_exit(pod),
                restart_backoff=_restart_backoff(pod),
                resource_version=pod.metadata.resource_version or "",
                gated=bool(pod.spec.scheduling_gates),
                pinned=(pod.spec.node_selector or {}).get(LABEL_SERVER),
                owner=next(
                    (
                        f"{o.kind}/{o.name}"
                        for o in pod.metadata.owner_references or []
                        if o.controller
                    ),
                    None,
                ),
            )
        return out

    async def nodes(self, max_age: float = NODES_TTL_SECONDS) -> dict[str, NodeView]:
        """Every server as the scheduler sees it: Ready (and since when not), cordoned, its
        taints and labels, NPUs allocatable (recovery's node tier, and where its new pods may
        go). One list shared by every group's pass while it is younger than ``max_age`` s (a
        pass that may recover asks for a fresh one).
        Listing nodes is what the operator's ClusterRole grants (``nodes``: get, list)."""
        now = self._clock()
        if self._nodes is not None and now - self._nodes[0] < max_age:
            return self._nodes[1]
        found = await self._call(self.core.list_node)
        out = {}
        for node in found.items:
            allocatable = (node.status.allocatable or {}).get(NPU_RESOURCE)
            ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
            down_since = None
            if ready is None or ready.status != "True":
                flipped: datetime | None = ready.last_transition_time if ready else None
                down_since = flipped.timestamp() if flipped else node_created(node)
            out[node.metadata.name] = NodeView(
                node.metadata.name,
                down_since is None,
                int(allocatable) if allocatable is not None else 0,
                cordoned=bool(node.spec.unschedulable),
                taints=tuple(Taint(t.key, t.value or "", t.effect) for t in node.spec.taints or []),
                down_since=down_since,
                labels=dict(node.metadata.labels or {}),
            )
        self._nodes = (now, out)
        return out

    async def npus_in_use(
        self, namespaces: Sequence[str] = (), max_age: float = NODES_TTL_SECONDS
    ) -> dict[str, int]:
        """NPUs every pod of the cluster holds or has reserved, by server: a bound pod's on its
        node, an unbound pod's on the server its node selector pins it to (a gang's reservation,
        gated or not yet scheduled); finished pods hold none. ``namespaces``: only theirs (an
        operator watching some namespaces may list pods there alone: another tenant's pods are
        then the scheduler's to count, and a server taken under a reservation is found by the
        gang's bound); none: the cluster's. One list shared by every group's pass while it is
        younger than ``max_age`` s."""
        now = self._clock()
        if self._usage is not None and now - self._usage[0] < max_age:
            return self._usage[1]
        running = "status.phase!=Succeeded,status.phase!=Failed"
        if namespaces:
            lists = await asyncio.gather(
                *(
                    self._call(self.core.list_namespaced_pod, namespace, field_selector=running)
                    for namespace in namespaces
                )
            )
            items = [pod for found in lists for pod in found.items]
        else:
            found = await self._call(self.core.list_pod_for_all_namespaces, field_selector=running)
            items = found.items
        used: dict[str, int] = {}
        for pod in items:
            if (pod.status.phase or "") in ("Succeeded", "Failed"):
                continue
            # bound: its node's; pinned and not bound yet (gated, or ungated and not yet
            # scheduled): the server it will be bound to
            server = pod.spec.node_name or (pod.spec.node_selector or {}).get(LABEL_SERVER)
            npus = sum(_npus(c) for c in pod.spec.containers or [])
            if server and npus:
                used[server] = used.get(server, 0) + npus
        self._usage = (now, used)
        return used

    async def _superpod_of(self, node: str) -> str | None:
        if node in self._superpods:
            return self._superpods[node]
        try:
            obj = await self._call(self.core.read_node, node)
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
            pod = await self._call(self.core.read_namespaced_pod, name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        owners = pod.metadata.owner_references or []
        return ", ".join(f"{o.kind} {o.name}" for o in owners) or "no owner"

    async def create_pod(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """True if created, False if it already existed. The Secrets it reads and the
        NetworkPolicies that guard it first (:class:`SecretTaken` if one of those Secrets is
        someone else's there; a policy that is, is left alone)."""
        taken = await self.pod_secrets_taken(namespace)
        if taken:
            raise SecretTaken(namespace, taken)
        await self.pod_policies_taken(namespace)
        try:
            self._fenced()
            await self._call(self.core.create_namespaced_pod, namespace, body)
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._reserved(body)
        return True

    def _reserved(self, body: Mapping[str, Any]) -> None:
        """A pod pinned to a server is that server's reservation from now on: counted in
        the cached usage at once, so that the next pass (of any group) within the cache's age
        does not give the same NPUs again."""
        spec = body.get("spec") or {}
        server = (spec.get("nodeSelector") or {}).get(LABEL_SERVER)
        if self._usage is None or not server:
            return
        npus = 0
        for container in spec.get("containers") or []:
            limits = (container.get("resources") or {}).get("limits") or {}
            with contextlib.suppress(TypeError, ValueError):
                npus += int(limits.get(NPU_RESOURCE) or 0)
        used = self._usage[1]
        used[server] = used.get(server, 0) + npus

    async def pod_secrets_taken(self, namespace: str) -> list[str]:
        """Put the Secrets our pods read in place in ``namespace``: created if absent, our data
        put back if it differs. One found in place is not asked about again for
        ``SECRET_RECHECK_SECONDS``. Returns the names held there by a Secret that is not ours
        (without our labels: a tenant's, left as it is)."""
        kept = _Kept(
            "Secret",
            "data",
            self.core.read_namespaced_secret,
            self.core.create_namespaced_secret,
            self.core.patch_namespaced_secret,
        )
        return list(await self._keep(namespace, self.pod_secrets, kept))

    async def pod_policies_taken(self, namespace: str) -> dict[str, dict[str, str]]:
        """Put the engines' NetworkPolicies in place in ``namespace``, as :meth:`pod_secrets_taken`
        does the Secrets (their spec ours). Returns those held there by a policy that is not ours
        (name -> its labels: the chart's own, or a tenant's), left as they are."""

        def patch(name: str, namespace: str, body: Mapping[str, Any], **options: Any) -> Any:
            return self.networking.patch_namespaced_network_policy(
                name, namespace, body, _content_type="application/merge-patch+json", **options
            )

        kept = _Kept(
            "NetworkPolicy",
            "spec",
            self.networking.read_namespaced_network_policy,
            self.networking.create_namespaced_network_policy,
            patch,
        )
        return await self._keep(namespace, self.pod_policies, kept)

    async def _keep(
        self, namespace: str, wanted: Sequence[Mapping[str, Any]], kept: _Kept
    ) -> dict[str, dict[str, str]]:
        """Each of ``wanted`` in place in ``namespace`` (checked at most once per
        ``SECRET_RECHECK_SECONDS`` once found as we wrote it); the names held by one that is
        not ours, with its labels."""
        taken = {}
        for body in wanted:
            key = (kept.kind, namespace, str(body["metadata"]["name"]))
            checked = self._checked.get(key)
            if checked is not None and self._clock() - checked < SECRET_RECHECK_SECONDS:
                continue
            theirs = await self._write(namespace, body, kept)
            if theirs is None:
                self._checked[key] = self._clock()
            else:
                self._checked.pop(key, None)
                taken[key[2]] = theirs
        return taken

    async def _write(
        self, namespace: str, body: Mapping[str, Any], kept: _Kept
    ) -> dict[str, str] | None:
        """Create the object, or put ours back in it; None once it is ours as we wrote it, the
        labels of the one there if it is not ours."""
        name = str(body["metadata"]["name"])
        found = await self._read(kept, namespace, name)
        if found is None:
            try:
                self._fenced()
                await self._call(kept.create, namespace, body)
                return None
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
            found = await self._read(kept, namespace, name)  # made meanwhile: whose is it?
            if found is None:  # and deleted meanwhile: the pass fails, the next one retries
                raise RuntimeError(f"{kept.kind} {namespace}/{name} came and went meanwhile")
        labels: dict[str, str] = dict(found.metadata.labels or {})
        if any(labels.get(k) != v for k, v in body["metadata"]["labels"].items()):
            return labels
        have = self.api.sanitize_for_serialization(getattr(found, kept.field)) or {}
        change = _diff(have, body[kept.field])
        if change is not _SAME:
            self._fenced()
            await self._call(kept.patch, name, namespace, {kept.field: change})
        return None

    async def _read(self, kept: _Kept, namespace: str, name: str) -> Any:
        try:
            return await self._call(kept.read, name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def delete_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        force: bool = False,
        resource_version: str | None = None,
    ) -> bool:
        """Delete the pod of that UID (and, if given, still at that resourceVersion: a warm pod
        claimed meanwhile is not deleted); ``force``: grace period 0 (its server is down: the
        API server removes it at once, no kubelet is waited for)."""
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid, resource_version=resource_version)
        )
        if force:
            options.grace_period_seconds = 0
        self._fenced()
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace, body=options)
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    async def ungate_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Remove the pod's scheduling gates, only while it is the pod of that UID (a JSON
        patch's test). True if lifted; False if it is gone, someone else's now (the test
        failed: 422), or no longer gated (no path to remove: 422)."""
        body = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "remove", "path": "/spec/schedulingGates"},
        ]
        return await self._patch_pod(
            namespace, name, body, "application/json-patch+json", (404, 409, 422)
        )

    async def claim_pod(
        self, namespace: str, name: str, resource_version: str, patch: Mapping[str, Any]
    ) -> bool:
        """Merge-patch the pod's metadata only if it is still at ``resource_version``
        (optimistic concurrency: the API server refuses a patch carrying a stale
        resourceVersion with 409). True if the claim is ours; False if someone changed the pod
        first (another claim, a deletion) or it is gone."""
        body = {"metadata": {**patch, "resourceVersion": resource_version}}
        # a JSON merge patch: ownerReferences replaced as a whole (a strategic merge would
        # merge them by UID and keep the pool's controller reference beside the group's)
        return await self._patch_pod(
            namespace, name, body, "application/merge-patch+json", (404, 409)
        )

    async def _patch_pod(
        self, namespace: str, name: str, body: Any, content_type: str, refused: tuple[int, ...]
    ) -> bool:
        """Patch a pod (fenced: only while this replica leads); False for a ``refused``
        status (its precondition failed, or the pod is gone)."""
        self._fenced()
        try:
            await self._call(
                self.core.patch_namespaced_pod, name, namespace, body, _content_type=content_type
            )
        except client.ApiException as exc:
            if exc.status in refused:
                return False
            raise
        return True

    async def create_object(self, kind: Kind, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create a custom object; True if created, False if one of that name was there."""
        self._fenced()
        try:
            await self._custom(
                self.custom.create_namespaced_custom_object,
                kind,
                namespace,
                body,
            )
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def patch_object(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        resource_version: str | None = None,
    ) -> bool:
        """Merge-patch a custom object (its spec, its metadata), only while it is at
        ``resource_version`` if given. True if patched; False if it is gone or changed
        meanwhile (409)."""
        body = dict(patch)
        if resource_version is not None:
            body["metadata"] = {
                **(patch.get("metadata") or {}),
                "resourceVersion": resource_version,
            }
        self._fenced()
        try:
            await self._custom(
                self.custom.patch_namespaced_custom_object,
                kind,
                namespace,
                name,
                body,
                _content_type="application/merge-patch+json",
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
        self._fenced()
        try:
            await self._custom(
                self.custom.patch_namespaced_custom_object_status,
                kind,
                namespace,
                name,
                {"status": status},
            )
        except client.ApiException as exc:
            if exc.status != 404:  # deleted meanwhile
                raise


_SAME = object()


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns the stored status ``old`` into ``new``: only
    what differs, compared as the API server stores it (empty strings and ``null`` are absent).
    A top-level key ``new`` does not name is left as it is (a ``None`` there deletes it); below
    the top, ``new`` is the whole truth: a key it no longer has is deleted (a merge patch alone
    would keep it, and a record rewritten with fewer keys would carry stale ones)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        if value is None or value == "":
            if key in old:
                patch[key] = None
            continue
        diff = _diff(old.get(key, _SAME), as_stored(value))
        if diff is not _SAME:
            patch[key] = diff
    return patch


def _diff(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        out: dict[str, Any] = {k: None for k in old if k not in new}
        for key, value in new.items():
            diff = _diff(old.get(key, _SAME), value)
            if diff is not _SAME:
                out[key] = diff
        return out or _SAME
    return _SAME if old == new else new


def as_stored(value: Any) -> Any:
    """The value as the API server keeps it after our merge patch: empty strings left out, and
    the keys a ``null`` deletes gone (a ``None`` at the top level compares as an absent key)."""
    if isinstance(value, dict):
        return {k: as_stored(v) for k, v in value.items() if v != "" and v is not None}
    if isinstance(value, list):
        return [as_stored(v) for v in value]
    return value


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


def _npus(container: client.V1Container) -> int:
    """The NPUs a container asks for (extended resources: requests equal limits)."""
    resources = container.resources
    if resources is None:
        return 0
    asked = (resources.limits or {}).get(NPU_RESOURCE) or (resources.requests or {}).get(
        NPU_RESOURCE
    )
    try:
        return int(asked) if asked is not None else 0
    except ValueError:
        return 0


def _engine_status(pod: client.V1Pod) -> Any:
    """The engine container's status (the kubelet lists containers by name: a sidecar may
    come first), or None."""
    statuses = pod.status.container_statuses or []
    return next((s for s in statuses if s.name == ENGINE_CONTAINER), None)


def _last_exit(pod: client.V1Pod) -> float | None:
    """When the engine container last ended (its ``lastState.terminated``, or its state while
    it waits to be restarted), None if it never did."""
    engine = _engine_status(pod)
    if engine is None:
        return None
    for state in (engine.state, engine.last_state):
        terminated = state.terminated if state is not None else None
        if terminated is not None:
            finished: datetime | None = terminated.finished_at
            if finished is not None:
                return finished.timestamp()
    return None


_BACKOFF = re.compile(r"back-off ((?:\d+(?:\.\d+)?(?:h|ms|m|s))+) restarting")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def node_created(node: client.V1Node) -> float:
    """When the Node object was created (a server that never said Ready: down since then)."""
    created: datetime | None = node.metadata.creation_timestamp
    return created.timestamp() if created else 0.0


def _restart_backoff(pod: client.V1Pod) -> float | None:
    """The back-off the kubelet waits before restarting the engine container, from its
    ``CrashLoopBackOff`` message (a Go duration: ``10s``, ``2m40s``, ``5m0s``); None if it is
    not waiting in one (or says it otherwise)."""
    engine = _engine_status(pod)
    waiting = engine.state.waiting if engine is not None and engine.state is not None else None
    if waiting is None or waiting.reason != "CrashLoopBackOff":
        return None
    found = _BACKOFF.search(waiting.message or "")
    if found is None:
        return None
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", found.group(1))
    return sum(float(n) * _UNITS[unit] for n, unit in parts)


def _running_since(pod: client.V1Pod) -> float | None:
    """When the pod's engine container started running; None while it does not run."""
    engine = _engine_status(pod)
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
