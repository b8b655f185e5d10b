"""Benchmark: P/D ratio control (issue 19; P/D-Serve §2.1, §3.3 Eq. (1), §4.2 Fig. 13a).

Setup: a private dev cluster (one SuperPod of 4 servers of 8 NPUs), the operator, the gateway and
a WarmPool of 2 one-instance pods (new instances come by warm claim + NPU-fork); a PDGroup of
**8** Llama3-8B instances of 2 NPUs (prefill batch 8, decode batch 4), SLO TTFT 1 s, TPOT 50 ms
(emulated), engines at **time scale 0.25** (an emulated second lasts 4 wall seconds: the load
the best split serves stays within what this 2-core machine can drive and relay) with a health
report every emulated second (4 wall s; the policies' observations travel in them), loading
from local SSD with no TE-Pre-Load (a new instance starts in about a second: start-up is
bench-scale-out's subject). A closed
load of ``CLIENTS`` clients (``bench/load_player.py``, a process of its own: one request after
another per client, P/D-Serve §4.2's method) of one of three mixes:

- ``chat``: 1,500-token prompts, 64 tokens out (decode-heavy);
- ``summarize``: 8,000-token prompts, 16 tokens out (prefill-heavy);
- ``mixed``: half of each;
- ``bigbatch`` (issue 29): 5,000-token prompts, 48 tokens out, on decodes of batch **48** under
  ``BIGBATCH_CLIENTS`` clients: the decodes' TPOT rises with their batch (a 48-request step
  reads 48 prompts' KV), so the best split is the last before one fewer decode runs out of
  batch (by the stub's timing model 6:2, its decodes at about half a batch; at 7:1 the one
  decode is full and short) — a load whose TPOT at a split's own batch misled Model before
  issue 29.

**Φ** (goodput per instance, §2.1): requests that succeeded within both SLOs (TTFT and mean
TPOT, client-side, converted to emulated seconds) per emulated second, over the 8 instances.

Runs, one cluster:

1. **Sweep**: a ``Fixed`` group walked through every split of 8 (1:7 ... 7:1) under each mix;
   ``m_best_phi``, ``m_worst_phi`` and the splits.
2. **Model's own ratios**: ``Model`` from 4:4 under ``summarize`` and ``chat`` until it settles:
   each mix's start is the split Model settled at for *another* mix (chat and mixed start from
   summarize's, summarize from chat's) — a realistic mismatch, not an extreme.
3. **Convergence**: for each mix and each policy (``Model``, ``Feedback``), a fresh group at that
   start under load until the policy settles (no change for ``QUIET_S`` after arriving and no
   move being judged — Feedback's ``status.ratio.feedback.moving`` — at most ``CONVERGE_S``; the
   policy's reasons are printed as they change): ``m_start_phi`` (measured at the start,
   before the policy may act: a ``Fixed`` group), ``m_model_phi`` / ``m_feedback_phi``
   (measured at the settled split, the policy still on), ``m_model_steps`` /
   ``m_feedback_steps`` (changes of target),
   ``m_failed_during_changes`` (requests failed, not merely late, while the policies moved:
   both policies' runs).
4. **Shift**: ``Model`` settled on ``chat``, then the load switches to ``summarize``:
   ``shift_changes`` (target changes after the switch) and whether they went one way.

Writes ``bench/results/ratio.json`` and prints the table. ``BENCH_MIXES=chat`` runs a subset (the
JSON is then not written).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from kubernetes import client, config

sys.path.insert(0, str(REPO))  # testkit, the kit shared with the tests
from matrixserve.api import kinds
from matrixserve.devcluster.cluster import DevCluster, free_ports
from matrixserve.devcluster.procs import Supervisor
from matrixserve.domain.conditions import is_true
from testkit.helpers import poll

RESULTS = REPO / "bench" / "results" / "ratio.json"
SCALE = 0.25  # emulated seconds per wall second
HEALTH_INTERVAL = "1"  # emulated seconds between health reports (4 wall s)
TOTAL = 8
CLIENTS = int(os.environ.get("BENCH_CLIENTS", "40"))
# a decode batch of 48 is filled only by more requests in flight than 40 clients hold
BIGBATCH_CLIENTS = int(os.environ.get("BENCH_BIGBATCH_CLIENTS", "100"))
SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.05  # emulated
WARMUP_S, MEASURE_S = 8.0, 24.0  # wall
WINDOW_S, COOLDOWN_S = 16, 20  # the policies' (wall s)
# settled: no change for this long after arriving (the feedback rule's trend is 3 windows, after
# a window for its baseline)
QUIET_S = 5 * WINDOW_S + COOLDOWN_S
CONVERGE_S = float(os.environ.get("BENCH_CONVERGE_S", "1200"))
GROUP = "g"
# (the stub's calibrated costs put each mix's best split inside the range, not at an end:
# chat ~2:6, summarize ~6:2, mixed ~4:4 — so a mix's start, another mix's split, is a mismatch
# and not an extreme)
CHAT = {"weight": 1, "promptChars": 6000, "maxTokens": 64}  # 1,500 tokens in
SUMMARIZE = {"weight": 1, "promptChars": 32000, "maxTokens": 16}  # 8,000 tokens in
BIGBATCH = {"weight": 1, "promptChars": 20000, "maxTokens": 48}  # 5,000 tokens in
MIXES: dict[str, list[dict[str, Any]]] = {
    "chat": [CHAT],
    "summarize": [SUMMARIZE],
    "mixed": [CHAT, SUMMARIZE],
    "bigbatch": [BIGBATCH],
}


@dataclass(frozen=True)
class Shape:
    """The group and the load a mix runs on."""

    decode_batch: int = 4
    clients: int = CLIENTS


SHAPES = {"bigbatch": Shape(decode_batch=48, clients=BIGBATCH_CLIENTS)}


def shape_of(mix: str) -> Shape:
    return SHAPES.get(mix, Shape())


ONLY = [m for m in os.environ.get("BENCH_MIXES", "").split(",") if m]
# a quick look (the JSON is then not written): only these prefill counts swept, no policy run
SWEEP_ONLY = [int(p) for p in os.environ.get("BENCH_SWEEP_ONLY", "").split(",") if p]
# BENCH_RERUN=Feedback: that policy's convergence runs again from the starts the last full run
# recorded (bench/results/ratio.json), its keys replaced there (after a change to the policy)
RERUN = os.environ.get("BENCH_RERUN", "")
RUN_MIXES = [m for m in MIXES if not ONLY or m in ONLY]


@dataclass
class Env:
    info: Any
    api: client.ApiClient
    namespace: str
    gateway: str

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def where(self, kind: kinds.Kind = kinds.PDGROUP) -> tuple[str, str, str, str]:
        return (kind.group, kind.version, self.namespace, kind.plural)


# --------------------------------------------------------------------------- the group
def group_body(p: int, d: int, mode: str = "Fixed", shape: Shape = Shape()) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(
        (REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text()
    )
    body["metadata"] = {"name": GROUP}
    spec = body["spec"]
    spec["prefill"].update(replicas=p, batchSize=8)
    spec["decode"].update(replicas=d, batchSize=shape.decode_batch)
    spec["slo"] = {"ttftMilliseconds": int(SLO_TTFT_S * 1000), "tpotMilliseconds": 50}
    spec["ratioPolicy"] = {
        "mode": mode,
        "windowSeconds": WINDOW_S,
        "cooldownSeconds": COOLDOWN_S,
    }
    return body


def pool_body() -> dict[str, Any]:
    return {
        "apiVersion": kinds.API_VERSION,
        "kind": kinds.WARMPOOL.kind,
        "metadata": {"name": "wp"},
        "spec": {"shapes": [{"name": "two", "size": 2, "devicesPerPod": 2}]},
    }


def status(env: Env) -> dict[str, Any]:
    try:
        obj = env.custom.get_namespaced_custom_object(*env.where(), GROUP)
    except client.ApiException:
        return {}
    return dict(obj.get("status") or {})


def serving(env: Env, p: int, d: int) -> bool:
    s = status(env)
    return (
        is_true(s, "Ready")
        and (s.get("prefill") or {}).get("ready") == p
        and (s.get("decode") or {}).get("ready") == d
        and (s.get("ratio") or {}).get("current") == f"{p}:{d}"
    )


def create_group(env: Env, p: int, d: int, mode: str, shape: Shape = Shape()) -> None:
    env.custom.create_namespaced_custom_object(*env.where(), group_body(p, d, mode, shape))
    poll(lambda: serving(env, p, d), 600, f"the group serving {p}:{d}", every=1.0)


def delete_group(env: Env) -> None:
    env.custom.delete_namespaced_custom_object(*env.where(), GROUP)

    def gone() -> bool:
        pods = env.core.list_namespaced_pod(
            env.namespace, label_selector=f"{kinds.LABEL_GROUP}={GROUP}"
        ).items
        return not pods and not status(env)

    poll(gone, 300, "the group and its pods gone", every=1.0)


def set_split(env: Env, p: int, d: int) -> None:
    env.custom.patch_namespaced_custom_object(
        *env.where(), GROUP, {"spec": {"prefill": {"replicas": p}, "decode": {"replicas": d}}}
    )
    poll(lambda: serving(env, p, d), 600, f"the group serving {p}:{d}", every=1.0)


# --------------------------------------------------------------------------- the load
class Load:
    """The load player in the background: ``rows()`` so far (a JSON line per request)."""

    def __init__(
        self,
        env: Env,
        mixes: list[tuple[float, list[dict[str, Any]]]],
        seconds: float,
        clients: int = CLIENTS,
    ):
        order = {
            "gateway": env.gateway,
            "scenario": "general",
            "clients": clients,
            "seconds": seconds,
            "mixes": [[t, m] for t, m in mixes],
            "seed": 7,
            "timeout": 120,
        }
        self.out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ratio-load-{os.getpid()}.jsonl"
        self.handle = self.out.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "load_player.py")],
            stdin=subprocess.PIPE,
            stdout=self.handle,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order))
        self.proc.stdin.close()
        self.began = time.time()

    def rows(self) -> list[list[Any]]:
        if not self.handle.closed:
            self.handle.flush()
        rows = []
        for line in self.out.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return rows

    def stop(self) -> list[list[Any]]:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.handle.close()
        rows = self.rows()
        self.out.unlink(missing_ok=True)
        return rows


def good(row: list[Any]) -> bool:
    start, first, end, outcome, tokens = row[:5]
    if outcome != "ok" or first is None:
        return False
    ttft = (first - start) * SCALE
    tpot = (end - first) * SCALE / max(tokens - 1, 1)
    return bool(ttft <= SLO_TTFT_S and (tokens <= 1 or tpot <= SLO_TPOT_S))


def failed(row: list[Any]) -> bool:
    """Failed outright (an error, a cut stream), not merely late or refused as over-budget."""
    outcome = str(row[3])
    return outcome != "ok" and "ttft" not in outcome and "no_capacity" not in outcome


def phi(rows: list[list[Any]], lo: float, hi: float) -> float:
    """Goodput per instance: good requests ended in [lo, hi] per emulated second, over TOTAL."""
    n = sum(1 for r in rows if lo <= r[2] <= hi and good(r))
    return round(n / ((hi - lo) * SCALE) / TOTAL, 3)


def measure(env: Env, mix: str) -> dict[str, Any]:
    """Φ of the group as it is, under ``mix``: warm-up, then ``MEASURE_S``."""
    load = Load(env, [(0.0, MIXES[mix])], WARMUP_S + MEASURE_S + 5, shape_of(mix).clients)
    time.sleep(WARMUP_S + MEASURE_S)
    rows = load.stop()
    lo, hi = load.began + WARMUP_S, load.began + WARMUP_S + MEASURE_S
    during = [r for r in rows if lo <= r[2] <= hi]
    return {
        "phi": phi(rows, lo, hi),
        "requests": len(during),
        "failed": sum(1 for r in during if failed(r)),
        "good_fraction": round(sum(1 for r in during if good(r)) / max(len(during), 1), 3),
    }


# --------------------------------------------------------------------------- the runs
def sweep(env: Env, mix: str) -> dict[str, float]:
    """Φ of every split of TOTAL under ``mix`` (a Fixed group walked one split to the next)."""
    out = {}
    prefills = SWEEP_ONLY or list(range(1, TOTAL))
    create_group(env, prefills[0], TOTAL - prefills[0], "Fixed", shape_of(mix))
    try:
        for p in prefills:
            if p != prefills[0]:
                set_split(env, p, TOTAL - p)
            figures = measure(env, mix)
            out[f"{p}:{TOTAL - p}"] = figures["phi"]
            print(f"  sweep {mix} {p}:{TOTAL - p}: {json.dumps(figures)}", flush=True)
    finally:
        delete_group(env)
    return out


def converge(
    env: Env,
    mixes: list[tuple[float, list[dict[str, Any]]]],
    start: str,
    mode: str,
    shape: Shape = Shape(),
) -> dict[str, Any]:
    """A ``mode`` group from ``start`` under the load until the policy settles: its targets
    over time (wall, from the load's start), the failed requests, and Φ at the end."""
    p, d = (int(x) for x in start.split(":"))
    create_group(env, p, d, mode, shape)
    load = Load(env, mixes, CONVERGE_S + WARMUP_S + MEASURE_S + 60, shape.clients)
    targets: list[tuple[float, str]] = [(0.0, start)]
    settled_at = None
    said = ""
    try:
        deadline = time.time() + CONVERGE_S
        while time.time() < deadline:
            time.sleep(2.0)
            ratio = status(env).get("ratio") or {}
            target, current = str(ratio.get("target") or ""), str(ratio.get("current") or "")
            reason = str(ratio.get("reason") or "")
            if reason != said:
                said = reason
                print(f"    {time.time() - load.began:6.1f} s {current}: {reason}", flush=True)
            if target and target != targets[-1][1]:
                targets.append((round(time.time() - load.began, 1), target))
                settled_at = None
            # Feedback judges a move over windows after it: not settled while it does
            judging = bool((ratio.get("feedback") or {}).get("moving"))
            if current == targets[-1][1] and not judging:
                settled_at = settled_at or time.time()
                last_switch = max(t for t, _ in mixes)
                if (
                    time.time() - settled_at >= QUIET_S
                    and time.time() - load.began > last_switch + QUIET_S
                ):
                    break
            else:
                settled_at = None
        end = time.time()
        time.sleep(WARMUP_S + MEASURE_S)  # Φ at the settled split, the policy still on
        rows = load.stop()
    except BaseException:
        load.stop()
        raise
    finally:
        delete_group(env)
    moving = [r for r in rows if r[0] <= end]
    return {
        "targets": targets,
        "steps": len(targets) - 1,
        "settled": targets[-1][1],
        "converged": settled_at is not None,
        "failed": sum(1 for r in moving if failed(r)),
        "refused": sum(1 for r in moving if r[3] != "ok" and not failed(r)),
        "requests": len(moving),
        "phi": phi(rows, end + WARMUP_S, end + WARMUP_S + MEASURE_S),
    }


def main(work: Path) -> int:
    dev = DevCluster(work / "cluster")
    # every server's SSD holds the model: a new instance loads in 0.35 emulated s, and with no
    # TE-Pre-Load (start-up is bench-scale-out's subject, not this one's) a move takes seconds
    info = dev.up(timeout=300, superpods=1, servers=4, emulator_flags=("--ssd-models", "llama3-8b"))
    sup = Supervisor(work / "processes")
    namespace = "bench-ratio"
    metrics, liveness, port = free_ports(3)
    recorded: dict[str, Any] = {}
    if RERUN:
        recorded = {
            k: json.loads(v) if isinstance(v, str) and v[:1] in "[{" else v
            for k, v in json.loads(RESULTS.read_text()).items()
        }
    results: dict[str, Any] = {
        **recorded,
        "total_instances": TOTAL,
        "engine_time_scale": SCALE,
        "clients": CLIENTS,
        "bigbatch_clients": BIGBATCH_CLIENTS,
        "bigbatch_decode_batch": SHAPES["bigbatch"].decode_batch,
        "slo_ttft_s": SLO_TTFT_S,
        "slo_tpot_s": SLO_TPOT_S,
    }
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            make_namespace(client.CoreV1Api(api), namespace)
            sup.start(
                "operator",
                [
                    *(sys.executable, "-m", "matrixserve", "--zookeeper", info.zookeeper),
                    *("--namespace", namespace, "--no-webhook"),
                    *("--metrics-port", str(metrics), "--liveness-port", str(liveness)),
                    *("--engine-time-scale", str(SCALE)),
                    *("--engine-health-interval", HEALTH_INTERVAL),
                    *("--engine-pre-load-seconds", "0", "--engine-load-source", "SSD"),
                    *("--log-level", "WARNING"),
                ],
                env=cluster_env(info),
            )
            sup.start(
                "gateway",
                gateway_command(info.zookeeper, namespace, port, "--time-scale", str(SCALE)),
                env=cluster_env(info),
            )
            env = Env(info, api, namespace, f"http://127.0.0.1:{port}")
            env.custom.create_namespaced_custom_object(*env.where(kinds.WARMPOOL), pool_body())
            run(env, results)
    finally:
        sup.stop("gateway", grace=5)
        sup.stop("operator", grace=10)
        dev.down()
    return report(results)


def reversals(splits: list[str]) -> int:
    """Moves against the one before (A -> B -> A counts one), over a run's targets."""
    prefills = [int(s.split(":")[0]) for s in splits]
    ups = [b > a for a, b in itertools.pairwise(prefills) if b != a]
    return sum(1 for a, b in itertools.pairwise(ups) if a != b)


def policy_keys(mix: str, key: str, run_: dict[str, Any]) -> dict[str, Any]:
    """A policy's convergence run under ``mix`` as result keys (``m_model_phi``, ...)."""
    return {
        f"{mix}_{key}_phi": run_["phi"],
        f"{mix}_{key}_steps": run_["steps"],
        f"{mix}_{key}_moves": run_["steps"],
        f"{mix}_{key}_reversals": reversals([s for _, s in run_["targets"]]),
        f"{mix}_{key}_split": run_["settled"],
        f"{mix}_{key}_converged": run_["converged"],
        f"{mix}_{key}_targets": run_["targets"],
        f"{mix}_{key}_failed": run_["failed"],
    }


def rerun(env: Env, results: dict[str, Any], mode: str) -> None:
    """``mode``'s convergence runs again from the recorded starts (``BENCH_RERUN``)."""
    key = mode.lower()
    for mix in RUN_MIXES:
        if f"{mix}_start_split" not in results:
            print(f"  {mode} on {mix}: no recorded start (a full run first)", flush=True)
            continue
        start = str(results[f"{mix}_start_split"])
        run_ = converge(env, [(0.0, MIXES[mix])], start, mode, shape_of(mix))
        before = int(results.get(f"{mix}_{key}_failed", 0))
        failed = int(results[f"{mix}_failed_during_changes"]) - before + run_["failed"]
        results |= policy_keys(mix, key, run_) | {
            f"{mix}_failed_during_changes": failed,
            f"{mix}_{key}_rerun": True,
        }
        print(f"  {mode} on {mix} from {start} (rerun): {json.dumps(run_)}", flush=True)


def run(env: Env, results: dict[str, Any]) -> None:
    if SWEEP_ONLY:
        run_sweeps(env, results)
        return
    if RERUN:
        rerun(env, results, RERUN)
        return
    # the Model policy's own ratios, from 4:4: the mismatched starts
    own: dict[str, str] = {}
    for mix in ("summarize", "chat"):
        run_ = converge(env, [(0.0, MIXES[mix])], f"{TOTAL // 2}:{TOTAL // 2}", "Model")
        own[mix] = run_["settled"]
        results[f"model_own_{mix}"] = own[mix]
        print(f"  Model's own split for {mix}: {json.dumps(run_)}", flush=True)
    starts = {
        "chat": own["summarize"],
        "mixed": own["summarize"],
        "summarize": own["chat"],
        "bigbatch": own["chat"],
    }
    for mix in RUN_MIXES:
        start = starts[mix]
        p, d = (int(x) for x in start.split(":"))
        create_group(env, p, d, "Fixed", shape_of(mix))
        try:
            at_start = measure(env, mix)
        finally:
            delete_group(env)
        results[f"{mix}_start_split"] = start
        results[f"{mix}_start_phi"] = at_start["phi"]
        failed_total = refused_total = 0
        for mode in ("Model", "Feedback"):
            run_ = converge(env, [(0.0, MIXES[mix])], start, mode, shape_of(mix))
            key = mode.lower()
            results |= policy_keys(mix, key, run_)
            failed_total += run_["failed"]
            refused_total += run_["refused"]
            print(f"  {mode} on {mix} from {start}: {json.dumps(run_)}", flush=True)
        results[f"{mix}_failed_during_changes"] = failed_total
        # refused up front or over their TTFT budget (the gateway's early intervention): load
        # shed, not broken by a change; said apart
        results[f"{mix}_refused_during_changes"] = refused_total
    run_sweeps(env, results)
    # the shift: Model settled on chat, then summarize
    switch = 2 * QUIET_S  # chat's own split from the start: settled long before
    shift = converge(
        env, [(0.0, MIXES["chat"]), (switch, MIXES["summarize"])], own["chat"], "Model"
    )
    after = [(t, s) for t, s in shift["targets"] if t >= switch]
    prefills = [int(s.split(":")[0]) for _, s in [shift["targets"][0], *after]]
    steps = [b - a for a, b in itertools.pairwise(prefills)]
    results |= {
        "shift_changes": len(after),
        "shift_targets": shift["targets"],
        "shift_one_way": all(x > 0 for x in steps) or all(x < 0 for x in steps),
        "shift_failed": shift["failed"],
    }
    print(f"  shift chat -> summarize: {json.dumps(shift)}", flush=True)


def run_sweeps(env: Env, results: dict[str, Any]) -> None:
    """Every split of TOTAL under every mix: the best and the worst."""
    best: dict[str, str] = {}
    for mix in RUN_MIXES:
        phis = sweep(env, mix)
        best[mix] = max(phis, key=lambda k: phis[k])
        worst = min(phis, key=lambda k: phis[k])
        results |= {
            f"{mix}_sweep": phis,
            f"{mix}_best_phi": phis[best[mix]],
            f"{mix}_best_split": best[mix],
            f"{mix}_worst_phi": phis[worst],
            f"{mix}_worst_split": worst,
        }


def report(results: dict[str, Any]) -> int:
    print(
        f"\nP/D ratio control, {TOTAL} Llama3-8B instances, engines at time scale {SCALE}, "
        f"{CLIENTS} closed-loop clients (bigbatch: {BIGBATCH_CLIENTS}, decode batch "
        f"{SHAPES['bigbatch'].decode_batch}); Φ = requests within the SLOs (TTFT {SLO_TTFT_S} s, "
        f"TPOT {SLO_TPOT_S * 1000:.0f} ms) per emulated second per instance"
    )
    head = (
        f"{'mix':<11}{'best Φ':>12}{'worst Φ':>12}{'best/worst':>11}{'start Φ':>12}"
        f"{'Model Φ':>14}{'moves':>6}{'rev':>4}{'Feedback Φ':>16}{'moves':>6}{'rev':>4}"
        f"{'failed':>7}"
    )
    print(head)

    def cell(mix: str, key: str, split: str | None = None) -> str:
        value = results.get(f"{mix}_{key}")
        where = results.get(f"{mix}_{split}") if split else None
        return "-" if value is None else f"{value}" + (f" ({where})" if where else "")

    for mix in RUN_MIXES:
        r = results

        best, worst = r.get(f"{mix}_best_phi") or 0, r.get(f"{mix}_worst_phi") or 0
        ratio = f"{best / worst:.2f}x" if worst else "-"
        model, feedback = r.get(f"{mix}_model_phi"), r.get(f"{mix}_feedback_phi")
        of_best = (
            f" {model / best:.0%}/{feedback / best:.0%}" if best and model and feedback else ""
        )
        print(
            f"{mix:<11}{cell(mix, 'best_phi', 'best_split'):>12}{cell(mix, 'worst_phi', 'worst_split'):>12}"
            f"{ratio:>11}{cell(mix, 'start_phi', 'start_split'):>12}"
            f"{cell(mix, 'model_phi', 'model_split'):>14}{cell(mix, 'model_moves'):>6}"
            f"{cell(mix, 'model_reversals'):>4}"
            f"{cell(mix, 'feedback_phi', 'feedback_split'):>16}{cell(mix, 'feedback_moves'):>6}"
            f"{cell(mix, 'feedback_reversals'):>4}"
            f"{cell(mix, 'failed_during_changes'):>7}{of_best}"
        )
    print(
        f"shift chat -> summarize: {results.get('shift_changes')} changes, one way: "
        f"{results.get('shift_one_way')}, targets {results.get('shift_targets')}. Targets: each "
        "policy >= 95 % of the best Φ from the mismatched start, at most one reversal; best >= 1.6x worst on one mix "
        "(P/D-Serve Fig. 13a: the optimum 'at least 60 %' over the other ratios); no request "
        "failed by a change."
    )
    flat = {k: v for k, v in results.items() if not isinstance(v, dict | list)}
    flat |= {k: json.dumps(v) for k, v in results.items() if isinstance(v, dict | list)}
    subset = ",".join(
        x
        for x in (
            f"BENCH_MIXES={','.join(ONLY)}" * bool(ONLY),
            "BENCH_SWEEP_ONLY" * bool(SWEEP_ONLY),
        )
        if x
    )
    write_results(RESULTS, flat, subset)
    return 0


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-ratio-"))
