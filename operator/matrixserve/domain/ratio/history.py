"""The load's history (pure): what a group measured and did under its current load, for both
policies — each split it served and what it served there, the role its last move added and the
reversals since — and the walk's two guards built on it: never to a split measured worse, at
most one reversal per load. Forgotten when the load changes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from matrixserve.api import zk_layout as zl
from matrixserve.api.status import HistoryStatus, MeasuredStatus, MixStatus, Split
from matrixserve.domain.ratio.feedback import SIGNIFICANT, Tally, compare
from matrixserve.domain.ratio.model import DECODE, PREFILL, BatchPoint, rounded
from matrixserve.domain.ratio.observe import Signal

# ------------------------------------------------------------------------- the load's history
# [design] the load changed: its prompts, its answers or their proportion (the P/D balance moves
# with it) this far from the load's running mean, for CHANGE_WINDOWS windows in a row; or the
# split it serves now finishing this much more or fewer requests per second than it was
# measured to (and CHANGE_SIGMAS standard deviations of the counts' Poisson noise), as long
MIX_CHANGE = 0.2
RATE_CHANGE = 0.15
CHANGE_SIGMAS = 3.0
CHANGE_WINDOWS = 2


@dataclass(frozen=True)
class Mix:
    """What a load's requests are, whatever the split: prompt and answer tokens per request."""

    prompt: float
    output: float

    def differs(self, other: Mix) -> bool:
        pairs = (
            (self.prompt, other.prompt),
            (self.output, other.output),
            (self.prompt / self.output, other.prompt / other.output),
        )
        return any(abs(a - b) > MIX_CHANGE * max(a, b) for a, b in pairs)

    def toward(self, other: Mix, weight: float) -> Mix:
        """A running mean: ``weight`` of the way to ``other``."""
        return Mix(
            self.prompt + weight * (other.prompt - self.prompt),
            self.output + weight * (other.output - self.output),
        )

    def __str__(self) -> str:
        return f"{self.prompt:.0f} tokens in, {self.output:.0f} out"


def mix_of(prefill: zl.Load, decode: zl.Load) -> Mix | None:
    if prefill.prefilled < 1 or decode.decoded < 1 or decode.output_tokens < 1:
        return None
    return Mix(prefill.prompt_tokens / prefill.prefilled, decode.output_tokens / decode.decoded)


@dataclass(frozen=True)
class Measured:
    """What a split served under the current load: its windows (:class:`Tally`), the decodes'
    mean batch and TPOT there (0: not known), and when it was last measured (the caller's
    clock)."""

    split: Split
    tally: Tally
    batch: float = 0.0
    tpot: float = 0.0
    at: float = 0.0

    @property
    def phi(self) -> float:
        """Requests finished per second per instance (0: not known)."""
        return self.tally.served / self.split.total

    def said(self) -> str:
        if self.tally.served > 0:
            return f"{self.tally.served:.3g} req/s (Φ {self.phi:.3g}) at {self.split}"
        return f"E2E {self.tally.mean_e2e:.3f} s at {self.split}"


def _move_role(old: Split, new: Split) -> str:
    """The role a move from ``old`` to ``new`` adds (a split of the same total)."""
    return PREFILL if new.prefill > old.prefill else DECODE


def _rate_moved(tally: Tally, signal: Signal) -> bool:
    """One window's requests per second against a split's measured ones: moved by
    ``RATE_CHANGE`` and ``CHANGE_SIGMAS`` standard deviations (both counts' Poisson noise)."""
    if tally.seconds <= 0 or signal.seconds <= 0 or tally.served <= 0:
        return False
    was, now = tally.served, signal.served
    noise = math.sqrt(tally.finished / tally.seconds**2 + signal.finished / signal.seconds**2)
    return abs(now - was) >= max(CHANGE_SIGMAS * noise, RATE_CHANGE * was)


@dataclass(frozen=True)
class History:
    """What a group measured and did under the current load, for both policies: each split it
    served at least a window and what it served there; the role its last move
    added and the reversals (a move against the one before it: a step past the best and
    back) since the load last changed. Kept in ``status.ratio``; forgotten when the load
    changes (its :class:`Mix`, or the rate the current split serves: ``CHANGE_WINDOWS``
    windows in a row) and by the caller on a new total; a measurement older than the caller's
    ``max_age`` is dropped."""

    mix: Mix | None = None  # the load's running mean
    measured: tuple[Measured, ...] = ()
    last_move: str | None = None
    reversals: int = 0
    last_reversal: bool = False  # the last move was a reversal (given back if it is abandoned)
    flap_said: bool = False  # the Warning of a held flap was said (once per load)
    drift: int = 0  # windows in a row whose mix differs from the running mean
    shift: int = 0  # windows in a row whose rate differs from the split's measured one

    def at(self, split: Split) -> Measured | None:
        return next((m for m in self.measured if m.split == split), None)

    def points(self, besides: Split) -> list[BatchPoint]:
        """The decodes' batch and TPOT measured at splits other than ``besides``."""
        return [
            BatchPoint(m.batch, m.tpot)
            for m in self.measured
            if m.split != besides and m.batch > 0 and m.tpot > 0
        ]

    def observe(
        self,
        split: Split,
        mix: Mix | None,
        signal: Signal | None,
        saturated: bool,
        point: BatchPoint | None,
        keep: int,
        now: float = 0.0,
        max_age: float = math.inf,
    ) -> History:
        """With one more window at ``split``: a changed load starts afresh (with this window);
        the split's figures are a mean of its last ``keep`` windows."""
        history = replace(self, measured=tuple(m for m in self.measured if now - m.at <= max_age))
        if mix is not None:
            known = history.mix
            if known is None:
                history = replace(history, mix=mix, drift=0)
            elif mix.differs(known):
                history = replace(history, drift=history.drift + 1)
            else:
                history = replace(history, mix=known.toward(mix, 1 / (keep + 1)), drift=0)
        here = history.at(split)
        if signal is not None and here is not None and here.tally.windows >= keep:
            moved = _rate_moved(here.tally, signal)
            history = replace(history, shift=history.shift + 1 if moved else 0)
        if history.drift >= CHANGE_WINDOWS or history.shift >= CHANGE_WINDOWS:
            history = History(mix=mix)
        if signal is None:
            return history
        old = history.at(split) or Measured(split, Tally())
        tally = old.tally.add(signal, saturated, keep)
        w = old.tally.windows
        batch, tpot = old.batch, old.tpot
        if point is not None and point.batch > 0 and point.tpot > 0:
            # a mean over the windows the tally holds (the old ones weigh as the tally does)
            batch = (old.batch * w + point.batch) / (w + 1) if old.batch else point.batch
            tpot = (old.tpot * w + point.tpot) / (w + 1) if old.tpot else point.tpot
        rest = tuple(m for m in history.measured if m.split != split)
        entry = Measured(split, tally, batch, tpot, now)
        return replace(
            history, measured=tuple(sorted((*rest, entry), key=lambda m: -m.split.prefill))
        )

    def _verdict(self, current: Split, candidate: Split, improve: float) -> tuple[int, str]:
        """+1 if ``candidate`` was measured better than ``current``, -1 worse, else 0. Saturated
        (either), by requests served per second: any difference of ``SIGNIFICANT`` standard
        deviations of the counts' noise (a measurement, unlike a move's first windows, is not
        asked to pay for a move: a split that served less is worse); else by E2E, by
        ``improve``."""
        here, there = self.at(current), self.at(candidate)
        if here is None or there is None:
            return 0, ""
        said = f"{there.said()} against {here.said()}"
        a, b = here.tally, there.tally
        if a.is_saturated or b.is_saturated:
            if min(a.served, b.served) <= 0:
                return 0, said
            noise = math.sqrt(a.finished / a.seconds**2 + b.finished / b.seconds**2)
            if abs(b.served - a.served) < SIGNIFICANT * noise:
                return 0, said
            return (1 if b.served > a.served else -1), said
        verdict, _ = compare(a, b, improve)
        return verdict, said

    def worse(self, current: Split, candidate: Split, improve: float) -> str | None:
        """Why ``candidate`` is not to be moved to, if both were measured and ``candidate``
        served worse than ``current``; else None."""
        verdict, figures = self._verdict(current, candidate, improve)
        return f"{candidate} was measured worse: {figures}" if verdict < 0 else None

    def better(self, current: Split, candidate: Split, improve: float) -> bool:
        """Both measured, and ``candidate`` served better than ``current``."""
        return self._verdict(current, candidate, improve)[0] > 0

    def move(
        self, current: Split, target: Split, better: bool = False
    ) -> tuple[History, str | None]:
        """The history with a move from ``current`` to ``target`` made, or itself and why not.
        A move against the last one (a reversal: a step back) is made only to a split measured
        ``better`` than ``current`` under this load — taking back a move that did not pay; and
        once the group has reversed (a step past the best and back), it makes no move but to
        such a split until the load changes: a policy that would keep walking is held, not
        left to flap."""
        role = _move_role(current, target)
        last = self.last_move
        reversal = last is not None and role != last
        if not better and last is not None and reversal:
            return self, (
                f"{target} would take back the last move (one more {last}) and was not "
                f"measured better than {current} under this load"
            )
        if not better and self.reversals >= 1:
            return self, (
                "the group has reversed once under this load (a step past the best and back); "
                f"it moves now only to a split measured better, and {target} was not"
            )
        moved = replace(
            self,
            last_move=role,
            reversals=self.reversals + int(reversal),
            last_reversal=reversal,
        )
        return moved, None

    def abandoned(self) -> History:
        """A move given up: no policy's reversal (what it counted is given back)."""
        return replace(
            self,
            last_move=None,
            reversals=self.reversals - int(self.last_reversal),
            last_reversal=False,
        )

    def to_status(self) -> HistoryStatus:
        mix = self.mix
        return HistoryStatus(
            mix=(
                MixStatus(prompt_tokens=rounded(mix.prompt), output_tokens=rounded(mix.output))
                if mix is not None
                else None
            ),
            measured=[
                MeasuredStatus(
                    split=m.split,
                    tally=m.tally.to_status(),
                    served=rounded(m.tally.served),
                    phi=rounded(m.phi),
                    e2e=rounded(m.tally.mean_e2e),
                    batch=rounded(m.batch),
                    tpot=rounded(m.tpot),
                    at=m.at,
                )
                for m in self.measured
            ],
            last_move=self.last_move,
            reversals=self.reversals,
            last_reversal=self.last_reversal,
            flap_said=self.flap_said,
            drift=self.drift,
            shift=self.shift,
        )

    @classmethod
    def from_status(cls, raw: HistoryStatus | Mapping[str, object] | None) -> History:
        """Read back what :meth:`to_status` wrote (or the stored form of it); what is
        unreadable is left out."""
        status = HistoryStatus.of(raw)
        if status is None:
            return cls()
        mix = None
        if status.mix is not None:
            prompt, output = status.mix.prompt_tokens, status.mix.output_tokens
            if prompt is not None and output is not None and prompt > 0 and output > 0:
                mix = Mix(prompt, output)
        measured: list[Measured] = []
        for item in status.measured or []:
            split = item.split
            if split is None or not split.whole:
                continue
            tally = Tally.from_status(item.tally)
            if not tally.windows or any(e.split == split for e in measured):
                continue
            batch, tpot = item.batch or 0.0, item.tpot or 0.0
            measured.append(Measured(split, tally, max(batch, 0.0), max(tpot, 0.0), item.at or 0.0))
        last_move = status.last_move
        return cls(
            mix=mix,
            measured=tuple(measured),
            last_move=last_move,
            reversals=status.reversals or 0,
            last_reversal=status.last_reversal is True and last_move is not None,
            flap_said=status.flap_said is True,
            drift=status.drift or 0,
            shift=status.shift or 0,
        )
