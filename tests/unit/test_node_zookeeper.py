"""The node emulator's ZooKeeper ensemble (issue 31): the ``zookeeper`` image's shim writes the
configuration the official image would, with every port on the pod's own IP, and the hosts
files give the servers' cluster DNS names as the cluster DNS would answer them."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from enginestub.node import hosts, podspec, zookeeper
from enginestub.node.events import Events
from enginestub.node.hosts import HostsFiles, NamedPod, named_pod, published, render
from enginestub.node.podlifecycle import PodLifecycle
from enginestub.node.state import EmulatorConfig, EmulatorState, PodRecord

HEADLESS = "r-matrixserve-zookeeper-headless"
SERVERS = " ".join(
    f"server.{i + 1}=r-matrixserve-zookeeper-{i}.{HEADLESS}.ms.svc.cluster.local:2888:3888;2181"
    for i in range(3)
)


# ----------------------------------------------------------------------------- the shim's config
def test_zoo_servers_are_read_as_the_image_reads_them() -> None:
    servers = zookeeper.parse_servers(f"  {SERVERS}\n")
    assert sorted(servers) == [1, 2, 3]
    assert servers[2] == f"r-matrixserve-zookeeper-1.{HEADLESS}.ms.svc.cluster.local:2888:3888;2181"
    assert zookeeper.parse_servers("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server.1=a:2888:3888 server.1=b:2888:3888", "names server.1 twice"),
        ("server.x=a:2888:3888", "is not server.<id>="),
        ("server.1=", "is not server.<id>="),
        ("a:2888:3888", "is not server.<id>="),
    ],
)
def test_a_malformed_zoo_servers_is_refused_with_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        zookeeper.parse_servers(text)


def test_the_ensemble_config_binds_this_server_on_its_pod_ip_and_names_its_peers() -> None:
    servers = zookeeper.parse_servers(SERVERS)
    lines = zookeeper.quorum_config(servers, 2, "127.64.0.7").splitlines()
    assert lines == [
        "quorumListenOnAllIPs=false",
        f"server.1={servers[1]}",
        "server.2=127.64.0.7:2888:3888",  # no ";2181": that would listen on every address
        f"server.3={servers[3]}",
    ]


def test_the_whole_zoo_cfg_listens_on_the_pod_ip_alone(tmp_path: Path) -> None:
    config = tmp_path / "zoo.cfg"
    extra = zookeeper.quorum_config(zookeeper.parse_servers(SERVERS), 1, "127.64.0.7")
    zookeeper.write_config(config, tmp_path / "data", 2181, "127.64.0.7", "ruok,srvr", extra)
    settings = dict(line.split("=", 1) for line in config.read_text().splitlines())
    assert settings["clientPortAddress"] == "127.64.0.7"
    assert settings["quorumListenOnAllIPs"] == "false"
    assert settings["server.1"] == "127.64.0.7:2888:3888"
    assert "0.0.0.0" not in config.read_text()


@pytest.mark.parametrize(
    ("entry", "bound"),
    [
        ("zk-0.h.ns.svc.cluster.local:2888:3888;2181", "127.64.0.7:2888:3888"),
        ("zk-0:2888:3888:observer;0.0.0.0:2181", "127.64.0.7:2888:3888:observer"),
        ("zk-0:2988:3988:participant", "127.64.0.7:2988:3988:participant"),
    ],
)
def test_this_servers_entry_keeps_its_ports_and_role(entry: str, bound: str) -> None:
    assert zookeeper.own_address(entry, "127.64.0.7") == bound


@pytest.mark.parametrize("entry", ["zk-0:2888", "zk-0:a:3888", ":2888:3888", "a:1:2|b:1:2"])
def test_an_entry_without_host_and_two_ports_is_refused(entry: str) -> None:
    with pytest.raises(ValueError, match=re.escape(entry)):
        zookeeper.own_address(entry, "127.64.0.7")


def test_a_server_missing_from_zoo_servers_is_refused_with_the_ids_listed() -> None:
    with pytest.raises(ValueError, match=r"id is 4, and ZOO_SERVERS lists only server.1, server.2"):
        zookeeper.quorum_config({1: "a:2888:3888", 2: "b:2888:3888"}, 4, "127.64.0.7")


@pytest.mark.parametrize(
    ("stored", "configured", "hostname", "myid"),
    [
        ("3\n", "1", "zk-0", 3),  # the data directory's myid wins (the chart's init container)
        (None, "2", "zk-0", 2),  # else ZOO_MY_ID
        ("", " 2 ", "zk-0", 2),
        (None, None, "r-matrixserve-zookeeper-2", 3),  # else the ordinal + 1
        (None, "", "r-matrixserve-zookeeper-0", 1),
        (None, None, "zookeeper", 1),  # else the entrypoint's default
    ],
)
def test_the_server_id_comes_as_the_chart_and_the_image_give_it(
    stored: str | None, configured: str | None, hostname: str, myid: int
) -> None:
    assert zookeeper.choose_myid(stored, configured, hostname) == myid


@pytest.mark.parametrize(("stored", "configured"), [("x", None), (None, "0"), ("256", None)])
def test_a_server_id_out_of_range_is_refused(stored: str | None, configured: str | None) -> None:
    with pytest.raises(ValueError, match="not a server id"):
        zookeeper.choose_myid(stored, configured, "zk-0")


def _run_main(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]
) -> tuple[int, list[str]]:
    """``main()`` in a pod directory with ``env``: its exit code and the argv it would exec
    (empty if it exits before)."""
    if shutil.which("java") is None or not any(Path("/usr/share/java").glob("zookeeper*.jar")):
        pytest.skip("needs a JRE and Debian's zookeeper package")
    for name in ("ZOO_SERVERS", "ZOO_MY_ID", "HOSTNAME", hosts.HOSTS_FILE_ENV, "POD_IP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    executed: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        executed.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    try:
        code = zookeeper.main()
    except SystemExit:
        code = 0
    return code, executed[0] if executed else []


def test_an_ensemble_member_starts_the_quorum_peer_with_the_emulators_hosts_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = {
        "ZOO_SERVERS": SERVERS,
        "HOSTNAME": "r-matrixserve-zookeeper-1",
        "MATRIXSERVE_POD_IP": "127.64.0.9",
        hosts.HOSTS_FILE_ENV: "/state/hosts/ms",
    }
    _, argv = _run_main(monkeypatch, tmp_path, env)
    assert argv[-2:] == [zookeeper.QUORUM_MAIN, str(tmp_path / "zoo.cfg")]
    assert "-Djdk.net.hosts.file=/state/hosts/ms" in argv
    assert f"-Djava.security.properties={tmp_path / 'java.security'}" in argv
    assert (tmp_path / "java.security").read_text() == zookeeper.ADDRESS_CACHE
    assert (tmp_path / "zookeeper-data" / "myid").read_text() == "2\n"
    assert "server.2=127.64.0.9:2888:3888\n" in (tmp_path / "zoo.cfg").read_text()
    # started again (a restart in the same pod), its myid file decides
    env["HOSTNAME"] = "renamed-0"
    _, again = _run_main(monkeypatch, tmp_path, env)
    assert again == argv


def test_one_server_stays_standalone_as_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = {"ZOO_SERVERS": "server.1=localhost:2888:3888;2181", "MATRIXSERVE_POD_IP": "127.64.0.9"}
    _, argv = _run_main(monkeypatch, tmp_path, env)
    assert argv[-2] == zookeeper.STANDALONE_MAIN
    assert not any(a.startswith("-Djdk.net.hosts.file") for a in argv)
    assert "server." not in (tmp_path / "zoo.cfg").read_text()
    assert not (tmp_path / "zookeeper-data" / "myid").exists()


def test_a_bad_ensemble_exits_2_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {
        "ZOO_SERVERS": "server.1=a:2888:3888 server.2=b:2888:3888",
        "HOSTNAME": "zk-5",
        "MATRIXSERVE_POD_IP": "127.64.0.9",
    }
    assert _run_main(monkeypatch, tmp_path, env) == (2, [])
    assert "this server's id is 6" in capsys.readouterr().err


# ----------------------------------------------------------------------------- hosts files
def pod(
    name: str,
    namespace: str = "ms",
    subdomain: str | None = HEADLESS,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"hostname": name}
    if subdomain:
        spec["subdomain"] = subdomain
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {"app": "zk"}},
        "spec": spec,
    }


def headless(
    namespace: str = "ms", publish_not_ready: bool = True, cluster_ip: str = "None"
) -> dict[tuple[str, str], dict[str, Any]]:
    spec = {
        "clusterIP": cluster_ip,
        "selector": {"app": "zk"},
        "publishNotReadyAddresses": publish_not_ready,
    }
    return {(namespace, HEADLESS): {"spec": spec}}


def test_only_a_pod_with_hostname_subdomain_and_ip_has_a_dns_name() -> None:
    assert named_pod(pod("zk-0"), "127.64.0.2", ready=False) is not None
    assert named_pod(pod("zk-0", subdomain=None), "127.64.0.2", ready=True) is None
    assert named_pod(pod("zk-0"), None, ready=True) is None
    assert podspec.pod_hostname(pod("zk-0")) == "zk-0"
    assert podspec.pod_hostname({"metadata": {"name": "x" * 62 + "-y"}}) == "x" * 62


def test_the_dns_answers_as_the_headless_service_publishes() -> None:
    ready = named_pod(pod("zk-0"), "127.64.0.2", ready=True)
    starting = named_pod(pod("zk-1"), "127.64.0.3", ready=False)
    stranger = named_pod(pod("zk-2", labels={"app": "other"}), "127.64.0.4", ready=True)
    elsewhere = named_pod(pod("zk-3", namespace="other"), "127.64.0.5", ready=True)
    pods = [p for p in (ready, starting, stranger, elsewhere) if p is not None]
    assert published(pods, headless()) == [ready, starting]  # not-ready addresses published
    assert published(pods, headless(publish_not_ready=False)) == [ready]
    assert published(pods, headless(cluster_ip="127.128.0.9")) == []  # not headless: no names
    assert published(pods, {}) == []  # no such Service
    assert published(pods, None) == pods  # Services unknown: every pod


def test_a_namespaces_hosts_file_holds_the_names_its_resolver_would_find() -> None:
    own = NamedPod("ms", "zk-0", "h", "127.64.0.2", (), True)
    other = NamedPod("other", "zk-0", "h", "127.64.0.3", (), True)
    lines = render([other, own], "ms").splitlines()
    assert "127.0.0.1 localhost" in lines
    assert "127.64.0.2 zk-0.h.ms.svc.cluster.local zk-0.h.ms.svc zk-0.h.ms zk-0.h" in lines
    # the short name is the search path's, from the pod's own namespace only
    assert "127.64.0.3 zk-0.h.other.svc.cluster.local zk-0.h.other.svc zk-0.h.other" in lines


def test_hosts_files_are_written_for_the_namespaces_asked_and_only_when_they_change(
    tmp_path: Path,
) -> None:
    files = HostsFiles(tmp_path)
    zk0 = NamedPod("ms", "zk-0", "h", "127.64.0.2", (), True)
    files.update([zk0], ["ms"])
    path = hosts.hosts_file(tmp_path, "ms")
    assert "127.64.0.2 zk-0.h.ms.svc.cluster.local" in path.read_text()
    assert not hosts.hosts_file(tmp_path, "other").exists()
    path.write_text("tampered")  # unchanged content is not written again
    files.update([zk0], ["ms"])
    assert path.read_text() == "tampered"
    moved = NamedPod("ms", "zk-0", "h", "127.64.0.9", (), True)  # a peer back with another IP
    files.update([moved], ["ms"])
    assert "127.64.0.9 zk-0.h.ms.svc.cluster.local" in path.read_text()
    assert "127.64.0.2" not in path.read_text()


async def test_the_emulator_names_its_own_pods_and_those_other_kubelets_run(
    tmp_path: Path,
) -> None:
    """Its own pods by the IP it gave them, before their containers start (here: before any
    status); another kubelet's by the IP its status shows, until it is deleted, and a relisting
    accounts for it (a deletion missed while the watch was broken is still seen)."""
    state = EmulatorState(EmulatorConfig(servers=[], state_dir=tmp_path), client.ApiClient())
    life = PodLifecycle(state, Events(state.core), proxy=None)
    own = pod("zk-0")
    state.pods["u0"] = PodRecord("u0", "ms", "zk-0", "here", own, ip="127.64.0.2")
    other = pod("zk-1")
    other["metadata"]["uid"] = "u1"
    other["spec"]["nodeName"] = "another-emulators-node"
    other["status"] = {
        "podIP": "127.65.0.2",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    await life._on_pod("ADDED", other)
    assert "u1" in dict(life._known())
    life.write_hosts()
    text = hosts.hosts_file(tmp_path, "ms").read_text()
    assert f"127.64.0.2 zk-0.{HEADLESS}.ms.svc.cluster.local" in text
    assert f"127.65.0.2 zk-1.{HEADLESS}.ms.svc.cluster.local" in text
    await life._on_pod("DELETED", other)
    life.write_hosts()
    assert "127.65.0.2" not in hosts.hosts_file(tmp_path, "ms").read_text()
    assert "u1" not in dict(life._known())
