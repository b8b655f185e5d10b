"""Issue 18, the engine's side (DeepServe §6): its start-up phases, warm pods, NPU-fork and the
fork source registry, on engine processes over a private ZooKeeper. The test plays the operator:
it writes the assignments, the RoCE map and the init order.

1. a cold engine pays TE-Pre-Load (live, not ready) and TE-Post-Load, and says both in its
   health and metrics; while it serves it is a fork source, and a fault takes the entry away;
2. a warm engine reports itself, ignores an assignment left for another pod of its name, and
   once claimed joins its group and serves on the same address, TE-Pre-Load not paid again; an
   assignment that makes no valid engine of this pod exits 2; a warm report and a gathering
   member's report come back after their session is lost; a warm engine pre-loads its server's
   DRAM plan and drops what leaves it;
3. a target forked from a serving source loads faster than from the shared file service and
   says NPUForkUB; the source, asked directly, serves only the targets the operator sent to it,
   refuses what it must, serves at most 32 targets at once in about one broadcast's time, keeps
   serving its requests during a fork, and its KV shares the link with the fork;
4. a fork that cannot be (a key mismatch, no source, the source killed or stopped mid-transfer)
   falls back.

Time scales are high where the test is about behaviour; lower where an emulated duration is
compared with the model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from enginestub import calibration as cal
from enginestub import timing
from enginestub.engine.config import parse
from enginestub.engine.fork import fork_key
from enginestub.fabric import Plane, link_latency
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import GPT3_175B, LLAMA3_8B
from testkit.helpers import assert_emulated, metric, wait_for

NS = "t"
SOURCES = "src"  # the group of the fork sources the tests ask directly
FAST = "50"  # emulated s per wall s where the test is about behaviour
SESSION_TIMEOUT = 10.0  # the engines' ZooKeeper session timeout (s)
TP1 = timing.InstanceShape(dies=1, tp=1)  # Llama3-8B-TP1 on one die: DeepServe Fig. 11's case
SFS = timing.LoadSource.SHARED_FILE_SERVICE


@dataclass
class Operator:
    """The operator's side, played by the test: warm assignments, RoCE maps, init orders."""

    zk: KazooClient
    hosts: str
    server: Any  # the private ZooKeeper's handle (stop, start)

    def reconnect(self) -> None:
        """A new client (after the server was stopped and started again)."""
        self.zk.stop()
        self.zk.close()
        self.zk = KazooClient(hosts=self.hosts, timeout=10)
        self.zk.start(timeout=15)

    def env(self, roce: str, **extra: str) -> dict[str, str]:
        return {
            "MATRIXSERVE_ZK": self.hosts,
            "MATRIXSERVE_ROCE_IPS": roce,
            "MATRIXSERVE_DIES": ",".join(str(d) for d in range(len(roce.split(",")))),
            "POD_NAMESPACE": NS,
            # open znodes, whatever the environment says (this ZooKeeper has no identity)
            "MATRIXSERVE_ZK_AUTH": "",
            "MATRIXSERVE_ZK_AUTH_FILE": "",
            **extra,
        }

    def member_env(self, group: str, roce: str, **extra: str) -> dict[str, str]:
        return self.env(roce, MATRIXSERVE_GROUP=f"{NS}/{group}", **extra)

    def admit(self, group: str, prefills: list[str], decodes: tuple[str, ...] = ()) -> None:
        """Wait for these members' reports, then a RoCE map naming every report there (a new
        version), the init order if there is none, and the decode meta."""
        paths = zl.GroupPaths(NS, group)
        names = [*prefills, *decodes]
        wait_for(
            lambda: (
                self.zk.exists(paths.reports)
                and set(names) <= set(self.zk.get_children(paths.reports))
            ),
            timeout=30,
            what=f"reports from {names}",
            every=0.05,
        )
        reports = [
            zl.Report.parse(self.zk.get(paths.report(n))[0])
            for n in self.zk.get_children(paths.reports)
        ]
        roles = {r.instance: zl.Role.PREFILL for r in reports} | dict.fromkeys(
            decodes, zl.Role.DECODE
        )
        version = 1
        if self.zk.exists(paths.roce_map):
            version = zl.RoceMap.parse(self.zk.get(paths.roce_map)[0]).version + 1
        roce_map = zl.build_roce_map(reports, roles, version)
        self.zk.ensure_path(paths.root)
        if self.zk.exists(paths.roce_map):
            self.zk.set(paths.roce_map, roce_map.dump())
        else:
            self.zk.create(paths.roce_map, roce_map.dump())
        meta = zl.DecodeMeta(version=version, decodes=roce_map.decode).dump()
        if self.zk.exists(paths.decode_meta):
            self.zk.set(paths.decode_meta, meta)
        else:
            self.zk.create(paths.decode_meta, meta)
        if not self.zk.exists(paths.init_order):
            order = zl.InitOrder(epoch=1, roceMapVersion=version)
            self.zk.create(paths.init_order, order.dump())

    def read(self, path: str) -> bytes | None:
        """A znode's data, None when it is absent (or went just now)."""
        try:
            data: bytes = self.zk.get(path)[0]
        except NoNodeError:
            return None
        return data

    def health(self, group: str, name: str) -> zl.Health | None:
        data = self.read(zl.GroupPaths(NS, group).health_of(name))
        return zl.Health.parse(data) if data else None

    def serving(self, group: str, name: str, timeout: float = 60) -> zl.Health:
        health: zl.Health = wait_for(
            lambda: (
                (h := self.health(group, name)) is not None
                and h.state is zl.HealthState.SERVING
                and h
            ),
            timeout=timeout,
            what=f"{name} serving",
            every=0.05,
        )
        return health

    def assign(
        self,
        pod: str,
        uid: str,
        group: str,
        instance: str,
        *,
        load_source: str = "HostDRAM",
        fork: zl.ForkRef | None = None,
        fallback: str = "SharedFileService",
        namespace: str = NS,
        **env: str,
    ) -> None:
        assignment = zl.Assignment(
            podUid=uid,
            group=f"{namespace}/{group}",
            instance=instance,
            env={"ENGINE_MODEL": "llama3-8b", "ENGINE_ROLE": "prefill", **env},
            loadSource=load_source,
            fork=fork,
            fallback=fallback,
            ts=time.time(),
        )
        path = zl.WarmPaths(NS).assignment(pod)
        if self.zk.exists(path):
            self.zk.set(path, assignment.dump())
        else:
            self.zk.create(path, assignment.dump(), makepath=True)

    def send_to(self, pod: str, uid: str, source: Any, plane: str = "UB") -> None:
        """An assignment of ``pod`` (``uid``) naming ``source`` (a group member of ``SOURCES``)
        as its fork: what the source's fork gate reads before it serves a target (the test
        plays the target, ``_fork``)."""
        self.assign(
            pod,
            uid,
            "targets",
            f"targets-{pod}",
            load_source="NPUForkUB" if plane == "UB" else "NPUForkRoCE",
            fork=zl.ForkRef(
                group=f"{NS}/{SOURCES}",
                instance=source.name,
                podIP=source.host,
                port=source.port,
                plane=plane,
                key="-",
            ),
        )

    def warm_report(self, pod: str) -> zl.WarmReport | None:
        data = self.read(zl.WarmPaths(NS).pod(pod))
        return zl.WarmReport.parse(data) if data else None

    def fork_sources(self) -> dict[str, zl.ForkSource]:
        """Every fork source entry of the namespace, by ``<key>/<group>.<instance>``."""
        root = zl.fork_sources_root(NS)
        found = {}
        for key in self.zk.get_children(root) if self.zk.exists(root) else []:
            for child in self.zk.get_children(f"{root}/{key}"):
                data = self.read(f"{root}/{key}/{child}")
                if data:
                    found[f"{key}/{child}"] = zl.ForkSource.parse(data)
        return found


@pytest.fixture
def operator(start_zookeeper: Callable[[], Any]) -> Iterator[Operator]:
    server = start_zookeeper()
    zk = KazooClient(hosts=server.address, timeout=10)
    zk.start(timeout=15)
    played = Operator(zk, server.address, server)
    yield played
    played.zk.stop()
    played.zk.close()


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=5, trust_env=False)


def _info(engine: Any) -> dict[str, Any]:
    return dict(_get(f"{engine.url}/v1/info").json())


def _generate(engine: Any, rid: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{engine.url}/v1/generate",
        json={"requestId": rid, "promptTokens": 64, "maxTokens": 1, **body},
        timeout=30,
        trust_env=False,
    )


def _key(*args: str) -> str:
    """The fork key of an engine started with these arguments."""
    return fork_key(parse([*args, "--host", "127.0.0.1"]))


def _fork(source: Any, own_key: str, pod: str = "t-0", **body: Any) -> httpx.Response:
    """Ask ``source`` for a fork as a target in ``pod`` (its UID ``uid-<pod>``) whose key is
    ``own_key`` would (the test plays the target); ``body`` overrides any field."""
    fields = {
        "key": own_key,
        "target": f"targets-{pod}",
        "pod": pod,
        "podUid": f"uid-{pod}",
        "plane": "UB",
        "dies": 1,
        "node": "local",
        "superpod": "local",
    }
    return httpx.post(
        f"{source.url}/v1/fork",
        json=fields | body,
        timeout=120,
        trust_env=False,
    )


def _source(
    start_engine: Any, operator: Operator, name: str, roce: str, *args: str, scale: str = FAST
) -> Any:
    """A serving member of group ``SOURCES``: a fork source (its fork gate reads ZooKeeper),
    llama3-8b on one die unless ``args`` say otherwise, no TE-Pre-Load."""
    engine = start_engine(
        name,
        *("--role", "prefill", "--model", "llama3-8b", "--dies", "0", *args),
        *("--time-scale", scale, "--load-source", "NPUForkUB", "--pre-load-seconds", "0"),
        env=operator.member_env(SOURCES, roce),
        wait_ready=False,
    )
    operator.admit(SOURCES, [name])
    operator.serving(SOURCES, name)
    return engine


def _warm(start_engine: Any, operator: Operator, pod: str, uid: str, *args: str) -> Any:
    """A warm engine on one die, ready (past TE-Pre-Load) and reported (``args`` override)."""
    engine = start_engine(
        pod, "--warm", "--time-scale", FAST, *args, env=operator.env("198.19.9.1", POD_UID=uid)
    )
    wait_for(lambda: operator.warm_report(pod), timeout=30, what=f"{pod}'s warm report")
    return engine


# ------------------------------------------------------------------ 1. the phases, the registry


def test_a_cold_engine_pays_pre_load_and_post_load_says_them_and_registers_as_a_fork_source(
    operator: Operator, start_engine: Any
) -> None:
    scale = 20  # TE-Pre-Load's default 20 emulated s: 1 wall s, long enough to look at it
    engine = start_engine(
        "g1-p-0",
        *("--role", "prefill", "--model", "llama3-8b", "--dies", "0"),
        *("--time-scale", str(scale), "--load-source", "HostDRAM"),
        env=operator.member_env("g1", "198.19.1.1"),
        wait_ready=False,
    )
    # During TE-Pre-Load: alive, not ready, no requests; nothing reported to the group yet.
    wait_for(lambda: _healthz(engine), timeout=30, what="the engine's /healthz")
    assert _get(f"{engine.url}/readyz").status_code == 503
    refused = _generate(engine, "early")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "not_ready"
    assert not operator.zk.exists(zl.GroupPaths(NS, "g1").report("g1-p-0"))

    operator.admit("g1", ["g1-p-0"])
    health = operator.serving("g1", "g1-p-0")
    assert health.warm is False
    assert health.load_source == "HostDRAM"
    assert set(health.phases) == {"TEPreLoad", "TELoad", "TEPostLoad"}
    assert_emulated(health.phases["TEPreLoad"], cal.TE_PRE_LOAD_SECONDS, scale)
    assert_emulated(
        health.phases["TELoad"],
        timing.load_seconds(LLAMA3_8B, TP1, timing.LoadSource.HOST_DRAM),
        scale,
    )
    assert_emulated(health.phases["TEPostLoad"], cal.TE_POST_LOAD_SECONDS, scale)
    for phase, seconds in health.phases.items():
        series = f'matrixserve_engine_setup_phase_seconds{{phase="{phase}"}}'
        assert metric(engine.url, series) == pytest.approx(seconds, abs=1e-5)
    assert _info(engine)["health"]["phases"] == health.phases
    assert _get(f"{engine.url}/readyz").status_code == 200

    # A serving member is a fork source under its content key; a fault takes the entry away at
    # once (with the health write), healing brings it back.
    key = _key("--model", "llama3-8b", "--dies", "0")
    entry = f"{key}/g1.g1-p-0"
    sources = wait_for(operator.fork_sources, timeout=10, what="the fork source entry")
    assert list(sources) == [entry]
    source = sources[entry]
    assert (source.model, source.dies, source.group, source.instance) == (
        "llama3-8b",
        1,
        f"{NS}/g1",
        "g1-p-0",
    )
    assert (source.pod_ip, source.port) == (engine.host, engine.port)
    _fault(engine, "die-down", die=0)
    wait_for(lambda: not operator.fork_sources(), timeout=2, what="the entry gone on a fault")
    _fault(engine, "die-down", heal=True)
    wait_for(operator.fork_sources, timeout=5, what="the entry back once healed")


def test_the_shared_file_service_is_shared_by_who_reads_it_now_not_by_a_count_fixed_at_start(
    operator: Operator, start_engine: Any
) -> None:
    """001 Table 2: the bucket's bandwidth divided among the instances loading at the time. Two
    members loading together take two lone loads each and say so (``loadShare``); one of them
    restarted in place later loads alone (bench-recovery's kill took 67 s when the count was
    fixed in the pod's environment), and the bucket's readers are gone once all loaded."""
    scale = 4.0  # a lone load of 7.7 emulated s: 1.9 wall s, two shared: 3.8 wall s
    lone = timing.load_seconds(LLAMA3_8B, TP1, SFS)
    args = (
        *("--role", "prefill", "--model", "llama3-8b", "--dies", "0"),
        *("--time-scale", str(scale), "--load-source", "SharedFileService"),
        *("--pre-load-seconds", "0"),
    )
    engines = [
        start_engine(
            name, *args, env=operator.member_env("g2", f"198.19.2.{i + 1}"), wait_ready=False
        )
        for i, name in enumerate(("g2-p-0", "g2-p-1"))
    ]
    operator.admit("g2", ["g2-p-0", "g2-p-1"])  # one map: both load from the same moment
    for name in ("g2-p-0", "g2-p-1"):
        health = operator.serving("g2", name)
        assert health.load_source == "SharedFileService"
        # two lone loads each (the two reads start within the map's two watch events)
        assert health.phases["TELoad"] == pytest.approx(2 * lone, rel=0.05)
        assert health.load_share == pytest.approx(health.phases["TELoad"] / lone, abs=0.002)
    assert operator.zk.get_children(zl.loaders_root()) == []

    # g2-p-1's container restarts (the same name and environment): it loads alone
    engines[1].sup.stop("g2-p-1", grace=5)
    wait_for(lambda: operator.health("g2", "g2-p-1") is None, timeout=15, what="its health gone")
    restarted = start_engine(
        "g2-p-1", *args, env=operator.member_env("g2", "198.19.2.2"), wait_ready=False
    )
    operator.admit("g2", ["g2-p-0", "g2-p-1"])
    health = operator.serving("g2", "g2-p-1")
    # alone: one lone load (2 would be sharing), late only by the event loop on a busy host
    assert health.load_share < 1.3, health.load_share
    assert_emulated(health.phases["TELoad"], lone, scale, late=0.5)
    assert restarted.alive()
    assert operator.zk.get_children(zl.loaders_root()) == []


def _healthz(engine: Any) -> bool:
    try:
        return _get(f"{engine.url}/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def _fault(engine: Any, kind: str, heal: bool = False, **params: Any) -> None:
    response = httpx.request(
        "DELETE" if heal else "POST",
        f"{engine.url}/v1/faults",
        json={"kind": kind, **params},
        trust_env=False,
    )
    assert response.status_code == (200 if heal else 201), response.text


# ------------------------------------------------------------------ 2. warm pods


def test_a_warm_engine_reports_itself_ignores_another_pods_assignment_and_serves_once_claimed(
    operator: Operator, start_engine: Any
) -> None:
    pre_load = 50.0  # emulated s: one wall s at the fast scale, long enough to look at it
    engine = start_engine(
        "w-1",
        *("--warm", "--time-scale", FAST, "--pre-load-seconds", str(pre_load)),
        env=operator.env("198.19.9.1", POD_UID="uid-1"),
        wait_ready=False,
    )
    wait_for(lambda: _healthz(engine), timeout=30, what="the warm engine's /healthz")
    early = _get(f"{engine.url}/readyz")
    assert early.status_code == 503, early.text  # still in TE-Pre-Load
    assert early.json()["phase"] == "PreLoading"
    wait_for(
        lambda: _get(f"{engine.url}/readyz").status_code == 200, timeout=10, what="warm, ready"
    )
    report = wait_for(lambda: operator.warm_report("w-1"), timeout=10, what="the warm report")
    assert (report.pod, report.pod_uid, report.pod_ip, report.port) == (
        "w-1",
        "uid-1",
        engine.host,
        engine.port,
    )
    assert (report.dies, report.roce_ips) == ([0], ["198.19.9.1"])
    assert_emulated(report.pre_load_seconds, pre_load, float(FAST))
    # No model, no role: every engine request is 503 not_ready, a fork request too.
    for path in ("/v1/generate", "/v1/decode", "/v1/fork"):
        answer = httpx.post(f"{engine.url}{path}", json={}, trust_env=False, timeout=5)
        assert answer.status_code == 503, (path, answer.text)
        assert answer.json()["error"]["code"] == "not_ready"
        assert answer.headers["Retry-After"] == "5"

    # An assignment left for an earlier pod of this name: ignored.
    operator.assign("w-1", "uid-0", "g2", "g2-p-0")
    time.sleep(1.0)
    assert operator.warm_report("w-1") is not None
    assert _info(engine)["phase"] == "Warm"
    assert not operator.zk.exists(zl.GroupPaths(NS, "g2").report("g2-p-0"))

    # Its own: it leaves the pool and becomes the instance, on the same address.
    claimed = time.time()
    operator.assign("w-1", "uid-1", "g2", "g2-p-0", load_source="HostDRAM", ENGINE_MAX_BATCH="4")
    wait_for(lambda: operator.warm_report("w-1") is None, timeout=10, what="the report gone")
    operator.admit("g2", ["g2-p-0"])
    health = operator.serving("g2", "g2-p-0")
    assert (health.pod_ip, health.port) == (engine.host, engine.port)
    assert health.warm is True
    # ready counted from the claim, not from the process's start (2 wall s before it)
    assert 0 < health.ready_after <= time.time() - claimed
    assert health.load_source == "HostDRAM"
    assert health.phases["TEPreLoad"] == 0.0, "paid before the claim"
    assert_emulated(
        health.phases["TELoad"],
        timing.load_seconds(LLAMA3_8B, TP1, timing.LoadSource.HOST_DRAM),
        float(FAST),
        late=0.1,
    )
    info = _info(engine)
    assert (info["instance"], info["role"], info["maxBatch"]) == ("g2-p-0", "prefill", 4)
    served = _generate(engine, "after-claim")
    assert served.status_code == 200, served.text
    assert metric(engine.url, 'matrixserve_engine_setup_phase_seconds{phase="TEPreLoad"}') == 0


@pytest.fixture
def pod_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``pod_process(name, host, env, *args)``: an engine process on a fixed address (a pod's:
    a restarted container keeps its IP), logging to ``tmp_path/<name>.log``; killed after."""
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, host: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "enginestub", "--host", host, *args],
                env={**os.environ, "POD_NAME": name, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_FAR_SOURCE = zl.ForkRef(
    group=f"{NS}/g0", instance="p-0", podIP="10.1.2.3", port=8000, plane="UB", key="-"
)


@pytest.mark.parametrize(
    ("i", "assignment", "why"),
    [
        (1, {"ENGINE_MODEL": "gpt5"}, "unknown model 'gpt5'"),
        # the pod's own credential file, ZooKeeper, platform are never the assignment's
        (
            2,
            {"MATRIXSERVE_ZK_AUTH_FILE": "/var/run/secrets/matrixserve/zookeeper/auth"},
            "env MATRIXSERVE_ZK_AUTH_FILE: not an instance setting",
        ),
        (
            3,
            {"load_source": "NPUForkUB", "fork": _FAR_SOURCE},
            "fork podIP '10.1.2.3' is not a loopback IPv4 address",
        ),
        (4, {"namespace": "elsewhere"}, "not in the pod's namespace t"),
        (5, {"load_source": "NPUForkRoCE"}, "loadSource NPUForkRoCE names no fork"),
    ],
)
def test_an_assignment_that_makes_no_valid_engine_exits_2_and_says_why(
    operator: Operator,
    pod_process: Callable[..., Any],
    tmp_path: Path,
    i: int,
    assignment: dict[str, Any],
    why: str,
) -> None:
    env = operator.env("198.19.9.1", POD_UID="uid-bad")
    proc = pod_process(
        "w-bad", f"127.79.{os.getpid() % 200}.{10 + i}", env, "--warm", "--time-scale", FAST
    )
    wait_for(lambda: operator.warm_report("w-bad"), timeout=30, what="the warm report")
    operator.assign("w-bad", "uid-bad", "g3", "g3-p-0", **assignment)
    assert proc.wait(timeout=15) == 2
    text = (tmp_path / "w-bad.log").read_text()
    assert "invalid assignment of pod w-bad" in text
    assert why in text
    assert "Traceback" not in text


def test_an_engine_restarted_in_a_claimed_pod_pays_pre_load_and_applies_its_assignment_at_once(
    operator: Operator, pod_process: Callable[..., Any]
) -> None:
    host = f"127.79.{os.getpid() % 200}.2"
    env = operator.env("198.19.9.1", POD_UID="uid-8", ENGINE_WARM="1")
    first = pod_process("w-8", host, env, "--time-scale", FAST)
    wait_for(lambda: operator.warm_report("w-8"), timeout=30, what="the warm report")
    operator.assign("w-8", "uid-8", "g8", "g8-p-0")
    operator.admit("g8", ["g8-p-0"])
    before = operator.serving("g8", "g8-p-0")
    first.kill()
    first.wait()
    # The container restarts: the same pod, address and environment (still "warm").
    seen_warm: list[bool] = []
    report_path = zl.GroupPaths(NS, "g8").report("g8-p-0")

    def reported_again() -> bool:
        seen_warm.append(operator.warm_report("w-8") is not None)
        data = operator.read(report_path)
        return data is not None and zl.Report.parse(data).incarnation != before.incarnation

    restarted = time.monotonic()
    pod_process("w-8", host, env, "--time-scale", FAST)
    wait_for(reported_again, timeout=30, what="the restarted engine's report", every=0.02)
    assert time.monotonic() - restarted >= cal.TE_PRE_LOAD_SECONDS / float(FAST), (
        "a new process pays TE-Pre-Load before it reports"
    )
    assert not any(seen_warm), "a claimed pod's engine never offers itself as warm again"
    operator.admit("g8", ["g8-p-0"])
    after = wait_for(
        lambda: (h := operator.serving("g8", "g8-p-0")).incarnation != before.incarnation and h,
        timeout=30,
        what="the restarted engine serving",
    )
    assert after.warm is True  # a claimed pod's engine
    # ... that paid its TE-Pre-Load in this process (never warm here): said, not 0
    assert before.phases["TEPreLoad"] == 0.0
    assert_emulated(after.phases["TEPreLoad"], cal.TE_PRE_LOAD_SECONDS, float(FAST))
    assert (after.pod_ip, after.port) == (before.pod_ip, before.port)


# ------------------------------------------------------------------ 3. NPU-fork


def test_a_fork_from_a_serving_source_is_faster_than_the_shared_file_service(
    operator: Operator, start_engine: Any
) -> None:
    scale = "10"  # a fork's loopback round trip is wall time: kept to ~0.3 emulated s here
    source = start_engine(
        "g4-p-0",
        *("--role", "prefill", "--model", "llama3-8b", "--dies", "0"),
        *("--time-scale", scale, "--load-source", "NPUForkUB"),
        env=operator.member_env("g4", "198.19.4.1"),
        wait_ready=False,
    )
    operator.admit("g4", ["g4-p-0"])
    operator.serving("g4", "g4-p-0")
    (entry,) = wait_for(operator.fork_sources, timeout=10, what="the source").values()
    target = _warm(start_engine, operator, "w-4", "uid-4", "--time-scale", scale)
    ref = zl.ForkRef(
        group=entry.group,
        instance=entry.instance,
        podIP=entry.pod_ip,
        port=entry.port,
        plane="UB",
        key=entry.key,
    )
    operator.assign("w-4", "uid-4", "g4", "g4-p-1", load_source="NPUForkUB", fork=ref)
    operator.admit("g4", ["g4-p-0", "g4-p-1"])
    health = operator.serving("g4", "g4-p-1")
    forked = health.phases["TELoad"]
    alone = timing.fork_seconds(LLAMA3_8B, TP1, Plane.UB)
    shared = timing.load_seconds(LLAMA3_8B, TP1, SFS)
    print(f"\nLlama3-8B TP1: NPU-fork over UB {forked:.3f} s (model {alone:.3f}), SFS {shared:.2f}")
    assert health.load_source == "NPUForkUB"
    assert health.warm is True
    # TE-Load is the source's emulated transfer and one latency for its answer, not the
    # target's wall time (a loopback round trip of 20-30 ms wall, 0.2-0.3 emulated s here):
    # the model's 0.1 s is 10 ms wall at this scale, within 15 ms of the source's timer
    # lateness, and below every local path (SSD: 0.32 s)
    latency = link_latency(Plane.UB, same_node=False)
    assert_emulated(forked, alone + latency, float(scale), late=0.015)
    assert forked < timing.load_seconds(LLAMA3_8B, TP1, timing.LoadSource.SSD)
    assert forked < shared / 2
    nbytes = timing.fork_bytes_per_die(LLAMA3_8B, TP1)
    assert metric(source.url, 'matrixserve_engine_forks_total{outcome="served"}') == 1
    assert metric(source.url, 'matrixserve_engine_fork_bytes_total{plane="UB"}') == pytest.approx(
        nbytes
    )
    assert _generate(target, "forked").status_code == 200
    # the new member serves and is a fork source in turn (under the same key)
    wait_for(lambda: len(operator.fork_sources()) == 2, timeout=10, what="two fork sources")


def test_a_source_serves_only_its_targets_refuses_what_it_must_and_at_most_32_at_once(
    operator: Operator, start_engine: Any
) -> None:
    # a fork of 0.66 emulated s over RoCE lasts 2.6 wall s: all 33 ask meanwhile, even on a
    # loaded machine (at 0.5, 1.3 s, the 33rd once came after the first had ended: 33 served)
    scale = 0.25
    source = _source(start_engine, operator, "src-p-0", "198.19.4.1", scale=str(scale))
    other = _source(start_engine, operator, "src-p-1", "198.19.4.2", scale=str(scale))
    key = _key("--model", "llama3-8b", "--dies", "0")
    # The gate: only a pod whose assignment (of its UID) names this source is served.
    operator.send_to("t-0", "uid-t-0", source)
    operator.send_to("t-1", "uid-t-1", other)
    operator.send_to("t-2", "uid-earlier", source)
    for pod, status, code in (
        ("t-9", 403, "fork_not_assigned"),  # no assignment at all
        ("t-1", 403, "fork_not_assigned"),  # sent to the other source
        ("t-2", 403, "fork_not_assigned"),  # an earlier pod's assignment (another UID)
    ):
        answer = _fork(source, key, pod)
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), pod
    for body, status, code in (
        ({"key": "llama3-8b.000000000000"}, 409, "fork_mismatch"),
        ({"dies": 2}, 409, "fork_mismatch"),
        ({"superpod": "elsewhere"}, 409, "plane_unreachable"),
        ({"plane": "VPC"}, 400, "invalid_request"),
        ({"dies": True}, 400, "invalid_request"),
        ({"node": 7}, 400, "invalid_request"),
        ({"target": "Not-A-Name"}, 400, "invalid_request"),
    ):
        answer = _fork(source, key, "t-0", **body)
        assert answer.status_code == status, (body, answer.text)
        assert answer.json()["error"]["code"] == code, body
        assert "000000000000" not in answer.text, "a key is never echoed"

    for i in range(33):
        operator.send_to(f"t-{100 + i}", f"uid-t-{100 + i}", source, plane="RoCE")
    with concurrent.futures.ThreadPoolExecutor(33) as pool:
        answers = list(
            pool.map(lambda i: _fork(source, key, f"t-{100 + i}", plane="RoCE"), range(33))
        )
    served = [a.json() for a in answers if a.status_code == 200]
    busy = [a for a in answers if a.status_code != 200]
    assert len(served) == cal.FORK_FANOUT
    assert [(a.status_code, a.json()["error"]["code"]) for a in busy] == [(503, "fork_busy")]
    assert busy[0].headers["Retry-After"] == "5"
    assert sorted(a["position"] for a in served) == list(range(1, 33))
    alone = timing.fork_seconds(LLAMA3_8B, TP1, Plane.ROCE)
    last = timing.fork_seconds(LLAMA3_8B, TP1, Plane.ROCE, position=32)
    took = sorted(a["seconds"] for a in served)
    print(f"\n32 targets over RoCE: {took[0]:.3f}-{took[-1]:.3f} s (one alone: {alone:.3f} s)")
    # one pipelined broadcast: each about one transfer's time, never 32 of them
    for seconds in took:
        assert_emulated(seconds, alone, scale, late=0.2)
    assert last < 1.01 * alone
    # the wall times of the forks served, one per target, each within its caller's wait
    windows = _info(source)["forkWindows"]
    assert len(windows) == cal.FORK_FANOUT
    assert all(began <= ended <= time.time() for began, ended in windows)
    assert max(e for _, e in windows) - min(b for b, _ in windows) < 60
    assert {a["bytes"] for a in served} == {timing.fork_bytes_per_die(LLAMA3_8B, TP1)}
    assert metric(source.url, 'matrixserve_engine_forks_total{outcome="fork_busy"}') == 1
    assert metric(source.url, 'matrixserve_engine_forks_total{outcome="fork_not_assigned"}') == 3
    # One slot per target pod: a second request of a pod whose fork is under way is refused.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_fork, source, key, "t-0", plane="RoCE")
        wait_for(lambda: _info(source)["health"]["forkTargets"] == 1, timeout=10, what="a fork")
        twice = _fork(source, key, "t-0", plane="RoCE")
        assert first.result().status_code == 200
    assert (twice.status_code, twice.json()["error"]["code"]) == (409, "fork_in_progress")
    # A source that cannot serve forks nobody.
    _fault(source, "die-down", die=0)
    refused = _fork(source, key, "t-0")
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "not_ready")


async def test_the_gates_read_needs_no_worker_thread_and_a_caller_may_stop_waiting(
    operator: Operator,
) -> None:
    """The fork gate's read (:meth:`Session.read`: kazoo's asynchronous read handed to the
    event loop, no worker thread per target): a znode's data, None for an absent or empty one;
    with the server down the caller's own timeout ends the wait (the gate answers 503), the
    late answer is dropped without a trace on the loop; once the server is back the next read
    is answered; a stopped session's read raises the session's error."""
    import asyncio
    import threading

    from matrixserve import coordination
    from matrixserve.coordination import Session, SessionState

    operator.zk.create("/read/full", b"assigned", makepath=True)
    operator.zk.create("/read/empty", b"")
    loop = asyncio.get_running_loop()
    troubles: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: troubles.append(context))
    session = Session(operator.hosts, timeout=4.0)
    await session.start(timeout=15)
    try:
        threads = set(threading.enumerate())
        reads = [session.read(f"/read/{name}") for name in ("full", "empty", "absent") * 32]
        answers = await asyncio.gather(*reads)
        assert answers == [b"assigned", None, None] * 32
        assert not set(threading.enumerate()) - threads  # 96 reads at once, no thread started
        operator.server.stop()
        for _ in range(100):  # kazoo has seen the connection go: the read is held, not failed
            if session.state is not SessionState.CONNECTED:
                break
            await asyncio.sleep(0.1)
        assert session.state is not SessionState.CONNECTED
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await session.read("/read/full")
        assert time.monotonic() - began < 2.0
        operator.server.start()
        for _ in range(60):  # the session reconnects (or a new one: no read needs the old)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    if await session.read("/read/full") == b"assigned":
                        break
            await asyncio.sleep(0.5)
        else:
            pytest.fail("no read answered after ZooKeeper came back")
        await asyncio.sleep(0.5)  # the abandoned read's answer, if it came late, was dropped
        assert not troubles
    finally:
        await session.stop()
    with pytest.raises(coordination.ERRORS):
        async with asyncio.timeout(5.0):
            await session.read("/read/full")


def test_a_source_keeps_serving_during_a_fork_and_its_kv_shares_the_link(
    operator: Operator, start_engine: Any
) -> None:
    scale = 1  # the KV pulls are ~50 ms: compared with the model at time scale 1
    gpt3 = ("--model", "gpt3-175b", "--dies", "0,1,2,3,4,5,6,7", "--kv-plane", "RoCE")
    # no TE-Pre-Load: 20 wall s at time scale 1, and not what this test is about
    common = ("--time-scale", str(scale), "--load-source", "NPUForkUB", "--pre-load-seconds", "0")
    roce = [",".join(f"198.19.{n}.{d + 1}" for d in range(8)) for n in (6, 7)]
    start_engine(
        "kv-d",
        *("--role", "decode", *gpt3, *common),
        env=operator.member_env(SOURCES, roce[0]),
        wait_ready=False,
    )
    prefill = start_engine(
        "kv-p",
        *("--role", "prefill", *gpt3, *common),
        env=operator.member_env(SOURCES, roce[1]),
        wait_ready=False,
    )
    operator.admit(SOURCES, ["kv-p"], ("kv-d",))
    operator.serving(SOURCES, "kv-d")
    operator.serving(SOURCES, "kv-p")
    body = {"promptTokens": 2048, "maxTokens": 2}
    alone = _generate(prefill, "alone", **body)
    assert alone.status_code == 200, alone.text
    kv_alone = _done(alone)["timings"]["kvTransfer"]
    operator.send_to("t-kv", "uid-t-kv", prefill, plane="RoCE")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        key = _key(*gpt3[:4])
        forking = pool.submit(_fork, prefill, key, "t-kv", plane="RoCE", dies=8)
        wait_for(lambda: _info(prefill)["health"]["forkTargets"] == 1, timeout=5, what="the fork")
        during = _generate(prefill, "during", **body)
        still_forking = _info(prefill)["health"]["forkTargets"] == 1
        fork = forking.result()
    assert fork.status_code == 200, fork.text
    assert still_forking, "the request must have run during the fork"
    assert during.status_code == 200
    done = _done(during)
    shape = timing.InstanceShape(dies=8, tp=8)
    # its compute is its own (the AICPUs move the fork): the first token as the model says
    assert_emulated(done["timings"]["ttft"], timing.prefill_seconds(GPT3_175B, shape, 2048), scale)
    # its KV egress is shared with the broadcast on RoCE: one flow more, twice as long
    kv_during = done["timings"]["kvTransfer"]
    print(f"\nKV pull alone {kv_alone:.4f} s, during a RoCE fork {kv_during:.4f} s")
    assert 1.6 * kv_alone <= kv_during <= 2.4 * kv_alone
    # ... and the broadcast gave the pull its share: longer than alone by about the KV's time
    fork_alone = timing.fork_seconds(GPT3_175B, shape, Plane.ROCE)
    seconds = fork.json()["seconds"]
    assert fork_alone + 0.5 * kv_alone <= seconds <= fork_alone + 2 * kv_alone + 0.1


def _done(response: httpx.Response) -> dict[str, Any]:
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line]
    assert events[-1]["type"] == "done", events[-1]
    return dict(events[-1])


# ------------------------------------------------------------------ 4. fallbacks


def test_a_key_mismatch_and_a_missing_source_fall_back(
    operator: Operator, start_engine: Any
) -> None:
    source = start_engine(
        "src-m",
        *("--role", "colocated", "--model", "llama3-8b", "--dies", "0"),
        *("--time-scale", FAST, "--load-source", "NPUForkUB"),
    )
    mismatched = _warm(start_engine, operator, "w-5", "uid-5")
    orphan = _warm(start_engine, operator, "w-6", "uid-6")
    other = zl.fork_source_key("llama3-8b", "000000000000")  # another artefact build
    ref = zl.ForkRef(
        group=f"{NS}/g0",
        instance="src-m",
        podIP=source.host,
        port=source.port,
        plane="UB",
        key=other,
    )
    operator.assign("w-5", "uid-5", "g5", "g5-p-0", load_source="NPUForkUB", fork=ref)
    gone = ref.model_copy(update={"pod_ip": "127.0.0.1", "port": 9, "key": _key("--dies", "0")})
    operator.assign(
        "w-6", "uid-6", "g5", "g5-p-1", load_source="NPUForkUB", fork=gone, fallback="HostDRAM"
    )
    operator.admit("g5", ["g5-p-0", "g5-p-1"])
    by_key = operator.serving("g5", "g5-p-0")
    by_address = operator.serving("g5", "g5-p-1")
    assert by_key.load_source == "SharedFileService"
    assert_emulated(
        by_key.phases["TELoad"], timing.load_seconds(LLAMA3_8B, TP1, SFS), float(FAST), late=0.1
    )
    assert by_address.load_source == "HostDRAM"
    assert_emulated(
        by_address.phases["TELoad"],
        timing.load_seconds(LLAMA3_8B, TP1, timing.LoadSource.HOST_DRAM),
        float(FAST),
        late=0.1,
    )
    # the target refused the mismatched key itself: the source was never asked
    assert "fork_mismatch" in mismatched.log()
    assert "matrixserve_engine_forks_total{" not in _get(f"{source.url}/metrics").text
    assert "ConnectError" in orphan.log()


def _fork_under_way(operator: Operator, start_engine: Any, n: int) -> tuple[Any, Any]:
    """A source (slowed 1000 times: its fork of 0.66 emulated s over RoCE lasts 13 wall s) and
    a warm target ``w-<n>`` claimed by group ``g<n>`` that is forking from it now."""
    source = _source(start_engine, operator, f"src-p-{n}", f"198.19.{n}.1")
    _fault(source, "slow", factor=1000)
    target = _warm(start_engine, operator, f"w-{n}", f"uid-{n}")
    ref = zl.ForkRef(
        group=f"{NS}/{SOURCES}",
        instance=f"src-p-{n}",
        podIP=source.host,
        port=source.port,
        plane="RoCE",
        key=_key("--dies", "0"),
    )
    group = f"g{n}"
    operator.assign(
        f"w-{n}", f"uid-{n}", group, f"{group}-p-0", load_source="NPUForkRoCE", fork=ref
    )
    operator.admit(group, [f"{group}-p-0"])
    wait_for(lambda: _info(source)["health"]["forkTargets"] == 1, timeout=10, what="the fork")
    return source, target


def test_a_source_killed_mid_fork_leaves_the_target_to_its_fallback(
    operator: Operator, start_engine: Any
) -> None:
    source, target = _fork_under_way(operator, start_engine, 7)
    killed = time.monotonic()
    os.kill(source.pid, signal.SIGKILL)
    health = operator.serving("g7", "g7-p-0", timeout=30)
    print(f"\nthe target serves {time.monotonic() - killed:.2f} wall s after the kill")
    assert health.load_source == "SharedFileService"
    lost_at_most = 5.0 * float(FAST)  # the fork's own bound: it must not be what ended it
    full = timing.load_seconds(LLAMA3_8B, TP1, SFS)
    assert full <= health.phases["TELoad"] < full + lost_at_most
    log = target.log()
    assert "NPU-fork from src-p-7 failed" in log
    assert "no answer" not in log, "the fork ended by the kill, not by the wait bound"
    assert _generate(target, "after-kill").status_code == 200


def test_a_source_stopped_mid_fork_answers_fork_aborted_and_its_target_falls_back_at_once(
    operator: Operator, start_engine: Any
) -> None:
    """A source told to stop answers the forks it serves (503 fork_aborted) before its server
    stops, rather than keeping them waiting through the server's shutdown or cutting them."""
    source, target = _fork_under_way(operator, start_engine, 8)
    stopped = time.monotonic()
    os.kill(source.pid, signal.SIGTERM)
    health = operator.serving("g8", "g8-p-0", timeout=30)
    took = time.monotonic() - stopped
    print(f"\nthe target serves {took:.2f} wall s after the source was told to stop")
    assert "fork_aborted" in target.log()
    assert health.load_source == "SharedFileService"
    full = timing.load_seconds(LLAMA3_8B, TP1, SFS)
    lost = 2.0 * float(FAST)  # the abort is answered at once: 2 wall s at most
    assert full <= health.phases["TELoad"] < full + lost
    wait_for(lambda: not source.alive(), timeout=5, what="the source gone")


# ------------------------------------------------------------------ 5. sessions, DRAM


def test_a_lost_session_brings_back_the_warm_report_and_a_gathering_members_report(
    operator: Operator, start_engine: Any
) -> None:
    """Finding 1: after a lost session the re-registration loop wrote nothing (its event was
    still set when it looked), so a warm pod left the pool and a member still gathering was
    never in its group. The engines' sessions are lost by stopping ZooKeeper (its data kept)
    for longer than their session timeout: each gives its session up and starts another."""
    engines = [_warm(start_engine, operator, "w-s", "uid-s")]
    engines += [
        start_engine(
            "gs-p-0",
            *("--role", "prefill", "--model", "llama3-8b", "--dies", "0", "--time-scale", FAST),
            *("--pre-load-seconds", "0"),
            env=operator.member_env("gs", "198.19.5.1"),
            wait_ready=False,
        )
    ]
    paths = [zl.WarmPaths(NS).pod("w-s"), zl.GroupPaths(NS, "gs").report("gs-p-0")]
    wait_for(lambda: all(operator.zk.exists(p) for p in paths), timeout=30, what="both reports")
    owners = {p: operator.zk.exists(p).ephemeralOwner for p in paths}
    operator.zk.stop()
    operator.server.stop()
    time.sleep(SESSION_TIMEOUT + 2)
    operator.server.start()
    operator.reconnect()

    def rewritten(path: str) -> bool:
        stat = operator.zk.exists(path)
        return stat is not None and stat.ephemeralOwner != owners[path]

    def explain() -> str:
        missing = [p for p in paths if not rewritten(p)]
        logs = "\n".join(f"--- {e.name}:\n{e.log()[-3000:]}" for e in engines)
        return f"not written again by a new session: {missing}\n{logs}"

    # Bounded by ZooKeeper's start under load and the engines' reconnection back-off (at most
    # 5 s between tries), not by a latency this test measures.
    wait_for(
        lambda: all(rewritten(p) for p in paths),
        timeout=60,
        what="both reports written again by the engines' new sessions",
        explain=explain,
    )
    # The watches came back with the sessions: the warm pod is claimed, the member linked.
    operator.assign("w-s", "uid-s", "gs", "gs-p-1")
    operator.admit("gs", ["gs-p-0", "gs-p-1"])
    operator.serving("gs", "gs-p-0")
    operator.serving("gs", "gs-p-1")


def test_a_warm_engine_pre_loads_its_servers_dram_plan_and_drops_what_leaves_it(
    operator: Operator, start_engine: Any
) -> None:
    """DeepServe §6.2: the cluster manager "pre-loads [models] into DRAM page cache using
    pre-warmed TEs". The plan lists two models: each is loaded from the shared file service
    (one after the other, emulated) and then reported; one leaving the plan leaves at once."""
    scale = 100.0
    engine = _warm(start_engine, operator, "w-d", "uid-d", "--time-scale", str(scale))
    first = operator.warm_report("w-d")
    assert first is not None
    assert first.dram_models == []
    small, large = (timing.dram_preload_seconds(m) for m in (LLAMA3_8B, GPT3_175B))
    path = zl.WarmPaths(NS).dram("local")  # the node the engine is on (the default)

    def plan(*models: str) -> None:
        data = zl.DramPlan(node="local", models=list(models), ts=time.time()).dump()
        operator.zk.ensure_path(path)
        operator.zk.set(path, data)

    def dram() -> list[str]:
        report = operator.warm_report("w-d")
        return report.dram_models if report is not None else ["(no report)"]

    written = time.monotonic()
    plan("llama3-8b", "gpt3-175b")
    wait_for(lambda: dram() == ["llama3-8b"], timeout=10, what="llama3-8b in DRAM", every=0.01)
    assert time.monotonic() - written >= small / scale, "not before its emulated load"
    assert _info(engine)["dramLoading"] == "gpt3-175b"  # then the next, one after the other
    dropped = time.monotonic()
    plan("gpt3-175b")
    wait_for(lambda: dram() == [], timeout=5, what="llama3-8b evicted", every=0.01)
    assert time.monotonic() - dropped < 0.5 * large / scale, "at once, not after the next load"
    wait_for(lambda: dram() == ["gpt3-175b"], timeout=10, what="gpt3-175b in DRAM", every=0.01)
    assert time.monotonic() - written >= (small + large) / scale
    for model in ("llama3-8b", "gpt3-175b"):
        series = f'matrixserve_engine_dram_preloads_total{{model="{model}"}}'
        assert metric(engine.url, series) == 1
    operator.zk.delete(path)  # no plan: nothing in DRAM
    wait_for(lambda: dram() == [], timeout=5, what="gpt3-175b evicted", every=0.01)
