"""The chart's bundled ZooKeeper as a 3-server ensemble (issue 31 item 1), on the dev cluster's
emulated servers: it forms a quorum (one leader, two followers, one server per server), serves
through its client Service what every server reads, and keeps serving writes through the
Service while the leader's server is down (the node emulator's ``node-down``), a client's
session and its ephemeral znode living through it, its disruption budget then refusing to evict
another server; back, that server rejoins as a follower with what was written meanwhile.

It runs on the dev cluster's own node emulator, the one with the Service proxy (a private
emulator's pods are not behind the cluster's Services), and takes one of its servers down for a
few seconds, healed whatever happens.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError
from kazoo.handlers.threading import KazooTimeoutError
from kubernetes import client

from matrixserve.devcluster.cluster import ClusterInfo
from testkit.chaoskit import emulator_fault
from testkit.helpers import wait_for, zookeeper

CHART = Path(__file__).resolve().parents[2] / "charts" / "matrixserve"
COMPONENT = "app.kubernetes.io/component"


def srvr_mode(ip: str) -> str | None:
    """The server's ``Mode`` (leader, follower, standalone) from the srvr four-letter word, or
    None while it does not serve (no quorum) or does not answer."""
    try:
        with socket.create_connection((ip, 2181), timeout=2) as sock:
            sock.sendall(b"srvr")
            sock.settimeout(2)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    except OSError:
        return None
    for line in answer.decode(errors="replace").splitlines():
        if line.startswith("Mode: "):
            return line.removeprefix("Mode: ").strip()
    return None


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _fewest_gateways() -> int:
    """The fewest gateways the chart's schema allows (this test needs none)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    replicas = schema["properties"]["gateway"]["properties"]["replicas"]
    return int(min(replicas["enum"]) if "enum" in replicas else replicas.get("minimum", 0))


def _wrote(zk: KazooClient, path: str) -> bool:
    """Whether a write through ``zk`` succeeds within 5 s (kazoo holds a request while its
    connection is lost; one that got through late makes the next find the znode there)."""
    try:
        zk.create_async(path, b"written", makepath=True).get(timeout=5)
    except NodeExistsError:
        return True
    except (KazooException, KazooTimeoutError):
        return False
    return True


def test_three_servers_form_a_quorum_and_serve_through_the_loss_of_the_leaders_server(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    run_tool: Callable[..., Any],
) -> None:
    release = f"r{namespace[-6:]}"
    full = f"{release}-matrixserve"
    core = client.CoreV1Api(api_client)
    began = time.monotonic()
    run_tool(
        "helm", "install", release, str(CHART), "-n", namespace,
        "--set", f"watchNamespaces={{{namespace}}}",
        "--set", "operator.replicas=0", "--set", f"gateway.replicas={_fewest_gateways()}",
        "--set", "operator.webhook.enabled=false",
        "--set", "zookeeper.replicas=3", "--set", "zookeeper.persistence=false",
    )  # fmt: skip
    down_node: str | None = None
    figures: dict[str, float] = {}
    try:

        def servers() -> list[Any]:
            listed = core.list_namespaced_pod(namespace, label_selector=f"{COMPONENT}=zookeeper")
            return sorted(listed.items, key=lambda p: p.metadata.name)

        def all_serving() -> list[Any] | None:
            pods = servers()
            return pods if len(pods) == 3 and all(_ready(p) for p in pods) else None

        pods = wait_for(all_serving, timeout=90, what="three ZooKeeper servers Ready (a quorum)")
        figures["quorum formed (s after helm install)"] = time.monotonic() - began
        assert len({p.spec.node_name for p in pods}) == 3, "one server per emulated server"
        policy = client.PolicyV1Api(api_client)

        def budget() -> tuple[int, int]:
            status = policy.read_namespaced_pod_disruption_budget(
                f"{full}-zookeeper", namespace
            ).status
            return (status.current_healthy or 0, status.disruptions_allowed or 0)

        wait_for(lambda: budget() == (3, 1), timeout=30, what="the budget: one server may go")
        modes = {p.metadata.name: srvr_mode(p.status.pod_ip) for p in pods}
        assert sorted(map(str, modes.values())) == ["follower", "follower", "leader"], modes

        # Written through the client Service, read from every server.
        service = core.read_namespaced_service(f"{full}-zookeeper", namespace).spec.cluster_ip
        with zookeeper(f"{service}:2181", auth="") as zk:
            zk.create("/ensemble/before", b"from the Service", makepath=True)
            zk.create("/ensemble/session", b"", ephemeral=True)
            session = zk.client_id
            for pod in pods:
                with zookeeper(f"{pod.status.pod_ip}:2181", auth="") as direct:
                    direct.sync("/ensemble/before")
                    assert direct.get("/ensemble/before")[0] == b"from the Service", pod

            # The leader's server down: the two others elect a leader and serve on.
            leader = next(p for p in pods if modes[p.metadata.name] == "leader")
            down_node = leader.spec.node_name
            emulator_fault(cluster.node_emulator, kind="node-down", node=down_node)
            lost = time.monotonic()
            wait_for(
                lambda: _wrote(zk, "/ensemble/during"),
                timeout=30,
                what="a write through the Service with the leader's server down",
            )
            figures["writes again after the leader's loss (s)"] = time.monotonic() - lost
            assert zk.client_id == session, "the session lived through the leader's loss"
            assert zk.exists("/ensemble/session") is not None, "and its ephemeral with it"
            survivors = [p for p in pods if p.metadata.name != leader.metadata.name]
            modes = {p.metadata.name: srvr_mode(p.status.pod_ip) for p in survivors}
            assert sorted(map(str, modes.values())) == ["follower", "leader"], modes
            # The budget keeps the quorum: no survivor may be evicted now.
            wait_for(lambda: budget() == (2, 0), timeout=30, what="the budget: none may go")
            eviction = client.V1Eviction(
                metadata=client.V1ObjectMeta(name=survivors[0].metadata.name, namespace=namespace)
            )
            with pytest.raises(client.ApiException) as refused:
                core.create_namespaced_pod_eviction(survivors[0].metadata.name, namespace, eviction)
            assert refused.value.status == 429, refused.value.body
            with zookeeper(f"{service}:2181", auth="") as fresh:  # a new client is served too
                fresh.create("/ensemble/new-client", b"")

            # Back: the server rejoins as a follower, with what was written meanwhile.
            emulator_fault(cluster.node_emulator, heal=True, kind="node-down", node=down_node)
            down_node = None
            back = time.monotonic()

            def rejoined() -> bool:
                pod = core.read_namespaced_pod(leader.metadata.name, namespace)
                return _ready(pod) and srvr_mode(pod.status.pod_ip) == "follower"

            wait_for(rejoined, timeout=60, what="the server back as a follower, Ready")
            figures["rejoined after its server is back (s)"] = time.monotonic() - back
            ip = core.read_namespaced_pod(leader.metadata.name, namespace).status.pod_ip
            with zookeeper(f"{ip}:2181", auth="") as direct:
                direct.sync("/ensemble/during")
                assert direct.get("/ensemble/during")[0] == b"written"
                assert direct.exists("/ensemble/new-client") is not None
        print("\n" + ", ".join(f"{what}: {value:.1f}" for what, value in figures.items()))
    finally:
        if down_node is not None:
            emulator_fault(cluster.node_emulator, heal=True, kind="node-down", node=down_node)
        run_tool("helm", "uninstall", release, "-n", namespace, "--wait", check=False)
