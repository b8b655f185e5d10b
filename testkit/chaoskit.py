"""Chaos under traffic, the parts three programs share: the chaos test (``test_chaos.py``), the
recovery chaos test (``test_recovery_chaos.py``) and the recovery benchmark (``bench/recovery.py``;
``bench/scale_out.py`` and ``bench/load_player.py`` use its traffic).

- **traffic**: streamed completions through the gateway from client threads, each request's start,
  tokens (wall time of each), end, outcome and the instances it was on — a failed one's too, from
  its error chunk's ``matrixserve`` object (a client can tell whether a failure was on the faulty
  instance);
- **pods** as the node emulator runs them (:class:`PodRun`: UID, server, NPUs, restarts, pids),
  and which of them a fault restarted (:func:`restarted`);
- **faults** injected (:func:`inject`): a die, a whole NPU, a server, one sub-link (the node
  emulator's control API), a hung engine (the engine's ``POST /v1/faults``), a killed engine process
  (kill -9 of its pid); each with its heal;
- **the group whole** in ZooKeeper (:func:`zk_whole`): every desired instance reported,
  healthy (Serving) and linked in its current incarnation, every prefill an entrance, every
  decode in the decode meta, nobody removed; and **clean** (:func:`zk_leftovers`): nothing of
  a gone incarnation or instance left (links, health, reports, entrances, ``removed/``);
- the **served-tokens timeline** (:func:`capacity_lost`): ∫ (served tokens/s before the fault
  - served tokens/s) dt, in seconds of the group's pre-fault output.

:class:`Stage` is what a chaos test runs on (its fixtures live in the test modules).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client

from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.errors import tail
from matrixserve.devcluster.procs import process_start_time
from matrixserve.domain.conditions import is_true
from testkit.helpers import Groups, explain_namespace, poll, wait_for, zookeeper

GROUP = "g"
CLIENTS = 3
MAX_TOKENS = 8
SAMPLE_EVERY = 0.5  # s between Ready samples


# --------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Request:
    """One streamed completion as the client saw it (wall clock, ``time.time()``)."""

    start: float
    end: float
    outcome: str  # "ok"; an error chunk's code; "http <status> <code>"; the client's exception
    first_token: float | None = None
    prefill: str = ""  # the instances it was on (a failed one's from its error chunk, if said)
    decode: str = ""
    tokens: tuple[float, ...] = ()  # when each token chunk arrived

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def refused_up_front(self) -> bool:
        """Failed before its stream began (an HTTP error status, e.g. 503 no_capacity)."""
        return self.outcome.startswith("http ")

    def on(self, instances: Iterable[str]) -> bool:
        """Whether it was on one of ``instances`` (as its prefill or its decode)."""
        return bool({self.prefill, self.decode} & set(instances))


@dataclass
class StreamRead:
    """What the gateway's SSE lines of one streamed completion said, fed line by line (the
    chaos kit's clients and bench-ratio's load player read streams alike)."""

    tokens: list[float] = field(default_factory=list)  # when each token chunk arrived
    error: str = ""  # an error chunk's code
    on: dict[str, Any] = field(default_factory=dict)  # the instances it was on
    final: bool = False  # a choice's last chunk came
    done: bool = False  # ``data: [DONE]``

    def feed(self, line: str, now: float) -> bool:
        """One line read at ``now``; True once the stream says it is done."""
        if line == "data: [DONE]":
            self.done = True
            return True
        if line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "matrixserve" in chunk:  # a choice's last chunk, or a failure's
                self.on = dict(chunk["matrixserve"].get("instances") or {})
            if "error" in chunk:
                self.error = str(chunk["error"].get("code") or "error")
            elif "matrixserve" in chunk:
                self.final = True
            else:
                self.tokens.append(now)
        return False

    @property
    def outcome(self) -> str:
        return "ok" if not self.error and self.final and self.done else self.error or "incomplete"

    @property
    def prefill(self) -> str:
        return str(self.on.get("prefill") or "")

    @property
    def decode(self) -> str:
        return str(self.on.get("decode") or "")


def refused_code(body: bytes) -> str:
    """An HTTP error answer's code (``"?"`` if it has none)."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


def complete(
    http: httpx.Client, gateway: str, prompt: str, max_tokens: int = MAX_TOKENS
) -> Request:
    """A streamed completion through the gateway, with its outcome."""
    body = {"model": "general", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.time()
    read = StreamRead()
    try:
        with http.stream("POST", f"{gateway}/v1/completions", json=body) as response:
            if response.status_code != 200:
                code = refused_code(response.read())
                return Request(start, time.time(), f"http {response.status_code} {code}")
            for line in response.iter_lines():
                if read.feed(line, time.time()):
                    break
    except httpx.HTTPError as exc:
        first = read.tokens[0] if read.tokens else None
        return Request(start, time.time(), type(exc).__name__, first, tokens=tuple(read.tokens))
    first = read.tokens[0] if read.tokens else None
    return Request(
        start, time.time(), read.outcome, first, read.prefill, read.decode, tuple(read.tokens)
    )


@dataclass(frozen=True)
class Sample:
    at: float
    ready: bool
    probe: Request | None  # sent when Ready was True


class Traffic:
    """Steady streamed completions from ``clients`` threads (back to back, each recording start,
    tokens, end and outcome), and, given ``ready``, a sampler reading it every ``SAMPLE_EVERY``
    s that sends a probe request at each True."""

    def __init__(
        self,
        gateway: str,
        ready: Callable[[], bool] | None = None,
        clients: int = CLIENTS,
        max_tokens: int = MAX_TOKENS,
        prompt_repeat: int = 8,
    ) -> None:
        self.gateway = gateway
        self.ready = ready
        self.max_tokens = max_tokens
        self.prompt_repeat = prompt_repeat  # the prompt's phrase this many times (~6 tokens each)
        self.requests: list[Request] = []
        self.samples: list[Sample] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]
        if ready is not None:
            self.threads.append(threading.Thread(target=self._sampler, daemon=True))

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=20, trust_env=False) as http:
            n = 0
            while not self.stopping.is_set():
                prompt = f"client {index} request {n} " * self.prompt_repeat
                request = complete(http, self.gateway, prompt, self.max_tokens)
                with self.lock:
                    self.requests.append(request)
                n += 1
                if not request.ok:
                    time.sleep(0.05)  # a failing group is not hammered (a client backs off)

    def _sampler(self) -> None:
        assert self.ready is not None
        with httpx.Client(timeout=20, trust_env=False) as http:
            while not self.stopping.is_set():
                began = time.monotonic()
                at = time.time()
                try:
                    ready = self.ready()
                except Exception:  # the API server's hiccup is no sample
                    ready = None
                if ready is not None:
                    probe = complete(http, self.gateway, "probe " * 8) if ready else None
                    with self.lock:
                        self.samples.append(Sample(at, ready, probe))
                self.stopping.wait(max(0.0, SAMPLE_EVERY - (time.monotonic() - began)))

    # ------------------------------------------------------------------ queries
    def snapshot(self) -> list[Request]:
        with self.lock:
            return list(self.requests)

    def served(self, after: float, instance: str | None = None) -> Request | None:
        """The request that started after ``after``, succeeded (through ``instance``, as prefill
        or decode, if given) and got its first token first."""
        found = [
            r
            for r in self.snapshot()
            if r.ok
            and r.start >= after
            and r.first_token is not None
            and (instance is None or instance in (r.prefill, r.decode))
        ]
        return min(found, key=lambda r: r.first_token or 0.0, default=None)


def failed_outside(
    requests: Iterable[Request], since: float, faulty: Iterable[str]
) -> list[Request]:
    """The requests in flight at or begun after ``since`` that failed after their stream began
    although they were not on a ``faulty`` instance (a refusal up front, 503 while capacity is
    short, is no failure: the client is told to retry before anything was served)."""
    hit = set(faulty)
    return [
        r
        for r in requests
        if r.end >= since and not r.ok and not r.refused_up_front and not r.on(hit)
    ]


def capacity_lost(
    requests: Iterable[Request], fault: float, until: float, before: float, width: float = 1.0
) -> tuple[float, float]:
    """∫ (served tokens/s before the fault - served tokens/s) dt from ``fault`` to ``until``, in
    seconds of the pre-fault rate (1 s: the whole group's output for a second), from the
    requests' token times in ``width``-s bins; and that rate (tokens/s over the ``before`` s
    before the fault). Tokens of failed requests count: they were served."""
    times = [t for r in requests for t in r.tokens]
    rate = sum(1 for t in times if fault - before <= t < fault) / before
    if rate <= 0:
        return 0.0, 0.0
    bins = max(1, round((until - fault) / width))
    per_bin = [0] * bins
    for t in times:
        if fault <= t < fault + bins * width:
            per_bin[int((t - fault) / width)] += 1
    lost_tokens = sum(rate * width - n for n in per_bin)
    return lost_tokens / rate, rate


# --------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class PodRun:
    """A pod as the node emulator runs it."""

    name: str
    uid: str
    node: str
    npus: tuple[int, ...]
    restarts: int
    pids: tuple[int, ...]
    ip: str = ""


def pod_runs(
    pods: Iterable[dict[str, Any]], namespace: str, live: bool = False
) -> dict[str, PodRun]:
    """The namespace's pods in the node emulator's ``/pods`` answer, by name; ``live``: not
    those being deleted (a pod on a server that went down stays Terminating beside its
    replacement of the same name)."""
    runs = {}
    for p in pods:
        if p["namespace"] != namespace or (live and p.get("terminating")):
            continue
        containers = dict(p["containers"])
        runs[str(p["name"])] = PodRun(
            str(p["name"]),
            str(p["uid"]),
            str(p["node"]),
            tuple(p["npus"]),
            sum(int(c["restarts"]) for c in containers.values()),
            tuple(int(pid) for pid in dict(p["pids"]).values()),
            str(p.get("podIP") or ""),
        )
    return runs


def restarted(before: dict[str, PodRun], after: dict[str, PodRun]) -> dict[str, str]:
    """The pods (by name: an instance's pod is named after it) replaced (a new UID, or gone) or
    restarted (more container restarts) between two looks, each with what happened."""
    changed = {}
    for name, was in before.items():
        now = after.get(name)
        if now is None:
            changed[name] = "gone"
        elif now.uid != was.uid:
            changed[name] = "replaced"
        elif now.restarts > was.restarts:
            changed[name] = f"restarted {now.restarts - was.restarts}"
    return changed


# --------------------------------------------------------------------------- faults

FAULTS = ("die", "npu", "node", "link", "hang", "kill")


@dataclass(frozen=True)
class Target:
    """Where a fault lands: the node emulator's control API, the pods it runs, the instance and
    its engine's endpoint ``host:port`` (a hang goes there); for a link fault, the decode at the
    sub-link's far end (``peer``)."""

    control: str
    pods: dict[str, PodRun]
    instance: str
    endpoint: str = ""
    peer: str = ""


@dataclass(frozen=True)
class Injected:
    """A fault injected: its kind, the instance it hit, when (wall s), what it did, whether its
    effect shows yet (``seen()``: the die or link down in the device status, the node not Ready,
    the engine not answering, the process gone) and how to heal it (``None``: nothing to heal,
    the hit process is gone)."""

    kind: str
    instance: str
    at: float
    detail: str
    seen: Callable[[], bool]
    heal: Callable[[], object] | None = None
    peer: str = ""


def _control(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10, trust_env=False)


def emulator_fault(control: str, heal: bool = False, **body: object) -> dict[str, Any]:
    """Inject (or heal) a fault through the node emulator's control API."""
    with _control(control) as http:
        response = http.request("DELETE" if heal else "POST", "/faults", json=body)
        if not response.is_success:
            raise RuntimeError(f"the emulator refused {body}: {response.text}")
        return dict(response.json())


def engine_fault(endpoint: str, kind: str, heal: bool = False) -> dict[str, Any]:
    """Inject (or heal) a fault through an engine's own ``/v1/faults`` (fault injection on)."""
    with httpx.Client(timeout=10, trust_env=False) as http:
        response = http.request(
            "DELETE" if heal else "POST", f"http://{endpoint}/v1/faults", json={"kind": kind}
        )
        if not response.is_success:
            raise RuntimeError(f"engine {endpoint} refused the {kind} fault: {response.text}")
        return dict(response.json())


def device_status(control: str, node: str) -> dict[str, Any]:
    """A server's device status file, as its pods read it."""
    with _control(control) as http:
        return dict(http.get(f"/nodes/{node}/device-status").json())


def dies_of(control: str, run: PodRun) -> list[dict[str, Any]]:
    """The pod's dies (id, RoCE IP, health) from its server's device status, in NPU order."""
    status = device_status(control, run.node)
    return [d for n in status["npus"] if n["id"] in run.npus for d in n["dies"]]


def node_ready(control: str, node: str) -> bool:
    """Whether the emulator serves the node as up (its status posted, its pods running)."""
    with _control(control) as http:
        return not any(n["down"] for n in http.get("/nodes").json() if n["name"] == node)


def engine_ready(endpoint: str, within: float = 0.5) -> bool:
    """Whether an engine's ``/readyz`` answers 200 within ``within`` s (a hung engine's does
    not: it waits, then answers 503 once the engine has declared its hang)."""
    try:
        answer = httpx.get(f"http://{endpoint}/readyz", timeout=within, trust_env=False)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200


def inject(kind: str, target: Target) -> Injected:
    """Inject one of :data:`FAULTS` on ``target.instance``: ``die`` (the first die of its first
    NPU down), ``npu`` (its first NPU down), ``node`` (its server down), ``link`` (the sub-link
    of device 0 toward ``target.peer``: its first die's link to the peer's first die's RoCE IP
    down, on its side), ``hang`` (its engine's serving hung), ``kill`` (kill -9 of its engine)."""
    run = target.pods[target.instance]
    control = target.control
    if kind in ("die", "npu", "link"):
        die = dies_of(control, run)[0]
        body: dict[str, Any] = {"kind": "die-down", "node": run.node, "die": die["id"]}
        what = f"die-down of die {die['id']} on {run.node}"
        if kind == "npu":
            body = {"kind": "npu-down", "node": run.node, "npu": run.npus[0]}
            what = f"npu-down of NPU {run.npus[0]} on {run.node}"
        if kind == "link":
            far = dies_of(control, target.pods[target.peer])[0]["roceIp"]
            body |= {"kind": "link-down", "peerRoceIp": far}
            what = f"link-down of die {die['id']} on {run.node} toward {target.peer}'s {far}"
        at = time.time()
        emulator_fault(control, **body)
        return Injected(
            kind,
            target.instance,
            at,
            what,
            lambda: _shows(control, body),
            lambda: emulator_fault(control, heal=True, **body),
            target.peer,
        )
    if kind == "node":
        at = time.time()
        emulator_fault(control, kind="node-down", node=run.node)
        return Injected(
            kind,
            target.instance,
            at,
            f"node-down of {run.node}",
            lambda: not node_ready(control, run.node),
            lambda: emulator_fault(control, heal=True, kind="node-down", node=run.node),
        )
    if kind == "hang":
        at = time.time()
        engine_fault(target.endpoint, "hang")
        return Injected(
            kind,
            target.instance,
            at,
            f"engine hang at {target.endpoint}",
            lambda: not engine_ready(target.endpoint),
        )
    if kind == "kill":
        (pid,) = run.pids
        started = process_start_time(pid)
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return Injected(
            kind,
            target.instance,
            at,
            f"kill -9 of engine pid {pid}",
            lambda: process_start_time(pid) != started,
        )
    raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULTS)}")


def _shows(control: str, body: dict[str, Any]) -> bool:
    """Whether the device status of the fault's server says it: the die (or the NPU's dies)
    not Healthy, or the link Down toward the peer's RoCE IP."""
    status = device_status(control, str(body["node"]))
    if body["kind"] == "link-down":
        return any(
            link["die"] == body["die"]
            and link["peerRoceIp"] == body["peerRoceIp"]
            and link["health"] == "Down"
            for link in status.get("links", [])
        )
    dies = [
        d
        for n in status["npus"]
        for d in n["dies"]
        if d["id"] == body.get("die") or n["id"] == body.get("npu")
    ]
    return bool(dies) and all(d["health"] != "Healthy" for d in dies)


# --------------------------------------------------------------------------- status.lastRecovery


def _epoch(stamp: object) -> float | None:
    """An RFC 3339 time as epoch seconds (None if absent)."""
    if not isinstance(stamp, str) or not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class LastRecovery:
    """The group's ``status.lastRecovery`` (the operator's recovery contract), as read."""

    kind: str
    instances: tuple[str, ...]  # the fault's
    detected_by: str
    fault_at: float | None
    detected_at: float | None
    action: str
    plan_instances: tuple[str, ...]
    predicted_s: float | None
    terms: dict[str, float]
    pods_restarted: int | None
    phase: str
    restored_at: float | None
    restored_after_s: float | None
    raw: dict[str, Any]

    @classmethod
    def of(cls, status: dict[str, Any]) -> LastRecovery | None:
        last = status.get("lastRecovery")
        if not isinstance(last, dict) or not last:
            return None
        fault, plan = dict(last.get("fault") or {}), dict(last.get("plan") or {})
        restarted = last.get("podsRestarted")
        predicted = plan.get("predictedRestoreSeconds")
        after = last.get("restoredAfterSeconds")
        return cls(
            str(fault.get("kind", "")),
            tuple(fault.get("instances") or ()),
            str(fault.get("detectedBy", "")),
            _epoch(fault.get("at")),
            _epoch(last.get("detectedAt")),
            str(plan.get("action", "")),
            tuple(plan.get("instances") or ()),
            float(predicted) if predicted is not None else None,
            {str(k): float(v) for k, v in dict(plan.get("terms") or {}).items()},
            int(restarted) if restarted is not None else None,
            str(last.get("phase", "")),
            _epoch(last.get("restoredAt")),
            float(after) if after is not None else None,
            last,
        )

    def since(self, moment: float) -> bool:
        """Whether it is about a fault detected at or after ``moment`` (RFC 3339 keeps whole
        seconds: a second's slack)."""
        return self.detected_at is not None and self.detected_at >= moment - 1.0


# --------------------------------------------------------------------------- the group in ZooKeeper


@dataclass(frozen=True)
class ZkGroup:
    """A group's subtree as read at one moment."""

    reports: dict[str, zl.Report]
    health: dict[str, zl.Health]
    links: dict[str, zl.Link]
    entrances: set[str]
    decodes: set[str]  # the decode meta's
    removed: set[str]
    exists: bool = True


def read_group(zk: Any, namespace: str, group: str) -> ZkGroup:
    """The group's subtree (an absent folder reads empty)."""
    paths = zl.GroupPaths(namespace, group)

    def children(folder: str) -> dict[str, bytes]:
        out = {}
        for child in zk.get_children(folder) if zk.exists(folder) else []:
            with contextlib.suppress(Exception):  # gone meanwhile
                out[child] = zk.get(f"{folder}/{child}")[0]
        return out

    meta = zk.get(paths.decode_meta)[0] if zk.exists(paths.decode_meta) else b""
    return ZkGroup(
        {k: zl.Report.parse(v) for k, v in children(paths.reports).items() if v},
        {k: zl.Health.parse(v) for k, v in children(paths.health).items() if v},
        {k: zl.Link.parse(v) for k, v in children(paths.links).items() if v},
        set(children(paths.entrances)),
        {d.instance for d in zl.DecodeMeta.parse(meta).decodes} if meta else set(),
        set(children(paths.removed)),
        bool(zk.exists(paths.root)),
    )


def zk_whole(g: ZkGroup, prefills: set[str], decodes: set[str]) -> list[str]:
    """Why the group is not serving with every desired instance (empty: it is): each reported,
    Serving and linked to every peer in its current incarnation; every prefill an entrance,
    every decode in the decode meta, none removed."""
    why = []
    for name in sorted(prefills | decodes):
        report, health = g.reports.get(name), g.health.get(name)
        if report is None or health is None:
            why.append(f"{name}: {'no report' if report is None else 'no health'}")
        elif health.incarnation != report.incarnation:
            why.append(f"{name}: health of incarnation {health.incarnation}, not the current")
        elif health.state is not zl.HealthState.SERVING:
            why.append(f"{name}: {health.state}")
    for p in sorted(prefills):
        for d in sorted(decodes):
            link = g.links.get(f"{p}--{d}")
            rp, rd = g.reports.get(p), g.reports.get(d)
            if (
                link is None
                or rp is None
                or rd is None
                or (link.prefill_incarnation, link.decode_incarnation)
                != (rp.incarnation, rd.incarnation)
            ):
                why.append(f"{p}--{d}: not linked in the current incarnations")
    if g.entrances != prefills:
        why.append(f"entrances {sorted(g.entrances)}")
    if g.decodes != decodes:
        why.append(f"decode meta {sorted(g.decodes)}")
    if g.removed:
        why.append(f"removed {sorted(g.removed)}")
    return why


def zk_leftovers(g: ZkGroup, members: set[str]) -> list[str]:
    """What the subtree keeps of instances or incarnations that are gone (empty: nothing):
    reports, health, entrances of non-members, links to them or of an older incarnation, health
    of an older incarnation, anything under ``removed/``."""
    left = []
    for folder, names in (
        ("reports", set(g.reports)),
        ("health", set(g.health)),
        ("entrances", g.entrances),
        ("decode meta", g.decodes),
    ):
        if names - members:
            left.append(f"{folder} of {sorted(names - members)}")
    for name, health in g.health.items():
        report = g.reports.get(name)
        if report is not None and health.incarnation != report.incarnation:
            left.append(f"health of {name}'s gone incarnation {health.incarnation}")
    for key, link in g.links.items():
        rp, rd = g.reports.get(link.prefill), g.reports.get(link.decode)
        if (
            rp is None
            or rd is None
            or (link.prefill_incarnation, link.decode_incarnation)
            != (
                rp.incarnation,
                rd.incarnation,
            )
        ):
            left.append(f"link {key} of a gone instance or incarnation")
    if g.removed:
        left.append(f"removed/ {sorted(g.removed)}")
    return left


# --------------------------------------------------------------------------- the stage


@dataclass
class Stage:
    """Everything one scenario runs on."""

    namespace: str
    groups: Groups
    zookeeper: Any  # conftest's ZooKeeperHandle (or anything with the ``address`` it serves)
    emulator: Any  # conftest's EmulatorHandle
    operator: Any  # conftest's OperatorHandle
    gateway: str
    ready: Callable[[], bool]  # Ready=True, read on the sampler's own API client
    gateway_log: Path
    seen_pids: dict[int, int | None] = field(default_factory=dict)  # pid -> its start time
    group: str = GROUP

    @property
    def core(self) -> client.CoreV1Api:
        return self.groups.core

    def pods(self, live: bool = False) -> dict[str, PodRun]:
        """The namespace's pods the node emulator runs (``live``: not being deleted), their
        engine pids remembered, so the end of the test can check none is left."""
        runs = pod_runs(self.emulator.pods(), self.namespace, live)
        for run in runs.values():
            for pid in run.pids:
                self.seen_pids.setdefault(pid, process_start_time(pid))
        return runs

    def status(self) -> dict[str, Any]:
        return dict(self.groups.get(self.group).get("status") or {})

    def is_ready(self) -> bool:
        return bool(self.groups.ready(self.group))

    def znode(self, path: str) -> tuple[bytes, Any] | None:
        """A znode's data and stat from the stage's ZooKeeper, None if absent."""
        with zookeeper(self.zookeeper.address) as zk:
            if not zk.exists(path):
                return None
            data, stat = zk.get(path)
            return data, stat

    def engine_ready(self, instance: str) -> dict[str, float]:
        """When the instance's current engine reported, finished its links and its health
        (load) in ZooKeeper (wall s, from the znodes' ctime/mtime)."""
        paths = zl.GroupPaths(self.namespace, self.group)
        with zookeeper(self.zookeeper.address) as zk:
            raw, stat = zk.get(paths.report(instance))
            report = zl.Report.parse(raw)
            times = {"reported": stat.ctime / 1000}
            linked = 0.0
            for child in zk.get_children(paths.links):
                raw, stat = zk.get(f"{paths.links}/{child}")
                link = zl.Link.parse(raw)
                if report.incarnation in (link.prefill_incarnation, link.decode_incarnation):
                    linked = max(linked, stat.mtime / 1000)
            times["linked"] = linked
            raw, stat = zk.get(paths.health_of(instance))
            health = zl.Health.parse(raw)
            assert health.incarnation == report.incarnation, "health of another incarnation"
            times["healthy"] = stat.ctime / 1000
        return times

    def explain(self) -> str:
        """The namespace (group conditions, pods), the group's status, and the tails of the
        operator's, the gateway's and every engine container's log."""
        # (no log tails from explain_namespace: it reads the session emulator's; ours follow)
        lines = [explain_namespace("/nonexistent", self.groups.core.api_client, self.namespace)]
        with contextlib.suppress(Exception):
            status = self.status()
            lines.append(
                f"status: map v{status.get('roceMapVersion')} links {status.get('links')} "
                f"entrances {status.get('entrances')}"
            )
            lines += [f"  {row}" for row in status.get("instances", [])]
            if "lastRecovery" in status:
                lines.append(f"lastRecovery: {json.dumps(status['lastRecovery'])}")
        lines.append("--- operator log")
        lines.append(self.operator.log()[-4000:])
        lines.append("--- gateway log")
        lines.append(tail(self.gateway_log, 20))
        for log in sorted((self.emulator.state_dir / "pods").glob(f"{self.namespace}_*/*.log")):
            lines.append(f"--- {log.parent.name.split('_')[1]}/{log.name}")
            lines.append(tail(log, 15))
        return "\n".join(lines)

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        return wait_for(predicate, timeout=timeout, what=what, explain=self.explain)

    def cordon(self, node: str, unschedulable: bool = True) -> None:
        self.core.patch_node(node, {"spec": {"unschedulable": unschedulable}})


# --------------------------------------------------------------------------- one fault, measured


@dataclass
class Subject:
    """A serving group a fault hits: where to inject (the node emulator's control API), how to
    read it (its status, its live pods, its subtree on a started ZooKeeper client ``zk``) and
    the instances it should serve with."""

    namespace: str
    group: str
    control: str
    zk: Any  # a started kazoo client
    status: Callable[[], dict[str, Any]]
    pods: Callable[[], dict[str, PodRun]]  # live ones
    prefills: set[str]
    decodes: set[str]

    @property
    def members(self) -> set[str]:
        return self.prefills | self.decodes

    def subtree(self) -> ZkGroup:
        return read_group(self.zk, self.namespace, self.group)

    def endpoint(self, instance: str) -> str:
        """The instance's engine, ``host:port``, from its report."""
        report = self.subtree().reports[instance]
        return f"{report.pod_ip}:{report.port}"

    def whole(self) -> list[str]:
        """Why the group is not Ready and serving with every desired instance (empty: it is)."""
        why = zk_whole(self.subtree(), self.prefills, self.decodes)
        return why if is_true(self.status(), "Ready") else ["not Ready", *why]


@dataclass
class Run:
    """One fault from its injection until the group is whole again, as measured (wall s from
    the injection), and what it left."""

    injected: Injected
    seen_s: float  # until its effect showed (device status, node, engine, process)
    unready_s: float | None = None  # until the group said Ready=False (None: never seen)
    recovery: LastRecovery | None = None  # status.lastRecovery about this fault, last read
    detected_s: float | None = None  # until we first read that lastRecovery
    restored_s: float | None = None  # until Restored, Ready and whole (None: not within bound)
    not_whole: list[str] = field(default_factory=list)  # why not, at the bound
    restarted: dict[str, str] = field(default_factory=dict)  # pods replaced or restarted
    leftovers: list[str] = field(default_factory=list)  # the subtree's, once settled
    notes: list[str] = field(default_factory=list)


def run_fault(
    subject: Subject, kind: str, instance: str, peer: str = "", bound: float = 60.0
) -> Run:
    """Inject ``kind`` on ``instance`` (toward ``peer`` for a link), then poll (0.1 s) until the
    operator says this fault's recovery ``Restored``, the group is Ready and every desired
    instance serves in ZooKeeper (at most ``bound`` s); heal what needs healing (the die, NPU,
    link or server comes back), wait for the subtree to settle (nothing of a gone instance or
    incarnation, 10 s at most) and compare the pods with those before."""
    before = subject.pods()
    endpoint = subject.endpoint(instance) if kind == "hang" else ""
    injected = inject(kind, Target(subject.control, before, instance, endpoint, peer))
    poll(injected.seen, 5, f"the {kind} fault ({injected.detail}) to show")
    run = Run(injected, time.time() - injected.at)
    while True:
        now = time.time()
        status = subject.status()
        if run.unready_s is None and not is_true(status, "Ready"):
            run.unready_s = now - injected.at
        last = LastRecovery.of(status)
        if last is not None and last.since(injected.at):
            run.recovery = last
            run.detected_s = run.detected_s or now - injected.at
        if run.recovery is not None and run.recovery.phase == "Restored":
            run.not_whole = subject.whole()
            if not run.not_whole:
                run.restored_s = now - injected.at
                break
        if now - injected.at > bound:
            run.not_whole = run.not_whole or subject.whole()
            if run.recovery is None:
                run.not_whole.append("no status.lastRecovery about this fault")
            break
        time.sleep(0.1)
    if injected.heal is not None:
        injected.heal()
    if kind == "node":  # back: the pods it kept Terminating go
        poll(lambda: node_ready(subject.control, before[instance].node), 30, "the node back")
    try:
        poll(lambda: not zk_leftovers(subject.subtree(), subject.members), 10, "a clean subtree")
    except TimeoutError:
        run.leftovers = zk_leftovers(subject.subtree(), subject.members)
    run.restarted = restarted(before, subject.pods())
    return run
