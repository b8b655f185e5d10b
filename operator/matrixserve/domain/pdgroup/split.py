"""The P/D ratio policy in a group's plan: the plan's ``ratio`` seam (pure).

Under ``Fixed`` the spec's replicas are the counts. Under ``Model`` and ``Feedback`` the
replicas set the **total** and the policy splits it (P/D-Serve §2.1, §3.3;
:mod:`matrixserve.domain.ratio`):

1. **Observation**: each engine's health report carries what it has served since its process
   started (``zl.Load``). A window starts with the serving members' counters summed per role
   (and each member's incarnation) in ``status.ratio.window``; after ``windowSeconds`` the
   difference is the window's figures (Model: §2.1's inputs; Feedback: E2E, T_p, refusals). A
   member that came, went or restarted meanwhile starts a new window (its counters are another
   process's), as does a group that is not steady: figures from the middle of a move, or of a
   recovery, say nothing about a split.
2. **Decision**, at the end of a window of a steady group (Ready, ZooKeeper connected, no
   recovery under way, the target reached): the policy's target split, its reason and numbers.
   Model moves at most ``step`` instances per change and waits ``cooldownSeconds`` between
   changes (so does Feedback, by its own rule). A change is said once, as an Event ("Moving one
   instance from decode to prefill: ..."), and dated (``lastChangeTime``).
3. **Walk**: this pass's counts, one instance at a time from the serving split toward the
   target (``transition``), counted from the map's serving members: under ``FixedTotal`` the
   instance of the other role is added only once the released one has left the map, under
   ``Elastic`` one is released only once the added one serves. A group that is not steady holds
   its last counts (recovery owns its instances then). A new total (the spec's replicas or the
   scale subresource changed) is split at once and obtained at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import RatioMode
from matrixserve.api.status import RatioStatus, RatioWindow, Split
from matrixserve.domain import ratio
from matrixserve.domain.pdgroup import recovery
from matrixserve.domain.pdgroup.actions import Action, ReportRatioChange
from matrixserve.domain.pdgroup.membership import DRAIN_SECONDS, RoleCounts
from matrixserve.domain.pdgroup.validation import model_facts, ratio_bounds
from matrixserve.domain.pdgroup.view import GroupView

# [design] A move that has not arrived after this long is given up (back to the split it left):
# a drain's bound, and as long again for the new instance to start.
WALK_SECONDS = 2 * DRAIN_SECONDS
# [design] what a split served is remembered this many windows (or cooldowns, the longer) at most
MEMORY_WINDOWS = 20


@dataclass(frozen=True)
class RatioPass:
    """This pass's counts, ``status.ratio``, and the Event of a change (if one was decided)."""

    counts: RoleCounts
    status: RatioStatus
    notices: list[Action] = field(default_factory=list)


def serving_split(view: GroupView) -> Split | None:
    """The map's members that serve now, per role; None before the group has a map (or while
    a role has none serving)."""
    roce_map = view.zk.roce_map
    if roce_map is None:
        return None

    def serving(entries: list[zl.MapEntry]) -> int:
        return sum(
            1 for e in entries if e.instance not in view.zk.removed and view.healthy(e.instance)
        )

    p, d = serving(roce_map.prefill), serving(roce_map.decode)
    return Split(p, d) if p and d else None


def steady(view: GroupView) -> bool:
    """Ready, ZooKeeper connected, no recovery under way, every member of the map serving."""
    roce_map = view.zk.roce_map
    return (
        view.zk.connected
        and roce_map is not None
        and view.previous.is_true("Ready")
        and not recovery.records(view)
        and all(view.healthy(e.instance) for e in [*roce_map.prefill, *roce_map.decode])
        and not any(e.instance in view.zk.removed for e in [*roce_map.prefill, *roce_map.decode])
    )


def _whole(split: Split | None) -> Split | None:
    """A split a policy may have targeted (each role an instance), else None."""
    return split if split is not None and split.whole else None


def _members(view: GroupView) -> dict[str, str]:
    """The serving members with a load report: instance -> incarnation."""
    roce_map = view.zk.roce_map
    if roce_map is None:
        return {}
    out = {}
    for e in [*roce_map.prefill, *roce_map.decode]:
        health = view.zk.health.get(e.instance)
        if health is not None and health.load is not None and view.healthy(e.instance):
            out[e.instance] = health.incarnation
    return out


def _member_list(members: Mapping[str, str]) -> list[str]:
    return [f"{name}@{incarnation}" for name, incarnation in sorted(members.items())]


def _sums(view: GroupView, members: Mapping[str, str]) -> tuple[zl.Load, zl.Load]:
    def loads(role: zl.Role) -> list[zl.Load]:
        out = []
        for name in members:
            health = view.zk.health[name]
            if health.role is role and health.load is not None:
                out.append(health.load)
        return out

    return ratio.load_sum(loads(zl.Role.PREFILL)), ratio.load_sum(loads(zl.Role.DECODE))


def _window(view: GroupView, members: Mapping[str, str]) -> RatioWindow:
    prefill, decode = _sums(view, members)
    return RatioWindow(
        start=view.now,
        # a list (a merge patch replaces it whole; a map would keep a member that left)
        members=_member_list(members),
        prefill=prefill,
        decode=decode,
    )


def _window_end(
    view: GroupView, window: RatioWindow, members: Mapping[str, str]
) -> tuple[zl.Load, zl.Load] | None:
    """What the prefills and the decodes served over the window (its start's counters against
    now's, the same members); None if the start is unreadable or a counter went back."""
    p0, d0 = window.prefill, window.decode
    if p0 is None or d0 is None:
        return None
    p1, d1 = _sums(view, members)
    dp, dd = ratio.load_delta(p0, p1), ratio.load_delta(d0, d1)
    return (dp, dd) if dp is not None and dd is not None else None


def _moving(old: Split, new: Split) -> str:
    if old.total != new.total:
        return f"Splitting the total of {new.total} as {new}"
    k = abs(new.prefill - old.prefill)
    donor, receiver = ("decode", "prefill") if new.prefill > old.prefill else ("prefill", "decode")
    what = "one instance" if k == 1 else f"{k} instances"
    return f"Moving {what} from {donor} to {receiver} ({old} -> {new})"


def ratio_pass(view: GroupView) -> RatioPass:
    spec = view.spec
    rp = spec.ratio_policy
    spec_split = Split(spec.prefill.replicas, spec.decode.replicas)
    if not rp.total_driven:
        return RatioPass(
            RoleCounts(spec_split.prefill, spec_split.decode),
            RatioStatus(
                target=spec_split, policy=rp.mode, reason="Fixed policy: the spec's replicas"
            ),
        )
    said = view.previous.ratio or RatioStatus()
    # what the status says under another policy is not this one's
    prev = said if said.policy == rp.mode else RatioStatus()
    total = spec_split.total
    bounds = ratio_bounds(spec)
    serving = serving_split(view)
    is_steady = steady(view)
    target = _whole(prev.target)
    last_change = prev.last_change_time
    reason = prev.reason or ""
    numbers: dict[str, float] = dict(prev.numbers or {})
    feedback = ratio.FeedbackState.from_status(prev.feedback)
    notices: list[Action] = []
    old_target = target
    left = _whole(prev.from_)  # the split the last move left
    reached = prev.reached_time
    history = ratio.History.from_status(prev.history)

    # the target: kept while it is a split of the total within the bounds
    if target is None or target.total != total or not bounds.allows(target):
        base = serving or target or spec_split
        target = ratio.fallback_split(total, bounds, base) if bounds.splits(total) else spec_split
        if old_target is None:
            reason = f"{rp.mode} policy: starting from {target}"
        else:
            reason = f"the total is {total}: {target}, the split nearest {base}"
            last_change, left, reached = view.now, None, None
            # the feedback rule judges splits of one total: a new total starts it afresh, and
            # what was measured and moved for the old total says nothing of the new one
            feedback = ratio.FeedbackState(last_change=view.now)
            history = ratio.History()
    elif (
        serving is not None
        and serving != target
        and last_change is not None
        and reached is None
        and view.now - last_change > WALK_SECONDS
    ):
        # a move that did not arrive (its new instance never serves: unschedulable, crashing)
        # is given up: back to the split it left, known to run
        back = left if left is not None and left.total == total and bounds.allows(left) else None
        back = back or ratio.fallback_split(total, bounds, serving)
        notices.append(
            ReportRatioChange(
                f"Giving up the move to {target} after {WALK_SECONDS:.0f} s (serving "
                f"{serving}): back to {back}",
                reason="RatioMoveAbandoned",
                warning=True,
            )
        )
        reason = f"the move to {target} did not arrive within {WALK_SECONDS:.0f} s: back to {back}"
        target, last_change, left = back, view.now, None
        feedback = ratio.FeedbackState(last_change=view.now)
        # giving up is not a policy's reversal: the next move is counted afresh
        history = history.abandoned()
    if (
        serving is not None
        and serving == target
        and last_change is not None
        and (reached is None or reached < last_change)
    ):
        # arrived: the cooldown counts from here (a drain and a start can outlast it)
        reached = view.now
        if feedback.last_change is not None:
            feedback = replace(feedback, last_change=view.now)

    # the window, and a decision at its end
    members = _members(view)
    window = prev.window
    # the figures of the last window that gave some, until another does
    capacity = RatioStatus(
        phi=prev.phi,
        prefill_capacity=prev.prefill_capacity,
        decode_capacity=prev.decode_capacity,
        bottleneck=prev.bottleneck,
    )
    if (
        not is_steady
        or serving != target
        or window is None
        or window.members != _member_list(members)
    ):
        window = _window(view, members)
    elif view.now - (window.start or 0.0) >= rp.window_seconds:
        observed = _window_end(view, window, members)
        if observed is not None:
            dp, dd = observed
            # the prefills' slot capacity over the window, in emulated seconds
            emulated = (view.now - (window.start or 0.0)) * float(view.engine.time_scale)
            capacity_s = emulated * serving.prefill * spec.prefill.batch_size
            params = ratio.feedback_params(rp)
            signal = ratio.signal_of(dp, dd, ratio.LEAST_REQUESTS, capacity_s, emulated)
            saturated = signal is not None and ratio.Feedback(params, bounds).saturated(signal)
            history = history.observe(
                serving,
                ratio.mix_of(dp, dd)
                if min(dp.prefilled, dd.decoded) >= ratio.LEAST_REQUESTS
                else None,
                signal,
                saturated,
                ratio.batch_point(dd),
                params.windows,
                now=view.now,
                max_age=MEMORY_WINDOWS * max(rp.window_seconds, rp.cooldown_seconds),
            )
            facts = model_facts(spec)
            figures = ratio.figures_of(
                dp,
                dd,
                spec.decode.batch_size,
                ratio.LEAST_REQUESTS,
                kv_share=facts.kv_bytes_per_token / facts.weight_bytes if facts else None,
                others=history.points(besides=serving),
            )
            if figures is not None:
                capacity = ratio.capacity(figures, serving).as_status()
            since = max((t for t in (last_change, reached) if t is not None), default=None)
            decided = ratio.decide(
                rp,
                bounds,
                ratio.Window(serving, total, dp, dd, figures, signal, view.now),
                ratio.RatioMemory(feedback, since, left),
            )
            if decided is not None:
                decision, feedback = decided
                numbers = dict(decision.numbers)
                reason = decision.reason
                if decision.changed and decision.target != target:
                    # the walk's two guards, for both policies: never to a split
                    # measured worse under this load; at most one reversal per load
                    improve = rp.margin if rp.mode is RatioMode.MODEL else params.improve
                    worse = history.worse(serving, decision.target, improve)
                    better = decision.measured_better or history.better(
                        serving, decision.target, improve
                    )
                    history, refusal = (
                        (history, None) if worse else history.move(serving, decision.target, better)
                    )
                    if worse is not None:
                        reason = f"{decision.reason}; not moved: {worse}"
                        if rp.mode is RatioMode.FEEDBACK:
                            feedback = ratio.held(feedback, serving, decision.target, view.now)
                    elif refusal is not None:
                        reason = f"{decision.reason}; held at {serving}: {refusal}"
                        if not history.flap_said:
                            notices.append(
                                ReportRatioChange(
                                    f"Holding {serving}: {rp.mode} would move to "
                                    f"{decision.target}, {refusal}",
                                    reason="RatioFlapPrevented",
                                    warning=True,
                                )
                            )
                            history = replace(history, flap_said=True)
                        if rp.mode is RatioMode.FEEDBACK:
                            feedback = ratio.held(feedback, serving, decision.target, view.now)
                    else:
                        notices.append(
                            ReportRatioChange(
                                f"{_moving(serving, decision.target)}: {decision.reason}"
                            )
                        )
                        left, target = serving, decision.target
                        last_change, reached = view.now, None
        window = _window(view, members)

    # the walk
    if serving is None or abs(serving.total - target.total) > 1:
        # no map yet (the group forms with the target), or a new total (a scale): all of it at
        # once, through the scale-out path choice
        counts = target
    elif is_steady or serving.total != target.total:
        counts = ratio.next_step(serving, target, ratio.Transition(str(rp.transition)))
    else:
        counts = _whole(prev.desired) or target
    if old_target is not None and target != old_target and not notices:
        notices.append(ReportRatioChange(f"{_moving(old_target, target)}: {reason}"))
    out = RatioStatus(
        target=target,
        desired=counts,
        policy=rp.mode,
        reason=reason,
        numbers=numbers,
        window=window,
        phi=capacity.phi,
        prefill_capacity=capacity.prefill_capacity,
        decode_capacity=capacity.decode_capacity,
        bottleneck=capacity.bottleneck,
        last_change_time=last_change,
        reached_time=reached,
        from_=left,
        feedback=feedback.to_status() if rp.mode is RatioMode.FEEDBACK else None,
        history=history.to_status(),
    )
    return RatioPass(RoleCounts(counts.prefill, counts.decode), out, notices)
