"""Bring the local control plane and ZooKeeper up and down, report it, export its address.

Components, in start order, all bound to 127.0.0.1 on free ports:

1. etcd (Debian's 3.4 with Kubernetes 1.20, the default; v3.7.3 built beside Kubernetes with
   ``MATRIXSERVE_KUBERNETES=1.37``), data in ``<state>/data/etcd``;
2. kube-apiserver (v1.20.2, or v1.37.2: :mod:`.tools`; RBAC + Node authorization, static-token admin in ``system:masters``,
   service accounts signed by our key pair, serving certificate from our CA);
3. kube-controller-manager (all controllers but node lifecycle: there is no kubelet here, so a
   node's health and its pods' readiness are the node emulator's business; taint eviction runs,
   so a pod's ``tolerationSeconds`` for the emulator's unreachable taint act), the root CA published
   to every namespace (``kube-root-ca.crt``) for projected service-account tokens;
4. kube-scheduler;
5. ZooKeeper (``ZooKeeperServerMain``, 4-letter ``ruok`` for readiness);
6. the node emulator (``python -m enginestub.node``): emulated NPU servers that run pods as local
   processes (SYSTEM.md §5), one SuperPod of four 8-NPU servers by default.

Each waits for its own readiness endpoint with a timeout; a component that dies while we wait
fails the step with its log. ``down`` stops exactly the processes recorded in ``<state>/pids``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import shutil
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matrixserve.api import zk_layout as zl
from matrixserve.devcluster import pki, tools
from matrixserve.devcluster.errors import DevClusterError, tail
from matrixserve.devcluster.procs import Supervisor

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "zookeeper",
    "node-emulator",
)
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    zookeeper: int


@dataclass(frozen=True)
class ClusterInfo:
    """What scripts and tests need to reach a running cluster (``<state>/cluster.json``)."""

    state_dir: str
    kubeconfig: str
    server: str
    ca_file: str
    admin_token: str
    zookeeper: str
    ports: Ports
    bin_dir: str
    helm: str
    node_emulator: str = ""  # control API URL of the node emulator
    service_cidr: str = ""  # ClusterIPs: a loopback /16 the node emulator routes
    # MatrixServe's ZooKeeper identity, user:password: an operator, gateway or engine given it
    # ($MATRIXSERVE_ZK_AUTH) makes its znodes readable and writable by that identity alone
    zookeeper_auth: str = ""

    @classmethod
    def load(cls, path: Path) -> ClusterInfo:
        data = json.loads(path.read_text())
        data["ports"] = Ports(**data["ports"])
        return cls(**data)

    def env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": self.kubeconfig,
            "MATRIXSERVE_ZK": self.zookeeper,
            "MATRIXSERVE_ZK_AUTH": self.zookeeper_auth,
            "MATRIXSERVE_STATE_DIR": self.state_dir,
            "MATRIXSERVE_HELM": self.helm,
            "MATRIXSERVE_NODE_EMULATOR": self.node_emulator,
        }


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class DevCluster:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.supervisor = Supervisor(state_dir)
        self.info_path = state_dir / "cluster.json"
        self.setup_log = state_dir / "logs" / "setup.log"

    # ----------------------------------------------------------------- queries
    def info(self) -> ClusterInfo | None:
        if not self.info_path.exists():
            return None
        try:
            return ClusterInfo.load(self.info_path)
        except (json.JSONDecodeError, KeyError, TypeError):
            return None

    def component_alive(self) -> dict[str, bool]:
        alive = {}
        for name in COMPONENTS:
            record = self.supervisor.record(name)
            alive[name] = record is not None and record.alive()
        return alive

    def is_running(self) -> bool:
        info = self.info()
        return info is not None and all(self.component_alive().values()) and _apiserver_ready(info)

    def status(self) -> dict[str, object]:
        info = self.info()
        components = []
        extra = [r.name for r in self.supervisor.records() if r.name not in COMPONENTS]
        for name in (*COMPONENTS, *extra):
            record = self.supervisor.record(name)
            components.append(
                {
                    "name": name,
                    "pid": record.pid if record else None,
                    "alive": bool(record and record.alive()),
                    "log": str(self.supervisor.log_path(name)),
                }
            )
        return {
            "stateDir": str(self.state_dir),
            "running": self.is_running(),
            "server": info.server if info else None,
            "zookeeper": info.zookeeper if info else None,
            "kubeconfig": info.kubeconfig if info else None,
            "nodeEmulator": info.node_emulator if info else None,
            "components": components,
        }

    # ----------------------------------------------------------------- up/down
    def up(
        self,
        *,
        timeout: float = 120.0,
        superpods: int = 1,
        servers: int = 4,
        emulator_flags: Sequence[str] = (),
    ) -> ClusterInfo:
        """Start the cluster (idempotent: a healthy running cluster is returned as it is);
        ``emulator_flags`` go to the node emulator (e.g. ``--npus-per-server 2``)."""
        existing = self.info()
        if existing is not None and self.is_running():
            return existing
        if any(self.component_alive().values()):
            tools.say(f"a partial cluster is running in {self.state_dir}; stopping it first")
        self.down()

        bin_dir = tools.setup(self.setup_log)
        helm = tools.helm_path()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ports = Ports(*free_ports(6))
        pki_dir = self.state_dir / "pki"
        ca = pki.ensure_ca(pki_dir)
        serving = pki.issue_certificate(
            ca,
            pki_dir,
            "apiserver",
            "kube-apiserver",
            [
                f"IP:{LOOPBACK}",
                "IP:10.96.0.1",
                "DNS:localhost",
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc",
                "DNS:kubernetes.default.svc.cluster.local",
            ],
        )
        sa = pki.ensure_service_account_keys(pki_dir)
        token = secrets.token_hex(24)
        tokens_csv = pki_dir / "tokens.csv"
        tokens_csv.write_text(f'{token},matrixserve-admin,matrixserve-admin,"system:masters"\n')
        tokens_csv.chmod(0o600)
        kubeconfig = self.state_dir / "kubeconfig"
        server = f"https://{LOOPBACK}:{ports.apiserver}"
        _write_kubeconfig(kubeconfig, server, ca.cert, token)
        # The service range: a loopback /16 (the node emulator routes its ClusterIPs), kept for
        # the state dir's lifetime since etcd remembers the ClusterIPs it handed out.
        cidr_file = self.state_dir / "service-cidr"
        if not cidr_file.exists():
            from enginestub.node.network import free_service_cidr

            cidr_file.write_text(free_service_cidr())
        info = ClusterInfo(
            service_cidr=cidr_file.read_text().strip(),
            state_dir=str(self.state_dir),
            kubeconfig=str(kubeconfig),
            server=server,
            ca_file=str(ca.cert),
            admin_token=token,
            zookeeper=f"{LOOPBACK}:{ports.zookeeper}",
            zookeeper_auth=f"{zl.USER}:{secrets.token_hex(16)}",
            ports=ports,
            bin_dir=str(bin_dir),
            helm=str(helm),
        )
        self.info_path.write_text(json.dumps(dataclasses.asdict(info), indent=2))
        self.info_path.chmod(0o600)

        deadline = time.monotonic() + timeout
        try:
            self._start_etcd(info, deadline)
            self._start_apiserver(
                info, ca=ca, serving=serving, sa=sa, tokens_csv=tokens_csv, deadline=deadline
            )
            self._start_controller_manager(info, ca, sa, kubeconfig, deadline)
            self._start_scheduler(info, kubeconfig, deadline)
            self._start_zookeeper(info, deadline)
            self._wait(
                "controller-manager: default service account",
                "kube-controller-manager",
                deadline,
                lambda: _default_service_account_ready(info),
            )
            info = self._start_node_emulator(
                info, kubeconfig, superpods, servers, deadline, emulator_flags
            )
            self.info_path.write_text(json.dumps(dataclasses.asdict(info), indent=2))
        except BaseException:
            self.down(keep_logs=True)
            raise
        return info

    def down(self, *, keep_logs: bool = True) -> list[str]:
        """Stop every process this state directory started (reverse order); remove its data."""
        stopped = []
        names = [r.name for r in self.supervisor.records()]
        # Whatever runs on top (the operator, started by the demo) stops first.
        ordered = [n for n in names if n not in COMPONENTS] + [
            n for n in reversed(COMPONENTS) if n in names
        ]
        for name in ordered:
            if self.supervisor.stop(name):
                stopped.append(name)
        for sub in ("data", "pki", "run", "emulator"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        for path in (self.info_path, self.state_dir / "kubeconfig"):
            path.unlink(missing_ok=True)
        if not keep_logs:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return stopped

    # ----------------------------------------------------------------- components
    def _wait(self, step: str, component: str, deadline: float, ready: Callable[[], bool]) -> None:
        log = self.supervisor.log_path(component)
        while True:
            if self.supervisor.exited(component):
                raise DevClusterError(
                    step, f"{component} exited during start-up", log=log, hint=_hint_from_log(log)
                )
            try:
                if ready():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise DevClusterError(
                    step,
                    f"{component} not ready before the timeout",
                    log=log,
                    hint=_hint_from_log(log),
                )
            time.sleep(0.2)

    def _start_etcd(self, info: ClusterInfo, deadline: float) -> None:
        data = self.state_dir / "data" / "etcd"
        data.mkdir(parents=True, exist_ok=True)
        data.chmod(0o700)
        client = f"http://{LOOPBACK}:{info.ports.etcd_client}"
        peer = f"http://{LOOPBACK}:{info.ports.etcd_peer}"
        self.supervisor.start(
            "etcd",
            [
                str(tools.etcd_path()),
                "--name=devcluster",
                f"--data-dir={data}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=devcluster={peer}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait("etcd", "etcd", deadline, lambda: b'"true"' in _http_get(f"{client}/health"))

    def _start_apiserver(
        self,
        info: ClusterInfo,
        *,
        ca: pki.KeyPair,
        serving: pki.KeyPair,
        sa: pki.KeyPair,
        tokens_csv: Path,
        deadline: float,
    ) -> None:
        bins = Path(info.bin_dir)
        self.supervisor.start(
            "kube-apiserver",
            [
                str(bins / "kube-apiserver"),
                f"--etcd-servers=http://{LOOPBACK}:{info.ports.etcd_client}",
                f"--bind-address={LOOPBACK}",
                f"--advertise-address={LOOPBACK}",
                f"--secure-port={info.ports.apiserver}",
                # 1.20 still had an insecure port (removed in 1.24)
                *(["--insecure-port=0"] if tools.legacy() else []),
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca.cert}",
                # the controller-manager and the scheduler read the front proxy's CA at start
                # and log its absence every few seconds since 1.2x: ours, for a name nobody has
                *(
                    []
                    if tools.legacy()
                    else [
                        f"--requestheader-client-ca-file={ca.cert}",
                        "--requestheader-allowed-names=front-proxy-client",
                    ]
                ),
                f"--cert-dir={self.state_dir / 'pki' / 'apiserver'}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--authorization-mode=Node,RBAC",
                f"--token-auth-file={tokens_csv}",
                f"--service-cluster-ip-range={info.service_cidr}",
                # Nothing routes to Service IPs here; don't reconcile the kubernetes endpoint
                # (it would log "may not be in the loopback range" every few seconds).
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait("kube-apiserver", "kube-apiserver", deadline, lambda: _apiserver_ready(info))

    def _start_controller_manager(
        self, info: ClusterInfo, ca: pki.KeyPair, sa: pki.KeyPair, kubeconfig: Path, deadline: float
    ) -> None:
        self._start_component(
            "kube-controller-manager",
            info,
            kubeconfig,
            info.ports.controller_manager,
            [
                # No kubelet here: the node emulator keeps the Nodes' status and taints, and
                # marks a down node's pods not Ready. Taint eviction, a controller of its own
                # since 1.29, runs: a pod on a down node (tainted unreachable:NoExecute) is
                # deleted once its toleration's seconds pass (the chart's control plane: 30 s;
                # others: the API server's DefaultTolerationSeconds, 300 s), so a Deployment's
                # replacement runs elsewhere. In 1.20 eviction was node lifecycle's: off.
                "--controllers=*,-nodelifecycle",
                f"--service-account-private-key-file={sa.key}",
                f"--root-ca-file={ca.cert}",
                f"--cluster-signing-cert-file={ca.cert}",
                f"--cluster-signing-key-file={ca.key}",
            ],
            deadline,
        )

    def _start_scheduler(self, info: ClusterInfo, kubeconfig: Path, deadline: float) -> None:
        self._start_component(
            "kube-scheduler", info, kubeconfig, info.ports.scheduler, [], deadline
        )

    def _start_component(
        self,
        name: str,
        info: ClusterInfo,
        kubeconfig: Path,
        port: int,
        own_flags: list[str],
        deadline: float,
    ) -> None:
        """Start kube-controller-manager or kube-scheduler with the flags both take, then its own
        flags, and wait for its ``/healthz``.

        Both use the admin kubeconfig for the API server and for delegated authentication and
        authorization, serve HTTPS on loopback only (insecure port off, self-signed certificate
        in their own directory), run alone (no leader election) and without profiling.
        """
        self.supervisor.start(
            name,
            [
                str(Path(info.bin_dir) / name),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={port}",
                *(["--port=0"] if tools.legacy() else []),  # the insecure port, until 1.24
                f"--cert-dir={self.state_dir / 'pki' / name.removeprefix('kube-')}",
                "--leader-elect=false",
                *own_flags,
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait(
            name,
            name,
            deadline,
            lambda: _http_get(f"https://{LOOPBACK}:{port}/healthz", insecure=True) == b"ok",
        )

    def _start_zookeeper(self, info: ClusterInfo, deadline: float) -> None:
        from enginestub.node import zookeeper  # the same server the chart's ZooKeeper pod runs

        data = self.state_dir / "data" / "zookeeper"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.state_dir / "data" / "zoo.cfg"
        zookeeper.write_config(
            cfg,
            data,
            info.ports.zookeeper,
            LOOPBACK,
            "ruok,srvr,stat,mntr",
            # Sessions may be as short as 2 s: tests expire them on purpose.
            "minSessionTimeout=2000\n",
        )
        self.supervisor.start(
            "zookeeper",
            zookeeper.server_argv(str(tools.java_path()), cfg, self.state_dir / "logs"),
        )
        self._wait(
            "zookeeper",
            "zookeeper",
            deadline,
            lambda: _four_letter(LOOPBACK, info.ports.zookeeper, b"ruok") == b"imok",
        )

    def _start_node_emulator(
        self,
        info: ClusterInfo,
        kubeconfig: Path,
        superpods: int,
        servers: int,
        deadline: float,
        flags: Sequence[str] = (),
    ) -> ClusterInfo:
        from enginestub.node.command import node_names, run_argv

        state = self.state_dir / "emulator"
        self.supervisor.start(
            "node-emulator",
            run_argv(
                state,
                superpods=superpods,
                servers=servers,
                extra=("--service-proxy", "--service-cidr", info.service_cidr, *flags),
            ),
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )
        names = node_names(superpods, servers)
        self._wait(
            "node-emulator",
            "node-emulator",
            deadline,
            lambda: (state / "emulator.json").exists() and _nodes_ready(info, names),
        )
        control = json.loads((state / "emulator.json").read_text())["control"]
        return dataclasses.replace(info, node_emulator=control)


# --------------------------------------------------------------------- helpers
def _nodes_ready(info: ClusterInfo, names: list[str]) -> bool:
    for name in names:
        node = json.loads(
            _http_get(
                f"{info.server}/api/v1/nodes/{name}", token=info.admin_token, ca_file=info.ca_file
            )
        )
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        if conditions.get("Ready") != "True" or node.get("spec", {}).get("taints"):
            return False
    return True


def _write_kubeconfig(path: Path, server: str, ca: Path, token: str) -> None:
    from enginestub.node.podspec import token_kubeconfig

    path.write_text(
        token_kubeconfig(
            server,
            str(ca),
            token,
            cluster_name="matrixserve-dev",
            user="matrixserve-admin",
            context="matrixserve-dev",
        )
    )
    path.chmod(0o600)


def _http_get(
    url: str, *, token: str | None = None, ca_file: str | None = None, insecure: bool = False
) -> bytes:
    context = None
    if url.startswith("https"):
        context = ssl.create_default_context(cafile=ca_file)
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=2, context=context) as response:
        body: bytes = response.read()
        return body


def _apiserver_ready(info: ClusterInfo) -> bool:
    try:
        return (
            _http_get(f"{info.server}/readyz", token=info.admin_token, ca_file=info.ca_file)
            == b"ok"
        )
    except (OSError, urllib.error.URLError):
        return False


def _default_service_account_ready(info: ClusterInfo) -> bool:
    """The default ServiceAccount exists and a pod can get its token: the root CA published
    (``kube-root-ca.crt``, for projected tokens), or on 1.20 the account's token Secret."""

    def get(path: str) -> dict[str, object]:
        body = _http_get(f"{info.server}{path}", token=info.admin_token, ca_file=info.ca_file)
        out = json.loads(body)
        return out if isinstance(out, dict) else {}

    account = get("/api/v1/namespaces/default/serviceaccounts/default")
    if account.get("secrets"):
        return True
    if account.get("kind") != "ServiceAccount" or tools.legacy():
        return False
    return get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt").get("kind") == "ConfigMap"


def _four_letter(host: str, port: int, word: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=2) as sock:
        sock.sendall(word)
        chunks = []
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        return b"".join(chunks)


_HINTS = (
    (
        "address already in use",
        "another process holds one of the chosen ports; run the command again "
        "(ports are picked afresh)",
    ),
    (
        "bind: permission denied",
        "the port is not allowed for this user; run as root or pick higher ports",
    ),
    ("no space left", "free some disk space under the state directory"),
    (
        "java.lang",
        "ZooKeeper's Java failed: check that the zookeeper package and a JRE are installed",
    ),
    ("unable to create storage backend", "etcd is not reachable: see etcd.log in the same folder"),
)


def _hint_from_log(log: Path) -> str:
    text = tail(log, 200).lower()
    for needle, hint in _HINTS:
        if needle in text:
            return hint
    return (
        "read the log above; 'python -m matrixserve.devcluster down' cleans up, then try 'up' again"
    )


def export_lines(info: ClusterInfo) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in info.env().items())
