"""Changing an ExpertPool's map one phase at a time, and EPLB deciding when (pure; xDeepServe
§4.5, EaaS §3.4).

**One walk for every change.** A new pool, a replacement's slots, a scale-up or -down
(:func:`.expertmap.wanted`) and an EPLB rebalance (:func:`matrixserve.domain.eplb.plan`) all
reach their target by the same versions, :func:`matrixserve.domain.eplb.reconfiguration`'s
(§4.5 step 3): ``Prefetch`` (the servers stage what they will load; routes unchanged),
``Disable`` (the copies whose slots a full server frees), ``Load`` (the new copies in place,
disabled until loaded), ``Enable``, ``Steady``. :func:`change` builds them: servers joining
enter the table with no slots, servers leaving keep theirs (enabled, serving) until the
``Enable`` version and are out of the table in ``Steady``; it keeps only the phases that do
something (:func:`needed`: a replacement is ``Load``, ``Steady``), EPLB all four.

**Written ahead, walked one at a time.** The whole walk is written at once, each version
immutable, the pointer on the first; :func:`advance` moves the pointer to the next stored
version once every server of the table has applied the one in force (reports ``loaded`` >= it
and is not ``Loading``): for ``Load`` that is every server with new slots having loaded them;
for the other phases it is every server having seen them. So a restarted operator walks on
from ZooKeeper alone, and there is never more than one change in flight: nothing else changes
the map while a version in force is not ``Steady``.

**A failover cuts a walk short** (:func:`preempt`). In ``Prefetch`` and ``Disable`` every
server still holds the old slots: the failover's version re-enables them (``Steady``, the old
slots without the failed servers). In ``Load`` and ``Enable`` the new slots are in place: the
version keeps its phase without the failed servers, and :func:`advance`, finding nothing
stored after it (the rest of the walk is pruned), enables it once loaded. Either way each
version written keeps every enabled copy the phase had on the servers that are left; since a
change keeps each expert's copies where they are up to its replicas (:func:`eplb.place`: only
a walk restoring a short expert may move a loaded copy, of an expert that keeps another), an
expert keeps at least ``minReplicasPerExpert`` - 1 enabled copies through a failure in any
phase of a walk that starts with every expert at its replicas.

**EPLB's window** (§4.5 step 1, :func:`decide`) is the autoscaler's sample
(:func:`.autoscale.due`: at least ``SAMPLE_SECONDS`` apart): the servers' per-expert counts
at the last sample (the handler keeps those reports: too big for the status) against now's.
At a sample, once ``rebalance.intervalSeconds`` have passed since it last looked, with the map
steady and every expert at its replicas, EPLB reads the window: the hottest experts go to the
status, and :func:`eplb.plan` decides (a layer over ``imbalancePercentThreshold`` whose
plan lowers its slowest server's load); its versions are the walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from matrixserve.api import zk_layout as zl
from matrixserve.api.status import ExpertLoadStatus, ExpertPoolStatus, ExpertRebalanceStatus
from matrixserve.domain import eplb
from matrixserve.domain.expertpool import autoscale
from matrixserve.domain.expertpool import expertmap as em
from matrixserve.domain.expertpool.view import PoolView

P = zl.ExpertMapPhase
HOT_EXPERTS = 5  # [design] how many of the window's hottest experts the status names
COMPLETED, PREEMPTED = "Completed", "Preempted"


# --------------------------------------------------------------------------- payloads
def payload(m: em.ExpertMap) -> eplb.MapVersion:
    head, layers = m.payloads()
    return eplb.MapVersion(head, tuple(layers))


def of_payload(v: eplb.MapVersion, shift: int = 0) -> em.ExpertMap:
    """The version read as the planner's map, its number moved by ``shift`` (a phase of a
    walk: its rows not stamped yet, :func:`.expertmap.stamped` does it as it is written)."""
    m = em.ExpertMap.of(v.version, v.layers)
    return replace(m, version=m.version + shift, rows_at=())


def based(m: em.ExpertMap, version: int) -> eplb.MapVersion:
    """``m`` as the base of a walk numbered from ``version``: :mod:`eplb` numbers a walk on
    from its base, and a base is a written version (>= 1); so the base takes ``version`` and
    the walk is moved back by one (:func:`of_payload`)."""
    return payload(replace(m, version=version))


# --------------------------------------------------------------------------- the walk
def _held(m: em.ExpertMap | None, layer: int, server: str) -> tuple[int, ...]:
    if m is None or server not in m.servers or layer >= m.layers:
        return ()
    return m.held[layer][m.servers.index(server)]


def change(
    current: em.ExpertMap | None, target: em.ExpertMap, version: int, reason: str, at: float
) -> tuple[em.ExpertMap, ...]:
    """The walk from ``current`` (steady, or None: a new pool) to ``target``'s servers and
    slots, numbered from ``version``: the table is ``current``'s with ``target``'s newcomers
    after; servers not in ``target`` give up their slots and leave it in ``Steady``. Empty
    when ``current`` says that already. ValueError if an expert would lose its every enabled
    copy on the way (:func:`eplb.reconfiguration`)."""
    table = list(current.servers) if current else []
    table += [s for s in target.servers if s not in table]
    base = em.ExpertMap(
        version,
        target.experts,
        target.slots,
        tuple(table),
        tuple(tuple(_held(current, n, s) for s in table) for n in range(target.layers)),
        reason=reason,
        at=at,
    )
    targets = {n: [_held(target, n, s) for s in table] for n in range(target.layers)}
    gone = [s for s in table if s not in target.servers]
    walk = needed(
        [
            of_payload(v, -1)
            for v in eplb.reconfiguration(based(base, version), targets, reason=reason, now=at)
        ],
        base,
        leaving=bool(gone),
    )
    if walk:
        walk[-1] = walk[-1].without(gone, walk[-1].version, reason, at)
        return tuple(walk)
    steady = base.without(gone, version, reason, at)
    if current is not None and steady.servers == current.servers:
        return ()
    return (steady,)


def needed(walk: Sequence[em.ExpertMap], base: em.ExpertMap, leaving: bool) -> list[em.ExpertMap]:
    """The phases of a change's ``walk`` that do something, renumbered on from its first:
    ``Prefetch`` only when a server already holding slots stages (a server that holds nothing,
    a newcomer, loads straight into its empty slots), ``Disable`` only when a slot is freed,
    ``Enable`` only when servers leave (its layers are ``Steady``'s; the leavers' copies go
    out of the routes a version before the leavers go out of the table). A replacement is
    then ``Load``, ``Steady``: every other server's rows unchanged (EaaS §3.4: the failover
    touches only the failed server's experts). EPLB's rebalance keeps xDeepServe §4.5's four
    phases (:func:`decide`)."""
    holds = {i for layer in base.held for i, experts in enumerate(layer) if experts}

    def does(m: em.ExpertMap) -> bool:
        if m.phase is P.PREFETCH:
            return any(
                experts and i in holds for layer in m.prefetch for i, experts in enumerate(layer)
            )
        if m.phase is P.DISABLE:
            return bool(m.disabled)
        if m.phase is P.ENABLE:
            return leaving
        return True

    kept = [m for m in walk if does(m)]
    first = walk[0].version if walk else 0
    return [replace(m, version=first + n) for n, m in enumerate(kept)]


def applied(view: PoolView, m: em.ExpertMap) -> bool:
    """Whether every server of ``m``'s table has applied it (loaded what it gives them)."""
    for server in m.servers:
        report = view.report(server)
        if (
            report is None
            or report.loaded < m.version
            or report.state is zl.ExpertServerState.LOADING
        ):
            return False
    return True


def advance(view: PoolView, in_force: em.ExpertMap, version: int) -> em.ExpertMap | None:
    """The next version of the walk in force, once every server applied it: the one stored
    after it (stamped now), or, when a failover cut the walk short, the version in force with
    every slot enabled (``Steady``, numbered ``version``); None while waiting, or steady."""
    if in_force.steady or not applied(view, in_force):
        return None
    stored = view.successor
    if stored is not None and stored.version == in_force.version + 1:
        return replace(stored, at=view.now)
    why = f"enabled map v{in_force.version}'s slots ({in_force.phase} cut short)"
    return in_force.enabled(version, why, view.now)


def preempt(
    current: em.ExpertMap, failed: Sequence[str], version: int, why: str, at: float
) -> em.ExpertMap:
    """The failover's version of ``current`` (see the module's docstring): without the
    ``failed`` servers, the old slots re-enabled if the walk had not loaded anything yet."""
    if current.phase in (P.PREFETCH, P.DISABLE):
        current = current.enabled(version, why, at)
    return current.without(failed, version, why, at)


# --------------------------------------------------------------------------- EPLB
@dataclass(frozen=True)
class Decision:
    """What EPLB made of a window: the hottest experts, and the walk if it rebalances."""

    hot: tuple[ExpertLoadStatus, ...]
    walk: tuple[em.ExpertMap, ...] = ()
    record: ExpertRebalanceStatus | None = None
    problem: str = ""  # a window that could not be read (a report's counts), said


def due(view: PoolView) -> bool:
    """Whether this pass takes a sample and EPLB's interval has passed since it last looked."""
    previous = view.previous
    if previous.token_sample is None or not autoscale.due(previous.token_sample, view.now):
        return False
    last = previous.rebalance_checked_at
    return last is None or view.now - last >= view.spec.rebalance.interval_seconds


def hottest(
    counts: Sequence[Sequence[int]], top: int = HOT_EXPERTS
) -> tuple[ExpertLoadStatus, ...]:
    """The ``top`` experts with the most tokens in the window (any layer), each with its share
    of its layer's tokens and its ratio to the layer's mean expert."""
    ranked = sorted(
        ((c, n, e) for n, row in enumerate(counts) for e, c in enumerate(row) if c > 0),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    out = []
    for tokens, n, e in ranked[:top]:
        total = sum(counts[n])
        out.append(
            ExpertLoadStatus(
                layer=n,
                expert=e,
                tokens=tokens,
                share=round(tokens / total, 4),
                ratio=round(tokens / (total / len(counts[n])), 2),
            )
        )
    return tuple(out)


def decide(view: PoolView, in_force: em.ExpertMap, version: int) -> Decision | None:
    """EPLB over the window from the last sample to now (None: no window, or not due); the
    walk numbered from ``version``."""
    if view.sampled is None or not due(view):
        return None
    spec = view.spec
    live = view.live()
    try:
        counts = eplb.window_counts(
            view.sampled.values(),
            [r for s, r in view.reports.items() if s in live],
            layers=spec.model.layers,
            experts=spec.model.experts,
        )
    except ValueError as exc:
        return Decision((), problem=str(exc))
    hot = hottest(counts)
    if not hot:
        return Decision(hot)
    result = eplb.plan(
        based(in_force, version),
        counts,
        min_replicas=spec.min_replicas_per_expert,
        budget=spec.redundant_expert_budget,
        threshold_percent=spec.rebalance.imbalance_percent_threshold,
        now=view.now,
    )
    if not result.rebalance:
        return Decision(hot)
    walk = tuple(of_payload(v, -1) for v in result.versions)
    final = walk[-1]
    record = ExpertRebalanceStatus(
        at=view.now,
        reason=result.reason,
        imbalanceBefore=round(result.imbalance, 3),
        imbalanceAfter=round(
            max(eplb.imbalance(final.held[n], counts[n]) for n in range(final.layers)), 3
        ),
        moeTimeBefore=round(result.moe_time_before, 1),
        moeTimeAfter=round(result.moe_time_after, 1),
        versions=[m.version for m in walk],
        layers=[lp.layer for lp in result.layers],
    )
    return Decision(hot, walk, record)


def status(
    status: ExpertPoolStatus, after: em.ExpertMap | None, decision: Decision | None, now: float
) -> ExpertPoolStatus:
    """The status with EPLB's part: the window's hottest experts and when it looked (at a
    decision), the rebalance decided, or the last one's end once the map is steady again
    (``Completed`` at its last version, ``Preempted`` at a failover's)."""
    update: dict[str, object] = {}
    last = status.last_rebalance
    if decision is not None:
        update["rebalance_checked_at"] = now
        update["hot_experts"] = list(decision.hot)
        if decision.record is not None:
            last = decision.record
    if (
        last is not None
        and last.ended_version is None
        and after is not None
        and after.steady
        and last.versions
        and after.version >= last.versions[-1]
    ):
        outcome = COMPLETED if after.version == last.versions[-1] else PREEMPTED
        last = last.model_copy(update={"ended_version": after.version, "outcome": outcome})
    update["last_rebalance"] = last
    return status.model_copy(update=update)
