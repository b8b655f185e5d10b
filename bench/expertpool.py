"""Benchmark: an ExpertPool under a saturated decode load (EaaS §5.3, §5.4; xDeepServe §4.5,
§7.1) — failover, the autoscaler and EPLB, ours against the baseline each figure has.

Setup: a private dev cluster (node emulator: ``NODES`` servers of 8 NPUs), the operator
(engines at time scale :data:`SCALE`), and an ExpertPool of :data:`SERVERS` expert server pods
(one engine process each) of DeepSeek-V3's 256 experts x 58 MoE layers, :data:`SLOTS` slots per
server, every expert on :data:`COPIES` distinct servers plus :data:`BUDGET` redundant slots per
layer (coverage bound ``ceil((256 x 2 + 64) / 16) = 36`` servers: below EaaS §5.3's 40).
:data:`CLIENTS` attention clients (``ENGINE_ROLE=attention`` engine processes beside the
cluster, no P/D group: ``/v1/generate`` prefills and decodes there) each hold a batch of
:data:`BATCH` requests, xDeepServe §7.1's shape (96 per die, one die per client), kept full by a
closed load (:mod:`testkit.closedload`). ``8192 equivalent requests`` are EaaS §5.3's traffic on
64 GPUs; ours is ``CLIENTS x BATCH`` of them, scaled by :data:`EQUIVALENT` (said in the table).

(a) **Failover** (EaaS §5.4: "we randomly disable ten GPUs, one at a time, and measure the
average decoding throughput during recovery"): :data:`KILLS` servers killed one at a time
(SIGKILL by pid), each once the pool is whole again from the last. A window runs from the kill
to the coverage restored (the pool's status: ``lastFailover.restoredAt`` of that failover, every
expert back to ``minReplicasPerExpert``); its throughput (tokens reaching the load per wall s)
against the :data:`BEFORE_S` s before that kill, the pool whole through them (EaaS gives one
rate before the kills; ours is per kill, so that how the load's requests end and start again
over the run is no part of a window's loss). ``failover_failed``: requests that ended
other than well from the first kill to the last window's end. Baseline: the same kills with the
clients in monolithic mode (``ENGINE_EXPERT_MODE=monolithic``: one static EP group, EaaS §2.2,
§5.4 "unable to continue serving during recovery").

(b) **Scale-down** (EaaS §5.3: "when the traffic decreases from 8192 to 5120 ... EAAS can scale
down to 40 or 48 GPUs while maintaining the same level of decoding throughput"): the load falls
to 5120 equivalent requests (60 per client); once its requests have turned over
(:data:`TURNOVER_S`, shorter ones: :data:`LOW_OUTPUTS`) the pool's throughput and ITL p99 at
64 servers and that load are measured, then the autoscaler is switched on with a target of the
servers' token rate at full load over 64 (EaaS's linear capacity, notes 003 §3.3: 8192 / 64 =
5120 / 40 per GPU) and picks the count live, one server at a time; once it stays put, the same
figures again.

(c) **EPLB** (xDeepServe §4.5, Fig. 11a/b): clients whose tokens go to experts by Zipf (the
hottest expert ~30x the mean) feed the servers' token counts; the controller rebalances through
the four phases. Fig. 11b's figure is the forward latency at "EP288 and 1K sequence": ours is a
forward of a 1K sequence per server, made through the servers by a client
(``/v1/attention/step`` with ``send``), its MoE part (each MoE layer's slowest server, summed:
the combine barrier EPLB shortens) without against with the rebalance. The decode iteration and
its MoE part under the Zipf load are given beside: at a decode batch a server's grouped GEMM
reads its experts' weights whatever their tokens (memory-bound), so a hot expert costs it
little and EPLB gains little there.

``iteration_ms``: the clients' measured iteration at (a)'s load before the first kill, beside
§7.1's 92.9 ms. Host CPU is measured during each part and printed (the emulated capacity is
the figure only while the host is not the bottleneck).

Writes ``bench/results/expertpool.json`` (flat keys, issue 34's contract) and prints the table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import REPO, cluster_env, install_crds, make_namespace, run_bench, write_results
from common import zookeeper as zk_client
from kubernetes import client, config
from recovery import host_cpu, host_idle_since

sys.path.insert(0, str(REPO))  # testkit, the kit shared with the tests
from matrixserve.api import kinds, rfc3339
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo, DevCluster, free_ports
from matrixserve.devcluster.procs import Supervisor
from matrixserve.domain.conditions import is_true
from matrixserve.domain.expertpool import autoscale
from testkit.chaoskit import pod_runs
from testkit.closedload import ClosedLoad
from testkit.helpers import poll

RESULTS = REPO / "bench" / "results" / "expertpool.json"
KIND = kinds.EXPERTPOOL
WHERE = (KIND.group, KIND.version)
NAMESPACE, POOL = "bench-expertpool", "ep"
NODES, NPUS_PER_NODE = 10, 8  # 80 NPUs: 64 servers and room for replacements
# Engines' emulated seconds per wall second (BENCH_TIME_SCALE to change it). See the table's
# CPU line: at this scale both cores keep room under the full load.
SCALE = float(os.environ.get("BENCH_TIME_SCALE", "0.025"))
SERVERS, SLOTS, COPIES, BUDGET = 64, 16, 2, 64
EXPERTS, LAYERS, TOP_K = 256, 58, 8
# Two clients of 96 requests on one die each (xDeepServe §7.1: 96 per die). A client's
# iteration is a plan over 58 layers x 2 microbatches x 256 experts and a message to each of 64
# servers, all in Python (0.2-0.7 CPU s on this host, by its processes' CPU over their
# iterations in trial runs): more clients would need a time scale at which a failover window
# lasts many minutes of wall time.
CLIENTS, BATCH = 2, 96
FULL_LOAD, LOW_LOAD = 8192, 5120  # EaaS §5.3's traffic, in equivalent requests
EQUIVALENT = FULL_LOAD / (CLIENTS * BATCH)  # EaaS requests per request of ours
KILLS = max(1, int(os.environ.get("BENCH_KILLS", "10")))
VICTIMS = [f"{POOL}-s{i}" for i in (3, 9, 15, 21, 27, 33, 39, 45, 51, 57)]
BEFORE_S = 30.0  # s of steady load before each kill: the rate its window is held against
MEASURE_S = 30.0  # s a steady figure (b, c) is measured over
# Prompts of 64 tokens, outputs of 256-768: a standalone client prefills each request itself,
# in its serving loop (xDeepServe §7.1's 3K context would stall it for minutes of wall time
# per batch at this scale), so the batch's mean context is ~500 tokens; the clients' own
# prediction at §7.1's 3K context is printed beside (their /v1/attention/step).
PROMPT_TOKENS, PAPER_CONTEXT = 64, 3072
WARM_S = 15.0  # s of load before anything is measured (the batches fill)
# (b)'s requests: outputs of 32-96 tokens, and TURNOVER_S s (two of their lives) before the
# first figure: the 64 servers' figure and the autoscaler's, minutes apart, are then both of
# a load whose requests end and start again as they will (their contexts spread the same); a
# load of young requests against an old one would differ by its contexts (the attention's
# KV reads) whatever the servers
LOW_OUTPUTS, TURNOVER_S = (32, 96), 180.0
GAP_S = 3.0  # s between the pool whole again and the next kill
RESTORE_BOUND_S = 300.0
STAYS_PUT_S = 75.0  # the autoscaler has not moved for longer than its cooldown and two samples
SCALE_BOUND_S = 1500.0
EPLB_BOUND_S = 240.0
# The server pods' engines: no TE-Pre-Load (20 emulated s, DeepServe §6.1: 800 wall s per
# replacement at this scale; as a warm pod, which has paid it before its claim), their slots
# from local SSD (9 slots x 58 layers in 0.46 emulated s; SFS: 11 s), and their reports (with
# the token counts the autoscaler's and EPLB's samples read, every 10 wall s) rewritten every
# 2 wall s (the default, 20 emulated s, is 800 wall s at this scale: every sample would see no
# token move).
REPORT_WALL_S = 2.0
SERVER_FLAGS = (
    *("--engine-pre-load-seconds", "0", "--engine-load-source", "SSD"),
    *("--engine-health-interval", f"{REPORT_WALL_S * SCALE:g}"),
)
PAPER_ITERATION_MS = 92.9  # xDeepServe §7.1
# (c)'s forward probe: xDeepServe Fig. 11b's "EP288 and 1K sequence", a 1K sequence per expert
# rank (288 dies, each one routed or shared expert and one redundant); ours a 1K sequence per
# server, sent by one client (its MoE part is the figure: the attention of 64 sequences on one
# die is the client's, not the EP group's)
FORWARD_REQUESTS, FORWARD_TOKENS, PROBES = SERVERS, 1024, 2
# BENCH_PARTS=a,b,c: a subset (for looking into one; the JSON is then not written)
PARTS = [p for p in os.environ.get("BENCH_PARTS", "a,b,c").split(",") if p]
SUBSET = "" if PARTS == ["a", "b", "c"] else f"BENCH_PARTS={','.join(PARTS)}"


def pool_body() -> dict[str, Any]:
    return {
        "apiVersion": KIND.api_version,
        "kind": KIND.kind,
        "metadata": {"name": POOL},
        "spec": {
            "model": {"name": "deepseek-v3", "experts": EXPERTS, "layers": LAYERS, "topK": TOP_K},
            "servers": {"replicas": SERVERS, "slotsPerServer": SLOTS},
            "minReplicasPerExpert": COPIES,
            "redundantExpertBudget": BUDGET,
            # no rebalance until (c) asks for one (a threshold no uniform load reaches)
            "rebalance": {"intervalSeconds": 10, "imbalancePercentThreshold": 1000},
            "failoverTimeoutMilliseconds": 1000,
        },
    }


@dataclass
class Bench:
    info: ClusterInfo
    api: client.ApiClient
    sup: Supervisor
    clients: dict[str, str] = field(default_factory=dict)  # name -> url

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def pool(self) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(*WHERE, NAMESPACE, KIND.plural, POOL))

    def status(self) -> dict[str, Any]:
        return dict(self.pool().get("status") or {})

    def patch(self, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            *WHERE, NAMESPACE, KIND.plural, POOL, {"spec": spec}
        )

    def pods(self) -> dict[str, Any]:
        with httpx.Client(base_url=self.info.node_emulator, timeout=10, trust_env=False) as h:
            return pod_runs(h.get("/pods").json(), NAMESPACE, live=True)

    def settled(self, servers: int | None = None) -> dict[str, Any] | None:
        """The status once the pool serves its servers, every expert fully replicated, no map
        change under way (``servers``: that many)."""
        s = self.status()
        want = servers if servers is not None else s.get("wantedServers")
        ok = (
            is_true(s, "Available")
            and is_true(s, "FullyReplicated")
            and not is_true(s, "Rebalancing")
            and s.get("readyServers") == want
            and len(s.get("servers") or []) == want
            and not s.get("draining")
        )
        return s if ok else None

    # ------------------------------------------------------------------ clients
    def start_clients(self, count: int, mode: str, popularity: str = "uniform") -> list[str]:
        """``count`` attention clients of the pool (``mode``: eaas | monolithic); their urls
        once each has the map in force and every expert covered."""
        urls = []
        for index in range(count):
            name = f"att-{mode}-{popularity}-{index}"
            (port,) = free_ports(1)
            self.sup.start(
                name,
                [
                    *(sys.executable, "-m", "enginestub", "--role", "attention"),
                    *("--model", "deepseek-v3", "--host", "127.0.0.1", "--port", str(port)),
                    *("--time-scale", str(SCALE), "--max-batch", str(BATCH), "--dies", "0"),
                    *("--pre-load-seconds", "0", "--load-source", "HostDRAM"),
                    *("--expert-mode", mode, "--expert-popularity", popularity, "--mtp"),
                ],
                env={
                    **cluster_env(self.info),
                    "MATRIXSERVE_EXPERT_POOL": f"{NAMESPACE}/{POOL}",
                    "ENGINE_INSTANCE": name,
                    "PYTHONPATH": os.pathsep.join(
                        [str(REPO / "operator"), str(REPO / "engine-stub")]
                    ),
                },
            )
            url = f"http://127.0.0.1:{port}"
            self.clients[name] = url
            urls.append(url)
        for url in urls:
            poll(lambda u=url: _ready(u), 120, f"the attention client {url} ready", every=0.5)
        return urls

    def stop_clients(self, urls: list[str]) -> None:
        for name, url in list(self.clients.items()):
            if url in urls:
                self.sup.stop(name, grace=5)
                del self.clients[name]


def server_tokens(info: ClusterInfo) -> dict[str, tuple[float, int]]:
    """Each server's report time and cumulative tokens (every layer and expert), as the
    autoscaler counts them (:func:`autoscale.tokens_of`), from its report in ZooKeeper."""
    paths = zl.ExpertPoolPaths(NAMESPACE, POOL)
    zk = zk_client(info)
    try:
        out = {}
        for server in zk.get_children(paths.servers):
            raw, _ = zk.get(paths.server(server))
            report = zl.ExpertServerReport.parse(raw)
            out[server] = (report.ts, autoscale.tokens_of(report))
        return out
    finally:
        zk.stop()


def server_rate(then: dict[str, tuple[float, int]], now: dict[str, tuple[float, int]]) -> float:
    """The servers' tokens per wall s between two reads: each server's over the times of its
    own reports (a report is rewritten every health interval), summed."""
    rate = 0.0
    for server, (ts, tokens) in now.items():
        ts0, tokens0 = then.get(server, (0.0, 0))
        if ts > ts0 > 0 and tokens >= tokens0:
            rate += (tokens - tokens0) / (ts - ts0)
    return rate


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@dataclass
class Iterations:
    """The clients' iteration counters at a moment: the mean iteration between two of them."""

    sums: float
    counts: float
    moe: float  # the iterations' MoE parts, summed

    @classmethod
    def read(cls, urls: list[str]) -> Iterations:
        sums = counts = moe = 0.0
        for url in urls:
            text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
            sums += _metric(text, "matrixserve_engine_expert_iteration_seconds_sum")
            counts += _metric(text, "matrixserve_engine_expert_iteration_seconds_count")
            moe += _metric(text, "matrixserve_engine_expert_moe_seconds_sum")
        return cls(sums, counts, moe)

    def mean_ms_since(self, before: Iterations) -> float:
        n = self.counts - before.counts
        return 1000 * (self.sums - before.sums) / n if n else 0.0

    def moe_ms_since(self, before: Iterations) -> float:
        n = self.counts - before.counts
        return 1000 * (self.moe - before.moe) / n if n else 0.0


def predicted_ms(url: str) -> float:
    """A client's iteration of :data:`BATCH` requests at §7.1's context, as it predicts it."""
    body = {"batch": BATCH, "kvTokens": PAPER_CONTEXT}
    answer = httpx.post(f"{url}/v1/attention/step", json=body, timeout=10, trust_env=False)
    return round(1000 * float(answer.json()["seconds"]), 2)


def filled(load: ClosedLoad, urls: list[str], streams: int) -> None:
    """Start ``streams`` on each client, and return once each iterates with its batch full
    (its model loaded, its requests prefilled), :data:`WARM_S` later."""
    for url in urls:
        load.add(url, streams)

    def full() -> bool:
        for url in urls:
            text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
            if _metric(text, "matrixserve_engine_decode_batch_size") < streams:
                return False
        return True

    poll(full, 300, f"{streams} requests decoding on each client", every=1)
    time.sleep(WARM_S)


def steady(bench: Bench, load: ClosedLoad, urls: list[str], seconds: float) -> dict[str, Any]:
    """Throughput, ITL p99 and the clients' iteration over the next ``seconds``, with the
    host's idle share."""
    cpu, iters = host_cpu(), Iterations.read(urls)
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    gaps = sorted(load.gaps_between(start, end))
    after = Iterations.read(urls)
    return {
        "tokens_per_s": round(load.rate(start, end), 2),
        "itl_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 2) if gaps else None,
        "iteration_ms": round(after.mean_ms_since(iters), 2),
        "moe_ms": round(after.moe_ms_since(iters), 2),
        "host_idle": host_idle_since(cpu),
        "start": start,
        "end": end,
    }


# --------------------------------------------------------------------------- (a) failover
@dataclass
class Window:
    victim: str
    killed: float
    restored: float | None  # the controller's restoredAt for this failover (wall s)
    rate: float | None  # tokens per wall s over the window
    before: float  # tokens per wall s over the BEFORE_S s before the kill, the pool whole
    host_idle: float


def kill(bench: Bench, victim: str) -> float:
    """SIGKILL the engine of ``victim``'s pod; the wall time of the kill."""
    (pid,) = bench.pods()[victim].pids
    os.kill(pid, signal.SIGKILL)
    return time.time()


def epoch(stored: Any) -> float:
    """A status time (RFC 3339, as the controller stores it) in epoch seconds; 0 if absent."""
    return rfc3339.parse(stored) or 0.0


def restored_after(bench: Bench, victim: str, killed: float) -> float | None:
    """The wall time the controller found every expert back to its copies after the failover
    of ``victim`` (``lastFailover.restoredAt``); None past :data:`RESTORE_BOUND_S`."""

    def restored() -> float | None:
        f = bench.status().get("lastFailover") or {}
        if victim in (f.get("servers") or []) and epoch(f.get("at")) >= killed - 1:
            return epoch(f.get("restoredAt")) or None
        return None

    try:
        return float(poll(restored, RESTORE_BOUND_S, f"{victim}'s copies restored", every=0.25))
    except TimeoutError:
        return None


def whole_for(
    bench: Bench, load: ClosedLoad, urls: list[str], label: str, servers: bool
) -> dict[str, Any]:
    """The :data:`BEFORE_S` s of steady load a kill is held against: once the pool is whole
    again (and :data:`GAP_S` later: every client has the map in force), measured while it
    stays whole (measured again if it did not); with ``servers``, the servers' token rate
    over it too."""
    while True:
        poll(lambda: bench.settled(SERVERS), 300, f"{label}: the pool whole again", every=0.5)
        time.sleep(GAP_S)
        version = bench.status().get("mapVersion")
        tokens = server_tokens(bench.info) if servers else {}
        before = steady(bench, load, urls, BEFORE_S)
        if servers:
            before["server_tokens_per_s"] = round(server_rate(tokens, server_tokens(bench.info)), 1)
        if bench.settled(SERVERS) is not None and bench.status().get("mapVersion") == version:
            return before
        print(f"  {label}: the map moved while measuring; again", flush=True)


def failovers(
    bench: Bench, load: ClosedLoad, urls: list[str], label: str
) -> tuple[list[Window], dict[str, Any]]:
    """:data:`KILLS` servers killed one at a time, each once the pool is whole again and each
    held against the :data:`BEFORE_S` s before it (EaaS §5.4 gives one rate before; ours per
    kill, so that what the load does over the run, its requests ending and starting again,
    is no part of a window's figure); and the first kill's steady figures."""
    windows: list[Window] = []
    first: dict[str, Any] = {}
    for victim in VICTIMS[:KILLS]:
        before = whole_for(bench, load, urls, label, servers=not first)
        if not first:  # the clients' own figures at the full load, the pool whole
            before["predicted_3k_ms"] = predicted_ms(urls[0])
            first = before
        cpu = host_cpu()
        killed = kill(bench, victim)
        restored = restored_after(bench, victim, killed)
        rate = load.rate(killed, restored) if restored is not None else None
        window = Window(
            victim, killed, restored, rate, before["tokens_per_s"], host_idle_since(cpu)
        )
        windows.append(window)
        took = f"{restored - killed:.1f} s" if restored is not None else "not restored"
        loss = f"{1 - rate / window.before:.2%}" if rate is not None and window.before else "-"
        print(
            f"  {label}: {victim} killed, copies restored after {took}; "
            f"{window.before:.1f} -> {rate or 0:.1f} tokens/s ({loss})",
            flush=True,
        )
        if restored is None:
            break
    return windows, first


def failover_figures(windows: list[Window]) -> dict[str, Any]:
    losses = [1 - w.rate / w.before for w in windows if w.rate is not None and w.before > 0]
    return {
        "loss": round(statistics.mean(losses), 4) if losses else None,
        "loss_max": round(max(losses), 4) if losses else None,
        "window_s": round(statistics.mean(w.restored - w.killed for w in windows if w.restored), 1)
        if any(w.restored for w in windows)
        else None,
        "restored": sum(1 for w in windows if w.restored is not None),
        "host_idle": round(min(w.host_idle for w in windows), 3) if windows else None,
    }


def part_a(bench: Bench, mode: str) -> dict[str, Any]:
    """The kills under the full load of clients in ``mode``."""
    urls = bench.start_clients(CLIENTS, mode)
    with ClosedLoad(PROMPT_TOKENS, seed=1) as load:
        filled(load, urls, BATCH)
        windows, before = failovers(bench, load, urls, mode)
        print(f"  {mode}: before the first kill {json.dumps(before)}", flush=True)
        end = max((w.restored or w.killed) for w in windows) + 2.0
        failed = load.failed_between(windows[0].killed, end) if windows else []
    bench.stop_clients(urls)
    figures = failover_figures(windows)
    return figures | {
        "before": before,
        "server_tokens_per_s": before["server_tokens_per_s"],
        "failed": len(failed),
        "failed_codes": sorted({f.outcome for f in failed}),
        "windows": [
            {
                "victim": w.victim,
                "s": round(w.restored - w.killed, 1) if w.restored else None,
                "tokens_per_s_before": round(w.before, 1),
                "tokens_per_s": round(w.rate, 1) if w.rate is not None else None,
            }
            for w in windows
        ],
    }


# --------------------------------------------------------------------------- (b) scale-down
def part_b(bench: Bench, server_rate: float) -> dict[str, Any]:
    """The load falls to 5120 equivalent requests: 64 servers' figures, then the autoscaler's
    count's, at that load."""
    urls = bench.start_clients(CLIENTS, "eaas")
    streams = round(BATCH * LOW_LOAD / FULL_LOAD)
    target = max(1, round(server_rate / SERVERS))  # per server at the full load on 64
    with ClosedLoad(PROMPT_TOKENS, LOW_OUTPUTS, seed=2) as load:
        filled(load, urls, streams)
        time.sleep(TURNOVER_S)  # the requests' ages (their contexts) as they will stay
        at_64 = steady(bench, load, urls, MEASURE_S)
        print(f"  64 servers at {LOW_LOAD} equivalent: {json.dumps(at_64)}", flush=True)
        bench.patch(
            {
                "autoscaling": {
                    "enabled": True,
                    "maxServers": SERVERS,
                    "targetTokensPerServerPerSecond": target,
                }
            }
        )
        enabled = time.time()

        def put() -> dict[str, Any] | None:
            s = bench.settled()
            last = (s or {}).get("lastScale") or {}
            quiet = time.time() - max(epoch(last.get("at")), enabled)
            return s if s is not None and quiet >= STAYS_PUT_S else None

        settled = poll(put, SCALE_BOUND_S, "the autoscaler's count to stay put", every=1)
        servers = int(settled["wantedServers"])
        print(
            f"  the autoscaler: {SERVERS} -> {servers} servers after {time.time() - enabled:.0f} s",
            flush=True,
        )
        at_n = steady(bench, load, urls, MEASURE_S)
        print(f"  {servers} servers at {LOW_LOAD} equivalent: {json.dumps(at_n)}", flush=True)
        failed = load.failed_between(at_64["start"], at_n["end"])
    bench.patch({"autoscaling": {"enabled": False}})
    bench.stop_clients(urls)
    return {
        "servers_before": SERVERS,
        "servers_after": servers,
        "target": target,
        "scale_s": round(time.time() - enabled, 1),
        "at_64": at_64,
        "at_n": at_n,
        "throughput_ratio": round(at_n["tokens_per_s"] / at_64["tokens_per_s"], 4),
        "itl_p99_ratio": round(at_n["itl_p99_ms"] / at_64["itl_p99_ms"], 4)
        if at_n["itl_p99_ms"] and at_64["itl_p99_ms"]
        else None,
        "failed": len(failed),
    }


# --------------------------------------------------------------------------- (c) EPLB
def forward_probe(url: str) -> dict[str, float]:
    """xDeepServe Fig. 11b's forward (EP288, a 1K sequence: one per expert rank; ours one per
    server, :data:`FORWARD_REQUESTS` of :data:`FORWARD_TOKENS`), made through the servers by
    a client (``/v1/attention/step`` with ``send``) :data:`PROBES` times: its MoE part (each
    MoE layer's slowest server, summed: what EPLB acts on) and the whole forward (attention
    of every sequence on the client's one die included), mean emulated ms."""
    body = {
        "batch": FORWARD_REQUESTS,
        "kvTokens": FORWARD_TOKENS // 2,  # the mean context a token of the sequence sees
        "tokensPerRequest": FORWARD_TOKENS,
        "send": True,
    }
    answers = []
    for _ in range(PROBES):
        answer = httpx.post(f"{url}/v1/attention/step", json=body, timeout=900, trust_env=False)
        answer.raise_for_status()
        answers.append(answer.json())
    return {
        "moe_ms": round(1000 * statistics.mean(a["moeSeconds"] for a in answers), 2),
        "forward_ms": round(1000 * statistics.mean(a["seconds"] for a in answers), 2),
    }


def part_c(bench: Bench) -> dict[str, Any]:
    """Zipf clients: the forward probe and the decode iteration before and after the
    controller's rebalance."""
    urls = bench.start_clients(CLIENTS, "eaas", "zipf")
    servers = len(bench.status().get("servers") or [])
    with ClosedLoad(PROMPT_TOKENS, seed=3) as load:
        filled(load, urls, BATCH)
        without = steady(bench, load, urls, MEASURE_S)
        without["probe"] = forward_probe(urls[0])
        print(f"  zipf, no rebalance: {json.dumps(without)}", flush=True)
        asked = time.time()
        bench.patch({"rebalance": {"intervalSeconds": 10, "imbalancePercentThreshold": 20}})

        def rebalanced() -> dict[str, Any] | None:
            s = bench.settled()
            r = (s or {}).get("lastRebalance") or {}
            done = r.get("outcome") == "Completed" and epoch(r.get("at")) >= asked
            return s if done else None

        try:
            status = poll(rebalanced, EPLB_BOUND_S, "the rebalance completed", every=1)
        except TimeoutError as exc:
            print(f"  no rebalance: {exc}", flush=True)
            status = None
        with_eplb = None
        if status is not None:
            print(
                f"  rebalanced after {time.time() - asked:.0f} s: "
                f"{json.dumps(status.get('lastRebalance'))}",
                flush=True,
            )
            # no second rebalance under the figures: the next one's imbalance is against the
            # new map's (a threshold no load reaches)
            bench.patch({"rebalance": {"intervalSeconds": 10, "imbalancePercentThreshold": 1000}})
            time.sleep(WARM_S)
            with_eplb = steady(bench, load, urls, MEASURE_S)
            with_eplb["probe"] = forward_probe(urls[0])
            print(f"  zipf, rebalanced: {json.dumps(with_eplb)}", flush=True)
        failed = load.failed_between(without["start"], time.time())
    bench.stop_clients(urls)

    def reduction(key: str, of: str | None = None) -> float | None:
        if not with_eplb:
            return None
        a, b = (with_eplb[of], without[of]) if of else (with_eplb, without)
        return round(1 - a[key] / b[key], 4) if b.get(key) else None

    return {
        "servers": servers,
        "without": without,
        "with": with_eplb,
        "reduction": reduction("moe_ms", "probe"),
        "forward_reduction": reduction("forward_ms", "probe"),
        "decode_iteration_reduction": reduction("iteration_ms"),
        "decode_moe_reduction": reduction("moe_ms"),
        "rebalance": status.get("lastRebalance") if status else None,
        "hot_experts": status.get("hotExperts") if status else None,
        "failed": len(failed),
    }


# --------------------------------------------------------------------------- the run
def main(work: Path) -> int:
    dev = DevCluster(work / "cluster")
    began = time.monotonic()
    info = dev.up(
        timeout=240,
        superpods=1,
        servers=NODES,
        emulator_flags=("--npus-per-server", str(NPUS_PER_NODE)),
    )
    sup = Supervisor(work / "processes")
    parts: dict[str, Any] = {}
    bench: Bench | None = None
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            make_namespace(client.CoreV1Api(api), NAMESPACE)
            metrics, liveness = free_ports(2)
            sup.start(
                "operator",
                [
                    *(sys.executable, "-m", "matrixserve", "--zookeeper", info.zookeeper),
                    *("--namespace", NAMESPACE, "--no-webhook", "--engine-time-scale", str(SCALE)),
                    *SERVER_FLAGS,
                    *("--metrics-port", str(metrics), "--liveness-port", str(liveness)),
                    *("--log-level", "WARNING"),
                ],
                env=cluster_env(info),
            )
            bench = Bench(info, api, sup)
            bench.custom.create_namespaced_custom_object(
                *WHERE, NAMESPACE, KIND.plural, pool_body()
            )
            poll(lambda: bench.settled(SERVERS), 600, f"{SERVERS} servers serving", every=1)
            print(f"pool of {SERVERS} serving after {time.monotonic() - began:.0f} s", flush=True)
            run_part(parts, "a", "(a) failover, EaaS clients", part_a, bench, "eaas")
            run_part(parts, "a_baseline", "(a) failover, monolithic", part_a, bench, "monolithic")
            rate = (parts.get("a") or {}).get("server_tokens_per_s")
            if "b" in PARTS and not rate:
                rate = full_rate(bench)
            run_part(parts, "b", "(b) the load falls; the autoscaler", part_b, bench, rate)
            run_part(parts, "c", "(c) EPLB under Zipf popularity", part_c, bench)
    finally:
        if bench is not None:
            for name in list(bench.clients):
                sup.stop(name, grace=5)
        sup.stop("operator", grace=10)
        dev.down()
    parts["wall_s"] = round(time.monotonic() - began, 1)
    return report(parts)


def run_part(parts: dict[str, Any], key: str, title: str, fn: Any, *args: Any) -> None:
    """One part, if asked (``BENCH_PARTS``), its figures printed as they come; a part that
    fails is said and the others still run (the JSON is then not written)."""
    if key[0] not in PARTS:
        return
    print(title, flush=True)
    try:
        parts[key] = fn(*args)
    except Exception as exc:  # the run goes on; the report says what is missing
        print(f"  {key} failed: {type(exc).__name__}: {exc}", flush=True)
        parts.setdefault("failed_parts", []).append(key)
        return
    print(f"  {key}: {json.dumps(parts[key])}", flush=True)


def full_rate(bench: Bench) -> float:
    """The servers' token rate under the full load (when (a) did not measure it)."""
    urls = bench.start_clients(CLIENTS, "eaas")
    with ClosedLoad(PROMPT_TOKENS, seed=4) as load:
        filled(load, urls, BATCH)
        tokens = server_tokens(bench.info)
        time.sleep(BEFORE_S)
        rate = server_rate(tokens, server_tokens(bench.info))
    bench.stop_clients(urls)
    return rate


def report(parts: dict[str, Any]) -> int:
    a, base, b, c = (parts.get(k) or {} for k in ("a", "a_baseline", "b", "c"))
    before = a.get("before") or {}
    results: dict[str, Any] = {
        "servers": SERVERS,
        "clients": CLIENTS,
        "time_scale": SCALE,
        "iteration_ms": before.get("iteration_ms"),
        "killed": len(a.get("windows") or []),
        "failover_throughput_loss": a.get("loss"),
        "failover_throughput_loss_max": a.get("loss_max"),
        "failover_failed": a.get("failed"),
        "baseline_failover_throughput_loss": base.get("loss"),
        "scale_down_servers_before": b.get("servers_before"),
        "scale_down_servers_after": b.get("servers_after"),
        "scale_down_throughput_ratio": b.get("throughput_ratio"),
        "scale_down_itl_p99_ratio": b.get("itl_p99_ratio"),
        "eplb_latency_reduction": c.get("reduction"),
        # more (never renamed above)
        "paper_iteration_ms": PAPER_ITERATION_MS,
        "iteration_ms_predicted_at_3k_context": before.get("predicted_3k_ms"),
        "batch_per_client": BATCH,
        "equivalent_requests_per_request": round(EQUIVALENT, 3),
        "slots_per_server": SLOTS,
        "min_replicas_per_expert": COPIES,
        "redundant_expert_budget": BUDGET,
        "coverage_bound": coverage_bound(),
        "failover_window_s_mean": a.get("window_s"),
        "failover_tokens_per_s_before": before.get("tokens_per_s"),
        "failover_host_idle_before": before.get("host_idle"),
        "failover_host_idle_min": a.get("host_idle"),
        "failover_windows": json.dumps(a.get("windows")),
        "baseline_killed": len(base.get("windows") or []),
        "baseline_failover_throughput_loss_max": base.get("loss_max"),
        "baseline_failover_failed": base.get("failed"),
        "baseline_failover_window_s_mean": base.get("window_s"),
        "baseline_failover_windows": json.dumps(base.get("windows")),
        "scale_down_target_tokens_per_server_per_second": b.get("target"),
        "scale_down_seconds": b.get("scale_s"),
        "scale_down_failed": b.get("failed"),
        "scale_down_at_64": json.dumps(b.get("at_64")),
        "scale_down_at_after": json.dumps(b.get("at_n")),
        "eplb_servers": c.get("servers"),
        "eplb_forward_tokens": FORWARD_REQUESTS * FORWARD_TOKENS,
        "eplb_forward_moe_ms_without": _probe(c.get("without"), "moe_ms"),
        "eplb_forward_moe_ms_with": _probe(c.get("with"), "moe_ms"),
        "eplb_forward_ms_without": _probe(c.get("without"), "forward_ms"),
        "eplb_forward_ms_with": _probe(c.get("with"), "forward_ms"),
        "eplb_forward_reduction": c.get("forward_reduction"),
        "eplb_iteration_ms_without": (c.get("without") or {}).get("iteration_ms"),
        "eplb_iteration_ms_with": (c.get("with") or {}).get("iteration_ms"),
        "eplb_decode_iteration_reduction": c.get("decode_iteration_reduction"),
        "eplb_decode_moe_ms_without": (c.get("without") or {}).get("moe_ms"),
        "eplb_decode_moe_ms_with": (c.get("with") or {}).get("moe_ms"),
        "eplb_decode_moe_reduction": c.get("decode_moe_reduction"),
        "eplb_hot_experts": json.dumps(c.get("hot_experts")),
        "eplb_rebalance": json.dumps(c.get("rebalance")),
        "eplb_failed": c.get("failed"),
        "server_flags": " ".join(SERVER_FLAGS),
        "wall_s": parts.get("wall_s"),
    }
    print_table(results)
    wanted = ("failover_throughput_loss", "baseline_failover_throughput_loss")
    done = all(results[k] is not None for k in wanted) and bool(b) and bool(c)
    failed = parts.get("failed_parts")
    why = SUBSET or ("" if done and not failed else f"an incomplete run ({failed or 'figures'})")
    write_results(RESULTS, results, why)
    return 0 if SUBSET or (done and not failed) else 1


def _probe(figures: dict[str, Any] | None, key: str) -> float | None:
    return ((figures or {}).get("probe") or {}).get(key)


def coverage_bound() -> int:
    return -(-(EXPERTS * COPIES + BUDGET) // SLOTS)


def _error(ms: float | None) -> float | None:
    return None if ms is None else abs(ms / PAPER_ITERATION_MS - 1)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def print_table(r: dict[str, Any]) -> None:
    def row(what: str, ours: Any, base: Any, target: str) -> None:
        print(f"{what:<44}{ours!s:>16}{base!s:>16}   {target}")

    print(
        f"\nExpertPool: {r['servers']} expert servers ({SLOTS} slots, {COPIES} copies + "
        f"{BUDGET} redundant per layer, coverage bound {r['coverage_bound']}), {r['clients']} "
        f"attention clients x {BATCH} requests (1 die each: xDeepServe §7.1's shape); engines "
        f"at time scale {r['time_scale']}; one request of ours = "
        f"{r['equivalent_requests_per_request']:.2f} of EaaS's (8192 = {CLIENTS} x {BATCH}); "
        f"server pods: {r['server_flags']}"
    )
    print(
        f"host CPU idle: {_pct(r['failover_host_idle_before'])} under the full load, "
        f"{_pct(r['failover_host_idle_min'])} at the busiest failover window"
    )
    print(f"{'':<44}{'ours':>16}{'baseline':>16}   target (paper)")
    row(
        "iteration (ms, clients' measure, ~500 context)",
        r["iteration_ms"],
        "-",
        f"xDeepServe §7.1: {PAPER_ITERATION_MS} (3K context)",
    )
    row(
        "iteration (ms, clients' prediction, 3K)",
        r["iteration_ms_predicted_at_3k_context"],
        "-",
        f"error {_pct(_error(r['iteration_ms_predicted_at_3k_context']))} (<= 10%)",
    )
    row(
        f"(a) throughput loss, mean of {r['killed']} / {r['baseline_killed']} kills",
        _pct(r["failover_throughput_loss"]),
        _pct(r["baseline_failover_throughput_loss"]),
        "<= 2% (EaaS §5.4); baseline halts",
    )
    row(
        "(a) throughput loss, worst window",
        _pct(r["failover_throughput_loss_max"]),
        _pct(r["baseline_failover_throughput_loss_max"]),
        "<= 5%",
    )
    row(
        "(a) failed requests",
        r["failover_failed"],
        r["baseline_failover_failed"],
        "0",
    )
    row(
        "(a) window: kill -> coverage restored (s)",
        r["failover_window_s_mean"],
        r["baseline_failover_window_s_mean"],
        "",
    )
    after, before = r["scale_down_servers_after"], r["scale_down_servers_before"]
    saved = 1 - after / before if after and before else None
    row(
        f"(b) servers at {LOW_LOAD} eq. (autoscaler, live)",
        f"{before} -> {after}" if after else "-",
        f"{SERVERS} (static)",
        f">= 37.5% fewer (EaaS §5.3): {_pct(saved)}",
    )
    row(
        "(b) throughput vs 64 at the same load",
        _pct(r["scale_down_throughput_ratio"]),
        "100%",
        ">= 98%",
    )
    row(
        "(b) ITL p99 vs 64 at the same load", _pct(r["scale_down_itl_p99_ratio"]), "100%", "<= 105%"
    )
    row(
        f"(c) MoE of a {r['eplb_forward_tokens']}-token forward (ms)",
        r["eplb_forward_moe_ms_with"],
        r["eplb_forward_moe_ms_without"],
        "with EPLB vs without (Fig. 11b: EP288, 1K sequence)",
    )
    row(
        "(c) EPLB latency reduction (that MoE part)",
        _pct(r["eplb_latency_reduction"]),
        "-",
        ">= 40% (xDeepServe Fig. 11b)",
    )
    row(
        "(c) the whole forward (ms; attention on 1 die)",
        r["eplb_forward_ms_with"],
        r["eplb_forward_ms_without"],
        f"reduction {_pct(r['eplb_forward_reduction'])}",
    )
    row(
        f"(c) decode iteration, Zipf (ms, {r['eplb_servers']} servers)",
        r["eplb_iteration_ms_with"],
        r["eplb_iteration_ms_without"],
        f"reduction {_pct(r['eplb_decode_iteration_reduction'])}",
    )
    row(
        "(c) decode iteration's MoE part (ms)",
        r["eplb_decode_moe_ms_with"],
        r["eplb_decode_moe_ms_without"],
        f"reduction {_pct(r['eplb_decode_moe_reduction'])}",
    )
    print(
        "throughput: tokens reaching the load per wall s; a window runs from the kill to the "
        "controller's restoredAt, against the "
        f"{BEFORE_S:.0f} s before that kill (the pool whole); ITL: the engine's step over its tokens "
        "(emulated); (b)'s target: the servers' token rate at the full load over 64 "
        f"({r['scale_down_target_tokens_per_server_per_second']}/s per server, wall); whole "
        f"run {r['wall_s']} s"
    )


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-expertpool-"))
