"""Benchmark: PDGroup apply -> Ready for a 4P+4D group, and the operator's own overhead.

A private dev cluster (node emulator, ZooKeeper) and the operator (no webhook); a 4P+4D group
of llama3-8b, 2 NPUs (4 dies) per instance, engine time scale 50. Timed from the apply:
pods created, every instance reported its RoCE IPs, RoCE map written, all 4x4x4 sub-links
verified, every instance healthy, Ready. The emulated model load (shared file service, from
the timing model) is subtracted from apply -> Ready. The operator's *own* share is the time the
group waits on the operator: apply -> pods created, all reported -> map written, all healthy ->
Ready. Then the operator's CPU per group over a steady 30 s.

Ours: event-driven reconciling (ZooKeeper watches and pod events wake the group). Baseline,
same run: the same operator as a plain polling controller (no watches, re-plans every 5 s).

Writes ``bench/results/operator-setup.json`` and prints the table.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from kazoo.client import KazooClient
from kubernetes import client, config

from enginestub import timing
from enginestub.models import LLAMA3_8B
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import DevCluster, free_ports
from matrixserve.devcluster.procs import Supervisor

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "operator-setup.json"
SCALE = 50.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def install_crds(api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api)
    for path in sorted((REPO / "crds").glob("matrixserve.io_*.yaml")):
        try:
            ext.create_custom_resource_definition(yaml.safe_load(path.read_text()))
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    time.sleep(2)


def namespace(core: client.CoreV1Api, name: str) -> None:
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if core.read_namespaced_service_account("default", name).secrets:
                return
        except client.ApiException:
            pass
        time.sleep(0.1)
    raise SystemExit(f"namespace {name} got no service-account token")


def run_variant(
    label: str, extra: list[str], info: Any, api: client.ApiClient, work: Path
) -> dict[str, float]:
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    ns = f"bench-{label}"
    namespace(core, ns)
    sup = Supervisor(work / label)
    metrics_port, liveness_port = free_ports(2)
    sup.start(
        "operator",
        [
            sys.executable,
            "-m",
            "matrixserve",
            "--zookeeper",
            info.zookeeper,
            "--namespace",
            ns,
            "--no-webhook",
            "--engine-time-scale",
            str(SCALE),
            "--metrics-port",
            str(metrics_port),
            "--liveness-port",
            str(liveness_port),
            "--log-level",
            "WARNING",
            *extra,
        ],
        env={**os.environ, "KUBECONFIG": info.kubeconfig},
    )
    time.sleep(3)  # operator start-up
    record = sup.record("operator")
    assert record is not None
    zk = KazooClient(hosts=info.zookeeper)
    zk.start()
    paths = zl.GroupPaths(ns, "bench")
    body = yaml.safe_load((REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text())
    body["metadata"] = {"name": "bench"}
    body["spec"]["prefill"]["replicas"] = 4
    body["spec"]["decode"]["replicas"] = 4
    marks: dict[str, float] = {}

    def children(path: str) -> int:
        return len(zk.get_children(path)) if zk.exists(path) else 0

    try:
        cpu0 = cpu_seconds(record.pid)
        t0 = time.monotonic()
        custom.create_namespaced_custom_object("matrixserve.io", "v1alpha1", ns, "pdgroups", body)
        while "ready" not in marks:
            now = time.monotonic() - t0
            if now > 120:
                raise SystemExit(f"{label}: not Ready within 120 s; marks {marks}")
            pods = core.list_namespaced_pod(ns, label_selector="matrixserve.io/group=bench").items
            if len(pods) == 8:
                marks.setdefault("pods_created", now)
            if children(paths.reports) == 8:
                marks.setdefault("reported", now)
            if zk.exists(paths.roce_map):
                marks.setdefault("mapped", now)
            if (
                sum(
                    len(zl.Link.parse(zk.get(f"{paths.links}/{c}")[0]).sub_links)
                    for c in zk.get_children(paths.links)
                )
                == 64
                if zk.exists(paths.links)
                else False
            ):
                marks.setdefault("linked", now)
            if children(paths.health) == 8:
                marks.setdefault("healthy", now)
            status = (
                custom.get_namespaced_custom_object(
                    "matrixserve.io", "v1alpha1", ns, "pdgroups", "bench"
                ).get("status")
                or {}
            )
            if any(
                c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
            ):
                marks["ready"] = now
            time.sleep(0.02)
        setup_cpu = cpu_seconds(record.pid) - cpu0
        cpu1 = cpu_seconds(record.pid)
        time.sleep(30)
        steady_cpu_per_min = (cpu_seconds(record.pid) - cpu1) * 2
        custom.delete_namespaced_custom_object(
            "matrixserve.io", "v1alpha1", ns, "pdgroups", "bench"
        )
        time.sleep(2)
    finally:
        zk.stop()
        sup.stop("operator", grace=10)
    load_wall = (
        timing.load_seconds(
            LLAMA3_8B, timing.InstanceShape(dies=4, tp=4), timing.LoadSource.SHARED_FILE_SERVICE
        )
        / SCALE
    )
    operator_own = (
        marks["pods_created"]
        + (marks["mapped"] - marks["reported"])
        + (marks["ready"] - marks["healthy"])
    )
    return {
        **{f"{k}_s": round(v, 3) for k, v in marks.items()},
        "model_load_wall_s": round(load_wall, 3),
        "ready_minus_load_s": round(marks["ready"] - load_wall, 3),
        "operator_own_s": round(operator_own, 3),
        "setup_cpu_s": round(setup_cpu, 3),
        "steady_cpu_s_per_group_per_min": round(steady_cpu_per_min, 4),
    }


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    dev = DevCluster(work / "cluster")
    info = dev.up(timeout=240, superpods=1, servers=4)
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            ours = run_variant("ours", [], info, api, work)
            base = run_variant(
                "baseline", ["--no-zk-watches", "--resync-seconds", "5"], info, api, work
            )
    finally:
        dev.down()
    results = {"group": "4P+4D", "target_overhead_s": 2.0}
    results |= {f"ours_{k}": v for k, v in ours.items()} | {
        f"baseline_{k}": v for k, v in base.items()
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        ("pods created", "pods_created_s"),
        ("all reported RoCE IPs", "reported_s"),
        ("RoCE map + init order", "mapped_s"),
        ("64 sub-links verified", "linked_s"),
        ("all healthy", "healthy_s"),
        ("Ready", "ready_s"),
        ("emulated model load (wall)", "model_load_wall_s"),
        ("Ready minus model load", "ready_minus_load_s"),
        ("operator's own share", "operator_own_s"),
        ("operator CPU during setup (s)", "setup_cpu_s"),
        ("operator CPU per group per min (s)", "steady_cpu_s_per_group_per_min"),
    ]
    print("\nPDGroup 4P+4D apply -> Ready (seconds after the apply, wall clock)")
    print(f"{'':38}{'ours (event-driven)':>22}{'baseline (polling 5 s)':>24}")
    for label, key in rows:
        print(f"{label:38}{ours[key]:>22.3f}{base[key]:>24.3f}")
    print(f"\ntarget: Ready minus model load <= 2 s; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
