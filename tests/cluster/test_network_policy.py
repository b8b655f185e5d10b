"""The chart's NetworkPolicies against the connections MatrixServe's pods really make (issue 16,
finding 7 and its "Done when").

The local cluster enforces no network policy, so the test records who connects to whom while the
chart runs a group with traffic through the gateway, a scale-out and a fault, and asks the
evaluator (``tests/netpol.py``, Kubernetes' semantics) whether each connection would pass where
policies are enforced: every one must, and a pod that is not MatrixServe's (in the release's
namespace or another) must not reach an engine or ZooKeeper.

Recording: ``tests/pod_sockets.py``, a process of its own, samples every 50 ms which pod's
process holds which client socket (pods here are processes on per-pod 127.x addresses; their
outgoing connections do not bind that address, so a socket is tied to its pod by its owner).
The peer is a pod by its IP, a Service's ClusterIP (the emulator's service proxy stands in for
kube-proxy: the connection counts as one to every pod the Service selects, at its target port,
as policies see it after kube-proxy's DNAT), or an address no pod has (the API server). The
pooled keep-alive connections (gateway to prefills, prefills to decodes, decodes to prefills),
the ZooKeeper sessions and the streams last long enough to be seen; short ones are caught most
of the time, which is all the test needs: it asserts that what was seen is allowed, and that
each kind of edge MatrixServe relies on was seen at least once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from matrixserve.adapters.kube import SECRET_RECHECK_SECONDS, KubeAdapter
from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import LABEL_ROLE
from matrixserve.devcluster import demo, tools
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.devcluster.namespaces import wait_for_service_account
from matrixserve.domain.enginepod import (
    ENGINE_PORT,
    POLICY_LABELS,
    engine_container,
    engine_network_policy,
)
from matrixserve.domain.pdgroup.pods import pod_labels, role_label
from netpol import Cluster, Endpoint, Pod
from testkit.helpers import Groups, absent, events_of, explain_namespace, pdgroup_body, wait_for

CHART = Path(__file__).resolve().parents[2] / "charts" / "matrixserve"
SAMPLER = Path(__file__).resolve().parents[1] / "pod_sockets.py"
COMPONENT = "app.kubernetes.io/component"
ZOOKEEPER_PORT = 2181

# The edges MatrixServe relies on: the gateway calls prefills (generate, info); a prefill streams
# to a decode; a decode pulls KV from a prefill; every engine, the gateway and the operator keep
# a ZooKeeper session. (The operator calls no engine: it learns everything from ZooKeeper.)
EXPECTED_EDGES = {
    ("gateway", "prefill"),
    ("prefill", "decode"),
    ("decode", "prefill"),
    ("prefill", "zookeeper"),
    ("decode", "zookeeper"),
    ("gateway", "zookeeper"),
    ("operator", "zookeeper"),
    ("zookeeper", "zookeeper"),  # the default ensemble's quorum and election (issue 31)
}


def render(release: str, namespace: str, *values: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart (no cluster needed)."""
    return subprocess.run(
        [str(tools.helm_path()), "template", release, str(CHART), "-n", namespace, *values],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def helm_template(release: str, namespace: str, *values: str) -> list[dict[str, Any]]:
    """The chart's documents, rendered."""
    done = render(release, namespace, *values)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def policies(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == "NetworkPolicy"]


# ------------------------------------------------------------------ the rendered policies alone
RELEASE_NS = "ms"
NAMESPACE_LABELS = {  # as Kubernetes >= 1.21 labels every namespace
    ns: {"kubernetes.io/metadata.name": ns} for ns in (RELEASE_NS, "serve", "extra", "other")
}


def chart_pod(component: str, namespace: str = RELEASE_NS, release: str = "r") -> Pod:
    ports = {
        "gateway": {"http": (8090, "TCP")},
        "operator": {"metrics": (8080, "TCP"), "webhook": (9443, "TCP"), "liveness": (8081, "TCP")},
        "zookeeper": {"client": (ZOOKEEPER_PORT, "TCP")},
    }[component]
    labels = {
        "app.kubernetes.io/name": "matrixserve",
        "app.kubernetes.io/instance": release,
        COMPONENT: component,
    }
    return Pod(namespace, f"{release}-{component}", labels, f"10.1.0.{len(component)}", ports)


def engine_pod(namespace: str, role: zl.Role = zl.Role.PREFILL) -> Pod:
    """An engine pod with the labels and named port the operator gives it."""
    name = f"g-{role_label(role)[0]}-0"
    ports = {
        port["name"]: (port["containerPort"], port.get("protocol", "TCP"))
        for port in engine_container("engine:1", [], 2)["ports"]
    }
    return Pod(namespace, name, pod_labels("g", role, name), "10.2.0.1", ports)


def verdict(cluster: Cluster, source: Pod | Endpoint, dest: Pod, port: int) -> bool:
    src = source if isinstance(source, Endpoint) else Endpoint.of(source)
    return bool(cluster.allows(src, Endpoint.of(dest), port))


def test_the_policies_admit_matrixserve_and_refuse_the_rest_wherever_engines_run() -> None:
    rendered = policies(
        helm_template(
            "r", RELEASE_NS, "--set", "watchNamespaces={serve}",
            "--set", "networkPolicy.engineNamespaces={extra}",
        )
    )  # fmt: skip
    cluster = Cluster(rendered, NAMESPACE_LABELS, default_namespace=RELEASE_NS)
    gateway, operator, zk = (chart_pod(c) for c in ("gateway", "operator", "zookeeper"))
    intruder = Pod("serve", "intruder", {"app": "curl"}, "10.3.0.1")
    outsider = Pod("other", "intruder", {"app": "curl"}, "10.3.0.2")
    # a pod elsewhere wearing the gateway's labels is not the gateway
    impostor = chart_pod("gateway", namespace="other")
    for ns in ("serve", "extra"):  # the watched namespace and the listed one
        prefill, decode = engine_pod(ns), engine_pod(ns, zl.Role.DECODE)
        for source in (gateway, operator, decode, engine_pod("other", zl.Role.DECODE)):
            assert verdict(cluster, source, prefill, ENGINE_PORT), (source, ns)
        for source in (intruder, outsider, impostor, Endpoint("192.0.2.1")):
            assert not verdict(cluster, source, prefill, ENGINE_PORT), (source, ns)
        assert not verdict(cluster, gateway, prefill, 9999)  # the engine port only
        assert verdict(cluster, prefill, zk, ZOOKEEPER_PORT)
    # the release namespace is not watched here, so it has no engines' policy
    assert verdict(cluster, intruder, engine_pod(RELEASE_NS), ENGINE_PORT)
    # the chart alone cannot reach an unlisted namespace: the operator writes the policy there
    assert verdict(cluster, outsider, engine_pod("other"), ENGINE_PORT)
    for source in (gateway, operator, engine_pod("other")):
        assert verdict(cluster, source, zk, ZOOKEEPER_PORT)
    for source in (intruder, outsider, impostor, Pod(RELEASE_NS, "x", {}, "10.3.0.3")):
        assert not verdict(cluster, source, zk, ZOOKEEPER_PORT)
    assert verdict(cluster, chart_pod("zookeeper"), zk, 2888)  # quorum, server to server
    assert not verdict(cluster, gateway, zk, 2888)
    # The entry and the operator's ports stay open (values restrict them: next test).
    assert verdict(cluster, Endpoint("192.0.2.1"), gateway, 8090)
    assert verdict(cluster, Endpoint("192.0.2.1"), operator, 9443)  # the API server calls
    assert verdict(cluster, outsider, operator, 8080)
    assert not verdict(cluster, outsider, operator, 8081)  # liveness: the node only
    assert not verdict(cluster, gateway, operator, 9999)
    # Egress is not restricted for the gateway and the operator (the API server is no pod).
    for source in (gateway, operator):
        assert cluster.allows(Endpoint.of(source), Endpoint("10.96.0.1"), 6443)


def notes(release: str, namespace: str, *values: str) -> str:
    """What ``helm install`` prints after installing (NOTES.txt), from a client-side dry run."""
    done = subprocess.run(
        [
            str(tools.helm_path()), "install", release, str(CHART), "-n", namespace,
            "--dry-run=client", *values,
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\nNOTES:\n", 1)[1]


def operator_flags(documents: list[dict[str, Any]]) -> list[str]:
    """The flags the rendered chart gives its operator for the engines' policy (issue 31)."""
    (deployment,) = [
        d
        for d in documents
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
    ]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a for a in args if a.startswith("--engine-network-policy")]


def operator_policy(documents: list[dict[str, Any]], namespace: str) -> dict[str, Any]:
    """The engines' policy the operator writes into ``namespace``, from those flags."""
    args = dict(a.removeprefix("--").split("=", 1) for a in operator_flags(documents))
    policy = engine_network_policy(
        args["engine-network-policy-name"], json.loads(args["engine-network-policy"])
    )
    policy["metadata"]["namespace"] = namespace
    return policy


@pytest.mark.parametrize(
    "values",
    [
        (),
        ("--set", "networkPolicy.engineEgress.enabled=true"),
        (
            "--set", "networkPolicy.engineEgress.enabled=true",
            "--set", "zookeeper.external=zk.example:2181",
            "--set-json", 'networkPolicy.engineEgress.to=[{"ports": [{"port": 443}]}]',
            "--set-json", 'networkPolicy.metricsFrom=[{"podSelector": {"matchLabels": {"app": "prometheus"}}, "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]',
        ),
    ],
)  # fmt: skip
def test_the_operator_writes_the_charts_engine_policy_where_the_values_list_no_namespace(
    values: tuple[str, ...],
) -> None:
    """Issue 31: engines in a namespace the chart's values do not list were open to every pod.
    The chart gives the operator its engines' policy (its spec, rendered for any namespace,
    and its name); the operator writes it where it creates engine pods. The same rules as the
    chart's own policy in a listed namespace, under the same name (one policy a namespace,
    whoever wrote it), and they admit MatrixServe and refuse the rest there."""
    documents = helm_template(
        "r", RELEASE_NS, "--set", "networkPolicy.engineNamespaces={extra}", *values
    )
    (charts,) = [
        p
        for p in policies(documents)
        if p["metadata"]["namespace"] == "extra" and p["metadata"]["name"].endswith("-engines")
    ]
    ours = operator_policy(documents, "extra")
    assert ours["metadata"]["name"] == charts["metadata"]["name"] == "r-matrixserve-engines"
    # the same rules, as the API server keeps them (a port's protocol written out: TCP)
    assert ours["spec"] == engine_network_policy("x", charts["spec"])["spec"]
    if not any("engineEgress.to" in v for v in values):  # the chart's own rules write it out
        assert ours["spec"] == charts["spec"]
    assert ours["metadata"]["labels"] == POLICY_LABELS  # the operator's, not the chart's
    # In a namespace no value names, only the operator's policy guards the engines.
    cluster = Cluster(
        [*policies(documents), operator_policy(documents, "other")],
        NAMESPACE_LABELS,
        default_namespace=RELEASE_NS,
    )
    prefill = engine_pod("other")
    for source in (
        chart_pod("gateway"),
        chart_pod("operator"),
        engine_pod("serve", zl.Role.DECODE),
    ):
        assert verdict(cluster, source, prefill, ENGINE_PORT), source
    for intruder in (
        Pod("other", "intruder", {"app": "curl"}, "10.3.0.1"),
        Pod("serve", "intruder", {"app": "curl"}, "10.3.0.2"),
        chart_pod("gateway", namespace="other"),  # the gateway's labels, but not its namespace
    ):
        assert not verdict(cluster, intruder, prefill, ENGINE_PORT), intruder
    # without the chart's network policies, the operator is given none to write
    off = helm_template("r", RELEASE_NS, "--set", "networkPolicy.enabled=false")
    assert operator_flags(off) == []


def test_with_every_namespace_served_the_listed_engine_namespaces_are_covered_too() -> None:
    """The default, ``watchNamespaces: []`` (the operator serves every namespace): the engines'
    policy is in the release namespace and in each of ``networkPolicy.engineNamespaces`` from
    the install; elsewhere the operator writes it before the first engine pod (previous test),
    so the install notes warn of no namespace left open."""
    values = ("--set", "networkPolicy.engineNamespaces={extra}")
    rendered = policies(helm_template("r", RELEASE_NS, *values))
    engines = [p for p in rendered if p["metadata"]["name"] == "r-matrixserve-engines"]
    assert sorted(p["metadata"]["namespace"] for p in engines) == sorted([RELEASE_NS, "extra"])
    cluster = Cluster(rendered, NAMESPACE_LABELS, default_namespace=RELEASE_NS)
    gateway, operator = chart_pod("gateway"), chart_pod("operator")
    for ns in (RELEASE_NS, "extra"):
        prefill = engine_pod(ns)
        for source in (gateway, operator, engine_pod("other", zl.Role.DECODE)):
            assert verdict(cluster, source, prefill, ENGINE_PORT), (source, ns)
        for intruder in (Pod(ns, "intruder", {"app": "curl"}, "10.3.0.1"),
                         Pod("other", "intruder", {"app": "curl"}, "10.3.0.2")):  # fmt: skip
            assert not verdict(cluster, intruder, prefill, ENGINE_PORT), (intruder, ns)
    for quiet in ((), values, ("--set", "networkPolicy.enabled=false")):
        assert "WARNING" not in notes("r", RELEASE_NS, *quiet), quiet


def test_the_demo_covers_the_namespace_its_group_runs_in() -> None:
    """``make demo`` installs in one namespace and runs its group in another, with the
    operator serving every namespace: its values list the group's namespace."""
    values = [arg for value in demo.LOCAL_VALUES for arg in ("--set", value)]
    rendered = policies(helm_template(demo.RELEASE, demo.SYSTEM, *values))
    engines = {
        p["metadata"]["namespace"] for p in rendered if p["metadata"]["name"].endswith("-engines")
    }
    assert engines == {demo.SYSTEM, demo.NAMESPACE}
    labels = {ns: {"kubernetes.io/metadata.name": ns} for ns in (demo.SYSTEM, demo.NAMESPACE)}
    cluster = Cluster(rendered, labels, default_namespace=demo.SYSTEM)
    prefill = engine_pod(demo.NAMESPACE)
    gateway = chart_pod("gateway", namespace=demo.SYSTEM, release=demo.RELEASE)
    assert verdict(cluster, gateway, prefill, ENGINE_PORT)
    intruder = Pod(demo.NAMESPACE, "intruder", {"app": "curl"}, "10.3.0.1")
    assert not verdict(cluster, intruder, prefill, ENGINE_PORT)
    assert "WARNING" not in notes(demo.RELEASE, demo.SYSTEM, *values)


def test_values_narrow_who_reaches_the_gateway_the_webhook_metrics_and_engine_egress() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}}}
    lb = {"ipBlock": {"cidr": "198.51.100.0/24"}}
    rendered = policies(
        helm_template(
            "r", RELEASE_NS,
            "--set-json", f"networkPolicy.gatewayFrom=[{json.dumps(lb)}]",
            "--set-json", 'networkPolicy.webhookFrom=[{"ipBlock": {"cidr": "192.0.2.0/28"}}]',
            "--set-json", f"networkPolicy.metricsFrom=[{json.dumps(prometheus)}]",
            "--set", "networkPolicy.engineEgress.enabled=true",
            "--set-json", 'networkPolicy.engineEgress.to=[{"ports": [{"port": 443}]}]',
        )
    )  # fmt: skip
    cluster = Cluster(rendered, NAMESPACE_LABELS, default_namespace=RELEASE_NS)
    gateway, operator, zk = (chart_pod(c) for c in ("gateway", "operator", "zookeeper"))
    scraper = Pod("other", "prometheus", {"app": "prometheus"}, "10.4.0.1")
    prefill, decode = engine_pod(RELEASE_NS), engine_pod(RELEASE_NS, zl.Role.DECODE)
    assert verdict(cluster, Endpoint("198.51.100.9"), gateway, 8090)
    assert not verdict(cluster, Endpoint("203.0.113.9"), gateway, 8090)
    assert verdict(cluster, scraper, gateway, 8090)  # /metrics is on the gateway's port
    assert verdict(cluster, Endpoint("192.0.2.1"), operator, 9443)
    assert not verdict(cluster, Endpoint("192.0.2.100"), operator, 9443)
    assert verdict(cluster, scraper, operator, 8080)
    assert not verdict(cluster, Endpoint("203.0.113.9"), operator, 8080)
    assert verdict(cluster, scraper, prefill, ENGINE_PORT)  # scraping engines, when asked for
    # Engines' egress: engines, the bundled ZooKeeper, DNS and what `to` adds; nothing else.
    assert verdict(cluster, prefill, decode, ENGINE_PORT)
    assert verdict(cluster, prefill, engine_pod("other", zl.Role.DECODE), ENGINE_PORT)
    assert verdict(cluster, prefill, zk, ZOOKEEPER_PORT)
    assert cluster.allows(Endpoint.of(prefill), Endpoint("10.96.0.10"), 53, "UDP")
    assert cluster.allows(Endpoint.of(prefill), Endpoint("203.0.113.9"), 443)
    assert not cluster.allows(Endpoint.of(prefill), Endpoint("10.96.0.1"), 6443)  # API server
    assert not verdict(cluster, prefill, gateway, 8090)
    assert not verdict(cluster, prefill, operator, 8080)


def test_no_policy_for_what_the_chart_does_not_run_and_bad_peers_refused() -> None:
    assert not policies(helm_template("r", RELEASE_NS, "--set", "networkPolicy.enabled=false"))
    external = policies(
        helm_template(
            "r", RELEASE_NS, "--set", "zookeeper.external=zk.example:2181",
            "--set", "networkPolicy.engineEgress.enabled=true",
        )
    )  # fmt: skip
    names = {p["metadata"]["name"] for p in external}
    assert names == {"r-matrixserve-engines", "r-matrixserve-gateway", "r-matrixserve-operator"}
    (engines,) = [p for p in external if p["metadata"]["name"].endswith("-engines")]
    assert engines["metadata"]["namespace"] == RELEASE_NS  # watchNamespaces empty: the release's
    # an external ensemble is no pod the chart can name: engines reach it through engineEgress.to
    judge = Cluster(external, NAMESPACE_LABELS, default_namespace=RELEASE_NS)
    assert not judge.allows(Endpoint.of(engine_pod(RELEASE_NS)), Endpoint("10.0.0.5"), 2181)
    bad = render("r", RELEASE_NS, "--set-json", 'networkPolicy.gatewayFrom=[{"podSelectr": {}}]')
    assert bad.returncode != 0
    assert "podSelectr" in bad.stderr


# ------------------------------------------------------------------ the operator's policy
def test_the_operator_guards_engines_where_it_makes_them_and_leaves_a_foreign_policy_alone(
    api_client: client.ApiClient,
    namespace: str,
    start_operator: Callable[..., Any],
) -> None:
    """Issue 31 on the real API server: an operator given the chart's flags (a release in a
    namespace of its own, no value naming the test's namespaces) and a group in each of two
    namespaces. In the first, the engines' policy appears with the first pods, the operator's
    (its labels), with the chart's rules for that namespace. In the second, a tenant's policy
    holds the name: left exactly as it was, the pods made anyway, a Warning Event on the group.
    Then the adapter against the real server: a changed policy is put back, and one as written
    is only read (what the server stores compares equal to what the operator writes)."""
    documents = helm_template("r", "ms-release")
    flags = operator_flags(documents)
    name = "r-matrixserve-engines"
    core = client.CoreV1Api(api_client)
    networking = client.NetworkingV1Api(api_client)
    other = f"{namespace}-b"
    core.create_namespace({"metadata": {"name": other, "labels": {"matrixserve.io/test": "true"}}})
    wait_for_service_account(core, other)
    tenants = networking.create_namespaced_network_policy(
        other,
        {
            "metadata": {"name": name, "labels": {"team": "b"}},
            "spec": {"podSelector": {}, "ingress": [{}]},  # theirs: open to all
        },
    )
    ours_there, theirs_there = Groups(api_client, namespace), Groups(api_client, other)
    try:
        start_operator(namespace, webhook=False, extra=("--namespace", other, *flags))
        for groups in (ours_there, theirs_there):
            groups.create(pdgroup_body("g", 1, 1))
        for groups in (ours_there, theirs_there):
            wait_for(lambda g=groups: len(g.pods("g")) == 2, 30, f"pods in {groups.namespace}")
        made = networking.read_namespaced_network_policy(name, namespace)
        assert made.metadata.labels == POLICY_LABELS
        stored = api_client.sanitize_for_serialization(made.spec)
        assert stored == operator_policy(documents, namespace)["spec"]
        first_pod = min(p.metadata.creation_timestamp for p in ours_there.pods("g").values())
        assert made.metadata.creation_timestamp <= first_pod
        left = networking.read_namespaced_network_policy(name, other)
        assert left.metadata.resource_version == tenants.metadata.resource_version
        wait_for(
            lambda: (
                "EnginePolicyTaken"
                in [e.reason for e in events_of(core, other, "g") if e.type == "Warning"]
            ),
            30,
            "the tenant's policy said",
        )
        assert "EnginePolicyTaken" not in [e.reason for e in events_of(core, namespace, "g")]

        # The adapter itself: what it wrote is read back equal (one read, no write); opened by
        # someone, it is put back at the next check.
        clock = [0.0]
        kube = KubeAdapter(
            api_client,
            clock=lambda: clock[0],
            pod_policies=[operator_policy(documents, namespace)],
        )
        asyncio.run(kube.pod_policies_taken(namespace))
        again = networking.read_namespaced_network_policy(name, namespace)
        assert again.metadata.resource_version == made.metadata.resource_version
        networking.patch_namespaced_network_policy(
            name, namespace, {"spec": {"ingress": [{}], "podSelector": {}}}
        )
        clock[0] = SECRET_RECHECK_SECONDS
        assert asyncio.run(kube.pod_policies_taken(namespace)) == {}
        back = networking.read_namespaced_network_policy(name, namespace)
        assert api_client.sanitize_for_serialization(back.spec) == stored
    finally:
        for groups in (ours_there, theirs_there):
            with contextlib.suppress(client.ApiException):
                groups.delete("g")
        for groups in (ours_there, theirs_there):
            wait_for(lambda g=groups: absent(lambda: g.get("g")), 30, "the groups deleted")
        core.delete_namespace(other, propagation_policy="Background")


# ------------------------------------------------------------------ the connections made
@dataclass(frozen=True)
class Connection:
    """One connection a pod opened, as policies see it (a Service resolved to a backend)."""

    source: Pod
    source_uid: str
    destination: Endpoint
    port: int
    via: str  # the Service it went through, if any


@dataclass
class Recorder:
    """Who connected to whom, from the pods of one namespace: the sockets sampled by a process
    of their own (``tests/pod_sockets.py``), the pods' labels, ports and the Services listed here
    meanwhile. A connection's ends are resolved at the end (a new pod's first connections may
    come before its IP is listed), against every pod that held the address during the run."""

    core: client.CoreV1Api
    emulator: str
    namespace: str
    out: Path
    refresh_every: float = 0.5
    error: BaseException | None = None
    _pods: dict[str, Pod] = field(default_factory=dict)  # by UID
    _services: dict[tuple[str, int], Any] = field(default_factory=dict)  # (IP, port) -> Service
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _sampler: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._sampler = subprocess.Popen(
            [sys.executable, str(SAMPLER), self.emulator, self.namespace, str(self.out)]
        )
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop both; the number of socket samples taken (a failure is kept in ``error``, so
        that the test's own clean-up still runs)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sampler is not None:
            self._sampler.send_signal(signal.SIGTERM)
            try:
                code = self._sampler.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._sampler.kill()
                code = self._sampler.wait()
            if code != 0 and self.error is None:
                self.error = RuntimeError(f"the socket sampler exited with {code}")
        samples = self._records("samples")
        return int(samples[-1]) if samples else 0

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._refresh()
                self._stop.wait(self.refresh_every)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def _refresh(self) -> None:
        for item in self.core.list_namespaced_pod(self.namespace).items:
            ports = {
                port.name: (port.container_port, port.protocol or "TCP")
                for container in item.spec.containers
                for port in container.ports or []
                if port.name
            }
            labels = dict(item.metadata.labels or {})
            self._pods[item.metadata.uid] = Pod(
                self.namespace, item.metadata.name, labels, "", ports
            )
        self._services = {
            (svc.spec.cluster_ip, port.port): (svc, port)
            for svc in self.core.list_service_for_all_namespaces().items
            if svc.spec.cluster_ip and svc.spec.cluster_ip != "None"
            for port in svc.spec.ports or []
        }

    def _records(self, kind: str) -> list[Any]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        return [record[kind] for record in map(json.loads, lines) if kind in record]

    def connections(self) -> set[Connection]:
        """Every recorded connection with its ends resolved."""
        ips = dict(self._records("ip"))
        pods = {uid: replace(pod, ip=ips.get(uid, "")) for uid, pod in self._pods.items()}
        out: set[Connection] = set()
        for uid, ip, port in self._records("seen"):
            assert uid in pods, f"a connection from pod {uid}, which was never listed"
            out.update(
                Connection(pods[uid], uid, destination, target, via)
                for destination, target, via in self._destinations(ip, port, pods)
            )
        return out

    def _destinations(
        self, ip: str, port: int, pods: dict[str, Pod]
    ) -> list[tuple[Endpoint, int, str]]:
        """The pods behind an address: a Service's, at their target port (as policies see it
        after kube-proxy's DNAT), or those that held the IP; or the address alone (no pod)."""
        if (ip, port) in self._services:
            svc, service_port = self._services[(ip, port)]
            backends = [
                (Endpoint.of(pod), number)
                for pod in pods.values()
                if svc.metadata.namespace == self.namespace
                and svc.spec.selector
                and all(pod.labels.get(k) == v for k, v in svc.spec.selector.items())
                and (number := _target_port(service_port.target_port, pod)) is not None
            ]
            via = f"{svc.metadata.namespace}/{svc.metadata.name}"
            return [(b, n, via) for b, n in backends] or [(Endpoint(ip), port, via)]
        holders = [Endpoint.of(pod) for pod in pods.values() if pod.ip == ip]
        return [(h, port, "") for h in holders] or [(Endpoint(ip), port, "")]


def _target_port(target: int | str, pod: Pod) -> int | None:
    if isinstance(target, int) or target.isdigit():
        return int(target)
    named = pod.ports.get(target)
    return named[0] if named else None


def kind_of(pod: Pod | None) -> str:
    if pod is None:
        return "outside"
    return pod.labels.get(COMPONENT) or pod.labels.get(LABEL_ROLE) or "other"


@contextlib.contextmanager
def traffic(url: str) -> Iterator[list[tuple[float, int]]]:
    """Clients through the gateway's Service until the block ends: (time, status) per request
    (0: the connection failed), streamed and not, completions and chat."""
    outcomes: list[tuple[float, int]] = []
    stop = threading.Event()

    def client_loop(stream: bool) -> None:
        with httpx.Client(timeout=30, trust_env=False) as http:
            while not stop.is_set():
                body = {
                    "model": "general",
                    "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 4,
                    "stream": stream,
                }
                try:
                    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                        r.read()
                        outcomes.append((time.monotonic(), r.status_code))
                except httpx.HTTPError:
                    outcomes.append((time.monotonic(), 0))
                stop.wait(0.05)

    threads = [threading.Thread(target=client_loop, args=(s,), daemon=True) for s in (True, False)]
    for t in threads:
        t.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=35)


def test_every_connection_the_chart_makes_is_allowed_and_strangers_are_not(
    cluster: ClusterInfo,
    crds_installed: list[str],
    run_tool: Callable[..., Any],
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    tmp_path: Path,
) -> None:
    """helm install (with engines' egress restricted too) -> a 2P1D group Ready -> traffic
    through the gateway's Service -> decode scaled 1 -> 2 -> a prefill pod deleted and replaced
    -> traffic served again; meanwhile the recorder watches the pods' sockets. Then the chart
    rendered with the same values judges every recorded connection."""
    release = f"r{namespace[-6:]}"
    values = [
        *("--set", f"watchNamespaces={{{namespace}}}", "--set", "zookeeper.persistence=false"),
        *("--set", "gateway.service.port=8080", "--set", "operator.engine.timeScale=20"),
        *("--set", "networkPolicy.engineEgress.enabled=true"),
    ]
    core = client.CoreV1Api(api_client)
    run_tool("helm", "install", release, str(CHART), "-n", namespace, *values)
    recorder = Recorder(core, cluster.node_emulator, namespace, tmp_path / "sockets.jsonl")
    recorder.start()
    began = time.monotonic()
    try:
        for component in ("zookeeper", "operator", "gateway"):
            wait_for(
                lambda c=component: _ready_pod(core, namespace, c),
                timeout=60,
                what=f"the {component} pod Ready",
            )
        groups.create(pdgroup_body("g"))
        groups.wait_ready("g")
        gateway = core.read_namespaced_service(f"{release}-matrixserve-gateway", namespace)
        url = f"http://{gateway.spec.cluster_ip}:8080"
        # routing by ZooKeeper: its session is open (else it routes by the groups' status)
        wait_for(
            lambda: httpx.get(f"{url}/v1/routes", trust_env=False).json()["source"] == "zookeeper",
            timeout=30,
            what="the gateway on ZooKeeper",
        )
        with traffic(url) as outcomes:
            wait_for(
                lambda: _served(outcomes, 0) >= 4,
                timeout=30,
                what="traffic served",
                explain=lambda: f"statuses: {collections.Counter(s for _, s in outcomes)}",
            )
            groups.patch("g", {"decode": {"replicas": 2}})
            # The pod Ready (its engine serving: registered and linked), not only the group:
            # the group's status may not have seen the change yet.
            scaled = wait_for(lambda: _serving(groups, "g-d-1"), timeout=60, what="decode 1 -> 2")
            before = groups.pods("g")["g-p-0"].metadata.uid
            core.delete_namespaced_pod("g-p-0", namespace, grace_period_seconds=0)
            replaced = wait_for(
                lambda: _serving(groups, "g-p-0", other_than=before),
                timeout=60,
                what="the deleted prefill replaced and serving",
            )
            after = time.monotonic()
            wait_for(lambda: _served(outcomes, after) >= 4, timeout=30, what="traffic again")
    finally:
        samples = recorder.stop()
        recorded = time.monotonic() - began
        state = explain_namespace(cluster.state_dir, api_client, namespace)  # logs, if it fails
        with contextlib.suppress(client.ApiException):
            groups.delete("g")
        # the operator runs the group's finalizer before the chart takes it away
        wait_for(lambda: absent(lambda: groups.get("g")), what="the group deleted")
        run_tool("helm", "uninstall", release, "-n", namespace, "--wait", check=False)
    assert recorder.error is None, repr(recorder.error)
    connections = recorder.connections()

    rendered = policies(helm_template(release, namespace, *values))
    namespaces = {
        ns.metadata.name: dict(ns.metadata.labels or {}) for ns in core.list_namespace().items
    }
    judge = Cluster(rendered, namespaces, default_namespace=namespace)
    refused = {
        f"{c.source.name} -> {c.destination.pod.name if c.destination.pod else c.destination.ip}"
        f":{c.port} ({c.via or 'direct'}): {verdict.reason}"
        for c in connections
        if not (verdict := judge.allows(Endpoint.of(c.source), c.destination, c.port))
    }
    assert not refused, "\n".join(sorted(refused))
    seen = {(kind_of(c.source), kind_of(c.destination.pod)) for c in connections}
    print(  # the figures, with pytest -s
        f"\n{len(connections)} connections in {samples} samples over {recorded:.0f} s; edges "
        + ", ".join(
            f"{a}->{b}:{port}"
            for a, b, port in sorted(
                {(kind_of(c.source), kind_of(c.destination.pod), c.port) for c in connections}
            )
        )
    )
    assert seen >= EXPECTED_EDGES, (
        f"not seen: {EXPECTED_EDGES - seen}; seen: {sorted(seen)}\n{state}"
    )
    # The new pods were seen too: the scaled-out decode and the replacement prefill.
    sources = {c.source_uid for c in connections}
    assert scaled in sources, "the scaled-out decode's connections were not recorded"
    assert replaced in sources, "the replacement prefill's connections were not recorded"

    # Strangers: a pod with other labels, here and in another namespace, and a pod elsewhere
    # with the gateway's labels, reach neither an engine nor ZooKeeper.
    seen_pods = {c.source for c in connections} | {
        c.destination.pod for c in connections if c.destination.pod is not None
    }
    zookeeper = [p for p in seen_pods if kind_of(p) == "zookeeper"]
    engine_pods = [p for p in seen_pods if kind_of(p) in ("prefill", "decode")]
    gateway_labels = next(p for p in seen_pods if kind_of(p) == "gateway").labels
    strangers = [
        Pod(namespace, "stranger", {"app": "curl"}, "127.99.0.1"),
        Pod("default", "stranger", {"app": "curl"}, "127.99.0.2"),
        Pod("default", "impostor", dict(gateway_labels), "127.99.0.3"),
    ]
    for stranger in strangers:
        for target, port in [(p, ENGINE_PORT) for p in engine_pods] + [
            (p, ZOOKEEPER_PORT) for p in zookeeper
        ]:
            assert not judge.allows(Endpoint.of(stranger), Endpoint.of(target), port), (
                f"{stranger.namespace}/{stranger.name} may reach {target.name}:{port}"
            )


def _is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _ready_pod(core: client.CoreV1Api, namespace: str, component: str) -> bool:
    listed = core.list_namespaced_pod(namespace, label_selector=f"{COMPONENT}={component}").items
    return any(_is_ready(p) for p in listed)


def _serving(groups: Groups, name: str, other_than: str = "") -> str | None:
    """The UID of group g's pod ``name`` once it is Ready (and not ``other_than``), with the
    group Ready."""
    pod = groups.pods("g").get(name)
    if pod is None or pod.metadata.uid == other_than or not _is_ready(pod):
        return None
    return str(pod.metadata.uid) if groups.ready("g") else None


def _served(outcomes: list[tuple[float, int]], since: float) -> int:
    return sum(1 for t, status in list(outcomes) if t >= since and status == 200)
