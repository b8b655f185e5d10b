"""Services for an emulated cluster: kube-proxy's userspace mode, on loopback.

The dev cluster gives the API server a service range inside 127.128.0.0/10, so every ClusterIP
is a loopback address. For each Service port the emulator listens on ``clusterIP:port`` and
pipes each connection to one ready pod matching the Service's selector (round-robin), at the
target port (a number or a container port's name). A backend that refuses the connection (its
process just died: the pod is not yet marked not Ready) or does not answer in time is passed
over for the next ready one, as kube-proxy's userspace mode did (``TryConnectEndpoints``), so a
client of a Service whose one replica went away reaches another at once. The ``kubernetes`` Service
goes to the API server. So the API server reaches a webhook Service, and pods reach ZooKeeper or the
gateway by their Service, with no kube-proxy, no iptables and no DNS: pods learn the addresses from
the ``<NAME>_SERVICE_HOST`` / ``_PORT`` variables (:func:`service_env`), as a kubelet injects them.

Pure helpers here (:func:`service_env`, :func:`matches`, :func:`target_port`) plus the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from enginestub.node.listwatch import watch_events

log = logging.getLogger("enginestub.node.services")

# s a connection to one backend may take before the next is tried, by try (kube-proxy's
# userspace mode: EndpointDialTimeouts); past the last, the last again
CONNECT_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Backend:
    """A ready pod a Service may send to: its IP and its named container ports."""

    ip: str
    ports: Mapping[str, int]


def _env_name(service: str) -> str:
    return service.upper().replace("-", "_").replace(".", "_")


def service_env(services: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """The Docker-links style variables a kubelet gives a pod for its namespace's Services."""
    env: dict[str, str] = {}
    for svc in services:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        ports = spec.get("ports") or []
        if not ip or ip == "None" or not ports:
            continue
        prefix = _env_name(svc["metadata"]["name"])
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{_env_name(port['name'])}"] = str(port["port"])
    return env


def matches(selector: Mapping[str, str] | None, labels: Mapping[str, str] | None) -> bool:
    return bool(selector) and all((labels or {}).get(k) == v for k, v in (selector or {}).items())


def target_port(port: Mapping[str, Any], backend: Backend) -> int | None:
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    return backend.ports.get(str(target))


@dataclass
class _Listener:
    namespace: str
    name: str
    port: dict[str, Any]
    server: asyncio.Server | None = None


class ServiceProxy:
    """Listens on every Service's ClusterIP:port and forwards to ready pods (or the API server)."""

    def __init__(
        self,
        api: client.ApiClient,
        backends: Callable[[str, Mapping[str, str]], list[Backend]],
        apiserver: tuple[str, int],
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.backends = backends
        self.apiserver = apiserver
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.listeners: dict[tuple[str, int], _Listener] = {}
        self._turn = itertools.count()
        self._stop = threading.Event()
        # Set once the first listing is applied: a kubelet gives a pod its Service variables
        # only after its informer synced, and so does the emulator (see Emulator._admit).
        self.synced = asyncio.Event()

    async def run(self) -> None:
        try:
            async for kind, svc in watch_events(
                self.core.list_service_for_all_namespaces,
                stopped=self._stop.is_set,
                key=lambda svc: (svc["metadata"]["namespace"], svc["metadata"]["name"]),
                known=lambda: list(self.services.items()),
                what="service",
            ):
                if kind == "SYNCED":
                    self.synced.set()
                else:
                    await self._on_service(kind, svc)
        finally:
            self._stop.set()
            for listener in self.listeners.values():
                if listener.server is not None:
                    listener.server.close()

    def namespace_env(self, namespace: str) -> dict[str, str]:
        return service_env(s for (ns, _), s in list(self.services.items()) if ns == namespace)

    async def _on_service(self, kind: str, svc: dict[str, Any]) -> None:
        key = (svc["metadata"]["namespace"], svc["metadata"]["name"])
        if kind == "DELETED":
            self.services.pop(key, None)
        else:
            self.services[key] = svc
        wanted: dict[tuple[str, int], dict[str, Any]] = {}
        for (namespace, name), s in self.services.items():
            ip = (s.get("spec") or {}).get("clusterIP")
            if not ip or ip == "None" or not ip.startswith("127."):
                continue  # headless, or a range this machine cannot listen on
            for port in s["spec"].get("ports") or []:
                if port.get("protocol", "TCP") == "TCP":
                    wanted[(ip, int(port["port"]))] = {
                        "namespace": namespace,
                        "name": name,
                        "port": port,
                    }
        for address in [a for a in self.listeners if a not in wanted]:
            server = self.listeners.pop(address).server
            if server is not None:
                server.close()
        for address, what in wanted.items():
            current = self.listeners.get(address)
            if current is not None:
                current.namespace, current.name, current.port = (
                    what["namespace"],
                    what["name"],
                    what["port"],
                )
                continue
            listener = _Listener(what["namespace"], what["name"], what["port"])

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                listener: _Listener = listener,
            ) -> None:
                await self._forward(listener, reader, writer)

            try:
                listener.server = await asyncio.start_server(handle, *address)
            except OSError as exc:
                log.warning(
                    "Service %s/%s: cannot listen on %s:%d (%s)",
                    what["namespace"],
                    what["name"],
                    *address,
                    exc,
                )
                continue
            self.listeners[address] = listener

    def _pick(self, listener: _Listener) -> list[tuple[str, int]]:
        """The Service's ready backends in the order to try them: from the next in round-robin
        on, each once."""
        svc = self.services.get((listener.namespace, listener.name))
        if svc is None:
            return []
        selector = (svc.get("spec") or {}).get("selector")
        if not selector:
            if (listener.namespace, listener.name) == ("default", "kubernetes"):
                return [self.apiserver]
            return []
        candidates = []
        for backend in self.backends(listener.namespace, selector):
            port = target_port(listener.port, backend)
            if port is not None:
                candidates.append((backend.ip, port))
        if not candidates:
            return []
        first = next(self._turn) % len(candidates)
        return candidates[first:] + candidates[:first]

    async def _forward(
        self, listener: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        upstream = None
        for attempt, target in enumerate(self._pick(listener)):
            timeout = CONNECT_TIMEOUTS[min(attempt, len(CONNECT_TIMEOUTS) - 1)]
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(*target), timeout)
                break
            except (OSError, TimeoutError) as exc:
                log.debug(
                    "Service %s/%s: backend %s:%d failed (%s), trying the next",
                    listener.namespace,
                    listener.name,
                    *target,
                    str(exc) or "timed out",
                )
        if upstream is None:
            writer.close()  # no ready endpoint answered: refused, as kube-proxy would (REJECT)
            return
        up_reader, up_writer = upstream
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction; pass an EOF on as a half-close, an error as a close."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (ConnectionError, OSError):
        writer.close()
