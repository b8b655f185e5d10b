"""Benchmark: TTFT-SLO attainment under load A, 2A, 3A, 4A — on-demand forwarding (ours) against
round-robin and least-loaded-by-queue-reports, on the same group and trace (P/D-Serve §3.5,
§4.2 Fig. 14a).

Setup: a private dev cluster, the operator, one PDGroup of llama3-8b — 4 prefills and 2 decodes
of 2 NPUs each, prefill batch 4, decode batch 64, engines at time scale 1 — and three
gateways in front of it, one per policy. Ours: prefills reject when their slots are full, or when
the prompt's first token (or that of a prompt in prefill) would miss its threshold, and the
gateway tries the next, until the TTFT budget is spent. Baselines (P/D-Serve's "original
version"): the gateway commits to one prefill (the next in turn, or the one whose last 100 ms
queue report was smallest) and the prefill keeps a local queue.

Load: closed-loop users, as in the paper ("maintaining the constant requests (one completed
triggers new one added)"), each sending its own seeded sequence of requests (the same for every
policy): 75 % short prompts (256-2048 tokens), 25 % long (4096-8192 tokens), 32 output tokens.

**A** is fixed before the sweep: the group's nominal capacity is
C = min(C_p, C_d) requests per emulated second from the timing model (P/D-Serve's C_p = n_p / E[T_p] for compute-bound
prefill, C_d = n_d * b_d / ((m - 1) * TPOT)); the unloaded response time R1 is measured first
(one user through the gateway, whole streams, emulated time); by Little's law the group is fully
busy at N = C * R1 closed-loop users. A = N / 4, so 4A is the group's nominal capacity and A..4A
sweeps a quarter of it to all of it.

**TTFT thresholds by prompt length** (P/D-Serve §2.2.2: "the timeout threshold for 1k is quite
different from that of 8k"; Fig. 3b: short prompts break their thresholds first under load):
the group's ``slo.ttftMilliseconds`` = 100 ms plus ``slo.ttftMillisecondsPer1kTokens`` = twice
the modelled unloaded prefill time per 1k tokens of the longest prompt (prefill time grows
faster than the length, so every prompt's threshold is at least 100 ms + twice its own unloaded
prefill time). Gateways and prefills enforce each request's own threshold (the gateway's
budget; the prefill's check before and after prefill), and a request succeeds when its first
token reaches the client within it (client-side wall time x the engines' time scale); a 503 or
an error before the first token is a miss. ``BENCH_SLO_MS`` / ``BENCH_SLO_PER_1K_MS`` override
the two (``BENCH_SLO_PER_1K_MS=0``: one flat threshold for every prompt). Each run
lasts RUN_SECONDS of wall time; requests started in its first WARMUP_SECONDS are not counted.

Each run's misses are counted by cause (``<policy>_<k>a_misses_<cause>``): ``late`` (a first
token past its threshold), ``http_503`` (no prefill accepted in time), ``ttft_timeout`` (the
prefill's check failed).

Writes ``bench/results/ttft-slo.json`` and prints the table.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from common import (
    REPO,
    cluster_env,
    collector_paused,
    gateway_command,
    install_crds,
    make_namespace,
    run_bench,
    wait_http,
)
from kubernetes import client, config

from enginestub import timing
from matrixserve.api import catalog
from matrixserve.api.catalog import LLAMA3_8B
from matrixserve.api.kinds import PDGROUP
from matrixserve.devcluster.cluster import DevCluster, free_ports
from matrixserve.devcluster.procs import Supervisor
from matrixserve.domain.conditions import is_true
from matrixserve.domain.gateway.routing import ttft_threshold_ms

RESULTS = REPO / "bench" / "results" / "ttft-slo.json"
# Engines' emulated seconds per wall second. 1: at 2 this 2-core machine saturates (~70 req/s
# emulated whatever the policy, against the model's ~119) and every TTFT stretches with the CPU
# queue, which measures the emulator, not the forwarding.
SCALE = float(os.environ.get("BENCH_TIME_SCALE", "1"))
SLO_MS = int(os.environ.get("BENCH_SLO_MS", "100"))
N_P, N_D, B_P, B_D = 4, 2, 4, 64
OUTPUT_TOKENS = 32
SHORT, LONG, LONG_SHARE = (256, 2048), (4096, 8192), 0.25
RUN_SECONDS, WARMUP_SECONDS = 14.0, 2.0
POLICIES = tuple(os.environ.get("BENCH_POLICIES", "on-demand,round-robin,least-loaded").split(","))
# A..4A as asked, then 6A and 8A: past nominal capacity, where the designs part.
LEVELS = tuple(int(k) for k in os.environ.get("BENCH_LEVELS", "1,2,3,4,6,8").split(","))
# A level repeated in BENCH_LEVELS (e.g. "4,4,4" to see a level's spread) is a run of its own in
# the table and the JSON: "4a", "4a_run2", "4a_run3".
RUNS = [
    (k, f"{k}a" if i == 0 else f"{k}a_run{i + 1}")
    for k, i in ((k, LEVELS[:j].count(k)) for j, k in enumerate(LEVELS))
]
NS = "bench-slo"


def slo_per_1k_ms(devices_per_instance: int) -> int:
    """Twice the modelled unloaded prefill time per 1k tokens of the longest prompt, on the
    prefill's shape (the docstring's threshold rule); ``BENCH_SLO_PER_1K_MS`` overrides it."""
    if "BENCH_SLO_PER_1K_MS" in os.environ:
        return int(os.environ["BENCH_SLO_PER_1K_MS"])
    dies = devices_per_instance * catalog.DIES_PER_NPU
    t_p = timing.prefill_seconds(LLAMA3_8B, timing.InstanceShape(dies=dies, tp=dies), LONG[1])
    return round(2 * t_p * 1000 / (LONG[1] / 1000))


def prompt_tokens(rng: random.Random) -> int:
    low, high = LONG if rng.random() < LONG_SHARE else SHORT
    return rng.randint(low, high)


def nominal_users(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, float]:
    """The group's capacity in closed-loop users, from the timing model (see the docstring)."""
    p_shape = timing.InstanceShape(dies=len(prefill["dies"]), tp=prefill["tp"])
    d_shape = timing.InstanceShape(dies=len(decode["dies"]), tp=decode["tp"])
    rng = random.Random(7)
    sample = [prompt_tokens(rng) for _ in range(20000)]
    t_p = statistics.fmean(timing.prefill_seconds(LLAMA3_8B, p_shape, n) for n in sample)
    mean_prompt = statistics.fmean(sample)
    kv = int(mean_prompt + OUTPUT_TOKENS / 2)
    tpot_full = timing.tpot(LLAMA3_8B, d_shape, B_D / d_shape.npus, kv)
    tpot_light = timing.tpot(LLAMA3_8B, d_shape, 1 / d_shape.npus, kv)  # for reference
    c_p = N_P / t_p
    c_d = N_D * B_D / ((OUTPUT_TOKENS - 1) * tpot_full)
    capacity = min(c_p, c_d)
    return {
        "mean_prefill_s": t_p,
        "c_p_rps": c_p,
        "c_d_rps": c_d,
        "capacity_rps": capacity,
        "r0_model_s": t_p + (OUTPUT_TOKENS - 1) * tpot_light,
    }


async def user(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    stop: float,
    count_from: float,
    out: list[tuple[float | None, float, int, str]],
) -> None:
    """One closed-loop user: its own seeded request sequence, a new request when one ends."""
    rng = random.Random(1000 + index)
    while time.monotonic() < stop:
        tokens = prompt_tokens(rng)
        body = {
            "model": "general",
            "prompt": "x" * (4 * tokens),  # the engines count ~4 characters a token
            "max_tokens": OUTPUT_TOKENS,
            "stream": True,
        }
        started = time.monotonic()
        ttft = None
        outcome = "ok"
        try:
            async with session.post(url, json=body) as response:
                if response.status == 200:
                    async for line in response.content:
                        # the first chunk carrying text (an error chunk has no "id")
                        if ttft is None and line.startswith(b'data: {"id"') and b'"text"' in line:
                            ttft = (time.monotonic() - started) * SCALE
                        elif ttft is None and line.startswith(b'data: {"error"'):
                            outcome = json.loads(line[6:])["error"].get("code") or "error"
                else:
                    outcome = f"http_{response.status}"
                    await response.read()
        except aiohttp.ClientError:
            outcome = "client_error"
        if started >= count_from:
            out.append((ttft, (time.monotonic() - started) * SCALE, tokens, outcome))
        if ttft is None:
            # A miss answers fast (503 after the budget, or an error): keep the closed loop
            # from spinning on a saturated group.
            await asyncio.sleep(0.05)


async def run(url: str, users: int) -> list[tuple[float | None, float, int, str]]:
    """(TTFT or None for a miss, response time, prompt tokens, how a request without a first
    token ended) of each counted request, emulated seconds."""
    out: list[tuple[float | None, float, int, str]] = []
    begin = time.monotonic()
    with collector_paused():
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
        ) as session:
            await asyncio.gather(
                *(
                    user(session, url, i, begin + RUN_SECONDS, begin + WARMUP_SECONDS, out)
                    for i in range(users)
                )
            )
    return out


def start_gateway(sup: Supervisor, info: Any, policy: str, started: list[str]) -> str:
    (port,) = free_ports(1)
    started.append(f"gateway-{policy}")
    sup.start(
        f"gateway-{policy}",
        gateway_command(info.zookeeper, NS, port, "--time-scale", str(SCALE), "--policy", policy),
        env=cluster_env(info),
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz")
    return f"{url}/v1/completions"


def group_status(custom: client.CustomObjectsApi) -> dict[str, Any]:
    body = custom.get_namespaced_custom_object(
        PDGROUP.group, PDGROUP.version, NS, PDGROUP.plural, "slo"
    )
    return dict(body.get("status") or {})


def main(work: Path) -> int:
    dev = DevCluster(work / "cluster")
    info = dev.up(timeout=240, superpods=1, servers=2)
    sup = Supervisor(work / "procs")
    started: list[str] = []
    table: dict[str, dict[str, tuple[float, int, float]]] = {p: {} for p in POLICIES}
    shares: dict[str, dict[str, dict[str, float]]] = {p: {} for p in POLICIES}
    misses: dict[str, dict[str, dict[str, int]]] = {p: {} for p in POLICIES}
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            make_namespace(client.CoreV1Api(api), NS)
            custom = client.CustomObjectsApi(api)
            started.append("operator")
            sup.start(
                "operator",
                [
                    *(sys.executable, "-m", "matrixserve", "--zookeeper", info.zookeeper),
                    *("--namespace", NS, "--no-webhook", "--engine-time-scale", str(SCALE)),
                    *("--metrics-port", str(free_ports(1)[0]), "--log-level", "WARNING"),
                    *("--liveness-port", str(free_ports(1)[0])),
                ],
                env=cluster_env(info),
            )
            group = yaml.safe_load((REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text())
            group["metadata"] = {"name": "slo"}
            spec = group["spec"]
            spec["prefill"].update(replicas=N_P, batchSize=B_P)
            spec["decode"].update(replicas=N_D, batchSize=B_D)
            per_1k = slo_per_1k_ms(spec["prefill"]["devicesPerInstance"])
            spec["slo"]["ttftMilliseconds"] = SLO_MS
            spec["slo"]["ttftMillisecondsPer1kTokens"] = per_1k
            custom.create_namespaced_custom_object(
                PDGROUP.group, PDGROUP.version, NS, PDGROUP.plural, group
            )
            deadline = time.monotonic() + 120
            while not is_true(group_status(custom), "Ready"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the group did not get Ready: {group_status(custom)}")
                time.sleep(0.5)
            rows = {r["name"]: r for r in group_status(custom)["instances"]}
            prefill = httpx.get(f"http://{rows['slo-p-0']['endpoint']}/v1/info").json()
            decode = httpx.get(f"http://{rows['slo-d-0']['endpoint']}/v1/info").json()
        model = nominal_users(prefill, decode)
        urls = {p: start_gateway(sup, info, p, started) for p in POLICIES}
        for url in urls.values():  # warm the connections and the engines
            asyncio.run(run_short(url))
        # The unloaded response time, measured: one user, through our gateway.
        alone = asyncio.run(run(urls[POLICIES[0]], 1))
        model["r1_s"] = statistics.fmean(r for _, r, _, _ in alone)
        model["capacity_users"] = model["capacity_rps"] * model["r1_s"]
        a = max(1, round(model["capacity_users"] / 4))
        for k, label in RUNS:
            for policy in POLICIES:
                results = asyncio.run(run(urls[policy], k * a))
                met = [
                    (n, t is not None and t <= ttft_threshold_ms(SLO_MS, per_1k, n) / 1000)
                    for t, _, n, _ in results
                ]
                # why the misses missed: late (a first token past the threshold), or no first
                # token (the gateway's 503, the prefill's ttft_timeout, ...)
                why = collections.Counter(
                    "late" if t is not None else outcome
                    for (t, _, _, outcome), (_, hit) in zip(results, met, strict=True)
                    if not hit
                )
                misses[policy][label] = dict(why)
                ok = sum(1 for _, hit in met if hit)
                by_length = {
                    kind: 100.0
                    * sum(hit for n, hit in met if (n >= LONG[0]) == is_long)
                    / max(1, sum(1 for n, _ in met if (n >= LONG[0]) == is_long))
                    for kind, is_long in (("short", False), ("long", True))
                }
                shares[policy][label] = by_length
                done = [t for t, _, _, _ in results if t is not None]
                p99 = sorted(done)[int(0.99 * (len(done) - 1))] if done else float("nan")
                table[policy][label] = (100.0 * ok / max(1, len(results)), len(results), p99)
                tries = attempts(urls[policy])
                print(
                    f"  {k}A ({k * a} users) {policy:13} {table[policy][label][0]:6.1f} % of "
                    f"{len(results)} requests within their thresholds (short prompts "
                    f"{by_length['short']:.1f} %, long {by_length['long']:.1f} %; TTFT p99 "
                    f"{p99 * 1000:.0f} ms); misses {dict(why)}; "
                    f"prefill tries so far {tries}",
                    flush=True,
                )
    finally:
        for name in started:
            sup.stop(name)
        dev.down()
    results_json: dict[str, Any] = {
        "slo_ms": SLO_MS,
        "slo_per_1k_tokens_ms": per_1k,
        "slo_ms_shortest_prompt": round(ttft_threshold_ms(SLO_MS, per_1k, SHORT[0]), 1),
        "slo_ms_longest_prompt": round(ttft_threshold_ms(SLO_MS, per_1k, LONG[1]), 1),
        "time_scale": SCALE,
        "group": f"{N_P}P+{N_D}D",
        "prefill_batch": B_P,
        "decode_batch": B_D,
        "a_users": a,
        "capacity_users_model": round(model["capacity_users"], 2),
        "capacity_rps_model": round(model["capacity_rps"], 2),
        "unloaded_response_s_measured": round(model["r1_s"], 4),
        "unloaded_response_s_model": round(model["r0_model_s"], 4),
        "mean_prefill_ms_model": round(model["mean_prefill_s"] * 1000, 2),
    }
    for policy in POLICIES:
        key = policy.replace("-", "_")
        for label, (pct, n, p99) in table[policy].items():
            results_json[f"{key}_{label}_attainment_pct"] = round(pct, 2)
            results_json[f"{key}_{label}_requests"] = n
            results_json[f"{key}_{label}_throughput_rps"] = round(rps(n), 2)
            results_json[f"{key}_{label}_ttft_p99_ms"] = round(p99 * 1000, 1)
            for kind, pct_kind in shares[policy][label].items():
                results_json[f"{key}_{label}_{kind}_prompts_attainment_pct"] = round(pct_kind, 2)
            for reason, count in sorted(misses[policy][label].items()):
                results_json[f"{key}_{label}_misses_{reason}"] = count
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results_json, indent=2) + "\n")
    print(
        f"\nTTFT-SLO attainment (threshold {SLO_MS} ms + {per_1k} ms per 1k prompt tokens: "
        f"{ttft_threshold_ms(SLO_MS, per_1k, SHORT[0]):.0f} ms at {SHORT[0]} tokens .. "
        f"{ttft_threshold_ms(SLO_MS, per_1k, LONG[1]):.0f} ms at {LONG[1]}), "
        f"{N_P}P+{N_D}D llama3-8b, closed-loop users; "
        f"A = {a} users (4A = nominal capacity {model['capacity_users']:.1f} users, "
        f"{model['capacity_rps']:.1f} req/s x unloaded response {model['r1_s'] * 1000:.0f} ms)"
    )
    print(f"  {'load':10}" + "".join(f"{p:>16}" for p in POLICIES))
    print(f"  {'':10}" + "".join(f"{'SLO %  req/s':>16}" for _ in POLICIES))
    for _, label in RUNS:
        print(
            f"  {label.upper().replace('_RUN', ' #'):10}"
            + "".join(
                f"{table[p][label][0]:>9.1f}% {rps(table[p][label][1]):>5.0f}" for p in POLICIES
            )
        )
    print(
        "  (target: on-demand >= 99 % at 4A, where the paper's queue-report baseline fell to ~57 %)"
    )
    print(f"wrote {RESULTS}")
    return 0


def rps(requests: int) -> float:
    """Emulated requests/s completed while counting."""
    return requests / ((RUN_SECONDS - WARMUP_SECONDS) * SCALE)


def attempts(url: str) -> dict[str, float]:
    """The gateway's prefill tries so far, by answer."""
    text = httpx.get(url.replace("/v1/completions", "/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("matrixserve_gateway_forward_attempts_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


async def run_short(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            async with session.post(
                url, json={"model": "general", "prompt": "warm", "max_tokens": 2}
            ) as response:
                await response.read()


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-slo-"))
