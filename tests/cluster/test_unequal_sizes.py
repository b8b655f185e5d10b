"""Prefill and decode of different sizes on the local cluster (CloudMatrix-Infer §4.3.3): the
operator, real ZooKeeper and engine stubs on emulated servers link a 2-NPU prefill (4 dies, tp 4)
with a 4-NPU decode (8 dies, tp 2, dp 4) by the deterministic group connection mapping
(``matrixserve.api.kvmapping``), the group reaches Ready with the mapping's count of sub-links,
and a request is served across the two sizes. (A shape the mapping cannot pair is refused by the
API server, naming the field: ``test_operator`` and the CEL rules of ``test_crd_contract``.)"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from kubernetes import client
from test_engine_group import stream

from enginestub import timing
from enginestub.fabric import Plane, link_bandwidth
from matrixserve.api import kvmapping
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import LLAMA3_8B
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.helpers import Groups, pdgroup_body, zookeeper

PREFILL = kvmapping.Side(4, 4)  # 2 NPUs; tp not given: the engine's, all its dies
DECODE = kvmapping.Side(8, 2)  # 4 NPUs, parallelism.tp 2: dp 4


def test_a_2_npu_prefill_and_a_4_npu_decode_link_by_the_mapping_and_serve(
    api_client: client.ApiClient,
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    start_emulator: Callable[..., Any],
    start_operator: Callable[..., Any],
) -> None:
    start_emulator(servers=2)  # room for 2 + 2 + 4 NPUs whatever else the session runs
    start_operator(namespace)
    body = pdgroup_body("g", prefill=2, decode=1)
    body["spec"]["decode"]["devicesPerInstance"] = 4
    body["spec"]["decode"]["parallelism"] = {"tp": 2}
    groups.create(body)  # admitted by the API server's rules and the webhook
    groups.wait_ready("g")

    # One sub-link per decode die for each of the 2 P-D pairs: 2 x 8, all verified.
    per_pair = kvmapping.sub_links_per_pair(PREFILL, DECODE)
    assert per_pair == 8
    status = groups.get("g")["status"]
    assert status["links"] == {"expected": 2 * per_pair, "verified": 16, "summary": "16/16"}
    sources = kvmapping.source_dies(PREFILL, DECODE)
    assert sources == [0, 1, 0, 1, 2, 3, 2, 3]  # ratio 2, group_size 2
    with zookeeper(cluster.zookeeper) as zk:
        paths = zl.GroupPaths(namespace, "g")
        roce_map = zl.RoceMap.parse(zk.get(paths.roce_map)[0])
        assert [(e.tp, len(e.roce_ips)) for e in roce_map.prefill] == [(4, 4), (4, 4)]
        assert [(e.tp, len(e.roce_ips)) for e in roce_map.decode] == [(2, 8)]
        assert roce_map.expected_links() == 16
        (decode,) = roce_map.decode
        for prefill in roce_map.prefill:
            link = zl.Link.parse(zk.get(paths.link(prefill.instance, decode.instance))[0])
            assert [(s.device, s.prefill_device) for s in link.sub_links] == list(
                enumerate(sources)
            )
            assert [(s.prefill_ip, s.decode_ip) for s in link.sub_links] == [
                (prefill.roce_ips[i], decode.roce_ips[j]) for j, i in enumerate(sources)
            ]
            # every prefill die serves decode dp x decode tp / prefill tp = 2 decode dies
            assert Counter(s.prefill_device for s in link.sub_links) == {0: 2, 1: 2, 2: 2, 3: 2}

    # A request served across the two sizes, its KV pulled over the decode DP group's 2 links.
    core = client.CoreV1Api(api_client)
    pod_ip = core.read_namespaced_pod("g-p-0", namespace).status.pod_ip
    events = stream(
        f"http://{pod_ip}:8000/v1/generate",
        {"requestId": "uneq", "promptTokens": 8192, "maxTokens": 20},
    )
    done = events[-1]
    assert done["type"] == "done", events[-3:]
    assert [e["index"] for e in events if e["type"] == "token"] == list(range(20))
    assert done["instances"] == {"prefill": "g-p-0", "decode": "g-d-0"}
    nodes = {n: core.read_namespaced_pod(n, namespace).spec.node_name for n in ("g-p-0", "g-d-0")}
    decode_ip = core.read_namespaced_pod("g-d-0", namespace).status.pod_ip
    metrics = httpx.get(f"http://{decode_ip}:8000/metrics", trust_env=False).text
    (plane,) = set(
        re.findall(r'matrixserve_engine_kv_bytes_total\{direction="in",plane="(\w+)"', metrics)
    )
    per_die = link_bandwidth(Plane(plane), same_node=nodes["g-p-0"] == nodes["g-d-0"])
    two_links = timing.kv_bytes(LLAMA3_8B, 8192) / (
        timing.kv_pull_links(DECODE.tp, PREFILL.dies, 1) * per_die
    )
    print(
        f"sub-links {status['links']['summary']} ({per_pair} per pair); KV transfer "
        f"{done['timings']['kvTransfer'] * 1e3:.1f} ms, its 2 links' model {two_links * 1e3:.1f} ms"
    )
    # never faster than its DP group's 2 links (the whole 8-die decode would be 4x faster)
    assert done["timings"]["kvTransfer"] >= 0.98 * two_links, (done["timings"], two_links)
