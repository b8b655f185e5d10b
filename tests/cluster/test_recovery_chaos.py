"""Recovery under traffic (issue 17, second "Done when"): one fault at a time on a serving
2P+2D group while clients stream completions through the gateway — a die down (the server's
device status), a whole NPU down, a server down (``node-down``), one sub-link blocked, a hung
engine, a killed engine process. For each:

- the operator says what it saw and did (``status.lastRecovery``: the fault's kind and
  instance, the plan) and **the pods restarted equal the plan**: the pods replaced (a new UID)
  or restarted (more container restarts), read from the node emulator before and after, are
  the plan's instances, as many as ``podsRestarted``; a fault on one instance restarts exactly
  that instance's pod, nothing else;
- **no request fails that was not on the faulty instance** (a failed stream's error chunk names
  the instances it was on; a request refused up front — 503 with Retry-After while capacity is
  short — is no failure: nothing was served, the client is told to retry; those are counted
  and printed);
- the group is **Ready again with every desired instance** serving (each reported, Serving and
  linked in its current incarnation, every prefill an entrance, every decode in the decode
  meta, nobody under ``removed/``), and its subtree keeps nothing of a gone instance or
  incarnation;
- and, at the end, deleting the group leaves **no pod, no znode, no engine process**.

The faults run one after another on one group, each once the group is whole again from the
last (and the last one's die, NPU, link or server healed), so the file stays within ~4 min on 2
cores. Which instance each hits (:data:`FAULTS`) covers both roles: the kill and the die hit
decodes, the hang, the NPU, the link and the server prefills.

Topology: a private node emulator of six servers with **two NPUs each**, so a 2-NPU instance
fills a server (every instance is alone on its server: a server down takes one instance, and a
faulty NPU leaves its server no room for the replacement); four servers serve the group, two
are spare. Engines at time scale 50 (llama3-8b's cold load from the shared file service, 7.7
emulated s, is 0.15 wall s), a TTFT budget of 60 emulated s (1.2 wall s), the node emulator's
restart back-off 0.5 s (as test_chaos). The figures of each fault are printed as a table at the
end (``pytest -s``); ``make bench-recovery`` measures them at time scale 1.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client, config

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.devcluster.procs import process_start_time
from testkit.chaoskit import (
    GROUP,
    LastRecovery,
    Request,
    Run,
    Stage,
    Subject,
    Traffic,
    dies_of,
    failed_outside,
    pod_runs,
    run_fault,
)
from testkit.helpers import Groups, absent, pdgroup_body, wait_for, zookeeper

TIME_SCALE = "50"
SERVERS, NPUS_PER_SERVER = 6, 2
PREFILLS = {f"{GROUP}-p-0", f"{GROUP}-p-1"}
DECODES = {f"{GROUP}-d-0", f"{GROUP}-d-1"}
WARM_UP = 2.0  # s of traffic before the first fault (every request must succeed)
SETTLE = 2.0  # s of traffic between a fault's restore and the next fault
RESTORE_BOUND = 30.0  # s from a fault until the group is whole again
# (fault, the instance it hits, the far end of a link fault), in the order they run
FAULTS: list[tuple[str, str, str]] = [
    ("kill", f"{GROUP}-d-0", ""),
    ("hang", f"{GROUP}-p-1", ""),
    ("die", f"{GROUP}-d-1", ""),
    ("npu", f"{GROUP}-p-0", ""),
    ("link", f"{GROUP}-p-1", f"{GROUP}-d-0"),
    ("node", f"{GROUP}-p-0", ""),
]
# The plans that restart pods (their instances'); Relink and MaskAndRetry restart none.
RESTARTING = {"Replace", "RestartInPlace", "Shrink", "RestartGroup"}


@pytest.fixture
def stage(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    tmp_path: Path,
    start_emulator: Callable[..., Any],
    start_operator: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> Iterator[Stage]:
    """A private node emulator (six 2-NPU servers), the operator and the gateway on the session's
    ZooKeeper, and group ``g`` (2P+2D) serving."""
    emulator = start_emulator(servers=SERVERS, extra=("--npus-per-server", str(NPUS_PER_SERVER)))
    core = client.CoreV1Api(api_client)
    sampler_api = config.new_client_from_config(config_file=cluster.kubeconfig)
    sampler_groups = Groups(sampler_api, namespace)
    with cordoned(core, keep=emulator.nodes):
        try:
            operator = start_operator(namespace, webhook=False, time_scale=TIME_SCALE)
            gateway = start_gateway("--time-scale", TIME_SCALE)
            stage = Stage(
                namespace,
                groups,
                SimpleNamespace(address=cluster.zookeeper),
                emulator,
                operator,
                gateway,
                lambda: sampler_groups.ready(GROUP),
                tmp_path / "gateway" / "logs" / "gateway-0.log",
            )
            body = pdgroup_body(GROUP, len(PREFILLS), len(DECODES))
            body["spec"]["slo"]["ttftMilliseconds"] = 60000
            groups.create(body)
            stage.wait(stage.is_ready, 90, "the group Ready")
            yield stage
        finally:
            sampler_api.close()
            let_go(groups, GROUP)


@contextlib.contextmanager
def cordoned(core: client.CoreV1Api, keep: list[str]) -> Iterator[None]:
    """The session's other emulated nodes take no pod of this test meanwhile."""
    others = {
        n.metadata.name: bool(n.spec.unschedulable)
        for n in core.list_node(label_selector=f"{kinds.LABEL_EMULATED}=true").items
        if n.metadata.name not in keep
    }
    for name in others:
        core.patch_node(name, {"spec": {"unschedulable": True}})
    try:
        yield
    finally:
        for name, was in others.items():
            with contextlib.suppress(client.ApiException):
                core.patch_node(name, {"spec": {"unschedulable": was}})


def let_go(groups: Groups, name: str) -> None:
    """A test that failed may leave its group behind with an operator that cannot finish it:
    the namespace's deletion must not hang on the finalizer."""
    with contextlib.suppress(client.ApiException):
        if not absent(lambda: groups.get(name)):
            groups.delete(name)
            time.sleep(5)
            groups.custom.patch_namespaced_custom_object(
                *groups.where, name, {"metadata": {"finalizers": None}}
            )


# --------------------------------------------------------------------------- judging one fault


def excused(run: Run, request: Request) -> bool:
    """Whether a failed request was on what the fault hit: the faulty instance (for a link, the
    prefill and decode at its two ends, together), or an instance the plan took down."""
    injected = run.injected
    planned = set(run.recovery.plan_instances) if run.recovery is not None else set()
    if bool(request.on(planned)):
        return True
    if injected.kind == "link":
        return (request.prefill, request.decode) == (injected.instance, injected.peer)
    return bool(request.on({injected.instance}))


def problems(run: Run, requests: list[Request]) -> list[str]:
    """What went wrong with one fault, each as a sentence (empty: nothing)."""
    injected, last = run.injected, run.recovery
    kind, instance = injected.kind, injected.instance
    found = []
    if run.restored_s is None:
        found.append(f"not whole within {RESTORE_BOUND:g}s: {'; '.join(run.not_whole)}")
    if last is None:
        found.append("no status.lastRecovery about this fault")
    else:
        if last.kind != kind or instance not in last.instances:
            found.append(
                f"lastRecovery says a {last.kind} fault on {list(last.instances)}, not {kind} "
                f"on {instance}"
            )
        planned = set(last.plan_instances) if last.action in RESTARTING else set()
        if set(run.restarted) != planned or len(run.restarted) != last.pods_restarted:
            found.append(
                f"pods restarted {run.restarted}; the plan: {last.action} of "
                f"{sorted(planned)}, podsRestarted {last.pods_restarted}"
            )
    if kind != "link" and set(run.restarted) != {instance}:
        found.append(f"a {kind} fault on {instance} restarted {run.restarted}, not that pod alone")
    outside = [r for r in failed_outside(requests, injected.at, ()) if not excused(run, r)]
    if outside:
        found.append(
            f"{len(outside)} requests failed that were not on the faulty instance: "
            + ", ".join(
                f"{r.outcome} on {r.prefill or '?'}/{r.decode or '?'} +{r.start - injected.at:.1f}s"
                for r in outside[:8]
            )
        )
    if run.leftovers:
        found.append(f"left in ZooKeeper after the restore: {run.leftovers}")
    return [f"{kind} on {instance}: {p}" for p in found]


def figures(run: Run, requests: list[Request]) -> str:
    """One row of the table printed at the end."""
    last = run.recovery
    failed = collections.Counter(r.outcome for r in requests if not r.ok)

    def s(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else "-"

    plan = f"{last.action} {','.join(last.plan_instances)}" if last else "-"
    return (
        f"{run.injected.kind:<6}{run.injected.instance:<8}{s(run.seen_s):>6}{s(run.unready_s):>9}"
        f"{s(run.detected_s):>9}{s(run.restored_s):>10}"
        f"{s(last.predicted_s if last else None):>11}  {plan:<24}"
        f"{','.join(f'{k} {v}' for k, v in run.restarted.items()) or 'none':<22}"
        f"{len(requests):>5}  {', '.join(f'{k} {v}' for k, v in sorted(failed.items())) or '-'}"
    )


# --------------------------------------------------------------------------- the test


def test_each_fault_restarts_what_the_plan_says_fails_nothing_else_and_restores_the_group(
    stage: Stage, cluster: ClusterInfo
) -> None:
    runs: list[tuple[Run, list[Request]]] = []
    found: list[str] = []
    with (
        zookeeper(cluster.zookeeper) as zk,
        Traffic(stage.gateway) as traffic,
    ):
        subject = Subject(
            stage.namespace,
            GROUP,
            stage.emulator.control,
            zk,
            stage.status,
            lambda: stage.pods(live=True),
            PREFILLS,
            DECODES,
        )
        time.sleep(WARM_UP)
        warm = traffic.snapshot()
        assert warm, "no request finished before the first fault"
        assert all(r.ok for r in warm), (
            "the group did not serve before the faults: "
            f"{collections.Counter(r.outcome for r in warm)}\n{stage.explain()}"
        )
        try:
            for kind, instance, peer in FAULTS:
                run = run_fault(subject, kind, instance, peer, RESTORE_BOUND)
                time.sleep(SETTLE)
                # this fault's requests: those that ended since (the next fault's come later)
                runs.append((run, [r for r in traffic.snapshot() if r.end >= run.injected.at]))
                found += problems(run, runs[-1][1])
                if run.restored_s is None:
                    break  # the next fault would hit a group that is not whole
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{stage.explain()}")
        finally:
            print_table(runs)
    assert not found, "\n".join(found) + "\n" + stage.explain()
    assert len(runs) == len(FAULTS)

    # deleting the group leaves nothing behind
    stage.groups.delete(GROUP)
    stage.wait(lambda: absent(lambda: stage.groups.get(GROUP)), 60, "the group deleted")
    # the garbage collector learns of a CRD installed moments ago only at its next discovery
    stage.wait(lambda: not stage.core.list_namespaced_pod(stage.namespace).items, 60, "no pod")
    stage.wait(lambda: not stage.pods(), 30, "no pod left on the node emulator")
    with zookeeper(cluster.zookeeper) as zk:
        assert not zk.exists(zl.group_path(stage.namespace, GROUP)), "the group's znodes remain"
    alive = [p for p, t in stage.seen_pids.items() if t is not None and process_start_time(p) == t]
    assert not alive, f"engine processes left: {alive}"


def print_table(runs: list[tuple[Run, list[Request]]]) -> None:
    refused = sum(r.refused_up_front for _, requests in runs for r in requests)
    print(
        "\n".join(
            [
                "",
                f"recovery under traffic (2P+2D llama3-8b, one instance per 2-NPU server, engine "
                f"time scale {TIME_SCALE}; seconds from the injection, wall clock)",
                f"{'fault':<6}{'on':<8}{'seen':>6}{'unready':>9}{'detected':>9}{'restored':>10}"
                f"{'predicted':>11}  {'plan':<24}{'pods restarted':<22}{'reqs':>5}  failed",
                *(figures(run, requests) for run, requests in runs),
                f"(requests refused up front while capacity was short, not failures: {refused})",
            ]
        )
    )


# --------------------------------------------------------------------------- a shrink's prefill


def test_a_shrink_gives_up_only_a_prefill_whose_npus_the_decode_can_use(
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    start_emulator: Callable[..., Any],
    start_operator: Callable[..., Any],
) -> None:
    """Issue 31 item 4: a 2P+1D group on three 2-NPU servers, each instance alone on one. Once
    it serves, g-p-1's server is cordoned (g-p-1 serves on: a cordon evicts nothing), then a die
    goes down on g-d-0: its server is tainted, no NPU is free, so the decode is restored by
    giving up a prefill (xDeepServe §6.2). g-p-1 is the one a shrink gives up first (the last),
    but no new pod may go where it runs: the plan gives up g-p-0, whose server takes the new
    decode. The decode serves again there, g-p-1 is untouched, g-p-0 waits Pending until the
    die heals, then the group is whole. (Before: g-p-1 was given up for NPUs the decode could
    not use; the decode stayed Pending and the group served nothing.)"""
    emulator = start_emulator(servers=3, extra=("--npus-per-server", "2"))
    core = client.CoreV1Api(api_client)
    also_cordoned: list[str] = []
    with cordoned(core, keep=emulator.nodes):
        start_operator(namespace, webhook=False, time_scale=TIME_SCALE)
        try:
            groups.create(pdgroup_body(GROUP, 2, 1))
            groups.wait_ready(GROUP)
            pods = groups.pods(GROUP)
            kept = pods[f"{GROUP}-p-1"]
            home = pods[f"{GROUP}-p-0"].spec.node_name
            also_cordoned.append(kept.spec.node_name)
            core.patch_node(kept.spec.node_name, {"spec": {"unschedulable": True}})
            decode = pod_runs(emulator.pods(), namespace)[f"{GROUP}-d-0"]
            die = {
                "kind": "die-down",
                "node": decode.node,
                "die": dies_of(emulator.control, decode)[0]["id"],
            }
            emulator.fault(**die)
            try:
                last = wait_for(
                    lambda: (
                        (found := LastRecovery.of(groups.get(GROUP).get("status") or {}))
                        and found.kind == "die"
                        and found
                    ),
                    30,
                    "the die's recovery planned",
                    explain=groups.explain,
                )
                assert (last.action, last.raw["plan"]["sacrificed"]) == (
                    "Shrink",
                    [f"{GROUP}-p-0"],
                ), last.raw
                wait_for(
                    lambda: (
                        (pod := groups.pods(GROUP).get(f"{GROUP}-d-0")) is not None
                        and pod.spec.node_name == home
                        and any(
                            c.type == "Ready" and c.status == "True"
                            for c in pod.status.conditions or []
                        )
                        and LastRecovery.of(groups.get(GROUP)["status"]).phase == "Restored"  # type: ignore[union-attr]  # a record was read above
                    ),
                    60,
                    "the new decode serving on g-p-0's server",
                    explain=groups.explain,
                )
                assert groups.pods(GROUP)[f"{GROUP}-p-1"].metadata.uid == kept.metadata.uid
                wait_for(
                    lambda: groups.condition(GROUP, "Ready").get("reason") == "Unschedulable",
                    30,
                    "g-p-0 desired again, Pending for want of NPUs",
                    explain=groups.explain,
                )
            finally:
                emulator.fault(heal=True, **die)
            groups.wait_ready(GROUP, "the group whole once the die heals")
            assert groups.pods(GROUP)[f"{GROUP}-p-1"].metadata.uid == kept.metadata.uid
        finally:
            for node in also_cordoned:
                with contextlib.suppress(client.ApiException):
                    core.patch_node(node, {"spec": {"unschedulable": False}})
            let_go(groups, GROUP)
