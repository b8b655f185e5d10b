"""Benchmark: one node emulator process driving 20 emulated NPU servers and 200 pods.

Starts a private dev cluster and one emulator with 2 SuperPods x 10 servers, creates 200
sleep-like pods spread evenly over the 20 nodes, and measures:

- time from the first pod create to all 200 pods Running (scheduler + emulator + status writes);
- the emulator's own CPU (user+sys) during that ramp and over a steady-state window, and its
  resident memory; the pods' processes are not counted;
- time for all 200 pods to be deleted and their processes gone.

Baseline, measured in the same run: spawning and reaping the same 200 processes directly from
Python, with no Kubernetes at all (the floor under the emulator's work).

Writes ``bench/results/node-emulator.json`` (flat keys) and prints a side-by-side table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import (
    cluster_env,
    cpu_seconds,
    make_namespace,
    run_bench,
)
from kubernetes import client, config

from enginestub.node.command import node_names, run_argv
from matrixserve.devcluster.cluster import DevCluster
from matrixserve.devcluster.procs import Supervisor

RESULTS = Path(__file__).resolve().parent / "results" / "node-emulator.json"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def baseline_direct_spawn(count: int) -> float:
    started = time.monotonic()
    procs = [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait()
    return time.monotonic() - started


def main(work: Path) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    args = parser.parse_args()
    superpods, servers = 2, args.nodes // 2

    dev = DevCluster(work / "cluster")
    info = dev.up(timeout=240, superpods=1, servers=1)
    sup = Supervisor(work / "emulator")
    try:
        sup.start(
            "node-emulator",
            run_argv(
                work / "emulator" / "data",
                superpods=superpods,
                servers=servers,
                prefix="bench",
                extra=("--log-level", "WARNING"),
            ),
            env=cluster_env(info),
        )
        record = sup.record("node-emulator")
        assert record is not None
        pid = record.pid
        api = config.new_client_from_config(config_file=info.kubeconfig)
        core = client.CoreV1Api(api)
        names = node_names(superpods, servers, prefix="bench")
        deadline = time.monotonic() + 60
        while True:
            ready = sum(
                1
                for n in core.list_node().items
                if n.metadata.name in names
                and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
            )
            if ready == len(names):
                break
            if time.monotonic() > deadline or sup.exited("node-emulator"):
                raise SystemExit(
                    "emulated nodes did not come up; see " + str(sup.log_path("node-emulator"))
                )
            time.sleep(0.2)
        make_namespace(core, "bench")

        def pod(i: int) -> dict[str, object]:
            return {
                "metadata": {"name": f"sleeper-{i:03d}"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": names[i % len(names)]},
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {"name": "main", "image": "busybox", "command": ["sleep", "3600"]}
                    ],
                },
            }

        cpu0 = cpu_seconds(pid)
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: core.create_namespaced_pod("bench", pod(i)), range(args.pods)))
        while True:
            running = sum(
                1 for p in core.list_namespaced_pod("bench").items if p.status.phase == "Running"
            )
            if running == args.pods:
                break
            if time.monotonic() - started > 300:
                raise SystemExit(f"only {running}/{args.pods} pods Running after 300 s")
            time.sleep(0.25)
        ramp = time.monotonic() - started
        ramp_cpu = cpu_seconds(pid) - cpu0

        cpu1, t1 = cpu_seconds(pid), time.monotonic()
        time.sleep(args.steady_seconds)
        steady_cpu_pct = 100 * (cpu_seconds(pid) - cpu1) / (time.monotonic() - t1)
        rss = rss_mib(pid)

        deleted_at = time.monotonic()
        core.delete_collection_namespaced_pod("bench")
        while core.list_namespaced_pod("bench").items:
            if time.monotonic() - deleted_at > 120:
                raise SystemExit("pods not deleted within 120 s")
            time.sleep(0.25)
        delete_time = time.monotonic() - deleted_at
        baseline = baseline_direct_spawn(args.pods)
    finally:
        sup.stop("node-emulator", grace=30)
        dev.down()

    results = {
        "nodes": len(names),
        "pods": args.pods,
        "all_running_seconds": round(ramp, 2),
        "ramp_emulator_cpu_seconds": round(ramp_cpu, 2),
        "steady_emulator_cpu_percent": round(steady_cpu_pct, 2),
        "emulator_rss_mib": round(rss, 1),
        "delete_all_seconds": round(delete_time, 2),
        "baseline_direct_spawn_seconds": round(baseline, 3),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        ("pods Running (s)", f"{ramp:.2f}", f"{baseline:.3f} (spawn+reap only)"),
        ("emulator CPU during ramp (s)", f"{ramp_cpu:.2f}", "-"),
        ("emulator CPU steady (%)", f"{steady_cpu_pct:.2f}", "-"),
        ("emulator RSS (MiB)", f"{rss:.1f}", "-"),
        ("all deleted (s)", f"{delete_time:.2f}", "-"),
    ]
    print(f"\nnode emulator: {len(names)} nodes, {args.pods} pods (one emulator process)")
    print(f"{'metric':<32}{'emulator':>12}   {'baseline: direct spawn':<28}")
    for name, ours, base in rows:
        print(f"{name:<32}{ours:>12}   {base:<28}")
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-node-emulator-"))
