"""Expert placement load balancing (EPLB): which experts to replicate, where, and the four-phase
map change that puts them in place (pure).

**Why.** A MoE layer ends at its slowest expert server: the combine waits for every server
(xDeepServe §7.1, notes 000 §3.6), so the server that holds the hottest expert sets the layer's
time. Routing is skewed: on ShareGPT "20% of experts receive more than the average load, and the
hottest expert sees 30x more tokens than the average" (xDeepServe §4.5, Fig. 11a). EPLB
replicates the hot experts into redundant slots and spreads their tokens over the replicas,
which improves forward latency "more than 40%" (Fig. 11b). xDeepServe §4.5 (Fig. 12, notes 000
§2.7) in four steps, each here:

1. *Collect* the tokens routed to each expert over a window (:func:`window_counts`: the expert
   servers report cumulative counts; two samples differenced give the window's).
2. *Select and place* (:func:`replica_counts`, :func:`place`): with a budget of redundant
   replicas, each extra replica goes to the expert whose per-replica load is the highest now,
   and its tokens are then split over one more replica. This is the paper's rule (pick the
   candidate that lowers the simulated layer load most, then update its counts) for one time
   slice: the layer's load is its hottest per-replica load, and only splitting that expert
   lowers it. Then the new replicas, heaviest first, each go to the least-loaded server with a
   free slot that does not hold that expert already ("least-loaded NPU with available
   redundancy slots, updating that NPU's load after each assignment"); a server's load counts
   what it keeps too. Copies already in the map stay where they are (up to the replicas their
   expert keeps), so a rebalance moves only what changes. One exception, for coverage only: a
   replica that brings an expert back to ``minReplicasPerExpert`` (a failover's) may make room
   by moving a loaded copy of another expert that keeps a copy in place (:func:`_swap_in`);
   that copy is disabled while it moves, so a redundant replica never moves one (every expert
   at its minimum stays there through a rebalance's phases).
3. *Reconfigure* in four phases (:func:`reconfiguration`), each a new map version: prefetch the
   new weights (routes unchanged), disable the slots to be replaced, load the new experts into
   them (still disabled), enable them; then a ``Steady`` version. A slot is disabled only where
   its server needs the room (a full server, as EPLB's redundant slots are): a copy that goes
   from a server with a free slot stays enabled until its replacement is (so a server leaving
   the pool keeps serving its experts until their new copies do). An expert's last enabled
   copy is never disabled: every expert keeps, through every phase, a copy that neither the
   old nor the new map moves (the paper's "without interrupting ongoing inference").
4. *Balance tokens over replicas*: the clients rotate an expert's tokens over its enabled
   replicas by token position (the engine's part); here that is an even split
   (:func:`server_loads`), the rotation's expectation.

**The decision** (:func:`plan`): a layer is rebalanced when its simulated imbalance (max server
load over the mean, tokens split evenly over replicas) exceeds the pool's threshold and the plan
lowers its max load, or when one of its experts has fewer copies than ``minReplicasPerExpert``
(the coverage a failure took). Loads are in tokens: a server's MoE time grows with the tokens it
computes (grouped GEMM), so :func:`layer_time`, the max over servers, is the layer's simulated
MoE time up to the engine's per-token cost.

The paper leaves open whether a candidate may be picked twice and how ties break (notes 000
§2.7, open question 13): an expert may get several extra replicas, at most one per server; ties
go to the expert that already has that many copies (no churn), then to the lowest index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from matrixserve.api import zk_layout as zl

Slots = tuple[tuple[int, ...], ...]  # per server, the experts it holds in one layer


@dataclass(frozen=True)
class MapVersion:
    """One map version as written to ZooKeeper: ``map/v<N>`` and its layers (index = layer)."""

    version: zl.ExpertMapVersion
    layers: tuple[zl.ExpertMapLayer, ...]

    def __post_init__(self) -> None:
        v = self.version
        if len(self.layers) != v.layers:
            raise ValueError(f"map v{v.version} has {v.layers} layers, {len(self.layers)} given")
        for index, layer in enumerate(self.layers):
            if layer.layer != index:
                raise ValueError(f"map v{v.version}: layer {layer.layer} given at index {index}")
            if len(layer.slots) != len(v.servers):
                raise ValueError(
                    f"map v{v.version} layer {index}: {len(layer.slots)} slot lists for "
                    f"{len(v.servers)} servers"
                )
            for server, held in enumerate(layer.slots):
                if len(held) > v.slots or len(set(held)) != len(held):
                    raise ValueError(
                        f"map v{v.version} layer {index} server {server}: {list(held)} is more "
                        f"than {v.slots} slots or holds an expert twice"
                    )
                if any(not 0 <= e < v.experts for e in held):
                    raise ValueError(
                        f"map v{v.version} layer {index} server {server}: an expert outside "
                        f"0..{v.experts - 1} in {list(held)}"
                    )


@dataclass(frozen=True)
class LayerPlan:
    """One layer the plan changes: the slots it gets and what the simulation says of them."""

    layer: int
    slots: Slots
    imbalance_before: float  # max server load / mean, tokens split evenly over replicas
    imbalance_after: float
    time_before: float  # max server load (tokens): the layer's simulated MoE time
    time_after: float
    unplaced: tuple[int, ...] = ()  # experts short of a replica no free distinct slot could take


@dataclass(frozen=True)
class Plan:
    """Whether to rebalance, why, and the map versions that do it (empty when not)."""

    rebalance: bool
    reason: str
    layers: tuple[LayerPlan, ...]
    imbalance: float  # the worst layer's now
    moe_time_before: float  # per iteration: the layers' times summed (tokens)
    moe_time_after: float
    versions: tuple[MapVersion, ...]


# --------------------------------------------------------------------------- step 1: collect
def window_counts(
    before: Iterable[zl.ExpertServerReport],
    after: Iterable[zl.ExpertServerReport],
    *,
    layers: int,
    experts: int,
) -> list[list[int]]:
    """The tokens routed to each expert between two samples of the servers' reports,
    ``[layer][expert]`` summed over servers. A server's counts are cumulative per engine
    incarnation: one in both samples with the same incarnation counts the difference; one new
    in ``after`` (or restarted: another incarnation) counts all it has, every token of it
    computed since ``before``. A server gone by ``after`` took its window's tokens with it."""
    _check_positive(layers=layers, experts=experts)
    earlier = {(r.pod, r.incarnation): r.tokens for r in before}
    out = [[0] * experts for _ in range(layers)]
    for report in after:
        base = earlier.get((report.pod, report.incarnation), {})
        for layer, per_expert in report.tokens.items():
            if not 0 <= layer < layers:
                raise ValueError(f"server {report.pod} reports layer {layer} of {layers}")
            for expert, count in per_expert.items():
                if not 0 <= expert < experts:
                    raise ValueError(
                        f"server {report.pod} reports expert {expert} of {experts} (layer {layer})"
                    )
                delta = count - base.get(layer, {}).get(expert, 0)
                if delta < 0:
                    raise ValueError(
                        f"server {report.pod} (incarnation {report.incarnation}) counts fewer "
                        f"tokens for layer {layer} expert {expert} than before: {count} < "
                        f"{count - delta}; cumulative counts only grow"
                    )
                out[layer][expert] += delta
    return out


# --------------------------------------------------------------------------- simulation
def server_loads(
    slots: Sequence[Sequence[int]],
    counts: Sequence[float],
    disabled: Sequence[Sequence[int]] = (),
) -> list[float]:
    """Each server's tokens in one layer: every expert's tokens split evenly over the servers
    that hold it enabled (the position rotation's expectation). An expert nobody serves adds
    to no server."""
    routes: list[list[int]] = [[] for _ in counts]
    for server, held in enumerate(slots):
        off = set(disabled[server]) if server < len(disabled) else set()
        for expert in held:
            if expert not in off and 0 <= expert < len(counts):
                routes[expert].append(server)
    loads = [0.0] * len(slots)
    for expert, servers in enumerate(routes):
        for server in servers:
            loads[server] += counts[expert] / len(servers)
    return loads


def layer_time(layer: zl.ExpertMapLayer, counts: Sequence[float]) -> float:
    """A layer's simulated MoE time, in tokens: its slowest server's (the combine waits for
    every server)."""
    return max(server_loads(layer.slots, counts, layer.disabled), default=0.0)


def imbalance(slots: Sequence[Sequence[int]], counts: Sequence[float]) -> float:
    """Max server load over the mean server load (1.0 for a layer with no tokens)."""
    loads = server_loads(slots, counts)
    total = sum(loads)
    if not loads or total <= 0:
        return 1.0
    return max(loads) / (total / len(loads))


# --------------------------------------------------------------------------- step 2: select, place
def replica_counts(
    counts: Sequence[float],
    *,
    min_replicas: int,
    budget: int,
    servers: int,
    current: Sequence[int] = (),
) -> list[int]:
    """How many replicas each expert gets: ``min_replicas`` each, then up to ``budget`` more,
    each to the expert with the highest per-replica load now (at most one replica per server).
    ``current``: each expert's copies in the map now; a tie goes to an expert that has more
    copies than it would get (it keeps one instead of another expert gaining one). Raises when
    the servers cannot hold ``min_replicas`` distinct copies of every expert."""
    experts = len(counts)
    _check_positive(experts=experts, min_replicas=min_replicas, servers=servers)
    if budget < 0:
        raise ValueError(f"a redundant expert budget >= 0 expected, got {budget}")
    if min_replicas > servers:
        raise ValueError(
            f"{min_replicas} replicas per expert on distinct servers need {min_replicas} "
            f"servers, the map has {servers}"
        )
    replicas = [min_replicas] * experts
    have = list(current) + [0] * (experts - len(current))
    extra = min(budget, experts * (servers - min_replicas))
    for _ in range(extra):
        best = max(
            (e for e in range(experts) if replicas[e] < servers),
            key=lambda e: (counts[e] / replicas[e], have[e] > replicas[e], -e),
        )
        replicas[best] += 1
    return replicas


def place(
    counts: Sequence[float],
    replicas: Sequence[int],
    current: Sequence[Sequence[int]],
    slots: int,
    *,
    min_replicas: int = 0,
) -> tuple[Slots, tuple[int, ...]]:
    """Where the replicas go in one layer, from the current slots: each expert keeps up to
    ``replicas[e]`` of its copies where they are (a surplus copy leaves a server holding no
    expert that gains a replica, the most loaded first); the missing replicas, heaviest per-replica load first, each go to the least-loaded
    server with a free slot that does not hold that expert (ties: lowest index); when every
    free slot is beside a copy of it, a copy moves there to make room (:func:`_swap_in`), so a
    free slot an earlier replica took does not leave a later one short: one placed in this
    plan, or, for a replica that brings its expert up to ``min_replicas``, a loaded one. Returns
    the slots per server and the experts left a replica short (no such server, no such move)."""
    experts = len(counts)
    if len(replicas) != experts:
        raise ValueError(f"{len(replicas)} replica counts for {experts} experts")
    per = [counts[e] / replicas[e] for e in range(experts)]
    kept = [[e for e in held if 0 <= e < experts] for held in current]
    if any(len(held) > slots for held in kept):
        raise ValueError(f"a server holds more than its {slots} slots: {list(current)}")
    load = [sum(per[e] for e in held) for held in kept]
    holders: list[list[int]] = [[] for _ in range(experts)]
    for server, held in enumerate(kept):
        for e in held:
            holders[e].append(server)
    # a surplus copy leaves a server the gaining experts can use (one holding none of them),
    # the most loaded first: the slot it frees is where a hot expert's new replica may go
    gaining = {e for e in range(experts) if replicas[e] > len(holders[e])}
    for e in range(experts):
        while len(holders[e]) > replicas[e]:
            drop = max(holders[e], key=lambda s: (not gaining.intersection(kept[s]), load[s], s))
            holders[e].remove(drop)
            kept[drop].remove(e)
            load[drop] -= per[e]
    units = sorted(
        (e for e in range(experts) for _ in range(replicas[e] - len(holders[e]))),
        key=lambda e: (-per[e], e),
    )
    unplaced: list[int] = []
    fresh: set[tuple[int, int]] = set()  # (server, expert): the copies placed here, not kept
    for e in units:
        free = [s for s, held in enumerate(kept) if len(held) < slots and e not in held]
        if not free:
            short = sum(e in held for held in kept) < min_replicas
            # a redundant replica may move only a loaded copy whose expert keeps its minimum
            # where it is (coverage stays at minReplicasPerExpert through the walk); one that
            # restores an expert's minimum may, at last, take one whose expert keeps fewer
            keeps = (
                range(min_replicas, 0, -1) if short else range(min_replicas, min_replicas - 1, -1)
            )
            if not _swap_in(e, kept, fresh, slots, load, per, keeps):
                unplaced.append(e)
            continue
        target = min(free, key=lambda s: (load[s], s))
        kept[target].append(e)
        load[target] += per[e]
        fresh.add((target, e))
    return tuple(tuple(held) for held in kept), tuple(unplaced)


def _swap_in(
    e: int,
    kept: list[list[int]],
    fresh: set[tuple[int, int]],
    slots: int,
    load: list[float],
    per: Sequence[float],
    keeps: Iterable[int],
) -> bool:
    """Room for a replica of ``e`` when every server with a free slot holds ``e`` already: a
    copy ``f`` on a server ``h`` without ``e`` moves to such a free slot and ``e`` takes its
    place. ``f`` is one placed in this plan (nothing loaded moves), or else a kept (loaded)
    copy whose expert keeps at least ``k`` other loaded copies where they are, each ``k`` of
    ``keeps`` tried in turn (most first): ``h`` is full (a server with room would have taken
    ``e``), so the walk disables ``f`` there from ``Disable`` until its new copy is enabled,
    and ``f`` serves from those alone (never from none). For a redundant replica ``keeps`` is
    the minimum alone: it moves only a copy beyond its expert's minimum, so no expert drops
    below its minimum mid-walk. False if no such move exists."""
    rooms = sorted(
        (s for s, held in enumerate(kept) if len(held) < slots), key=lambda s: (load[s], s)
    )
    givers = sorted((s for s, held in enumerate(kept) if e not in held), key=lambda s: (load[s], s))
    for keep in (0, *keeps):  # 0: a copy placed in this plan
        for room in rooms:
            for h in givers:
                for f in kept[h]:
                    if f in kept[room] or ((h, f) in fresh) is not (keep == 0):
                        continue
                    stays = [s for s, held in enumerate(kept) if s != h and f in held]
                    if sum((s, f) not in fresh for s in stays) < keep:
                        continue
                    kept[h].remove(f)
                    kept[room].append(f)
                    kept[h].append(e)
                    load[h] += per[e] - per[f]
                    load[room] += per[f]
                    fresh.discard((h, f))
                    fresh.update({(room, f), (h, e)})
                    return True
    return False


# --------------------------------------------------------------------------- step 3: reconfigure
def reconfiguration(
    current: MapVersion,
    targets: Mapping[int, Sequence[Sequence[int]]],
    *,
    reason: str,
    now: float,
) -> tuple[MapVersion, ...]:
    """The versions that take ``current`` to ``targets`` (layer -> slots per server, same server
    table; layers not named stay as they are), in order: ``Prefetch`` (``prefetch[i]``: what
    server ``i`` stages; routes unchanged), ``Disable`` (``disabled[i]``: its copies to go
    that free the slots it loads into), ``Load`` (the new experts in those slots, disabled
    while they load), ``Enable`` (the new slots routable, the old gone), ``Steady``; numbered on from ``current``. Empty when nothing
    changes. Raises when a target leaves an expert with no enabled copy kept through the
    change (its last copy would be disabled: add a copy first, in an earlier change), when
    ``current`` is mid-change (a disabled slot), or when a target overfills a server."""
    v = current.version
    changed: dict[int, Slots] = {}
    for index, target in sorted(targets.items()):
        if not 0 <= index < v.layers:
            raise ValueError(f"layer {index} outside the map's {v.layers}")
        layer = current.layers[index]
        if any(layer.disabled) or any(layer.prefetch):
            raise ValueError(f"layer {index} of map v{v.version} is mid-change (disabled slots)")
        if len(target) != len(v.servers):
            raise ValueError(
                f"layer {index}: {len(target)} slot lists for {len(v.servers)} servers"
            )
        new = tuple(tuple(held) for held in target)
        if new != tuple(tuple(held) for held in layer.slots):
            _check_kept_copy(index, layer, new, v.experts, v.slots)
            changed[index] = new
    if not changed:
        return ()

    def version(
        n: int, phase: zl.ExpertMapPhase, layer_of: Callable[[int, Slots], zl.ExpertMapLayer]
    ) -> MapVersion:
        layers = tuple(
            layer_of(i, changed[i]) if i in changed else current.layers[i] for i in range(v.layers)
        )
        head = {**v.model_dump(), "version": v.version + n, "phase": phase}
        return MapVersion(
            zl.ExpertMapVersion.model_validate({**head, "reason": reason, "at": now}), layers
        )

    def prefetch(i: int, new: Slots) -> zl.ExpertMapLayer:
        old = current.layers[i].slots
        return zl.ExpertMapLayer(
            layer=i, slots=old, prefetch=[_added(old[s], new[s]) for s in range(len(old))]
        )

    def disable(i: int, new: Slots) -> zl.ExpertMapLayer:
        old = current.layers[i].slots
        return zl.ExpertMapLayer(
            layer=i, slots=old, disabled=[_freed(old[s], new[s], v.slots) for s in range(len(old))]
        )

    def load(i: int, new: Slots) -> zl.ExpertMapLayer:
        old = current.layers[i].slots
        return zl.ExpertMapLayer(
            layer=i,
            slots=[
                _in_place(old[s], new[s], _freed(old[s], new[s], v.slots)) for s in range(len(old))
            ],
            disabled=[_added(old[s], new[s]) for s in range(len(old))],
        )

    def enable(i: int, new: Slots) -> zl.ExpertMapLayer:
        old = current.layers[i].slots
        return zl.ExpertMapLayer(
            layer=i, slots=[_in_place(old[s], new[s]) for s in range(len(old))]
        )

    P = zl.ExpertMapPhase
    return (
        version(1, P.PREFETCH, prefetch),
        version(2, P.DISABLE, disable),
        version(3, P.LOAD, load),
        version(4, P.ENABLE, enable),
        version(5, P.STEADY, enable),
    )


def _added(old: Sequence[int], new: Sequence[int]) -> list[int]:
    return [e for e in new if e not in old]


def _removed(old: Sequence[int], new: Sequence[int]) -> list[int]:
    return [e for e in old if e not in new]


def _freed(old: Sequence[int], new: Sequence[int], slots: int) -> list[int]:
    """The copies a server disables to make room for what it loads: as many of those it gives
    up as its free slots fall short of (none on a server with room)."""
    short = len(old) + len(_added(old, new)) - slots
    return _removed(old, new)[: max(0, short)]


def _in_place(
    old: Sequence[int], new: Sequence[int], freed: Sequence[int] | None = None
) -> list[int]:
    """``new``'s experts with each kept one in its old slot and each added one in a ``freed``
    one's (the slot it replaces; default: every removed one), the rest after. A removed copy
    not freed stays where it is (still enabled while the added ones load)."""
    gone = _removed(old, new) if freed is None else freed
    added = iter(_added(old, new))
    out = [next(added, -1) if e in gone else e for e in old]
    out = [e for e in out if e >= 0]
    return out + list(added)


def _check_kept_copy(
    index: int, layer: zl.ExpertMapLayer, new: Slots, experts: int, slots: int
) -> None:
    """Every expert keeps an enabled copy through the change: one its server does not free
    (Disable, Load), and a copy in the new slots (Enable)."""
    for expert, holders in enumerate(layer.routes(experts)):
        if not holders:
            continue
        freed = {s for s in holders if expert in _freed(layer.slots[s], new[s], slots)}
        if freed == set(holders) or not any(expert in held for held in new):
            raise ValueError(
                f"layer {index}: expert {expert}'s every copy (servers {holders}) would be "
                "disabled or dropped at once, leaving it no enabled copy; keep one where it "
                "is while the others move"
            )


# --------------------------------------------------------------------------- the decision
def plan(
    current: MapVersion,
    counts: Sequence[Sequence[float]],
    *,
    min_replicas: int,
    budget: int,
    threshold_percent: float,
    now: float,
) -> Plan:
    """Whether and how to rebalance ``current`` for the window's ``counts`` (``[layer][expert]``,
    :func:`window_counts`): the layers whose imbalance exceeds ``threshold_percent`` (max
    server load above the mean by more than that) and whose plan lowers their max load, and
    the layers with an expert below ``min_replicas`` copies (coverage to restore); for them
    :func:`replica_counts` within ``budget`` (capped by the free slots), :func:`place`, and
    :func:`reconfiguration`'s versions."""
    v = current.version
    if v.phase is not zl.ExpertMapPhase.STEADY:
        return Plan(
            False,
            f"map v{v.version} is in phase {v.phase}: one change at a time",
            (),
            1.0,
            0.0,
            0.0,
            (),
        )
    if len(counts) != v.layers or any(len(c) != v.experts for c in counts):
        raise ValueError(f"counts per layer and expert expected: {v.layers} x {v.experts}")
    if threshold_percent < 0:
        raise ValueError(f"an imbalance threshold >= 0 % expected, got {threshold_percent}")
    servers = len(v.servers)
    capacity = servers * v.slots
    if capacity < v.experts * min_replicas:
        raise ValueError(
            f"{servers} servers x {v.slots} slots = {capacity} slots cannot hold {v.experts} "
            f"experts x {min_replicas} replicas"
        )
    spare = min(budget, capacity - v.experts * min_replicas)
    worst = 1.0
    before_total = after_total = 0.0
    chosen: list[LayerPlan] = []
    why: list[str] = []
    for index, layer in enumerate(current.layers):
        c = counts[index]
        held = [len(h) for h in layer.routes(v.experts)]
        now_imbalance = imbalance(layer.slots, c)
        now_time = layer_time(layer, c)
        worst = max(worst, now_imbalance)
        before_total += now_time
        short = any(h < min_replicas for h in held)
        skewed = (now_imbalance - 1.0) * 100.0 > threshold_percent
        if not (short or skewed):
            after_total += now_time
            continue
        replicas = replica_counts(
            c, min_replicas=min_replicas, budget=spare, servers=servers, current=held
        )
        slots, unplaced = place(c, replicas, layer.slots, v.slots, min_replicas=min_replicas)
        new_time = max(server_loads(slots, c), default=0.0)
        if not short and not new_time < now_time:
            after_total += now_time
            continue
        after_total += new_time
        chosen.append(
            LayerPlan(
                index, slots, now_imbalance, imbalance(slots, c), now_time, new_time, unplaced
            )
        )
        why.append(
            f"layer {index}: "
            + ("an expert below its replicas" if short else f"imbalance {now_imbalance:.2f}")
        )
    if not chosen:
        return Plan(False, "balanced", (), worst, before_total, before_total, ())
    reason = (
        "rebalance: " + ", ".join(why[:3]) + (f" (+{len(why) - 3} layers)" if len(why) > 3 else "")
    )
    versions = reconfiguration(
        current, {lp.layer: lp.slots for lp in chosen}, reason=reason, now=now
    )
    return Plan(bool(versions), reason, tuple(chosen), worst, before_total, after_total, versions)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} >= 1 expected, got {value}")
