"""The gateway in front of a PDGroup on the local cluster: OpenAI streaming and not, discovery
from ZooKeeper, entrance removal, bad input (a decode or prefill killed mid-stream:
``test_migration.py``)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
from kubernetes import client

from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo, free_ports
from testkit.helpers import Groups, TcpProxy, metric, wait_for, zookeeper


def sse(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, list[Any]]:
    with httpx.stream(
        "POST", url, json=body, headers=headers, timeout=60, trust_env=False
    ) as response:
        if response.status_code != 200:
            return response.status_code, [json.loads(response.read())]
        out = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        return 200, out


def test_streamed_and_plain_completions_through_the_gateway(
    serving_group: Callable[..., Any], gateway: str
) -> None:
    serving_group()
    wait_for(
        lambda: httpx.get(f"{gateway}/v1/models", trust_env=False).json()["data"],
        what="the scenario",
    )
    models = httpx.get(f"{gateway}/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["general"]

    status, chunks = sse(
        f"{gateway}/v1/completions",
        {
            "model": "general",
            "prompt": "hi " * 200,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    assert chunks[-1] == "[DONE]"
    texts = [c["choices"][0]["text"] for c in chunks[:-3]]
    assert len(texts) == 8
    final = chunks[-3]
    assert final["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"] == []
    assert chunks[-2]["usage"]["completion_tokens"] == 8
    assert final["matrixserve"]["instances"]["decode"] == "g-d-0"
    assert final["matrixserve"]["timings"]["ttft"] > 0

    plain = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
        },
        headers={"X-MatrixServe-Scenario": "general"},
        timeout=60,
        trust_env=False,
    )
    assert plain.status_code == 200
    body = plain.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4

    unknown = httpx.post(
        f"{gateway}/v1/completions", json={"model": "nope", "prompt": "x"}, trust_env=False
    )
    assert unknown.status_code == 404
    assert (
        "no PDGroup serves scenario 'nope' (known: general)" in unknown.json()["error"]["message"]
    )
    bad = httpx.post(f"{gateway}/v1/completions", content=b"{not json", trust_env=False)
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_a_prefill_leaving_the_entrances_stops_getting_requests_within_a_second(
    cluster: ClusterInfo, namespace: str, serving_group: Callable[..., Any], gateway: str
) -> None:
    operator = serving_group()
    operator.stop()  # so nothing re-opens the entrance we close by hand
    with zookeeper(cluster.zookeeper) as zk:
        paths = zl.GroupPaths(namespace, "g")
        served = set()
        for i in range(6):
            _, chunks = sse(
                f"{gateway}/v1/completions",
                {"model": "general", "prompt": f"q{i}", "max_tokens": 2, "stream": True},
            )
            served.add(chunks[-2]["matrixserve"]["instances"]["prefill"])
        zk.delete(paths.entrance("g-p-0"))
        removed_at = time.monotonic()
        time.sleep(1.0)
        after = []
        while time.monotonic() - removed_at < 3:
            _, chunks = sse(
                f"{gateway}/v1/completions",
                {"model": "general", "prompt": "z", "max_tokens": 2, "stream": True},
            )
            after.append(chunks[-2]["matrixserve"]["instances"]["prefill"])
        assert set(after) == {"g-p-1"}, after


def test_an_abandoned_plain_request_stops_the_decode(
    groups: Groups, serving_group: Callable[..., Any], start_gateway: Callable[..., str]
) -> None:
    """Issue 16, finding 5: a client that leaves a request that is not streamed cancels it at the
    gateway, which closes its engine stream, so the decode stops generating for nobody (it ran
    to ``max_tokens`` before: a batch slot for seconds, minutes at real time scale). The engines
    run in real time here, so the request would decode for ~20 s."""
    # (TE-Pre-Load off: 20 wall s of start-up at this scale that the test does not look at)
    serving_group(prefill=1, decode=1, time_scale="1", extra=("--engine-pre-load-seconds", "0"))
    gateway = start_gateway("--time-scale", "1")
    ips = {
        name: groups.core.read_namespaced_pod(name, groups.namespace).status.pod_ip
        for name in ("g-p-0", "g-d-0")
    }

    def health(name: str) -> dict[str, Any]:
        info = httpx.get(f"http://{ips[name]}:8000/v1/info", timeout=5, trust_env=False).json()
        return dict(info["health"])

    def decoding() -> int:
        return int(health("g-d-0")["decodeBatch"]["running"])

    _, probe = sse(
        f"{gateway}/v1/completions",
        {"model": "general", "prompt": "probe", "max_tokens": 4, "stream": True},
    )
    tokens = 8000
    would_last = tokens * probe[-2]["matrixserve"]["timings"]["tpotMean"]  # wall s
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "general", "prompt": "abandoned", "max_tokens": tokens}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: decoding() == 1, timeout=10, every=0.02, what="the request decoding")
    left = time.monotonic()
    wait_for(
        lambda: decoding() == 0,
        timeout=3,
        every=0.02,
        what="the decode to stop",
        explain=lambda: f"decode {health('g-d-0')}\n{httpx.get(f'{gateway}/metrics').text}",
    )
    stopped = time.monotonic() - left
    assert stopped < 3 < would_last / 2, (stopped, would_last)
    assert health("g-p-0")["prefillSlots"]["used"] == 0
    for name in ("open_streams", "prompts_in_prefill", "prefill_slots_held"):
        assert metric(gateway, f"matrixserve_gateway_{name}") == 0, name
    scrape = httpx.get(f"{gateway}/metrics", trust_env=False).text
    assert 'requests_total{outcome="client_gone",scenario="general"} 1.0' in scrape


def test_a_hung_prefill_gets_a_503_once_the_budget_for_the_prompts_length_is_spent(
    groups: Groups, serving_group: Callable[..., Any], start_gateway: Callable[..., str]
) -> None:
    """P/D-Serve §2.2.2/§3.5: the TTFT threshold depends on the prompt's length; the gateway
    waits for a prefill's answer only within it (a hung prefill is not waited on for ever), then
    answers 503 with the reason. The gateway runs at time scale 20: budgets are emulated."""
    serving_group(prefill=1, decode=1)
    groups.patch("g", {"slo": {"ttftMilliseconds": 2000, "ttftMillisecondsPer1kTokens": 1000}})
    url = start_gateway()
    wait_for(
        lambda: (
            httpx.get(f"{url}/v1/routes", trust_env=False)
            .json()["groups"][0]
            .get("ttftMillisecondsPer1kTokens")
            == 1000
        ),
        timeout=10,
        what="the per-1k-token threshold in the routes",
    )
    pod = groups.core.read_namespaced_pod("g-p-0", groups.namespace)
    prefill = f"http://{pod.status.pod_ip}:8000"
    hang = {"kind": "hang"}
    assert httpx.post(f"{prefill}/v1/faults", json=hang, trust_env=False).status_code == 201
    try:
        answers = {}
        for chars in (100, 40_000):  # 25 and 10,000 tokens: budgets 2,025 and 12,000 ms
            began = time.monotonic()
            code, body = sse(
                f"{url}/v1/completions",
                {"model": "general", "prompt": "x" * chars, "max_tokens": 2, "stream": True},
            )
            answers[chars] = (code, body[0], time.monotonic() - began)
    finally:
        httpx.request("DELETE", f"{prefill}/v1/faults", json=hang, trust_env=False)
    for chars, budget_ms in ((100, 2025), (40_000, 12000)):
        code, body, took = answers[chars]
        assert code == 503, body
        assert body["error"]["code"] == "no_capacity"
        assert f"TTFT budget of {budget_ms} ms" in body["error"]["message"], body
        assert "1 not answered in time" in body["error"]["message"], body
        # waited the budget (emulated ms / 20 in wall time), not the engine's 60 s read timeout
        assert budget_ms / 20 / 1000 * 0.9 <= took < budget_ms / 20 / 1000 + 3, (chars, took)
    metrics = httpx.get(f"{url}/metrics", trust_env=False).text
    assert 'matrixserve_gateway_forward_attempts_total{answer="timeout"}' in metrics
    code, chunks = sse(
        f"{url}/v1/completions",
        {"model": "general", "prompt": "healed", "max_tokens": 2, "stream": True},
    )
    assert code == 200, chunks
    assert "choices" in chunks[-2], chunks


def test_api_keys_are_required_when_configured_and_rate_limited_per_key(
    api_client: client.ApiClient,
    namespace: str,
    serving_group: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> None:
    key, key_b = "sk-matrixserve-0123456789", "sk-matrixserve-bbbbbbbbbb"
    client.CoreV1Api(api_client).create_namespaced_secret(
        namespace,
        {"metadata": {"name": "gateway-keys"}, "stringData": {"team-a": key, "team-b": key_b}},
    )
    serving_group()
    url = start_gateway(
        "--api-keys-secret", f"{namespace}/gateway-keys", "--rate-limit", "0.1", "--rate-burst", "2"
    )
    body = {"model": "general", "prompt": "hello", "max_tokens": 2}

    def post(headers: dict[str, str]) -> httpx.Response:
        return httpx.post(
            f"{url}/v1/completions", json=body, headers=headers, timeout=30, trust_env=False
        )

    wait_for(
        lambda: post({"Authorization": f"Bearer {key}"}).status_code == 200,
        timeout=20,
        what="the keys loaded",
    )
    missing = post({})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert post({"Authorization": "Bearer sk-wrong-key-000000000"}).status_code == 401
    # team-b's bucket starts at its burst (2); at 0.1 requests/s it refills a token in 10 s
    answers = [post({"Authorization": f"Bearer {key_b}"}) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    limited = answers[2]
    assert limited.json()["error"]["code"] == "rate_limited"
    assert "team-b" in limited.json()["error"]["message"]
    assert float(limited.headers["Retry-After"]) > 0
    models = httpx.get(f"{url}/v1/models", trust_env=False)
    assert models.status_code == 401


def test_a_missing_key_secret_fails_closed(
    namespace: str, serving_group: Callable[..., Any], start_gateway: Callable[..., str]
) -> None:
    serving_group()
    url = start_gateway("--api-keys-secret", f"{namespace}/does-not-exist")
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": "general", "prompt": "x"},
        headers={"Authorization": "Bearer sk-anything-at-all-123"},
        trust_env=False,
    )
    assert response.status_code == 401


def _zookeeper_connected(url: str) -> float:
    return float(metric(url, "matrixserve_gateway_zookeeper_connected"))


def _sessions_lost(url: str) -> float:
    return float(metric(url, "matrixserve_gateway_zookeeper_sessions_lost_total"))


def _routes(url: str) -> tuple[str, list[str]]:
    body = httpx.get(f"{url}/v1/routes", trust_env=False).json()
    (group,) = body["groups"]
    return body["source"], sorted(e["instance"] for e in group["entrances"])


def _served(url: str, n: int) -> set[str]:
    served = set()
    for i in range(n):
        code, chunks = sse(
            f"{url}/v1/completions",
            {"model": "general", "prompt": f"q{i}", "max_tokens": 2, "stream": True},
        )
        assert code == 200, chunks
        served.add(chunks[-2]["matrixserve"]["instances"]["prefill"])
    return served


def test_without_zookeeper_the_gateway_routes_by_pdgroup_status(
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    serving_group: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> None:
    operator = serving_group()
    host, port = cluster.zookeeper.rsplit(":", 1)
    proxy = TcpProxy((host, int(port)))
    try:
        url = start_gateway("--zookeeper", proxy.address)
        wait_for(lambda: _zookeeper_connected(url) == 1, timeout=10, what="ZooKeeper connected")
        assert _routes(url) == ("zookeeper", ["g-p-0", "g-p-1"])
        proxy.cut()  # the gateway loses ZooKeeper; the operator and engines keep theirs
        cut_at = time.monotonic()
        wait_for(lambda: _zookeeper_connected(url) == 0, timeout=10, what="ZooKeeper lost")
        assert _routes(url) == ("status", ["g-p-0", "g-p-1"])
        assert _served(url, 3) <= {"g-p-0", "g-p-1"}
        # A third prefill opens while the gateway has no ZooKeeper: the status brings it.
        groups.patch("g", {"prefill": {"replicas": 3}})
        wait_for(
            lambda: _routes(url) == ("status", ["g-p-0", "g-p-1", "g-p-2"]),
            timeout=30,
            what="the new prefill routed from the PDGroup status",
        )
        # A gateway that never reached ZooKeeper serves from the status alone.
        never = start_gateway("--zookeeper", f"127.0.0.1:{free_ports(1)[0]}")
        assert _zookeeper_connected(never) == 0
        assert _routes(never) == ("status", ["g-p-0", "g-p-1", "g-p-2"])
        assert _served(never, 3) <= {"g-p-0", "g-p-1", "g-p-2"}
        # Outlast kazoo's 10 s session timeout (ZooKeeper expires sessions on its 2 s tick): the
        # session (and its watches) are lost, which the gateway learns on reconnecting.
        assert _sessions_lost(url) == 0
        time.sleep(max(0.0, 14 - (time.monotonic() - cut_at)))
        proxy.restore()
        wait_for(lambda: _zookeeper_connected(url) == 1, timeout=20, what="ZooKeeper back")
        assert _sessions_lost(url) == 1, "the cut must have cost the session (else untested)"
        wait_for(
            lambda: _routes(url) == ("zookeeper", ["g-p-0", "g-p-1", "g-p-2"]),
            timeout=10,
            what="entrances from ZooKeeper again",
        )
        assert _served(url, 3) <= {"g-p-0", "g-p-1", "g-p-2"}
        # ZooKeeper, not the status, is the source again: with the operator stopped (the status
        # no longer changes), an entrance removed in ZooKeeper leaves the routes (the status still lists it).
        operator.stop()
        with zookeeper(cluster.zookeeper) as zk:
            zk.delete(zl.GroupPaths(namespace, "g").entrance("g-p-2"))
        wait_for(
            lambda: _routes(url) == ("zookeeper", ["g-p-0", "g-p-1"]),
            timeout=5,
            what="the removal seen through ZooKeeper",
        )
        # Lose the session again with the entrances unchanged across the loss (the status still
        # lists g-p-2): the gateway must read ZooKeeper again, not stay on the status.
        proxy.cut()
        time.sleep(14)
        proxy.restore()
        wait_for(lambda: _zookeeper_connected(url) == 1, timeout=20, what="ZooKeeper back again")
        assert _sessions_lost(url) == 2, "the second cut must have cost the session too"
        wait_for(
            lambda: _routes(url) == ("zookeeper", ["g-p-0", "g-p-1"]),
            timeout=3,
            what="entrances re-read from ZooKeeper after the lost session",
        )
    finally:
        proxy.close()
