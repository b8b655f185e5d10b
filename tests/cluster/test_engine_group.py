"""A prefill and a decode engine-stub pod in one P/D group on the local cluster: they report
their RoCE IPs to ZooKeeper, link (device k <-> device k), load, report health and serve a
streamed request end to end; a die fault injected on the node reaches health within 1 s.

The operator's side of the protocol (init order, RoCE map, decode meta) is played by the test
here; the PDGroup operator takes it over."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient
from kubernetes import client

from enginestub import timing
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import LLAMA3_8B
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.helpers import assert_emulated, wait_for

NPU = "huawei.com/Ascend910"
SCALE = 1.0  # timings are compared with the model, so keep wall-clock jitter small


def wait_reports(zk: KazooClient, paths: zl.GroupPaths, names: list[str]) -> dict[str, zl.Report]:
    def present() -> bool:
        return bool(zk.exists(paths.reports)) and set(names) <= set(zk.get_children(paths.reports))

    wait_for(present, what=f"reports from {names}")
    return {name: zl.Report.parse(zk.get(paths.report(name))[0]) for name in names}


def wait_healthy(zk: KazooClient, paths: zl.GroupPaths, names: list[str]) -> None:
    wait_for(
        lambda: set(names) <= set(zk.get_children(paths.health)),
        timeout=60,
        what=f"health from {names}",
    )


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request; retried briefly while the prefill has not seen the decode meta."""
    deadline = time.monotonic() + 10
    while True:
        with httpx.stream("POST", url, json=body, timeout=60, trust_env=False) as response:
            assert response.status_code == 200, response.read()
            events = [
                json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
            ]
        if events[-1].get("code") != "no_decode" or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


def engine_pod(name: str, node: str, role: str, group: str, zk_hosts: str) -> dict[str, Any]:
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "ENGINE_ROLE", "value": role},
        {"name": "ENGINE_MODEL", "value": "llama3-8b"},
        {"name": "ENGINE_LOAD_SOURCE", "value": "HostDRAM"},
        {"name": "MATRIXSERVE_TIME_SCALE", "value": str(SCALE)},
        {"name": "MATRIXSERVE_GROUP", "value": group},
        {"name": "MATRIXSERVE_ZK", "value": zk_hosts},
    ]
    return {
        "metadata": {"name": name, "labels": {"app": "pd", "role": role}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {
                    "name": "engine",
                    "image": "matrixserve/engine-stub:dev",
                    "env": env,
                    "readinessProbe": {
                        "httpGet": {"path": "/readyz", "port": 8000},
                        "periodSeconds": 1,
                    },
                    "resources": {"limits": {NPU: "2"}},
                }
            ],
        },
    }


@dataclass
class EngineGroup:
    """Engine-stub pods of one P/D group on a private node emulator, speaking to ZooKeeper at
    ``zk_hosts`` (the test's chroot)."""

    core: client.CoreV1Api
    namespace: str
    name: str
    zk_hosts: str
    emulator: Any

    @property
    def paths(self) -> zl.GroupPaths:
        return zl.GroupPaths(self.namespace, self.name)

    def add(self, pod: str, server: int, role: str) -> None:
        """Create engine pod ``pod`` on the emulator's ``server``-th node."""
        node = self.emulator.nodes[server]
        group = f"{self.namespace}/{self.name}"
        self.core.create_namespaced_pod(
            self.namespace, engine_pod(pod, node, role, group, self.zk_hosts)
        )


@pytest.fixture
def engine_group(
    api_client: client.ApiClient,
    cluster: ClusterInfo,
    namespace: str,
    zk: KazooClient,
    start_emulator: Callable[..., Any],
) -> Callable[[str], EngineGroup]:
    """``engine_group(name)``: two emulated servers, group ``name``'s prefill ``<name>-p-0`` on
    the first and its decode ``<name>-d-0`` on the second (created, not waited for)."""

    def start(name: str) -> EngineGroup:
        zk_hosts = f"{cluster.zookeeper}{zk.chroot}"
        emulator = start_emulator(servers=2)
        group = EngineGroup(client.CoreV1Api(api_client), namespace, name, zk_hosts, emulator)
        group.add(f"{name}-p-0", server=0, role="prefill")
        group.add(f"{name}-d-0", server=1, role="decode")
        return group

    return start


def test_prefill_and_decode_register_link_load_and_serve_a_streamed_request(
    namespace: str, zk: KazooClient, engine_group: Callable[[str], EngineGroup]
) -> None:
    group = engine_group("g1")
    core, emulator, paths = group.core, group.emulator, group.paths

    # 1. Gathering: both report their RoCE IPs, ordered by device id.
    gathered = wait_reports(zk, paths, ["g1-p-0", "g1-d-0"])
    assert len(zk.get_children(paths.reports)) == 2
    for name, report in gathered.items():
        # The engine may report before the node's status update carrying the pod IP lands
        # (a kubelet's status sync lags container start the same way).
        pod_ip = wait_for(
            lambda name=name: core.read_namespaced_pod(name, namespace).status.pod_ip,
            timeout=10,
            what=f"{name}'s pod IP in its status",
        )
        assert report.pod_ip == pod_ip
        assert report.dies == sorted(report.dies)
        assert len(report.roce_ips) == 4  # 2 NPUs x 2 dies
        assert report.role == (zl.Role.PREFILL if name == "g1-p-0" else zl.Role.DECODE)
    with emulator.http() as http:
        node_file = http.get(f"/nodes/{gathered['g1-p-0'].node}/device-status").json()
    ip_by_die = {d["id"]: d["roceIp"] for n in node_file["npus"] for d in n["dies"]}
    assert gathered["g1-p-0"].roce_ips == [ip_by_die[d] for d in gathered["g1-p-0"].dies]
    assert not zk.exists(paths.health_of("g1-p-0")), "no health before the init order"

    # 2. The operator's part: RoCE map and init order once reports == expected instances.
    roce_map = zl.build_roce_map(gathered.values(), {}, version=1)
    zk.create(paths.roce_map, roce_map.dump())
    zk.create(paths.init_order, zl.InitOrder(epoch=1, roceMapVersion=1).dump())

    # 3. Links: exactly n_p * n_d * K verified sub-links, device k <-> device k.
    wait_for(lambda: zk.get_children(paths.links), what="the P-D link")
    link = zl.Link.parse(zk.get(paths.link("g1-p-0", "g1-d-0"))[0])
    assert len(zk.get_children(paths.links)) == 1
    assert len(link.sub_links) == roce_map.expected_links() == 1 * 1 * 4
    for k, sub in enumerate(link.sub_links):
        assert (sub.device, sub.prefill_ip, sub.decode_ip) == (
            k,
            gathered["g1-p-0"].roce_ips[k],
            gathered["g1-d-0"].roce_ips[k],
        )

    # 4-5. Load, then health from both.
    wait_healthy(zk, paths, ["g1-p-0", "g1-d-0"])
    health = zl.Health.parse(zk.get(paths.health_of("g1-d-0"))[0])
    assert health.state is zl.HealthState.SERVING
    prefill_ip = core.read_namespaced_pod("g1-p-0", namespace).status.pod_ip
    prefill_url = f"http://{prefill_ip}:8000"
    info = httpx.get(f"{prefill_url}/v1/info", trust_env=False).json()
    shape = timing.InstanceShape(dies=4, tp=4)
    expected_load = timing.load_seconds(LLAMA3_8B, shape, timing.LoadSource.HOST_DRAM)
    assert_emulated(info["loadSeconds"], expected_load, SCALE, late=0.2)

    # 6. Decode meta to the prefill; then a streamed request end to end.
    zk.create(paths.decode_meta, zl.DecodeMeta(version=1, decodes=roce_map.decode).dump())
    events = stream(
        f"{prefill_url}/v1/generate", {"requestId": "e2e", "promptTokens": 8192, "maxTokens": 60}
    )
    tokens = [e for e in events if e["type"] == "token"]
    done = events[-1]
    assert done["type"] == "done", events[-3:]
    assert [t["index"] for t in tokens] == list(range(60))
    assert done["instances"] == {"prefill": "g1-p-0", "decode": "g1-d-0"}
    expected_ttft = timing.prefill_seconds(LLAMA3_8B, shape, 8192)
    expected_tpot = timing.tpot(LLAMA3_8B, shape, 1 / shape.npus, 8192 + 30)
    assert_emulated(done["timings"]["ttft"], expected_ttft, SCALE)
    assert_emulated(done["timings"]["tpotMean"], expected_tpot, SCALE, steps=59)
    assert done["timings"]["kvTransfer"] > 0
    decode_pod = core.read_namespaced_pod("g1-d-0", namespace)
    decode_metrics = _samples(
        httpx.get(f"http://{decode_pod.status.pod_ip}:8000/metrics", trust_env=False).text
    )
    assert decode_metrics[
        ("matrixserve_engine_kv_bytes_total", (("direction", "in"), ("plane", "RoCE")))
    ] == (timing.kv_bytes(LLAMA3_8B, 8192))
    assert decode_metrics[("matrixserve_engine_tpot_seconds_count", ())] == 59
    prefill_metrics = _samples(httpx.get(f"{prefill_url}/metrics", trust_env=False).text)
    assert prefill_metrics[("matrixserve_engine_ttft_seconds_sum", ())] == pytest.approx(
        done["timings"]["ttft"], rel=1e-6
    )

    # A die fault on the decode's node reaches its health promptly (issue 17: Faulty with the
    # typed fault, never a silence; typically ~0.2 s, printed; the wait allows 3 s on a loaded
    # machine).
    die = gathered["g1-d-0"].dies[0]
    injected = time.monotonic()
    emulator.fault(kind="die-down", node=decode_pod.spec.node_name, die=die)

    def faulty() -> zl.Health | None:
        raw = zk.get(paths.health_of("g1-d-0"))[0]
        health = zl.Health.parse(raw)
        return health if health.state is zl.HealthState.FAULTY else None

    health = wait_for(faulty, timeout=3.0, what="the decode's health Faulty")
    print(f"\ndie fault -> health Faulty in {(time.monotonic() - injected) * 1000:.0f} ms")
    assert [(f.kind, f.dies) for f in health.faults] == [(zl.EngineFaultKind.DIE, [die])]
    prefill_health = zl.Health.parse(zk.get(paths.health_of("g1-p-0"))[0])
    assert prefill_health.state is zl.HealthState.SERVING, "the prefill's health must not change"
    readyz = httpx.get(f"http://{decode_pod.status.pod_ip}:8000/readyz", trust_env=False)
    assert readyz.status_code == 503
    assert readyz.json()["unhealthyDies"] == {str(die): "DIE_DOWN"}


def test_a_role_less_container_joins_a_serving_group_without_disturbing_it(
    namespace: str, zk: KazooClient, engine_group: Callable[[str], EngineGroup]
) -> None:
    """Dynamic RoCE construction (P/D-Serve §3.3, Fig. 7): the newcomer gets the map, links to
    the existing prefill, loads, reports health; only then is it pushed in the decode meta."""
    group = engine_group("g2")
    core, emulator, paths = group.core, group.emulator, group.paths
    first = wait_reports(zk, paths, ["g2-p-0", "g2-d-0"])
    v1 = zl.build_roce_map(first.values(), {}, version=1)
    zk.create(paths.roce_map, v1.dump())
    zk.create(paths.init_order, zl.InitOrder(epoch=1, roceMapVersion=1).dump())
    wait_healthy(zk, paths, ["g2-p-0", "g2-d-0"])
    zk.create(paths.decode_meta, zl.DecodeMeta(version=1, decodes=v1.decode).dump())
    before = {p["name"]: p["pids"] for p in emulator.pods()}
    uids = {n: core.read_namespaced_pod(n, namespace).metadata.uid for n in ("g2-p-0", "g2-d-0")}
    first_link = zk.get(paths.link("g2-p-0", "g2-d-0"))[1].mzxid

    # A role-less container ("auto") reports without a role and waits for the map.
    group.add("g2-x-1", server=1, role="auto")
    newcomer = wait_reports(zk, paths, ["g2-x-1"])["g2-x-1"]
    assert newcomer.role is None
    time.sleep(1.0)
    assert not zk.exists(paths.link("g2-p-0", "g2-x-1")), (
        "no link before the map names the newcomer"
    )

    # The operator binds its role in the map (v2); it links, loads and reports health.
    v2 = zl.build_roce_map([*first.values(), newcomer], {"g2-x-1": zl.Role.DECODE}, version=2)
    zk.set(paths.roce_map, v2.dump())
    wait_healthy(zk, paths, ["g2-x-1"])
    link = zl.Link.parse(zk.get(paths.link("g2-p-0", "g2-x-1"))[0])
    assert link.initiator == "g2-x-1"
    assert len(link.sub_links) == 4
    assert len(zk.get_children(paths.links)) == v2.expected_links() // 4 == 2
    assert zk.get(paths.link("g2-p-0", "g2-d-0"))[1].mzxid == first_link, (
        "the existing link was not rebuilt"
    )

    # Then the decode meta reaches the prefill, and traffic can land on the newcomer.
    zk.set(paths.decode_meta, zl.DecodeMeta(version=2, decodes=v2.decode).dump())
    prefill_ip = core.read_namespaced_pod("g2-p-0", namespace).status.pod_ip
    served_by = set()
    for i in range(6):
        events = stream(
            f"http://{prefill_ip}:8000/v1/generate",
            {"requestId": f"j{i}", "promptTokens": 64, "maxTokens": 2},
        )
        assert events[-1]["type"] == "done", events[-1]
        served_by.add(events[-1]["instances"]["decode"])
    assert served_by == {"g2-d-0", "g2-x-1"}

    # Nobody restarted: same pod UIDs, same processes.
    after = {p["name"]: p["pids"] for p in emulator.pods()}
    for name in ("g2-p-0", "g2-d-0"):
        assert after[name] == before[name], f"{name} was restarted"
        assert core.read_namespaced_pod(name, namespace).metadata.uid == uids[name]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
