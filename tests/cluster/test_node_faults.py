"""The node emulator under faults (issue 17, "What to build" item 1, emulator side), on the real
API server and scheduler: a faulty NPU leaves allocatable and taints its server NoSchedule; a
down server leaves its pods Terminating as a real kubelet would, and, back, finalises and
restarts them with nothing leaked; the same across an emulator restart while a node is down."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from test_node_emulator import pod_body, ready

from enginestub.node.command import node_names, run_argv
from matrixserve.api.kinds import NPU_RESOURCE, TAINT_NPU_FAULT
from matrixserve.devcluster import tools
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.devcluster.procs import Supervisor, process_start_time
from testkit.helpers import absent, events_of, wait_for

UNREACHABLE = "node.kubernetes.io/unreachable"
FOREIGN = {"key": "example.com/keep", "value": "yes", "effect": "PreferNoSchedule"}
TOLERATE_NPU_FAULT = {"key": TAINT_NPU_FAULT, "operator": "Exists", "effect": "NoSchedule"}


def sleeper(npus: int) -> dict[str, Any]:
    """A sleep-like container asking for ``npus`` NPUs (kubelet behaviour is under test)."""
    return {
        "name": "main",
        "image": "busybox",
        "command": ["sleep", "3600"],
        "resources": {"limits": {NPU_RESOURCE: str(npus)}},
    }


def create_pod(
    core: client.CoreV1Api, namespace: str, name: str, node: str, npus: int, **spec: Any
) -> None:
    core.create_namespaced_pod(namespace, pod_body(name, node, [sleeper(npus)], **spec))


def running(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod:
    """The pod once it runs and is Ready."""
    return wait_for(
        lambda: (
            (p := core.read_namespaced_pod(name, namespace)).status.phase == "Running"
            and ready(p)
            and p
        ),
        what=f"{name} Running and Ready",
    )


def taints(core: client.CoreV1Api, node: str) -> set[tuple[str, str | None, str]]:
    return {(t.key, t.value, t.effect) for t in core.read_node(node).spec.taints or []}


def npus_allocatable(core: client.CoreV1Api, node: str) -> tuple[str, str]:
    status = core.read_node(node).status
    return status.capacity[NPU_RESOURCE], status.allocatable[NPU_RESOURCE]


def unschedulable(core: client.CoreV1Api, namespace: str, name: str) -> str:
    """The scheduler's message once the pod is Pending as Unschedulable ("" until then)."""
    pod = core.read_namespaced_pod(name, namespace)
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
            return str(condition.message)
    return ""


def node_events(core: client.CoreV1Api, node: str, reason: str) -> list[Any]:
    return [e for e in events_of(core, "default", node) if e.reason == reason]


def emulated(emulator: Any, node: str) -> dict[str, Any]:
    with emulator.http() as http:
        return next(n for n in http.get("/nodes").json() if n["name"] == node)


def add_foreign_taint(core: client.CoreV1Api, node: str) -> None:
    """Someone else's taint (a user's, another controller's): the emulator must keep it."""
    core.patch_node(node, {"spec": {"taints": [FOREIGN]}})


def holds(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    """Assert ``predicate()`` throughout ``seconds`` (what a fixed emulator must NOT do: the
    code before the fix does it within a fraction of a second)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), what
        time.sleep(0.1)


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


# --------------------------------------------------------------------------- faulty NPUs


def test_a_die_fault_takes_its_npu_out_of_allocatable_taints_the_node_and_heal_gives_it_back(
    core: client.CoreV1Api, namespace: str, start_emulator: Callable[..., Any]
) -> None:
    """xDeepServe §6.2: a faulty NPU is not allocatable and its server is tainted NoSchedule;
    only a pod tolerating the taint lands there, and it is granted healthy NPUs only."""
    emulator = start_emulator(servers=1)
    (node,) = emulator.nodes
    add_foreign_taint(core, node)

    result = emulator.fault(kind="die-down", node=node, die=7)  # die 7 is on NPU 3
    assert result["changed"] is True
    assert npus_allocatable(core, node) == ("8", "7")
    assert taints(core, node) == {
        (FOREIGN["key"], FOREIGN["value"], FOREIGN["effect"]),
        (TAINT_NPU_FAULT, "npu-3", "NoSchedule"),
    }
    (warning,) = wait_for(lambda: node_events(core, node, "NPUUnhealthy"), what="NPUUnhealthy")
    assert warning.type == "Warning"
    assert "NPU 3 is unhealthy (die-down on die 7)" in warning.message
    seen = emulated(emulator, node)
    assert seen["faultyNpus"] == [3]
    assert seen["allocatable"][NPU_RESOURCE] == "7"
    assert {"key": TAINT_NPU_FAULT, "value": "npu-3", "effect": "NoSchedule"} in seen["taints"]

    # Not tolerating the taint: Pending, whatever it asks for.
    create_pod(core, namespace, "plain", node, 1)
    message = wait_for(lambda: unschedulable(core, namespace, "plain"), what="plain Unschedulable")
    # (1.20's scheduler names the taint; a current one says "untolerated taint(s)" only — the
    # other taint on the node is PreferNoSchedule, so the NPU fault's is the one)
    assert (TAINT_NPU_FAULT if tools.legacy() else "untolerated taint") in message, message
    # Tolerating it but asking for every NPU: the scheduler counts only 7.
    create_pod(core, namespace, "greedy", node, 8, tolerations=[TOLERATE_NPU_FAULT])
    message = wait_for(lambda: unschedulable(core, namespace, "greedy"), what="greedy Pending")
    assert f"Insufficient {NPU_RESOURCE}" in message
    # Tolerating it and fitting the healthy NPUs: it runs, on every NPU but the faulty one.
    create_pod(core, namespace, "tolerant", node, 7, tolerations=[TOLERATE_NPU_FAULT])
    pod = running(core, namespace, "tolerant")
    healthy = [0, 1, 2, 4, 5, 6, 7]
    assert pod.metadata.annotations[NPU_RESOURCE] == ",".join(f"Ascend910-{n}" for n in healthy)
    assert next(p for p in emulator.pods() if p["name"] == "tolerant")["npus"] == healthy

    emulator.fault(heal=True, kind="die-down", node=node, die=7)
    assert npus_allocatable(core, node) == ("8", "8")
    assert taints(core, node) == {(FOREIGN["key"], FOREIGN["value"], FOREIGN["effect"])}
    (healed,) = wait_for(lambda: node_events(core, node, "NPUHealthy"), what="NPUHealthy")
    assert healed.type == "Normal"
    # The healed NPU is grantable again: the pod that waited gets it.
    pod = running(core, namespace, "plain")
    assert pod.metadata.annotations[NPU_RESOURCE] == "Ascend910-3"
    assert unschedulable(core, namespace, "greedy"), "8 NPUs asked, 1 free: still Pending"
    seen = emulated(emulator, node)
    assert (seen["faultyNpus"], seen["taints"]) == ([], [])


def test_npu_and_link_faults_and_node_down_share_the_taints(
    core: client.CoreV1Api, start_emulator: Callable[..., Any]
) -> None:
    """One place computes the node's taints: the npu-fault taint, the unreachable pair and
    someone else's taint live side by side through node-down and back; faults changed while
    the node is down show when it is back (a down server posts nothing)."""
    emulator = start_emulator(servers=1)
    (node,) = emulator.nodes
    foreign = (FOREIGN["key"], FOREIGN["value"], FOREIGN["effect"])
    add_foreign_taint(core, node)

    assert emulator.fault(kind="npu-down", node=node, npu=1)["dies"] == [2, 3]
    emulator.fault(kind="hbm-error", node=node, die=10)  # NPU 5
    assert npus_allocatable(core, node) == ("8", "6")
    assert taints(core, node) == {foreign, (TAINT_NPU_FAULT, "npu-1.npu-5", "NoSchedule")}
    # A RoCE link down makes its die's NPU NetworkUnhealthy: withheld from new pods as well
    link = {"kind": "link-down", "node": node, "die": 4, "peerRoceIp": "198.18.200.1"}
    emulator.fault(**link)
    assert npus_allocatable(core, node) == ("8", "5")
    assert taints(core, node) == {foreign, (TAINT_NPU_FAULT, "npu-1.npu-2.npu-5", "NoSchedule")}
    with emulator.http() as http:
        status = http.get(f"/nodes/{node}/device-status").json()
    assert [(x["die"], x["peerRoceIp"]) for x in status["links"]] == [(4, "198.18.200.1")]
    assert status["npus"][2]["dies"][0]["health"] == "Healthy"  # the die itself is up
    assert emulated(emulator, node)["faultyNpus"] == [1, 2, 5]
    emulator.fault(heal=True, **link)
    assert npus_allocatable(core, node) == ("8", "6")
    assert emulated(emulator, node)["faultyNpus"] == [1, 5]
    (link_back,) = wait_for(lambda: node_events(core, node, "NPUHealthy"), what="NPUHealthy")
    assert "NPU 2" in link_back.message

    emulator.fault(kind="node-down", node=node)
    assert taints(core, node) == {
        foreign,
        (TAINT_NPU_FAULT, "npu-1.npu-5", "NoSchedule"),
        (UNREACHABLE, None, "NoSchedule"),
        (UNREACHABLE, None, "NoExecute"),
    }
    emulator.fault(heal=True, kind="npu-down", node=node, npu=1)
    assert npus_allocatable(core, node) == ("8", "6"), "a down node posts nothing"
    assert len(node_events(core, node, "NPUHealthy")) == 1  # NPU 2's, before it went down

    emulator.fault(heal=True, kind="node-down", node=node)
    assert npus_allocatable(core, node) == ("8", "7")
    assert taints(core, node) == {foreign, (TAINT_NPU_FAULT, "npu-5", "NoSchedule")}
    healthy = wait_for(
        lambda: [e for e in node_events(core, node, "NPUHealthy") if "NPU 1" in e.message],
        what="NPU 1 healthy",
    )
    assert len(healthy) == 1
    assert len(node_events(core, node, "NPUUnhealthy")) == 3  # NPU 1, 2, 5: once each

    emulator.fault(heal=True, kind="hbm-error", node=node, die=10)
    assert npus_allocatable(core, node) == ("8", "8")
    assert taints(core, node) == {foreign}


# --------------------------------------------------------------------------- node down


def test_a_down_nodes_pods_wait_for_it_then_the_deleted_are_finalised_and_the_rest_restarted(
    core: client.CoreV1Api, namespace: str, start_emulator: Callable[..., Any]
) -> None:
    """A dead server's kubelet finalises nothing: a pod deleted meanwhile stays Terminating, a
    force delete removes it from the API at once; back, the node finalises the one, forgets the
    other (no process, NPU or credential left), and restarts the rest by restartPolicy."""
    emulator = start_emulator(servers=1)
    (node,) = emulator.nodes
    for name, npus, spec in (
        ("graceful", 2, {}),
        ("forced", 2, {}),
        ("always", 1, {}),
        ("never", 1, {"restartPolicy": "Never"}),
    ):
        create_pod(core, namespace, name, node, npus, **spec)
    for name in ("graceful", "forced", "always", "never"):
        running(core, namespace, name)
    before = {p["name"]: p for p in emulator.pods()}
    pids = {name: next(iter(p["pids"].values())) for name, p in before.items()}
    starts = {name: process_start_time(pid) for name, pid in pids.items()}
    held = {name: set(p["npus"]) for name, p in before.items()}
    assert {p["uid"] for p in before.values()} == {
        core.read_namespaced_pod(n, namespace).metadata.uid for n in before
    }
    assert all(p["node"] == node and p["restarts"] == 0 for p in before.values())

    emulator.fault(kind="node-down", node=node)
    wait_for(
        lambda: all(process_start_time(pid) != starts[name] for name, pid in pids.items()),
        timeout=5,
        what="every process of the node's pods dead",
    )
    wait_for(
        lambda: not any(ready(core.read_namespaced_pod(name, namespace)) for name in pids),
        timeout=5,
        what="its pods not Ready (the node lifecycle controller's part)",
    )
    versions = {
        name: core.read_namespaced_pod(name, namespace).metadata.resource_version
        for name in ("always", "never")
    }
    core.delete_namespaced_pod("graceful", namespace, grace_period_seconds=5)
    core.delete_namespaced_pod("forced", namespace, grace_period_seconds=0)
    wait_for(
        lambda: absent(lambda: core.read_namespaced_pod("forced", namespace)),
        timeout=5,
        what="a force-deleted pod gone from the API at once",
    )

    def nothing_done() -> bool:
        if absent(lambda: core.read_namespaced_pod("graceful", namespace)):
            return False  # its delete finalised: no down kubelet can do that
        graceful = core.read_namespaced_pod("graceful", namespace)
        return graceful.metadata.deletion_timestamp is not None and all(
            core.read_namespaced_pod(name, namespace).metadata.resource_version == version
            for name, version in versions.items()
        )

    holds(nothing_done, 3.0, "a down node finalised a delete or wrote a pod's status")
    books = emulator.pods()
    assert {p["name"] for p in books} == set(pids), "a down kubelet forgets nothing"
    assert not any(p["pids"] for p in books), "every process held down"

    emulator.fault(heal=True, kind="node-down", node=node)
    wait_for(
        lambda: absent(lambda: core.read_namespaced_pod("graceful", namespace)),
        timeout=15,
        what="the delete finalised once the node is back",
    )
    always = wait_for(
        lambda: (
            (p := core.read_namespaced_pod("always", namespace))
            and ready(p)
            and p.status.container_statuses[0].restart_count == 1
            and p
        ),
        timeout=15,
        what="restartPolicy Always: restarted once",
    )
    assert always.status.container_statuses[0].last_state.terminated.exit_code == 137
    never = wait_for(
        lambda: (p := core.read_namespaced_pod("never", namespace)).status.phase == "Failed" and p,
        timeout=15,
        what="restartPolicy Never: not restarted, the pod Failed",
    )
    status = never.status.container_statuses[0]
    assert (status.restart_count, status.state.terminated.exit_code) == (0, 137)

    after = {p["name"]: p for p in emulator.pods()}
    assert set(after) == {"always", "never"}
    assert (after["always"]["restarts"], bool(after["always"]["pids"])) == (1, True)
    assert (after["never"]["phase"], after["never"]["pids"]) == ("Failed", {})
    assert set(emulated(emulator, node)["freeNpus"]) == (
        set(range(8)) - held["always"] - held["never"]
    ), "the deleted pods' NPUs are free again, the others' still held"
    for name in ("graceful", "forced"):
        assert process_start_time(pids[name]) != starts[name]
        (folder,) = Path(emulator.state_dir, "pods").glob(f"{namespace}_{name}_*")
        assert not (folder / "serviceaccount").exists(), f"{name}'s token left on disk"


def _start_own_emulator(
    sup: Supervisor, cluster: ClusterInfo, state: Path, prefix: str, delete_on_exit: bool
) -> str:
    """An emulator whose restart keeps its Node (the fixture's deletes it on exit); its control
    URL once it serves."""
    (state / "emulator.json").unlink(missing_ok=True)
    fast = ("--backoff-base", "0.5", "--lease-interval", "2")
    argv = run_argv(
        state, superpods=1, servers=1, prefix=prefix, delete_nodes_on_exit=delete_on_exit
    )
    sup.start("node-emulator", [*argv, *fast], env={**os.environ, "KUBECONFIG": cluster.kubeconfig})
    info = state / "emulator.json"
    wait_for(info.exists, timeout=30, what="the emulator's control URL")
    return str(json.loads(info.read_text())["control"])


def test_an_emulator_restarted_while_a_node_is_down_leaks_nothing(
    core: client.CoreV1Api, cluster: ClusterInfo, namespace: str, tmp_path: Path
) -> None:
    """The down state lives in the emulator: restarted, its node is back. The pod deleted
    meanwhile is finalised, the force-deleted one's credentials are removed (an orphaned pod
    directory), the survivor runs again on the NPUs it was granted."""
    prefix = "e" + secrets.token_hex(3)
    (node,) = node_names(1, 1, prefix)
    sup = Supervisor(tmp_path / "own")
    state = tmp_path / "own" / "data"

    def node_ready() -> bool:
        try:
            current = core.read_node(node)
        except client.ApiException:
            return False
        conditions = {c.type: c.status for c in current.status.conditions or []}
        return conditions.get("Ready") == "True" and not current.spec.taints

    try:
        control = _start_own_emulator(sup, cluster, state, prefix, delete_on_exit=False)
        wait_for(node_ready, timeout=30, what="the node Ready")
        for name in ("kept", "deleted", "forced"):
            create_pod(core, namespace, name, node, 2)
        for name in ("kept", "deleted", "forced"):
            running(core, namespace, name)
        with httpx.Client(base_url=control, timeout=10, trust_env=False) as http:
            pods = {p["name"]: p for p in http.get("/pods").json()}
            for entry in pods.values():
                entry["start"] = process_start_time(next(iter(entry["pids"].values())))
            assert http.post("/faults", json={"kind": "node-down", "node": node}).is_success
        grant = core.read_namespaced_pod("kept", namespace).metadata.annotations[NPU_RESOURCE]
        core.delete_namespaced_pod("deleted", namespace, grace_period_seconds=30)
        core.delete_namespaced_pod("forced", namespace, grace_period_seconds=0)
        sup.stop("node-emulator", grace=15)
        folders = {n: next((state / "pods").glob(f"{namespace}_{n}_*")) for n in pods}
        assert (folders["forced"] / "serviceaccount").exists()  # what the restart must clean

        control = _start_own_emulator(sup, cluster, state, prefix, delete_on_exit=True)
        wait_for(node_ready, timeout=30, what="the node Ready again")
        wait_for(
            lambda: absent(lambda: core.read_namespaced_pod("deleted", namespace)),
            timeout=15,
            what="the pod deleted while the node was down finalised",
        )
        kept = running(core, namespace, "kept")
        assert kept.metadata.annotations[NPU_RESOURCE] == grant
        with httpx.Client(base_url=control, timeout=10, trust_env=False) as http:
            now = http.get("/pods").json()
            (seen,) = [n for n in http.get("/nodes").json() if n["name"] == node]
        assert [p["name"] for p in now] == ["kept"]
        assert len(seen["freeNpus"]) == 6
        for name in ("deleted", "forced"):
            pid = next(iter(pods[name]["pids"].values()))
            assert process_start_time(pid) != pods[name]["start"]
            assert not (folders[name] / "serviceaccount").exists(), f"{name}'s token on disk"
    finally:
        sup.stop("node-emulator", grace=15)
        with contextlib.suppress(client.ApiException):
            core.delete_node(node)
