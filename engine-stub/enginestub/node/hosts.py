"""Pods' cluster DNS names without DNS: hosts files the node emulator keeps.

In a real cluster a pod with ``spec.hostname`` and ``spec.subdomain`` (what a StatefulSet gives
each of its pods: its name and the governing headless Service) is
``<hostname>.<subdomain>.<namespace>.svc.<cluster domain>``: the cluster DNS answers it from the
headless Service's endpoints, which hold the pods the Service selects that are Ready, or all of
them when the Service publishes not-ready addresses. The pods' resolver searches
``<namespace>.svc.<domain>``, ``svc.<domain>`` and ``<domain>``, so ``<hostname>.<subdomain>``
works from the pod's own namespace and ``<hostname>.<subdomain>.<namespace>[.svc]`` from any.

Pods here have no cluster DNS. The emulator writes what it would answer, as seen from each
namespace, into one hosts file per namespace (:func:`hosts_file`; ``$MATRIXSERVE_HOSTS_FILE`` in
the pod's environment names its namespace's) and rewrites it as pods come and go, turn Ready or
not, and as Services change. A JVM reads such a file on every lookup its address cache misses
(``-Djdk.net.hosts.file``, JDK 9+: the ``zookeeper`` image's shim, :mod:`.zookeeper`).

Pure: :func:`named_pod`, :func:`published`, :func:`render`; the files are written by
:class:`HostsFiles` (atomically: readers see the old or the new file, never half of one). The
shim imports this module for :data:`HOSTS_FILE_ENV` alone, so it imports the emulator's heavier
modules only where they are used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOSTS_FILE_ENV = "MATRIXSERVE_HOSTS_FILE"
CLUSTER_DOMAIN = "cluster.local"  # the kubelet's --cluster-domain default


@dataclass(frozen=True)
class NamedPod:
    """A pod the cluster DNS may name: its namespace, hostname, subdomain, IP, labels, Ready."""

    namespace: str
    hostname: str
    subdomain: str
    ip: str
    labels: tuple[tuple[str, str], ...]
    ready: bool


def named_pod(pod: Mapping[str, Any], ip: str | None, ready: bool) -> NamedPod | None:
    """The pod as the DNS may name it, or None: no hostname and subdomain, or no IP yet."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain or not ip:
        return None
    return NamedPod(
        str(meta.get("namespace", "")),
        str(hostname),
        str(subdomain),
        ip,
        tuple(sorted((meta.get("labels") or {}).items())),
        ready,
    )


def published(
    pods: Iterable[NamedPod], services: Mapping[tuple[str, str], Mapping[str, Any]] | None
) -> list[NamedPod]:
    """The pods the cluster DNS answers for: a headless Service named after the pod's subdomain
    exists in its namespace and selects it, and the pod is Ready or the Service publishes
    not-ready addresses. ``services`` None (the emulator does not list them: no Service proxy):
    every pod, as if each had such a Service publishing them all."""
    from enginestub.node.services import matches

    found = []
    for pod in pods:
        if services is not None:
            svc = services.get((pod.namespace, pod.subdomain))
            spec = (svc or {}).get("spec") or {}
            if (
                svc is None
                or spec.get("clusterIP") != "None"
                or not matches(spec.get("selector"), dict(pod.labels))
                or not (pod.ready or spec.get("publishNotReadyAddresses"))
            ):
                continue
        found.append(pod)
    return found


def render(pods: Iterable[NamedPod], namespace: str, domain: str = CLUSTER_DOMAIN) -> str:
    """The hosts file of ``namespace``: each pod's names a resolver there would find, the short
    ``<hostname>.<subdomain>`` only for the namespace's own pods (the search path)."""
    lines = [
        f"# Pods' cluster DNS names as seen from namespace {namespace} (the node emulator's)",
        "127.0.0.1 localhost",
    ]
    for pod in sorted(pods, key=lambda p: (p.namespace, p.subdomain, p.hostname, p.ip)):
        base = f"{pod.hostname}.{pod.subdomain}.{pod.namespace}"
        names = [f"{base}.svc.{domain}", f"{base}.svc", base]
        if pod.namespace == namespace:
            names.append(f"{pod.hostname}.{pod.subdomain}")
        lines.append(f"{pod.ip} {' '.join(names)}")
    return "\n".join(lines) + "\n"


def hosts_file(state_dir: Path, namespace: str) -> Path:
    """Where namespace ``namespace``'s hosts file lives in the emulator's state directory."""
    return state_dir / "hosts" / namespace


class HostsFiles:
    """One hosts file per namespace in the emulator's state directory, each rewritten only
    when it changes."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._written: dict[str, str] = {}

    def update(self, pods: Iterable[NamedPod], namespaces: Iterable[str]) -> None:
        """Write the hosts file of each of ``namespaces`` (those whose pods read one) that
        differs from what it holds; ``pods``: what the cluster DNS answers (:func:`published`)."""
        from enginestub.node.devicestatus import write_text_atomically

        answered = list(pods)
        for namespace in namespaces:
            text = render(answered, namespace)
            if self._written.get(namespace) != text:
                write_text_atomically(hosts_file(self.state_dir, namespace), text)
                self._written[namespace] = text
