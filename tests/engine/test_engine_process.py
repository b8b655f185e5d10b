"""The engine stub as real processes on loopback: streaming, admission, KV over the fabric,
timings against the model, faults, bad input."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginestub import calibration as cal
from enginestub import timing
from enginestub.node import devicestatus
from enginestub.node.topology import SuperPodSpec, TopologySpec, build
from matrixserve.api import catalog
from matrixserve.api.catalog import GPT3_175B, HBM_USABLE_FRACTION, LLAMA3_8B
from testkit.helpers import assert_emulated, metric

LLAMA = ["--model", "llama3-8b", "--dies", "0,1"]
GPT3 = ["--model", "gpt3-175b", "--dies", "0,1,2,3,4,5,6,7"]


def launch(
    start_engine: Any,
    name: str,
    *,
    role: str = "colocated",
    model: list[str] = LLAMA,
    scale: str,
    extra: tuple[str, ...] | list[str] = (),
) -> Any:
    """An engine of ``role`` loading its model at once (NPU-fork over UB), at time ``scale``.
    No TE-Pre-Load: these tests are about serving, and at time scale 1 its 20 emulated s would
    be 20 wall s per engine (tests/engine/test_warm_fork.py tests the start-up phases)."""
    return start_engine(
        name,
        "--role",
        role,
        *model,
        "--time-scale",
        scale,
        "--load-source",
        "NPUForkUB",
        "--pre-load-seconds",
        "0",
        *extra,
    )


def test_colocated_streams_tokens_with_ttft_and_tpot_from_the_model(
    start_engine: Any, stream: Any
) -> None:
    engine = launch(start_engine, "colo", scale="1")
    status, events = stream(
        f"{engine.url}/v1/generate", {"requestId": "r1", "promptTokens": 8192, "maxTokens": 60}
    )
    assert status == 200
    tokens = [e for e in events if e["type"] == "token"]
    assert [t["index"] for t in tokens] == list(range(60))
    done = events[-1]
    assert done["type"] == "done"
    assert done["usage"] == {"promptTokens": 8192, "completionTokens": 60}
    shape = timing.InstanceShape(dies=2, tp=2)
    expected_ttft = timing.prefill_seconds(LLAMA3_8B, shape, 8192)
    expected_tpot = timing.tpot(LLAMA3_8B, shape, 1 / shape.npus, 8192 + 30)
    assert_emulated(done["timings"]["ttft"], expected_ttft, 1)
    assert_emulated(done["timings"]["tpotMean"], expected_tpot, 1, steps=59)
    # The same figures reach Prometheus.
    assert metric(engine.url, "matrixserve_engine_ttft_seconds_count") == 1
    assert metric(engine.url, "matrixserve_engine_ttft_seconds_sum") == pytest.approx(
        done["timings"]["ttft"], rel=1e-6
    )
    tpot_sum = metric(engine.url, "matrixserve_engine_tpot_seconds_sum")
    tpot_count = metric(engine.url, "matrixserve_engine_tpot_seconds_count")
    assert_emulated(tpot_sum / tpot_count, expected_tpot, 1, steps=59)


def test_time_scale_compresses_wall_time_not_reported_time(start_engine: Any, stream: Any) -> None:
    slow = launch(start_engine, "x1", scale="1")
    fast = launch(start_engine, "x20", scale="20")
    results = {}
    for name, engine in (("x1", slow), ("x20", fast)):
        began = time.monotonic()
        _, events = stream(
            f"{engine.url}/v1/generate", {"requestId": "r", "promptTokens": 32000, "maxTokens": 2}
        )
        results[name] = (time.monotonic() - began, events[-1]["timings"]["ttft"])
    # Emulated TTFT does not depend on the scale: both match the model (reporting wall time
    # would make x20's 20 times shorter, scaling twice 20 times longer).
    expected = timing.prefill_seconds(LLAMA3_8B, timing.InstanceShape(dies=2, tp=2), 32000)
    assert_emulated(results["x1"][1], expected, 1)
    assert_emulated(results["x20"][1], expected, 20)
    assert results["x20"][0] < results["x1"][0] / 3, "a larger time scale must take less wall time"


def test_prefill_rejects_instead_of_queueing(start_engine: Any, stream: Any) -> None:
    engine = launch(start_engine, "p1", scale="1", extra=["--max-batch", "1"])
    status, body, answered_in = _behind_a_long_prompt(
        engine.url, stream, {"requestId": "second", "promptTokens": 10, "maxTokens": 1}
    )
    # The baseline's admission, asked per request: wait in the local queue behind the slot.
    q_status, q_events, _ = _behind_a_long_prompt(
        engine.url,
        stream,
        {"requestId": "queued", "promptTokens": 10, "maxTokens": 1, "admission": "queue"},
    )
    assert status == 429
    assert body[0]["error"]["code"] == "rejected"
    assert "prefill busy: 1/1 slots in use" in body[0]["error"]["message"]
    assert answered_in < 0.5, "a rejection must not wait behind the 1.3 s prefill (no queue)"
    assert q_status == 200
    assert q_events[-1]["timings"]["ttft"] > 1.0, "the queued request waited for the long prefill"
    # Its budget spent in the queue, a request is not prefilled (checked before prefill too).
    late_status, late, _ = _behind_a_long_prompt(
        engine.url,
        stream,
        {
            "requestId": "late",
            "promptTokens": 10,
            "maxTokens": 1,
            "admission": "queue",
            "ttftBudget": 0.2,
        },
    )
    assert late_status == 200
    assert late[-1]["type"] == "error"
    assert late[-1]["code"] == "ttft_timeout"
    assert "not prefilled" in late[-1]["message"]
    assert not any(e["type"] == "token" for e in late)
    bad_status, bad = stream(
        f"{engine.url}/v1/generate",
        {"requestId": "x", "promptTokens": 10, "maxTokens": 1, "admission": "maybe"},
    )
    assert bad_status == 400
    assert "admission" in bad[0]["error"]["message"]


def test_prefill_refuses_a_prompt_that_would_miss_a_ttft_budget(
    start_engine: Any, stream: Any
) -> None:
    """Admission checks budgets beside the prompts already in prefill (processor sharing): a
    prompt is refused (429, a free slot notwithstanding) if its own first token, or that of a
    prompt in prefill, would then be late; one that fits is accepted."""
    engine = launch(start_engine, "pd", scale="1", extra=["--max-batch", "4"])
    shape = timing.InstanceShape(dies=2, tp=2)
    alone = timing.prefill_seconds(LLAMA3_8B, shape, 32000)
    url = f"{engine.url}/v1/generate"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # 0.4 s of slack alone; a 16k-token prompt beside it (~0.6 s of work) would eat it all
        first = {"requestId": "long", "promptTokens": 32000, "maxTokens": 1}
        busy = pool.submit(stream, url, {**first, "ttftBudget": alone + 0.4})
        _wait_slots_used(engine.url, 1)
        pushes, pushed = stream(
            url, {"requestId": "big", "promptTokens": 16000, "maxTokens": 1, "ttftBudget": 10}
        )
        own, own_body = stream(  # 0.25 s alone, twice that beside the long one
            url, {"requestId": "own", "promptTokens": 8000, "maxTokens": 1, "ttftBudget": 0.4}
        )
        fits, fitted = stream(  # 0.11 s of work: the long one keeps most of its slack
            url, {"requestId": "fits", "promptTokens": 4000, "maxTokens": 1, "ttftBudget": 10}
        )
        long_status, long_events = busy.result()
    assert pushes == 429, pushed
    assert own == 429, own_body
    for body in (pushed, own_body):
        assert body[0]["error"]["code"] == "rejected"
        assert "would miss" in body[0]["error"]["message"]
    assert fits == 200, fitted
    assert fitted[-1]["type"] == "done", fitted
    assert long_status == 200, long_events
    assert long_events[-1]["type"] == "done", long_events
    assert long_events[-1]["timings"]["ttft"] <= alone + 0.4, (
        "the prompt in prefill kept its budget"
    )
    refused = 'matrixserve_engine_requests_total{outcome="rejected_deadline",stage="prefill"}'
    assert metric(engine.url, refused) == 2


def _behind_a_long_prompt(url: str, stream: Any, body: dict[str, Any]) -> tuple[int, Any, float]:
    """``body``'s answer from a one-slot engine whose slot a 32k-token prompt holds, and how long
    it took (wall s)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(
            stream,
            f"{url}/v1/generate",
            {"requestId": f"long-{body['requestId']}", "promptTokens": 32000, "maxTokens": 1},
        )
        _wait_slots_used(url, 1)
        began = time.monotonic()
        status, events = stream(f"{url}/v1/generate", body)
        took = time.monotonic() - began
        assert busy.result()[0] == 200
    return status, events, took


def _streams(
    pool: concurrent.futures.Executor, stream: Any, url: str, prefix: str, n: int, **body: Any
) -> list[concurrent.futures.Future[Any]]:
    """``n`` generate streams under way in ``pool``, request ids ``<prefix><i>``."""
    return [
        pool.submit(stream, f"{url}/v1/generate", {"requestId": f"{prefix}{i}", **body}, 120)
        for i in range(n)
    ]


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/info", trust_env=False).json()["health"])


def _wait_slots_used(url: str, used: int) -> None:
    deadline = time.monotonic() + 10
    while _health(url)["prefillSlots"]["used"] != used:
        assert time.monotonic() < deadline, f"{url}: prefill slots never reached {used} in use"
        time.sleep(0.01)


def _pd_pair(start_engine: Any, plane: str, name: str, scale: str = "0.1") -> tuple[Any, Any]:
    decode = launch(
        start_engine,
        f"{name}-d",
        role="decode",
        model=GPT3,
        scale=scale,
        extra=["--kv-plane", plane],
    )
    prefill = launch(
        start_engine,
        f"{name}-p",
        role="prefill",
        model=GPT3,
        scale=scale,
        extra=["--kv-plane", plane, "--decode-peer", decode.address, "--max-batch", "4"],
    )
    return prefill, decode


def test_kv_over_roce_vs_ub_differs_by_the_modelled_bandwidth_ratio(
    start_engine: Any, stream: Any
) -> None:
    times = {}
    for plane in ("RoCE", "UB"):
        prefill, _ = _pd_pair(start_engine, plane, plane.lower())
        status, events = stream(
            f"{prefill.url}/v1/generate",
            {"requestId": "kv", "promptTokens": 2048, "maxTokens": 3},
            timeout=120,
        )
        assert status == 200, events
        assert events[-1]["type"] == "done", events[-1]
        times[plane] = events[-1]["timings"]["kvTransfer"]
    nbytes = timing.kv_bytes(GPT3_175B, 2048)
    # each plane against its own model (time scale 0.1): a transfer on the wrong plane is 6-8x off
    assert_emulated(times["RoCE"], cal.ROCE_LATENCY + nbytes / (8 * cal.ROCE_DIE_BANDWIDTH), 0.1)
    assert_emulated(
        times["UB"], cal.UB_LATENCY_INTER + nbytes / (8 * cal.UB_READ_BANDWIDTH_INTER), 0.1
    )
    ratio = times["RoCE"] / times["UB"]
    modelled = cal.UB_READ_BANDWIDTH_INTER / cal.ROCE_DIE_BANDWIDTH
    print(
        f"\nKV {nbytes / 2**30:.1f} GiB: RoCE {times['RoCE']:.4f}s, UB {times['UB']:.4f}s -> {ratio:.2f}x (model {modelled:.2f}x)"
    )
    assert ratio > modelled / 2, "UB must be the far faster plane"


def test_kv_into_a_larger_decode_moves_over_its_dp_groups_sub_links(
    start_engine: Any, stream: Any
) -> None:
    """A prefill of 4 dies and a decode of 8 dies with tp 2 (dp 4; CloudMatrix-Infer §4.3.3):
    the request decodes on one DP group, whose 2 dies pull over their own sub-links from 2
    distinct prefill dies (``timing.kv_pull_links``), not over all 8 of the decode's."""
    decode = launch(
        start_engine,
        "big-d",
        role="decode",
        model=["--model", "llama3-8b", "--dies", "0,1,2,3,4,5,6,7"],
        scale="0.1",
        extra=["--kv-plane", "RoCE", "--tp", "2"],
    )
    prefill = launch(
        start_engine,
        "small-p",
        role="prefill",
        model=["--model", "llama3-8b", "--dies", "0,1,2,3"],
        scale="0.1",
        extra=["--kv-plane", "RoCE", "--decode-peer", decode.address],
    )
    status, events = stream(
        f"{prefill.url}/v1/generate",
        {"requestId": "kv", "promptTokens": 8192, "maxTokens": 2},
        timeout=120,
    )
    assert status == 200, events
    assert events[-1]["type"] == "done", events[-1]
    links = timing.kv_pull_links(2, 4, 1)
    assert links == 2
    nbytes = timing.kv_bytes(LLAMA3_8B, 8192)
    measured = events[-1]["timings"]["kvTransfer"]
    print(f"\nKV {nbytes / 2**30:.2f} GiB into a DP group of 2 dies over RoCE: {measured:.4f}s")
    assert_emulated(measured, cal.ROCE_LATENCY + nbytes / (links * cal.ROCE_DIE_BANDWIDTH), 0.1)


def test_two_concurrent_kv_pulls_into_one_decode_take_twice_as_long(
    start_engine: Any, stream: Any
) -> None:
    prefill, decode = _pd_pair(start_engine, "RoCE", "pair")
    body = {"promptTokens": 2048, "maxTokens": 2}
    _, alone = stream(f"{prefill.url}/v1/generate", {"requestId": "alone", **body}, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = _streams(pool, stream, prefill.url, "c", 2, **body)
        together = [f.result()[1][-1]["timings"]["kvTransfer"] for f in futures]
    single = alone[-1]["timings"]["kvTransfer"]
    print(f"\nKV pull alone {single:.4f}s, two at once {together[0]:.4f}s / {together[1]:.4f}s")
    for t in together:
        # shared fairly: twice as long, less whatever the two requests were out of step
        assert 1.6 * single <= t <= 2.3 * single
    assert metric(
        decode.url, 'matrixserve_engine_kv_bytes_total{direction="in",plane="RoCE"}'
    ) == pytest.approx(3 * timing.kv_bytes(GPT3_175B, 2048))


def test_die_fault_in_the_device_file_is_seen_within_one_second_and_fails_requests(
    start_engine: Any, tmp_path: Path, stream: Any
) -> None:
    server = build(TopologySpec(superpods=[SuperPodSpec(name="sp0", servers=1)]))[0]
    status = devicestatus.DeviceStatus(server)
    device_file = tmp_path / "device-status.json"
    devicestatus.write_atomically(device_file, status.render("t0"))
    # The dies come from the node's environment, as the node emulator passes them.
    engine = start_engine(
        "faulty",
        "--role",
        "colocated",
        "--model",
        "llama3-8b",
        "--time-scale",
        "1",
        "--load-source",
        "NPUForkUB",
        # no TE-Pre-Load: 20 wall s at time scale 1, and not what this test is about
        "--pre-load-seconds",
        "0",
        env={"MATRIXSERVE_DEVICE_STATUS_FILE": str(device_file), "MATRIXSERVE_DIES": "2,3"},
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            stream,
            f"{engine.url}/v1/generate",
            {"requestId": "inflight", "promptTokens": 100, "maxTokens": 2000},
        )
        deadline = time.monotonic() + 10
        while _health(engine.url)["decodeBatch"]["running"] < 1:
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.02)
        status.inject(devicestatus.Fault(devicestatus.FaultKind.DIE_DOWN, 3, "t1"))
        devicestatus.write_atomically(device_file, status.render("t1"))
        injected = time.monotonic()
        while httpx.get(f"{engine.url}/readyz", trust_env=False).status_code == 200:
            assert time.monotonic() - injected < 1.0, "the die fault was not seen within 1 s"
            time.sleep(0.02)
        seen_in = time.monotonic() - injected
        _, events = running.result()
    print(f"\ndie fault seen by the engine in {seen_in * 1000:.0f} ms")
    assert events[-1]["type"] == "error"
    assert "die 3: DIE_DOWN" in events[-1]["message"]
    health = httpx.get(f"{engine.url}/readyz", trust_env=False).json()
    assert health["unhealthyDies"] == {"3": "DIE_DOWN"}
    rejected, body = stream(f"{engine.url}/v1/generate", {"requestId": "after", "promptTokens": 10})
    assert rejected == 503
    assert body[0]["error"]["code"] == "device_fault"
    # A fault on a die of another pod on the node does not concern this engine.
    status.heal(devicestatus.FaultKind.DIE_DOWN, 3)
    status.inject(devicestatus.Fault(devicestatus.FaultKind.DIE_DOWN, 9, "t2"))
    devicestatus.write_atomically(device_file, status.render("t2"))
    deadline = time.monotonic() + 2
    while httpx.get(f"{engine.url}/readyz", trust_env=False).status_code != 200:
        assert time.monotonic() < deadline, "healing die 3 must make the engine ready again"
        time.sleep(0.05)


def test_injected_faults_slow_hang_and_bad_fault_requests(start_engine: Any, stream: Any) -> None:
    engine = launch(start_engine, "inj", scale="1")
    _, normal = stream(
        f"{engine.url}/v1/generate", {"requestId": "n", "promptTokens": 4096, "maxTokens": 2}
    )
    assert (
        httpx.post(
            f"{engine.url}/v1/faults", json={"kind": "slow", "factor": 3}, trust_env=False
        ).status_code
        == 201
    )
    _, slowed = stream(
        f"{engine.url}/v1/generate", {"requestId": "s", "promptTokens": 4096, "maxTokens": 2}
    )
    expected = timing.prefill_seconds(LLAMA3_8B, timing.InstanceShape(dies=2, tp=2), 4096)
    assert_emulated(normal[-1]["timings"]["ttft"], expected, 1)
    assert_emulated(slowed[-1]["timings"]["ttft"], 3 * expected, 1)
    httpx.request("DELETE", f"{engine.url}/v1/faults", json={"kind": "slow"}, trust_env=False)

    assert (
        httpx.post(f"{engine.url}/v1/faults", json={"kind": "hang"}, trust_env=False).status_code
        == 201
    )
    # Hung: alive (liveness answers), producing nothing (a request waits on the loop).
    assert httpx.get(f"{engine.url}/healthz", timeout=2, trust_env=False).text == "ok"
    with pytest.raises(httpx.TimeoutException):
        stream(f"{engine.url}/v1/generate", {"requestId": "h", "promptTokens": 8}, timeout=0.5)
    healed = httpx.request(
        "DELETE", f"{engine.url}/v1/faults", json={"kind": "hang"}, trust_env=False
    )
    assert healed.status_code == 200
    assert httpx.get(f"{engine.url}/healthz", timeout=2, trust_env=False).text == "ok"
    other = engine
    for body, code in (
        ({"kind": "melt"}, "invalid_fault"),
        ({"kind": "slow", "factor": 0}, "invalid_fault"),
        ({"kind": "die-down", "die": 99}, "invalid_fault"),
        ({"nokind": 1}, "invalid_fault"),
    ):
        response = httpx.post(f"{other.url}/v1/faults", json=body, trust_env=False)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ("not json", 400, "invalid_json"),
        ({"promptTokens": 10}, 400, "invalid_request"),
        ({"requestId": "x"}, 400, "invalid_request"),
        ({"requestId": "x", "promptTokens": -1}, 400, "invalid_request"),
        ({"requestId": "x", "promptTokens": 10, "maxTokens": 10**9}, 400, "invalid_request"),
        ({"requestId": "x", "promptTokens": 10, "maxTokens": "5"}, 400, "invalid_request"),
        ({"requestId": "x", "promptTokens": 10**7}, 413, "prompt_too_long"),
    ],
)
def test_bad_requests_get_clear_4xx(
    start_engine: Any, stream: Any, body: Any, status: int, code: str
) -> None:
    engine = launch(start_engine, "bad", scale="50")
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{engine.url}/v1/generate", content=content, trust_env=False)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert httpx.get(f"{engine.url}/readyz", trust_env=False).status_code == 200


def test_decode_role_refuses_entrance_requests(start_engine: Any, stream: Any) -> None:
    engine = launch(start_engine, "d-only", role="decode", scale="50")
    status, body = stream(f"{engine.url}/v1/generate", {"requestId": "x", "promptTokens": 10})
    assert status == 409
    assert body[0]["error"]["code"] == "wrong_role"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "oracle"], "Input should be 'prefill'"),
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--model", "gpt3-175b", "--dies", "0,1"], "does not fit"),
        (["--dies", "0,1,2", "--tp", "2"], "tp 2 does not divide the 3 dies"),
        (["--host", "10.0.0.1"], "loopback addresses (127.0.0.0/8) only"),
        (["--time-scale", "0"], "time_scale"),
    ],
)
def test_invalid_configurations_exit_2_with_one_message(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "enginestub", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_hbm_limits_the_decode_batch(start_engine: Any, stream: Any) -> None:
    engine = launch(start_engine, "hbm", scale="50", extra=["--max-batch", "64"])
    info = httpx.get(f"{engine.url}/v1/info", trust_env=False).json()
    capacity = 2 * catalog.DIE_HBM_BYTES * HBM_USABLE_FRACTION - info["weightsBytes"]
    assert info["kvCapacityBytes"] == pytest.approx(capacity)
    too_big = int(capacity / LLAMA3_8B.kv_bytes_per_token) + 1
    status, body = stream(
        f"{engine.url}/v1/generate", {"requestId": "huge", "promptTokens": min(too_big, 32768)}
    )
    if too_big <= 32768:
        assert status == 413
        assert "does not fit" in body[0]["error"]["message"]


def test_link_probe_tells_a_working_sub_link_from_a_delayed_and_a_blocked_one(
    start_engine: Any, stream: Any
) -> None:
    """xDeepServe §6.1: a prefill's dummy payload to a decode (``/v1/link/probe``); busy KV
    pulls into the decode make it late (delayed), a link-down fault on a sub-link blocks that
    sub-link only."""
    prefill, decode = _pd_pair(start_engine, "RoCE", "probe")
    prefill_ips = httpx.get(f"{prefill.url}/v1/info", trust_env=False).json()["roceIps"]
    body = {"instance": "probe-p", "roceIps": prefill_ips, "bytes": 1 << 20}
    healthy = httpx.post(f"{decode.url}/v1/link/probe", json=body, trust_env=False).json()
    assert healthy["blocked"] == {}
    assert healthy["shareOfLink"] == 1.0
    assert healthy["seconds"] == pytest.approx(healthy["aloneSeconds"])
    assert healthy["backpressure"] == ""
    # Two KV pulls from this prefill into this decode under way: the probe's share is a third.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pulls = _streams(pool, stream, prefill.url, "busy", 2, promptTokens=2048, maxTokens=2)
        deadline = time.monotonic() + 60
        while _health(prefill.url)["kvEgressFlows"] < 2:
            assert time.monotonic() < deadline, "the two KV pulls never ran together"
            time.sleep(0.005)
        busy = httpx.post(
            f"{decode.url}/v1/link/probe", json={**body, "egressFlows": 2}, trust_env=False
        ).json()
        assert all(f.result()[1][-1]["type"] == "done" for f in pulls)
    assert busy["shareOfLink"] <= 1 / 3 + 1e-9, busy
    transfer, alone = (busy[k] - busy["latencySeconds"] for k in ("seconds", "aloneSeconds"))
    assert transfer > cal.PROBE_DELAY_FACTOR * alone, "late: the prober reads it Delayed"
    httpx.post(
        f"{decode.url}/v1/faults",
        json={"kind": "link-down", "peerRoceIp": prefill_ips[2]},
        trust_env=False,
    )
    broken = httpx.post(f"{decode.url}/v1/link/probe", json=body, trust_env=False).json()
    assert broken["blocked"] == {"2": f"RoCE link down to {prefill_ips[2]}"}
    mismatch = httpx.post(
        f"{decode.url}/v1/link/probe", json={**body, "roceIps": prefill_ips[:2]}, trust_env=False
    )
    assert mismatch.status_code == 409
    assert mismatch.json()["error"]["code"] == "device_mismatch"


def test_a_probe_between_unequal_sizes_names_sub_links_by_the_kv_mapping(
    start_engine: Any,
) -> None:
    """A decode of 8 dies (tp 2, dp 4) probed by a prefill of 4 dies (tp 4): one sub-link per
    decode die, from the prefill die CloudMatrix-Infer §4.3.3's mapping gives it
    (``kvmapping.source_dies``: 0,1,0,1,2,3,2,3); a link down to prefill die 1 blocks exactly
    the sub-links of decode dies 1 and 3; a prefill the mapping cannot pair is refused."""
    decode = launch(
        start_engine,
        "uneq-d",
        role="decode",
        model=["--model", "llama3-8b", "--dies", "0,1,2,3,4,5,6,7"],
        scale="0.1",
        extra=["--tp", "2"],
    )
    prefill_ips = [f"198.19.0.{k + 1}" for k in range(4)]
    body = {"instance": "uneq-p", "roceIps": prefill_ips, "tp": 4, "bytes": 1 << 20}
    healthy = httpx.post(f"{decode.url}/v1/link/probe", json=body, trust_env=False).json()
    assert (healthy["blocked"], healthy["tp"]) == ({}, 2)
    httpx.post(
        f"{decode.url}/v1/faults",
        json={"kind": "link-down", "peerRoceIp": prefill_ips[1]},
        trust_env=False,
    ).raise_for_status()
    broken = httpx.post(f"{decode.url}/v1/link/probe", json=body, trust_env=False).json()
    assert broken["blocked"] == {
        "1": f"RoCE link down to {prefill_ips[1]}",
        "3": f"RoCE link down to {prefill_ips[1]}",
    }
    for refused in ({**body, "tp": 2}, {**body, "roceIps": prefill_ips[:3], "tp": 3}):
        answer = httpx.post(f"{decode.url}/v1/link/probe", json=refused, trust_env=False)
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "device_mismatch"
        assert "CloudMatrix-Infer §4.3.3's mapping needs" in answer.json()["error"]["message"]


def test_a_prefill_slot_frees_once_the_decode_has_pulled_the_kv(
    start_engine: Any, stream: Any
) -> None:
    """P/D-Serve §3.5: a prompt occupies a prefill slot while it waits for the KV transfer, not
    while the decode generates: long generations must not starve the prefill."""
    prefill, decode = _pd_pair(start_engine, "UB", "slot", scale="5")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # the prefill's batch is 4
        long_streams = _streams(
            pool, stream, prefill.url, "long", 4, promptTokens=64, maxTokens=200
        )

        # all four decoding (so admitted and pulled), then their slots must be free
        deadline = time.monotonic() + 10
        while _health(decode.url)["decodeBatch"]["running"] < 4:
            assert time.monotonic() < deadline, "the four requests never reached the decode batch"
            time.sleep(0.02)
        _wait_slots_used(prefill.url, 0)
        status, events = stream(
            f"{prefill.url}/v1/generate", {"requestId": "next", "promptTokens": 64, "maxTokens": 2}
        )
        assert status == 200, events
        assert not any(f.done() for f in long_streams), "the long streams are still decoding"
        assert all(f.result()[1][-1]["type"] == "done" for f in long_streams)
