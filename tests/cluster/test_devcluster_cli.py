"""The dev cluster's script interface and lifecycle: env/status for scripts, idempotent up,
and a down that leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrixserve.devcluster.cluster import COMPONENTS, ClusterInfo, DevCluster
from matrixserve.devcluster.procs import process_start_time


def devcluster_cli(state_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "matrixserve.devcluster", "--state-dir", state_dir, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_env_prints_exports_that_reach_the_running_cluster(cluster: ClusterInfo) -> None:
    result = devcluster_cli(cluster.state_dir, "env")
    assert result.returncode == 0, result.stderr
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in result.stdout.strip().splitlines()
    )
    assert exports["KUBECONFIG"] == cluster.kubeconfig
    assert exports["MATRIXSERVE_ZK"] == cluster.zookeeper
    # A script that evals the exports can use kubectl straight away.
    shell = subprocess.run(
        [
            "bash",
            "-c",
            f'eval "{result.stdout}" && '
            f'"{Path(sys.executable).parent}/kubectl" get ns default -o name',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
    )
    assert shell.stdout.strip() == "namespace/default", shell.stderr


def test_status_json_lists_every_component_running(cluster: ClusterInfo) -> None:
    result = devcluster_cli(cluster.state_dir, "status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["running"] is True
    assert [c["name"] for c in report["components"]] == list(COMPONENTS)
    assert all(c["alive"] and c["pid"] for c in report["components"])


def test_up_is_idempotent_and_down_leaves_no_process(cluster: ClusterInfo, tmp_path: Path) -> None:
    # A second, private cluster beside the session one: its own ports and state.
    dev = DevCluster(tmp_path / "second")
    first = dev.up(timeout=180)
    try:
        assert first.ports.apiserver != cluster.ports.apiserver
        records = {r.name: r for r in dev.supervisor.records()}
        assert set(records) == set(COMPONENTS)
        # Its emulated nodes never share a pod /24 with the session cluster's (machine-wide locks).
        assert set(_pod_cidrs(first)).isdisjoint(_pod_cidrs(cluster))
        assert len(_pod_cidrs(first)) == 4
        again = dev.up(timeout=60)
        assert again == first, "up on a running cluster must not restart it"
        assert {r.name: r.pid for r in dev.supervisor.records()} == {
            n: r.pid for n, r in records.items()
        }
    finally:
        result = devcluster_cli(str(tmp_path / "second"), "down")
    assert result.returncode == 0, result.stderr
    for record in records.values():
        assert process_start_time(record.pid) != record.start_time, f"{record.name} survived down"
    assert dev.supervisor.records() == []
    # The session cluster is untouched.
    assert DevCluster(Path(cluster.state_dir)).is_running()


def _pod_cidrs(info: ClusterInfo) -> list[str]:
    from kubernetes import client, config

    with config.new_client_from_config(config_file=info.kubeconfig) as api:
        return [n.spec.pod_cidr for n in client.CoreV1Api(api).list_node().items if n.spec.pod_cidr]


def test_env_without_a_cluster_exits_3_with_a_clear_message(tmp_path: Path) -> None:
    result = devcluster_cli(str(tmp_path / "nothing"), "env")
    assert result.returncode == 3
    assert "no running cluster" in result.stderr
    assert "make cluster-up" in result.stderr


@pytest.mark.parametrize("command", ["status", "down"])
def test_status_and_down_are_safe_without_a_cluster(tmp_path: Path, command: str) -> None:
    result = devcluster_cli(str(tmp_path / "nothing"), command)
    assert result.returncode == (3 if command == "status" else 0), result.stderr
