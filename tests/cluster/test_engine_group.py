"""A prefill and a decode engine-stub pod in one P/D group on the local cluster: they report
their RoCE IPs to ZooKeeper, link (device k <-> device k), load, report health and serve a
streamed request end to end; a die fault injected on the node reaches health within 1 s.

The operator's side of the protocol (init order, RoCE map, decode meta) is played by the test
here; the PDGroup operator takes it over."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient
from kubernetes import client

from enginestub import timing
from enginestub.models import LLAMA3_8B
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo

NPU = "huawei.com/Ascend910"
SCALE = 1.0  # timings are compared with the model, so keep wall-clock jitter small


def wait_for(predicate: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


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


def test_prefill_and_decode_register_link_load_and_serve_a_streamed_request(
    api_client: client.ApiClient,
    cluster: ClusterInfo,
    namespace: str,
    zk: KazooClient,
    start_emulator: Callable[..., Any],
) -> None:
    emulator = start_emulator(servers=2)
    core = client.CoreV1Api(api_client)
    zk_hosts = f"{cluster.zookeeper}{zk.chroot}"
    group = f"{namespace}/g1"
    paths = zl.GroupPaths(namespace, "g1")
    core.create_namespaced_pod(
        namespace, engine_pod("g1-p-0", emulator.nodes[0], "prefill", group, zk_hosts)
    )
    core.create_namespaced_pod(
        namespace, engine_pod("g1-d-0", emulator.nodes[1], "decode", group, zk_hosts)
    )

    # 1. Gathering: both report their RoCE IPs, ordered by device id.
    def reports() -> Any:
        if not zk.exists(paths.reports):
            return None
        children = zk.get_children(paths.reports)
        return children if len(children) == 2 else None

    wait_for(reports, what="two reports in ZooKeeper")
    gathered = {
        name: zl.Report.parse(zk.get(paths.report(name))[0]) for name in ("g1-p-0", "g1-d-0")
    }
    for name, report in gathered.items():
        pod = core.read_namespaced_pod(name, namespace)
        assert report.pod_ip == pod.status.pod_ip
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
    wait_for(
        lambda: len(zk.get_children(paths.health)) == 2,
        timeout=60,
        what="health from both instances",
    )
    health = zl.Health.parse(zk.get(paths.health_of("g1-d-0"))[0])
    assert health.state is zl.HealthState.SERVING
    prefill_pod = wait_for(
        lambda: (p := core.read_namespaced_pod("g1-p-0", namespace)) and _ready(p) and p,
        what="prefill pod Ready",
    )
    prefill_url = f"http://{prefill_pod.status.pod_ip}:8000"
    info = httpx.get(f"{prefill_url}/v1/info", trust_env=False).json()
    shape = timing.InstanceShape(dies=4, tp=4)
    assert info["loadSeconds"] == pytest.approx(
        timing.load_seconds(LLAMA3_8B, shape, timing.LoadSource.HOST_DRAM), rel=0.05
    )

    # 6. Decode meta to the prefill; then a streamed request end to end.
    decode_entry = roce_map.decode[0]
    zk.create(paths.decode_meta, zl.DecodeMeta(version=1, decodes=[decode_entry]).dump())
    wait_for(
        lambda: httpx.get(f"{prefill_url}/v1/info", trust_env=False).status_code == 200,
        what="prefill up",
    )
    deadline = time.monotonic() + 10
    while True:
        with httpx.stream(
            "POST",
            f"{prefill_url}/v1/generate",
            json={"requestId": "e2e", "promptTokens": 8192, "maxTokens": 12},
            timeout=60,
            trust_env=False,
        ) as response:
            assert response.status_code == 200
            events = [
                json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
            ]
        if events[-1].get("code") != "no_decode" or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # the prefill has not seen the decode meta yet
    tokens = [e for e in events if e["type"] == "token"]
    done = events[-1]
    assert done["type"] == "done", events[-3:]
    assert [t["index"] for t in tokens] == list(range(12))
    assert done["instances"] == {"prefill": "g1-p-0", "decode": "g1-d-0"}
    expected_ttft = timing.prefill_seconds(LLAMA3_8B, shape, 8192)
    expected_tpot = timing.tpot(LLAMA3_8B, shape, 1 / shape.npus, 8192 + 6)
    assert done["timings"]["ttft"] == pytest.approx(expected_ttft, rel=0.1)
    assert done["timings"]["tpotMean"] == pytest.approx(expected_tpot, rel=0.1)
    assert done["timings"]["kvTransfer"] > 0
    decode_pod = core.read_namespaced_pod("g1-d-0", namespace)
    decode_metrics = _samples(
        httpx.get(f"http://{decode_pod.status.pod_ip}:8000/metrics", trust_env=False).text
    )
    assert decode_metrics[
        ("matrixserve_engine_kv_bytes_total", (("direction", "in"), ("plane", "RoCE")))
    ] == (timing.kv_bytes(LLAMA3_8B, 8192))
    assert decode_metrics[("matrixserve_engine_tpot_seconds_count", ())] == 11

    # A die fault on the decode's node reaches its health within 1 s (its znode is dropped).
    die = zl.Report.parse(zk.get(paths.report("g1-d-0"))[0]).dies[0]
    injected = time.monotonic()
    emulator.fault(kind="die-down", node=decode_pod.spec.node_name, die=die)
    wait_for(
        lambda: not zk.exists(paths.health_of("g1-d-0")),
        timeout=1.0,
        what="the decode's health to drop",
    )
    dropped_in = time.monotonic() - injected
    print(f"\ndie fault -> health znode dropped in {dropped_in * 1000:.0f} ms")
    assert zk.exists(paths.health_of("g1-p-0")), "the prefill's health must not change"
    readyz = httpx.get(f"http://{decode_pod.status.pod_ip}:8000/readyz", trust_env=False)
    assert readyz.status_code == 503
    assert readyz.json()["unhealthyDies"] == {str(die): "DIE_DOWN"}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
