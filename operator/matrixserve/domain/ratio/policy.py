"""The policies' decisions on a window (pure). Model: Eq. (1)'s target
(:func:`~matrixserve.domain.ratio.model.model_target`), walked at most ``step`` instances per
change, one change a cooldown, and not straight back to the split it just left unless the figures
say so by a wide margin (its capacities are estimates). Feedback: the §3.3 rule
(:class:`~matrixserve.domain.ratio.feedback.Feedback`). A decision takes what the window observed
(:class:`Window`) and what the group remembers of its moves (:class:`RatioMemory`); the stage
that runs it (:mod:`matrixserve.domain.pdgroup.split`) keeps both in the group's status."""

from __future__ import annotations

from dataclasses import dataclass

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import RatioMode, RatioPolicy
from matrixserve.api.status import Split
from matrixserve.domain.ratio.feedback import Feedback, FeedbackParams, FeedbackState
from matrixserve.domain.ratio.model import DECODE, PREFILL, Bounds, Decision, Figures, model_target
from matrixserve.domain.ratio.observe import Signal
from matrixserve.domain.ratio.walk import toward

# A window's figures need this many requests through each role (fewer say nothing).
LEAST_REQUESTS = 5
# [design] Model goes back to the split it just left only for this many times its margin, within
# this many cooldowns of leaving it.
RETURN_MARGINS = 3
RETURN_COOLDOWNS = 3


@dataclass(frozen=True)
class Window:
    """What one window of a steady group observed, at its end (``now``): the split that served
    through it and the group's total, what each role served (the difference of its counters),
    and each policy's inputs from that (None: too few requests)."""

    serving: Split
    total: int
    prefill: zl.Load
    decode: zl.Load
    figures: Figures | None
    signal: Signal | None
    now: float


@dataclass(frozen=True)
class RatioMemory:
    """What the group remembers of its moves: the feedback rule's state, when the split last
    changed or arrived (``since``: the later; cooldowns count from it), and the split the last
    move left (``left``)."""

    feedback: FeedbackState
    since: float | None = None
    left: Split | None = None


def feedback_params(rp: RatioPolicy) -> FeedbackParams:
    """The feedback rule's knobs as the spec tunes them."""
    tuning = rp.feedback
    return FeedbackParams(
        e2e_rise=tuning.e2e_rise,
        share_delta=tuning.tp_share_delta,
        rejection=tuning.rejection,
        kv_wait=tuning.kv_wait,
        slots_full=tuning.slots_full,
        windows=tuning.windows,
        improve=tuning.improve,
        cooldown=float(rp.cooldown_seconds),
    )


def decide(
    rp: RatioPolicy, bounds: Bounds, window: Window, memory: RatioMemory
) -> tuple[Decision, FeedbackState] | None:
    """The policy's decision on a window, or None when the window says too little. Model goes
    back to ``memory.left`` within ``RETURN_COOLDOWNS`` cooldowns only for ``RETURN_MARGINS``
    times its margin."""
    serving, now, feedback = window.serving, window.now, memory.feedback
    if rp.mode is RatioMode.MODEL:
        if window.figures is None:
            return (
                Decision(
                    serving,
                    False,
                    f"too few requests in the window ({window.prefill.prefilled} prefilled, "
                    f"{window.decode.decoded} decoded; {LEAST_REQUESTS} each needed)",
                ),
                feedback,
            )
        decision = model_target(window.figures, window.total, bounds, serving, rp.margin)
        if not decision.changed:
            return decision, feedback
        since = memory.since
        if since is not None and now - since < rp.cooldown_seconds:
            return Decision(
                serving, False, f"{decision.reason}; cooling down", decision.numbers
            ), feedback
        step = toward(serving, decision.target, rp.step, bounds)
        recent = since is not None and (now - since < RETURN_COOLDOWNS * rp.cooldown_seconds)
        now_cap = float(decision.numbers.get("capacityNow") or 0.0)
        best_cap = float(decision.numbers.get("capacityTarget") or 0.0)
        left = memory.left
        if step == left and recent and best_cap <= now_cap * (1 + RETURN_MARGINS * rp.margin):
            why = (
                f"{decision.reason}; not back to {left}, left less than "
                f"{RETURN_COOLDOWNS} cooldowns ago, for less than {RETURN_MARGINS * rp.margin:.0%}"
            )
            return Decision(serving, False, why, decision.numbers), feedback
        return Decision(step, step != serving, decision.reason, decision.numbers), feedback
    if window.signal is None:
        return None
    rule = Feedback(feedback_params(rp), bounds)
    return rule.decide(feedback, window.signal, serving, window.total, now)


def held(state: FeedbackState, serving: Split, target: Split, now: float) -> FeedbackState:
    """The feedback rule after the walk held a move that would flap: settled where it is, the
    role it asked for refuted (the saturation alarms no longer ask for it until the load
    changes), a fresh baseline and a cooldown."""
    role = PREFILL if target.prefill > serving.prefill else DECODE
    return FeedbackState(last_change=now, refuted=tuple(sorted({*state.refuted, role})))
