"""Issue 19: what the engines have served, in their health reports (``load``), as the operator's
ratio control reads them: engine processes in a P/D group over a private ZooKeeper (the test plays
the operator), real requests through the prefill.

The counters must agree with what the requests were: their number, prompt and output tokens,
refusals of a busy prefill, the prefill's slot time and its part waiting for a decode to take the
KV, the decode's steps and batch. Each is compared with what the test sent and saw, not with the
engine's timing model.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import pytest

from engine.conftest import Group
from matrixserve.api import zk_layout as zl
from testkit.helpers import wait_for

SCALE = "10"  # emulated seconds per wall second: a health report every 2 wall s
MODEL = (
    *("--model", "llama3-8b", "--time-scale", SCALE, "--load-source", "NPUForkUB"),
    *("--pre-load-seconds", "0"),
)


def _load(group: Group, name: str, after: float = 0.0) -> zl.Load:
    """The instance's ``load`` from a health report written after ``after`` (wall)."""
    found: list[zl.Load] = []

    def fresh() -> bool:
        health = group.health(name)
        if health is None or health.load is None or health.ts <= after:
            return False
        found.append(health.load)
        return True

    wait_for(fresh, timeout=30, what=f"a health report of {name} after {after}", every=0.1)
    return found[-1]


def test_the_health_report_counts_what_was_served(
    group: Group, start_engine: Any, stream: Any
) -> None:
    engines = group.start(
        start_engine,
        MODEL,
        ("p-1", "prefill", "198.19.1.1,198.19.1.2", "--max-batch", "2"),
        ("d-1", "decode", "198.19.2.1,198.19.2.2", "--max-batch", "64"),
    )
    group.form(["p-1"], ["d-1"])
    before_p, before_d = _load(group, "p-1"), _load(group, "d-1")
    assert before_p.offered == before_p.prefilled == 0
    assert before_d.decoded == 0
    url = f"{engines['p-1'].url}/v1/generate"

    # 6 requests at once on a prefill of 2 slots: some are refused (429), the rest served whole
    bodies: list[dict[str, Any]] = [
        {"requestId": f"r{i}", "promptTokens": 4000 + 100 * i, "maxTokens": 20} for i in range(6)
    ]
    together = threading.Barrier(len(bodies))  # sent at once, even on a busy machine

    def send(body: dict[str, Any]) -> Any:
        together.wait(timeout=30)
        return stream(url, body, 120)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, bodies))
    served = [b for b, (status, events) in zip(bodies, answers, strict=True) if status == 200]
    refused = [status for status, _ in answers if status == 429]
    assert served, answers
    assert refused, "a prefill of 2 slots refused none of 6 prompts sent at once"
    assert len(served) + len(refused) == len(bodies)
    for (status, events), body in zip(answers, bodies, strict=True):
        if status == 200:
            tokens = [e for e in events if e["type"] == "token"]
            assert len(tokens) == body["maxTokens"], events[-1]
    sent_at = time.time()
    p, d = _load(group, "p-1", sent_at), _load(group, "d-1", sent_at)
    print(f"\np-1 load: {p.dump().decode()}\nd-1 load: {d.dump().decode()}")

    # the prefill: what it was offered, refused and prefilled
    assert p.offered == len(bodies)
    assert p.refused == len(refused)
    assert p.prefilled == len(served)
    assert p.prompt_tokens == sum(b["promptTokens"] for b in served)
    assert p.ttft_s > 0
    assert 0 < p.busy_s <= p.slot_s  # computing is part of the slots' time
    # each slot held from admission until the decode took its KV: after its prefill, it waited
    assert 0 < p.kv_wait_s < p.slot_s
    # the decode: every request it finished, every token it stepped, one KV pull each
    assert d.decoded == len(served)
    assert d.kv_pulls == len(served)
    assert d.kv_s > 0
    # the first token is the prefill's; the decode generates the rest (the model's G), one step
    # (a TPOT sample) each
    assert d.output_tokens == sum(b["maxTokens"] - 1 for b in served)
    assert d.tokens == d.output_tokens
    assert d.tpot_s > 0
    assert d.iterations >= max(b["maxTokens"] - 1 for b in served)
    assert d.iterations <= d.tokens <= d.batch_sum * 1.0001
    assert d.decode_s >= d.tpot_s / max(1, len(served))  # a request lasts its tokens at least
    # the roles' counters stay 0 on the other role
    assert (p.decoded, p.tokens, d.offered, d.prefilled) == (0, 0, 0, 0)


@pytest.mark.parametrize("field", ["ttftSeconds", "busySeconds", "batchSum"])
def test_a_load_report_keeps_its_wire_names(field: str) -> None:
    """The operator reads these names (zk_layout.Load's aliases) from any engine version."""
    assert field in zl.Load().dump().decode()
