"""What a pod's processes get from their node besides their own spec (SYSTEM.md §5): its
hostname and the cluster DNS's pod names as a hosts file (:mod:`.hosts`), the Ascend device
plugin's variables (granted NPUs, their dies' RoCE IPs and UB addresses, the node's device
status file: CloudMatrix-Infer §3, P/D-Serve §3.2 and §3.4) and what the server's local SSD holds
(``--ssd-models``), named as the engine reads them
(:class:`~matrixserve.api.engine_settings.EngineEnv`), the API server's address, the
service-account credentials a kubelet would mount, its Secret volumes' files, and the Secrets
and ConfigMaps the pod's env refers to (fetched here so that :mod:`.podspec` stays pure).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client

from enginestub.node import podspec
from enginestub.node.hosts import HOSTS_FILE_ENV, hosts_file
from enginestub.node.state import EmulatorConfig, NodeState, PodRecord
from matrixserve.api.engine_settings import EngineEnv

# What a process inherits from the emulator's own environment (the rest is the pod's).
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV")
# The models the server's local SSD holds (the emulator's --ssd-models), comma-separated: a warm
# engine reports them as its WarmReport's ssdModels.
SSD_MODELS_ENV = EngineEnv.name("ssd_models")


class PodEnvironment:
    """Builds the node-given part of a pod's environment; reads Secrets and ConfigMaps."""

    def __init__(self, config: EmulatorConfig, core: client.CoreV1Api) -> None:
        self.config = config
        self.core = core

    def base(self, state: NodeState, record: PodRecord) -> dict[str, str]:
        """The device plugin's variables and the API server's address (as in-cluster clients
        expect them)."""
        dies = state.server.dies_of(record.npus)
        env = {k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ}
        devices = EngineEnv(
            npus=",".join(map(str, record.npus)),
            dies=",".join(str(d.index) for d in dies),
            roce_ips=",".join(d.roce_ip for d in dies),
            ub_addresses=",".join(d.ub_address for d in dies),
            device_status_file=str(state.device_file),
            node_name=state.server.node_name,
            superpod=state.server.superpod,
            node_pod_ip=record.ip or "",
            ssd_models=",".join(self.config.ssd_models) if self.config.ssd_models else None,
        )
        env.update(
            {
                "ASCEND_VISIBLE_DEVICES": ",".join(map(str, record.npus)),
                **devices.to_dict(),
                # What the container runtime sets: the pod's hostname (a StatefulSet's pods are
                # named <set>-<ordinal>), and the cluster DNS's names as a hosts file (.hosts).
                "HOSTNAME": podspec.pod_hostname(record.pod),
                HOSTS_FILE_ENV: str(hosts_file(self.config.state_dir, record.namespace)),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.config.apiserver_host and self.config.apiserver_port:
            env["KUBERNETES_SERVICE_HOST"] = self.config.apiserver_host
            env["KUBERNETES_SERVICE_PORT"] = str(self.config.apiserver_port)
        return env

    async def service_account(
        self, namespace: str, pod: dict[str, Any], workdir: Path
    ) -> dict[str, str]:
        """The pod's service-account credentials, as a kubelet would mount them: the projected
        token the ServiceAccount admission plugin put in the pod's volumes (a TokenRequest bound
        to the pod, the cluster's CA from the ConfigMap it names), or on an older API server its
        token Secret. A process here cannot see /var/run/secrets, so the emulator writes a
        kubeconfig for that token into the pod's directory and points ``KUBECONFIG`` at it
        (clients then run as the ServiceAccount, under its RBAC, exactly as in a pod)."""
        secret_name = podspec.service_account_secret(pod)
        projected = podspec.service_account_projection(pod)
        if not (self.config.apiserver_host and self.config.apiserver_port):
            return {}
        if projected is not None:
            data = await self._projected_token(namespace, pod, projected)
        elif secret_name is None:
            # No token (automountServiceAccountToken: false): no credentials at all, rather than
            # a client falling back to the developer's ~/.kube/config through $HOME.
            return {"KUBECONFIG": str(workdir / "no-service-account-token")}
        else:
            try:
                data = await self._read_secret(namespace, secret_name)
            except client.ApiException as exc:
                raise podspec.ContainerConfigError(
                    f'service-account token Secret "{secret_name}": {exc.status} {exc.reason}'
                ) from exc
            if not data.get("token"):
                raise podspec.ContainerConfigError(f'Secret "{secret_name}" holds no token')
        folder = workdir / "serviceaccount"
        folder.mkdir(parents=True, exist_ok=True)
        for key in ("token", "ca.crt", "namespace"):
            if key in data:
                path = folder / key
                path.touch(mode=0o600)
                path.write_bytes(data[key])
        ca = str(folder / "ca.crt") if "ca.crt" in data else self.config.apiserver_ca
        kubeconfig = folder / "kubeconfig"
        kubeconfig.touch(mode=0o600)
        kubeconfig.write_text(
            podspec.token_kubeconfig(
                f"https://{self.config.apiserver_host}:{self.config.apiserver_port}",
                ca,
                data["token"].decode(),
            )
        )
        return {"KUBECONFIG": str(kubeconfig)}

    async def secret_volumes(
        self, namespace: str, pod: dict[str, Any], workdir: Path
    ) -> dict[str, str]:
        """The pod's Secret volumes as a kubelet sets them up: each Secret read at pod start,
        its keys written as files with their modes into ``<pod dir>/volumes/<volume>/`` (the
        container's mount path is moved there: :func:`.podspec.translate`); volume name ->
        folder. :class:`.podspec.MountError` while a Secret (or a key) is missing or cannot be
        read: the pod waits and the caller tries again."""
        folders = {}
        for volume in podspec.secret_volumes(pod):
            try:
                data: dict[str, bytes] | None = await self._read_secret(namespace, volume.secret)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise podspec.MountError(
                        f'MountVolume.SetUp failed for volume "{volume.name}" : '
                        f"{exc.status} {exc.reason}"
                    ) from exc
                data = None
            folder = workdir / "volumes" / volume.name
            write_files(folder, podspec.secret_files(namespace, volume, data))
            folders[volume.name] = str(folder)
        return folders

    async def _projected_token(
        self, namespace: str, pod: dict[str, Any], projected: podspec.ProjectedToken
    ) -> dict[str, bytes]:
        """The projected volume's files: a token requested for the pod's ServiceAccount and bound
        to the pod (deleting the pod invalidates it), ``ca.crt`` and ``namespace``."""
        meta = pod.get("metadata") or {}
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[projected.audience] if projected.audience else [],
                expiration_seconds=projected.expiration_seconds,
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=meta.get("name"), uid=meta.get("uid")
                ),
            )
        )
        try:
            answer = await asyncio.to_thread(
                self.core.create_namespaced_service_account_token,
                projected.service_account,
                namespace,
                request,
            )
        except client.ApiException as exc:
            raise podspec.ContainerConfigError(
                f'a token for ServiceAccount "{projected.service_account}": '
                f"{exc.status} {exc.reason}"
            ) from exc
        data = {"token": str(answer.status.token).encode(), "namespace": namespace.encode()}
        if projected.ca_config_map:
            try:
                cm = await asyncio.to_thread(
                    self.core.read_namespaced_config_map, projected.ca_config_map, namespace
                )
            except client.ApiException as exc:
                raise podspec.ContainerConfigError(
                    f'ConfigMap "{projected.ca_config_map}": {exc.status} {exc.reason}'
                ) from exc
            ca = (cm.data or {}).get("ca.crt")
            if ca:
                data["ca.crt"] = ca.encode()
        return data

    async def _read_secret(self, namespace: str, name: str) -> dict[str, bytes]:
        secret = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    async def lookup(self, namespace: str, pod: dict[str, Any]) -> podspec.SecretLookup:
        """Prefetch the ConfigMaps and Secrets the pod's env refers to (the lookup stays pure)."""
        wanted: set[tuple[str, str]] = set()
        for container in pod["spec"].get("containers") or []:
            for item in container.get("env") or []:
                source = item.get("valueFrom") or {}
                if "secretKeyRef" in source:
                    wanted.add(("Secret", source["secretKeyRef"]["name"]))
                if "configMapKeyRef" in source:
                    wanted.add(("ConfigMap", source["configMapKeyRef"]["name"]))
            for item in container.get("envFrom") or []:
                if "secretRef" in item:
                    wanted.add(("Secret", item["secretRef"]["name"]))
                if "configMapRef" in item:
                    wanted.add(("ConfigMap", item["configMapRef"]["name"]))
        found: dict[tuple[str, str], dict[str, str]] = {}
        for kind, name in wanted:
            try:
                if kind == "Secret":
                    raw = await self._read_secret(namespace, name)
                    found[(kind, name)] = {k: v.decode("utf-8", "replace") for k, v in raw.items()}
                else:
                    cm = await asyncio.to_thread(
                        self.core.read_namespaced_config_map, name, namespace
                    )
                    found[(kind, name)] = dict(cm.data or {})
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        return lambda kind, name: found.get((kind, name))


def write_files(folder: Path, files: Mapping[str, tuple[bytes, int]]) -> None:
    """``folder`` holding exactly ``files`` (relative path -> content, mode), written afresh
    (a retried mount or a restarted emulator; files of mode 0440 cannot be opened for writing
    again), the folder readable by the pod's user only."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for relative, (content, mode) in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        os.chmod(path, mode)  # exactly the mode asked (not narrowed by the umask)


def remove_volumes(workdir: Path) -> None:
    """A pod's volumes go with it (the kubelet unmounts them): no Secret, and no
    service-account token, is left on disk. Its logs stay."""
    shutil.rmtree(workdir / "volumes", ignore_errors=True)
    shutil.rmtree(workdir / "serviceaccount", ignore_errors=True)
