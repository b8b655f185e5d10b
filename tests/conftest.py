"""Shared fixtures: one real local cluster per run; a fresh namespace and ZooKeeper chroot per test.

Markers are applied here, not by hand: tests under ``tests/unit`` are ``unit``; any test that
uses the ``cluster`` fixture (directly or through another fixture) is ``cluster``. So
``pytest -m unit`` is the fast, cluster-free subset.

Set ``MATRIXSERVE_TEST_STATE_DIR`` to the state dir of a running dev cluster (``make cluster-up``)
to reuse it instead of starting a private one for the session (faster iteration); a private one
is always stopped at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from matrixserve.devcluster.cluster import ClusterInfo, DevCluster

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unit_dir = REPO / "tests" / "unit"
    for item in items:
        if Path(str(item.fspath)).is_relative_to(unit_dir):
            item.add_marker(pytest.mark.unit)
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    reuse = os.environ.get("MATRIXSERVE_TEST_STATE_DIR")
    if reuse:
        existing = DevCluster(Path(reuse))
        info = existing.info()
        if info is None or not existing.is_running():
            pytest.fail(f"MATRIXSERVE_TEST_STATE_DIR={reuse} has no running cluster")
        yield info
        return
    dev = DevCluster(tmp_path_factory.mktemp("devcluster"))
    info = dev.up(timeout=180)
    try:
        yield info
    finally:
        dev.down()


@pytest.fixture(scope="session")
def api_client(cluster: ClusterInfo) -> Iterator[object]:
    from kubernetes import config

    client = config.new_client_from_config(config_file=cluster.kubeconfig)
    yield client
    client.close()


def _dns_label(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")


@pytest.fixture
def namespace(request: pytest.FixtureRequest, api_client: object) -> Iterator[str]:
    """A fresh namespace, ready for pods (its default service account has its token)."""
    from kubernetes import client

    from matrixserve.devcluster.namespaces import wait_for_service_account

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
def zk(cluster: ClusterInfo) -> Iterator[object]:
    """A started kazoo client whose root is a fresh chroot, removed afterwards."""
    from kazoo.client import KazooClient

    root = f"/tests/{secrets.token_hex(6)}"
    admin = KazooClient(hosts=cluster.zookeeper, timeout=10)
    admin.start(timeout=15)
    admin.ensure_path(root)
    client = KazooClient(hosts=f"{cluster.zookeeper}{root}", timeout=10)
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()
    admin.delete(root, recursive=True)
    admin.stop()
    admin.close()


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
    from matrixserve.devcluster import tools

    paths = {"kubectl": str(tools.kubectl_path()), "helm": str(tools.helm_path())}

    def run(
        tool: str, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
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


class EmulatorHandle:
    """A node emulator process started for one test, with its own SuperPod(s) and nodes."""

    def __init__(
        self, state_dir: Path, supervisor: object, prefix: str, node_names: list[str]
    ) -> None:
        self.state_dir = state_dir
        self.supervisor = supervisor
        self.prefix = prefix
        self.nodes = node_names
        self.control = ""

    def http(self) -> object:
        import httpx

        return httpx.Client(base_url=self.control, timeout=10, trust_env=False)

    def pods(self) -> list[dict[str, object]]:
        with self.http() as http:  # type: ignore[attr-defined]
            return list(http.get("/pods").json())

    def fault(self, heal: bool = False, **body: object) -> dict[str, object]:
        with self.http() as http:  # type: ignore[attr-defined]
            response = http.request("DELETE" if heal else "POST", "/faults", json=body)
            assert response.is_success, response.text
            return dict(response.json())


@pytest.fixture
def start_emulator(
    cluster: ClusterInfo, api_client: object, tmp_path: Path
) -> Iterator[Callable[..., EmulatorHandle]]:
    """Start a private node emulator: ``start_emulator(servers=1, superpods=1, extra=[...])``."""
    import json
    import sys

    from kubernetes import client

    from matrixserve.devcluster.procs import Supervisor

    started: list[tuple[Supervisor, str]] = []

    def start(servers: int = 1, superpods: int = 1, extra: tuple[str, ...] = ()) -> EmulatorHandle:
        prefix = "e" + secrets.token_hex(3)
        state = tmp_path / f"emulator-{prefix}"
        sup = Supervisor(state)
        sup.start(
            "node-emulator",
            [
                sys.executable,
                "-m",
                "enginestub.node",
                "run",
                "--state-dir",
                str(state / "data"),
                "--superpods",
                str(superpods),
                "--servers",
                str(servers),
                "--superpod-prefix",
                prefix,
                "--backoff-base",
                "0.5",
                "--backoff-max",
                "8",
                "--lease-interval",
                "2",
                "--delete-nodes-on-exit",
                *extra,
            ],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
        )
        started.append((sup, prefix))
        names = [f"{prefix}{p}-server-{s:02d}" for p in range(superpods) for s in range(servers)]
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
def crds_installed(api_client: object) -> list[str]:
    """The MatrixServe CRDs on the test cluster (idempotent; left installed)."""
    import yaml
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api_client)
    names = []
    for path in sorted((REPO / "crds").glob("matrixserve.io_*.yaml")):
        body = yaml.safe_load(path.read_text())
        names.append(body["metadata"]["name"])
        try:
            ext.create_custom_resource_definition(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    deadline = time.monotonic() + 30
    for name in names:
        while not any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(name).status.conditions or []
        ):
            assert time.monotonic() < deadline, f"{name} not established"
            time.sleep(0.1)
    return names


class OperatorHandle:
    def __init__(
        self, supervisor: object, name: str, metrics_url: str, args: list[str], env: dict[str, str]
    ) -> None:
        self.supervisor = supervisor
        self.name = name
        self.metrics_url = metrics_url
        self.args = args
        self.env = env

    def log(self) -> str:
        text: str = self.supervisor.log_path(self.name).read_text()  # type: ignore[attr-defined]
        return text

    def stop(self, grace: float = 10) -> None:
        self.supervisor.stop(self.name, grace=grace)  # type: ignore[attr-defined]

    def kill(self) -> None:
        self.stop(grace=0)

    def start(self) -> None:
        self.supervisor.start(self.name, self.args, env=self.env)  # type: ignore[attr-defined]


@pytest.fixture
def start_operator(
    cluster: ClusterInfo, api_client: object, crds_installed: list[str], tmp_path: Path
) -> Iterator[Callable[..., OperatorHandle]]:
    """Start the operator watching one namespace: ``start_operator(namespace, webhook=True, ...)``.

    Each test gets its own operator process (so tests never share one); the managed webhook
    configuration is removed afterwards."""
    import sys

    import yaml
    from kubernetes import client

    from matrixserve.devcluster import pki
    from matrixserve.devcluster.cluster import free_ports
    from matrixserve.devcluster.procs import Supervisor

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
        import httpx

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
        custom = client.CustomObjectsApi(api_client)
        probe = yaml.safe_load((REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text())
        probe["metadata"] = {"name": "webhook-probe"}
        probe["spec"]["decode"]["devicesPerInstance"] = 4  # differs from prefill: refused
        while True:
            try:
                custom.create_namespaced_custom_object(
                    "matrixserve.io", "v1alpha1", namespace, "pdgroups", probe, dry_run="All"
                )
            except client.ApiException as exc:
                if exc.status == 422:
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
            delete("matrixserve.io")
