"""The ratio policy in a group's plan (issue 19, :mod:`matrixserve.domain.pdgroup.split`): the
window kept in the status, the decision at its end, the Event of a change, the walk one instance
at a time, and what holds it (a group not steady, a cooldown)."""

from __future__ import annotations

from typing import Any

from fakes import pdgroup_spec, serving_group
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.status import RatioStatus
from matrixserve.domain import pdgroup
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.pdgroup import GroupView
from matrixserve.domain.pdgroup.actions import (
    CreatePod,
    MarkRemoved,
    ReportRatioChange,
    StartDrain,
)
from matrixserve.domain.pdgroup.split import WALK_SECONDS, ratio_pass

P, D = zl.Role.PREFILL, zl.Role.DECODE
ENGINE = EngineSettings(zookeeper="127.0.0.1:2181")
T0 = 1_000_000.0
READY = {"conditions": [{"type": "Ready", "status": "True"}]}


def spec(p: int, d: int, **policy: Any) -> PDGroupSpec:
    out: PDGroupSpec = pdgroup_spec(p, d, ratioPolicy=policy)
    return out


def names(p: int, d: int) -> dict[str, zl.Role]:
    return {f"g-p-{i}": P for i in range(p)} | {f"g-d-{i}": D for i in range(d)}


def load_of(
    role: zl.Role, heavy_prompts: bool, t: float, shape: tuple[float, int] | None = None
) -> zl.Load:
    """Counters ``t`` emulated seconds into a steady load: prompt-heavy (long prefills, short
    outputs) or output-heavy, or ``shape`` (TTFT, tokens generated). Per instance."""
    n = int(t)  # a request a second each
    ttft, g = shape or ((2.0, 10) if heavy_prompts else (0.2, 400))
    if role is P:
        return zl.Load.model_validate(
            {
                "offered": n,
                "prefilled": n,
                "ttft_s": ttft * n,
                "busy_s": ttft * n / 4,  # 4 prompts share the compute: 2 req/s busy (heavy)
                "slot_s": ttft * n,
            }
        )
    return zl.Load.model_validate(
        {
            "decoded": n,
            "output_tokens": g * n,
            "tokens": g * n,
            "tpot_s": 0.02 * g * n,
            "kv_pulls": n,
            "kv_s": 0.01 * n,
            "decode_s": 0.02 * g * n,
        }
    )


def group(
    s: PDGroupSpec,
    members: dict[str, zl.Role],
    *,
    now: float,
    previous: dict[str, Any] | None = None,
    heavy_prompts: bool = True,
    incarnation: str = "i1",
    pods: dict[str, zl.Role] | None = None,
    shape: tuple[float, int] | None = None,
) -> GroupView:
    """A formed group of ``members`` serving, their health carrying ``load_of`` at ``now``."""
    view: GroupView = serving_group(
        s,
        members,
        {n: load_of(r, heavy_prompts, now - T0 + 100, shape) for n, r in members.items()},
        dict.fromkeys(members, incarnation),
        now=now,
        previous={**READY, **(previous or {})},
        engine=ENGINE,
        pods=pods,
    )
    return view


def test_fixed_counts_are_the_spec_replicas() -> None:
    s = spec(2, 2)
    out = ratio_pass(group(s, names(2, 2), now=T0))
    assert (out.counts.prefill, out.counts.decode) == (2, 2)
    assert out.status["policy"] == "Fixed"
    assert out.notices == []


def test_model_moves_a_prompt_heavy_group_toward_prefill_one_instance_at_a_time() -> None:
    s = spec(2, 2, mode="Model", windowSeconds=30, cooldownSeconds=60)
    first = ratio_pass(group(s, names(2, 2), now=T0))
    assert first.status["target"] == "2:2"
    assert (first.counts.prefill, first.counts.decode) == (2, 2)
    window = first.status["window"]
    assert window["start"] == T0
    assert window["members"] == sorted(f"{n}@i1" for n in names(2, 2))
    # within the window: nothing decided, the window kept
    mid = ratio_pass(group(s, names(2, 2), now=T0 + 10, previous={"ratio": first.status}))
    assert mid.status["window"] == window
    assert mid.notices == []
    # the window over: prompts of 2 s at 2 req/s busy per prefill, decodes of 0.21 s at 32:
    # Eq. (1) wants nearly every instance in prefill; one moves (step 1)
    end = ratio_pass(group(s, names(2, 2), now=T0 + 31, previous={"ratio": mid.status}))
    assert end.status["target"] == "3:1"
    (event,) = end.notices
    assert isinstance(event, ReportRatioChange)
    assert event.message.startswith("Moving one instance from decode to prefill (2:2 -> 3:1): ")
    assert "Eq. (1)" in event.message
    assert end.status["bottleneck"] == "prefill"
    assert end.status["prefillCapacity"] < end.status["decodeCapacity"]
    assert end.status["lastChangeTime"]
    # FixedTotal: the decode is released first
    assert (end.counts.prefill, end.counts.decode) == (2, 1)
    plan = pdgroup.plan(group(s, names(2, 2), now=T0 + 31, previous={"ratio": mid.status}))
    # ... drained first (it finishes its requests, no new ones), then out of the map
    assert [a.drain.instance for a in plan.actions if isinstance(a, StartDrain)] == ["g-d-1"]
    assert not any(isinstance(a, MarkRemoved) for a in plan.actions)
    assert any(isinstance(a, ReportRatioChange) for a in plan.actions)
    # ... the decode gone from the map: the prefill is added (a new pod for g-p-2)
    after = ratio_pass(group(s, names(2, 1), now=T0 + 40, previous={"ratio": end.status}))
    assert after.status["target"] == "3:1"
    assert (after.counts.prefill, after.counts.decode) == (3, 1)
    assert after.notices == []
    plan = pdgroup.plan(group(s, names(2, 1), now=T0 + 40, previous={"ratio": end.status}))
    assert [a.name for a in plan.actions if isinstance(a, CreatePod)] == ["g-p-2"]


def test_elastic_adds_first_and_releases_once_the_new_one_serves() -> None:
    s = spec(2, 2, mode="Model", transition="Elastic")
    ratio = {"ratio": {"policy": "Model", "target": "3:1", "desired": "2:2"}}
    out = ratio_pass(group(s, names(2, 2), now=T0, previous=ratio))
    assert (out.counts.prefill, out.counts.decode) == (3, 2)
    # the new prefill in the map and serving: now the decode goes
    out = ratio_pass(group(s, names(3, 2), now=T0, previous={"ratio": out.status}))
    assert (out.counts.prefill, out.counts.decode) == (3, 1)


def test_no_decision_while_cooling_down_or_not_steady() -> None:
    s = spec(2, 2, mode="Model", windowSeconds=30, cooldownSeconds=600)
    first = ratio_pass(group(s, names(2, 2), now=T0))
    recent = {**first.status, "lastChangeTime": "1970-01-12T13:46:30.000000Z"}  # T0 - 10
    end = ratio_pass(group(s, names(2, 2), now=T0 + 31, previous={"ratio": recent}))
    assert end.status["target"] == "2:2"
    assert "cooling down" in end.status["reason"]
    assert end.notices == []
    # a recovery under way: the window starts again, the counts hold
    held = ratio_pass(
        group(
            s,
            names(2, 2),
            now=T0 + 31,
            previous={"ratio": {**first.status, "desired": "2:2"}, "recovering": [{"plan": {}}]},
        )
    )
    assert held.status["window"]["start"] == T0 + 31
    assert held.notices == []
    assert (held.counts.prefill, held.counts.decode) == (2, 2)


def test_a_restarted_member_starts_a_new_window() -> None:
    s = spec(2, 2, mode="Model", windowSeconds=30)
    first = ratio_pass(group(s, names(2, 2), now=T0))
    out = ratio_pass(
        group(s, names(2, 2), now=T0 + 31, previous={"ratio": first.status}, incarnation="i2")
    )
    assert out.status["window"]["start"] == T0 + 31
    assert out.notices == []
    assert out.status["target"] == "2:2"


def test_a_new_total_is_split_at_once() -> None:
    s = spec(2, 2, mode="Model")
    first = ratio_pass(group(s, names(2, 2), now=T0))
    bigger = spec(3, 3, mode="Model")
    out = ratio_pass(group(bigger, names(2, 2), now=T0 + 5, previous={"ratio": first.status}))
    assert out.status["target"] == "3:3"
    assert (out.counts.prefill, out.counts.decode) == (3, 3)  # obtained at once, not one by one
    (event,) = out.notices
    assert isinstance(event, ReportRatioChange)
    assert event.message.startswith("Splitting the total of 6 as 3:3")


def test_feedback_keeps_its_state_in_the_status() -> None:
    s = spec(2, 2, mode="Feedback", windowSeconds=30)
    first = ratio_pass(group(s, names(2, 2), now=T0))
    end = ratio_pass(group(s, names(2, 2), now=T0 + 31, previous={"ratio": first.status}))
    assert end.status["feedback"]["baselineE2E"] is not None  # the first window: its baseline
    assert end.status["target"] == "2:2"
    assert end.notices == []


def test_a_move_of_several_instances_alternates_and_never_exceeds_the_total() -> None:
    """FixedTotal from 4:1 to 2:3: release, add, release, add (never 6 instances for 5)."""
    s = spec(4, 1, mode="Model")
    prev: dict[str, Any] | RatioStatus = {"policy": "Model", "target": "2:3", "desired": "4:1"}
    serving = names(4, 1)
    seen = []
    for _ in range(8):
        out = ratio_pass(group(s, serving, now=T0, previous={"ratio": prev}))
        counts = (out.counts.prefill, out.counts.decode)
        seen.append(counts)
        assert sum(counts) <= 5
        serving = names(*counts)
        prev = out.status
        if counts == (2, 3):
            break
    assert seen == [(3, 1), (3, 2), (2, 2), (2, 3)]


def test_a_new_total_restarts_the_feedback_rule() -> None:
    """A scale to 5 while the rule judged a move of a 4-instance group: the judgement (E2E
    before the move) says nothing about 5 instances; it starts afresh."""
    judging = {
        "policy": "Feedback",
        "target": "2:2",
        "feedback": {
            "moving": "prefill",
            "before": {"windows": 3, "e2e": 15.0, "served": 30.0, "saturated": 0},
            "lastChange": T0 - 100,
        },
    }
    out = ratio_pass(
        group(spec(3, 2, mode="Feedback"), names(2, 2), now=T0, previous={"ratio": judging})
    )
    assert out.status["target"] == "2:3"  # the split of 5 nearest 2:2's ratio
    assert out.status["feedback"]["moving"] is None
    assert out.status["feedback"]["before"] is None


def test_a_move_that_never_arrives_is_given_up() -> None:
    """2:2 -> 3:1 released g-d-1 but g-p-2 never serves: after WALK_SECONDS, back to 2:2."""
    s = spec(2, 2, mode="Model")
    moving = {
        "policy": "Model",
        "target": "3:1",
        "from": "2:2",
        "desired": "3:1",
        "lastChangeTime": "1970-01-12T13:46:40.000000Z",  # T0
    }
    early = ratio_pass(group(s, names(2, 1), now=T0 + 60, previous={"ratio": moving}))
    assert early.status["target"] == "3:1"
    assert early.notices == []
    late = ratio_pass(group(s, names(2, 1), now=T0 + WALK_SECONDS + 1, previous={"ratio": moving}))
    assert late.status["target"] == "2:2"
    (event,) = late.notices
    assert isinstance(event, ReportRatioChange)
    assert event.reason == "RatioMoveAbandoned"
    assert event.warning
    assert (late.counts.prefill, late.counts.decode) == (2, 2)


def test_the_cooldown_counts_from_the_arrival() -> None:
    s = spec(3, 1, mode="Model", windowSeconds=30, cooldownSeconds=60)
    arrived = {
        "policy": "Model",
        "target": "3:1",
        "from": "2:2",
        "lastChangeTime": "1970-01-12T13:45:00.000000Z",  # long before T0
    }
    out = ratio_pass(group(s, names(3, 1), now=T0, previous={"ratio": arrived}))
    assert out.status["reachedTime"] == "1970-01-12T13:46:40.000000Z"  # T0


def test_model_does_not_swing_back_to_the_split_it_just_left() -> None:
    """Figures by which 2:2 serves 5 % more than 3:1 (one prefill serves 4 req/s, one decode
    7.6): past the margin, so Model would move; but 2:2 is the split it left 105 s ago (less
    than three cooldowns), and 5 % is less than three margins: it stays. Later it may go."""
    s = spec(3, 1, mode="Model", windowSeconds=30, cooldownSeconds=60)
    shape = (1.0, 210)
    first = ratio_pass(group(s, names(3, 1), now=T0, shape=shape))
    left = {
        **first.status,
        "from": "2:2",
        "lastChangeTime": "1970-01-12T13:46:30.000000Z",  # T0 - 10
        "reachedTime": "1970-01-12T13:46:35.000000Z",  # T0 - 5
    }
    stay = ratio_pass(group(s, names(3, 1), now=T0 + 100, previous={"ratio": left}, shape=shape))
    assert stay.status["target"] == "3:1"
    assert "not back to 2:2" in stay.status["reason"]
    assert stay.status["numbers"]["capacityTarget"] > stay.status["numbers"]["capacityNow"]
    # long after leaving it, the same figures move it back
    long_ago = {
        **left,
        "lastChangeTime": "1970-01-12T13:30:00.000000Z",
        "reachedTime": "1970-01-12T13:31:00.000000Z",
    }
    back = ratio_pass(
        group(s, names(3, 1), now=T0 + 100, previous={"ratio": long_ago}, shape=shape)
    )
    assert back.status["target"] == "2:2"


def test_a_plan_asks_to_be_looked_at_when_its_window_ends_and_a_held_one_asks_nothing() -> None:
    """``recheck_after``: a group under a ratio policy is due again when its window ends; a
    pass that starts a window asks for its whole length; a held status (ZooKeeper away) keeps
    an old window and asks nothing (no pass every instant while ZooKeeper is away)."""
    from dataclasses import replace

    from matrixserve.domain import pdgroup

    s = spec(2, 2, mode="Feedback", windowSeconds=30)
    first = pdgroup.plan(group(s, names(2, 2), now=T0, previous=READY))
    assert first.status["ratio"]["window"]["start"] == T0
    assert first.recheck_after == 30
    later = group(s, names(2, 2), now=T0 + 12, previous=first.status.dump())
    assert pdgroup.plan(later).recheck_after == 18
    away = replace(later, now=T0 + 100, zk=replace(later.zk, connected=False))
    assert pdgroup.plan(away).status["ratio"]["window"]["start"] == T0  # the last known kept
    assert pdgroup.plan(away).recheck_after is None
    fixed = group(spec(2, 2), names(2, 2), now=T0, previous=READY)
    assert pdgroup.plan(fixed).recheck_after is None  # Fixed observes no window
