"""Benchmark: the most requests/s the gateway forwards on one core, and the TTFT it adds.

The gateway runs alone on core 0 (pinned), and forwards 16-token streamed completions to the
two entrances of a PDGroup's scenario, discovered as in production (the group from Kubernetes,
its entrances from ZooKeeper). Everything else shares core 1: the dev cluster, this load
generator and the upstream, a **null engine** (``bench/null_engine.py``) that speaks the engine
stub's stream protocol byte for byte at a fraction of its CPU cost: the first token as soon as
the request is read, the rest from a decode loop stepping every 0.2 ms that, like the stub's
(continuous batching), writes the next token of every running stream, each a separate write on
its stream's connection, so the gateway relays every token on its own as in production (tokens
a TPOT apart). With the engine stub upstream, core 1 saturated first and neither
measurement was the gateway's: the rate was the upstream's and the tails were its queueing.

1. **Most requests/s**: 64 closed-loop clients for 10 s; the gateway's core is ~100 % busy, so
   the rate is the gateway's own (its core's busy share is printed to show it).
2. **Added TTFT** at half that rate (the target) and at a quarter, 20 s of open loop each:
   client-side TTFT through the gateway against requests sent straight to the null engine
   (the baseline), interleaved in the same run: every eighth slot sends one direct request at
   the same instant as that slot's gateway request. **Added (paired)** is the distribution of
   each such pair's difference (gateway minus direct), so a moment of machine noise lands on
   both sides of a pair; the difference of the two sides' own percentiles is printed next to it.
   A first second at the same rate is not counted (connection pools fill then).

An event loop spends more CPU per request at a moderate rate than when saturated (a saturated
loop handles many ready sockets per wake-up, and relays several tokens per write): the gateway's
core is therefore well over half busy at half the most rate; the table prints how busy.

Writes ``bench/results/gateway-overhead.json`` and prints the table.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from common import (
    REPO,
    cluster_env,
    collector_paused,
    cpu_seconds,
    gateway_command,
    install_crds,
    make_namespace,
    run_bench,
    wait_http,
    zookeeper,
)
from kubernetes import client, config

from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import PDGROUP
from matrixserve.devcluster.cluster import DevCluster, free_ports

RESULTS = REPO / "bench" / "results" / "gateway-overhead.json"
ENGINES = [("127.93.0.1", "bench-p-0"), ("127.93.0.2", "bench-p-1")]
OPEN_LOOP_SECONDS = 20
CLOSED_LOOP_SECONDS = 10
# The group's TTFT threshold: far above any delay here, so no request is refused for time.
SLO_MS = 1000
PREFILL_SLOTS = 512
# The null engine's decode step (wall): every token reaches the gateway as a read of its own, as
# in production where tokens are a TPOT apart.
TOKEN_GAP_MS = 0.2
CLIENTS = 64
STREAM_TOKENS = 16
BODY = {"model": "bench", "prompt": "hello " * 16, "max_tokens": STREAM_TOKENS, "stream": True}


class LeanClient:
    """The load generator's HTTP/1.1 client: keep-alive connections, prebuilt requests, responses
    scanned for the first token and the end of the chunked body, nothing parsed. The load
    generator shares core 1 with the engines; aiohttp's client spent ~0.3 ms of that core per
    stream, so at the test rate core 1 ran near saturation and its queueing, not the gateway,
    made the tails on both sides."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
        self._idle = {}
        self._writers: list[asyncio.StreamWriter] = []
        self._heads: dict[str, tuple[tuple[str, int], bytes]] = {}  # per URL: address, head
        # per server: streams read to the end, and the server's writes (HTTP chunks) in them
        self.streams: collections.Counter[tuple[str, int]] = collections.Counter()
        self.chunks: collections.Counter[tuple[str, int]] = collections.Counter()

    def writes_per_stream(self, url: str) -> float:
        key = self._head(url)[0]
        return self.chunks[key] / max(self.streams[key], 1)

    def _head(self, url: str) -> tuple[tuple[str, int], bytes]:
        if url not in self._heads:
            split = urlsplit(url)
            key = (split.hostname or "127.0.0.1", split.port or 80)
            head = (
                f"POST {split.path} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode()
            self._heads[url] = (key, head)
        return self._heads[url]

    async def ttft(self, url: str, body: dict[str, Any]) -> float:
        """TTFT seen by the client (wall seconds); the stream is read to the end."""
        key, head = self._head(url)
        payload = json.dumps(body).encode()
        request = head + str(len(payload)).encode() + b"\r\n\r\n" + payload
        pool = self._idle.setdefault(key, [])
        started = time.monotonic()
        if pool:
            reader, writer = pool.pop()
        else:
            reader, writer = await asyncio.open_connection(*key)
            self._writers.append(writer)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{url}: {head.splitlines()[0].decode()}")
        if b"chunked" not in head.lower():
            raise RuntimeError(f"{url}: expected a chunked stream, got {head!r}")
        ttft = None
        tail = b""
        chunks = 0
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError(f"{url}: the stream closed before its end")
            if ttft is None and b'"text' in tail[-8:] + data:
                ttft = time.monotonic() - started
            chunks += (tail[-3:] + data).count(b"\n\n\r\n")  # an SSE chunk's end
            tail = (tail + data)[-16:]
            if tail.endswith(b"\r\n0\r\n\r\n") or tail == b"0\r\n\r\n":
                break
        pool.append((reader, writer))
        self.streams[key] += 1
        self.chunks[key] += chunks
        if ttft is None:
            raise RuntimeError(f"{url}: no token in the stream")
        return ttft

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()


async def closed_loop(
    url: str, body: dict[str, Any], clients: int, seconds: float
) -> tuple[int, float]:
    """Streams completed by ``clients`` back-to-back users in ``seconds``, and the server's
    writes per stream."""
    done = 0
    stop = time.monotonic() + seconds
    lean = LeanClient()

    async def user(i: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            await lean.ttft(url, body)  # the gateway names requests itself
            done += 1

    try:
        await asyncio.gather(*(user(i) for i in range(clients)))
    finally:
        await lean.close()
    return done, lean.writes_per_stream(url)


async def open_loop(
    gateway: str,
    body: dict[str, Any],
    rate: float,
    seconds: float,
    direct: list[str],
    direct_body: dict[str, Any],
    every: int = 8,
    warmup: float = 1.0,
) -> tuple[list[float], list[float], list[float], float]:
    """TTFTs through the gateway at ``rate`` for ``seconds``; interleaved in the same run, every
    ``every``-th slot also sends one request straight to the engines at the same instant as that
    slot's gateway request; and each such pair's difference (gateway minus direct). Both sides see
    the same moments of the machine (its noise would otherwise land on one side only). A first
    ``warmup`` seconds at the same rate is not counted (connection pools fill then). Last, the
    gateway's writes per stream."""
    lean = LeanClient()
    via: list[asyncio.Task[float]] = []
    pairs: list[tuple[asyncio.Task[float], asyncio.Task[float]]] = []
    every_task: list[asyncio.Task[float]] = []
    start = time.monotonic()
    skip = int(rate * warmup)
    n = skip + int(rate * seconds)
    try:
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            task = asyncio.create_task(lean.ttft(gateway, body))
            every_task.append(task)
            if i >= skip:
                via.append(task)
            if i % every == 0:
                engine = direct[(i // every) % len(direct)]
                side = asyncio.create_task(lean.ttft(engine, {**direct_body, "requestId": f"d{i}"}))
                every_task.append(side)
                if i >= skip:
                    pairs.append((task, side))
        await asyncio.gather(*every_task)
    finally:
        await lean.close()
    return (
        [t.result() for t in via],
        [d.result() for _, d in pairs],
        [g.result() - d.result() for g, d in pairs],
        lean.writes_per_stream(gateway),
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_routed(port: int, entrances: int, timeout: float = 30) -> None:
    """Return once the gateway routes the scenario to ``entrances`` entrances (discovered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/routes", timeout=2) as answer:
            groups = json.load(answer)["groups"]
        if sum(len(g["entrances"]) for g in groups) == entrances:
            return
        time.sleep(0.1)
    raise SystemExit(f"the gateway did not discover {entrances} entrances in {timeout:.0f}s")


def at_rate(
    gateway_pid: int, url: str, direct: list[str], direct_body: dict[str, Any], rate: float
) -> dict[str, float]:
    """The open loop at ``rate``: TTFT through the gateway, direct, and added (paired)."""
    cpu, t = cpu_seconds(gateway_pid), time.monotonic()
    # the load generator keeps every task until the end: no collections over that growing heap
    with collector_paused():
        via, straight, paired, writes = asyncio.run(
            open_loop(url, BODY, rate, OPEN_LOOP_SECONDS, direct, direct_body)
        )
    busy = (cpu_seconds(gateway_pid) - cpu) / (time.monotonic() - t)
    figures = {"rps": round(rate, 1), "gateway_core_busy": round(busy, 3)}
    figures["gateway_writes_per_stream"] = round(writes, 2)
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        figures[f"ttft_{label}_ms_gateway"] = round(pct(via, q) * 1000, 3)
        figures[f"ttft_{label}_ms_direct"] = round(pct(straight, q) * 1000, 3)
        figures[f"added_ttft_{label}_ms"] = round(pct(paired, q) * 1000, 3)
        figures[f"{label}_difference_ms"] = round((pct(via, q) - pct(straight, q)) * 1000, 3)
    figures["pairs"] = len(paired)
    return figures


def main(work: Path) -> int:
    # Core 0 is the gateway's alone: the dev cluster (API server, etcd, ZooKeeper), the null
    # engine and this load generator run on core 1.
    os.sched_setaffinity(0, {1})
    dev = DevCluster(work / "cluster")
    info = dev.up(timeout=240, superpods=1, servers=1)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            make_namespace(client.CoreV1Api(api), "bench")
            group = yaml.safe_load((REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text())
            group["metadata"] = {"name": "bench"}
            group["spec"]["scenario"] = "bench"
            group["spec"]["slo"] = {"ttftMilliseconds": SLO_MS}
            # the null engine batches without limit: the gateway never holds back for a slot
            group["spec"]["prefill"]["batchSize"] = PREFILL_SLOTS
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                PDGROUP.group, PDGROUP.version, "bench", PDGROUP.plural, group
            )
        upstream = subprocess.Popen(
            [
                *(sys.executable, str(REPO / "bench" / "null_engine.py")),
                *(",".join(host for host, _ in ENGINES), "8000", str(TOKEN_GAP_MS)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs.append(upstream)
        assert upstream.stdout is not None
        if upstream.stdout.readline().strip() != b"ready":
            raise SystemExit("the null engine did not start")
        zk = zookeeper(info)
        paths = zl.GroupPaths("bench", "bench")
        for host, name in ENGINES:
            zk.create(
                paths.entrance(name),
                zl.Entrance(instance=name, podIP=host, port=8000).dump(),
                makepath=True,
            )
        zk.stop()
        (port,) = free_ports(1)
        gateway = subprocess.Popen(
            ["taskset", "-c", "0", *gateway_command(info.zookeeper, "bench", port)],
            env=cluster_env(info),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(gateway)
        wait_http(f"http://127.0.0.1:{port}/healthz")
        wait_routed(port, len(ENGINES))
        url = f"http://127.0.0.1:{port}/v1/completions"
        direct = [f"http://{host}:8000/v1/generate" for host, _ in ENGINES]
        direct_body = {"prompt": BODY["prompt"], "maxTokens": STREAM_TOKENS}
        asyncio.run(closed_loop(url, BODY, 8, 2))  # warm-up
        cpu0, t0 = cpu_seconds(gateway.pid), time.monotonic()
        forwarded, writes = asyncio.run(closed_loop(url, BODY, CLIENTS, CLOSED_LOOP_SECONDS))
        elapsed = time.monotonic() - t0
        cpu = cpu_seconds(gateway.pid) - cpu0
        most = forwarded / elapsed
        half = at_rate(gateway.pid, url, direct, direct_body, most / 2)
        quarter = at_rate(gateway.pid, url, direct, direct_body, most / 4)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        dev.down()
    results: dict[str, float] = {
        "stream_tokens": STREAM_TOKENS,
        "token_gap_ms": TOKEN_GAP_MS,
        "max_rps": round(most, 1),
        "gateway_core_busy_at_max": round(cpu / elapsed, 3),
        "gateway_cpu_ms_per_request_at_max": round(cpu / forwarded * 1000, 3),
        "gateway_writes_per_stream_at_max": round(writes, 2),
        **{f"half_{k}": v for k, v in half.items()},
        **{f"quarter_{k}": v for k, v in quarter.items()},
        "target_rps_per_core": 1000,
        "target_added_p99_ms": 5,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\ngateway overhead: {STREAM_TOKENS}-token streamed completions, gateway on core 0")
    print(
        f"  most forwarded ({CLIENTS} closed-loop clients): {most:.0f} req/s (target >= 1000);"
        f" gateway core {cpu / elapsed:.0%} busy, {cpu / forwarded * 1000:.3f} ms CPU per"
        f" request, {writes:.1f} writes per stream"
    )
    print(
        f"\n  {'client-side TTFT':24}{'via gateway':>13}{'direct':>10}{'difference':>12}"
        f"{'added (paired)':>16}"
    )
    for name, f in (("half", half), ("quarter", quarter)):
        print(
            f"  at {f['rps']:.0f} req/s ({name} of most; gateway core {f['gateway_core_busy']:.0%}"
            f" busy, {f['gateway_writes_per_stream']:.1f} writes per stream)"
        )
        for label in ("p50", "p99"):
            print(
                f"  {label:24}{f[f'ttft_{label}_ms_gateway']:>11.2f}ms"
                f"{f[f'ttft_{label}_ms_direct']:>8.2f}ms{f[f'{label}_difference_ms']:>10.2f}ms"
                f"{f[f'added_ttft_{label}_ms']:>14.2f}ms"
            )
    print(
        f"  (added (paired): percentiles of gateway minus direct TTFT over {half['pairs']:.0f}"
        " pairs sent at the same instant; target at half: added p99 <= 5 ms)"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-gateway-"))
