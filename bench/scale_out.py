"""Benchmark: scale a group out by 64 instances by each of DeepServe's paths, side by side in one
run (issue 18; DeepServe §6, Figs. 9-11: "scale up to 64 instances in parallel within seconds").

Setup: a private dev cluster whose node emulator has two SuperPods of ``SERVERS`` 8-NPU servers,
every server's local SSD holding the model (``--ssd-models``), the operator and the gateway; a
PDGroup of 1 prefill + 1 decode Llama3-8B instances of **one NPU** each (DeepServe's Fig. 11 runs
Llama3-8B at TP1 on a 910B die; a 910C NPU is two dies, so TP2 here), engines at time scale 1
(every engine phase takes its emulated time in wall time). Three clients stream completions
through the gateway throughout, chat-sized prompts (~1,500 tokens, bench-ratio's chat mix: a
TTFT of ~50 ms; a 48-token prompt's ~4 ms TTFT is nothing but the processes' HTTP handling).

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
  source prefill and TPOT (the gaps between tokens) of those on the source decode, over the
  source's own forks (from the first fork it served to the last one's answer: its
  ``/v1/info``'s ``forkWindows``) against the 10 s before the patch (``p_source_tpot_change``,
  ``p_source_ttft_change``: fractions; ``p_source_*_samples``: how many gaps and first tokens
  fell in the fork window; the larger of the two forks' is the top level's, the issue's
  ``source_tpot_change``), and over the whole scale-out (``..._scaleout``: 64 engine processes
  becoming engines on this machine's two cores slow every process, the sources' included);
- for every warm path, the same over the new instances' loads (``source_*_change_loads``: from
  the first TE-Load's start to the last one's end, placed by each claim's time, ``readyAfter``
  and phases): the paths without a fork (SSD, DRAM) are the fork paths' baseline in the same
  run, the same processes starting at once without a fork;
- for the fork runs, before the scale-out, the same sources over **played** forks
  (``source_*_change_played``): 80 rounds, 0.5 s apart, of 32 fork targets per source (one
  scale-out's fan-out), each a real ``POST /v1/fork`` from ``bench/fork_player.py`` with the
  assignment the operator would write, but no target engine: the sources share the machine with
  no new engine process, so what they lose is the fabric model's (their links shared with the
  broadcast) and their own handling of the requests. The player, the targets' side, runs at
  the lowest CPU priority (``nice 19``): on a SuperPod the targets are other servers, whose work
  takes nothing from the source's. Each round (from its first request to its last answer)
  against the pause before it, over the same rounds, a sample touching a round counting as
  during it: the clients' closed loops drift over tens of seconds, which a window before would
  count as the fork's; the standard error by a bootstrap over rounds
  (``source_*_change_se_played``); and against the 30 s before the first round
  (``..._vs_before``). The **control** (``source_*_change_control``): the same requests with a
  key that is not the source's, refused after the same gate (a ZooKeeper read each): the
  requests' own cost on this machine without any broadcast. ``source_tpot_change`` and
  ``source_ttft_change`` (the issue's, over the scale-out's own forks) and
  ``source_*_change_played`` at the top level are the larger of UB's and RoCE's;
- ``p_fallbacks``: new instances whose weights did not come by the path's source.

Then the same five paths for one large model (``large_`` keys): GPT-3 175B (350 GB of FP16
weights) on one 8-NPU server per instance, scaled by 4 instances (``BENCH_LARGE_INSTANCES``; 64
would be 512 NPUs and 64 engine processes at once), engines at time scale 10 (its cold start is
167 emulated s per loader alone); ``BENCH_LARGE=0`` skips it.

Writes ``bench/results/scale_out.json`` (issue 18's keys: ``instances``, ``p_emulated_s`` and
``p_wall_s`` for ``cold``, ``warm_ssd``, ``warm_dram``, ``fork_ub``, ``fork_roce``, and
``source_tpot_change``) and prints the table. ``BENCH_PATHS=fork_ub,cold`` runs a subset (the
JSON is then not written); ``BENCH_INSTANCES`` changes the 64; ``BENCH_PLAYED_ONLY=1`` stops each
fork run after its played forks (no pool, no scale-out).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
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
from enginestub import calibration as cal
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import DevCluster, free_ports
from matrixserve.devcluster.procs import Supervisor
from matrixserve.domain.conditions import is_true
from testkit.chaoskit import Request, Traffic
from testkit.helpers import poll

RESULTS = REPO / "bench" / "results" / "scale_out.json"
SCALE = "1"  # engines' emulated seconds per wall second: the totals are both clocks at once
INSTANCES = int(os.environ.get("BENCH_INSTANCES", "64"))
NPUS_PER_SERVER = 8
MODEL = "llama3-8b"
GROUP = "g"


@dataclass(frozen=True)
class Case:
    """One model's runs: its keys' prefix, instance size, how many new instances, time scale."""

    prefix: str
    model: str
    npus: int
    instances: int
    scale: str
    decode_batch: int | None = None  # the sample's unless given (GPT-3's KV: 4.5 MiB a token)


CASES = [
    Case("", MODEL, 1, INSTANCES, SCALE),
    # the large model: GPT-3 175B (350 GB of FP16 weights) on one 8-NPU server per instance,
    # scaled by 4 instances (4 servers of a SuperPod; 64 would be 512 NPUs) at time scale 10
    # (its cold start alone is 167 emulated s per loader)
    Case("large_", "gpt3-175b", 8, int(os.environ.get("BENCH_LARGE_INSTANCES", "4")), "10", 16),
]
if os.environ.get("BENCH_LARGE", "1") == "0":
    CASES = CASES[:1]
# per SuperPod: the group's two instances and every new one (or warm pod), one spare server
SERVERS = max(-(-(c.instances + 2) * c.npus // NPUS_PER_SERVER) + 1 for c in CASES)
CLIENTS, MAX_TOKENS = 3, 16
# ~1,500-token prompts (300 times "client i request n ", ~5 tokens each), bench-ratio's chat mix:
# a TTFT of ~50 ms at time scale 1. A 48-token prompt's TTFT is ~4 ms, nothing but the processes'
# own HTTP handling, where a millisecond of a loaded 2-core machine's scheduling is 25 %.
PROMPT_REPEAT = 300
BEFORE_S = 10.0
# the played forks: rounds of FORK_FANOUT targets per source (one scale-out's fan-out), PAUSE_S
# apart (one round of an 8B model is a fraction of a second: too few tokens to measure)
PLAYED_ROUNDS = int(os.environ.get("BENCH_PLAYED_ROUNDS", "80"))
PLAYED_PAUSE_S = 0.5
# the played forks' "before": long enough that its mean TTFT (3 clients queueing at one prefill:
# first tokens of ~40 ms or ~80 ms) is known to a few per cent
PLAYED_BEFORE_S = 30.0
WARMUP_S = 5.0  # the clients' first seconds, before the played forks' "before": left out
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
PLAYED_ONLY = os.environ.get("BENCH_PLAYED_ONLY") == "1"
if ONLY:
    PATHS = [p for p in PATHS + EXTRA if p[0] in ONLY]


@dataclass
class Env:
    info: Any
    api: client.ApiClient
    namespace: str
    gateway_port: int
    sup: Supervisor
    operator_args: list[str]

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)


def streaming(env: Env) -> Traffic:
    """The clients streaming through the gateway: chat-sized prompts (:data:`PROMPT_REPEAT`)."""
    return Traffic(env.gateway, clients=CLIENTS, max_tokens=MAX_TOKENS, prompt_repeat=PROMPT_REPEAT)


def group_body(case: Case) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(
        (REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text()
    )
    body["metadata"] = {"name": GROUP}
    spec = body["spec"]
    spec["model"] = {"name": case.model}
    for role in ("prefill", "decode"):
        spec[role]["replicas"] = 1
        spec[role]["devicesPerInstance"] = case.npus
        spec[role].pop("parallelism", None)
    if case.decode_batch is not None:
        spec["decode"]["batchSize"] = case.decode_batch
    spec["slo"]["ttftMilliseconds"] = 60000  # refusals come from capacity, not from the SLO
    return body


def pool_body(case: Case, superpod: str, dram: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "shapes": [
            {
                "name": "one",
                "size": case.instances,
                "devicesPerPod": case.npus,
                "nodeSelector": {kinds.LABEL_SUPERPOD: superpod},
            }
        ],
        "refillPolicy": "Manual",  # the claimed pods are not refilled while the run measures
    }
    if dram:
        spec["dramPreload"] = [{"model": case.model}]
    return {
        "apiVersion": kinds.API_VERSION,
        "kind": kinds.WARMPOOL.kind,
        "metadata": {"name": "wp"},
        "spec": spec,
    }


def start_operator(env: Env, case: Case, path: str) -> None:
    allowed = "Cold" if path == "Cold" else f"Cold,{path}"
    env.sup.stop("operator", grace=10)
    env.sup.start(
        "operator",
        [*env.operator_args, "--engine-time-scale", case.scale, "--scale-out-paths", allowed],
        env=cluster_env(env.info),
    )


def start_gateway(env: Env, case: Case) -> None:
    env.sup.stop("gateway", grace=5)
    env.sup.start(
        "gateway",
        gateway_command(
            env.info.zookeeper, env.namespace, env.gateway_port, "--time-scale", case.scale
        ),
        env=cluster_env(env.info),
    )


def group_status(env: Env) -> dict[str, Any]:
    where = (kinds.PDGROUP.group, kinds.PDGROUP.version, env.namespace, kinds.PDGROUP.plural)
    return dict(env.custom.get_namespaced_custom_object(*where, GROUP).get("status") or {})


def group_ready(env: Env) -> bool:
    """Whether the group is Ready; an InvalidSpec ends the run at once, with its message."""
    status = group_status(env)
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready" and c.get("reason") == "InvalidSpec":
            raise RuntimeError(f"the group's spec is refused: {c.get('message')}")
    return is_true(status, "Ready")


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


def gaps(requests: list[Request], decode: str, lo: float, hi: float) -> list[float]:
    """The gaps between tokens (TPOT) of the requests decoded at ``decode``, both tokens in
    ``[lo, hi]`` (wall)."""
    return [
        b - a
        for r in requests
        if r.decode == decode
        for a, b in zip(r.tokens, r.tokens[1:], strict=False)
        if lo <= a and b <= hi
    ]


def ttfts(requests: list[Request], prefill: str, lo: float, hi: float) -> list[float]:
    """TTFT of the requests prefilled at ``prefill`` whose wait for a first token overlaps
    ``[lo, hi]`` (wall)."""
    return [
        r.first_token - r.start
        for r in requests
        if r.prefill == prefill and r.first_token and r.start <= hi and r.first_token >= lo
    ]


def change(before: list[float], during: list[float]) -> float | None:
    if not before or not during:
        return None
    return round(statistics.mean(during) / statistics.mean(before) - 1, 4)


def mean_ms(values: list[float]) -> float | None:
    return round(statistics.mean(values) * 1000, 2) if values else None


def fork_spans(health: zl.Health, since: float) -> list[tuple[float, float]]:
    """The spans (wall) in which the instance served a fork since ``since``, overlapping forks
    merged: what its ``/v1/info`` says (``forkWindows``)."""
    url = f"http://{health.pod_ip}:{health.port}/v1/info"
    try:
        said = httpx.get(url, timeout=5, trust_env=False).json().get("forkWindows", [])
    except (httpx.HTTPError, ValueError):
        return []
    spans: list[tuple[float, float]] = []
    for b, e in sorted((float(b), float(e)) for b, e in said if float(b) >= since):
        if spans and b <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], e))
        else:
            spans.append((b, e))
    return spans


def fork_window(health: zl.Health, since: float) -> tuple[float, float] | None:
    """From the first fork the instance served since ``since`` to its last one's end (wall)."""
    spans = fork_spans(health, since)
    return (spans[0][0], spans[-1][1]) if spans else None


def load_window(env: Env, new: dict[str, zl.Health], scale: float) -> tuple[float, float] | None:
    """When the new instances loaded (wall): from the first TE-Load's start to the last one's
    end, each placed by its claim's time (``matrixserve.io/claim``'s ``at``), its ``readyAfter``
    (from the claim to serving) and its phases; None for pods not claimed (a cold start)."""
    claimed = {}
    for pod in env.core.list_namespaced_pod(
        env.namespace, label_selector=f"{kinds.LABEL_GROUP}={GROUP}"
    ).items:
        record = (pod.metadata.annotations or {}).get(kinds.ANNOTATION_CLAIM)
        instance = (pod.metadata.labels or {}).get(kinds.LABEL_INSTANCE)
        if record and instance:
            claimed[instance] = float(json.loads(record).get("at") or 0)
    spans = []
    for name, h in new.items():
        if not claimed.get(name) or not h.ready_after:
            continue
        end = claimed[name] + h.ready_after - h.phases.get("TEPostLoad", 0.0) / scale
        spans.append((end - h.phases.get("TELoad", 0.0) / scale, end))
    if not spans:
        return None
    return min(b for b, _ in spans), max(e for _, e in spans)


def fork_sources(env: Env, zk: Any) -> dict[str, zl.ForkSource]:
    """The group's fork sources in ZooKeeper's registry, by instance."""
    root = zl.fork_sources_root(env.namespace)
    found = {}
    for key in zk.get_children(root) if zk.exists(root) else []:
        for child in zk.get_children(f"{root}/{key}"):
            raw, _ = zk.get(f"{root}/{key}/{child}")
            if raw:
                source = zl.ForkSource.parse(raw)
                if source.group == f"{env.namespace}/{GROUP}":
                    found[source.instance] = source
    return found


def play_forks(
    env: Env, zk: Any, plane: str, control: bool = False
) -> tuple[int, list[tuple[float, float]]]:
    """Play :data:`PLAYED_ROUNDS` rounds of ``FORK_FANOUT`` fork targets per live source over
    ``plane``, :data:`PLAYED_PAUSE_S` apart (each round one scale-out's fan-out, the next
    starting when it is over): for each target, the assignment the operator would write (naming
    the source: the source's fork gate reads it) and the target's ``POST /v1/fork``
    (``bench/fork_player.py``, a process of its own), answered when the emulated broadcast
    ends. No target engine runs, so the sources share this machine's cores with no
    new engine: what they lose is what the fabric model takes (their links shared with the
    broadcast). ``control``: the same requests with a key that is not the source's, each
    refused (409) after the same gate (its ZooKeeper read): what the requests themselves cost
    the source on this machine, without a broadcast. Returns the forks served and each round's
    span (wall, from its first request to its last answer)."""
    sources = fork_sources(env, zk)
    nodes = {
        n.metadata.name: n.metadata.labels[kinds.LABEL_SUPERPOD] for n in env.core.list_node().items
    }
    warm = zl.WarmPaths(env.namespace)
    rounds: list[list[dict[str, Any]]] = [[] for _ in range(PLAYED_ROUNDS)]
    pods = []
    for source in sources.values():
        superpod = next(
            s for s in sorted(set(nodes.values())) if (s == source.superpod) == (plane == "UB")
        )
        node = next(n for n, s in nodes.items() if s == superpod)
        for j in range(PLAYED_ROUNDS * cal.FORK_FANOUT):
            pod, uid, target = f"played-{source.instance}-{j}", str(uuid.uuid4()), f"played-{j}"
            fork = zl.ForkRef(
                group=source.group,
                instance=source.instance,
                podIP=source.pod_ip,
                port=source.port,
                plane=plane,
                key=source.key,
            )
            assignment = zl.Assignment(
                podUid=uid,
                group=f"{env.namespace}/{GROUP}",
                instance=target,
                env={},
                loadSource=f"NPUFork{plane}",
                fork=fork,
                ts=time.time(),
            )
            zk.create(warm.assignment(pod), assignment.dump(), makepath=True)
            pods.append(pod)
            body = {
                "key": f"control.{source.key}" if control else source.key,
                "target": target,
                "pod": pod,
                "podUid": uid,
                "plane": plane,
                "dies": source.dies,
                "node": node,
                "superpod": superpod,
            }
            url = f"http://{source.pod_ip}:{source.port}/v1/fork"
            rounds[j // cal.FORK_FANOUT].append({"url": url, "body": body})
    try:
        done = subprocess.run(
            # the targets' side at the lowest CPU priority: on a SuperPod the targets run on
            # other servers, so their requests must not take this machine's cores from the
            # sources, the gateway and the clients (what the sources do for the requests they
            # are sent is theirs, at their own priority)
            ["nice", "-n", "19", sys.executable, str(REPO / "bench" / "fork_player.py")],
            input=json.dumps({"pause": PLAYED_PAUSE_S, "rounds": rounds}),
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    finally:
        for pod in pods:
            zk.delete(warm.assignment(pod))
    said = json.loads(done.stdout)
    for refusal in [] if control else said["refused"][:5]:
        print(f"  a played fork was refused: {refusal}", flush=True)
    return int(said["served"]), [(float(b), float(e)) for b, e in said["spans"]]


Sample = tuple[float, float, float]  # (from, to, value): a TTFT or a gap between tokens, wall


def by_rounds(
    samples: list[Sample], rounds: list[tuple[float, float]]
) -> tuple[list[list[float]], list[list[float]]]:
    """The samples of each round: *during* round k if the sample overlaps its span (from its
    first fork request to its last answer), *between* if it lies whole in the pause before it
    (none for the first round: the assignments were being written); the rest (before the first
    round, after the last) is left out. A sample touching a round counts as during it."""
    during: list[list[float]] = [[] for _ in rounds]
    between: list[list[float]] = [[] for _ in rounds]
    for a, b, value in samples:
        for k, (begin, end) in enumerate(rounds):
            if a < end and b > begin:
                during[k].append(value)
                break
            if k and a >= rounds[k - 1][1] and b <= begin:
                between[k].append(value)
                break
    return during, between


def paired_change(
    during: list[list[float]], between: list[list[float]], draws: int = 1000
) -> tuple[float | None, float | None]:
    """The mean during the rounds against the mean between them, minus 1, and its standard
    error by a bootstrap over rounds (a round's samples, one request's gaps among them, are
    not independent of each other: the round is the unit)."""

    def ratio(picked: list[int]) -> float | None:
        nd, nb = sum(len(during[k]) for k in picked), sum(len(between[k]) for k in picked)
        if not nd or not nb:
            return None
        mean_d = sum(sum(during[k]) for k in picked) / nd
        return mean_d / (sum(sum(between[k]) for k in picked) / nb) - 1

    rounds = list(range(len(during)))
    whole = ratio(rounds)
    if whole is None:
        return None, None
    rng = random.Random(0)
    drawn = [
        r for _ in range(draws) if (r := ratio(rng.choices(rounds, k=len(rounds)))) is not None
    ]
    se = statistics.stdev(drawn) if len(drawn) > 1 else None
    return round(whole, 4), (round(se, 4) if se is not None else None)


def measure_played(env: Env, zk: Any, plane: str, src_p: str, src_d: str) -> dict[str, Any]:
    """The sources under load over played forks (:func:`play_forks`): their TTFT and TPOT
    during each round (from its first fork request to its last answer: the gate's reads, the
    broadcast, the answers) against the same sources' in the pause before it, over the same
    rounds (``source_*_change_played``, with its standard error ``..._se_played``): the
    clients' closed loops drift over tens of seconds, which a window before would count as the
    fork's; and against the 30 s before the first round (``..._vs_before``, the clients' first
    5 s left out). Then the control, the same requests refused (``..._control``)."""
    out: dict[str, Any] = {}
    for suffix in ("played", "control"):
        with streaming(env) as traffic:
            time.sleep(WARMUP_S + PLAYED_BEFORE_S)
            t0 = time.time()
            served, rounds = play_forks(env, zk, plane, control=suffix == "control")
            time.sleep(1.0)  # the last answers' tokens
            requests = [r for r in traffic.snapshot() if r.start >= t0 - PLAYED_BEFORE_S]
        if suffix == "played":
            out["forks_played"] = served
        ok = [r for r in requests if r.ok]
        ttft: list[Sample] = [
            (r.start, r.first_token, r.first_token - r.start)
            for r in ok
            if r.prefill == src_p and r.first_token
        ]
        tpot: list[Sample] = [
            (a, b, b - a)
            for r in ok
            if r.decode == src_d
            for a, b in zip(r.tokens, r.tokens[1:], strict=False)
        ]
        before = (t0 - PLAYED_BEFORE_S, t0)
        first, last = (rounds[0][0], rounds[-1][1]) if rounds else (t0, t0)
        for name, samples in (("ttft", ttft), ("tpot", tpot)):
            during, between = by_rounds(samples, rounds)
            changed, se = paired_change(during, between)
            earlier = [v for a, b, v in samples if before[0] <= a and b <= before[1]]
            flat_d = [v for k in during for v in k]
            flat_b = [v for k in between for v in k]
            out |= {
                f"source_{name}_change_{suffix}": changed,
                f"source_{name}_change_se_{suffix}": se,
                f"source_{name}_change_{suffix}_vs_before": change(earlier, flat_d),
                f"source_{name}_between_ms_{suffix}": mean_ms(flat_b),
                f"source_{name}_before_ms_{suffix}": mean_ms(earlier),
                f"source_{name}_samples_{suffix}": len(flat_d),
                f"source_{name}_samples_between_{suffix}": len(flat_b),
            }
        out |= {
            f"rounds_s_{suffix}": round(sum(e - b for b, e in rounds), 3),
            f"requests_failed_{suffix}": sum(
                1 for r in requests if not r.ok and first <= r.start <= last
            ),
        }
    return out


def run_path(
    env: Env, case: Case, key: str, path: str, where: str | None, source: str
) -> dict[str, Any]:
    where_group = (kinds.PDGROUP.group, kinds.PDGROUP.version, env.namespace, kinds.PDGROUP.plural)
    start_operator(env, case, path)
    env.custom.create_namespaced_custom_object(*where_group, group_body(case))
    poll(lambda: group_ready(env), 240, f"{key}: the group Ready", every=0.5)
    zk = zk_client(env.info)
    out: dict[str, Any] = {}
    played: dict[str, Any] = {}
    pool = False  # whether this run made the warm pool (deleted at its end)
    n = case.instances
    src_p, src_d = f"{GROUP}-p-0", f"{GROUP}-d-0"
    try:
        if path.startswith("WarmFork"):
            # first the same sources over played forks, no new engine on this machine
            played = measure_played(env, zk, path.removeprefix("WarmFork"), src_p, src_d)
            if PLAYED_ONLY:
                print(f"  {case.prefix}{key}: {json.dumps(played)}", flush=True)
                return played
        if where is not None:
            home = superpod_of(env, f"{GROUP}-p-0")
            other = next(s for s in superpods(env) if s != home)
            env.custom.create_namespaced_custom_object(
                kinds.WARMPOOL.group,
                kinds.WARMPOOL.version,
                env.namespace,
                kinds.WARMPOOL.plural,
                pool_body(case, home if where == "near" else other, dram=path == "WarmDRAM"),
            )
            pool = True

            def warm() -> bool:
                status = pool_status(env)
                if status.get("ready") != n:
                    return False
                if path != "WarmDRAM":
                    return True
                return all(case.model in row.get("loaded", []) for row in status.get("dram") or [])

            poll(warm, 300, f"{key}: {n} warm pods", every=1.0)
        with streaming(env) as traffic:
            time.sleep(BEFORE_S)
            t0 = time.time()
            env.custom.patch_namespaced_custom_object(
                *where_group, GROUP, {"spec": {"prefill": {"replicas": 1 + n}}}
            )

            def scaled() -> bool:
                status = group_status(env)
                return (status.get("prefill") or {}).get("ready") == 1 + n and is_true(
                    status, "Ready"
                )

            poll(scaled, BOUND_S, f"{key}: {n} new instances serving", every=0.25)
            t1 = time.time()
            requests = [r for r in traffic.snapshot() if r.ok and r.start >= t0 - BEFORE_S]
        every = healths(env, zk)
        new = {n: h for n, h in every.items() if n.startswith(f"{GROUP}-p-") and n != src_p}
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
        if out["emulated_s"] is not None and case.scale == "1":
            # at time scale 1 the engines' phases are wall time too: the rest is the control
            # plane's (Scaler-Pre's pod creation or claim, the assignment, Scaler-Post's joining)
            out["control_plane_s"] = round(out["wall_s"] - out["emulated_s"], 2)
        # the fork sources under load: over the scale-out, and over their own forks (from the
        # first fork each served to the last one's answer), against the 10 s before
        before = (t0 - BEFORE_S, t0)
        out |= {
            "source_ttft_change_scaleout": change(
                ttfts(requests, src_p, *before), ttfts(requests, src_p, t0, t1)
            ),
            "source_tpot_change_scaleout": change(
                gaps(requests, src_d, *before), gaps(requests, src_d, t0, t1)
            ),
            "requests_during": sum(1 for r in requests if t0 <= r.start <= t1),
        }
        # ... and over the new instances' loads, for every warm path alike: the same 64
        # processes becoming engines at once, with a fork or without (the no-fork paths are the
        # fork's baseline, measured in the same run)
        loads = load_window(env, new, float(case.scale))
        if loads is not None:
            lo, hi = loads
            out |= {
                "load_window_s": round(hi - lo, 3),
                "source_ttft_change_loads": change(
                    ttfts(requests, src_p, *before), ttfts(requests, src_p, lo, hi)
                ),
                "source_tpot_change_loads": change(
                    gaps(requests, src_d, *before), gaps(requests, src_d, lo, hi)
                ),
                "source_tpot_samples_loads": len(gaps(requests, src_d, lo, hi)),
            }
        if path.startswith("WarmFork"):
            p_window = fork_window(every[src_p], t0) if src_p in every else None
            d_window = fork_window(every[src_d], t0) if src_d in every else None
            during_ttft = ttfts(requests, src_p, *p_window) if p_window else []
            during_tpot = gaps(requests, src_d, *d_window) if d_window else []
            out |= {
                "source_ttft_change": change(ttfts(requests, src_p, *before), during_ttft),
                "source_tpot_change": change(gaps(requests, src_d, *before), during_tpot),
                "source_ttft_samples": len(during_ttft),
                "source_tpot_samples": len(during_tpot),
                "fork_window_s": round(
                    max(w[1] for w in (p_window, d_window) if w)
                    - min(w[0] for w in (p_window, d_window) if w),
                    3,
                )
                if p_window or d_window
                else None,
            }
        out |= played
        print(f"  {case.prefix}{key}: {json.dumps(out)}", flush=True)
    finally:
        zk.stop()
        env.custom.delete_namespaced_custom_object(*where_group, GROUP)
        if pool:
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
    models = ",".join(sorted({c.model for c in CASES}))
    info = dev.up(
        timeout=300,
        superpods=2,
        servers=SERVERS,
        emulator_flags=("--npus-per-server", str(NPUS_PER_SERVER), "--ssd-models", models),
    )
    sup = Supervisor(work / "processes")
    runs: dict[Case, dict[str, dict[str, Any]]] = {}
    try:
        with config.new_client_from_config(config_file=info.kubeconfig) as api:
            install_crds(api)
            namespace = "bench-scale-out"
            make_namespace(client.CoreV1Api(api), namespace)
            metrics, liveness, port = free_ports(3)
            operator = [
                *(sys.executable, "-m", "matrixserve", "--zookeeper", info.zookeeper),
                *("--namespace", namespace, "--no-webhook"),
                *("--metrics-port", str(metrics), "--liveness-port", str(liveness)),
                *("--log-level", "WARNING"),
            ]
            env = Env(info, api, namespace, port, sup, operator)
            for case in CASES:
                start_gateway(env, case)
                runs[case] = {
                    key: run_path(env, case, key, path, where, src)
                    for key, path, where, src in PATHS
                }
    finally:
        sup.stop("gateway", grace=5)
        sup.stop("operator", grace=10)
        dev.down()
    return report(runs)


def report(runs: dict[Case, dict[str, dict[str, Any]]]) -> int:
    main_case = CASES[0]
    results: dict[str, Any] = {
        "group": f"1P+1D {MODEL}, one NPU (two dies) per instance, scaled by {INSTANCES} prefills",
        "engine_time_scale": float(SCALE),
        "clients": CLIENTS,
        "instances": INSTANCES,
    }
    for case, by_path in runs.items():
        if case.prefix:
            results[f"{case.prefix}group"] = (
                f"1P+1D {case.model}, {case.npus} NPUs per instance, scaled by {case.instances}"
                " prefills"
            )
            results[f"{case.prefix}engine_time_scale"] = float(case.scale)
            results[f"{case.prefix}instances"] = case.instances
        for key, figures in by_path.items():  # e.g. fork_ub_emulated_s (the keys)
            for name, value in figures.items():
                results[f"{case.prefix}{key}_{name}"] = value
    # DeepServe's own figure, a secondary source (alphaXiv's reading of Fig. 9), for the table
    results["deepserve_llama3_8b_cold_s"] = cal.DEEPSERVE_COLD_SCALE_SECONDS
    results["deepserve_llama3_8b_fork_s"] = cal.DEEPSERVE_FORK_SCALE_SECONDS
    main_runs = runs.get(main_case, {})
    # The issue's source_tpot_change (and TTFT beside it): over the sources' own forks during
    # the scale-out; and over played forks, no new engine process on this machine (_played).
    # Each the larger of the two forks' (UB, RoCE).
    for name in (
        "source_tpot_change",
        "source_ttft_change",
        "source_tpot_change_played",
        "source_ttft_change_played",
    ):
        seen = [
            float(v)
            for k in ("fork_ub", "fork_roce")
            if (v := main_runs.get(k, {}).get(name)) is not None
        ]
        results[name] = max(seen, key=abs) if seen else None
    if "cold" in main_runs and "fork_ub" in main_runs and main_runs["fork_ub"].get("wall_s"):
        results["fork_ub_speedup_over_cold"] = round(
            main_runs["cold"]["wall_s"] / main_runs["fork_ub"]["wall_s"], 1
        )
    for case, by_path in runs.items():
        print_table(case, by_path)
    subset = [f"BENCH_PATHS={','.join(ONLY)}"] if ONLY else []
    subset += ["BENCH_PLAYED_ONLY=1"] if PLAYED_ONLY else []
    write_results(RESULTS, results, " ".join(subset))
    if subset:
        return 0
    complete = all(
        figures.get("instances") == case.instances
        for case, by_path in runs.items()
        for figures in by_path.values()
    )
    return 0 if complete else 1


def print_table(case: Case, runs: dict[str, dict[str, Any]]) -> None:
    def cell(figures: dict[str, Any], key: str, fmt: Callable[[Any], str] = str) -> str:
        value = figures.get(key)
        return "-" if value is None else fmt(value)

    print(
        f"\nscale-out by {case.instances} instances of {case.model} ({case.npus} NPU each), "
        f"engines at time scale {case.scale}: wall seconds from the patch to all serving; "
        "engine phases in emulated seconds"
    )
    print(
        f"{'path':<12}{'wall':>8}{'engine':>8}{'ctl':>7}{'pre-load':>10}{'load':>8}{'post':>7}"
        f"{'fallback':>9}{'forking':>16}{'control':>16}{'in scale-out':>16}{'loads':>9}"
        f"{'scale-out':>11}{'vs cold':>9}"
    )
    cold = runs.get("cold", {}).get("emulated_s")
    pct: Callable[[Any], str] = lambda v: f"{v:+.1%}"  # noqa: E731

    def pair(figures: dict[str, Any], suffix: str) -> str:
        ttft, tpot = f"source_ttft_change{suffix}", f"source_tpot_change{suffix}"
        return f"{cell(figures, ttft, pct)}/{cell(figures, tpot, pct)}"

    for key, figures in runs.items():
        emulated = figures.get("emulated_s")
        speed = f"{cold / emulated:.1f}x" if cold and emulated else "-"
        print(
            f"{key:<12}{cell(figures, 'wall_s'):>8}{cell(figures, 'emulated_s'):>8}"
            f"{cell(figures, 'control_plane_s'):>7}{cell(figures, 'TEPreLoad_max_s'):>10}"
            f"{cell(figures, 'TELoad_max_s'):>8}{cell(figures, 'TEPostLoad_max_s'):>7}"
            f"{cell(figures, 'fallbacks'):>9}{pair(figures, '_played'):>16}"
            f"{pair(figures, '_control'):>16}{pair(figures, ''):>16}"
            f"{cell(figures, 'source_tpot_change_loads', pct):>9}"
            f"{cell(figures, 'source_tpot_change_scaleout', pct):>11}{speed:>9}"
        )
    print(
        "engine: the slowest new instance's TE-Pre-Load + TE-Load + TE-Post-Load (emulated); "
        "ctl: the rest of the wall total at time scale 1 (pod start or claim, assignment, "
        "joining). The fork sources' TTFT/TPOT change: forking: during each of "
        f"{PLAYED_ROUNDS} rounds of {cal.FORK_FANOUT} played fork targets per source against "
        "the pauses between them, before the scale-out, no new engine process on this machine "
        "(source_*_change_played); control: the same requests refused, no broadcast; in "
        "scale-out: over the sources' own forks during the scale-out (the issue's "
        "source_tpot_change), 64 processes becoming engines on the same cores, against the "
        f"{BEFORE_S:.0f} s before the patch; loads: "
        "the source decode's TPOT over the new instances' loads, any warm path "
        "(a path without a fork is the fork's baseline); scale-out: over the whole scale-out. "
        "vs cold: the engines' emulated speed-up. DeepServe (a secondary source: alphaXiv's "
        f"reading of Fig. 9): Llama3-8B {cal.DEEPSERVE_COLD_SCALE_SECONDS} s "
        f"-> {cal.DEEPSERVE_FORK_SCALE_SECONDS} s"
    )


if __name__ == "__main__":
    sys.exit(run_bench(main, "bench-scale-out-"))
