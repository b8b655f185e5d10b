"""Small helpers shared by the tests and the benchmarks (see :mod:`testkit`)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from matrixserve.api.kinds import LABEL_EMULATED, LABEL_GROUP, PDGROUP
from matrixserve.devcluster.errors import tail

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "crds"


def crd_files() -> list[Path]:
    return sorted(CRDS.glob("matrixserve.io_*.yaml"))


def load(path: Path) -> dict[str, Any]:
    """A YAML document (a CRD or a sample)."""
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def wait_for(
    predicate: Callable[..., Any],  # a lambda may bind loop variables as defaults
    timeout: float = 60,
    what: str = "condition",
    every: float = 0.1,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail the test after ``timeout`` s
    (with ``explain()``'s account of the state then, if given)."""
    try:
        return poll(predicate, timeout, what, every)
    except TimeoutError as exc:
        detail = f"\n{explain()}" if explain is not None else ""
        pytest.fail(f"{exc}{detail}")


def poll(predicate: Callable[..., Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """Poll until ``predicate()`` is truthy and return it; TimeoutError naming ``what`` after
    ``timeout`` s (for code that runs without pytest too: the benchmarks)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def explain_namespace(state_dir: str, api_client: Any, namespace: str) -> str:
    """What a namespace's PDGroups and pods look like, and the tails of its containers' logs
    (the node emulator keeps them under the cluster's state directory): for failure messages."""
    from kubernetes import client

    lines = []
    try:
        groups = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
            PDGROUP.group, PDGROUP.version, namespace, PDGROUP.plural
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


# --------------------------------------------------------------------------- cluster tests
# The kubernetes client is imported inside these (as above): the engine tests import this module
# and use no cluster.

SAMPLE_2P1D = CRDS / "samples" / "pdgroup-2p1d.yaml"


def pdgroup_body(name: str, prefill: int = 2, decode: int = 1) -> dict[str, Any]:
    """The 2P1D sample as PDGroup ``name`` with these replicas (the sample's by default)."""
    body = load(SAMPLE_2P1D)
    body["metadata"] = {"name": name}
    body["spec"]["prefill"]["replicas"] = prefill
    body["spec"]["decode"]["replicas"] = decode
    return body


class Groups:
    """The PDGroups of one namespace through the API server, with their pods; ``where`` is the
    (group, version, namespace, plural) every namespaced custom-object call starts with."""

    def __init__(
        self, api_client: Any, namespace: str, explain: Callable[[], str] | None = None
    ) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.where = (PDGROUP.group, PDGROUP.version, namespace, PDGROUP.plural)
        self.explain = explain  # the namespace's state, for a timed-out wait's message

    def create(self, body: dict[str, Any], **options: Any) -> dict[str, Any]:
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            *self.where, body, **options
        )
        return created

    def get(self, name: str) -> dict[str, Any]:
        group: dict[str, Any] = self.custom.get_namespaced_custom_object(*self.where, name)
        return group

    def patch(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        patched: dict[str, Any] = self.custom.patch_namespaced_custom_object(
            *self.where, name, {"spec": spec}
        )
        return patched

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(*self.where, name)

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for cond in (self.get(name).get("status") or {}).get("conditions", []):
            if cond["type"] == kind:
                return dict(cond)
        return {}

    def ready(self, name: str) -> bool:
        return self.condition(name, "Ready").get("status") == "True"

    def wait_ready(self, name: str, what: str = "the group Ready") -> None:
        wait_for(lambda: self.ready(name), what=what, explain=self.explain)

    def pods(self, name: str) -> dict[str, Any]:
        """Group ``name``'s pods by name, those being deleted left out."""
        items = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_GROUP}={name}"
        ).items
        return {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}


def events_of(core: Any, namespace: str, name: str) -> list[Any]:
    """The Events about the object called ``name`` in ``namespace``."""
    return list(
        core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    )


def service_account_token(core: Any, namespace: str, account: str, timeout: float = 30) -> str:
    """A token for the ServiceAccount from the TokenRequest API (an hour; the controller-manager
    makes no token Secrets since Kubernetes 1.24), once the account exists."""
    from kubernetes import client

    def token() -> str | None:
        try:
            answer = core.create_namespaced_service_account_token(
                account,
                namespace,
                client.AuthenticationV1TokenRequest(
                    spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
                ),
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return None  # the account is not there yet
            raise
        return str(answer.status.token)

    value: str = wait_for(token, timeout=timeout, what=f"the token of ServiceAccount {account}")
    return value


def install_crds(
    api_client: Any, bodies: Iterable[dict[str, Any]], timeout: float = 60
) -> list[str]:
    """Create these CRDs (one already there is kept) and wait until the API server serves every
    one (``Established``); their names."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api_client)
    names = []
    for body in bodies:
        names.append(body["metadata"]["name"])
        try:
            ext.create_custom_resource_definition(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise

    def established(name: str) -> bool:
        conditions = ext.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_for(lambda: all(established(n) for n in names), timeout, what=f"{names} Established")
    return names


def serves(gateway: str, tokens: int = 3) -> None:
    """One completion through the gateway at ``gateway`` (its URL) answers with ``tokens``
    tokens."""
    answer = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": "general", "prompt": "hi", "max_tokens": tokens},
        timeout=30,
        trust_env=False,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == tokens


def zookeeper_auth(auth: str | None = None) -> list[tuple[str, str]] | None:
    """kazoo's ``auth_data`` for ``auth`` (``user:password``; by default MatrixServe's ZooKeeper
    identity, $MATRIXSERVE_ZK_AUTH, which the cluster fixture sets for the session); None
    without one (``auth=""``: none)."""
    auth = os.environ.get("MATRIXSERVE_ZK_AUTH") if auth is None else auth
    return [("digest", auth)] if auth else None


@contextlib.contextmanager
def zookeeper(hosts: str, auth: str | None = None) -> Iterator[Any]:
    """A started kazoo client for ``hosts`` (``host:port[/chroot]``), stopped and closed after;
    authenticated as :func:`zookeeper_auth` says (its znodes get kazoo's open ACL)."""
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=hosts, timeout=10, auth_data=zookeeper_auth(auth))
    zk.start(timeout=15)
    try:
        yield zk
    finally:
        zk.stop()
        zk.close()


@contextlib.contextmanager
def only_these_nodes(core: Any, keep: Iterable[str]) -> Iterator[None]:
    """The session's other emulated nodes cordoned meanwhile (they take no pod of the test's),
    and put back as they were after (a ``CoreV1Api`` as ``core``)."""
    from kubernetes import client

    keep = set(keep)
    others = {
        n.metadata.name: bool(n.spec.unschedulable)
        for n in core.list_node(label_selector=f"{LABEL_EMULATED}=true").items
        if n.metadata.name not in keep
    }
    for name in others:
        core.patch_node(name, {"spec": {"unschedulable": True}})
    try:
        yield
    finally:
        for name, was in others.items():
            with contextlib.suppress(client.ApiException):
                core.patch_node(name, {"spec": {"unschedulable": was}})
