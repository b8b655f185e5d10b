"""From a Pod (its JSON as the API server returns it) to the processes that stand in for its
containers: image → local command, command/args with ``$(VAR)`` expansion, env with the downward
API, probes, Secret volumes. Pure: secrets and config maps come through a lookup callable.

Secret volumes (the engines', operator's and gateway's ZooKeeper identity comes as a file): the
kubelet's projection of a Secret's keys into files with their modes (:func:`secret_files`), and,
since a process here cannot see the container's mount path, the path a container names moved to the
folder the emulator wrote them in (:func:`translate`: in its env, command, args and working
directory, where the mount path starts a value or follows ``=``), as the service-account token's
kubeconfig is pointed at by ``KUBECONFIG``.

Docker semantics: ``command`` replaces the image's entrypoint; ``args`` replace its default
arguments. The image map names, per image repository (tag ignored), the local entrypoint; the
special entrypoint ``[]`` means "run the container's command on the host" (for sleep-like test
pods).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from matrixserve.api.kinds import NPU_RESOURCE

SecretLookup = Callable[[str, str], Mapping[str, str] | None]  # (kind, name) -> data or None


class ContainerConfigError(Exception):
    """The container cannot be started as specified (kubelet's CreateContainerConfigError)."""


class UnknownImageError(Exception):
    """No local command is mapped for the image (reported like ErrImagePull)."""


class MountError(Exception):
    """A volume cannot be set up yet (the kubelet's FailedMount): the pod waits in
    ContainerCreating and the mount is tried again."""


@dataclass(frozen=True)
class Probe:
    kind: str  # "http", "tcp" or "exec"
    port: int = 0
    path: str = "/"
    command: tuple[str, ...] = ()
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclass(frozen=True)
class ContainerPlan:
    name: str
    image: str
    argv: tuple[str, ...]
    env: dict[str, str]
    working_dir: str | None
    readiness: Probe | None
    liveness: Probe | None
    ports: dict[str, int] = field(default_factory=dict)


def image_repository(image: str) -> str:
    """``registry:5000/org/name:tag@sha256:…`` → ``registry:5000/org/name``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


def resolve_entrypoint(image: str, image_map: Mapping[str, list[str]]) -> list[str]:
    repo = image_repository(image)
    candidates = [repo]
    first, _, rest = repo.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        candidates.append(rest)  # registry host stripped: registry.local/org/name -> org/name
        if rest.startswith("library/"):
            candidates.append(rest.removeprefix("library/"))
    for candidate in candidates:
        if candidate in image_map:
            return list(image_map[candidate])
    known = ", ".join(sorted(image_map)) or "none"
    raise UnknownImageError(
        f'image "{image}" is not known to the node emulator (known images: {known}); '
        "add it to the emulator's image map"
    )


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined vars expand, ``$$`` escapes, unknown stay as is."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(replace, text)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    status = pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIP": status.get("podIP", ""),
    }
    if path in simple:
        return str(simple[path])
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        match = re.fullmatch(rf"{re.escape(prefix)}\['([^']+)'\]", path)
        if match:
            return str((meta.get(source) or {}).get(match.group(1), ""))
    raise ContainerConfigError(f"unsupported fieldRef fieldPath {path!r}")


def pod_hostname(pod: Mapping[str, Any]) -> str:
    """The pod's hostname: ``spec.hostname`` (a StatefulSet sets the pod's name), else the pod's
    name, to 63 characters (the kubelet's)."""
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    return str(spec.get("hostname") or meta.get("name", ""))[:63].rstrip("-.")


def resource_ref(container: Mapping[str, Any], resource: str) -> str:
    kind, _, name = resource.partition(".")
    if kind not in {"limits", "requests"} or not name:
        raise ContainerConfigError(f"unsupported resourceFieldRef resource {resource!r}")
    value = ((container.get("resources") or {}).get(kind) or {}).get(name)
    return str(value) if value is not None else "0"


def _key_ref(ref: Mapping[str, Any], kind: str, lookup: SecretLookup, var: str) -> str | None:
    data = lookup(kind, ref["name"])
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind} "{ref["name"]}" not found (env {var})')
    if ref["key"] not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {ref['key']} in {kind} {ref['name']}")
    return data[ref["key"]]


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookup: SecretLookup,
    base: Mapping[str, str],
) -> dict[str, str]:
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in source:
                continue
            data = lookup(kind, source[key]["name"])
            if data is None:
                if source[key].get("optional"):
                    continue
                raise ContainerConfigError(f'{kind} "{source[key]["name"]}" not found (envFrom)')
            env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom") or {}
        value: str | None
        if "fieldRef" in source:
            value = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = resource_ref(container, source["resourceFieldRef"]["resource"])
        elif "secretKeyRef" in source:
            value = _key_ref(source["secretKeyRef"], "Secret", lookup, name)
        elif "configMapKeyRef" in source:
            value = _key_ref(source["configMapKeyRef"], "ConfigMap", lookup, name)
        else:
            value = ""
        if value is not None:
            env[name] = value
    return env


def _port(value: Any, ports: Mapping[str, int]) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, str) and value in ports:
        return ports[value]
    raise ContainerConfigError(f"probe port {value!r} is neither a number nor a named port")


def probe(spec: Mapping[str, Any] | None, ports: Mapping[str, int]) -> Probe | None:
    if not spec:
        return None
    if "httpGet" in spec:
        http = spec["httpGet"]
        base = Probe("http", port=_port(http["port"], ports), path=http.get("path", "/"))
    elif "tcpSocket" in spec:
        base = Probe("tcp", port=_port(spec["tcpSocket"]["port"], ports))
    elif "exec" in spec:
        base = Probe("exec", command=tuple(spec["exec"].get("command") or ()))
    else:
        raise ContainerConfigError("probe has none of httpGet, tcpSocket, exec")
    return replace(
        base,
        initial_delay=float(spec.get("initialDelaySeconds", 0)),
        period=float(spec.get("periodSeconds", 10)),
        timeout=float(spec.get("timeoutSeconds", 1)),
        failure_threshold=int(spec.get("failureThreshold", 3)),
        success_threshold=int(spec.get("successThreshold", 1)),
    )


def npu_request(pod: Mapping[str, Any]) -> int:
    """NPUs the pod asks for: the sum over containers (limits win, as for extended resources)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get(NPU_RESOURCE) or (
            resources.get("requests") or {}
        ).get(NPU_RESOURCE)
        if value is not None:
            total += int(str(value))
    return total


SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _service_account_volumes(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod's volumes a container mounts at the service-account path."""
    spec = pod.get("spec") or {}
    mounted = {
        m.get("name")
        for c in spec.get("containers") or []
        for m in c.get("volumeMounts") or []
        if m.get("mountPath") == SERVICE_ACCOUNT_MOUNT
    }
    return [v for v in spec.get("volumes") or [] if v.get("name") in mounted]


def service_account_secret(pod: Mapping[str, Any]) -> str | None:
    """The token Secret mounted at the service-account path (put there by the ServiceAccount
    admission plugin), or None when the pod has no service-account token."""
    for volume in _service_account_volumes(pod):
        if "secret" in volume:
            name = volume["secret"].get("secretName")
            return str(name) if name else None
    return None


@dataclass(frozen=True)
class ProjectedToken:
    """The service-account token a current API server's ServiceAccount admission puts in a pod
    (Kubernetes >= 1.22: a ``projected`` volume ``kube-api-access-*`` of a
    ``serviceAccountToken``, the ``kube-root-ca.crt`` ConfigMap's ``ca.crt`` and the namespace
    from the downward API), which a kubelet fills by a TokenRequest bound to the pod."""

    volume: str
    service_account: str
    expiration_seconds: int = 3607  # the admission plugin's default
    audience: str | None = None  # None: the API server's own audiences
    ca_config_map: str | None = None  # the ConfigMap whose ca.crt the volume holds


def service_account_projection(pod: Mapping[str, Any]) -> ProjectedToken | None:
    """The projected service-account token mounted at the service-account path, or None (no
    token, or a token Secret: :func:`service_account_secret`)."""
    spec = pod.get("spec") or {}
    for volume in _service_account_volumes(pod):
        if "projected" not in volume:
            continue
        sources = (volume["projected"] or {}).get("sources") or []
        token = next(
            (s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s), None
        )
        if token is None:
            continue
        ca = next((s["configMap"] for s in sources if "configMap" in s), None)
        return ProjectedToken(
            volume=str(volume["name"]),
            service_account=str(spec.get("serviceAccountName") or "default"),
            expiration_seconds=int(token.get("expirationSeconds") or 3607),
            audience=token.get("audience") or None,
            ca_config_map=str(ca.get("name")) if ca and ca.get("name") else None,
        )
    return None


@dataclass(frozen=True)
class SecretVolume:
    """A ``secret`` volume a container mounts: which Secret, which keys as which files."""

    name: str
    secret: str
    items: tuple[tuple[str, str, int | None], ...] = ()  # (key, path, mode); none: every key
    default_mode: int = 0o644  # the API server's default
    optional: bool = False


def secret_volumes(pod: Mapping[str, Any]) -> list[SecretVolume]:
    """The pod's Secret volumes that a container mounts, but the service-account token's
    (:func:`service_account_secret`: written as a kubeconfig instead)."""
    spec = pod.get("spec") or {}
    mounts = [m for c in spec.get("containers") or [] for m in c.get("volumeMounts") or []]
    token = {m.get("name") for m in mounts if m.get("mountPath") == SERVICE_ACCOUNT_MOUNT}
    mounted = {m.get("name") for m in mounts} - token
    found = []
    for volume in spec.get("volumes") or []:
        source = volume.get("secret")
        if source is None or volume.get("name") not in mounted:
            continue
        items = tuple(
            (str(i["key"]), str(i["path"]), i.get("mode")) for i in source.get("items") or []
        )
        found.append(
            SecretVolume(
                name=str(volume["name"]),
                secret=str(source.get("secretName", "")),
                items=items,
                default_mode=int(source.get("defaultMode", 0o644)),
                optional=bool(source.get("optional")),
            )
        )
    return found


def secret_files(
    namespace: str, volume: SecretVolume, data: Mapping[str, bytes] | None
) -> dict[str, tuple[bytes, int]]:
    """The volume's files as the kubelet projects the Secret's ``data`` (None: no such Secret):
    relative path -> (content, mode); :class:`MountError` in the kubelet's words where it
    cannot (the pod waits and the mount is tried again)."""
    failed = f'MountVolume.SetUp failed for volume "{volume.name}" : '
    if data is None:
        if volume.optional:
            return {}
        raise MountError(f'{failed}secret "{volume.secret}" not found')
    if not volume.items:
        return {key: (value, volume.default_mode) for key, value in data.items()}
    files = {}
    for key, path, mode in volume.items:
        if key not in data:
            if volume.optional:
                continue
            raise MountError(
                f"{failed}couldn't find key {key} in Secret {namespace}/{volume.secret}"
            )
        if path.startswith("/") or ".." in path.split("/"):
            raise MountError(f"{failed}invalid path {path!r} for key {key}")
        files[path] = (data[key], volume.default_mode if mode is None else int(mode))
    return files


def translate(text: str, mounts: Mapping[str, str]) -> str:
    """``text`` with each mount path (container path -> host folder) that starts it or follows
    ``=`` (``--flag=/path``, ``VAR=/path``) and ends at ``/`` or the end, moved to its folder."""
    for container_path in sorted(mounts, key=len, reverse=True):  # the deepest mount first
        where = container_path.rstrip("/") or "/"
        pattern = re.compile(rf"(^|=){re.escape(where)}(?=/|$)")
        host = mounts[container_path].replace("\\", "\\\\")  # literal in the replacement
        text = pattern.sub(rf"\g<1>{host}", text)
    return text


def container_mounts(
    container: Mapping[str, Any], volume_dirs: Mapping[str, str]
) -> dict[str, str]:
    """The container's mount paths of the volumes written to host folders (volume name ->
    folder), each to its folder (``subPath`` within it)."""
    mounts = {}
    for mount in container.get("volumeMounts") or []:
        folder = volume_dirs.get(mount.get("name", ""))
        if folder is None:
            continue
        sub = str(mount.get("subPath") or "")
        mounts[str(mount["mountPath"])] = f"{folder}/{sub}" if sub else folder
    return mounts


def token_kubeconfig(
    server: str,
    ca_file: str | None,
    token: str,
    *,
    cluster_name: str = "cluster",
    user: str = "pod",
    context: str = "pod",
) -> str:
    """A kubeconfig that authenticates with a bearer token (JSON is valid YAML)."""
    cluster: dict[str, Any] = {"server": server}
    if ca_file:
        cluster["certificate-authority"] = ca_file
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster_name, "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": context, "context": {"cluster": cluster_name, "user": user}}],
            "current-context": context,
        },
        indent=2,
    )


def plan_containers(
    pod: Mapping[str, Any],
    image_map: Mapping[str, list[str]],
    lookup: SecretLookup,
    base_env: Mapping[str, str],
    volume_dirs: Mapping[str, str] | None = None,
) -> list[ContainerPlan]:
    """Plans for every container of the pod; raises UnknownImageError/ContainerConfigError.
    ``volume_dirs``: the host folder of each volume the emulator wrote (its Secret volumes)."""
    plans = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        entrypoint = resolve_entrypoint(container.get("image", ""), image_map)
        mounts = container_mounts(container, volume_dirs or {})
        # The pod's own values (not what the node adds: PATH, the device plugin's, ...).
        own = {e["name"] for e in container.get("env") or []}
        env = {
            name: translate(value, mounts) if name in own or name not in base_env else value
            for name, value in container_env(pod, container, lookup, base_env).items()
        }
        command = [translate(expand(c, env), mounts) for c in container.get("command") or []]
        args = [translate(expand(a, env), mounts) for a in container.get("args") or []]
        argv = (command or entrypoint) + args
        if not argv:
            raise ContainerConfigError(
                f'container "{container["name"]}" has no command and its image maps to none'
            )
        ports = {
            p["name"]: int(p["containerPort"])
            for p in container.get("ports") or []
            if p.get("name")
        }
        plans.append(
            ContainerPlan(
                name=container["name"],
                image=container.get("image", ""),
                argv=tuple(argv),
                env=env,
                working_dir=(
                    translate(container["workingDir"], mounts)
                    if container.get("workingDir")
                    else None
                ),
                readiness=probe(container.get("readinessProbe"), ports),
                liveness=probe(container.get("livenessProbe"), ports),
                ports=ports,
            )
        )
    return plans
