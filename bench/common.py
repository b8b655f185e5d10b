"""Helpers shared by the benchmark scripts (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from kazoo.client import KazooClient
from kubernetes import client

from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.devcluster.namespaces import wait_for_service_account

REPO = Path(__file__).resolve().parents[1]

TICKS = os.sysconf("SC_CLK_TCK")


def cluster_env(info: ClusterInfo) -> dict[str, str]:
    """The environment of a process a benchmark starts against its own dev cluster: that
    cluster's kubeconfig and ZooKeeper identity, whatever the calling shell exported."""
    return {**os.environ, **info.env()}


def zookeeper(info: ClusterInfo) -> KazooClient:
    """A started ZooKeeper client of the benchmark's cluster, with MatrixServe's identity (its
    znodes are readable by that identity alone)."""
    auth = [("digest", info.zookeeper_auth)] if info.zookeeper_auth else None
    zk = KazooClient(hosts=info.zookeeper, auth_data=auth)
    zk.start()
    return zk


def run_bench(main: Callable[[Path], int], prefix: str) -> int:
    """Run a benchmark's ``main`` in a scratch directory of its own (its dev cluster's state and
    logs): removed after a run that succeeded, kept and named after one that failed."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    code = 1
    try:
        code = main(work)
    except SystemExit as exc:  # a failure the benchmark reported (kept), or --help (nothing to)
        code = 0 if exc.code in (None, 0) else 1
        raise
    finally:
        if code == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(
                f"the benchmark failed: its cluster's state and logs are in {work}", file=sys.stderr
            )
    return code


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic-GC pauses in the load generator while it times requests (they delayed its
    reads); one collection first."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def write_results(path: Path, results: Mapping[str, Any], subset: str = "") -> None:
    """Write a benchmark's flat results (``subset``: the environment variable that chose a
    part of its runs, e.g. ``BENCH_PATHS=fork_ub``: then nothing is written, and said so)."""
    if subset:
        print(f"\n{subset}: {path} not written")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def wait_http(url: str, timeout: float = 30) -> None:
    """Return once ``url`` answers 200; SystemExit if it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {timeout:.0f}s")


def gateway_command(zookeeper: str, namespace: str, port: int, *flags: str) -> list[str]:
    """``python -m matrixserve.gateway`` for one namespace's groups on 127.0.0.1:``port``; no
    drain on SIGTERM (behind no Service, nothing needs the time to look elsewhere)."""
    return [
        *(sys.executable, "-m", "matrixserve.gateway", "--zookeeper", zookeeper),
        *("--namespace", namespace, "--port", str(port), "--drain-seconds", "0", *flags),
    ]


def engine_command(host: str, cpu: int, *flags: str) -> list[str]:
    """A colocated Llama3-8B engine stub on ``host``:8000, pinned to one core."""
    return [
        *("taskset", "-c", str(cpu), sys.executable, "-m", "enginestub"),
        *("--role", "colocated", "--model", "llama3-8b", "--load-source", "NPUForkUB"),
        *("--host", host, "--port", "8000", *flags),
    ]


def install_crds(api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api)
    for path in sorted((REPO / "crds").glob("matrixserve.io_*.yaml")):
        try:
            ext.create_custom_resource_definition(yaml.safe_load(path.read_text()))
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    time.sleep(2)


def make_namespace(core: client.CoreV1Api, name: str) -> None:
    core.create_namespace({"metadata": {"name": name}})
    wait_for_service_account(core, name)
