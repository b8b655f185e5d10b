"""Instances that span servers, on the real control plane and a 48-server emulated SuperPod:
CloudMatrix-Infer's DeepSeek shapes (001 §4.1, §5.1), as the sample
``crds/samples/pdgroup-deepseek-ep32.yaml`` has them (EP32 prefills of 16 NPUs on 2 servers, a
decode of 64 NPUs on 8).

One group, set up once (a few dozen engine processes), then: it reaches Ready with the
connection mapping's sub-link count and serves through the gateway; its instances' pods are
each on their own server, an instance's all in one SuperPod, told their KV plane; killing one
worker's engine takes its instance out of the entrances and back, and restarts nobody else; a
second group whose decode no SuperPod can hold now creates none of that decode's pods, holds no
NPU for it, and says why with the free NPUs per SuperPod.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from kubernetes import client

from enginestub import timing
from matrixserve.api import kinds
from matrixserve.api.catalog import DEEPSEEK_V3
from testkit.chaoskit import pod_runs, restarted
from testkit.helpers import CRDS, Groups, load, only_these_nodes, wait_for

# Low enough that the engines' emulated times are precise to a few percent (a wall millisecond of
# a busy machine's lateness is TIME_SCALE emulated ones); the weights come from the servers' SSD
# (001 §4.4.1: 400 Gbps per server) so that setting up stays short at it.
TIME_SCALE = "2"
SERVERS = 48  # one 384-NPU SuperPod (001 §3.3.3)
SAMPLE = CRDS / "samples" / "pdgroup-deepseek-ep32.yaml"
OUTPUT_TOKENS = 64


@pytest.fixture
def superpod(
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    start_emulator: Callable[..., Any],
    start_operator: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> Iterator[tuple[Any, str]]:
    """A private 48-server SuperPod (the session's own emulated nodes cordoned meanwhile), the
    operator and the gateway for the namespace: (the emulator, the gateway's URL)."""
    emulator = start_emulator(servers=SERVERS)
    with only_these_nodes(client.CoreV1Api(api_client), emulator.nodes):
        try:
            start_operator(
                namespace,
                webhook=True,
                time_scale=TIME_SCALE,
                extra=("--engine-load-source", "SSD"),
            )
            gateway = start_gateway("--time-scale", TIME_SCALE)
            yield emulator, gateway
        finally:
            for group in ("ds", "ds-big"):
                with contextlib.suppress(client.ApiException):
                    groups.delete(group)


def _completion(
    gateway: str, scenario: str, prompt: str, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A streamed completion through the gateway: the engines' account of it (emulated
    timings, the instances) and its usage; fails the test on an error."""
    body = {
        "model": scenario,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    account: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    with (
        httpx.Client(timeout=120, trust_env=False) as http,
        http.stream("POST", f"{gateway}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            account = chunk.get("matrixserve") or account
            usage = chunk.get("usage") or usage
    assert account.get("timings"), account
    return account, usage


def _status(groups: Groups, name: str) -> dict[str, Any]:
    return dict(groups.get(name).get("status") or {})


def _rows(groups: Groups, name: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in _status(groups, name).get("instances") or []}


def test_deepseek_shapes_serve_and_a_worker_kill_restarts_only_that_pod(
    superpod: tuple[Any, str], groups: Groups, namespace: str
) -> None:
    emulator, gateway = superpod
    body = load(SAMPLE)
    body["metadata"] = {"name": "ds"}
    spec = body["spec"]
    groups.create(body)
    wait_for(lambda: groups.ready("ds"), 240, "the DeepSeek group Ready", explain=groups.explain)

    # --- the mapping's sub-links, every one verified
    status = _status(groups, "ds")
    n_p, n_d = spec["prefill"]["replicas"], spec["decode"]["replicas"]
    decode_dies = 2 * spec["decode"]["devicesPerInstance"]
    assert status["links"]["expected"] == n_p * n_d * decode_dies
    assert status["links"]["verified"] == status["links"]["expected"]

    # --- each instance's pods: one per server, all in one SuperPod, in rank order
    rows = _rows(groups, "ds")
    assert len(rows) == n_p + n_d
    runs = pod_runs(emulator.pods(), namespace, live=True)
    for name, row in rows.items():
        pods_per = spec[row["role"]]["podsPerInstance"]
        assert row["pods"] == [name] + [f"{name}-{k}" for k in range(1, pods_per)]
        assert len(set(row["servers"])) == pods_per, row
        assert [runs[p].node for p in row["pods"]] == row["servers"]
        assert {len(runs[p].npus) for p in row["pods"]} == {
            spec[row["role"]]["devicesPerInstance"] // pods_per
        }
        assert row["kvPlane"] == "UB"  # every instance in the decodes' SuperPod
        assert len(row["roceIps"]) == 2 * spec[row["role"]]["devicesPerInstance"]

    # --- it serves, timed as the whole shape in one process would be (the least of a few: a
    # busy machine's lateness only ever adds)
    served = [
        _completion(gateway, spec["scenario"], "hello " * 4500, OUTPUT_TOKENS) for _ in range(5)
    ]
    prompt = int(served[0][1]["prompt_tokens"])
    timings = {
        key: min(account["timings"][key] for account, _ in served)
        for key in ("ttft", "prefill", "tpotMean")
    }
    prefill_shape = timing.InstanceShape(
        dies=2 * spec["prefill"]["devicesPerInstance"],
        tp=spec["prefill"]["parallelism"].get("tp") or 2 * spec["prefill"]["devicesPerInstance"],
        ep=spec["prefill"]["parallelism"]["ep"],
    )
    decode_shape = timing.InstanceShape(
        dies=decode_dies,
        tp=spec["decode"]["parallelism"]["tp"],
        ep=spec["decode"]["parallelism"]["ep"],
    )
    predicted_prefill = timing.prefill_seconds(DEEPSEEK_V3, prefill_shape, prompt)
    predicted_tpot = timing.tpot(
        DEEPSEEK_V3, decode_shape, 1 / decode_shape.npus, prompt + OUTPUT_TOKENS // 2
    )
    print(
        f"EP{prefill_shape.ep} prefill on {spec['prefill']['podsPerInstance']} servers, "
        f"{prompt}-token prompt: TTFT {timings['ttft'] * 1000:.2f} ms (its compute "
        f"{timings['prefill'] * 1000:.2f} ms; one process of the shape: "
        f"{predicted_prefill * 1000:.2f} ms); decode on {spec['decode']['podsPerInstance']} "
        f"servers, batch 1: TPOT {timings['tpotMean'] * 1000:.2f} ms (one process: "
        f"{predicted_tpot * 1000:.2f} ms)"
    )
    assert timings["prefill"] == pytest.approx(predicted_prefill, rel=0.05)
    assert timings["tpotMean"] == pytest.approx(predicted_tpot, rel=0.05)

    # --- one worker's engine killed: its instance out of the entrances, then back; only it
    prefill = sorted(n for n, r in rows.items() if r["role"] == "prefill")[0]
    worker = f"{prefill}-1"
    before = pod_runs(emulator.pods(), namespace, live=True)
    killed = time.monotonic()
    for pid in before[worker].pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: prefill not in (_status(groups, "ds").get("entrances") or []),
        5,  # its pod not Ready: at once, not at its session's timeout (10 s)
        f"{prefill} out of the entrances",
        explain=groups.explain,
    )
    out = time.monotonic() - killed
    wait_for(
        lambda: groups.ready("ds") and prefill in (_status(groups, "ds").get("entrances") or []),
        120,
        f"{prefill} back in the entrances, the group Ready",
        explain=groups.explain,
    )
    print(
        f"worker {worker} killed: {prefill} out of the entrances after {out:.1f} s, back and "
        f"the group Ready after {time.monotonic() - killed:.1f} s"
    )
    after = pod_runs(emulator.pods(), namespace, live=True)
    assert restarted(before, after) == {worker: "restarted 1"}
    last = wait_for(
        lambda: (
            (_status(groups, "ds").get("lastRecovery") or {}).get("phase") == "Restored"
            and _status(groups, "ds")["lastRecovery"]
        ),
        30,
        "the recovery Restored",
        explain=groups.explain,
    )
    assert last["fault"]["kind"] == "kill", last
    assert last["fault"]["instances"] == [prefill], last
    assert "rank 1" in last["fault"]["detail"], last
    assert last["plan"]["action"] == "RestartInPlace", last
    assert last["podsRestarted"] == 1, last
    again, _ = _completion(gateway, spec["scenario"], "hello " * 64, 8)
    assert again["instances"]["prefill"] in rows, again

    # --- a decode no SuperPod can hold now: none of its pods, no NPU held, and why
    big = load(SAMPLE)
    big["metadata"] = {"name": "ds-big"}
    big["spec"]["scenario"] = "big"
    big["spec"]["prefill"]["replicas"] = 1
    used = sum(len(r.npus) for r in after.values())
    free_servers = SERVERS - len({r.node for r in after.values()})
    # more servers than are free, an even number (its dies a multiple of the prefill's 32: the
    # KV mapping's precondition)
    servers = free_servers + 1 + (free_servers + 1) % 2
    big["spec"]["decode"]["devicesPerInstance"] = 8 * servers
    big["spec"]["decode"]["podsPerInstance"] = servers
    groups.create(big)

    def says_why() -> str | None:
        ready = groups.condition("ds-big", "Ready")
        progressing = groups.condition("ds-big", "Progressing")
        if ready.get("reason") == "Unplaceable":
            return str(progressing.get("message"))
        return None

    message = wait_for(says_why, 60, "ds-big Unplaceable", explain=groups.explain)
    assert "holding no NPU" in message
    labels = groups.core.read_node(emulator.nodes[0]).metadata.labels
    assert f"{labels[kinds.LABEL_SUPERPOD]} " in message  # its free NPUs, by SuperPod
    time.sleep(5)  # nothing comes meanwhile
    pods = groups.pods("ds-big")
    assert not [p for p in pods if "-d-" in p], sorted(pods)
    now = pod_runs(emulator.pods(), namespace, live=True)
    decode_npus = sum(len(r.npus) for n, r in now.items() if n.startswith("ds-big-d"))
    assert decode_npus == 0
    assert sum(len(r.npus) for r in now.values()) >= used  # the first group untouched
