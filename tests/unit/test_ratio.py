"""The P/D ratio's model and policies (issue 19; P/D-Serve §2.1, §3.3 Eq. (1), §4.2).

The regression scenarios run the policies against a small plant (a unit-test fake of one layer:
a group's E2E and T_p as functions of its split and the offered load), the three public bugs of
NVIDIA Dynamo's planner that the issue names: a 2 <-> 1 oscillation under constant load, prefill
not rescued under a burst with back-pressure, an unreachable SLO freezing the ratio or blocking a
scale-down.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixserve.api import zk_layout as zl
from matrixserve.domain import ratio as r
from matrixserve.domain.ratio import Bounds, Feedback, FeedbackParams, FeedbackState, Split


def figures(c_p: float, c_d: float, **kw: Any) -> r.Figures:
    """Figures whose one-instance capacities are ``c_p`` and ``c_d`` (T_p = T_d = 1 s)."""
    return r.Figures(ttft_bs=1.0, b_p=c_p, tpot_bs=0.01, b_d=c_d, xi=0.0, g=100.0, **kw)


# ----------------------------------------------------------------------------- the model
def test_the_section_2_1_figures() -> None:
    f = r.Figures(ttft_bs=0.8, b_p=4, tpot_bs=0.05, b_d=32, xi=0.1, g=200, r_pre=0.5)
    assert f.t_p == pytest.approx(0.4)  # TTFT_bs * r_pre
    assert f.t_d == pytest.approx(10.1)  # xi + TPOT_bs * G
    assert f.e2e == pytest.approx(10.5)
    assert f.c_prefill == pytest.approx(10.0)  # b_p / T_p
    assert f.c_decode == pytest.approx(32 / 10.1)
    cap = r.capacity(f, Split(1, 3))
    assert cap.c_p == pytest.approx(10.0)
    assert cap.c_d == pytest.approx(3 * 32 / 10.1)
    assert cap.bottleneck == r.DECODE
    assert cap.phi == pytest.approx(3 * 32 / 10.1 / 4)
    # the traffic is the bottleneck when it is below both roles' capacities: Φ = I_t / n
    low = r.capacity(r.Figures(0.8, 4, 0.05, 32, 0.1, 200, 0.5, traffic=2.0), Split(1, 3))
    assert low.bottleneck == r.TRAFFIC
    assert low.phi == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("field", "value"), [("ttft_bs", 0.0), ("b_d", -1.0), ("g", float("nan")), ("r_pre", 1.5)]
)
def test_figures_that_mean_nothing_are_refused(field: str, value: float) -> None:
    kw: dict[str, Any] = {
        "ttft_bs": 1.0,
        "b_p": 1.0,
        "tpot_bs": 0.1,
        "b_d": 8.0,
        "xi": 0.0,
        "g": 10.0,
    }
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        r.Figures(**kw)


def test_eq1_on_the_papers_example() -> None:
    """Fig. 12a: one prefill serves 0.6, one decode 0.7: Eq. (1) balances at 7:6."""
    f = figures(0.6, 0.7)
    assert f.balanced_ratio() == pytest.approx(7 / 6)
    d = r.model_target(f, 13, Bounds(), Split(1, 12))
    assert (d.target, d.changed) == (Split(7, 6), True)
    assert "7:6" in d.reason
    assert d.numbers["capacityTarget"] == pytest.approx(4.2)
    # N:1 and 1:N are each bound by one role, as §4.2 says
    assert r.capacity(f, Split(12, 1)).bottleneck == r.DECODE
    assert r.capacity(f, Split(1, 12)).bottleneck == r.PREFILL


def test_eq1_with_the_formula() -> None:
    """n_p/n_d = b_d·T_p / (b_p·T_d): prompts of 1.2 s at batch 4, 32 decodes of 200 tokens at
    40 ms plus 0.2 s of transfer: T_d = 8.2 s, ratio 32·1.2/(4·8.2) = 1.17 -> 4:4 of 8 (the
    best integer split: 4·3.33 against 4·3.90)."""
    f = r.Figures(ttft_bs=1.2, b_p=4, tpot_bs=0.04, b_d=32, xi=0.2, g=200)
    assert f.balanced_ratio() == pytest.approx(32 * 1.2 / (4 * 8.2))
    assert r.model_target(f, 8, Bounds(), Split(2, 6)).target == Split(4, 4)
    # a prompt-heavy mix (T_p three times longer) wants more prefill
    heavy = r.Figures(ttft_bs=3.6, b_p=4, tpot_bs=0.04, b_d=32, xi=0.2, g=200)
    assert r.model_target(heavy, 8, Bounds(), Split(4, 4)).target == Split(6, 2)


def test_the_model_keeps_a_split_within_its_margin() -> None:
    """Figures on a rounding boundary do not move an instance back and forth."""
    f = figures(1.0, 1.02)  # 4:4 and 5:3 serve 4.0 and 3.06; 4:4 vs 3:5 = 3.0
    d = r.model_target(f, 8, Bounds(), Split(4, 4))
    assert (d.target, d.changed) == (Split(4, 4), False)
    nearly = figures(1.0, 1.0 / 1.04)  # 4:4 serves 3.85; 5:3 2.88
    assert not r.model_target(nearly, 8, Bounds(), Split(4, 4)).changed


@settings(max_examples=300, deadline=None)
@given(
    c_p=st.floats(0.01, 100),
    c_d=st.floats(0.01, 100),
    total=st.integers(2, 40),
    min_p=st.integers(1, 4),
    min_d=st.integers(1, 4),
    now_p=st.integers(1, 39),
)
def test_the_model_target_is_the_best_allowed_split(
    c_p: float, c_d: float, total: int, min_p: int, min_d: int, now_p: int
) -> None:
    bounds = Bounds(min_prefill=min_p, min_decode=min_d)
    current = Split(min(now_p, total - 1), total - min(now_p, total - 1))
    f = figures(c_p, c_d)
    if not bounds.splits(total):
        with pytest.raises(ValueError, match="no split"):
            r.model_target(f, total, bounds, current)
        return
    d = r.model_target(f, total, bounds, current, margin=0.0)
    assert bounds.allows(d.target)
    assert d.target.total == total
    served = [min(s.prefill * c_p, s.decode * c_d) for s in bounds.splits(total)]
    assert min(d.target.prefill * c_p, d.target.decode * c_d) == pytest.approx(max(served))


def test_bounds_and_ladder() -> None:
    f = figures(0.2, 5.0)  # wants nearly every instance in prefill
    assert r.model_target(f, 10, Bounds(), Split(5, 5)).target == Split(9, 1)
    assert r.model_target(f, 10, Bounds(max_prefill=6), Split(5, 5)).target == Split(6, 4)
    assert r.model_target(f, 10, Bounds(min_decode=3), Split(5, 5)).target == Split(7, 3)
    assert r.model_target(f, 10, Bounds(max_ratio=2.0), Split(5, 5)).target == Split(6, 4)
    ladder = r.parse_ladder(["2:8", "5:5", "7:3"])
    assert r.model_target(f, 10, Bounds(ladder=ladder), Split(5, 5)).target == Split(7, 3)
    # the other way, bounded below
    g = figures(5.0, 0.2)
    assert r.model_target(g, 10, Bounds(min_ratio=0.5), Split(5, 5)).target == Split(4, 6)
    assert r.model_target(g, 10, Bounds(ladder=ladder), Split(5, 5)).target == Split(2, 8)
    with pytest.raises(ValueError, match="no split"):
        r.model_target(f, 6, Bounds(ladder=ladder), Split(3, 3))


@pytest.mark.parametrize("bad", ["3", "a:b", "0:2", "2:0", "1:2:3", "-1:2", ""])
def test_a_bad_ladder_rung_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match=r"P:D|at least one"):
        r.parse_ladder(["2:2", bad])


# ------------------------------------------------------------------------------ execution
@settings(max_examples=300, deadline=None)
@given(
    p0=st.integers(1, 12),
    d0=st.integers(1, 12),
    p1=st.integers(1, 12),
    d1=st.integers(1, 12),
    transition=st.sampled_from(list(r.Transition)),
)
def test_next_step_walks_one_instance_at_a_time(
    p0: int, d0: int, p1: int, d1: int, transition: r.Transition
) -> None:
    current, target = Split(p0, d0), Split(p1, d1)
    path = [current]
    while path[-1] != target:
        step = r.next_step(path[-1], target, transition)
        assert abs(step.prefill - path[-1].prefill) + abs(step.decode - path[-1].decode) == 1
        assert min(step.prefill, step.decode) >= 1
        path.append(step)
        assert len(path) <= 50
    assert len(path) - 1 == abs(p1 - p0) + abs(d1 - d0)  # never a step away from the target
    totals = [s.total for s in path]
    lo, hi = min(current.total, target.total), max(current.total, target.total)
    if transition is r.Transition.FIXED_TOTAL:  # release first: never above either total
        assert max(totals) <= hi
        assert min(totals) >= lo - 1  # releases and additions alternate: one short at most
    else:  # add first: never below either total
        assert min(totals) >= lo
        assert max(totals) <= hi + 1


def test_one_change_moves_at_most_step_instances_and_rung_by_rung() -> None:
    assert r.toward(Split(2, 6), Split(6, 2), 1, Bounds()) == Split(3, 5)
    assert r.toward(Split(2, 6), Split(6, 2), 3, Bounds()) == Split(5, 3)
    assert r.toward(Split(2, 6), Split(3, 5), 3, Bounds()) == Split(3, 5)
    assert r.toward(Split(6, 2), Split(2, 6), 2, Bounds()) == Split(4, 4)
    ladder = Bounds(ladder=r.parse_ladder(["1:7", "4:4", "6:2"]))
    assert r.toward(Split(1, 7), Split(6, 2), 1, ladder) == Split(4, 4)  # the next rung
    assert r.toward(Split(4, 4), Split(6, 2), 1, ladder) == Split(6, 2)
    # nothing allowed on the way: stay
    assert r.toward(Split(2, 6), Split(3, 5), 1, Bounds(max_prefill=2)) == Split(2, 6)
    # a new total is taken at once (a scale of the group)
    assert r.toward(Split(2, 6), Split(2, 2), 1, Bounds()) == Split(2, 2)


@settings(max_examples=200, deadline=None)
@given(
    p0=st.integers(1, 15), p1=st.integers(1, 15), step=st.integers(1, 16), max_p=st.integers(1, 16)
)
def test_toward_stays_in_bounds_and_never_overshoots(
    p0: int, p1: int, step: int, max_p: int
) -> None:
    bounds = Bounds(max_prefill=max_p)
    current, target = Split(p0, 16 - p0), Split(p1, 16 - p1)
    nxt = r.toward(current, target, step, bounds)
    assert nxt == current or bounds.allows(nxt)
    if bounds.allows(current):  # from outside the bounds, the nearest split inside them
        assert abs(nxt.prefill - current.prefill) <= step
    assert min(p0, p1) <= nxt.prefill <= max(p0, p1)


def test_a_move_between_roles_in_each_mode() -> None:
    fixed, elastic = r.Transition.FIXED_TOTAL, r.Transition.ELASTIC
    assert r.next_step(Split(2, 6), Split(3, 5), fixed) == Split(2, 5)  # release a decode
    assert r.next_step(Split(2, 5), Split(3, 5), fixed) == Split(3, 5)  # then add a prefill
    assert r.next_step(Split(2, 6), Split(3, 5), elastic) == Split(3, 6)  # add a prefill
    assert r.next_step(Split(3, 6), Split(3, 5), elastic) == Split(3, 5)  # then release
    assert r.next_step(Split(3, 5), Split(3, 5), fixed) == Split(3, 5)


# ---------------------------------------------------------------------------- the feedback
PARAMS = FeedbackParams(windows=2, cooldown=60.0)
WINDOW_S = 10.0  # the plants' windows
REQUESTS = 10.0  # requests per second in a unit of the plants' rates


def settled(e2e: float = 1.0, share: float = 0.3) -> FeedbackState:
    return FeedbackState(baseline_e2e=e2e, baseline_share=share)


def run(
    fb: Feedback, state: FeedbackState, signal: r.Signal, split: Split, now: float, n: int
) -> tuple[list[r.Decision], FeedbackState]:
    decisions = []
    for i in range(n):
        d, state = fb.decide(state, signal, split, split.total, now + i * 10)
        decisions.append(d)
    return decisions, state


@pytest.mark.parametrize(
    ("e2e", "t_p", "wanted"),
    [
        (1.5, 0.6, r.PREFILL),  # E2E up, T_p/E2E up (0.3 -> 0.4): more prefill
        (1.5, 0.3, r.DECODE),  # E2E up, T_p/E2E down (0.3 -> 0.2): more decode
        (1.1, 0.5, None),  # T_p/E2E up but E2E within 20 %: nothing
        (0.9, 0.1, None),  # E2E down: nothing
    ],
)
def test_the_four_quadrants(e2e: float, t_p: float, wanted: str | None) -> None:
    fb = Feedback(PARAMS, Bounds())
    decisions, _ = run(fb, settled(), r.Signal(e2e, t_p), Split(4, 4), 1000.0, 2)
    last = decisions[-1]
    if wanted is None:
        assert not any(d.changed for d in decisions)
        return
    assert not decisions[0].changed  # one window is not a trend
    assert last.changed
    assert last.target == (Split(5, 3) if wanted == r.PREFILL else Split(3, 5))
    assert f"one more {wanted}" in last.reason
    assert last.numbers["E2E"] == e2e


def test_refusals_alone_are_an_alarm() -> None:
    """Dynamo's second bug: under a burst with back-pressure the engines' TTFT does not rise
    (the wait is at the gateway, the prefills refuse); the refusals move the split: to prefill,
    or to decode when the refusing prefills' slots wait for decodes to take their KV."""
    fb = Feedback(PARAMS, Bounds())
    decisions, _ = run(fb, settled(), r.Signal(1.0, 0.3, rejected=0.4), Split(4, 4), 1000.0, 2)
    assert decisions[-1].target == Split(5, 3)
    assert "refused 40%" in decisions[-1].reason
    held = r.Signal(1.0, 0.3, rejected=0.4, kv_wait=0.8)
    decisions, _ = run(fb, settled(), held, Split(4, 4), 1000.0, 2)
    assert decisions[-1].target == Split(3, 5)
    assert "waiting for a decode 80%" in decisions[-1].reason


def test_slots_waiting_for_decodes_are_a_decode_alarm_without_refusals() -> None:
    """A closed load that never fills the prefills' slots: no refusal, yet the slots wait for
    the decodes to take their KV most of the time (§4.2) — one more decode; not when it was just
    taken back, and then their slots full of KV waiting are no prefill alarm either."""
    fb = Feedback(PARAMS, Bounds())
    waiting = r.Signal(1.0, 0.3, rejected=0.0, kv_wait=0.7, slots_held=0.97)
    decisions, _ = run(fb, settled(), waiting, Split(6, 2), 1000.0, 2)
    assert decisions[-1].target == Split(5, 3)
    assert "waiting for a decode 70%" in decisions[-1].reason
    refuted = dataclasses.replace(settled(), refuted=(r.DECODE,))
    decisions, _ = run(fb, refuted, waiting, Split(6, 2), 1000.0, 4)
    assert not any(d.changed for d in decisions)


def test_full_prefill_slots_are_a_prefill_alarm_without_refusals() -> None:
    """A gateway that counts the slots it holds offers a full prefill nothing: no refusal at
    the engines, the requests wait at the gateway; the prefills' slots are held all the time,
    prefilling (not waiting for decodes) — one more prefill."""
    fb = Feedback(PARAMS, Bounds())
    full = r.Signal(1.0, 0.3, rejected=0.0, kv_wait=0.1, slots_held=0.97)
    decisions, _ = run(fb, settled(), full, Split(2, 6), 1000.0, 2)
    assert decisions[-1].target == Split(3, 5)
    assert "slots held 97% of the time, 90% of it prefilling" in decisions[-1].reason
    # full because they wait for decodes: a decode alarm instead
    waiting = r.Signal(1.0, 0.3, rejected=0.0, kv_wait=0.8, slots_held=0.97)
    decisions, _ = run(fb, settled(), waiting, Split(6, 2), 1000.0, 2)
    assert decisions[-1].target == Split(5, 3)


def test_feedback_respects_cooldown_and_bounds() -> None:
    fb = Feedback(PARAMS, Bounds(max_prefill=4))
    decisions, state = run(fb, settled(), r.Signal(1.5, 0.6), Split(4, 4), 1000.0, 5)
    assert not any(d.changed for d in decisions)
    assert "out of bounds" in decisions[-1].reason
    fb = Feedback(PARAMS, Bounds())
    state = FeedbackState(baseline_e2e=1.0, baseline_share=0.3, last_change=990.0)
    decisions, _ = run(fb, state, r.Signal(1.5, 0.6), Split(4, 4), 1000.0, 2)
    assert not decisions[-1].changed
    assert "cooling down" in decisions[-1].reason


def test_a_move_is_judged_on_the_mean_of_a_trend_of_windows() -> None:
    """A move is judged against the windows of the alarm that asked for it, on as many windows
    after it: one noisy window neither takes a good move back nor sends a bad one further."""
    fb = Feedback(PARAMS, Bounds())  # two windows a trend
    state = settled()
    split = Split(4, 4)
    for now, e2e in ((1000.0, 1.0), (1010.0, 2.0)):  # slots waiting for decodes: decode alarm
        d, state = fb.decide(state, r.Signal(e2e, 0.3, kv_wait=0.8), split, 8, now)
    assert d.target == Split(3, 5)
    assert state.before == r.Tally(2, 3.0, 0, 0.0, 0)  # not saturated: judged on E2E, mean 1.5
    split = d.target
    # after the cooldown: a bad window (E2E 1.65, 10 % worse) then a good one (1.05): their
    # mean (1.35) is 10 % better -> one more decode, not back
    d, judging = fb.decide(state, r.Signal(1.65, 0.3), split, 8, 1100.0)
    assert not d.changed
    assert "judging one more decode (1/2 windows)" in d.reason
    d, _ = fb.decide(judging, r.Signal(1.05, 0.3), split, 8, 1110.0)
    assert d.target == Split(2, 6), d.reason
    assert d.numbers["E2EAfterMove"] == pytest.approx(1.35)
    assert "E2E 1.500 s before, 1.350 s after" in d.reason
    # the same two windows the other way round say the same
    d, judging = fb.decide(state, r.Signal(1.05, 0.3), split, 8, 1100.0)
    d, _ = fb.decide(judging, r.Signal(1.65, 0.3), split, 8, 1110.0)
    assert d.target == Split(2, 6)


def test_a_saturated_move_is_judged_by_what_it_serves() -> None:
    """Slots full (a closed load, a gateway queue the engines do not see): the backlog waits
    either way, and a split that takes it into the engines shows a higher E2E there while the
    requests wait less in all — so a saturated group is judged by what it serves per second:
    30 % more at a 50 % higher engine E2E paid; 30 % less at a lower one did not; within the
    noise, served less is not kept, whatever E2E says. Unsaturated, E2E decides (the load is
    served at either split)."""
    fb = Feedback(PARAMS, Bounds())
    full = r.Tally(2, 2.0, 2000, 200.0, 2)  # E2E 1.0, 10 served/s, saturated
    after = FeedbackState(moving=r.DECODE, before=full, last_change=0.0)
    split = Split(5, 3)

    def judge(signal: r.Signal) -> tuple[r.Decision, FeedbackState]:
        state = after
        for now in (100.0, 110.0):
            d, state = fb.decide(state, signal, split, 8, now)
        return d, state

    d, state = judge(r.Signal(1.5, 0.3, slots_held=0.99, finished=1300, seconds=100.0))
    assert d.target == Split(4, 4), d.reason
    assert "served 10 requests/s before, 13 after (saturated)" in d.reason
    assert state.moving == r.DECODE
    assert state.before == r.Tally(2, 3.0, 2600, 200.0, 2)
    d, state = judge(r.Signal(0.8, 0.3, slots_held=0.99, finished=700, seconds=100.0))
    assert d.target == Split(6, 2), d.reason
    assert state.refuted == (r.DECODE,)
    assert "made it worse" in d.reason
    # within 5 %, no less: kept, settled, nothing refuted
    d, state = judge(r.Signal(1.02, 0.3, slots_held=0.99, finished=1020, seconds=100.0))
    assert not d.changed
    assert "no better, no worse" in d.reason
    assert "no less, within the noise" in d.reason
    assert state.refuted == ()
    assert state.moving is None
    # within 5 % but less, at a far lower engine E2E (issue 29: saturated, the engines' E2E
    # leaves out the wait at the gateway): not kept — E2E does not decide
    d, state = judge(r.Signal(0.6, 0.3, slots_held=0.99, finished=980, seconds=100.0))
    assert d.target == Split(6, 2), d.reason
    assert "less, within the noise" in d.reason
    assert state.refuted == (r.DECODE,)
    # ... and more at a far higher one: kept
    d, state = judge(r.Signal(1.8, 0.3, slots_held=0.99, finished=1010, seconds=100.0))
    assert not d.changed, d.reason
    # ... and less, but no longer saturated (the move ended the backlog): kept
    d, state = judge(r.Signal(0.6, 0.3, slots_held=0.5, finished=980, seconds=100.0))
    assert not d.changed, d.reason
    assert state.refuted == ()
    # 30 % more, but of too few requests to tell (2 x 13 against 2 x 10): no better
    few = FeedbackState(moving=r.DECODE, before=r.Tally(2, 2.0, 20, 2.0, 2), last_change=0.0)
    state = few
    for now in (100.0, 110.0):
        d, state = fb.decide(
            state, r.Signal(1.0, 0.3, slots_held=0.99, finished=13, seconds=1.0), split, 8, now
        )
    assert not d.changed
    assert "no less, within the noise" in d.reason
    # not saturated: E2E decides, whatever is served
    calm = FeedbackState(moving=r.DECODE, before=r.Tally(2, 2.0, 2000, 200.0, 0), last_change=0.0)
    state = calm
    for now in (100.0, 110.0):
        d, state = fb.decide(state, r.Signal(1.5, 0.3, finished=1300, seconds=100.0), split, 8, now)
    assert d.target == Split(6, 2), d.reason


def test_the_state_survives_the_status_and_garbage_does_not() -> None:
    state = FeedbackState(
        1.0,
        0.3,
        r.PREFILL,
        r.Tally(2, 2.1, 90, 10.0, 1.0),
        50.0,
        r.DECODE,
        r.Tally(3, 3.3, 300, 30.0, 3.0),
        (r.DECODE, r.PREFILL),
        2,
        r.Tally(1, 1.2, 110, 10.0, 0.0),
    )
    assert FeedbackState.from_status(state.to_status()) == state
    junk = {
        "baselineE2E": "x",
        "trend": {"windows": True, "e2e": 1.0, "finished": 1.0, "seconds": 1.0, "saturated": 0},
        "alarm": "sideways",
        "lastChange": float("inf"),
        "judged": {"windows": 2, "e2e": -1.0, "finished": 1.0, "seconds": 1.0, "saturated": 0},
        "refuted": "decode",  # not a list
        "calm": -3,
        "moving": "decode",  # no windows before it: nothing to judge it against
        "before": {"windows": 0},
    }
    assert FeedbackState.from_status(junk) == FeedbackState()
    assert FeedbackState.from_status(None) == FeedbackState()


# --------------------------------------------------------------- regression scenarios (plant)
@dataclass
class Plant:
    """A group under an offered load (a unit-test fake): each role a queue whose delay grows as
    its utilisation nears 1; a prefill past its capacity refuses the excess."""

    c_p: float  # one prefill's requests per second
    c_d: float
    offered: float  # requests per second
    t_p0: float = 0.3  # T_p and T_d unloaded
    t_d0: float = 1.0
    noise: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def signal(self, split: Split) -> r.Signal:
        c_p, c_d = split.prefill * self.c_p, split.decode * self.c_d
        u_p = self.offered / c_p
        u_d = min(self.offered, c_p) / c_d
        # the group takes what its weaker role serves and the prefills refuse the rest; when
        # the decodes are the weaker, the prefills' slots are full of KV no decode has taken
        # (the share of their capacity not computing)
        rejected = max(0.0, 1 - min(c_p, c_d) / self.offered)
        kv_wait = max(0.0, 1 - c_d / c_p) if rejected > 0 else 0.0
        jitter = 1 + self.rng.uniform(-self.noise, self.noise)
        t_p = self.t_p0 / (1 - min(u_p, 0.95)) * jitter
        t_d = self.t_d0 / (1 - min(u_d, 0.95)) * jitter
        served = self.count(min(self.offered, c_p, c_d))
        return r.Signal(t_p + t_d, t_p, rejected, kv_wait, finished=served, seconds=WINDOW_S)

    def count(self, rate: float) -> int:
        """The requests finished in a window at ``rate``, with their Poisson noise; a unit of
        the plant's rates is ``REQUESTS`` requests per second (a window holds hundreds of
        requests, as the bench's do)."""
        mean = rate * REQUESTS * WINDOW_S
        return max(0, round(self.rng.gauss(mean, math.sqrt(mean))))

    def figures(self) -> r.Figures:
        return figures(self.c_p, self.c_d)

    def best(self, total: int) -> Split:
        return max(
            Bounds().splits(total),
            key=lambda s: min(s.prefill * self.c_p, s.decode * self.c_d),
        )


def drive(
    plant: Plant, split: Split, windows: int, policy: str, params: FeedbackParams = PARAMS
) -> tuple[Split, list[tuple[float, Split]]]:
    """Run ``policy`` on ``plant`` one window (10 s) at a time, applying each target at once;
    returns the final split and every change (time, split)."""
    fb = Feedback(params, Bounds())
    state = FeedbackState()
    changes = []
    last_model = -1e9
    for i in range(windows):
        now = i * WINDOW_S
        if policy == "Model":
            if now - last_model < params.cooldown:
                continue
            d = r.model_target(plant.figures(), split.total, Bounds(), split)
        else:
            d, state = fb.decide(state, plant.signal(split), split, split.total, now)
        if d.changed:
            split = d.target
            changes.append((now, split))
            last_model = now
    return split, changes


@pytest.mark.parametrize("policy", ["Model", "Feedback"])
@pytest.mark.parametrize("seed", range(5))
def test_constant_load_never_oscillates(policy: str, seed: int) -> None:
    """Dynamo's first bug (2 <-> 1 under constant load): from the balanced split nothing moves;
    from a mismatched one the policy converges, at most one change per cooldown, and none once
    it has converged."""
    plant = Plant(c_p=1.0, c_d=0.7, offered=2.7, seed=seed)  # the best split (3:5) serves 3
    best = plant.best(8)
    split, changes = drive(plant, best, 400, policy)
    assert changes == [], f"{policy} moved a balanced group: {changes}"
    assert split == best
    for start in (Split(2, 6), Split(1, 7), Split(6, 2), Split(7, 1)):
        converges(plant, start, best, policy)


def converges(plant: Plant, start: Split, best: Split, policy: str) -> None:
    split, changes = drive(plant, start, 400, policy)
    times = [t for t, _ in changes]
    assert all(b - a >= PARAMS.cooldown for a, b in itertools.pairwise(times))
    assert times, f"{policy} never moved from {start}"
    assert times[-1] < 200 * 10, f"{policy} still moving late: {changes}"
    cap = min(split.prefill * plant.c_p, split.decode * plant.c_d)
    best_cap = min(best.prefill * plant.c_p, best.decode * plant.c_d)
    assert cap >= 0.85 * best_cap, f"{policy} settled at {split}, best {best}: {changes}"
    # a reversal at most once (an overshoot taken back), never back and forth
    directions = [
        r.PREFILL if b.prefill > a.prefill else r.DECODE
        for a, b in zip([start] + [s for _, s in changes], [s for _, s in changes], strict=False)
    ]
    reversals = sum(1 for a, b in itertools.pairwise(directions) if a != b)
    assert reversals <= 1, f"{policy}: {changes}"


@dataclass
class ClosedPlant(Plant):
    """``clients`` requests in flight, never more than the prefills' slots: nothing refused;
    the group serves what its weaker role does, and when that is the decodes the prefills'
    slots wait for them."""

    def signal(self, split: Split) -> r.Signal:
        c_p, c_d = split.prefill * self.c_p, split.decode * self.c_d
        served = min(c_p, c_d)
        jitter = 1 + self.rng.uniform(-self.noise, self.noise)
        # a closed loop of 10 clients: E2E is their number over what is served (Little's law)
        e2e = 10.0 / served * jitter
        t_p = self.t_p0 * (1 + c_d / c_p) * jitter
        kv_wait = max(0.0, 1 - c_d / c_p) if c_d < c_p else 0.0
        # the weaker role is saturated: if it is the prefills, their slots are full
        slots = 1.0 if c_p <= c_d else min(c_d / c_p + kv_wait, 1.0)
        finished = self.count(served)
        return r.Signal(e2e, min(t_p, e2e / 2), 0.0, kv_wait, slots, finished, WINDOW_S)


@pytest.mark.parametrize(
    ("start", "c_p", "c_d"),
    [(Split(6, 2), 4.0, 1.0), (Split(7, 1), 4.0, 1.0), (Split(2, 6), 1.0, 4.0)],
)
def test_feedback_moves_a_closed_load_off_a_steady_shortage(
    start: Split, c_p: float, c_d: float
) -> None:
    """The bench's cases: from a mismatched split with nothing refused (the slots waiting for
    decodes, or full of prompts), Feedback walks toward the short role and settles within reach
    of the best split."""
    plant = ClosedPlant(c_p=c_p, c_d=c_d, offered=0.0)
    best = plant.best(8)  # 2:6 (min(8, 6)) against 1:7 (4) and 3:5 (5)
    split, changes = drive(plant, start, 400, "Feedback")
    cap = min(split.prefill * plant.c_p, split.decode * plant.c_d)
    assert cap >= 0.8 * min(best.prefill * plant.c_p, best.decode * plant.c_d), changes
    short = r.DECODE if c_d < c_p else r.PREFILL
    first = changes[0][1]
    assert (first.decode > start.decode) if short == r.DECODE else (first.prefill > start.prefill)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("start", [Split(5, 35), Split(30, 10)])
def test_a_large_group_under_a_closed_load_does_not_take_turns(seed: int, start: Split) -> None:
    """40 instances: one instance moves a role's figures by a few per cent, within the noise
    — near the boundary where the slots go from computing to waiting, a decode alarm and a
    prefill alarm must not take turns (moves judged "no better" and kept, each undone by the
    other alarm). The gap between the two alarms' thresholds stops the walk within reach of
    the best split, one way, with at most one reversal (an overshoot taken back)."""
    plant = ClosedPlant(c_p=2.0, c_d=1.0, offered=0.0, seed=seed)
    split, changes = drive(plant, start, 2000, "Feedback")
    directions = [
        b.prefill > a.prefill
        for a, b in zip([start] + [s for _, s in changes], [s for _, s in changes], strict=False)
    ]
    assert sum(1 for a, b in itertools.pairwise(directions) if a != b) <= 1, changes
    assert changes
    assert changes[-1][0] < 1000 * WINDOW_S, changes  # none in the second half
    best = plant.best(40)
    cap = min(split.prefill * plant.c_p, split.decode * plant.c_d)
    assert cap >= 0.75 * min(best.prefill * plant.c_p, best.decode * plant.c_d), changes


@pytest.mark.parametrize("seed", range(3))
def test_a_group_past_its_capacity_probes_once_then_stays(seed: int) -> None:
    """No split serves 3.2 req/s (the best, 3:5, serves 3; 4:4 2.8): the prefills refuse at
    every split. The rule may try one more prefill, judged by what it serves (not by the
    engines' E2E, which leaves out the wait for a refused offer): taken back if it served
    less, kept if within the noise it did not (7 % apart, two windows of ~300 requests
    cannot always tell) — and then it stays put, the prefill refuted."""
    plant = Plant(c_p=1.0, c_d=0.7, offered=3.2, seed=seed)
    best = plant.best(8)
    split, changes = drive(plant, best, 400, "Feedback")
    assert len(changes) <= 2, changes
    assert all(t < 100 * WINDOW_S for t, _ in changes), changes  # none after the probe
    assert split in (best, Split(4, 4)), changes


def test_a_prefill_burst_with_rejections_moves_toward_prefill() -> None:
    """Dynamo's second bug: a burst the prefills refuse (back-pressure) moves the split to
    prefill, even while the decode's E2E share does not say so."""
    plant = Plant(c_p=1.0, c_d=1.0, offered=2.0)
    split, _ = drive(plant, Split(4, 4), 30, "Feedback")
    assert split == Split(4, 4)  # under the capacity: nothing to do
    fb = Feedback(PARAMS, Bounds())
    state = FeedbackState()
    for i in range(10):  # settled at 2 req/s
        _, state = fb.decide(state, plant.signal(split), split, 8, i * 10.0)
    plant.offered = 6.0  # the burst: 4 prefills serve 4
    moves = []
    for i in range(10, 60):
        d, state = fb.decide(state, plant.signal(split), split, 8, i * 10.0)
        if d.changed:
            moves.append(d)
            split = d.target
    assert moves
    assert moves[0].target == Split(5, 3)
    assert "refused" in moves[0].reason


def test_an_unreachable_slo_neither_freezes_the_ratio_nor_blocks_a_scale_down() -> None:
    """Dynamo's third bug: the rule never looks at an SLO, only at E2E against its own
    baseline. A group far slower than any SLO still moves on an alarm, and a smaller total is
    split at once."""
    slow = Plant(c_p=0.05, c_d=0.05, offered=0.15, t_p0=30.0, t_d0=120.0)  # minutes per request
    fb = Feedback(PARAMS, Bounds())
    state = FeedbackState()
    split = Split(4, 4)
    for i in range(5):
        d, state = fb.decide(state, slow.signal(split), split, 8, i * 10.0)
        assert not d.changed
    slow.t_p0 *= 3  # the prompts grow: T_p/E2E and E2E up
    moved = None
    for i in range(5, 40):
        d, state = fb.decide(state, slow.signal(split), split, 8, i * 10.0)
        if d.changed:
            moved = d.target
            break
    assert moved == Split(5, 3)
    # scale-down: the spec's total falls to 4: the split of 4 comes at once, SLO or not
    d, state = fb.decide(state, slow.signal(moved), moved, 4, 1000.0)
    assert d.changed
    assert d.target.total == 4
    d = r.model_target(slow.figures(), 4, Bounds(), moved)
    assert d.target.total == 4


# ------------------------------------------------------------------------- the observation
def load(**kw: float) -> zl.Load:
    return zl.Load.model_validate(kw)


def test_a_window_is_the_difference_of_two_reports_of_one_process() -> None:
    old = load(offered=10, refused=1, prefilled=9, ttft_s=4.5, busy_s=3.0)
    new = load(offered=30, refused=6, prefilled=24, ttft_s=12.0, busy_s=8.0)
    d = r.load_delta(old, new)
    assert d is not None
    assert (d.offered, d.refused, d.prefilled) == (20, 5, 15)
    assert d.ttft_s == pytest.approx(7.5)
    # a counter that went back is another process (a restart): no window
    assert r.load_delta(new, load(offered=3, prefilled=2)) is None
    total = r.load_sum([d, d, load(decoded=4)])
    assert (total.offered, total.prefilled, total.decoded) == (40, 30, 4)
    assert total.busy_s == pytest.approx(10.0)


def test_figures_and_signal_from_a_window() -> None:
    prefill = load(
        offered=100, refused=20, prefilled=80, ttft_s=40.0, busy_s=20.0, slot_s=60.0, kv_wait_s=15.0
    )
    decode = load(
        decoded=80,
        output_tokens=8000,
        tokens=8000,
        tpot_s=400.0,
        kv_pulls=80,
        kv_s=8.0,
        decode_s=420.0,
    )
    f = r.figures_of(prefill, decode, decode_batch=32)
    assert f is not None
    assert f.ttft_bs == pytest.approx(0.5)  # 40 s over 80 prompts
    assert f.c_prefill == pytest.approx(4.0)  # 80 prompts in 20 busy seconds
    assert f.tpot_bs == pytest.approx(0.05)
    assert f.g == pytest.approx(100)
    assert f.xi == pytest.approx(0.1)
    assert f.t_d == pytest.approx(0.1 + 0.05 * 100)
    assert f.c_decode == pytest.approx(32 / 5.1)
    sig = r.signal_of(prefill, decode, slot_capacity_s=80.0, window_s=40.0)
    assert sig is not None
    assert sig.slots_held == pytest.approx(0.75)  # 60 slot-seconds of 80
    assert sig.t_p == pytest.approx(0.5)
    # TTFT, then the KV's wait for a decode (15 s over 80 prompts, less the pull the decode's
    # time holds: ξ 0.1 s), then the decode
    assert sig.e2e == pytest.approx(0.5 + (15 / 80 - 0.1) + 420 / 80)
    assert sig.rejected == pytest.approx(0.2)
    assert sig.kv_wait == pytest.approx(0.25)
    assert sig.served == pytest.approx(2.0)  # 80 finished in 40 s
    unknown = r.signal_of(prefill, decode)  # the window's length not known
    assert unknown is not None
    assert unknown.served == 0.0
    # too few requests through a role: nothing to say
    assert r.figures_of(prefill, load(), 32) is None
    assert r.signal_of(load(), decode) is None
    assert r.figures_of(prefill, decode, 32, least=81) is None
