"""Chaos under traffic (issue 15, first "Done when"): one fault at a time on a serving 2P+1D
group while clients stream completions through the gateway.

Faults: a decode drained to another server, a prefill drained to another server (cordon its
server, delete its pod), kill -9 of the decode engine and of a prefill engine three times each
in a row, a ZooKeeper restart with its data kept, one with its data lost, and a die down on the
only decode. For each:

- **Ready is never True while the group cannot serve**: every 0.5 s a sampler reads the group's
  ``Ready``; at each True it sends a probe request through the gateway, which must succeed
  unless it began within ``DETECTION`` s of a fault (the time the operator takes to see one);
- the group is **Ready and serving again** afterwards, within the bound the scenario states;
- **no pod restarted or replaced that the fault did not hit** (pod UIDs and container restart
  counts from the node emulator, before and after);
- deleting the group leaves **no pod, no znode, no engine process** behind.

And per fault:

- an instance fault (drain, kill, die down) makes the group say ``Ready=False`` within
  ``DETECTION`` s; no request fails for want of a decode (``no_decode``) unless it began within
  ``NO_DECODE_BOUND`` s of a fault (or was in flight at it);
- after a drain, serving resumes within the new pod's start + link + load +
  ``ENGINE_READY_SLACK`` s (the new engine's report, links and health in ZooKeeper, to the first
  token served through it);
- a ZooKeeper restart with its data kept fails no request; while ZooKeeper is down the status
  keeps its last known state and says ``Coordinated=False``; after data loss the subtree is
  rebuilt (the RoCE map's version continued, not restarted) within 30 s of ZooKeeper being back,
  with no engine restarted;
- with its only decode's die down the group says ``Degraded`` within ``NO_DECODE_BOUND`` s
  (``NoServingDecode``, or ``Recovering`` once issue 17's recovery has planned), the decode is
  replaced on healthy NPUs without waiting for the die to heal, and requests begun
  ``NO_DECODE_BOUND`` s after the fault are served or refused up front (an HTTP error before the
  stream), never failed mid-stream.

"Serving again" is the first token of the first request that succeeded through the instance
the fault hit and started after that instance was back (drain and die down: the new pod's
engine reported; kill: the kill); for ZooKeeper restarts, of the first request started after
ZooKeeper was back. Seconds until serving again count from the fault (ZooKeeper: from its
restart). Seconds until Ready likewise, to the last time Ready became True
(ZooKeeper: Coordinated and Ready again, after data loss with the subtree rebuilt).

The figures of each fault are printed as one table at the end (``pytest -s``); tests assert,
benchmarks report, so nothing is written to ``bench/results``.

Set-up per scenario: a private ZooKeeper (restartable, with its data kept or lost), a private
node emulator of three servers with a 0.5 s restart back-off (the dev cluster's 10 s doubling
would make three kills in a row wait 70 s; the session emulator's nodes are cordoned meanwhile
so the group lands on ours), the operator and the gateway on that ZooKeeper, engines at time
scale 50, a TTFT budget of 60 emulated s (1.2 wall s: the machine's own CPU queue must not fail
requests).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.devcluster.procs import process_start_time
from testkit.chaoskit import CLIENTS, GROUP, SAMPLE_EVERY, Request, Stage, Traffic
from testkit.helpers import Groups, absent, events_of, only_these_nodes, pdgroup_body, zookeeper

TIME_SCALE = "50"
DETECTION = 2.0  # s: a fault may go unseen this long (Ready still True, a probe failing)
NO_DECODE_BOUND = 2.0  # s: after a decode-less fault, no request may fail for want of a decode
WARM_UP = 2.0  # s of traffic before the first fault (every request must succeed)
SETTLE = 2.0  # s of traffic after the group is back (Ready must keep telling the truth)
ENGINE_READY_SLACK = 2.0  # s: after a drain, serving resumes within start + link + load + this
ZOOKEEPER_DOWN = 3.0  # s from stopping ZooKeeper to starting it again

# (the traffic, the pods and the stage are chaoskit's: the recovery chaos test and benchmark of
# issue 17 share them)


@pytest.fixture
def stage(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    tmp_path: Path,
    start_zookeeper: Callable[[], Any],
    start_emulator: Callable[..., Any],
    start_operator: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> Iterator[Stage]:
    """A private ZooKeeper and node emulator, the operator and the gateway on them, and
    group ``g`` (2P+1D) serving."""
    zk = start_zookeeper()
    emulator = start_emulator(servers=3)
    # the session's own emulated nodes take no pod of this test meanwhile
    with only_these_nodes(client.CoreV1Api(api_client), emulator.nodes):
        sampler_api = config.new_client_from_config(config_file=cluster.kubeconfig)
        sampler_groups = Groups(sampler_api, namespace)
        try:
            operator = start_operator(
                namespace, webhook=False, time_scale=TIME_SCALE, extra=("--zookeeper", zk.address)
            )
            gateway = start_gateway("--zookeeper", zk.address, "--time-scale", TIME_SCALE)
            stage = Stage(
                namespace,
                groups,
                zk,
                emulator,
                operator,
                gateway,
                lambda: sampler_groups.ready(GROUP),
                tmp_path / "gateway" / "logs" / "gateway-0.log",
            )
            body = pdgroup_body(GROUP, 2, 1)
            body["spec"]["slo"]["ttftMilliseconds"] = 60000
            groups.create(body)
            stage.wait(stage.is_ready, 90, "the group Ready")
            yield stage
        finally:
            sampler_api.close()
            # a scenario that failed may leave its group behind with an operator that cannot
            # finish it: the namespace's deletion must not hang on the finalizer
            with contextlib.suppress(client.ApiException):
                if not absent(lambda: groups.get(GROUP)):
                    groups.delete(GROUP)
                    time.sleep(5)
                    groups.custom.patch_namespaced_custom_object(
                        *groups.where, GROUP, {"metadata": {"finalizers": None}}
                    )


# --------------------------------------------------------------------------- scenarios


@dataclass
class Chaos:
    """What a scenario did and saw."""

    faults: list[float] = field(default_factory=list)  # when each fault was injected
    hit: dict[str, str] = field(default_factory=dict)  # pod -> "replaced" | "restarted N"
    to_serving: list[float] = field(default_factory=list)  # s, per fault
    to_ready: list[float] = field(default_factory=list)  # s, per fault
    notes: list[str] = field(default_factory=list)


def recover(
    stage: Stage,
    traffic: Traffic,
    fault: float,
    instance: str | None,
    back: Callable[[], float | None],
    bound: float,
    what: str,
) -> tuple[float, Request]:
    """Wait (``bound`` s from ``fault``) until the group is Ready and a request started after
    ``back()`` (when the hit instance is there again) was served through ``instance``; the
    seconds from the fault until Ready (the last time it became True), and the request."""
    state: dict[str, Any] = {"ready_at": None}

    def recovered() -> tuple[float, Request] | None:
        ready = stage.is_ready()
        now = time.time()
        if not ready:
            state["ready_at"] = None
            return None
        state["ready_at"] = state["ready_at"] or now
        since = back()
        request = traffic.served(since, instance) if since is not None else None
        return (state["ready_at"], request) if request is not None else None

    ready_at, request = stage.wait(
        recovered, bound - (time.time() - fault), f"{what}: Ready and serving again"
    )
    return ready_at - fault, request


def at(moment: float) -> Callable[[], float | None]:
    """The hit instance is back from ``moment`` on."""
    return lambda: moment


def gone(pid: int, started: int | None) -> Callable[[], bool]:
    """Whether the process ``pid`` that started at ``started`` has ended."""
    return lambda: process_start_time(pid) != started


def wait_unready(stage: Stage, fault: float, what: str) -> float:
    """Seconds from the fault until the group says it is not Ready (it cannot serve fully)."""
    stage.wait(
        lambda: not stage.is_ready(), DETECTION - (time.time() - fault), f"{what}: Ready=False"
    )
    return time.time() - fault


def drain(stage: Stage, traffic: Traffic, chaos: Chaos, instance: str) -> None:
    """Cordon the instance's server, delete its pod: the operator recreates it on another
    server; serving resumes within its start + link + load + ``ENGINE_READY_SLACK`` s."""
    old = stage.pods()[instance]
    paths = zl.GroupPaths(stage.namespace, GROUP)
    stage.cordon(old.node)
    try:
        fault = time.time()
        chaos.faults.append(fault)
        stage.core.delete_namespaced_pod(instance, stage.namespace)
        unready = wait_unready(stage, fault, f"{instance} drained")

        def back() -> float | None:
            """When the new pod's engine reported (its report names the new pod)."""
            found = stage.znode(paths.report(instance))
            if found is None or zl.Report.parse(found[0]).pod_uid == old.uid:
                return None
            return float(found[1].ctime / 1000)

        to_ready, served = recover(stage, traffic, fault, instance, back, 60, "drain")
    finally:
        stage.cordon(old.node, unschedulable=False)
    new = stage.pods()[instance]
    assert new.uid != old.uid, "the pod was not replaced"
    assert new.node != old.node, f"{instance} came back on its cordoned server {old.node}"
    chaos.hit[instance] = "replaced"
    engine = stage.engine_ready(instance)
    serving = (served.first_token or 0.0) - fault
    chaos.to_serving.append(serving)
    chaos.to_ready.append(to_ready)
    ready_engine = max(engine["linked"], engine["healthy"])
    resumed = served.first_token or 0.0
    if instance.startswith(f"{GROUP}-p-"):
        # A prefill serves once it is an entrance again; which requests the gateway then sends
        # it (batch forwarding keeps a busy-enough prefill first) is load balancing, not recovery.
        opened = stage.znode(paths.entrance(instance))
        assert opened is not None, f"{instance} is not an entrance again"
        resumed = min(resumed, opened[1].ctime / 1000)
    overhead = resumed - ready_engine
    chaos.notes.append(
        f"not Ready after {unready:.1f}s; new engine reported +{engine['reported'] - fault:.1f}s, "
        f"linked +{engine['linked'] - fault:.1f}s, healthy +{engine['healthy'] - fault:.1f}s; "
        f"serving {overhead:+.2f}s after the engine was ready"
    )
    assert overhead <= ENGINE_READY_SLACK, (
        f"serving resumed {overhead:.2f}s after the new engine was linked and loaded "
        f"(target: within {ENGINE_READY_SLACK}s)\n{stage.explain()}"
    )


def kill_engine(
    stage: Stage, traffic: Traffic, chaos: Chaos, instance: str, times: int = 3
) -> None:
    """kill -9 of the instance's engine process, ``times`` times, each once the group is Ready
    and serving through it again (the emulated kubelet restarts it after its back-off)."""
    before = stage.pods()[instance]
    for n in range(times):
        run = stage.pods()[instance]
        (pid,) = run.pids
        started = process_start_time(pid)
        fault = time.time()
        chaos.faults.append(fault)
        os.kill(pid, signal.SIGKILL)
        stage.wait(gone(pid, started), 5, "the killed engine gone")
        unready = wait_unready(stage, fault, f"kill {n + 1} of {instance}")
        to_ready, served = recover(stage, traffic, fault, instance, at(fault), 45, f"kill {n + 1}")
        engine = stage.engine_ready(instance)
        chaos.to_serving.append((served.first_token or 0.0) - fault)
        chaos.to_ready.append(to_ready)
        chaos.notes.append(
            f"kill {n + 1}: not Ready after {unready:.1f}s, reported "
            f"+{engine['reported'] - fault:.1f}s, linked +{engine['linked'] - fault:.1f}s, "
            f"healthy +{engine['healthy'] - fault:.1f}s"
        )
    after = stage.pods()[instance]
    assert after.uid == before.uid, "a killed engine's pod was replaced"
    assert after.restarts == before.restarts + times, (before, after)
    chaos.hit[instance] = f"restarted {times}"


def restart_zookeeper(stage: Stage, traffic: Traffic, chaos: Chaos, keep_data: bool) -> None:
    """Stop the private ZooKeeper, lose its data or not, start it again on the same port
    ``ZOOKEEPER_DOWN`` s later. Meanwhile the operator keeps the group's last known status and
    says ``Coordinated=False``; once it is back, the status is ZooKeeper's again
    (``Coordinated=True``) and, after data loss, the subtree is rebuilt within 30 s."""
    before = int(stage.status()["roceMapVersion"])
    fault = time.time()
    chaos.faults.append(fault)
    stage.zookeeper.stop()
    if not keep_data:
        stage.zookeeper.wipe()
    said: float | None = None  # when the status said Coordinated=False
    while time.time() < fault + ZOOKEEPER_DOWN:
        if said is None and coordinated(stage) is False:
            said = time.time() - fault
        time.sleep(0.1)
    stage.zookeeper.start()
    back = time.time()
    bound = 10 if keep_data else 30  # the target after data loss: Ready within 30 s
    stage.wait(lambda: coordinated(stage), bound, "the operator's session back (Coordinated)")
    chaos.notes.append(
        f"ZooKeeper down {back - fault:.1f}s; Coordinated=False "
        + (f"after {said:.1f}s" if said is not None else "never said")
        + f"; Coordinated=True {time.time() - back:.1f}s after ZooKeeper was back"
    )
    if not keep_data:
        stage.wait(rebuilt(stage, before), bound - (time.time() - back), "the subtree rebuilt")
        chaos.notes.append(f"subtree rebuilt {time.time() - back:.1f}s after ZooKeeper was back")
    to_ready, served = recover(stage, traffic, back, None, at(back), bound, "ZooKeeper back")
    chaos.to_ready.append(to_ready)
    chaos.to_serving.append((served.first_token or 0.0) - back)
    assert said is not None, (
        f"ZooKeeper was down {ZOOKEEPER_DOWN}s and the group's status kept Coordinated=True"
    )


def coordinated(stage: Stage) -> bool | None:
    """The group's ``Coordinated`` condition (None before the operator set one)."""
    for condition in stage.status().get("conditions", []):
        if condition["type"] == "Coordinated":
            return bool(condition["status"] == "True")
    return None


def rebuilt(stage: Stage, version: int) -> Callable[[], bool]:
    """Whether the group's subtree is whole again: the RoCE map (its version continued from
    ``version``, never restarted), every instance's report and health, every prefill an
    entrance, the decode meta."""
    paths = zl.GroupPaths(stage.namespace, GROUP)
    instances = {f"{GROUP}-p-0", f"{GROUP}-p-1", f"{GROUP}-d-0"}

    def whole() -> bool:
        with zookeeper(stage.zookeeper.address) as zk:
            if not zk.exists(paths.roce_map) or not zk.exists(paths.decode_meta):
                return False
            if zl.RoceMap.parse(zk.get(paths.roce_map)[0]).version < version:
                return False
            for folder, want in (
                (paths.reports, instances),
                (paths.health, instances),
                (paths.entrances, {i for i in instances if "-p-" in i}),
            ):
                if not zk.exists(folder) or set(zk.get_children(folder)) != want:
                    return False
        return True

    return whole


def die_down_on_the_decode(stage: Stage, traffic: Traffic, chaos: Chaos) -> None:
    """A die fault on the only decode: the group stops admitting while no decode serves
    (Degraded: ``NoServingDecode``, or ``Recovering`` once recovery has planned), and issue 17's
    recovery replaces the decode on healthy NPUs without waiting for the die to heal; no request
    whose prefill began ``NO_DECODE_BOUND`` s after the fault fails after its stream began."""
    decode = stage.pods()[f"{GROUP}-d-0"]
    with stage.emulator.http() as http:
        device = http.get(f"/nodes/{decode.node}/device-status").json()
    (npu,) = [n for n in device["npus"] if n["id"] == decode.npus[0]]
    fault_body = {"kind": "die-down", "node": decode.node, "die": npu["dies"][0]["id"]}
    fault = time.time()
    chaos.faults.append(fault)
    stage.emulator.fault(**fault_body)
    try:
        unready = wait_unready(stage, fault, "die down")

        def degraded() -> bool:
            conditions = {c["type"]: c for c in stage.status().get("conditions", [])}
            reason = conditions.get("Degraded", {}).get("reason")
            return reason in ("NoServingDecode", "Recovering")

        stage.wait(degraded, NO_DECODE_BOUND, "Degraded=True, NoServingDecode or Recovering")
        said = time.time() - fault

        def replaced() -> float | None:
            """When the new decode pod's engine reported."""
            found = stage.znode(zl.GroupPaths(stage.namespace, GROUP).report(decode.name))
            if found is None or zl.Report.parse(found[0]).pod_uid == decode.uid:
                return None
            return float(found[1].ctime / 1000)

        to_ready, served = recover(stage, traffic, fault, decode.name, replaced, 30, "replaced")
    finally:
        stage.emulator.fault(heal=True, **fault_body)
    chaos.to_ready.append(to_ready)
    chaos.to_serving.append((served.first_token or 0.0) - fault)
    new = stage.pods()[decode.name]
    assert new.uid != decode.uid, "the decode with a die down was not replaced"
    assert (new.node, new.npus[0]) != (decode.node, decode.npus[0]), "replaced on the faulty NPU"
    chaos.hit[decode.name] = "replaced"
    last = stage.status().get("lastRecovery") or {}
    assert (last.get("fault", {}).get("kind"), last.get("plan", {}).get("action")) == (
        "die",
        "Replace",
    ), last
    during = [r for r in traffic.snapshot() if r.start >= fault]
    late = [r for r in during if r.start > fault + NO_DECODE_BOUND]
    want = [r for r in during if r.outcome == "no_decode"]
    last_no_decode = max((r.start - fault for r in want), default=None)
    chaos.notes.append(
        f"not Ready after {unready:.1f}s, Degraded after {said:.1f}s; replaced by recovery, "
        f"serving again +{(served.first_token or 0.0) - fault:.1f}s; last no_decode failure "
        "began " + (f"+{last_no_decode:.2f}s" if last_no_decode is not None else "never")
    )
    failed_in_stream = [r for r in late if not r.ok and not r.refused_up_front]
    assert not failed_in_stream, (
        f"{len(failed_in_stream)} requests begun over {NO_DECODE_BOUND}s after the die fault "
        "failed after their stream began (for want of a decode, instead of being refused up "
        f"front): {collections.Counter(r.outcome for r in failed_in_stream)}"
    )


SCENARIOS: dict[str, Callable[[Stage, Traffic, Chaos], None]] = {
    "decode-drain": lambda s, t, c: drain(s, t, c, f"{GROUP}-d-0"),
    "prefill-drain": lambda s, t, c: drain(s, t, c, f"{GROUP}-p-1"),
    "decode-kill-x3": lambda s, t, c: kill_engine(s, t, c, f"{GROUP}-d-0"),
    "prefill-kill-x3": lambda s, t, c: kill_engine(s, t, c, f"{GROUP}-p-0"),
    "zookeeper-restart": lambda s, t, c: restart_zookeeper(s, t, c, keep_data=True),
    "zookeeper-data-lost": lambda s, t, c: restart_zookeeper(s, t, c, keep_data=False),
    "decode-die-down": die_down_on_the_decode,
}


# --------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """One row of the table."""

    scenario: str
    chaos: Chaos = field(default_factory=Chaos)
    sent: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    restarted: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # traffic, faults and recovery (the stage's set-up not included)


@pytest.fixture(scope="module")
def figures() -> Iterator[list[Figures]]:
    """Each scenario's figures, printed as one table once the module's tests are done."""
    rows: list[Figures] = []
    yield rows
    if not rows:
        return
    out = [
        "",
        "chaos under traffic (2P+1D llama3-8b, engine time scale 50, "
        f"{CLIENTS} streaming clients + Ready probe every {SAMPLE_EVERY}s)",
        f"{'fault':<22}{'requests':>9}{'failed':>8}  {'s to serving':<18}{'s to Ready':<18}"
        f"{'pods restarted':<24}{'run s':>6}  failures by reason",
    ]
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.failed.items())) or "-"
        restarted = ", ".join(f"{k} {v}" for k, v in r.restarted.items()) or "none"
        out.append(
            f"{r.scenario:<22}{r.sent:>9}{sum(r.failed.values()):>8}  "
            f"{'/'.join(f'{s:.1f}' for s in r.chaos.to_serving) or '-':<18}"
            f"{'/'.join(f'{s:.1f}' for s in r.chaos.to_ready) or '-':<18}"
            f"{restarted:<24}{r.seconds:>6.0f}  {reasons}"
        )
        out += [f"{'':<22}{note}" for note in r.chaos.notes]
    print("\n".join(out))


def violations(traffic: Traffic, faults: list[float]) -> list[str]:
    """Samples where Ready was True and the probe failed, unless a fault was injected while the
    probe ran or at most ``DETECTION`` s before it began; each with the samples around it."""
    found = []
    for sample in traffic.samples:
        probe = sample.probe
        if probe is None or probe.ok:
            continue
        if any(probe.start - DETECTION <= f <= probe.end for f in faults):
            continue
        since = [probe.start - f for f in faults if f <= probe.start]
        after = f"{min(since):.2f}s after the last fault" if since else "before any fault"
        around = [
            f"{s.at - probe.start:+.2f}s Ready={s.ready}"
            + (f" probe {s.probe.outcome}" if s.probe else "")
            for s in traffic.samples
            if abs(s.at - probe.start) <= 3
        ]
        found.append(
            f"Ready=True {after}, the probe failed: {probe.outcome} "
            f"(took {probe.end - probe.start:.2f}s); samples around it: {'; '.join(around)}"
        )
    return found


@pytest.mark.parametrize(
    "scenario",
    [
        "decode-drain",
        "prefill-drain",
        "decode-kill-x3",
        "prefill-kill-x3",
        "zookeeper-restart",
        "zookeeper-data-lost",
        "decode-die-down",
    ],
)
def test_a_fault_under_traffic_never_leaves_ready_untrue(
    scenario: str, stage: Stage, figures: list[Figures]
) -> None:
    began = time.monotonic()
    before = stage.pods()
    row = Figures(scenario)
    figures.append(row)
    chaos = row.chaos
    with Traffic(stage.gateway, stage.ready) as traffic:
        time.sleep(WARM_UP)
        warm = traffic.snapshot()
        try:
            SCENARIOS[scenario](stage, traffic, chaos)
            time.sleep(SETTLE)
        except BaseException as exc:
            chaos.notes.append(f"FAILED: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            raise
        finally:
            traffic.stopping.set()
            requests = traffic.snapshot()
            row.sent = len(requests)
            row.failed = dict(collections.Counter(r.outcome for r in requests if not r.ok))
            row.seconds = time.monotonic() - began
            probes = [x.probe for x in traffic.samples if x.probe is not None]
            chaos.notes.append(
                f"{len(traffic.samples)} Ready samples, {len(probes)} True (probes failed: "
                f"{sum(not p.ok for p in probes)})"
            )
    after = stage.pods()
    restarted = dict(chaos.hit)
    for name, run in after.items():
        was = before.get(name)
        if name in chaos.hit:
            continue
        if was is None or was.uid != run.uid:
            restarted[name] = "replaced (not hit)"
        elif run.restarts != was.restarts:
            restarted[name] = f"restarted {run.restarts - was.restarts} (not hit)"
    row.restarted = restarted
    failed = row.failed

    assert warm, "no request finished before the fault"
    assert all(r.ok for r in warm), (
        f"the group did not serve before the fault: {collections.Counter(r.outcome for r in warm)}"
    )
    assert not [v for v in restarted.values() if "not hit" in v], (
        f"pods the fault did not hit were restarted or replaced: {restarted}"
    )
    assert sorted(before) == sorted(after), f"pods before {sorted(before)}, after {sorted(after)}"
    bad = violations(traffic, chaos.faults)
    assert not bad, "Ready was True while the group could not serve:\n" + "\n".join(bad)
    late = [
        r
        for r in requests
        if r.outcome == "no_decode"
        and not any(r.start - NO_DECODE_BOUND <= f <= r.end for f in chaos.faults)
    ]
    assert not late, (
        f"{len(late)} requests failed for want of a decode (no_decode) although they began over "
        f"{NO_DECODE_BOUND}s after the fault: "
        + ", ".join(
            f"+{min((r.start - f for f in chaos.faults if f <= r.start), default=-1):.2f}s"
            for r in late
        )
    )
    if scenario == "zookeeper-restart":
        assert not failed, f"a ZooKeeper restart with its data kept failed requests: {failed}"

    # deleting the group leaves nothing behind
    deleted = time.time()
    stage.groups.delete(GROUP)
    stage.wait(lambda: absent(lambda: stage.groups.get(GROUP)), 60, "the group deleted")
    chaos.notes.append(f"group deleted in {time.time() - deleted:.1f}s")
    # the garbage collector takes the pods; it learns of a CRD installed moments ago only at its
    # next discovery (every 30 s), so a fresh session's first group may take that long
    stage.wait(lambda: not stage.core.list_namespaced_pod(stage.namespace).items, 60, "no pod left")
    stage.wait(lambda: not stage.pods(), 30, "no pod left on the node emulator")
    with zookeeper(stage.zookeeper.address) as zk:
        assert not zk.exists(zl.group_path(stage.namespace, GROUP)), "the group's znodes remain"
    alive = [p for p, t in stage.seen_pids.items() if t is not None and process_start_time(p) == t]
    assert not alive, f"engine processes left: {alive}"


def test_a_group_deleted_while_zookeeper_is_down_goes_and_leaves_nothing_once_it_is_back(
    stage: Stage,
) -> None:
    """The finalizer waits for ZooKeeper a bounded time, then lets the group go (Warning
    ZooKeeperUnreachable); once ZooKeeper is back, the sweep of the operator's new session
    removes the group's subtree."""
    paths = zl.GroupPaths(stage.namespace, GROUP)
    stage.zookeeper.stop()
    started = time.time()
    stage.groups.delete(GROUP)
    stage.wait(lambda: absent(lambda: stage.groups.get(GROUP)), 60, "the group gone")
    assert time.time() - started < 60
    reasons = [e.reason for e in events_of(stage.groups.core, stage.namespace, GROUP)]
    assert "ZooKeeperUnreachable" in reasons, reasons
    stage.zookeeper.start()

    def swept() -> bool:
        with zookeeper(stage.zookeeper.address) as zk:
            return zk.exists(paths.root) is None

    stage.wait(swept, 30, "the group's subtree swept once ZooKeeper is back")
