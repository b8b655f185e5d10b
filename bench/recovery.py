"""Benchmark: recovery from one fault at a time under steady streamed traffic — our minimum-cost
planner against a whole-group restart, the LWS / RBG / Grove default (issue 17; P/D-Serve §3.4,
Fig. 8: "the faulty instance is logically removed ... and one new container is added").

Setup: a private dev cluster whose node emulator has eight 2-NPU servers (one instance fills a
server, so a server down takes exactly one instance and a faulty NPU leaves its server no room
for the replacement: it lands on one of the two spares), the operator, the gateway, and a PDGroup
of **exactly 4 prefill + 2 decode** llama3-8b instances of 2 NPUs (4 dies) each, engines at time
scale 1 (every engine step, the model load from the shared file service included, takes its
emulated time in wall time). Three clients stream 16-token completions through the gateway
back to back (``CLIENTS``: a load the host carries with room to spare, see there).

Each fault of issue 17 in turn (``die``, ``npu``, ``node``, ``link``, ``hang``, ``kill``; which
instance each hits: :data:`FAULTS`), once the group is whole again from the last (and the last
one's die, NPU, link or server healed). Two runs in one process: ``ours`` (``spec.recovery.policy:
MinimumCost``) and ``baseline`` (``RestartGroup``: the same detection, every pod of the group
deleted and recreated), each on a fresh group. Per fault and run:

- ``pods_restarted``: pods replaced (new UID) or restarted (more container restarts), from the
  node emulator before and after;
- ``restore_s``: wall seconds from the injection until the operator says the recovery
  ``Restored`` and the group is Ready with every desired instance serving in ZooKeeper (each
  reported, Serving and linked in its current incarnation, every prefill an entrance, every decode
  in the decode meta). At time scale 1 this is the sum of every step in its own clock:
  ``detect_s`` (fault → plan: control plane, wall) and the plan's terms (pod delete and start:
  control plane, wall; engine ready = register + link + load + first health: engine, emulated);
- ``failed_outside``: failed requests that were on neither the faulty instance nor (for a link)
  its far end (a 503 up front is a refusal, not a failure: nothing was served);
- ``capacity_lost_s``: ∫ (served tokens/s before the fault - served tokens/s) dt from the
  injection to the restore + 2 s, in seconds of the group's pre-fault output (served tokens from
  every stream's token times in 1 s bins, the rate before from the 10 s before the fault);
- the planner's prediction (``predicted_restore_s``, from the plan's terms) against the restore
  the operator measured from its own plan (``measured_restore_s``, ``prediction_error``: the
  issue's check is within 25 %), and the restore bound the issue states for a cold replacement
  from the restored instance's own steps, measured: ``restore_bound_s`` = detection + its pod's
  start (``pod_start_s``, the API's whole seconds) + its engine's time to serve
  (``engine_ready_s``, its ``readyAfter``: register, join, link, the model load, first health) +
  2 s; ``host_idle_before``: the host's idle share under the steady load before the fault.

Writes ``bench/results/recovery.json`` (flat keys; issue 17's contract: for each fault ``f``
``f_pods_restarted``, ``f_restore_s``, ``f_failed_outside``, ``f_capacity_lost_s`` and the
baseline's ``f_baseline_pods_restarted``, ``f_baseline_restore_s``, ``f_baseline_capacity_lost_s``)
and prints the table. A third run, ``warm`` (issue 18), keeps a WarmPool of ``WARM_PODS``
pods of the group's shape beside a fresh group and injects the single-instance faults of
:data:`WARM_FAULTS` (die, kill): the planner's replacement then claims a warm pod whose weights
come by NPU-fork from a live member; its keys are ``f_warm_<figure>`` (``die_warm_restore_s``,
``kill_warm_restore_s``, ...), with ``detect_to_serve_s`` for issue 18's target (detection ->
serving <= 7 s).
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

import httpx
import yaml
from common import (
    REPO,
    cluster_env,
    gateway_command,
    install_crds,
    make_namespace,
    run_bench,
    write_results,
)
from common import zookeeper as zk_client
from kubernetes import client, config

sys.path.insert(0, str(REPO))  # testkit, the kit shared with the tests
from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import LABEL_INSTANCE, PDGROUP, WARMPOOL
from matrixserve.devcluster.cluster import DevCluster, free_ports
from matrixserve.devcluster.procs import Supervisor
from matrixserve.domain.conditions import is_true
from testkit.chaoskit import CLIENTS as CHAOS_CLIENTS
from testkit.chaoskit import (
    GROUP,
    Request,
    Run,
    Subject,
    Traffic,
    capacity_lost,
    failed_outside,
    pod_runs,
    run_fault,
)
from testkit.helpers import poll

RESULTS = REPO / "bench" / "results" / "recovery.json"
SCALE = "1"  # engines' emulated seconds per wall second: the restore is the sum at scale 1
SERVERS, NPUS_PER_SERVER = 8, 2
N_P, N_D = 4, 2
PREFILLS = {f"{GROUP}-p-{i}" for i in range(N_P)}
DECODES = {f"{GROUP}-d-{i}" for i in range(N_D)}
# The steady load: the chaos tests' three streaming clients (BENCH_CLIENTS to change it). At
# this load the host keeps over half its CPU idle (54-56 % measured): the capacity the benchmark
# measures is the emulated group's, not this 2-core machine's (at six clients it kept 30-50 %,
# and every process starting or serving beside the others took from the survivors' output: ours
# lost 0.5-1.5 s and the ratio to the baseline moved between 6x and 26x from run to run).
CLIENTS, MAX_TOKENS = int(os.environ.get("BENCH_CLIENTS", str(CHAOS_CLIENTS))), 16
BEFORE_S = 10.0  # s of steady traffic before each fault: the pre-fault rate
AFTER_S = 2.0  # s past the restore counted in the capacity lost (the last bins settle)
BOUND_S = 180.0  # s a fault may take to restore before the run reports it as not restored
# (fault, the instance it hits, the far end of a link fault), in the order they run: both roles
FAULTS: list[tuple[str, str, str]] = [
    ("die", f"{GROUP}-d-1", ""),
    ("npu", f"{GROUP}-p-0", ""),
    ("node", f"{GROUP}-p-1", ""),
    ("link", f"{GROUP}-p-2", f"{GROUP}-d-0"),
    ("hang", f"{GROUP}-p-3", ""),
    ("kill", f"{GROUP}-d-0", ""),
]
# (run name, spec.recovery.policy): the JSON's key prefix is "" for ours, "baseline_" for the
# whole-group restart.
RUNS: list[tuple[str, str]] = [
    ("ours", "MinimumCost"),
    ("baseline", "RestartGroup"),
    ("warm", "MinimumCost"),  # issue 18: a WarmPool beside the group, single-instance faults
]
# The warm run's faults (issue 18: "a single-instance fault (die, kill) restored by warm claim +
# fork"), and its pool: WARM_PODS warm pods of the group's shape on the spare servers.
WARM_FAULTS = ("die", "kill")
WARM_PODS = 2
# BENCH_FAULTS=hang,kill: a subset (for looking into one; the JSON is then not written)
ONLY = [f for f in os.environ.get("BENCH_FAULTS", "").split(",") if f]
if ONLY:
    FAULTS = [f for f in FAULTS if f[0] in ONLY]


@dataclass
class Env:
    info: Any
    api: client.ApiClient
    namespace: str
    gateway: str
    control: str


def group_body(policy: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(
        (REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text()
    )
    body["metadata"] = {"name": GROUP}
    spec = body["spec"]
    spec["prefill"]["replicas"], spec["decode"]["replicas"] = N_P, N_D
    spec["slo"]["ttftMilliseconds"] = 60000  # refusals come from capacity, not from the SLO
    spec["recovery"] = {"policy": policy, "protect": "Decode"}
    return body


def host_cpu() -> tuple[int, int]:
    """The host's idle and total CPU ticks so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def host_idle_since(then: tuple[int, int]) -> float:
    """The host's idle share since ``then``: whether the steady load left the machine room
    (the capacity the bench measures is the emulated group's only while the host is not the
    bottleneck)."""
    idle, total = host_cpu()
    return round((idle - then[0]) / max(1, total - then[1]), 3)


def emulator_pods(control: str) -> list[dict[str, Any]]:
    with httpx.Client(base_url=control, timeout=10, trust_env=False) as http:
        pods: list[dict[str, Any]] = http.get("/pods").json()
        return pods


def excused(run: Run, request: Request) -> bool:
    """A failure on what the fault hit: the faulty instance, or both ends of a link."""
    hit = {run.injected.instance, *([run.injected.peer] if run.injected.peer else [])}
    return bool(request.on(hit))


def replacement_terms(env: Env, zk: Any, instance: str) -> dict[str, Any]:
    """The restored instance's own steps, measured: its pod's start (created -> its engine
    running, from the API's whole-second times; a restart in place: 0) and its engine's time to
    serve (``readyAfter``: process start -> Serving: register, join, link, load, first health)
    and the model load within it (the engine's setup-phase metric would say it too; the timing
    model's figure for its source is what it slept)."""
    # the instance's pod: its own name, or a claimed warm pod's (issue 18), by its label
    (pod,) = [
        p
        for p in client.CoreV1Api(env.api)
        .list_namespaced_pod(env.namespace, label_selector=f"{LABEL_INSTANCE}={instance}")
        .items
        if p.metadata.deletion_timestamp is None
    ]
    engine = next((c for c in pod.status.container_statuses or [] if c.name == "engine"), None)
    started = engine.state.running.started_at if engine and engine.state.running else None
    pod_start = 0.0
    if started is not None and engine is not None and not engine.restart_count:
        pod_start = max(0.0, (started - pod.metadata.creation_timestamp).total_seconds())
    raw, _ = zk.get(zl.GroupPaths(env.namespace, GROUP).health_of(instance))
    health = zl.Health.parse(raw)
    terms = {"pod_start_s": pod_start, "engine_ready_s": health.ready_after}
    if health.warm:  # a claimed warm pod: no pod started; how its weights came and how long
        terms |= {"pod_start_s": 0.0, "engine_phases_s": round(sum(health.phases.values()), 3)}
    return terms | {"warm": health.warm, "load_source": health.load_source}


def measure(run: Run, requests: list[Request], terms: dict[str, Any]) -> dict[str, Any]:
    """One fault's figures (see the module docstring); ``terms``: the restored instance's
    own steps, measured (:func:`replacement_terms`)."""
    at = run.injected.at
    last = run.recovery
    restore = run.restored_s
    until = at + (restore if restore is not None else BOUND_S) + AFTER_S
    lost, rate = capacity_lost(requests, at, until, BEFORE_S)
    failed = [r for r in failed_outside(requests, at, ()) if not excused(run, r)]
    out: dict[str, Any] = {
        "pods_restarted": len(run.restarted),
        "restore_s": round(restore, 2) if restore is not None else None,
        "failed_outside": len(failed),
        "capacity_lost_s": round(lost, 2),
        "tokens_per_s_before": round(rate, 1),
        "detect_s": round(run.detected_s, 2) if run.detected_s is not None else None,
        # issue 18's target for a warm replacement: from the detection to serving again
        "detect_to_serve_s": round(restore - run.detected_s, 2)
        if restore is not None and run.detected_s is not None
        else None,
        "refused_up_front": sum(1 for r in requests if r.refused_up_front and r.end >= at),
        "failed_on_faulty": sum(
            1 for r in requests if r.end >= at and not r.ok and excused(run, r)
        ),
    }
    if last is not None:
        measured = last.restored_after_s
        out |= {
            "action": last.action,
            "predicted_restore_s": last.predicted_s,
            "measured_restore_s": measured,
            "terms": dict(last.terms),
        }
        if measured and last.predicted_s:
            out["prediction_error"] = round(abs(measured - last.predicted_s) / last.predicted_s, 3)
        if run.detected_s is not None and terms:
            out |= {k: round(v, 2) if isinstance(v, float) else v for k, v in terms.items()}
            steps = terms["pod_start_s"] + terms["engine_ready_s"]
            out["restore_bound_s"] = round(run.detected_s + steps + 2.0, 2)
    if run.not_whole:
        out["not_whole"] = run.not_whole
    return out


def warm_pool(env: Env) -> None:
    """A WarmPool of the group's shape (2 NPUs), refilled at once, and wait for it to be warm."""
    custom = client.CustomObjectsApi(env.api)
    where = (WARMPOOL.group, WARMPOOL.version, env.namespace, WARMPOOL.plural)
    body = {
        "apiVersion": WARMPOOL.api_version,
        "kind": WARMPOOL.kind,
        "metadata": {"name": "wp"},
        "spec": {"shapes": [{"name": "two", "size": WARM_PODS, "devicesPerPod": NPUS_PER_SERVER}]},
    }
    custom.create_namespaced_custom_object(*where, body)

    def warm() -> bool:
        status = custom.get_namespaced_custom_object(*where, "wp").get("status") or {}
        return bool(status.get("ready") == WARM_PODS)

    poll(warm, 120, "the warm pool", every=0.5)


def run_policy(env: Env, name: str, policy: str, work: Path) -> dict[str, dict[str, Any]]:
    custom = client.CustomObjectsApi(env.api)
    where = (PDGROUP.group, PDGROUP.version, env.namespace, PDGROUP.plural)

    def status() -> dict[str, Any]:
        return dict(custom.get_namespaced_custom_object(*where, GROUP).get("status") or {})

    custom.create_namespaced_custom_object(*where, group_body(policy))
    poll(lambda: is_true(status(), "Ready"), 180, f"{name}: the group Ready", every=0.5)
    zk = zk_client(env.info)
    results: dict[str, dict[str, Any]] = {}
    try:
        subject = Subject(
            env.namespace,
            GROUP,
            env.control,
            zk,
            status,
            lambda: pod_runs(emulator_pods(env.control), env.namespace, live=True),
            PREFILLS,
            DECODES,
        )
        with Traffic(env.gateway, clients=CLIENTS, max_tokens=MAX_TOKENS) as traffic:
            if name == "warm":
                warm_pool(env)
            for kind, instance, peer in FAULTS:
                if name == "warm" and kind not in WARM_FAULTS:
                    continue
                cpu = host_cpu()
                time.sleep(BEFORE_S)
                idle = host_idle_since(cpu)
                run = run_fault(subject, kind, instance, peer, BOUND_S)
                time.sleep(AFTER_S)
                requests = [r for r in traffic.snapshot() if r.end >= run.injected.at - BEFORE_S]
                hit = run.recovery.plan_instances if run.recovery is not None else ()
                terms = (
                    replacement_terms(env, zk, instance if instance in hit else hit[0])
                    if run.restored_s is not None and hit
                    else {}
                )
                results[kind] = measure(run, requests, terms) | {"host_idle_before": idle}
                print(f"  {name} {kind}: {json.dumps(results[kind])}", flush=True)
                if os.environ.get("BENCH_TRACE"):
                    at = run.injected.at
                    bins = [0] * int(BEFORE_S + (run.restored_s or 0) + AFTER_S + 1)
                    for t in (t for r in requests for t in r.tokens):
                        if at - BEFORE_S <= t < at - BEFORE_S + len(bins):
                            bins[int(t - at + BEFORE_S)] += 1
                    print("    tokens/s from -10 s:", bins)
                    for r in requests:
                        print(
                            f"    {r.start - run.injected.at:+7.2f} {r.end - r.start:6.2f}s "
                            f"{r.outcome:<24} {r.prefill}/{r.decode} {len(r.tokens)} tokens"
                        )
                if run.restored_s is None:
                    print(f"  {name}: {kind} not restored; the remaining faults are skipped")
                    break
    finally:
        zk.stop()
        custom.delete_namespaced_custom_object(*where, GROUP)
        if name == "warm":
            custom.delete_namespaced_custom_object(
                WARMPOOL.group, WARMPOOL.version, env.namespace, WARMPOOL.plural, "wp"
            )
        core = client.CoreV1Api(env.api)
        poll(
            lambda: not core.list_namespaced_pod(env.namespace).items,
            120,
            f"{name}: the group's pods gone",
        )
    return results


def main(work: Path) -> int:
    dev = DevCluster(work / "cluster")
    info = dev.up(
        timeout=240,
        superpods=1,
        servers=SERVERS,
        emulator_flags=("--npus-per-server", str(NPUS_PER_SERVER)),
    )
    sup = Supervisor(work / "processes")
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            namespace = "bench-recovery"
            make_namespace(client.CoreV1Api(api), namespace)
            metrics, liveness, port = free_ports(3)
            sup.start(
                "operator",
                [
                    *(sys.executable, "-m", "matrixserve", "--zookeeper", info.zookeeper),
                    *("--namespace", namespace, "--no-webhook", "--engine-time-scale", SCALE),
                    "--engine-fault-injection",  # the hang is injected into the engine
                    *("--metrics-port", str(metrics), "--liveness-port", str(liveness)),
                    *("--log-level", "WARNING"),
                ],
                env=cluster_env(info),
            )
            sup.start(
                "gateway",
                gateway_command(info.zookeeper, namespace, port, "--time-scale", SCALE),
                env=cluster_env(info),
            )
            gateway = f"http://127.0.0.1:{port}"
            poll(lambda: _answers(f"{gateway}/healthz"), 30, "the gateway")
            env = Env(info, api, namespace, gateway, info.node_emulator)
            runs = {name: run_policy(env, name, policy, work) for name, policy in RUNS}
    finally:
        sup.stop("gateway", grace=5)
        sup.stop("operator", grace=10)
        dev.down()
    return report(runs)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def report(runs: dict[str, dict[str, dict[str, Any]]]) -> int:
    ours, base, warm = runs["ours"], runs["baseline"], runs.get("warm", {})
    results: dict[str, Any] = {
        "group": f"{N_P}P+{N_D}D llama3-8b, 2 NPUs per instance, one instance per server",
        "engine_time_scale": float(SCALE),
        "clients": CLIENTS,
    }
    for kind, *_ in FAULTS:
        for prefix, figures in (
            ("", ours.get(kind, {})),
            ("baseline_", base.get(kind, {})),
            ("warm_", warm.get(kind, {})),  # issue 18: die_warm_restore_s, kill_warm_restore_s
        ):
            for key, value in figures.items():
                flat = json.dumps(value) if isinstance(value, dict | list) else value
                results[f"{kind}_{prefix}{key}"] = flat
    errors = [ours[k]["prediction_error"] for k in ours if "prediction_error" in ours[k]]
    results["prediction_error_max"] = max(errors, default=None)
    results["prediction_error_median"] = statistics.median(errors) if errors else None
    print_table(ours, base)
    print_warm(ours, warm)
    write_results(RESULTS, results, f"BENCH_FAULTS={','.join(ONLY)}" if ONLY else "")
    if ONLY:
        return 0
    done = all(k in ours and k in base for k, *_ in FAULTS) and all(
        k in warm for k in WARM_FAULTS if k in {f for f, *_ in FAULTS}
    )
    return 0 if done else 1


def print_table(ours: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]]) -> None:
    def cell(figures: dict[str, Any], key: str, fmt: Callable[[Any], str] = str) -> str:
        value = figures.get(key)
        return "-" if value is None else fmt(value)

    print(
        f"\nrecovery under steady streamed traffic ({N_P}P+{N_D}D llama3-8b, engines at time scale "
        f"{SCALE}; seconds of wall time from the injection)"
    )
    print(
        f"{'fault':<6}{'plan':<16}{'pods':>5}{'restore':>9}{'bound':>7}{'pred':>7}{'err':>6}"
        f"{'failed':>7}{'lost':>7}   {'baseline: pods':>14}{'restore':>9}{'failed':>7}{'lost':>7}"
        f"{'lost x':>8}"
    )
    for kind, *_ in FAULTS:
        o, b = ours.get(kind, {}), base.get(kind, {})
        ratio = "-"
        if o.get("capacity_lost_s") is not None and b.get("capacity_lost_s") is not None:
            ratio = f"{b['capacity_lost_s'] / max(o['capacity_lost_s'], 0.01):.0f}"
        print(
            f"{kind:<6}{cell(o, 'action'):<16}{cell(o, 'pods_restarted'):>5}"
            f"{cell(o, 'restore_s'):>9}{cell(o, 'restore_bound_s'):>7}"
            f"{cell(o, 'predicted_restore_s'):>7}"
            f"{cell(o, 'prediction_error', lambda v: f'{v:.0%}'):>6}"
            f"{cell(o, 'failed_outside'):>7}{cell(o, 'capacity_lost_s'):>7}   "
            f"{cell(b, 'pods_restarted'):>14}{cell(b, 'restore_s'):>9}"
            f"{cell(b, 'failed_outside'):>7}{cell(b, 'capacity_lost_s'):>7}{ratio:>8}"
        )
    print(
        "pods: restarted; bound: detection + the restored instance's pod start + its engine's "
        "time to serve + 2 s, measured (issue 17's target for a cold replacement); pred/err: the planner's prediction and its error against the "
        "restore it measured; lost: capacity-seconds lost; lost x: the baseline's over ours"
    )


def print_warm(ours: dict[str, dict[str, Any]], warm: dict[str, dict[str, Any]]) -> None:
    """The single-instance faults restored from the warm pool beside the cold replacement."""
    if not warm:
        return
    print(
        "\nwarm replacement (issue 18): a WarmPool beside the group; seconds of wall time "
        f"(engines at time scale {SCALE}); target: detection -> serving <= 7 s"
    )
    print(
        f"{'fault':<6}{'cold: plan':<18}{'restore':>9}{'detect->serve':>15}   "
        f"{'warm: plan':<16}{'restore':>9}{'detect->serve':>15}{'load from':>14}{'lost':>7}"
    )
    for kind in WARM_FAULTS:
        o, w = ours.get(kind, {}), warm.get(kind, {})
        print(
            f"{kind:<6}{o.get('action', '-')!s:<18}{o.get('restore_s', '-')!s:>9}"
            f"{o.get('detect_to_serve_s', '-')!s:>15}   {w.get('action', '-')!s:<16}"
            f"{w.get('restore_s', '-')!s:>9}{w.get('detect_to_serve_s', '-')!s:>15}"
            f"{w.get('load_source', '-')!s:>14}{w.get('capacity_lost_s', '-')!s:>7}"
        )


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-recovery-"))
