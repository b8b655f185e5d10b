"""Fakes for unit tests of one layer: a scripted kazoo client (ZooKeeper's rules for znodes,
versions, ephemerals, ACLs and errors, in memory) and a scripted Kubernetes API (the 404/409/UID
rules the adapters rely on). Cluster tests use the real ones."""

from __future__ import annotations

import copy
import functools
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, TypeVar

from kazoo.client import KazooState
from kazoo.exceptions import (
    BadVersionError,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
)
from kazoo.security import ACL, OPEN_ACL_UNSAFE
from kubernetes import client

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.status import PDGroupStatus
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import PodView
from matrixserve.domain.pdgroup import GroupView, ZkView
from matrixserve.domain.pdgroup.pods import pod_labels


@dataclass
class Stat:
    version: int
    ephemeralOwner: int  # kazoo's ZnodeStat field name: the owning session, 0 if persistent


@dataclass
class Answer:
    """What kazoo's ``*_async`` calls return: ``get()`` gives the result or raises."""

    value: Any = None
    error: Exception | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class FakeKazoo:
    """In-memory znodes with ZooKeeper's rules. ``fail`` scripts errors: ``fail["set"] =
    [ConnectionLoss(), ...]`` raises them, in order, on the next ``set`` calls. ACLs: every
    znode's is open unless set (``acls``: by ``set_acls``, or at creation the ``acl`` given, else
    ``default_acl`` as kazoo's client does); a znode in ``foreign`` belongs to another identity
    (its ACL, children and ACL changes refused with ``NoAuthError``)."""

    def __init__(self, connect_on_start: bool = True) -> None:
        self.connect_on_start = connect_on_start
        # path -> (data, version, owner session: 0 for a persistent znode)
        self.nodes: dict[str, tuple[bytes, int, int]] = {"/": (b"", 0, 0)}
        self.session = 1  # this client's session id (client_id[0])
        self.connected = False
        self.listeners: list[Callable[[str], None]] = []
        self.fail: dict[str, list[Exception]] = {}
        self.calls: list[tuple[str, str]] = []
        self.starts = 0
        self.stops = 0
        self.acls: dict[str, list[ACL]] = {}
        self.default_acl: list[ACL] | None = None  # kazoo's client's (None: open)
        self.foreign: set[str] = set()

    # ------------------------------------------------------------------ session
    def add_listener(self, listener: Callable[[str], None]) -> None:
        self.listeners.append(listener)

    def transition(self, state: str) -> None:
        self.connected = state == KazooState.CONNECTED
        for listener in self.listeners:
            listener(state)

    def start_async(self) -> threading.Event:
        """kazoo's: the event set once connected. With ``connect_on_start`` (the default) the
        fake connects at once unless a queued ``fail["start"]`` entry says this try never
        will; without it, the test connects it (:meth:`transition`)."""
        self.starts += 1
        live = threading.Event()
        if self.fail.get("start"):
            self.fail["start"].pop(0)
        elif self.connect_on_start:
            self.transition(KazooState.CONNECTED)
            live.set()
        return live

    def stop(self) -> None:
        self.stops += 1
        self.connected = False

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ znodes
    def _maybe_fail(self, op: str) -> None:
        queued = self.fail.get(op)
        if queued:
            raise queued.pop(0)

    def _call(self, op: str, path: str) -> None:
        self.calls.append((op, path))
        self._maybe_fail(op)

    @staticmethod
    def _parent(path: str) -> str:
        return path.rsplit("/", 1)[0] or "/"

    def _children_of(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return sorted(
            p[len(prefix) :]
            for p in self.nodes
            if p.startswith(prefix) and "/" not in p[len(prefix) :]
        )

    def get(self, path: str) -> tuple[bytes, Stat]:
        self._call("get", path)
        if path not in self.nodes:
            raise NoNodeError(path)
        data, version, owner = self.nodes[path]
        return data, Stat(version, owner)

    def get_children(self, path: str) -> list[str]:
        self._call("get_children", path)
        if path not in self.nodes:
            raise NoNodeError(path)
        return self._children_of(path)

    def exists(self, path: str) -> Stat | None:
        self._call("exists", path)
        if path not in self.nodes:
            return None
        _, version, owner = self.nodes[path]
        return Stat(version, owner)

    def set(self, path: str, data: bytes, version: int = -1) -> None:
        self._call("set", path)
        if path not in self.nodes:
            raise NoNodeError(path)
        _, current, owner = self.nodes[path]
        if version not in (-1, current):
            raise BadVersionError(path)
        self.nodes[path] = (data, current + 1, owner)

    def create(
        self,
        path: str,
        value: bytes = b"",
        acl: list[ACL] | None = None,
        ephemeral: bool = False,
        makepath: bool = False,
    ) -> str:
        self._call("create", path)
        if path in self.nodes:
            raise NodeExistsError(path)
        parent = self._parent(path)
        if parent not in self.nodes:
            if not makepath:
                raise NoNodeError(parent)
            self.ensure_path(parent, acl)
        self.nodes[path] = (value, 0, self.session if ephemeral else 0)
        self._made(path, acl)
        return path

    def ensure_path(self, path: str, acl: list[ACL] | None = None) -> None:
        if path in self.nodes:
            return
        self.ensure_path(self._parent(path), acl)
        self.nodes[path] = (b"", 0, 0)
        self._made(path, acl)

    def _made(self, path: str, acl: list[ACL] | None) -> None:
        given = acl or self.default_acl
        if given is not None:
            self.acls[path] = list(given)
        else:
            self.acls.pop(path, None)  # a znode made again: not the old one's ACL

    def delete(self, path: str, version: int = -1, recursive: bool = False) -> None:
        self._call("delete", path)
        if path not in self.nodes:
            if recursive:
                return  # kazoo's recursive delete of an absent path is silent
            raise NoNodeError(path)
        if version not in (-1, self.nodes[path][1]):
            raise BadVersionError(path)
        children = self._children_of(path)
        if children and not recursive:
            raise NotEmptyError(path)
        for child in children:
            self.delete(f"{path}/{child}", recursive=True)
        del self.nodes[path]

    # ------------------------------------------------------------------ ACLs
    def get_acls(self, path: str) -> tuple[list[ACL], Stat]:
        self._call("get_acls", path)
        if path not in self.nodes:
            raise NoNodeError(path)
        if path in self.foreign:
            raise NoAuthError(path)
        _, version, owner = self.nodes[path]
        return list(self.acls.get(path, OPEN_ACL_UNSAFE)), Stat(version, owner)

    def set_acls(self, path: str, acls: list[ACL], version: int = -1) -> Stat:
        self._call("set_acls", path)
        if path not in self.nodes:
            raise NoNodeError(path)
        if path in self.foreign:
            raise NoAuthError(path)
        self.acls[path] = list(acls)
        _, current, owner = self.nodes[path]
        return Stat(current, owner)

    def _async(self, call: Callable[..., Any], *args: Any) -> Answer:
        try:
            return Answer(call(*args))
        except Exception as exc:
            return Answer(error=exc)

    def get_acls_async(self, path: str) -> Answer:
        return self._async(self.get_acls, path)

    def set_acls_async(self, path: str, acls: list[ACL], version: int = -1) -> Answer:
        return self._async(self.set_acls, path, acls, version)

    def get_children_async(self, path: str) -> Answer:
        if path in self.foreign:
            return Answer(error=NoAuthError(path))
        return self._async(self.get_children, path)

    def transaction(self) -> FakeTransaction:
        return FakeTransaction(self)

    @property
    def client_id(self) -> tuple[int, bytes] | None:
        return (self.session, b"password") if self.connected else None

    def expire(self, session: int | None = None) -> None:
        """A session expired (this client's unless ``session`` names another): its ephemerals
        are gone; for this client's own, it is LOST and gets a new session when it reconnects."""
        gone = self.session if session is None else session
        self.nodes = {p: n for p, n in self.nodes.items() if n[2] != gone}
        if gone == self.session:
            self.session += 1
            self.transition(KazooState.LOST)


class FakeTransaction:
    """kazoo's transaction: every operation or none (on a failure, the results hold the
    exception where it failed and a ``RolledBackError`` for the others)."""

    def __init__(self, zk: FakeKazoo) -> None:
        self.zk = zk
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def delete(self, path: str, version: int = -1) -> None:
        self.ops.append(("delete", (path,), {"version": version}))

    def create(
        self, path: str, value: bytes = b"", acl: list[ACL] | None = None, ephemeral: bool = False
    ) -> None:
        self.ops.append(("create", (path, value), {"acl": acl, "ephemeral": ephemeral}))

    def commit(self) -> list[Any]:
        saved = dict(self.zk.nodes)
        results: list[Any] = []
        for op, args, kwargs in self.ops:
            try:
                results.append(getattr(self.zk, op)(*args, **kwargs))
            except Exception as exc:
                self.zk.nodes = saved
                return [*[RolledBackError() for _ in results], exc]
        return results


def pdgroup_spec(p: int = 2, d: int = 1, **extra: Any) -> PDGroupSpec:
    """A Llama3-8B group of ``p`` prefills and ``d`` decodes of 2 NPUs (decode batch 32),
    ``extra`` top-level spec fields on top."""
    return PDGroupSpec.model_validate(
        {
            "service": "chat",
            "scenario": "general",
            "model": {"name": "llama3-8b"},
            "prefill": {"replicas": p, "devicesPerInstance": 2},
            "decode": {"replicas": d, "devicesPerInstance": 2, "batchSize": 32},
            **extra,
        }
    )


def engine_report(
    name: str, i: int, pod_uid: str | None = None, incarnation: str = ""
) -> zl.Report:
    """What the ``i``-th engine of a group reports (its resident process writes it): a pod IP on
    loopback, four dies' RoCE IPs from the testing range, the pod's UID (``uid-<name>`` unless
    given) and the engine's incarnation."""
    return zl.Report(
        instance=name,
        podIP=f"127.64.0.{i + 2}",
        port=8000,
        node="n1",
        superpod="sp0",
        dies=[0, 1, 2, 3],
        roceIps=[f"198.18.0.{4 * i + k + 1}" for k in range(4)],
        ts=0.0,
        podUid=f"uid-{name}" if pod_uid is None else pod_uid,
        incarnation=incarnation,
    )


# --------------------------------------------------------------------------- Kubernetes
_T = TypeVar("_T")


def api_calls(cls: type[_T]) -> type[_T]:
    """The fake's API calls take the client's options the adapters pass (``_request_timeout``),
    as the real client does; a fake's answers do not depend on them."""
    for name, fn in list(vars(cls).items()):
        if callable(fn) and re.match(r"(create|delete|read|patch|list|get)_", name):

            def call(
                self: Any, *args: Any, _fn: Any = fn, _request_timeout: Any = None, **kw: Any
            ) -> Any:
                return _fn(self, *args, **kw)

            setattr(cls, name, functools.wraps(fn)(call))
    return cls


def api_error(status: int) -> client.ApiException:
    reason = {404: "Not Found", 409: "Conflict"}.get(status, "Error")
    return client.ApiException(status=status, reason=reason)


@api_calls
@dataclass
class FakeCore:
    """``CoreV1Api``'s pod, Secret and node calls, with the API server's rules: a create of an
    existing name is 409, a delete with a stale UID precondition is 409, a missing pod is 404."""

    pods: dict[tuple[str, str], Any] = field(default_factory=dict)
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    nodes_down: dict[str, Any] = field(default_factory=dict)  # name -> not Ready since when
    node_specs: dict[str, client.V1NodeSpec] = field(default_factory=dict)  # cordon, taints
    node_reads: int = 0
    selectors: list[str] = field(default_factory=list)
    deletes: list[tuple[str, str, str | None]] = field(default_factory=list)
    secrets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # Every Secret call and pod creation, in order: ("create_pod" | "read_secret" |
    # "create_secret" | "patch_secret", namespace, name)
    calls: list[tuple[str, str, str]] = field(default_factory=list)

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any]) -> None:
        key = (namespace, body["metadata"]["name"])
        self.calls.append(("create_pod", *key))
        if key in self.pods:
            raise api_error(409)
        stored = copy.deepcopy(body)  # what the API server sets on creation
        stored["metadata"].setdefault("uid", str(uuid.uuid4()))
        stored["metadata"].setdefault("creationTimestamp", datetime.now(UTC))
        stored.setdefault("status", {"phase": "Pending"})
        stored["metadata"]["resourceVersion"] = "1"
        self.pods[key] = stored

    def delete_namespaced_pod(self, name: str, namespace: str, body: Any = None) -> None:
        uid = body.preconditions.uid if body is not None and body.preconditions else None
        self.deletes.append((namespace, name, uid))
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise api_error(404)
        if uid is not None and pod["metadata"].get("uid") != uid:
            raise api_error(409)
        version = (
            body.preconditions.resource_version if body is not None and body.preconditions else None
        )
        if version is not None and pod["metadata"].get("resourceVersion") != version:
            raise api_error(409)
        del self.pods[(namespace, name)]

    def read_namespaced_pod(self, name: str, namespace: str) -> client.V1Pod:
        body = self.pods.get((namespace, name))
        if body is None:
            raise api_error(404)
        pod = _v1_pod(body)
        pod.metadata.owner_references = [
            client.V1OwnerReference(api_version="v1", kind=o["kind"], name=o["name"], uid=o["uid"])
            for o in body["metadata"].get("ownerReferences") or []
        ]
        return pod

    def read_namespaced_secret(self, name: str, namespace: str) -> client.V1Secret:
        self.calls.append(("read_secret", namespace, name))
        body = self.secrets.get((namespace, name))
        if body is None:
            raise api_error(404)
        meta = body["metadata"]
        return client.V1Secret(
            metadata=client.V1ObjectMeta(name=meta["name"], labels=meta.get("labels")),
            data=copy.deepcopy(body.get("data")),
        )

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("create_secret", namespace, body["metadata"]["name"]))
        key = (namespace, body["metadata"]["name"])
        if key in self.secrets:
            raise api_error(409)
        self.secrets[key] = copy.deepcopy(body)

    def patch_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("patch_secret", namespace, name))
        if (namespace, name) not in self.secrets:
            raise api_error(404)
        self.secrets[(namespace, name)] = merge_patch(self.secrets[(namespace, name)], body)

    def list_namespaced_pod(self, namespace: str, label_selector: str = "") -> Any:
        """Selector terms ``k=v``, ``k`` (present) and ``!k`` (absent), as the API server."""
        self.selectors.append(label_selector)
        terms = [part for part in label_selector.split(",") if part]

        def matches(labels: dict[str, str]) -> bool:
            for term in terms:
                if term.startswith("!"):
                    if term[1:] in labels:
                        return False
                elif "=" in term:
                    k, v = term.split("=", 1)
                    if labels.get(k) != v:
                        return False
                elif term not in labels:
                    return False
            return True

        items = [
            _v1_pod(body)
            for (ns, _), body in self.pods.items()
            if ns == namespace and matches(body["metadata"].get("labels") or {})
        ]
        return client.V1PodList(items=items)

    def patch_namespaced_pod(
        self, name: str, namespace: str, body: dict[str, Any], _content_type: str = ""
    ) -> None:
        """A JSON merge patch (the only kind the fake takes); a ``metadata.resourceVersion`` in
        it is a precondition (409 if the pod has moved on), as the API server's optimistic
        concurrency."""
        assert _content_type == "application/merge-patch+json", _content_type
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise api_error(404)
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != pod["metadata"].get("resourceVersion"):
            raise api_error(409)
        patch = copy.deepcopy(body)
        patch["metadata"].pop("resourceVersion", None)
        self.pods[(namespace, name)] = merge_patch(pod, patch)
        self.bump(namespace, name)

    def bump(self, namespace: str, name: str) -> None:
        meta = self.pods[(namespace, name)]["metadata"]
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)

    def read_node(self, name: str) -> Any:
        self.node_reads += 1
        if name not in self.nodes:
            raise api_error(404)
        return client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=self.nodes[name]))

    def list_node(self) -> Any:
        """Each fake node with 8 NPUs allocatable, its spec from ``node_specs`` (none:
        schedulable, untainted), and Ready unless listed in ``nodes_down`` (name -> since
        when)."""
        down = self.nodes_down
        return client.V1NodeList(
            items=[
                client.V1Node(
                    metadata=client.V1ObjectMeta(name=name, labels=labels),
                    spec=self.node_specs.get(name, client.V1NodeSpec()),
                    status=client.V1NodeStatus(
                        allocatable={"huawei.com/Ascend910": "8"},
                        conditions=[
                            client.V1NodeCondition(
                                type="Ready",
                                status="True" if name not in down else "Unknown",
                                last_transition_time=down.get(name),
                            )
                        ],
                    ),
                )
                for name, labels in self.nodes.items()
            ]
        )


@api_calls
@dataclass
class FakeNetworking:
    """``NetworkingV1Api``'s NetworkPolicy calls with the API server's rules: a create of an
    existing name is 409, a read of none 404, a patch a JSON merge patch. ``calls`` may be a
    :class:`FakeCore`'s, for one ordered record with its pod creations."""

    policies: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, str, str]] = field(default_factory=list)

    def read_namespaced_network_policy(self, name: str, namespace: str) -> Any:
        self.calls.append(("read_policy", namespace, name))
        body = self.policies.get((namespace, name))
        if body is None:
            raise api_error(404)
        # the client's model of it: the spec as the API server serves it (camelCase)
        meta = client.V1ObjectMeta(name=name, labels=body["metadata"].get("labels"))
        return SimpleNamespace(metadata=meta, spec=copy.deepcopy(body["spec"]))

    def create_namespaced_network_policy(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("create_policy", namespace, body["metadata"]["name"]))
        key = (namespace, body["metadata"]["name"])
        if key in self.policies:
            raise api_error(409)
        self.policies[key] = copy.deepcopy(body)

    def patch_namespaced_network_policy(
        self, name: str, namespace: str, body: dict[str, Any], _content_type: str = ""
    ) -> None:
        assert _content_type == "application/merge-patch+json", _content_type
        self.calls.append(("patch_policy", namespace, name))
        if (namespace, name) not in self.policies:
            raise api_error(404)
        self.policies[(namespace, name)] = merge_patch(self.policies[(namespace, name)], body)


def _v1_pod(body: dict[str, Any]) -> client.V1Pod:
    """The parts of a pod the adapter reads, as the client's model."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=meta["name"],
            uid=meta.get("uid"),
            labels=meta.get("labels"),
            annotations=meta.get("annotations"),
            creation_timestamp=meta.get("creationTimestamp"),
            deletion_timestamp=meta.get("deletionTimestamp"),
            resource_version=meta.get("resourceVersion"),
            owner_references=[
                client.V1OwnerReference(
                    api_version=o.get("apiVersion", "v1"),
                    kind=o["kind"],
                    name=o["name"],
                    uid=o["uid"],
                    controller=o.get("controller"),
                )
                for o in meta.get("ownerReferences") or []
            ],
        ),
        spec=client.V1PodSpec(
            containers=[],
            node_name=spec.get("nodeName"),
            volumes=[
                client.V1Volume(
                    name=v["name"],
                    secret=client.V1SecretVolumeSource(secret_name=v["secret"]["secretName"])
                    if "secret" in v
                    else None,
                )
                for v in spec.get("volumes") or []
            ],
        ),
        status=client.V1PodStatus(
            phase=status.get("phase"),
            conditions=[
                client.V1PodCondition(
                    type=c["type"],
                    status=c["status"],
                    last_transition_time=c.get("lastTransitionTime"),
                )
                for c in status.get("conditions") or []
            ],
            container_statuses=[
                client.V1ContainerStatus(
                    name=cs["name"],
                    image="engine",
                    image_id="",
                    ready=bool(cs.get("ready")),
                    restart_count=int(cs.get("restartCount", 0)),
                    state=client.V1ContainerState(
                        running=client.V1ContainerStateRunning(started_at=cs["startedAt"])
                        if cs.get("startedAt")
                        else None,
                        waiting=client.V1ContainerStateWaiting(**cs["waiting"])
                        if cs.get("waiting")
                        else None,
                    ),
                    last_state=client.V1ContainerState(
                        terminated=client.V1ContainerStateTerminated(
                            exit_code=137, finished_at=cs["finishedAt"]
                        )
                    )
                    if cs.get("finishedAt")
                    else None,
                )
                for cs in status.get("containerStatuses") or []
            ]
            or None,
        ),
    )


@api_calls
@dataclass
class FakeCustom:
    """``CustomObjectsApi``'s get and status patch of namespaced objects."""

    objects: dict[tuple[str, str, str, str, str], dict[str, Any]] = field(default_factory=dict)
    patches: list[tuple[tuple[str, ...], dict[str, Any]]] = field(default_factory=list)

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        found = self.objects.get((group, version, namespace, plural, name))
        if found is None:
            raise api_error(404)
        return found

    def list_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str
    ) -> dict[str, Any]:
        return {
            "items": [
                o
                for (g, v, ns, p, _), o in self.objects.items()
                if (g, v, ns, p) == (group, version, namespace, plural)
            ]
        }

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> dict[str, Any]:
        return {
            "items": [
                o
                for (g, v, _, p, _), o in self.objects.items()
                if (g, v, p) == (group, version, plural)
            ]
        }

    def patch_namespaced_custom_object_status(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: Any
    ) -> None:
        key = (group, version, namespace, plural, name)
        self.patches.append((key, body))
        if key not in self.objects:
            raise api_error(404)
        self.objects[key] = merge_patch(self.objects[key], body)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies a ``merge-patch+json`` body."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# --------------------------------------------------------------------------- group views
def formed_zk(
    members: Mapping[str, tuple[zl.Role, int]],
    *,
    health_ts: float = 0.0,
    loads: Mapping[str, zl.Load] | None = None,
    incarnations: Mapping[str, str] | None = None,
    links: bool = True,
) -> ZkView:
    """Group ``g``'s ZooKeeper once ``members`` (name -> role and engine index, in order) have
    formed it: each reported (:func:`engine_report`, its incarnation if given), in the RoCE map
    (version 1) and its init order, serving in its health at ``health_ts`` (with its load if
    given), the decode meta and the entrances written; every prefill-decode link verified if
    ``links``."""
    reports = {
        n: engine_report(n, i, incarnation=incarnations[n])
        if incarnations is not None
        else engine_report(n, i)
        for n, (_, i) in members.items()
    }
    roce_map = zl.build_roce_map(reports.values(), {n: r for n, (r, _) in members.items()}, 1)
    health = {}
    for n, (r, i) in members.items():
        extra: dict[str, Any] = {}
        if incarnations is not None:
            extra["incarnation"] = incarnations[n]
        if loads is not None:
            extra["load"] = loads[n]
        health[n] = zl.Health(
            instance=n,
            role=r,
            state=zl.HealthState.SERVING,
            seq=1,
            ts=health_ts,
            podIP=f"127.64.0.{i + 2}",
            port=8000,
            **extra,
        )
    verified: dict[tuple[str, str], zl.Link] = {
        (p.instance, d.instance): zl.Link(
            prefill=p.instance,
            decode=d.instance,
            subLinks=zl.verify_sub_links(p, d),
            verifiedAt=0.0,
            initiator=p.instance,
        )
        for p in roce_map.prefill
        for d in roce_map.decode
        if links
    }
    return ZkView(
        connected=True,
        reports=reports,
        roce_map=roce_map,
        init_order=zl.InitOrder(epoch=1, roceMapVersion=1),
        health=health,
        decode_meta=zl.DecodeMeta(version=1, decodes=roce_map.decode),
        entrances=frozenset(e.instance for e in roce_map.prefill),
        links=verified,
    )


def running_pod(name: str, role: zl.Role, **fields: Any) -> PodView:
    """Group ``g``'s pod ``name``, Running and ready on ``n1`` (SuperPod ``sp0``), created at 0."""
    return PodView(
        name, f"uid-{name}", pod_labels("g", role, name), "Running", True, False, "n1", "sp0", 0.0,
        **fields,
    )  # fmt: skip


def formed_group(
    spec: PDGroupSpec,
    pods: Mapping[str, PodView],
    zk: ZkView,
    *,
    now: float,
    engine: EngineSettings,
    **fields: Any,
) -> GroupView:
    """PDGroup ``ns/g`` (generation 1, UID ``uid-g``) as one pass of its planner sees it:
    ``pods`` and ``zk`` (:func:`formed_zk`: once formed) at ``now``; ``fields``, the view's
    others (``previous``, ``nodes``, ``warm_pods``, ...); a ``previous`` status given as stored
    (a dict) is read as the planner reads it."""
    if isinstance(fields.get("previous"), Mapping):
        fields["previous"] = PDGroupStatus.read(fields["previous"])
    return GroupView("ns", "g", 1, spec, pods, zk, now=now, uid="uid-g", engine=engine, **fields)


def serving_group(
    spec: PDGroupSpec,
    members: dict[str, zl.Role],
    loads: dict[str, zl.Load],
    incarnations: dict[str, str],
    *,
    now: float,
    previous: dict[str, Any],
    engine: EngineSettings,
    pods: dict[str, zl.Role] | None = None,
) -> GroupView:
    """Group ``g`` formed by ``members``, each serving with its ``loads`` and its incarnation in
    its health at ``now``; its pods ``pods`` (the members unless given) Running and ready."""
    index = {n: i for i, n in enumerate(sorted(set(members) | set(pods or {})))}
    zk = formed_zk(
        {n: (r, index[n]) for n, r in members.items()},
        health_ts=now,
        loads=loads,
        incarnations=incarnations,
        links=False,
    )
    pod_views = {n: running_pod(n, r) for n, r in (pods or members).items()}
    return formed_group(spec, pod_views, zk, now=now, engine=engine, previous=previous)
