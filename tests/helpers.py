"""Small helpers shared by the tests (``pythonpath`` in pyproject puts this folder on the path)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from matrixserve.devcluster.errors import tail


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 60,
    what: str = "condition",
    every: float = 0.1,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail the test after ``timeout`` s
    (with ``explain()``'s account of the state then, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{explain()}" if explain is not None else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(every)


def explain_namespace(state_dir: str, api_client: Any, namespace: str) -> str:
    """What a namespace's PDGroups and pods look like, and the tails of its containers' logs
    (the node emulator keeps them under the cluster's state directory): for failure messages."""
    from kubernetes import client

    lines = []
    try:
        groups = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
            "matrixserve.io", "v1alpha1", namespace, "pdgroups"
        )["items"]
        for g in groups:
            status = g.get("status") or {}
            lines.append(f"PDGroup {g['metadata']['name']}: phase {status.get('phase')}")
            for c in status.get("conditions") or []:
                lines.append(
                    f"  {c.get('type')}={c.get('status')} {c.get('reason')}: {c.get('message')}"
                )
        for pod in client.CoreV1Api(api_client).list_namespaced_pod(namespace).items:
            states = [
                f"{cs.name} ready={cs.ready} restarts={cs.restart_count} "
                f"state={cs.state.to_dict() if cs.state else None}"
                for cs in pod.status.container_statuses or []
            ]
            lines.append(f"pod {pod.metadata.name}: {pod.status.phase} {'; '.join(states)}")
    except Exception as exc:  # an explanation must never hide the failure it explains
        lines.append(f"(reading the namespace failed: {exc})")
    pods = Path(state_dir) / "emulator" / "pods"
    for log in sorted(pods.glob(f"{namespace}_*/*.log")):
        lines.append(f"--- {log.parent.name.split('_')[1]}/{log.name}")
        lines.extend(f"    {line}" for line in tail(log, 12).splitlines())
    return "\n".join(lines)


def absent(read: Callable[[], object]) -> bool:
    """Whether reading an API object answers 404 (it is gone); any other error is raised."""
    from kubernetes import client

    try:
        read()
    except client.ApiException as exc:
        return bool(exc.status == 404)
    return False


def metric(url: str, name: str) -> float:
    """A Prometheus sample's value from ``url``'s ``/metrics`` (the first with that name)."""
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


class TcpProxy:
    """A loopback TCP forwarder whose link can be cut and restored: ``cut()`` closes every
    connection and refuses new ones (as a dead server would), ``restore()`` accepts again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.open = True
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if not self.open:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            self.open = False
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.sockets.clear()

    def restore(self) -> None:
        with self.lock:
            self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


def assert_emulated(
    measured: float, expected: float, scale: float, *, late: float = 0.05, steps: int = 1
) -> None:
    """An emulated duration matches the model: never shorter (beyond 2 %), and longer only by what
    ``late`` wall seconds of event-loop lateness make at this time scale, spread over ``steps``
    (a mean over many steps). A loaded machine only ever makes emulated durations longer."""
    low = expected * 0.98
    high = expected * 1.02 + late * scale / steps
    assert low <= measured <= high, (
        f"emulated {measured:.6f}s outside [{low:.6f}, {high:.6f}] "
        f"(model {expected:.6f}s, time scale {scale:g})"
    )
