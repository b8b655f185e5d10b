"""The node emulator on the real local control plane: scheduling by NPUs, processes on pod IPs,
deletion, restarts with back-off, device status faults, node down, hang, bad input."""

from __future__ import annotations

import ipaddress
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from matrixserve.devcluster.procs import process_start_time
from testkit.helpers import absent, events_of, wait_for

NPU = "huawei.com/Ascend910"


def stub_container(npus: int = 0, **extra: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "engine",
        "image": "matrixserve/engine-stub:dev",
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Kubelet behaviour is under test here, not timing: load the model quickly.
            {"name": "MATRIXSERVE_TIME_SCALE", "value": "50"},
        ],
        "args": ["--host", "$(POD_IP)", "--port", "8000"],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8000}, "periodSeconds": 1},
    }
    if npus:
        container["resources"] = {"limits": {NPU: str(npus)}}
    container.update(extra)
    return container


def pod_body(name: str, node: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": containers,
            **spec,
        },
    }


def ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def emulated_pid(emulator: Any, name: str) -> tuple[int, int]:
    entry = next(p for p in emulator.pods() if p["name"] == name)
    pid = (
        entry["pids"]["engine"] if "engine" in entry["pids"] else next(iter(entry["pids"].values()))
    )
    start = process_start_time(pid)
    assert start is not None
    return pid, start


def ready_pod(core: client.CoreV1Api, namespace: str, name: str, what: str = "") -> client.V1Pod:
    """Pod ``name`` once it is Ready."""
    return wait_for(
        lambda: (p := core.read_namespaced_pod(name, namespace)) and ready(p) and p,
        what=what or f"{name} Ready",
    )


def run_pod(
    core: client.CoreV1Api, namespace: str, name: str, node: str, container: dict[str, Any]
) -> client.V1Pod:
    """Create a one-container pod on ``node``; return it once it is Ready."""
    core.create_namespaced_pod(namespace, pod_body(name, node, [container]))
    return ready_pod(core, namespace, name)


def waiting_state(core: client.CoreV1Api, namespace: str, name: str) -> Any:
    """The first container's waiting state, once it has one (for ``wait_for``)."""
    statuses = core.read_namespaced_pod(name, namespace).status.container_statuses
    return statuses and statuses[0].state.waiting


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture
def emulator(start_emulator: Callable[..., Any]) -> Any:
    """A node emulator with one server (8 NPUs)."""
    return start_emulator(servers=1)


def test_the_emulated_kubelet_reports_the_api_servers_version(
    api_client: client.ApiClient, core: client.CoreV1Api, emulator: Any
) -> None:
    """No version skew between the emulated kubelets and the control plane they join."""
    server = client.VersionApi(api_client).get_code().git_version
    info = wait_for(
        lambda: core.read_node(emulator.nodes[0]).status.node_info,
        what="the node's nodeInfo",
    )
    assert info.kubelet_version == f"{server}-matrixserve-emulated"


def test_three_4npu_pods_on_an_8npu_node_two_run_one_pending(
    api_client: client.ApiClient, core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    node = emulator.nodes[0]
    apps = client.AppsV1Api(api_client)
    template = pod_body("x", node, [stub_container(npus=4)])
    apps.create_namespaced_deployment(
        namespace,
        {
            "metadata": {"name": "stub"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "stub"}},
                "template": {"metadata": {"labels": {"app": "stub"}}, "spec": template["spec"]},
            },
        },
    )

    def settled() -> Any:
        pods = core.list_namespaced_pod(namespace).items
        running = [p for p in pods if p.status.phase == "Running" and ready(p)]
        pending = [p for p in pods if p.status.phase == "Pending" and not p.spec.node_name]
        return (
            (running, pending)
            if len(pods) == 3 and len(running) == 2 and len(pending) == 1
            else None
        )

    running, pending = wait_for(settled, what="2 pods Running+Ready and 1 Pending")
    message = next(c.message for c in pending[0].status.conditions if c.type == "PodScheduled")
    assert f"Insufficient {NPU}" in message

    granted: list[set[str]] = []
    for pod in running:
        info = httpx.get(
            f"http://{pod.status.pod_ip}:8000/v1/info", timeout=5, trust_env=False
        ).json()
        assert info["pod"] == pod.metadata.name
        assert info["namespace"] == namespace
        assert info["node"] == node
        assert len(info["npus"]) == 4
        assert len(info["dies"]) == 8
        assert all(
            ipaddress.ip_address(ip) in ipaddress.ip_network("198.18.0.0/15")
            for ip in info["roceIps"]
        )
        assert pod.metadata.annotations[NPU] == ",".join(f"Ascend910-{n}" for n in info["npus"])
        granted.append(set(info["npus"]))
        assert ipaddress.ip_address(pod.status.pod_ip).is_loopback
    assert granted[0].isdisjoint(granted[1]), "two pods were given the same NPU"
    assert running[0].status.pod_ip != running[1].status.pod_ip


def test_deleting_a_pod_stops_its_process_and_frees_its_npus(
    core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    run_pod(core, namespace, "victim", emulator.nodes[0], stub_container(npus=8))
    pid, start = emulated_pid(emulator, "victim")

    core.delete_namespaced_pod("victim", namespace)

    wait_for(
        lambda: absent(lambda: core.read_namespaced_pod("victim", namespace)),
        timeout=40,
        what="the pod object to be finalised",
    )
    assert process_start_time(pid) != start, "the pod's process outlived the pod"
    # Its 8 NPUs are free again: a new 8-NPU pod runs on the same node.
    run_pod(core, namespace, "next", emulator.nodes[0], stub_container(npus=8))
    events = events_of(core, namespace, "victim")
    assert any(e.reason == "Killing" for e in events)


def test_crashing_container_restarts_with_backoff_and_reports_exit_code(
    core: client.CoreV1Api, namespace: str, emulator: Any, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    crash = {
        "name": "main",
        "image": "busybox",
        "command": ["sh", "-c", f"date +%s.%N >> {starts}; exit 3"],
    }
    core.create_namespaced_pod(namespace, pod_body("crasher", emulator.nodes[0], [crash]))

    def crash_looping() -> Any:
        status = core.read_namespaced_pod("crasher", namespace).status
        cs = (status.container_statuses or [None])[0]
        if cs is None or cs.restart_count < 3 or cs.state.waiting is None:  # in back-off
            return None
        return cs

    cs = wait_for(crash_looping, timeout=40, what="3 restarts")
    assert cs.state.waiting.reason == "CrashLoopBackOff"
    assert cs.last_state.terminated.exit_code == 3
    assert cs.last_state.terminated.reason == "Error"
    times = [float(x) for x in starts.read_text().split()]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) >= 3
    # As the kubelet: the first restart at once, then an exponential back-off from 0.5 s, each
    # gap at least doubling the wait (a gap is the back-off plus the restart's own start-up,
    # which a loaded machine only lengthens).
    assert gaps[0] < gaps[1], f"the first restart waited: {gaps}"
    assert gaps[1] >= 0.4, gaps
    assert gaps[2] >= 0.9, f"back-off did not grow: {gaps}"
    events = events_of(core, namespace, "crasher")
    assert any(e.reason == "BackOff" and e.type == "Warning" for e in events)


def test_die_fault_appears_in_the_node_device_file_within_one_second(
    core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    pod = run_pod(core, namespace, "reader", emulator.nodes[0], stub_container(npus=2))
    info = httpx.get(f"http://{pod.status.pod_ip}:8000/v1/info", timeout=5, trust_env=False).json()
    device_file = Path(info["deviceStatusFile"])
    die = int(info["dies"][1])
    before = json.loads(device_file.read_text())

    injected_at = time.monotonic()
    result = emulator.fault(kind="die-down", node=emulator.nodes[0], die=die)
    assert result["changed"] is True

    def faulted() -> Any:
        data = json.loads(device_file.read_text())
        dies = {d["id"]: d for n in data["npus"] for d in n["dies"]}
        return data if dies[die]["health"] == "Unhealthy" else None

    after = wait_for(faulted, timeout=1.0, what="the die fault in the device file")
    assert time.monotonic() - injected_at < 1.0
    assert after["generation"] == before["generation"] + 1
    fault = next(d for n in after["npus"] for d in n["dies"] if d["id"] == die)["faults"][0]
    assert (fault["type"], fault["level"], fault["code"]) == (
        "CardUnhealthy",
        "SeparateNPU",
        "DIE_DOWN",
    )
    others = [d for n in after["npus"] for d in n["dies"] if d["id"] != die]
    assert all(d["health"] == "Healthy" for d in others)

    emulator.fault(heal=True, kind="die-down", node=emulator.nodes[0], die=die)
    healed = json.loads(device_file.read_text())
    assert all(d["health"] == "Healthy" for n in healed["npus"] for d in n["dies"])


def test_link_down_is_recorded_on_both_ends(start_emulator: Callable[..., Any]) -> None:
    emulator = start_emulator(servers=2)
    a, b = emulator.nodes
    emulator.fault(kind="link-down", node=a, die=3, peerNode=b, peerDie=3)
    with emulator.http() as http:
        side_a = http.get(f"/nodes/{a}/device-status").json()
        side_b = http.get(f"/nodes/{b}/device-status").json()
    roce = {
        n: {d["id"]: d["roceIp"] for npu in s["npus"] for d in npu["dies"]}
        for n, s in ((a, side_a), (b, side_b))
    }
    assert side_a["links"] == [
        {
            **side_a["links"][0],
            "die": 3,
            "peerRoceIp": roce[b][3],
            "health": "Down",
            "plane": "RoCE",
        }
    ]
    assert side_b["links"][0]["peerRoceIp"] == roce[a][3]
    assert side_a["links"][0]["type"] == "CardNetworkUnhealthy"


def test_node_down_makes_the_node_notready_and_its_processes_gone(
    core: client.CoreV1Api, namespace: str, start_emulator: Callable[..., Any]
) -> None:
    emulator = start_emulator(servers=2)
    down_node, other_node = emulator.nodes
    core.create_namespaced_pod(namespace, pod_body("on-down", down_node, [stub_container(npus=1)]))
    core.create_namespaced_pod(
        namespace, pod_body("on-other", other_node, [stub_container(npus=1)])
    )
    for name in ("on-down", "on-other"):
        ready_pod(core, namespace, name)
    pid, start = emulated_pid(emulator, "on-down")
    other_pid, other_start = emulated_pid(emulator, "on-other")

    emulator.fault(kind="node-down", node=down_node)

    def node_not_ready() -> bool:
        node = core.read_node(down_node)
        conditions = {c.type: c.status for c in node.status.conditions}
        return bool(conditions["Ready"] != "True")

    wait_for(node_not_ready, timeout=5, what="node NotReady")
    wait_for(lambda: process_start_time(pid) != start, timeout=5, what="the pod's process to die")
    wait_for(
        lambda: not ready(core.read_namespaced_pod("on-down", namespace)),
        timeout=5,
        what="pod not Ready",
    )
    taints = {(t.key, t.effect) for t in core.read_node(down_node).spec.taints or []}
    assert ("node.kubernetes.io/unreachable", "NoSchedule") in taints
    # Nothing on the other node was touched.
    assert process_start_time(other_pid) == other_start
    assert ready(core.read_namespaced_pod("on-other", namespace))

    emulator.fault(heal=True, kind="node-down", node=down_node)
    wait_for(lambda: not node_not_ready(), timeout=5, what="node Ready again")
    revived = ready_pod(core, namespace, "on-down", what="pod Ready again")
    assert revived.status.container_statuses[0].restart_count == 1
    assert not core.read_node(down_node).spec.taints


def test_hang_stops_the_process_until_healed(
    core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    container = stub_container(npus=1)
    container["readinessProbe"] |= {"failureThreshold": 1, "timeoutSeconds": 1}
    run_pod(core, namespace, "sleepy", emulator.nodes[0], container)
    pid, _ = emulated_pid(emulator, "sleepy")

    result = emulator.fault(kind="hang", namespace=namespace, pod="sleepy")
    assert result["pids"] == [pid]
    # SIGSTOP is delivered asynchronously: the process may still be running for an instant
    stat = Path(f"/proc/{pid}/stat")
    wait_for(
        lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "T",
        timeout=5,
        what="the process stopped (state T)",
    )
    wait_for(
        lambda: not ready(core.read_namespaced_pod("sleepy", namespace)),
        timeout=10,
        what="not Ready",
    )

    emulator.fault(heal=True, kind="hang", namespace=namespace, pod="sleepy")
    wait_for(
        lambda: ready(core.read_namespaced_pod("sleepy", namespace)), timeout=10, what="Ready again"
    )
    assert emulated_pid(emulator, "sleepy")[0] == pid, "hang/heal must not restart the process"


def test_unknown_image_fails_with_a_clear_reason(
    core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    core.create_namespaced_pod(
        namespace,
        pod_body("mystery", emulator.nodes[0], [{"name": "main", "image": "example.com/nope:1"}]),
    )
    state = wait_for(lambda: waiting_state(core, namespace, "mystery"), what="a waiting reason")
    assert state.reason == "ErrImagePull"
    assert 'image "example.com/nope:1" is not known to the node emulator' in state.message
    events = events_of(core, namespace, "mystery")
    assert any(e.reason == "Failed" and e.type == "Warning" for e in events)


def test_missing_secret_reference_is_a_config_error(
    core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    container = {
        "name": "main",
        "image": "busybox",
        "command": ["sleep", "60"],
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "t"}}}],
    }
    core.create_namespaced_pod(namespace, pod_body("needs-secret", emulator.nodes[0], [container]))
    state = wait_for(
        lambda: waiting_state(core, namespace, "needs-secret"), what="a waiting reason"
    )
    assert state.reason == "CreateContainerConfigError"
    assert 'Secret "absent" not found' in state.message


def test_a_secret_volume_is_a_read_only_file_and_a_missing_secret_waits_like_a_kubelet(
    core: client.CoreV1Api, namespace: str, emulator: Any
) -> None:
    """Issue 16 finding 7: ZooKeeper's identity reaches pods as a mounted Secret. Missing, the
    pod waits in ContainerCreating with the kubelet's FailedMount Event (nothing runs, nothing
    crashes); once it exists the mount is tried again: the process reads the key at the path
    its container names, with the volume's mode; the pod's deletion takes the files away."""
    container = {
        "name": "main",
        "image": "busybox",
        "command": ["sh", "-c", 'cat "$AUTH"; echo; stat -c %a "$AUTH"; sleep 60'],
        "env": [{"name": "AUTH", "value": "/etc/matrixserve/auth"}],
        "volumeMounts": [{"name": "zk", "mountPath": "/etc/matrixserve", "readOnly": True}],
    }
    volume = {"name": "zk", "secret": {"secretName": "zk-auth", "defaultMode": 0o440}}
    core.create_namespaced_pod(
        namespace, pod_body("mounts", emulator.nodes[0], [container], volumes=[volume])
    )
    state = wait_for(lambda: waiting_state(core, namespace, "mounts"), what="a waiting reason")
    assert state.reason == "ContainerCreating"
    failed = wait_for(
        lambda: [e for e in events_of(core, namespace, "mounts") if e.reason == "FailedMount"],
        what="a FailedMount Event",
    )
    assert failed[0].type == "Warning"
    assert failed[0].message == (
        'MountVolume.SetUp failed for volume "zk" : secret "zk-auth" not found'
    )
    assert core.read_namespaced_pod("mounts", namespace).status.phase == "Pending"
    assert not next(p for p in emulator.pods() if p["name"] == "mounts")["pids"]
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(metadata=client.V1ObjectMeta(name="zk-auth"), string_data={"auth": "u:p"}),
    )
    ready_pod(core, namespace, "mounts", "the pod running once its Secret exists")
    (folder,) = Path(emulator.state_dir, "pods").glob(f"{namespace}_mounts_*")
    log = folder / "main.log"
    lines = wait_for(
        lambda: (
            (out := [ln for ln in log.read_text().splitlines() if not ln.startswith("===")])
            and len(out) >= 2
            and out
        ),
        what="what the process read",
    )
    assert lines[:2] == ["u:p", "440"]
    assert (folder / "volumes" / "zk" / "auth").read_text() == "u:p"
    core.delete_namespaced_pod("mounts", namespace, grace_period_seconds=0)
    wait_for(
        lambda: not (folder / "volumes").exists(),
        timeout=15,
        what="a deleted pod's Secret files removed from disk",
    )


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"kind": "die-down"}, 400, "node is required"),
        ({"kind": "die-down", "node": "no-such-node", "die": 0}, 404, "is not emulated here"),
        ({"kind": "die-down", "node": "NODE", "die": 99}, 400, "needs die in 0..15"),
        ({"kind": "melt", "node": "NODE"}, 400, "invalid fault"),
        ({"kind": "link-down", "node": "NODE", "die": 1}, 400, "needs peerNode and peerDie"),
        (
            {"kind": "link-down", "node": "NODE", "die": 1, "peerRoceIp": "10.0.0.1"},
            400,
            "'10.0.0.1' is not a RoCE IP (in 198.18.0.0/15)",
        ),
        (
            {"kind": "link-down", "node": "NODE", "die": 1, "peerDie": 2, "peerRoceIp": "x"},
            400,
            "not both",
        ),
        ({"kind": "npu-down", "node": "NODE", "npu": 1, "die": 3}, 400, "takes node, npu; not die"),
        ({"kind": "hang", "namespace": "x", "pod": "y"}, 404, "is not running here"),
    ],
)
def test_bad_fault_requests_get_clear_errors_and_change_nothing(
    emulator: Any, body: dict[str, Any], status: int, message: str
) -> None:
    body = {k: (emulator.nodes[0] if v == "NODE" else v) for k, v in body.items()}
    with emulator.http() as http:
        response = http.post("/faults", json=body)
        assert response.status_code == status
        assert message in response.json()["error"]
        assert http.get(f"/nodes/{emulator.nodes[0]}/device-status").json()["generation"] == 0


def test_advertise_mode_adds_npus_and_device_file_to_an_existing_node_and_runs_no_pods(
    core: client.CoreV1Api, cluster: Any, namespace: str, tmp_path: Path
) -> None:
    """Kind mode: real kubelets run containers; the emulator is only device plugin + fault file."""
    import os
    import secrets
    import sys

    from matrixserve.devcluster.procs import Supervisor

    name = f"kind-worker-{secrets.token_hex(3)}"
    labels = {
        "matrixserve.io/superpod": "sp-1",
        "matrixserve.io/server": "sp-1-server-1",
        "kubernetes.io/hostname": name,
    }
    core.create_node({"metadata": {"name": name, "labels": labels}})
    sup = Supervisor(tmp_path / "advertise")
    try:
        sup.start(
            "advertise",
            [
                sys.executable,
                "-m",
                "enginestub.node",
                "run",
                "--mode",
                "advertise",
                "--node-name",
                name,
                "--state-dir",
                str(tmp_path / "advertise" / "data"),
            ],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
        )

        def advertised() -> Any:
            node = core.read_node(name)
            return node if (node.status.capacity or {}).get(NPU) == "8" else None

        node = wait_for(advertised, what="NPU capacity on the node")
        assert node.status.allocatable[NPU] == "8"
        assert node.metadata.labels["matrixserve.io/emulated-node"] == "advertised"
        device_file = tmp_path / "advertise" / "data" / "nodes" / name / "device-status.json"
        first_die = json.loads(device_file.read_text())["npus"][0]["dies"][0]
        assert first_die["roceIp"] == "198.18.65.1"  # SuperPod 1, server 1, die 0
        # The taint the admission plugin set stays: a real kubelet owns readiness in kind mode.
        assert any(t.key == "node.kubernetes.io/not-ready" for t in node.spec.taints or [])
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {"name": "not-ours"},
                "spec": {
                    "nodeName": name,
                    "containers": [{"name": "c", "image": "busybox", "command": ["sleep", "60"]}],
                },
            },
        )
        time.sleep(2)
        assert core.read_namespaced_pod("not-ours", namespace).status.pod_ip is None
    finally:
        sup.stop("advertise", grace=10)
        core.delete_node(name)
