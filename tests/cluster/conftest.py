"""Fixtures for the tests on the local cluster: one real control plane with ZooKeeper per session;
per test a fresh namespace, ZooKeeper clients, and the processes a test starts (node emulators,
operators, gateways) and its PDGroups.

Set ``MATRIXSERVE_TEST_STATE_DIR`` to the state dir of a running dev cluster (``make cluster-up``)
to reuse it instead of starting a private one for the session (faster iteration); a private one
is always stopped at the end of the session.

Only tests under this folder pay for what these fixtures import; the markers are applied by the
top-level ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kazoo.client import KazooClient
from kubernetes import client, config

from enginestub.node.command import node_names, run_argv
from matrixserve.api import kinds
from matrixserve.devcluster import pki, tools
from matrixserve.devcluster.cluster import ClusterInfo, DevCluster, free_ports
from matrixserve.devcluster.namespaces import wait_for_service_account
from matrixserve.devcluster.procs import Supervisor
from testkit.helpers import (
    Groups,
    crd_files,
    explain_namespace,
    install_crds,
    load,
    pdgroup_body,
    wait_for,
    zookeeper,
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    reuse = os.environ.get("MATRIXSERVE_TEST_STATE_DIR")
    if reuse:
        existing = DevCluster(Path(reuse))
        info = existing.info()
        if info is None or not existing.is_running():
            pytest.fail(f"MATRIXSERVE_TEST_STATE_DIR={reuse} has no running cluster")
        with _zookeeper_identity(info):
            yield info
        return
    dev = DevCluster(tmp_path_factory.mktemp("devcluster"))
    info = dev.up(timeout=180)
    try:
        with _zookeeper_identity(info):
            yield info
    finally:
        dev.down()


@contextlib.contextmanager
def _zookeeper_identity(info: ClusterInfo) -> Iterator[None]:
    """The dev cluster's ZooKeeper identity as $MATRIXSERVE_ZK_AUTH for the session: operators
    and gateways the tests start use it (their znodes get digest ACLs, engines read it from the
    Secret the operator writes), and so do the tests' own clients (``testkit.helpers.zookeeper``)."""
    with pytest.MonkeyPatch.context() as patch:
        if info.zookeeper_auth:
            patch.setenv("MATRIXSERVE_ZK_AUTH", info.zookeeper_auth)
        else:  # a cluster started before identities: none, whatever the shell says
            patch.delenv("MATRIXSERVE_ZK_AUTH", raising=False)
        yield


@pytest.fixture(scope="session")
def api_client(cluster: ClusterInfo) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=cluster.kubeconfig)
    yield api
    api.close()


def _dns_label(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")


@pytest.fixture
def namespace(request: pytest.FixtureRequest, api_client: client.ApiClient) -> Iterator[str]:
    """A fresh namespace, ready for pods (its default service account has its token)."""
    core = client.CoreV1Api(api_client)
    name = f"t-{_dns_label(request.node.name, 40)}-{secrets.token_hex(3)}"
    core.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(name=name, labels={"matrixserve.io/test": "true"})
        )
    )
    try:
        wait_for_service_account(core, name)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    yield name
    core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture
def zk(cluster: ClusterInfo) -> Iterator[KazooClient]:
    """A started kazoo client whose root is a fresh chroot, removed afterwards."""
    root = f"/tests/{secrets.token_hex(6)}"
    with zookeeper(cluster.zookeeper) as admin:
        admin.ensure_path(root)
        with zookeeper(f"{cluster.zookeeper}{root}") as chrooted:
            yield chrooted
        admin.delete(root, recursive=True)


@pytest.fixture(scope="session")
def cli_env(cluster: ClusterInfo) -> dict[str, str]:
    """Environment for kubectl/helm subprocesses aimed at the test cluster."""
    return {
        **os.environ,
        **cluster.env(),
        "HELM_CACHE_HOME": str(Path(cluster.state_dir) / "helm-cache"),
        "HELM_CONFIG_HOME": str(Path(cluster.state_dir) / "helm-config"),
        "HELM_DATA_HOME": str(Path(cluster.state_dir) / "helm-data"),
    }


@pytest.fixture(scope="session")
def run_tool(cli_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run kubectl or helm against the test cluster; a non-zero exit fails the test unless told."""
    paths = {"kubectl": str(tools.kubectl_path()), "helm": str(tools.helm_path())}

    def run(
        tool: str, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        if tool == "helm" and args[:1] in (("install",), ("upgrade",)) and tools.legacy():
            pytest.skip(
                "the chart needs Kubernetes >= 1.30 (Chart.yaml kubeVersion); this cluster runs "
                f"v{tools.LEGACY_KUBERNETES_VERSION} ({tools.KUBERNETES_CHOICE})"
            )
        result = subprocess.run(
            [paths[tool], *args],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(f"{tool} {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    return run


@dataclass
class EmulatorHandle:
    """A node emulator process started for one test, with its own SuperPod(s) and nodes."""

    state_dir: Path
    supervisor: Supervisor
    prefix: str
    nodes: list[str]
    control: str = ""  # its control API's URL, once it has written it

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.control, timeout=10, trust_env=False)

    def pods(self) -> list[dict[str, object]]:
        with self.http() as http:
            return list(http.get("/pods").json())

    def fault(self, heal: bool = False, **body: object) -> dict[str, object]:
        with self.http() as http:
            response = http.request("DELETE" if heal else "POST", "/faults", json=body)
            assert response.is_success, response.text
            return dict(response.json())


@pytest.fixture
def start_emulator(
    cluster: ClusterInfo, api_client: client.ApiClient, tmp_path: Path
) -> Iterator[Callable[..., EmulatorHandle]]:
    """Start a private node emulator: ``start_emulator(servers=1, superpods=1, extra=[...])``."""
    started: list[tuple[Supervisor, str]] = []

    def start(servers: int = 1, superpods: int = 1, extra: tuple[str, ...] = ()) -> EmulatorHandle:
        prefix = "e" + secrets.token_hex(3)
        state = tmp_path / f"emulator-{prefix}"
        sup = Supervisor(state)
        fast = ("--backoff-base", "0.5", "--backoff-max", "8", "--lease-interval", "2")
        sup.start(
            "node-emulator",
            run_argv(
                state / "data",
                superpods=superpods,
                servers=servers,
                prefix=prefix,
                extra=(*fast, *extra),
            ),
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
        )
        started.append((sup, prefix))
        names = node_names(superpods, servers, prefix)
        handle = EmulatorHandle(state / "data", sup, prefix, names)
        core = client.CoreV1Api(api_client)
        deadline = time.monotonic() + 30
        info_file = state / "data" / "emulator.json"
        while True:
            if sup.exited("node-emulator"):
                pytest.fail(
                    "node emulator exited:\n" + sup.log_path("node-emulator").read_text()[-3000:]
                )
            ready = 0
            if info_file.exists():
                handle.control = json.loads(info_file.read_text())["control"]
                for name in names:
                    try:
                        node = core.read_node(name)
                    except client.ApiException:
                        break
                    conditions = {c.type: c.status for c in node.status.conditions or []}
                    if conditions.get("Ready") == "True" and not node.spec.taints:
                        ready += 1
            if ready == len(names):
                return handle
            if time.monotonic() > deadline:
                pytest.fail(
                    "emulated nodes not Ready within 30s:\n"
                    + sup.log_path("node-emulator").read_text()[-3000:]
                )
            time.sleep(0.1)

    yield start
    for sup, _ in started:
        sup.stop("node-emulator", grace=15)


@pytest.fixture(scope="session")
def crds_installed(api_client: client.ApiClient) -> list[str]:
    """The MatrixServe CRDs on the test cluster (idempotent; left installed)."""
    names: list[str] = install_crds(api_client, [load(path) for path in crd_files()], timeout=30)
    return names


@dataclass
class OperatorHandle:
    """An operator process started for one test; ``start()`` again after ``stop()``/``kill()``."""

    supervisor: Supervisor
    name: str
    metrics_url: str
    args: list[str]
    env: dict[str, str]

    def log(self) -> str:
        return self.supervisor.log_path(self.name).read_text()

    def stop(self, grace: float = 10) -> None:
        self.supervisor.stop(self.name, grace=grace)

    def kill(self) -> None:
        self.stop(grace=0)

    def start(self) -> None:
        self.supervisor.start(self.name, self.args, env=self.env)


@pytest.fixture
def start_operator(
    cluster: ClusterInfo, api_client: client.ApiClient, crds_installed: list[str], tmp_path: Path
) -> Iterator[Callable[..., OperatorHandle]]:
    """Start the operator watching one namespace: ``start_operator(namespace, webhook=True, ...)``.

    Each test gets its own operator process (so tests never share one); the managed webhook
    configuration is removed afterwards."""
    sup = Supervisor(tmp_path / "operator")
    handles: list[OperatorHandle] = []

    def start(
        namespace: str, webhook: bool = True, time_scale: str = "20", extra: tuple[str, ...] = ()
    ) -> OperatorHandle:
        metrics, liveness, hook = free_ports(3)
        args = [
            sys.executable,
            "-m",
            "matrixserve",
            "--zookeeper",
            cluster.zookeeper,
            "--namespace",
            namespace,
            "--engine-time-scale",
            time_scale,
            "--engine-fault-injection",  # tests inject faults (--no-engine-fault-injection: off)
            "--metrics-port",
            str(metrics),
            "--liveness-port",
            str(liveness),
        ]
        if webhook:
            ca = pki.KeyPair(Path(cluster.ca_file), Path(cluster.ca_file).with_name("ca.key"))
            pair = pki.issue_certificate(
                ca, tmp_path / "webhook", "webhook", "matrixserve-webhook", ["IP:127.0.0.1"]
            )
            args += [
                "--webhook-port",
                str(hook),
                "--webhook-cert",
                str(pair.cert),
                "--webhook-key",
                str(pair.key),
                "--webhook-ca",
                cluster.ca_file,
            ]
        else:
            args.append("--no-webhook")
        args += list(extra)
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig}
        handle = OperatorHandle(
            sup, f"operator-{len(handles)}", f"http://127.0.0.1:{metrics}/metrics", args, env
        )
        handle.start()
        handles.append(handle)
        deadline = time.monotonic() + 30
        while True:
            if sup.exited(handle.name):
                pytest.fail("operator exited:\n" + handle.log()[-3000:])
            try:
                if (
                    httpx.get(
                        f"http://127.0.0.1:{liveness}/healthz", timeout=1, trust_env=False
                    ).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("operator not live within 30s:\n" + handle.log()[-3000:])
            time.sleep(0.1)
        if webhook:  # kopf registers the webhook configuration once its server listens
            wait_webhook_effective(namespace, deadline, handle)
        return handle

    def wait_webhook_effective(namespace: str, deadline: float, handle: OperatorHandle) -> None:
        """Until a dry-run create of an invalid group is refused by this operator's webhook.

        The configuration existing is not enough: the API server's admission informer picks it
        up (or a previous operator's port being replaced) a moment later."""
        groups = Groups(api_client, namespace)
        probe = pdgroup_body("webhook-probe")
        # a rule only the webhook judges (the CRD's own rules are refused with no webhook)
        probe["spec"]["model"]["name"] = "gpt3-175b"  # its weights do not fit 2 NPUs
        while True:
            try:
                groups.create(probe, dry_run="All")
            except client.ApiException as exc:
                if exc.status == 422 and "admission webhook" in str(exc.body):
                    return
            if time.monotonic() > deadline:
                pytest.fail("webhook not in effect within 30s:\n" + handle.log()[-3000:])
            time.sleep(0.1)

    yield start
    for handle in handles:
        handle.stop()
    admission = client.AdmissionregistrationV1Api(api_client)
    for delete in (
        admission.delete_validating_webhook_configuration,
        admission.delete_mutating_webhook_configuration,
    ):
        with contextlib.suppress(client.ApiException):
            delete(kinds.GROUP)  # the operator names the configuration it manages after the group


@pytest.fixture
def start_gateway(
    cluster: ClusterInfo, namespace: str, tmp_path: Path
) -> Iterator[Callable[..., str]]:
    """Start the gateway for the test's namespace: ``start_gateway(*extra_flags)`` -> its URL."""
    sup = Supervisor(tmp_path / "gateway")
    names: list[str] = []

    def start(*extra: str) -> str:
        (port,) = free_ports(1)
        name = f"gateway-{len(names)}"
        sup.start(
            name,
            [
                sys.executable,
                "-m",
                "matrixserve.gateway",
                "--zookeeper",
                cluster.zookeeper,
                "--namespace",
                namespace,
                "--port",
                str(port),
                "--time-scale",
                "20",
                # stopped at the test's end, behind no Service: no drain (a test may ask for one)
                "--drain-seconds",
                "0",
                *extra,
            ],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
        )
        names.append(name)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if sup.exited(name):
                pytest.fail(sup.log_path(name).read_text()[-2000:])
            try:
                return httpx.get(f"{url}/healthz", timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=30, what="the gateway")
        return url

    yield start
    for name in names:
        sup.stop(name, grace=5)


@pytest.fixture
def gateway(start_gateway: Callable[..., str]) -> str:
    return start_gateway()


@pytest.fixture
def groups(cluster: ClusterInfo, api_client: client.ApiClient, namespace: str) -> Groups:
    """The test namespace's PDGroups; a wait for one to be Ready explains the namespace if it
    times out."""
    return Groups(
        api_client,
        namespace,
        explain=lambda: explain_namespace(cluster.state_dir, api_client, namespace),
    )


@pytest.fixture
def serving_group(
    groups: Groups, start_operator: Callable[..., OperatorHandle]
) -> Callable[..., OperatorHandle]:
    """Start the operator for the test's namespace, create PDGroup ``g`` from the 2P1D sample and
    wait until it is Ready: ``serving_group(prefill=2, decode=1, **start_operator_options)`` ->
    the operator."""

    def create(prefill: int = 2, decode: int = 1, **options: object) -> OperatorHandle:
        operator = start_operator(groups.namespace, **options)
        groups.create(pdgroup_body("g", prefill, decode))
        groups.wait_ready("g")
        return operator

    return create


@dataclass
class ZooKeeperHandle:
    """A private standalone ZooKeeper for one test (its own port and data dir), the server the
    dev cluster runs: it can be stopped and started again on the same port with its data kept
    (``stop(); start()``) or lost (``stop(); wipe(); start()``)."""

    supervisor: Supervisor
    config: Path
    data: Path
    port: int
    name: str = "zookeeper"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        """Start the server and wait until it answers ``ruok``."""
        from enginestub.node import zookeeper as server

        self.data.mkdir(parents=True, exist_ok=True)
        self.supervisor.start(
            self.name,
            server.server_argv(str(tools.java_path()), self.config, self.supervisor.log_dir),
        )

        def answers() -> bool:
            if self.supervisor.exited(self.name):
                pytest.fail("ZooKeeper exited:\n" + self.log()[-3000:])
            return self.ruok()

        wait_for(answers, timeout=timeout, what=f"ZooKeeper on {self.address}", every=0.05)

    def ruok(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"ruok")
                return sock.recv(16) == b"imok"
        except OSError:
            return False

    def stop(self, grace: float = 10) -> None:
        self.supervisor.stop(self.name, grace=grace)

    def wipe(self) -> None:
        """Lose every znode, session and zxid (as a server rescheduled on an empty volume)."""
        import shutil

        shutil.rmtree(self.data, ignore_errors=True)

    def log(self) -> str:
        path = self.supervisor.log_path(self.name)
        return path.read_text() if path.exists() else ""


@pytest.fixture
def start_zookeeper(tmp_path: Path) -> Iterator[Callable[[], ZooKeeperHandle]]:
    """Start a private ZooKeeper: ``start_zookeeper()`` -> its handle (stopped afterwards)."""
    from enginestub.node import zookeeper as server

    handles: list[ZooKeeperHandle] = []

    def start() -> ZooKeeperHandle:
        state = tmp_path / f"zookeeper-{len(handles)}"
        state.mkdir(parents=True)
        (port,) = free_ports(1)
        handle = ZooKeeperHandle(Supervisor(state), state / "zoo.cfg", state / "data", port)
        server.write_config(
            handle.config,
            handle.data,
            port,
            "127.0.0.1",
            "ruok,srvr,stat,mntr",
            "minSessionTimeout=2000\n",  # as the dev cluster's: tests may expire sessions
        )
        handles.append(handle)
        handle.start()
        return handle

    yield start
    for handle in handles:
        handle.stop()
