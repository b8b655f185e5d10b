"""Benchmark: how many concurrent streamed requests one engine-stub process sustains on one
core, keeping its timings within 5% of the model.

One colocated engine (llama3-8b on one die, time scale 1: its modelled TPOT at 100-1,000 streams is
27-63 ms, the band of CloudMatrix-Infer's TPOT SLOs, 001 T5) is pinned to core 0; the client, pinned
to core 1, opens N streams at once and timestamps every token as it arrives. In steady state
(tokens 30..100 of 120, when every stream is in the batch) the per-token interval a client sees
is compared with the timing model's TPOT for a batch of N: that relative error is the figure.

Ours: decode steps on absolute deadlines. Baseline, measured in the same run: the naive loop
that sleeps one step after doing its work, so the loop's own overhead adds to every step.

Writes ``bench/results/engine-streams.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from common import cpu_seconds, engine_command, wait_http

from enginestub import timing
from matrixserve.api.catalog import LLAMA3_8B

RESULTS = Path(__file__).resolve().parent / "results" / "engine-streams.json"
SHAPE = timing.InstanceShape(dies=1, tp=1)
PROMPT, MAX_TOKENS, WINDOW = 128, 120, (30, 100)


def start_engine(host: str, scheduling: str) -> subprocess.Popen[bytes]:
    cmd = engine_command(
        host,
        0,
        *("--dies", "0", "--tp", "1", "--max-batch", "2048", "--time-scale", "1"),
        *("--step-scheduling", scheduling),
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://{host}:8000/readyz")
    except SystemExit:
        proc.kill()
        raise
    return proc


async def one_stream(session: aiohttp.ClientSession, url: str, rid: str) -> list[float]:
    arrivals: list[float] = []
    async with session.post(
        url, json={"requestId": rid, "promptTokens": PROMPT, "maxTokens": MAX_TOKENS}
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{rid}: HTTP {resp.status} {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: "):
                now = time.monotonic()
                event = json.loads(line[6:])
                if event["type"] == "token":
                    arrivals.append(now)
                elif event["type"] == "error":
                    raise RuntimeError(f"{rid}: {event}")
    return arrivals


async def run_level(host: str, streams: int, pid: int) -> dict[str, float]:
    url = f"http://{host}:8000/v1/generate"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0, wall0 = cpu_seconds(pid), time.monotonic()
        results = await asyncio.gather(
            *(one_stream(session, url, f"s{streams}-{i}") for i in range(streams))
        )
        cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)
    lo, hi = WINDOW
    observed = [(a[hi] - a[lo]) / (hi - lo) for a in results if len(a) > hi]
    model = timing.tpot(LLAMA3_8B, SHAPE, streams / SHAPE.npus, PROMPT + (lo + hi) // 2)
    median = statistics.median(observed)
    p95 = sorted(observed)[int(0.95 * (len(observed) - 1))]
    return {
        "streams": streams,
        "model_tpot_ms": model * 1e3,
        "observed_tpot_median_ms": median * 1e3,
        "observed_tpot_p95_ms": p95 * 1e3,
        "error": abs(median - model) / model,
        "engine_cpu_cores": cpu,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="100,250,500,750,1000")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    os.sched_setaffinity(0, {1})
    rows: dict[str, list[dict[str, float]]] = {}
    for name, scheduling, host in (
        ("ours", "absolute", "127.91.0.1"),
        ("baseline", "relative", "127.91.0.2"),
    ):
        proc = start_engine(host, scheduling)
        try:
            rows[name] = [asyncio.run(run_level(host, n, proc.pid)) for n in levels]
        finally:
            proc.terminate()
            proc.wait(10)
    best = {
        name: max([r["streams"] for r in data if r["error"] <= 0.05], default=0)
        for name, data in rows.items()
    }
    results: dict[str, float] = {"target_streams": 500, "target_error": 0.05}
    for name, data in rows.items():
        results[f"{name}_max_streams_within_5pct"] = best[name]
        for r in data:
            n = int(r["streams"])
            results[f"{name}_error_at_{n}"] = round(r["error"], 4)
            results[f"{name}_observed_tpot_ms_at_{n}"] = round(r["observed_tpot_median_ms"], 3)
            results[f"{name}_engine_cpu_cores_at_{n}"] = round(r["engine_cpu_cores"], 3)
            results[f"model_tpot_ms_at_{n}"] = round(r["model_tpot_ms"], 3)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print("\nengine stub: concurrent streams on one core (llama3-8b, 1 die, time scale 1)")
    print(
        f"{'streams':>8}{'model TPOT':>12}{'ours TPOT':>11}{'ours err':>10}{'ours CPU':>10}"
        f"{'base TPOT':>11}{'base err':>10}"
    )
    for ours, base in zip(rows["ours"], rows["baseline"], strict=True):
        print(
            f"{int(ours['streams']):>8}{ours['model_tpot_ms']:>10.2f}ms{ours['observed_tpot_median_ms']:>9.2f}ms"
            f"{ours['error']:>10.1%}{ours['engine_cpu_cores']:>10.2f}"
            f"{base['observed_tpot_median_ms']:>9.2f}ms{base['error']:>10.1%}"
        )
    print(
        f"\nmost streams within 5%: ours {best['ours']}, baseline {best['baseline']} (target >= 500)"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
