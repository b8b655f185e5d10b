"""The Feedback policy (pure): §3.3's rule over a stream of windows — an alarm that holds for a
trend of windows moves one instance; the move is judged on the windows after it against those
before it (:func:`compare`), and kept, taken further, or taken back. What it remembers between
windows is :class:`FeedbackState`, kept in the group's status."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from matrixserve.api.status import FeedbackStatus, Split, TallyStatus
from matrixserve.domain.ratio.model import (
    DECODE,
    PREFILL,
    Bounds,
    Decision,
    fallback_split,
    rounded,
)
from matrixserve.domain.ratio.observe import Signal


@dataclass(frozen=True)
class FeedbackParams:
    """The feedback rule's knobs (``[design]``: the paper gives none)."""

    e2e_rise: float = 0.2  # "E2E increases dramatically": this fraction over its baseline
    share_delta: float = 0.05  # T_p/E2E moved by this much (absolute) from its baseline
    rejection: float = 0.05  # this fraction of offers refused is an alarm by itself: for ...
    kv_wait: float = 0.4  # ... decode if the prefills' slots waited this much for decodes
    slots_full: float = 0.9  # the prefills' slots held this much, not waiting: a prefill alarm
    windows: int = 3  # an alarm must hold this many windows in a row (the trend)
    # after a move, this much better (served if saturated, else E2E): another the same way;
    # this much worse (saturated: or served less within the noise, still saturated): back
    improve: float = 0.05
    cooldown: float = 300.0  # seconds between two changes


@dataclass(frozen=True)
class Tally:
    """Windows summed, so that a move is judged on their means and not on one window's noise:
    E2E (the windows' means summed), the requests finished and the seconds they took, and how
    many windows found the group saturated."""

    windows: int = 0
    e2e: float = 0.0
    finished: float = 0.0
    seconds: float = 0.0
    saturated: float = 0.0

    def add(self, signal: Signal, saturated: bool, keep: int) -> Tally:
        """With one more window, as a mean of at most the last ``keep`` windows' worth (an
        alarm that lasts through a cooldown is judged on its recent windows, not all of it)."""
        more = Tally(
            self.windows + 1,
            self.e2e + signal.e2e,
            self.finished + signal.finished,
            self.seconds + signal.seconds,
            self.saturated + float(saturated),
        )
        if more.windows <= keep:
            return more
        f = keep / more.windows
        return Tally(keep, more.e2e * f, more.finished * f, more.seconds * f, more.saturated * f)

    @property
    def mean_e2e(self) -> float:
        return self.e2e / self.windows if self.windows else 0.0

    @property
    def served(self) -> float:
        """Requests finished per second (0: not known)."""
        return self.finished / self.seconds if self.seconds > 0 else 0.0

    @property
    def is_saturated(self) -> bool:
        """Saturated in most of its windows."""
        return 2 * self.saturated > self.windows

    def to_status(self) -> TallyStatus:
        return TallyStatus(
            windows=self.windows,
            e2e=self.e2e,
            finished=self.finished,
            seconds=self.seconds,
            saturated=self.saturated,
        )

    @classmethod
    def from_status(cls, raw: TallyStatus | None) -> Tally:
        """Read back what :meth:`to_status` wrote; anything unreadable is no windows."""
        if raw is None:
            return cls()
        windows = raw.windows or 0
        sums = [raw.e2e, raw.finished, raw.seconds, raw.saturated]
        if not windows or any(v is None or v < 0 for v in sums):
            return cls()
        e2e, finished, seconds, saturated = (float(v or 0.0) for v in sums)
        return cls(windows, e2e, finished, seconds, min(saturated, float(windows)))


# a difference in requests served per second counts only this many standard deviations out
# (the counts' Poisson noise: two windows of 20 requests cannot tell 5 %)
SIGNIFICANT = 2.0


def compare(before: Tally, after: Tally, improve: float) -> tuple[int, str]:
    """+1 if ``after`` is better than ``before`` by ``improve``, -1 if worse by as much, else 0;
    and the figures that say so. A saturated group (its prefills' slots full, or refusing)
    has a backlog the engines do not see — a closed load's clients, the gateway's queue, offers
    tried again — whose wait the engines' E2E does not hold, so it is judged by what it
    serves per second (Little's law: the same backlog served faster waits less): better or
    worse by a difference that is both ``improve`` and ``SIGNIFICANT`` standard deviations of
    the counts' Poisson noise; without one, worse if it served less and is still saturated.
    Unsaturated before and after (the load is served either way), by E2E."""
    if (before.is_saturated or after.is_saturated) and min(before.served, after.served) > 0:
        b, a = before.served, after.served
        noise = math.sqrt(before.finished / before.seconds**2 + after.finished / after.seconds**2)
        served = f"served {b:.3g} requests/s before, {a:.3g} after (saturated)"
        if abs(a - b) >= SIGNIFICANT * noise:
            if a >= b * (1 + improve):
                return 1, served
            if a <= b * (1 - improve):
                return -1, served
        # no clear difference. Not judged by E2E: saturated, the engines' E2E holds the wait
        # in the prefills' slots (a decode-short split) but not the one at the gateway (a
        # prefill-short one), so it prefers the prefill-short split whatever each serves.
        # A move whose windows served less, still saturated, is not kept (the step back costs
        # the walk's one reversal, no more); one that served as much or more, or ended the
        # saturation (the load is served now), is.
        if a < b and after.is_saturated:
            return -1, f"{served}: less, within the noise"
        return 0, f"{served}: no less, within the noise"
    b, a = before.mean_e2e, after.mean_e2e
    said = f"E2E {b:.3f} s before, {a:.3f} s after"
    if b <= 0:
        return 0, said
    if a <= b * (1 - improve):
        return 1, said
    if a >= b * (1 + improve):
        return -1, said
    return 0, said


@dataclass(frozen=True)
class FeedbackState:
    """What the rule remembers between windows (kept in the group's status)."""

    baseline_e2e: float | None = None
    baseline_share: float | None = None
    alarm: str | None = None  # the role the current alarm asks for
    trend: Tally = Tally()  # the windows in a row with that alarm
    last_change: float | None = None  # when the split last changed (the caller's clock)
    moving: str | None = None  # the role the last move added, while its effect is judged
    before: Tally | None = None  # the windows that move is judged against
    # the roles whose move made things worse (taken back): the saturation alarms (refusals,
    # slots) no longer ask for them — a group past its capacity refuses at every
    # split, a closed load fills the slots at every split — until the load changes: a rise of
    # E2E, a new total, or ``windows`` windows in a row without saturation (``calm``)
    refuted: tuple[str, ...] = ()
    calm: int = 0
    # after a move: the windows judged so far (judged once there are ``windows`` of them: one
    # window's noise neither takes a move back nor sends it further)
    judged: Tally = Tally()

    @property
    def streak(self) -> int:
        return self.trend.windows

    def to_status(self) -> FeedbackStatus:
        return FeedbackStatus(
            baseline_e2e=self.baseline_e2e,
            baseline_share=self.baseline_share,
            alarm=self.alarm,
            streak=self.streak,
            trend=self.trend.to_status(),
            last_change=self.last_change,
            moving=self.moving,
            before=self.before.to_status() if self.before is not None else None,
            refuted=list(self.refuted),
            calm=self.calm,
            judged=self.judged.to_status(),
        )

    @classmethod
    def from_status(cls, raw: FeedbackStatus | Mapping[str, object] | None) -> FeedbackState:
        """Read back what :meth:`to_status` wrote (or the stored form of it); anything
        unreadable starts afresh (a status of an earlier operator with a move being judged:
        that move is kept, not judged)."""
        status = FeedbackStatus.of(raw)
        if status is None:
            return cls()
        before = Tally.from_status(status.before)
        moving = status.moving
        roles = status.refuted or []
        return cls(
            baseline_e2e=status.baseline_e2e,
            baseline_share=status.baseline_share,
            alarm=status.alarm,
            trend=Tally.from_status(status.trend),
            last_change=status.last_change,
            # a move is judged only against what asked for it
            moving=moving if before.windows else None,
            before=before if before.windows and moving else None,
            refuted=tuple(sorted({r for r in (PREFILL, DECODE) if r in roles})),
            calm=status.calm or 0,
            judged=Tally.from_status(status.judged),
        )


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def moved(split: Split, role: str, total: int) -> Split:
    """``split`` with one instance more of ``role`` in a group of ``total`` (fixed total: one
    fewer of the other; a total grown or shrunk meanwhile is met by the other role)."""
    p = split.prefill + (1 if role == PREFILL else 0)
    d = split.decode + (1 if role == DECODE else 0)
    if role == PREFILL:
        d = total - p
    else:
        p = total - d
    return Split(p, d)


class Feedback:
    """The §3.3 rule over a stream of windows (pure: state in, decision and state out)."""

    def __init__(self, params: FeedbackParams, bounds: Bounds) -> None:
        self.params = params
        self.bounds = bounds

    def decide(
        self, state: FeedbackState, signal: Signal, current: Split, total: int, now: float
    ) -> tuple[Decision, FeedbackState]:
        p = self.params
        numbers = {
            "E2E": rounded(signal.e2e),
            "Tp": rounded(signal.t_p),
            "TpShare": rounded(signal.prefill_share),
            "rejected": rounded(signal.rejected),
            "served": rounded(signal.served),
        }
        if current.total != total or not self.bounds.allows(current):
            # the total changed (a scale of the group) or the split is out of bounds: the
            # split of the new total nearest the current ratio, and a fresh baseline after it
            target = fallback_split(total, self.bounds, current)
            return (
                Decision(target, target != current, f"the total is {total}: {target}", numbers),
                replace(FeedbackState(), last_change=now if target != current else None),
            )
        cooling = state.last_change is not None and now - state.last_change < p.cooldown
        saturated = self.saturated(signal)
        # after a move: judged once the cooldown is over (the figures have settled), on as many
        # windows as an alarm's trend
        if state.moving is not None and state.before is not None:
            if cooling:
                return Decision(current, False, "cooling down after a move", numbers), state
            judged = state.judged.add(signal, saturated, p.windows)
            if judged.windows < p.windows:
                why = f"judging one more {state.moving} ({judged.windows}/{p.windows} windows)"
                return Decision(current, False, why, numbers), replace(state, judged=judged)
            return self._judge(
                state.moving, state.before, state, judged, signal, current, total, now, numbers
            )

        # the saturation gone for a trend's windows: the load changed, nothing stays refuted
        calm = 0 if saturated else state.calm + 1
        refuted = () if calm >= p.windows else state.refuted
        state = replace(state, calm=calm, refuted=refuted)
        if state.baseline_e2e is None or state.baseline_share is None:
            fresh = replace(
                state,
                baseline_e2e=signal.e2e,
                baseline_share=signal.prefill_share,
                trend=Tally(),
            )
            return Decision(current, False, "baseline taken", numbers), fresh

        alarm, why, rise = self._alarm(state.baseline_e2e, state.baseline_share, refuted, signal)
        # the alarm's windows in a row: this one added to the last ones if it asks the same
        trend = Tally()
        if alarm is not None:
            since = state.trend if alarm == state.alarm else Tally()
            trend = since.add(signal, saturated, p.windows)
        # E2E lower than the baseline: the baseline follows it down (a later rise is measured
        # from the best the group has done since it settled)
        baseline = min(state.baseline_e2e, signal.e2e)
        state = replace(state, alarm=alarm, trend=trend, baseline_e2e=baseline)
        if alarm is None:
            return Decision(current, False, "no alarm", numbers), state
        streak = trend.windows
        numbers = {**numbers, "baselineE2E": rounded(baseline), "streak": float(streak)}
        if streak < p.windows:
            return Decision(current, False, f"{why} ({streak}/{p.windows} windows)", numbers), state
        if cooling:
            return Decision(current, False, f"{why}; cooling down", numbers), state
        target = moved(current, alarm, total)
        if not self.bounds.allows(target):
            return Decision(current, False, f"{why}; {target} is out of bounds", numbers), state
        after = FeedbackState(
            last_change=now,
            moving=alarm,
            before=trend,
            # a rise of E2E is a change of the load: what did not pay before may now
            refuted=() if rise else refuted,
        )
        return Decision(target, True, f"{why}: one more {alarm}", numbers), after

    def saturated(self, signal: Signal) -> bool:
        """The prefills' slots full or refusing: a backlog waits where the engines cannot see
        it (the gateway's queue, a closed load's clients, offers tried again)."""
        p = self.params
        return signal.slots_held >= p.slots_full or signal.rejected >= p.rejection

    def _alarm(
        self, base_e2e: float, base: float, refuted: tuple[str, ...], signal: Signal
    ) -> tuple[str | None, str, bool]:
        """The role the window asks for, why, and whether it is a rise of E2E (§3.3's own
        trigger) rather than a saturation alarm."""
        p = self.params
        waiting = f"slots held by KV waiting for a decode {signal.kv_wait:.0%} of the time"
        # the slots wait for decodes (kvWait of their time): the decodes are short; they
        # compute (waiting less than half of that): the prefills are; in between, neither —
        # a gap, so that the two alarms do not take turns about one threshold
        short = (
            DECODE
            if signal.kv_wait >= p.kv_wait
            else PREFILL
            if signal.kv_wait < p.kv_wait / 2
            else None
        )
        if signal.rejected >= p.rejection:
            if short is not None and short not in refuted:
                refused = f"prefills refused {signal.rejected:.0%} of offers"
                return short, f"{refused}, their {waiting}", False
        elif short == DECODE:
            # §4.2: "some KVCaches wait in prefill for idle decoding" — the decodes are short
            # whether or not the prefills have had to refuse yet (a closed load, spare slots)
            if DECODE not in refuted:
                return DECODE, f"the prefills' {waiting}", False
        elif short == PREFILL and signal.slots_held >= p.slots_full and PREFILL not in refuted:
            # full, and computing (not waiting for decodes): the prefills are short, the
            # requests wait at the gateway for a slot
            return (
                PREFILL,
                f"the prefills' slots held {signal.slots_held:.0%} of the time, "
                f"{1 - signal.kv_wait:.0%} of it prefilling",
                False,
            )
        if signal.e2e < base_e2e * (1 + p.e2e_rise):
            return None, "", False
        rise = f"E2E rose from {base_e2e:.3f} s to {signal.e2e:.3f} s"
        share = signal.prefill_share
        if share >= base + p.share_delta:
            return PREFILL, f"{rise} and T_p/E2E from {base:.2f} to {share:.2f}", True
        if share <= base - p.share_delta:
            return DECODE, f"{rise} and T_p/E2E fell from {base:.2f} to {share:.2f}", True
        return None, "", False

    def _judge(
        self,
        role: str,
        before: Tally,
        state: FeedbackState,
        after: Tally,
        signal: Signal,
        current: Split,
        total: int,
        now: float,
        numbers: dict[str, float],
    ) -> tuple[Decision, FeedbackState]:
        """The last move's effect, the windows after it against those it is judged against
        (:func:`compare`): better -> one more the same way (if allowed); worse -> one back, its
        role refuted, then settled (a move that did not pay is not kept); neither -> settled.
        Settling takes the last window's figures as the new baseline."""
        verdict, figures = compare(before, after, self.params.improve)
        numbers = {
            **numbers,
            "E2EBeforeMove": rounded(before.mean_e2e),
            "E2EAfterMove": rounded(after.mean_e2e),
            "servedBeforeMove": rounded(before.served),
            "servedAfterMove": rounded(after.served),
        }
        settled = FeedbackState(
            baseline_e2e=signal.e2e,
            baseline_share=signal.prefill_share,
            last_change=state.last_change,
            refuted=state.refuted,
        )
        target = moved(current, role if verdict > 0 else _other(role), total)
        if verdict > 0:
            if self.bounds.allows(target):
                why = f"one more {role} paid ({figures}): one more {role}"
                return Decision(target, True, why, numbers), FeedbackState(
                    last_change=now, moving=role, before=after, refuted=state.refuted
                )
            why = f"one more {role} paid ({figures}); {target} is out of bounds: settled"
            return Decision(current, False, why, numbers), settled
        if verdict < 0:
            # worse: not kept, and refuted (the saturation alarms no longer ask for it)
            refuted = replace(settled, refuted=tuple(sorted({*state.refuted, role})))
            if self.bounds.allows(target):
                why = f"one more {role} made it worse ({figures}): moved back"
                # settled after the step back: its figures are the next baseline
                return Decision(target, True, why, numbers, measured_better=True), replace(
                    refuted, baseline_e2e=None, baseline_share=None, last_change=now
                )
            why = f"one more {role} made it worse ({figures}); {target} is out of bounds"
            return Decision(current, False, why, numbers), refuted
        # no better, no worse: kept; an alarm that still holds asks again after a new trend
        why = f"one more {role}: no better, no worse ({figures}): settled"
        return Decision(current, False, why, numbers), settled
