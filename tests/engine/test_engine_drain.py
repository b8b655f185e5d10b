"""Issue 19: an instance drained out of its group (a scale-in, a ratio move) finishes what it
holds and takes nothing new, and its health says when it holds nothing: engine processes in a
P/D group over a private ZooKeeper, the test playing the operator (the ``draining/`` marker)."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx

from engine.conftest import Group
from matrixserve.api import zk_layout as zl
from testkit.helpers import wait_for

MODEL = (
    *("--model", "llama3-8b", "--time-scale", "10", "--load-source", "NPUForkUB"),
    *("--pre-load-seconds", "0"),
)


def _drain(group: Group, name: str) -> float:
    at = time.time()
    drain = zl.Drain(instance=name, reason="test: scale-in", at=at)
    group.zk.create(group.paths.draining_of(name), drain.dump(), makepath=True)
    return at


def test_a_draining_decode_finishes_its_streams_and_refuses_new_ones(
    group: Group, start_engine: Any, stream: Any
) -> None:
    engines = group.start(
        start_engine,
        MODEL,
        ("p-1", "prefill", "198.19.1.1,198.19.1.2"),
        ("d-1", "decode", "198.19.2.1,198.19.2.2"),
        ("d-2", "decode", "198.19.3.1,198.19.3.2"),
    )
    group.form(["p-1"], ["d-1", "d-2"])
    url = f"{engines['p-1'].url}/v1/generate"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long_ones = [
            pool.submit(
                stream, url, {"requestId": f"long{i}", "promptTokens": 64, "maxTokens": 3000}, 120
            )
            for i in range(4)
        ]
        time.sleep(1.0)  # every stream decoding (the prefill takes the two decodes in turn)
        at = _drain(group, "d-2")
        # the drained decode refuses new work at once (503), so a new request goes to d-1
        wait_for(
            lambda: (h := group.health("d-2")) is not None and h.draining and h.ts >= at,
            timeout=10,
            what="d-2's health says it drains",
            every=0.05,
        )
        held = group.health("d-2")
        assert held is not None
        refused = httpx_post(f"{engines['d-2'].url}/v1/decode")
        assert refused[0] == 503
        assert refused[1]["error"]["code"] == "draining"
        status, events = stream(url, {"requestId": "new", "promptTokens": 64, "maxTokens": 4})
        assert status == 200
        assert events[-1]["type"] == "done", events[-1]
        assert events[-1]["instances"]["decode"] == "d-1"
        results = [f.result(timeout=120) for f in long_ones]
    # every stream it held ended whole: drained, not cut
    for status, events in results:
        assert status == 200
        assert [e["type"] for e in events].count("token") == 3000, events[-1]
        assert events[-1]["type"] == "done"
    on_d2 = [e for _, e in results if e[-1]["instances"]["decode"] == "d-2"]
    assert on_d2, "no stream was on the drained decode"
    assert held.inflight >= 1
    # ... and its health says, promptly, that it holds nothing more
    wait_for(
        lambda: (h := group.health("d-2")) is not None and h.draining and h.inflight == 0,
        timeout=5,
        what="d-2's health: drained",
        every=0.05,
    )
    # the marker gone (the group wants it again): it takes work again
    group.zk.delete(group.paths.draining_of("d-2"))
    wait_for(
        lambda: (
            httpx_post(f"{engines['d-2'].url}/v1/decode")[1].get("error", {}).get("code")
            != "draining"
        ),
        timeout=10,
        what="d-2 takes work again",
    )


def httpx_post(url: str) -> tuple[int, dict[str, Any]]:
    """A decode request straight to a decode (its answer's status and JSON body)."""
    response = httpx.post(
        url,
        json={"requestId": "x", "promptTokens": 8, "prefill": {"address": "127.0.0.1:1"}},
        trust_env=False,
        timeout=5,
    )
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {}
