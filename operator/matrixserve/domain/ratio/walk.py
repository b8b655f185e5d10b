"""The walk (pure): from the serving split to a target, one change at a time — at most ``step``
instances (or the next rung of a ladder) per decision, and one instance per pass, releases and
additions alternating as the transition mode says (§3.3: a fixed total releases first, an
elastic one adds first)."""

from __future__ import annotations

from collections.abc import Iterable

from matrixserve.api.status import Split
from matrixserve.domain.ratio.model import DECODE, PREFILL, Bounds, Transition


# ------------------------------------------------------------------------------ execution
def toward(current: Split, target: Split, step: int, bounds: Bounds) -> Split:
    """At most ``step`` instances of the way from ``current`` to ``target`` (one change: a
    policy moves the split this far, then observes again). With a ladder, the next rung on the
    way (a split between two rungs is not allowed); a split outside the bounds is never
    returned (``current`` if nothing on the way is allowed)."""
    if current == target or current.total != target.total:
        return target
    sign = 1 if target.prefill > current.prefill else -1
    ahead = [
        s
        for s in bounds.splits(target.total)
        if 0 < (s.prefill - current.prefill) * sign <= abs(target.prefill - current.prefill)
    ]
    if not ahead:
        return current
    if bounds.ladder:
        return min(ahead, key=lambda s: abs(s.prefill - current.prefill))
    within = [s for s in ahead if abs(s.prefill - current.prefill) <= step]
    if not within:
        return min(ahead, key=lambda s: abs(s.prefill - current.prefill))
    return max(within, key=lambda s: abs(s.prefill - current.prefill))


def next_step(current: Split, target: Split, transition: Transition) -> Split:
    """The next split on the way from ``current`` to ``target``, one instance at a time,
    releases and additions alternating: ``FixedTotal`` releases first (an instance of a role
    that has too many) whenever the group is not below the target's total, so it never holds
    more than the larger of the two totals; ``Elastic`` adds first whenever it is not above it,
    so it never holds fewer than the smaller. ``current`` when there. Of two roles to add (or
    release), the one further from its target goes first, prefill on a tie."""
    if current == target:
        return current
    excess = {PREFILL: current.prefill - target.prefill, DECODE: current.decode - target.decode}
    release = [r for r in (PREFILL, DECODE) if excess[r] > 0]
    add = [r for r in (PREFILL, DECODE) if excess[r] < 0]
    if transition is Transition.FIXED_TOTAL:
        releasing = bool(release) and (current.total >= target.total or not add)
    else:
        releasing = not add or (current.total > target.total and bool(release))
    if releasing:
        role, step = max(release, key=lambda r: excess[r]), -1
    else:
        role, step = min(add, key=lambda r: excess[r]), 1
    if role == PREFILL:
        return Split(current.prefill + step, current.decode)
    return Split(current.prefill, current.decode + step)


def parse_ladder(items: Iterable[str]) -> tuple[Split, ...]:
    """A ladder's ``"P:D"`` rungs, or ValueError naming the first bad one."""
    return tuple(Split.parse(item) for item in items)
