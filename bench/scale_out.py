"""Benchmark: scale a group out by 64 instances by each of DeepServe's paths, side by side in one
run (issue 18; DeepServe §6, Figs. 9-11: "scale up to 64 instances in parallel within seconds").

Setup: a private dev cluster whose node emulator has two SuperPods of ``SERVERS`` 8-NPU servers,
every server's local SSD holding the model (``--ssd-models``), the operator and the gateway; a
PDGroup of 1 prefill + 1 decode Llama3-8B instances of **one NPU** each (DeepServe's Fig. 11 runs
Llama3-8B at TP1 on a 910B die; a 910C NPU is two dies, so TP2 here), engines at time scale 1
(every engine phase takes its emulated time in wall time). Three clients stream completions
through the gateway throughout.

One run per path ``p`` (the operator restarted with ``--scale-out-paths Cold,<path>``, so the
planner may take only that path or a cold start, and takes the path, which its estimate puts
far ahead), each on a fresh group:

- ``cold``: no warm pod: 64 new pods, each through every phase (the shared file service's bucket
  shared by the 64 loaders: CloudMatrix-Infer Table 2's contention);
- ``warm_ssd``, ``warm_dram``, ``warm_shared``: a WarmPool of 64 one-NPU pods in the group's
  SuperPod, claimed and loading from local SSD, from host DRAM (the pool pre-loads the model
  there first: ``dramPreload``) — ``warm_shared`` is not a key of the issue and not run unless
  asked (``BENCH_PATHS``);
- ``fork_ub``, ``fork_roce``: the same pool in the group's SuperPod (UB) or the other one (RoCE),
  each new instance forking from one of the two live instances (32 targets each: Fig. 11's
  fan-out).

The group is scaled from 1 to 65 prefills in one patch; per run:

- ``p_wall_s``: wall seconds from the patch until the group is Ready with 65 prefills serving;
- ``p_emulated_s``: the slowest new instance's engine phases (TE-Pre-Load + TE-Load +
  TE-Post-Load, emulated seconds, from its health), the engines' share of the total;
- per phase: each engine phase's mean and max, the pods' start (Scaler-Pre, cold) and the rest of
  the wall total (claims, assignments, joining: control plane);
- for the fork runs, the fork sources under load: TTFT of the requests whose prefill was the
  source prefill and TPOT of those on the source decode, during the scale-out against the 10 s
  before (``source_tpot_change``, ``source_ttft_change``: fractions);
- ``p_fallbacks``: new instances whose weights did not come by the path's source.

Writes ``bench/results/scale_out.json`` (issue 18's keys: ``instances``, ``p_emulated_s`` and
``p_wall_s`` for ``cold``, ``warm_ssd``, ``warm_dram``, ``fork_ub``, ``fork_roce``, and
``source_tpot_change``) and prints the table. ``BENCH_PATHS=fork_ub,cold`` runs a subset (the
JSON is then not written); ``BENCH_INSTANCES`` changes the 64.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from common import REPO, cluster_env, gateway_command, install_crds, make_namespace, run_bench
from common import zookeeper as zk_client
from kubernetes import client, config

sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "cluster")]
from chaoskit import Request, Traffic  # noqa: E402

from enginestub import calibration as cal  # noqa: E402
from helpers import poll  # noqa: E402
from matrixserve.api import kinds  # noqa: E402
from matrixserve.api import zk_layout as zl  # noqa: E402
from matrixserve.devcluster.cluster import DevCluster, free_ports  # noqa: E402
from matrixserve.devcluster.procs import Supervisor  # noqa: E402
from matrixserve.domain.conditions import is_true  # noqa: E402

RESULTS = REPO / "bench" / "results" / "scale_out.json"
SCALE = "1"  # engines' emulated seconds per wall second: the totals are both clocks at once
INSTANCES = int(os.environ.get("BENCH_INSTANCES", "64"))
SERVERS, NPUS_PER_SERVER = (INSTANCES + 2 + 7) // 8 + 1, 8  # per SuperPod, one spare server
MODEL = "llama3-8b"
GROUP = "g"
CLIENTS, MAX_TOKENS = 3, 16
BEFORE_S = 10.0
BOUND_S = float(os.environ.get("BENCH_BOUND_S", "900"))  # the cold run's 64 shared loads: ~8 min
# (key, the operator's scale-out path, where the warm pool goes, what the new instances' health
# must say their weights came from)
PATHS: list[tuple[str, str, str | None, str]] = [
    ("cold", "Cold", None, "SharedFileService"),
    ("warm_ssd", "WarmSSD", "near", "SSD"),
    ("warm_dram", "WarmDRAM", "near", "HostDRAM"),
    ("fork_ub", "WarmForkUB", "near", "NPUForkUB"),
    ("fork_roce", "WarmForkRoCE", "far", "NPUForkRoCE"),
]
EXTRA = [("warm_shared", "WarmSharedFileService", "near", "SharedFileService")]
ONLY = [p for p in os.environ.get("BENCH_PATHS", "").split(",") if p]
if ONLY:
    PATHS = [p for p in PATHS + EXTRA if p[0] in ONLY]


@dataclass
class Env:
    info: Any
    api: client.ApiClient
    namespace: str
    gateway: str
    sup: Supervisor
    operator_args: list[str]

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)


def group_body() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(
        (REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text()
    )
    body["metadata"] = {"name": GROUP}
    spec = body["spec"]
    spec["model"] = {"name": MODEL}
    for role in ("prefill", "decode"):
        spec[role]["replicas"] = 1
        spec[role]["devicesPerInstance"] = 1
        spec[role].pop("parallelism", None)
    spec["slo"]["ttftMilliseconds"] = 60000  # refusals come from capacity, not from the SLO
    return body


def pool_body(superpod: str, dram: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "shapes": [
            {
                "name": "one",
                "size": INSTANCES,
                "devicesPerPod": 1,
                "nodeSelector": {kinds.LABEL_SUPERPOD: superpod},
            }
        ],
        "refillPolicy": "Manual",  # the claimed pods are not refilled while the run measures
    }
    if dram:
        spec["dramPreload"] = [{"model": MODEL}]
    return {
        "apiVersion": kinds.API_VERSION,
        "kind": kinds.WARMPOOL.kind,
        "metadata": {"name": "wp"},
        "spec": spec,
    }


def start_operator(env: Env, path: str) -> None:
    allowed = "Cold" if path == "Cold" else f"Cold,{path}"
    env.sup.stop("operator", grace=10)
    env.sup.start(
        "operator", [*env.operator_args, "--scale-out-paths", allowed], env=cluster_env(env.info)
    )


def group_status(env: Env) -> dict[str, Any]:
    where = (kinds.PDGROUP.group, kinds.PDGROUP.version, env.namespace, kinds.PDGROUP.plural)
    return dict(env.custom.get_namespaced_custom_object(*where, GROUP).get("status") or {})


def pool_status(env: Env) -> dict[str, Any]:
    obj = env.custom.get_namespaced_custom_object(
        kinds.WARMPOOL.group, kinds.WARMPOOL.version, env.namespace, kinds.WARMPOOL.plural, "wp"
    )
    return dict(obj.get("status") or {})


def superpod_of(env: Env, pod: str) -> str:
    node = env.core.read_namespaced_pod(pod, env.namespace).spec.node_name
    return str(env.core.read_node(node).metadata.labels[kinds.LABEL_SUPERPOD])


def superpods(env: Env) -> list[str]:
    return sorted({n.metadata.labels[kinds.LABEL_SUPERPOD] for n in env.core.list_node().items})


def healths(env: Env, zk: Any) -> dict[str, zl.Health]:
    paths = zl.GroupPaths(env.namespace, GROUP)
    out = {}
    for name in zk.get_children(paths.health):
        raw, _ = zk.get(paths.health_of(name))
        out[name] = zl.Health.parse(raw)
    return out


def tpot(request: Request) -> float | None:
    gaps = [b - a for a, b in zip(request.tokens, request.tokens[1:], strict=False)]
    return statistics.mean(gaps) if gaps else None


def change(before: list[float], during: list[float]) -> float | None:
    if not before or not during:
        return None
    return round(statistics.mean(during) / statistics.mean(before) - 1, 4)


def run_path(env: Env, key: str, path: str, where: str | None, source: str) -> dict[str, Any]:
    where_group = (kinds.PDGROUP.group, kinds.PDGROUP.version, env.namespace, kinds.PDGROUP.plural)
    start_operator(env, path)
    env.custom.create_namespaced_custom_object(*where_group, group_body())
    poll(lambda: is_true(group_status(env), "Ready"), 240, f"{key}: the group Ready", every=0.5)
    zk = zk_client(env.info)
    out: dict[str, Any] = {}
    try:
        if where is not None:
            home = superpod_of(env, f"{GROUP}-p-0")
            other = next(s for s in superpods(env) if s != home)
            env.custom.create_namespaced_custom_object(
                kinds.WARMPOOL.group,
                kinds.WARMPOOL.version,
                env.namespace,
                kinds.WARMPOOL.plural,
                pool_body(home if where == "near" else other, dram=path == "WarmDRAM"),
            )

            def warm() -> bool:
                status = pool_status(env)
                if status.get("ready") != INSTANCES:
                    return False
                if path != "WarmDRAM":
                    return True
                return all(MODEL in row.get("loaded", []) for row in status.get("dram") or [])

            poll(warm, 300, f"{key}: {INSTANCES} warm pods", every=1.0)
        with Traffic(env.gateway, clients=CLIENTS, max_tokens=MAX_TOKENS) as traffic:
            time.sleep(BEFORE_S)
            t0 = time.time()
            env.custom.patch_namespaced_custom_object(
                *where_group, GROUP, {"spec": {"prefill": {"replicas": 1 + INSTANCES}}}
            )

            def scaled() -> bool:
                status = group_status(env)
                return (status.get("prefill") or {}).get("ready") == 1 + INSTANCES and is_true(
                    status, "Ready"
                )

            poll(scaled, BOUND_S, f"{key}: {INSTANCES} new instances serving", every=0.25)
            t1 = time.time()
            requests = [r for r in traffic.snapshot() if r.ok and r.start >= t0 - BEFORE_S]
        new = {
            n: h
            for n, h in healths(env, zk).items()
            if n.startswith(f"{GROUP}-p-") and n != f"{GROUP}-p-0"
        }
        engine = [sum(h.phases.values()) for h in new.values()]
        out = {
            "instances": len(new),
            "wall_s": round(t1 - t0, 2),
            "emulated_s": round(max(engine), 2) if engine else None,
            "fallbacks": sum(1 for h in new.values() if h.load_source != source),
        }
        for phase in ("TEPreLoad", "TELoad", "TEPostLoad"):
            values = [h.phases.get(phase, 0.0) for h in new.values()]
            out[f"{phase}_mean_s"] = round(statistics.mean(values), 3) if values else None
            out[f"{phase}_max_s"] = round(max(values), 3) if values else None
        if out["emulated_s"] is not None:
            # at time scale 1 the engines' phases are wall time too: the rest is the control
            # plane's (Scaler-Pre's pod creation or claim, the assignment, Scaler-Post's joining)
            out["control_plane_s"] = round(out["wall_s"] - out["emulated_s"], 2)
        before = [r for r in requests if r.start < t0]
        during = [r for r in requests if t0 <= r.start <= t1]
        src_p, src_d = f"{GROUP}-p-0", f"{GROUP}-d-0"

        def ttft(rs: list[Request]) -> list[float]:
            return [r.first_token - r.start for r in rs if r.prefill == src_p and r.first_token]

        def tpots(rs: list[Request]) -> list[float]:
            return [t for r in rs if r.decode == src_d and (t := tpot(r)) is not None]

        out |= {
            "source_ttft_change": change(ttft(before), ttft(during)),
            "source_tpot_change": change(tpots(before), tpots(during)),
            "requests_during": len(during),
        }
        print(f"  {key}: {json.dumps(out)}", flush=True)
    finally:
        zk.stop()
        env.custom.delete_namespaced_custom_object(*where_group, GROUP)
        if where is not None:
            env.custom.delete_namespaced_custom_object(
                kinds.WARMPOOL.group,
                kinds.WARMPOOL.version,
                env.namespace,
                kinds.WARMPOOL.plural,
                "wp",
            )
        poll(
            lambda: not env.core.list_namespaced_pod(env.namespace).items,
            180,
            f"{key}: every pod gone",
            every=1.0,
        )
    return out


def main(work: Path) -> int:
    dev = DevCluster(work / "cluster")
    info = dev.up(
        timeout=300,
        superpods=2,
        servers=SERVERS,
        emulator_flags=("--npus-per-server", str(NPUS_PER_SERVER), "--ssd-models", MODEL),
    )
    sup = Supervisor(work / "processes")
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            namespace = "bench-scale-out"
            make_namespace(client.CoreV1Api(api), namespace)
            metrics, liveness, port = free_ports(3)
            operator = [
                *(sys.executable, "-m", "matrixserve", "--zookeeper", info.zookeeper),
                *("--namespace", namespace, "--no-webhook", "--engine-time-scale", SCALE),
                *("--metrics-port", str(metrics), "--liveness-port", str(liveness)),
                *("--log-level", "WARNING"),
            ]
            sup.start(
                "gateway",
                gateway_command(info.zookeeper, namespace, port, "--time-scale", SCALE),
                env=cluster_env(info),
            )
            gateway = f"http://127.0.0.1:{port}"
            env = Env(info, api, namespace, gateway, sup, operator)
            runs = {key: run_path(env, key, path, where, src) for key, path, where, src in PATHS}
    finally:
        sup.stop("gateway", grace=5)
        sup.stop("operator", grace=10)
        dev.down()
    return report(runs)


def report(runs: dict[str, dict[str, Any]]) -> int:
    results: dict[str, Any] = {
        "group": f"1P+1D {MODEL}, one NPU (two dies) per instance, scaled by {INSTANCES} prefills",
        "engine_time_scale": float(SCALE),
        "clients": CLIENTS,
        "instances": INSTANCES,
    }
    for key, figures in runs.items():  # e.g. fork_ub_emulated_s, fork_ub_wall_s (the issue's)
        for name, value in figures.items():
            results[f"{key}_{name}"] = value
    # DeepServe's own figure, a secondary source (alphaXiv's reading of Fig. 9), for the table
    results["deepserve_llama3_8b_cold_s"] = cal.DEEPSERVE_COLD_SCALE_SECONDS
    results["deepserve_llama3_8b_fork_s"] = cal.DEEPSERVE_FORK_SCALE_SECONDS
    for name in ("source_tpot_change", "source_ttft_change"):  # the larger of the two forks'
        seen = [
            float(v)
            for k in ("fork_ub", "fork_roce")
            if (v := runs.get(k, {}).get(name)) is not None
        ]
        results[name] = max(seen, key=abs) if seen else None
    if "cold" in runs and "fork_ub" in runs and runs["fork_ub"].get("wall_s"):
        results["fork_ub_speedup_over_cold"] = round(
            runs["cold"]["wall_s"] / runs["fork_ub"]["wall_s"], 1
        )
    print_table(runs)
    if ONLY:
        print(f"\nBENCH_PATHS={','.join(ONLY)}: {RESULTS} not written")
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")
    return 0 if all(runs[k].get("instances") == INSTANCES for k in runs) else 1


def print_table(runs: dict[str, dict[str, Any]]) -> None:
    def cell(figures: dict[str, Any], key: str, fmt: Callable[[Any], str] = str) -> str:
        value = figures.get(key)
        return "-" if value is None else fmt(value)

    print(
        f"\nscale-out by {INSTANCES} instances of {MODEL} (one NPU each), engines at time scale "
        f"{SCALE}: wall seconds from the patch to all serving; engine phases in emulated seconds"
    )
    print(
        f"{'path':<12}{'wall':>8}{'engine':>8}{'ctl':>7}{'pre-load':>10}{'load':>8}{'post':>7}"
        f"{'fallback':>9}{'src TTFT':>10}{'src TPOT':>10}{'vs cold':>9}"
    )
    cold = runs.get("cold", {}).get("wall_s")
    for key, figures in runs.items():
        pct: Callable[[Any], str] = lambda v: f"{v:+.1%}"  # noqa: E731
        speed = f"{cold / figures['wall_s']:.1f}x" if cold and figures.get("wall_s") else "-"
        print(
            f"{key:<12}{cell(figures, 'wall_s'):>8}{cell(figures, 'emulated_s'):>8}"
            f"{cell(figures, 'control_plane_s'):>7}{cell(figures, 'TEPreLoad_max_s'):>10}"
            f"{cell(figures, 'TELoad_max_s'):>8}{cell(figures, 'TEPostLoad_max_s'):>7}"
            f"{cell(figures, 'fallbacks'):>9}{cell(figures, 'source_ttft_change', pct):>10}"
            f"{cell(figures, 'source_tpot_change', pct):>10}{speed:>9}"
        )
    print(
        "engine: the slowest new instance's TE-Pre-Load + TE-Load + TE-Post-Load; ctl: the rest "
        "of the wall total (pod start or claim, assignment, joining); src: the fork sources' "
        "TTFT/TPOT during the scale-out against the 10 s before; vs cold: wall-time speed-up. "
        f"DeepServe (a secondary source: alphaXiv's reading of Fig. 9): Llama3-8B "
        f"{cal.DEEPSERVE_COLD_SCALE_SECONDS} s -> {cal.DEEPSERVE_FORK_SCALE_SECONDS} s"
    )


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-scale-out-"))
