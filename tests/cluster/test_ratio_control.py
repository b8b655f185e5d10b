"""Issue 19 on the dev cluster: a group under the ``Model`` ratio policy moves toward its
Eq. (1) split while it serves (P/D-Serve §3.3), by dynamic RoCE construction: a decode drained
and released first (fixed total), then a prefill added; the survivors are never restarted and
no request fails meanwhile."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from testkit.chaoskit import Traffic
from testkit.helpers import Groups, events_of, pdgroup_body, wait_for

# ~4,000-token prompts (16 k characters), 4 tokens out: prompts are nearly all of the work
PROMPT_REPEAT = 800
MAX_TOKENS = 4


def test_a_model_group_under_prompt_heavy_load_moves_to_prefill_without_a_failed_request(
    groups: Groups,
    start_operator: Callable[..., Any],
    gateway: str,
    run_tool: Callable[..., Any],
) -> None:
    start_operator(groups.namespace)
    body = pdgroup_body("g", prefill=2, decode=2)
    body["spec"]["ratioPolicy"] = {
        "mode": "Model",
        "windowSeconds": 5,
        "cooldownSeconds": 10,
    }
    body["spec"]["slo"] = {"ttftMilliseconds": 60000}  # failures here would be the move's
    groups.create(body)
    groups.wait_ready("g")
    before = {name: pod.metadata.uid for name, pod in groups.pods("g").items()}
    assert sorted(before) == ["g-d-0", "g-d-1", "g-p-0", "g-p-1"]
    status = groups.get("g")["status"]["ratio"]
    assert (status["policy"], status["target"]) == ("Model", "2:2")

    with Traffic(gateway, clients=3, max_tokens=MAX_TOKENS, prompt_repeat=PROMPT_REPEAT) as load:
        began = time.time()

        def moved() -> bool:
            ratio = groups.get("g").get("status", {}).get("ratio", {})
            return bool(ratio.get("target") == "3:1")

        wait_for(moved, timeout=90, what="the Model policy's target 3:1", explain=groups.explain)
        decided = time.time()

        def arrived() -> bool:
            status = groups.get("g").get("status", {})
            return (
                status.get("ratio", {}).get("current") == "3:1"
                and groups.ready("g")
                and sorted(groups.pods("g")) == ["g-d-0", "g-p-0", "g-p-1", "g-p-2"]
            )

        wait_for(arrived, timeout=120, what="the group serving 3:1", explain=groups.explain)
        arrived_at = time.time()
        time.sleep(2.0)  # requests across the end of the move
        requests = load.snapshot()

    during = [r for r in requests if r.end >= began]
    failed = [r for r in during if not r.ok]
    print(
        f"\ntarget 3:1 after {decided - began:.1f} s, serving 3:1 after {arrived_at - began:.1f}"
        f" s; {len(during)} requests, {len(failed)} failed"
    )
    assert len(during) >= 20, "too little traffic to say anything"
    assert failed == [], [(r.outcome, r.prefill, r.decode) for r in failed[:5]]
    # the released decode served until it drained; the new prefill serves now
    assert any(r.decode == "g-d-1" for r in during)
    assert any(r.prefill == "g-p-2" and r.start > arrived_at - 1 for r in during)
    # survivors untouched
    after = {name: pod.metadata.uid for name, pod in groups.pods("g").items()}
    for name in ("g-p-0", "g-p-1", "g-d-0"):
        assert after[name] == before[name], f"{name} was restarted"
    ratio = groups.get("g")["status"]["ratio"]
    assert ratio["bottleneck"] in ("prefill", "decode")
    assert ratio["numbers"]["balancedRatio"] > 1, ratio  # prompts dominate: more prefill
    assert ratio["lastChangeTime"]
    messages = [
        e.message
        for e in events_of(groups.core, groups.namespace, "g")
        if e.reason == "RatioChange"
    ]
    assert any(
        m.startswith("Moving one instance from decode to prefill (2:2 -> 3:1)") for m in messages
    ), messages
    assert any(e.reason == "Draining" for e in events_of(groups.core, groups.namespace, "g"))
    # what a user sees
    table = run_tool("kubectl", "get", "pdgroup", "g", "-n", groups.namespace, "-o", "wide")
    header, row = table.stdout.splitlines()[:2]
    assert "TARGET" in header
    assert "POLICY" in header
    assert row.split()[header.split().index("TARGET")] == "3:1"


def test_a_ratio_window_ends_within_a_second_of_its_end_not_at_the_resync(
    groups: Groups, start_operator: Callable[..., Any]
) -> None:
    """The plan asks for its own wake-up (``recheck_after``): with a resync of two minutes and
    nothing else waking the group (no traffic, no pod or ZooKeeper change), each 5 s window of
    the Feedback policy still ends, and the next starts, within a second of its end."""
    start_operator(groups.namespace, extra=("--resync-seconds", "120"))
    body = pdgroup_body("g", prefill=1, decode=1)
    body["spec"]["ratioPolicy"] = {"mode": "Feedback", "windowSeconds": 5, "cooldownSeconds": 600}
    groups.create(body)
    groups.wait_ready("g")
    starts: list[float] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(starts) < 4:
        window = groups.get("g").get("status", {}).get("ratio", {}).get("window") or {}
        start = window.get("start")
        if start is not None and (not starts or float(start) != starts[-1]):
            starts.append(float(start))
        time.sleep(0.1)
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(starts)]
    print("window starts", starts, "gaps", gaps)
    assert len(starts) >= 3, f"windows started at {starts} in 30 s (resync 120 s)"
    assert all(gap <= 5 + 1 for gap in gaps), gaps
