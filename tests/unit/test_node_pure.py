"""Pure parts of the node emulator: topology, NPU allocation, addressing, pod specs, status."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from enginestub.node import allocator, devicestatus, nodestatus, podspec, podstatus
from enginestub.node.command import node_names, run_argv
from enginestub.node.network import AddressExhausted, NodeAddresses, choose_cidrs
from enginestub.node.runner import ContainerState, Terminated
from enginestub.node.topology import (
    SuperPodSpec,
    TopologySpec,
    build,
    server_for_existing_node,
)
from matrixserve.api.kinds import NPU_RESOURCE, TAINT_NPU_FAULT
from matrixserve.api.rfc3339 import format_seconds as rfc3339

# ----------------------------------------------------------------------------- topology


def test_a_full_superpod_is_384_npus_768_dies_with_unique_roce_ips() -> None:
    servers = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=48)]))
    assert len(servers) == 48
    assert sum(s.npus for s in servers) == 384
    dies = [d for s in servers for d in s.dies]
    assert len(dies) == 768
    ips = [d.roce_ip for d in dies]
    assert len(set(ips)) == 768
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("198.18.0.0/15") for ip in ips)
    assert len({s.rack for s in servers}) == 16


def test_dies_of_npus_are_ordered_by_device_id() -> None:
    server = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=1)]))[0]
    assert [d.index for d in server.dies_of([3, 1])] == [2, 3, 6, 7]
    assert server.capacity[NPU_RESOURCE] == "8"
    assert server.labels["matrixserve.io/superpod"] == "sp0"


def test_roce_ips_differ_across_superpods() -> None:
    spec = TopologySpec(
        superpods=[SuperPodSpec(name="a", servers=2), SuperPodSpec(name="b", servers=2)]
    )
    ips = [d.roce_ip for s in build(spec) for d in s.dies]
    assert len(ips) == len(set(ips)) == 64


@pytest.mark.parametrize(
    "data",
    [
        {"superpods": []},
        {"superpods": [{"name": "Bad_Name", "servers": 1}]},
        {"superpods": [{"name": "sp", "servers": 49}]},
        {"superpods": [{"name": "sp", "servers": 1}, {"name": "sp", "servers": 1}]},
        {"superpods": [{"name": "sp", "servers": 1, "colour": "red"}]},
    ],
)
def test_invalid_topologies_are_rejected(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TopologySpec.model_validate(data)


def test_advertise_mode_server_comes_from_node_labels() -> None:
    server = server_for_existing_node(
        "kind-worker2",
        {"matrixserve.io/superpod": "sp-1", "matrixserve.io/server": "sp-1-server-1"},
    )
    assert (server.superpod_index, server.server_index) == (1, 1)
    assert server.dies[0].roce_ip == "198.18.65.1"


@pytest.mark.parametrize(
    ("prefix", "first", "last"),
    [(None, "sp0-server-00", "sp1-server-02"), ("x", "x0-server-00", "x1-server-02")],
)
def test_run_argv_parses_and_names_the_nodes_the_emulator_registers(
    tmp_path: Path, prefix: str | None, first: str, last: str
) -> None:
    from enginestub.node.__main__ import _parser, _topology

    argv = run_argv(tmp_path, superpods=2, servers=3, prefix=prefix, extra=("--no-zygote",))
    assert argv[1:4] == ["-m", "enginestub.node", "run"]
    args = _parser().parse_args(argv[3:])
    assert (args.state_dir, args.delete_nodes_on_exit, args.no_zygote) == (tmp_path, True, True)
    registered = [s.node_name for s in build(_topology(args))]
    named = node_names(2, 3) if prefix is None else node_names(2, 3, prefix)
    assert registered == named
    assert (len(named), named[0], named[-1]) == (6, first, last)


def test_ssd_models_are_the_servers_and_every_pod_is_told_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18: what a server's local SSD holds is the emulated server's (``--ssd-models``):
    every pod it runs gets $MATRIXSERVE_SSD_MODELS, which a warm engine reports as ssdModels."""
    from enginestub.engine.config import parse_warm
    from enginestub.node.__main__ import _parser, _topology
    from enginestub.node.podenv import SSD_MODELS_ENV, PodEnvironment
    from enginestub.node.state import EmulatorConfig, NodeState, PodRecord

    argv = run_argv(tmp_path, superpods=1, servers=1, ssd_models=("llama3-8b", "qwen2-72b"))
    args = _parser().parse_args(argv[3:])
    assert args.ssd_models == ("llama3-8b", "qwen2-72b")
    (server,) = build(_topology(args))
    config = EmulatorConfig(servers=[server], state_dir=tmp_path, ssd_models=args.ssd_models)
    node = NodeState(
        server=server,
        addresses=NodeAddresses("127.64.0.0/24"),
        allocator=allocator.NodeAllocator(server.npus),
        devices=devicestatus.DeviceStatus(server),
        device_file=tmp_path / "device-status.json",
    )
    record = PodRecord("uid-1", "t", "w-1", server.node_name, {}, ip="127.64.0.2", npus=[0])
    env = PodEnvironment(config, None).base(node, record)
    assert env[SSD_MODELS_ENV] == "llama3-8b,qwen2-72b"
    # the warm engine in that pod reports them
    pod_env = {**env, "POD_NAME": "w-1", "POD_UID": "uid-1", "MATRIXSERVE_ZK": "127.0.0.1:1"}
    monkeypatch.setattr(os, "environ", pod_env)
    warm = parse_warm(["--warm"])
    assert warm is not None
    assert warm.ssd_models == ["llama3-8b", "qwen2-72b"]
    # without the flag, no pod is told anything
    bare = EmulatorConfig(servers=[server], state_dir=tmp_path)
    assert SSD_MODELS_ENV not in PodEnvironment(bare, None).base(node, record)
    default = _parser().parse_args(run_argv(tmp_path, superpods=1, servers=1)[3:])
    assert default.ssd_models == ()


@pytest.mark.parametrize("value", ["", "a,,b", "a b", ","])
def test_bad_ssd_models_are_refused(value: str, tmp_path: Path) -> None:
    from enginestub.node.__main__ import _parser

    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["run", "--state-dir", str(tmp_path), "--ssd-models", value])
    assert exited.value.code == 2


# ----------------------------------------------------------------------------- allocation


def test_allocation_never_double_grants_and_prefers_contiguous() -> None:
    alloc = allocator.NodeAllocator(8)
    assert alloc.allocate("a", 2) == [0, 1]
    assert alloc.allocate("b", 4) == [2, 3, 4, 5]
    alloc.release("a")
    # Free: 0, 1, 6, 7 - no run of three, so the lowest ids.
    assert alloc.allocate("c", 3) == [0, 1, 6]
    with pytest.raises(allocator.AllocationError):
        alloc.allocate("d", 2)  # only NPU 7 is left


def test_allocation_is_idempotent_per_pod() -> None:
    alloc = allocator.NodeAllocator(8)
    assert alloc.allocate("a", 4) == alloc.allocate("a", 4) == [0, 1, 2, 3]
    with pytest.raises(allocator.AllocationError, match="already holds"):
        alloc.allocate("a", 2)


def test_adopting_a_grant_owned_by_another_pod_is_refused() -> None:
    alloc = allocator.NodeAllocator(8)
    alloc.adopt("a", [0, 1])
    with pytest.raises(allocator.AllocationError, match="already granted"):
        alloc.adopt("b", [1, 2])
    with pytest.raises(allocator.AllocationError, match="does not exist"):
        alloc.adopt("b", [8])
    assert alloc.free() == [2, 3, 4, 5, 6, 7]


@given(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 4), st.booleans()), max_size=40)
)
def test_allocation_invariants_hold_for_any_sequence(ops: list[tuple[str, int, bool]]) -> None:
    alloc = allocator.NodeAllocator(8)
    for pod, count, release in ops:
        if release:
            alloc.release(pod)
            continue
        try:
            got = alloc.allocate(pod, count)
        except allocator.AllocationError:
            continue
        assert len(got) == count or alloc.held_by(pod) == got
    owners = list(alloc.owners.items())
    assert len({n for n, _ in owners}) == len(owners)
    assert all(0 <= n < 8 for n, _ in owners)


def test_a_faulty_npu_is_never_granted_anew_and_its_holder_keeps_it() -> None:
    """Issue 17: the device plugin grants healthy NPUs only; a pod already holding a faulty one
    keeps it (recovery replaces that pod)."""
    alloc = allocator.NodeAllocator(8)
    assert alloc.allocate("holder", 2) == [0, 1]
    faulty = {1, 3}
    assert alloc.allocate("holder", 2, faulty) == [0, 1]
    assert alloc.free(faulty) == [2, 4, 5, 6, 7]
    assert alloc.allocate("next", 3, faulty) == [4, 5, 6]  # contiguous, around NPU 3
    with pytest.raises(allocator.AllocationError, match=r"2 free and healthy of 8 \(faulty"):
        alloc.allocate("greedy", 3, faulty)
    assert alloc.free() == [2, 3, 7], "free: granted to nobody, faulty or not"


@given(st.sets(st.integers(0, 7)), st.integers(0, 8))
def test_no_grant_ever_includes_a_faulty_npu(faulty: set[int], count: int) -> None:
    alloc = allocator.NodeAllocator(8)
    try:
        got = alloc.allocate("pod", count, faulty)
    except allocator.AllocationError:
        assert count > 8 - len(faulty)
        return
    assert len(got) == count
    assert not set(got) & faulty


def test_grant_annotation_round_trips_and_rejects_garbage() -> None:
    assert allocator.parse_grant(allocator.format_grant([3, 1])) == [1, 3]
    assert allocator.parse_grant("") == []
    with pytest.raises(ValueError, match="bad NPU grant"):
        allocator.parse_grant("GPU-0")


# ----------------------------------------------------------------------------- addressing


def test_cidrs_avoid_those_taken_and_addresses_are_unique() -> None:
    cidrs = choose_cidrs(3, ["127.64.0.0/24", "127.64.2.0/24"])
    assert cidrs == ["127.64.1.0/24", "127.64.3.0/24", "127.64.4.0/24"]
    node = NodeAddresses("127.64.1.0/24")
    assert node.host_ip == "127.64.1.1"
    first, second = node.claim(), node.claim()
    assert (first, second) == ("127.64.1.2", "127.64.1.3")
    assert node.claim("127.64.1.77") == "127.64.1.77"
    assert node.claim("127.64.1.2") == "127.64.1.4", "a taken preferred address is not reused"
    assert node.claim("10.0.0.5") == "127.64.1.5", "an address outside the CIDR is never used"
    node.release(first)
    assert node.claim() == first


def test_a_full_node_cidr_is_reported() -> None:
    node = NodeAddresses("127.64.9.0/30")
    node.claim()
    with pytest.raises(AddressExhausted):
        node.claim()


# ----------------------------------------------------------------------------- pod specs

POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
    "spec": {"nodeName": "n1", "serviceAccountName": "sa"},
    "status": {"podIP": "127.64.0.9", "hostIP": "127.64.0.1"},
}


@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("matrixserve/engine-stub:dev", "matrixserve/engine-stub"),
        (
            "localhost:5000/matrixserve/engine-stub:1.2@sha256:abc",
            "localhost:5000/matrixserve/engine-stub",
        ),
        ("busybox", "busybox"),
        ("docker.io/library/busybox:1.36", "docker.io/library/busybox"),
    ],
)
def test_image_repository(image: str, repo: str) -> None:
    assert podspec.image_repository(image) == repo


def test_entrypoint_resolution_and_unknown_image_message() -> None:
    images = {"matrixserve/engine-stub": ["python", "-m", "enginestub"], "busybox": []}
    assert podspec.resolve_entrypoint("registry.local/matrixserve/engine-stub:1", images) == [
        "python",
        "-m",
        "enginestub",
    ]
    assert (
        podspec.resolve_entrypoint("localhost:5000/matrixserve/engine-stub", images)[0] == "python"
    )
    assert podspec.resolve_entrypoint("docker.io/library/busybox:1.36", images) == []
    with pytest.raises(podspec.UnknownImageError, match='image "nginx" is not known'):
        podspec.resolve_entrypoint("nginx", images)
    with pytest.raises(podspec.UnknownImageError):
        podspec.resolve_entrypoint("other/engine-stub", images)


def test_env_downward_api_expansion_and_lookups() -> None:
    container = {
        "name": "c",
        "image": "busybox",
        "command": ["echo", "$(GREETING) $(POD) $$(NOT) $(MISSING)"],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "GREETING", "value": "hi-$(POD)"},
            {
                "name": "NPUS",
                "valueFrom": {"resourceFieldRef": {"resource": f"limits.{NPU_RESOURCE}"}},
            },
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
        ],
        "resources": {"limits": {NPU_RESOURCE: "4"}},
    }
    pod = {**POD, "spec": {**POD["spec"], "containers": [container]}}  # type: ignore[dict-item]
    lookup = {("Secret", "s"): {"t": "secret-value"}}
    plans = podspec.plan_containers(
        pod, {"busybox": []}, lambda k, n: lookup.get((k, n)), {"PATH": "/bin"}
    )
    env = plans[0].env
    assert env["POD"] == "p"
    assert env["IP"] == "127.64.0.9"
    assert env["APP"] == "x"
    assert env["GREETING"] == "hi-p"
    assert env["NPUS"] == "4"
    assert env["TOKEN"] == "secret-value"
    assert env["PATH"] == "/bin"
    assert plans[0].argv == ("echo", "hi-p p $(NOT) $(MISSING)")
    assert podspec.npu_request(pod) == 4


def test_missing_secret_key_and_optional_refs() -> None:
    def lookup(kind: str, name: str) -> dict[str, str] | None:
        return {"other": "x"} if name == "s" else None

    missing_key = {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}}
    with pytest.raises(podspec.ContainerConfigError, match="couldn't find key t in Secret s"):
        podspec.container_env(POD, {"env": [missing_key]}, lookup, {})
    optional = {
        "name": "T",
        "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "t", "optional": True}},
    }
    assert "T" not in podspec.container_env(POD, {"env": [optional]}, lookup, {})


def test_probes_resolve_named_ports_and_reject_bad_ones() -> None:
    container = {
        "name": "c",
        "image": "busybox",
        "command": ["x"],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": 8000}, "failureThreshold": 5},
    }
    pod = {**POD, "spec": {"containers": [container]}}
    plan = podspec.plan_containers(pod, {"busybox": []}, lambda k, n: None, {})[0]
    assert plan.readiness is not None
    assert (plan.readiness.kind, plan.readiness.port, plan.readiness.path) == (
        "http",
        8000,
        "/readyz",
    )
    assert plan.readiness.period == 2
    assert plan.liveness is not None
    assert (plan.liveness.kind, plan.liveness.failure_threshold) == ("tcp", 5)
    bad = {**container, "readinessProbe": {"httpGet": {"port": "grpc"}}}
    with pytest.raises(podspec.ContainerConfigError, match="named port"):
        podspec.plan_containers(
            {**POD, "spec": {"containers": [bad]}}, {"busybox": []}, lambda k, n: None, {}
        )


def test_host_image_without_command_is_a_config_error() -> None:
    pod = {**POD, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    with pytest.raises(podspec.ContainerConfigError, match="has no command"):
        podspec.plan_containers(pod, {"busybox": []}, lambda k, n: None, {})


# ----------------------------------------------------------------------------- pod status


def _state(
    phase: str, code: int | None = None, restarts: int = 0, ready: bool = False
) -> ContainerState:
    s = ContainerState("c", "img", phase=phase, restart_count=restarts, ready=ready, started_at=1.0)
    if code is not None:
        s.terminated = Terminated(code, "Completed" if code == 0 else "Error", 1.0, 2.0)
    return s


@pytest.mark.parametrize(
    ("states", "policy", "phase"),
    [
        ([_state("waiting")], "Always", "Pending"),
        ([_state("running")], "Always", "Running"),
        ([_state("terminated", 0)], "Never", "Succeeded"),
        ([_state("terminated", 1)], "Never", "Failed"),
        ([_state("terminated", 0)], "OnFailure", "Succeeded"),
        ([_state("waiting", 1, restarts=2)], "Always", "Running"),
        ([_state("terminated", 1)], "Always", "Running"),
    ],
)
def test_pod_phase(states: list[ContainerState], policy: str, phase: str) -> None:
    assert podstatus.pod_phase(states, policy) == phase


def test_conditions_keep_transition_time_until_they_flip() -> None:
    first = podstatus.render(
        [_state("running", ready=True)],
        restart_policy="Always",
        pod_ip="127.64.0.2",
        host_ip="127.64.0.1",
        started_at=0,
        now=100,
    )
    same = podstatus.render(
        [_state("running", ready=True)],
        restart_policy="Always",
        pod_ip="127.64.0.2",
        host_ip="127.64.0.1",
        started_at=0,
        now=200,
        previous_conditions=first["conditions"],
    )
    flipped = podstatus.render(
        [_state("running", ready=True)],
        restart_policy="Always",
        pod_ip="127.64.0.2",
        host_ip="127.64.0.1",
        started_at=0,
        now=300,
        previous_conditions=same["conditions"],
        node_ready=False,
    )
    ready = {c["type"]: c for c in same["conditions"]}["Ready"]
    assert (
        ready["lastTransitionTime"]
        == {c["type"]: c for c in first["conditions"]}["Ready"]["lastTransitionTime"]
    )
    flipped_ready = {c["type"]: c for c in flipped["conditions"]}["Ready"]
    assert flipped_ready["status"] == "False"
    assert flipped_ready["lastTransitionTime"] != ready["lastTransitionTime"]


# ----------------------------------------------------------------------------- device status


def test_device_status_render_inject_heal(tmp_path: Path) -> None:
    server = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=1)]))[0]
    status = devicestatus.DeviceStatus(server)
    fault = devicestatus.Fault(devicestatus.FaultKind.HBM_ERROR, 5, "t0")
    assert status.inject(fault)
    assert not status.inject(fault), "the same fault twice is one fault"
    assert status.unhealthy_dies() == {5}
    path = tmp_path / "status.json"
    devicestatus.write_atomically(path, status.render("t1"))
    data = json.loads(path.read_text())
    assert data["generation"] == 1
    npu2 = data["npus"][2]
    assert npu2["health"] == "Unhealthy"
    assert npu2["dies"][1]["faults"][0]["level"] == "RestartBusiness"
    assert status.heal(devicestatus.FaultKind.HBM_ERROR, 5)
    assert status.render("t2")["npus"][2]["health"] == "Healthy"
    assert not list(tmp_path.glob(".status.json.*")), "no temp files left behind"


@pytest.mark.parametrize(
    ("kind", "die", "faulty"),
    [
        (devicestatus.FaultKind.DIE_DOWN, 7, {3}),
        (devicestatus.FaultKind.NPU_DOWN, 2, {1}),
        (devicestatus.FaultKind.HBM_ERROR, 10, {5}),
        (devicestatus.FaultKind.LINK_DOWN, 4, {2}),  # NetworkUnhealthy: withheld as well
    ],
)
def test_a_die_npu_hbm_or_link_fault_makes_its_npu_faulty(
    kind: devicestatus.FaultKind, die: int, faulty: set[int]
) -> None:
    server = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=1)]))[0]
    status = devicestatus.DeviceStatus(server)
    peer = "198.18.1.1" if kind == devicestatus.FaultKind.LINK_DOWN else None
    status.inject(devicestatus.Fault(kind, die, "t0", peer))
    assert status.faulty_npus() == faulty
    assert [f.die for n in faulty for f in status.faults_of_npu(n)] == [die] * len(faulty)
    assert status.unhealthy_dies() == (set() if peer else {die})  # a link leaves the die up
    status.heal(kind, die, peer)
    assert status.faulty_npus() == frozenset()


# ----------------------------------------------------------------------------- Node status, taints

LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def test_allocatable_drops_by_the_faulty_npus_and_capacity_stays() -> None:
    server = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=1)]))[0]
    status = nodestatus.node_status(
        server, "127.64.0.1", down=False, faulty={3, 5}, boot_id="b", now=0.0
    )
    assert status["capacity"][NPU_RESOURCE] == "8"
    assert status["allocatable"][NPU_RESOURCE] == "6"
    assert status["allocatable"]["cpu"] == status["capacity"]["cpu"]
    down = nodestatus.node_status(server, "127.64.0.1", down=True, faulty=(), boot_id="b", now=0)
    assert next(c for c in down["conditions"] if c["type"] == "Ready")["status"] == "Unknown"


@pytest.mark.parametrize(
    ("npus", "value"),
    [
        ({3, 5}, "npu-3.npu-5"),
        ([5, 3, 3], "npu-3.npu-5"),
        (set(range(8)), "npu-0.npu-1.npu-2.npu-3.npu-4.npu-5.npu-6.npu-7"),
        (set(range(16)), "npu-0-15"),  # each by name would pass 63 characters
        (set(range(16)) - {9}, "npu-0-8.npu-10-15"),
        (set(range(0, 400, 2)), "npus-200"),  # beyond any catalogue server: the count
    ],
)
def test_the_npu_fault_taint_value_names_the_faulty_npus(
    npus: list[int] | set[int], value: str
) -> None:
    assert nodestatus.npu_fault_taint_value(npus) == value


@given(st.sets(st.integers(0, 15), min_size=1) | st.sets(st.integers(0, 999), min_size=1))
def test_the_npu_fault_taint_value_is_always_a_label_value(npus: set[int]) -> None:
    value = nodestatus.npu_fault_taint_value(npus)
    assert len(value) <= 63
    assert LABEL_VALUE.match(value)


def test_the_node_taints_keep_others_and_follow_the_node_state() -> None:
    """Issue 17: one place computes a node's taints; others' are never touched."""
    cordon = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    user = {"key": "example.com/keep", "value": "yes", "effect": "PreferNoSchedule"}
    admission = {"key": nodestatus.NOT_READY_TAINT, "effect": "NoSchedule"}
    fresh = nodestatus.node_taints(
        [admission, cordon, user], full=True, down=False, faulty=(), now=0
    )
    assert fresh == [cordon, user], "the not-ready taint lifted, the others kept in order"

    faulty = nodestatus.node_taints(fresh, full=True, down=False, faulty={5, 1}, now=0)
    npu_fault = {"key": TAINT_NPU_FAULT, "value": "npu-1.npu-5", "effect": "NoSchedule"}
    assert faulty == [cordon, user, npu_fault]

    down = nodestatus.node_taints(faulty, full=True, down=True, faulty={5, 1}, now=100.0)
    unreachable = [
        {"key": nodestatus.UNREACHABLE_TAINT, "effect": "NoSchedule"},
        {"key": nodestatus.UNREACHABLE_TAINT, "effect": "NoExecute", "timeAdded": rfc3339(100)},
    ]
    assert down == [cordon, user, *unreachable, npu_fault]
    again = nodestatus.node_taints(down, full=True, down=True, faulty={1, 5}, now=200.0)
    assert again == down, "a taint already there keeps its timeAdded"

    back = nodestatus.node_taints(down, full=True, down=False, faulty={5}, now=300.0)
    assert back == [cordon, user, {**npu_fault, "value": "npu-5"}]
    assert nodestatus.node_taints(back, full=True, down=False, faulty=(), now=0) == [cordon, user]


def test_in_advertise_mode_only_the_npu_fault_taint_is_the_emulators() -> None:
    """Under kind a real kubelet owns readiness: its taints are left alone."""
    admission = {"key": nodestatus.NOT_READY_TAINT, "effect": "NoSchedule"}
    got = nodestatus.node_taints([admission], full=False, down=True, faulty={2}, now=0)
    assert got == [admission, {"key": TAINT_NPU_FAULT, "value": "npu-2", "effect": "NoSchedule"}]


# ----------------------------------------------------------------------------- Secret volumes
def _secret_pod(items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A pod mounting Secret ``zk`` at /etc/zk (and the service-account token, handled apart)."""
    secret: dict[str, Any] = {"secretName": "zk", "defaultMode": 0o440}
    if items is not None:
        secret["items"] = items
    return {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "busybox",
                    "command": ["run", "--auth-file=/etc/zk/auth", "/etc/zk"],
                    "args": ["/etc/zkx/auth", "x=/etc/zk/auth"],
                    "workingDir": "/etc/zk",
                    "env": [
                        {"name": "AUTH_FILE", "value": "/etc/zk/auth"},
                        {"name": "NOT_A_PATH", "value": "see /etc/zk/auth"},
                    ],
                    "volumeMounts": [
                        {"name": "zk", "mountPath": "/etc/zk", "readOnly": True},
                        {"name": "sa", "mountPath": podspec.SERVICE_ACCOUNT_MOUNT},
                    ],
                }
            ],
            "volumes": [
                {"name": "zk", "secret": secret},
                {"name": "sa", "secret": {"secretName": "sa-token"}},
                {"name": "unmounted", "secret": {"secretName": "other"}},
            ],
        },
    }


def test_secret_volumes_are_projected_as_the_kubelet_does() -> None:
    (volume,) = podspec.secret_volumes(_secret_pod([{"key": "auth", "path": "auth"}]))
    assert (volume.name, volume.secret, volume.default_mode) == ("zk", "zk", 0o440)
    data = {"auth": b"u:p", "other": b"x"}
    assert podspec.secret_files("ns", volume, data) == {"auth": (b"u:p", 0o440)}
    (every_key,) = podspec.secret_volumes(_secret_pod())
    assert set(podspec.secret_files("ns", every_key, data)) == {"auth", "other"}
    with pytest.raises(podspec.MountError) as missing:
        podspec.secret_files("ns", volume, None)
    assert str(missing.value) == (
        'MountVolume.SetUp failed for volume "zk" : secret "zk" not found'
    )
    with pytest.raises(podspec.MountError, match="couldn't find key auth in Secret ns/zk"):
        podspec.secret_files("ns", volume, {"other": b"x"})
    (escaping,) = podspec.secret_volumes(_secret_pod([{"key": "auth", "path": "../../etc/x"}]))
    with pytest.raises(podspec.MountError, match="invalid path"):
        podspec.secret_files("ns", escaping, data)
    optional = podspec.SecretVolume("zk", "zk", optional=True)
    assert podspec.secret_files("ns", optional, None) == {}


def test_a_containers_mount_path_is_moved_to_the_folder_the_emulator_wrote() -> None:
    pod = _secret_pod()
    pod["status"] = {"podIP": "127.1.0.2"}
    (plan,) = podspec.plan_containers(pod, {"busybox": []}, lambda k, n: None, {}, {"zk": "/w/zk"})
    assert plan.argv == ("run", "--auth-file=/w/zk/auth", "/w/zk", "/etc/zkx/auth", "x=/w/zk/auth")
    assert plan.env["AUTH_FILE"] == "/w/zk/auth"
    assert plan.env["NOT_A_PATH"] == "see /etc/zk/auth"  # not a path value: left
    assert plan.working_dir == "/w/zk"
    assert podspec.translate("/etc/zk/a", {"/etc/zk": "/w", "/etc/zk/a": "/v"}) == "/v"


def test_secret_files_are_written_with_their_modes_and_nothing_else(tmp_path: Path) -> None:
    from enginestub.node.podenv import remove_volumes, write_files

    folder = tmp_path / "volumes" / "zk"
    write_files(folder, {"auth": (b"old", 0o440), "gone": (b"x", 0o400)})
    write_files(folder, {"auth": (b"u:p", 0o440), "sub/key": (b"k", 0o400)})  # a retry
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == ["auth", "key"]
    assert (folder / "auth").read_bytes() == b"u:p"
    assert (folder / "auth").stat().st_mode & 0o777 == 0o440
    assert (folder / "sub" / "key").stat().st_mode & 0o777 == 0o400
    remove_volumes(tmp_path)
    assert not (tmp_path / "volumes").exists()


def test_the_service_account_token_secret_is_the_volume_mounted_at_the_service_account_path() -> (
    None
):
    from enginestub.node import podspec

    pod: dict[str, Any] = {
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "volumeMounts": [
                        {"name": "data", "mountPath": "/data"},
                        {"name": "sa-token-x1", "mountPath": podspec.SERVICE_ACCOUNT_MOUNT},
                    ],
                }
            ],
            "volumes": [
                {"name": "data", "secret": {"secretName": "not-this"}},
                {"name": "sa-token-x1", "secret": {"secretName": "sa-token-x1"}},
            ],
        }
    }
    assert podspec.service_account_secret(pod) == "sa-token-x1"
    pod["spec"]["containers"][0]["volumeMounts"].pop()  # automountServiceAccountToken: false
    assert podspec.service_account_secret(pod) is None
    config = json.loads(podspec.token_kubeconfig("https://127.0.0.1:6443", "/ca.crt", "tok"))
    assert config["users"][0]["user"]["token"] == "tok"
    assert config["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": "/ca.crt",
    }


def test_service_variables_selectors_and_target_ports_follow_the_kubelet() -> None:
    from enginestub.node import services

    svc = {
        "metadata": {"name": "ms-matrixserve-zookeeper"},
        "spec": {
            "clusterIP": "127.128.3.4",
            "ports": [{"name": "client", "port": 2181}, {"name": "admin-http", "port": 8080}],
        },
    }
    headless = {"metadata": {"name": "zk-headless"}, "spec": {"clusterIP": "None", "ports": []}}
    env = services.service_env([svc, headless])
    assert env == {
        "MS_MATRIXSERVE_ZOOKEEPER_SERVICE_HOST": "127.128.3.4",
        "MS_MATRIXSERVE_ZOOKEEPER_SERVICE_PORT": "2181",
        "MS_MATRIXSERVE_ZOOKEEPER_SERVICE_PORT_CLIENT": "2181",
        "MS_MATRIXSERVE_ZOOKEEPER_SERVICE_PORT_ADMIN_HTTP": "8080",
    }
    assert services.matches({"app": "zk"}, {"app": "zk", "x": "y"})
    assert not services.matches({"app": "zk"}, {"app": "gw"})
    assert not services.matches({}, {"app": "zk"})  # no selector: no pod is an endpoint
    backend = services.Backend("127.64.0.9", {"client": 2181})
    assert services.target_port({"port": 80, "targetPort": "client"}, backend) == 2181
    assert services.target_port({"port": 80, "targetPort": 8090}, backend) == 8090
    assert services.target_port({"port": 80}, backend) == 80
    assert services.target_port({"port": 80, "targetPort": "missing"}, backend) is None


def test_a_pods_first_status_holds_since_the_pod_started_and_a_true_condition_has_no_reason() -> (
    None
):
    """A kubelet's first status stamps the conditions at the pod's start, before its containers
    run: a pod not Ready since then was never Ready in its container (the operator reads it so,
    PodView.awaiting_first_probe), even if this first write comes a second after the start.
    A condition that holds carries no reason: null, since the status is a merge patch that
    would otherwise keep "ContainersNotReady" beside "True"."""
    common: dict[str, Any] = {
        "restart_policy": "Always",
        "pod_ip": "127.64.0.2",
        "host_ip": "127.64.0.1",
        "started_at": 1_000,
    }
    first = podstatus.render([_state("running", ready=False)], now=1_001.5, **common)
    ready = {c["type"]: c for c in first["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ContainersNotReady")
    assert ready["lastTransitionTime"] == rfc3339(1_000)
    later = podstatus.render(
        [_state("running", ready=True)],
        now=1_003,
        previous_conditions=first["conditions"],
        **common,
    )
    ready = {c["type"]: c for c in later["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", None)
    assert ready["lastTransitionTime"] == rfc3339(1_003)


def test_a_container_waiting_in_back_off_shows_the_exit_it_waits_after_as_its_last_state() -> None:
    """As the kubelet: during CrashLoopBackOff, ``lastState.terminated`` is the latest exit
    (what a controller counts a kill by), and the back-off is in the waiting message."""
    first = Terminated(137, "Error", 1.0, 2.0, signal=9)
    latest = Terminated(137, "Error", 3.0, 4.0, signal=9)
    state = ContainerState(
        "engine", "img", phase="waiting", waiting_reason="CrashLoopBackOff",
        waiting_message="back-off 10s restarting failed container=engine pod=p_ns(u)",
        terminated=latest, last_terminated=first, restart_count=1,
    )  # fmt: skip
    status = podstatus.container_status(state, "emulated")
    assert status["lastState"]["terminated"]["finishedAt"] == rfc3339(4.0)
    assert status["state"]["waiting"]["message"].startswith("back-off 10s")
    running = ContainerState(
        "engine", "img", phase="running", started_at=5.0, last_terminated=latest, restart_count=2
    )
    assert podstatus.container_status(running, "emulated")["lastState"]["terminated"][
        "finishedAt"
    ] == rfc3339(4.0)


def test_the_projected_service_account_token_of_a_current_api_server() -> None:
    """Kubernetes >= 1.22 projects the token (kube-api-access-*), the CA ConfigMap and the
    namespace into one volume; the emulator requests the token as a kubelet does."""
    pod: dict[str, Any] = {
        "spec": {
            "serviceAccountName": "engine",
            "containers": [
                {
                    "name": "c",
                    "volumeMounts": [
                        {
                            "name": "kube-api-access-abcde",
                            "mountPath": podspec.SERVICE_ACCOUNT_MOUNT,
                        }
                    ],
                }
            ],
            "volumes": [
                {"name": "data", "projected": {"sources": [{"configMap": {"name": "x"}}]}},
                {
                    "name": "kube-api-access-abcde",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {"configMap": {"name": "kube-root-ca.crt", "items": []}},
                            {"downwardAPI": {"items": []}},
                        ]
                    },
                },
            ],
        }
    }
    projected = podspec.service_account_projection(pod)
    assert projected == podspec.ProjectedToken(
        volume="kube-api-access-abcde",
        service_account="engine",
        expiration_seconds=3607,
        audience=None,
        ca_config_map="kube-root-ca.crt",
    )
    assert podspec.service_account_secret(pod) is None  # not a Secret
    pod["spec"]["containers"][0]["volumeMounts"].pop()  # automountServiceAccountToken: false
    assert podspec.service_account_projection(pod) is None
