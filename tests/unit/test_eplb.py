"""EPLB (xDeepServe §4.5): the window's counts, the greedy selection, the placement, the
four-phase change that never leaves an expert without an enabled copy, and what it does to the
simulated MoE time under Fig. 11a's skew."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixserve.api import zk_layout as zl
from matrixserve.domain import eplb

P = zl.ExpertMapPhase


def report(pod: str, incarnation: str, tokens: dict[int, dict[int, int]]) -> zl.ExpertServerReport:
    return zl.ExpertServerReport(
        pod=pod, podUid="u", podIP="127.0.0.9", port=8000, node="n", superpod="sp", dies=[0],
        roceIps=[], incarnation=incarnation, ts=1.0, pool="ns/experts", slots=4,
        state=zl.ExpertServerState.SERVING, tokens=tokens,
    )  # fmt: skip


def map_of(
    slots_per_layer: list[list[list[int]]], *, experts: int, slots: int, version: int = 1
) -> eplb.MapVersion:
    servers = len(slots_per_layer[0])
    head = zl.ExpertMapVersion(
        version=version, layers=len(slots_per_layer), experts=experts, slots=slots,
        servers=[f"srv-{i}" for i in range(servers)],
    )  # fmt: skip
    layers = tuple(zl.ExpertMapLayer(layer=i, slots=s) for i, s in enumerate(slots_per_layer))
    return eplb.MapVersion(head, layers)


# --------------------------------------------------------------------------- collect
def test_window_counts_difference_per_incarnation() -> None:
    before = [report("a", "1", {0: {0: 10, 1: 5}}), report("b", "1", {0: {0: 7}})]
    after = [
        report("a", "1", {0: {0: 15, 1: 5}, 1: {2: 3}}),  # same engine: the difference
        report("b", "2", {0: {0: 4}}),  # restarted: all it counted is in the window
        report("c", "1", {1: {2: 1}}),  # new: likewise
    ]
    assert eplb.window_counts(before, after, layers=2, experts=3) == [[9, 0, 0], [0, 0, 4]]


def test_window_counts_refuse_shrinking_and_unknown_experts() -> None:
    with pytest.raises(ValueError, match="only grow"):
        eplb.window_counts(
            [report("a", "1", {0: {0: 10}})], [report("a", "1", {0: {0: 9}})], layers=1, experts=1
        )
    with pytest.raises(ValueError, match="expert 5 of 3"):
        eplb.window_counts([], [report("a", "1", {0: {5: 1}})], layers=1, experts=3)
    with pytest.raises(ValueError, match="layer 2 of 2"):
        eplb.window_counts([], [report("a", "1", {2: {0: 1}})], layers=2, experts=3)


# --------------------------------------------------------------------------- simulate
def test_server_loads_split_an_expert_evenly_over_its_enabled_replicas() -> None:
    slots = [[0, 1], [0, 2], [3]]
    assert eplb.server_loads(slots, [40, 10, 6, 2]) == [30.0, 26.0, 2.0]
    # server 1's copy of expert 0 disabled: server 0 takes all of it
    assert eplb.server_loads(slots, [40, 10, 6, 2], [[], [0], []]) == [50.0, 6.0, 2.0]
    assert eplb.imbalance(slots, [40, 10, 6, 2]) == pytest.approx(30 / (58 / 3))
    assert eplb.imbalance(slots, [0, 0, 0, 0]) == 1.0


# --------------------------------------------------------------------------- select, place
def test_greedy_gives_each_extra_replica_to_the_highest_per_replica_load() -> None:
    # per replica: 90 -> e0 (45), 45 -> e0 (30), 30 = 30 tie -> e0 (lowest index; 22.5),
    # 30 -> e1 (15), 22.5 -> e0 would need a 5th server: e0 stays at 4, then e1 (10)
    counts = [90, 30, 10, 10]
    assert eplb.replica_counts(counts, min_replicas=1, budget=3, servers=4) == [4, 1, 1, 1]
    assert eplb.replica_counts(counts, min_replicas=1, budget=5, servers=4) == [4, 3, 1, 1]
    # a tie goes to an expert that holds more copies now: no churn
    assert eplb.replica_counts([30, 30], min_replicas=1, budget=1, servers=2, current=[1, 2]) == [
        1,
        2,
    ]
    with pytest.raises(ValueError, match="need 3 servers"):
        eplb.replica_counts(counts, min_replicas=3, budget=0, servers=2)


def test_place_keeps_copies_and_puts_new_replicas_heaviest_first_on_the_least_loaded() -> None:
    counts = [60, 20, 20, 10]
    # e0 gets 3 replicas (20 each), others 1; e0 sits on server 0 already
    slots, unplaced = eplb.place(counts, [3, 1, 1, 1], [[0, 1], [2], [3]], slots=2)
    assert unplaced == ()
    # kept: s0 {0,1} = 40, s1 {2} = 20, s2 {3} = 10; e0's two new copies: s2 (10), then s1 (20)
    assert slots == ((0, 1), (2, 0), (3, 0))
    assert eplb.server_loads(slots, counts) == [40.0, 40.0, 30.0]


def test_place_drops_a_surplus_copy_from_the_most_loaded_server() -> None:
    slots, _ = eplb.place([10, 50], [1, 1], [[0, 1], [0]], slots=2)
    assert slots == ((1,), (0,))


def test_place_reports_a_replica_no_distinct_free_slot_can_take() -> None:
    slots, unplaced = eplb.place([10, 1, 1], [2, 1, 1], [[1, 2], []], slots=2)
    assert slots == ((1, 2), (0,))
    assert unplaced == (0,)


def test_place_makes_room_when_the_free_slots_are_beside_a_copy() -> None:
    """A failover left experts 0 and 1 one copy each and two free slots, on servers 3 {4} and 4
    {0}. The heavier expert 1 takes the least-loaded free slot first (server 3); then expert 0's
    only free slot is beside its copy: expert 1's new copy moves to server 4 and expert 0 takes
    its place. No expert is left short while the slots can hold them all."""
    slots, unplaced = eplb.place(
        [10, 50, 10, 10, 10], [2] * 5, [[1, 2], [2, 3], [3, 4], [4], [0]], slots=2
    )
    assert unplaced == ()
    assert slots == ((1, 2), (2, 3), (3, 4), (4, 0), (0, 1))


def test_plan_restores_every_expert_a_failover_left_short() -> None:
    current = map_of([[[1, 2], [2, 3], [3, 4], [4], [0]]], experts=5, slots=2)
    result = eplb.plan(
        current, [[10, 50, 10, 10, 10]], min_replicas=2, budget=0, threshold_percent=20, now=1.0
    )
    assert result.layers[0].unplaced == ()
    assert [len(r) for r in result.versions[-1].layers[0].routes(5)] == [2] * 5


def test_a_redundant_replica_moves_no_loaded_copy_so_every_expert_keeps_its_minimum() -> None:
    """Expert 0 is hot and wants two extra replicas; expert 2's third copy is surplus. It leaves
    server 0, which holds no copy of 0 (not server 2, beside one), so both replicas find a
    slot: server 0's and server 3's free one. Nothing at its minimum moves: every expert keeps
    two enabled copies in every phase (expert 1's stay where they were)."""
    current = map_of([[[1, 2], [0, 1], [0, 2], [2]]], experts=3, slots=2)
    result = eplb.plan(
        current, [[1000, 10, 10]], min_replicas=2, budget=2, threshold_percent=20, now=1.0
    )
    assert result.rebalance
    assert result.layers[0].unplaced == ()
    assert result.layers[0].slots == ((1, 0), (0, 1), (0, 2), (2, 0))
    for v in result.versions:
        assert min(len(r) for r in v.layers[0].routes(3)) >= 2, v.version.phase


def test_a_full_pool_gives_a_cold_experts_redundant_copy_to_a_hot_one() -> None:
    """Every slot full, the budget spread over cold experts at start (the initial map): the
    hot expert 0's extra replicas need servers without it, where only copies sit. A copy beyond
    its expert's minimum moves (expert 3's redundant one: it keeps its two), so expert 0 gains a
    copy and no expert drops below two enabled copies in any phase."""
    current = map_of([[[0, 1, 3], [0, 2, 3], [1, 2, 3]]], experts=4, slots=3)
    result = eplb.plan(
        current, [[3000, 10, 10, 10]], min_replicas=2, budget=1, threshold_percent=20, now=1.0
    )
    assert result.rebalance
    assert result.layers[0].unplaced == ()
    assert sum(0 in held for held in result.layers[0].slots) == 3
    for v in result.versions:
        assert min(len(r) for r in v.layers[0].routes(4)) >= 2, v.version.phase


def test_a_replica_restoring_coverage_may_move_a_loaded_copy_that_keeps_another() -> None:
    """A failover left expert 0 one copy, on server 2, whose free slot is beside it; servers 0
    and 1 are full. Expert 1's copy on server 0 moves to server 2 and expert 0 takes its slot:
    expert 1 serves from server 1 alone while it moves, never from none."""
    current = map_of([[[1, 2], [1, 2], [0]]], experts=3, slots=2)
    result = eplb.plan(
        current, [[10, 10, 10]], min_replicas=2, budget=0, threshold_percent=20, now=1.0
    )
    assert result.layers[0].unplaced == ()
    assert result.layers[0].slots == ((2, 0), (1, 2), (0, 1))
    assert [min(len(r) for r in v.layers[0].routes(3)) for v in result.versions] == [1, 1, 1, 2, 2]
    assert [len(r) for r in result.versions[-1].layers[0].routes(3)] == [2] * 3


# --------------------------------------------------------------------------- reconfigure
def test_four_phases_stage_disable_load_enable_then_steady() -> None:
    current = map_of([[[0, 1], [2, 1]]], experts=3, slots=2, version=7)
    versions = eplb.reconfiguration(current, {0: [[0, 1], [2, 0]]}, reason="rebalance", now=5.0)
    assert [v.version.version for v in versions] == [8, 9, 10, 11, 12]
    assert [v.version.phase for v in versions] == [
        P.PREFETCH,
        P.DISABLE,
        P.LOAD,
        P.ENABLE,
        P.STEADY,
    ]
    assert all(v.version.reason == "rebalance" and v.version.at == 5.0 for v in versions)
    prefetch, disable, load, enable, steady = (v.layers[0] for v in versions)
    assert prefetch.prefetch == [[], [0]]
    assert prefetch.routes(3) == current.layers[0].routes(3)
    assert disable.slots == [[0, 1], [2, 1]]
    assert disable.disabled == [[], [1]]
    assert disable.routes(3) == [[0], [0], [1]]  # expert 1 keeps its copy on server 0
    assert load.slots == [[0, 1], [2, 0]]
    assert load.disabled == [[], [0]]
    assert load.routes(3) == [[0], [0], [1]]
    assert enable.routes(3) == [[0, 1], [0], [1]]
    assert not any(enable.disabled)
    assert steady.slots == enable.slots
    assert not any(steady.disabled)


def test_a_change_taking_an_experts_last_enabled_copy_is_refused() -> None:
    current = map_of([[[0, 1], [2, 3]]], experts=4, slots=2)
    # experts 1 and 3 swap servers: each one's only copy would be disabled before the other
    # is loaded (the first found is named)
    with pytest.raises(ValueError, match=r"expert 1's every copy \(servers \[0\]\)"):
        eplb.reconfiguration(current, {0: [[0, 3], [2, 1]]}, reason="x", now=0.0)
    with pytest.raises(ValueError, match="expert 3's every copy"):  # dropped altogether
        eplb.reconfiguration(current, {0: [[0, 1], [2]]}, reason="x", now=0.0)
    assert eplb.reconfiguration(current, {0: [[0, 1], [2, 3]]}, reason="x", now=0.0) == ()
    with pytest.raises(ValueError, match="more than 2 slots"):
        eplb.reconfiguration(current, {0: [[0, 1, 2], [2, 3]]}, reason="x", now=0.0)


def enabled_copies(version: eplb.MapVersion) -> list[list[int]]:
    return [[len(r) for r in layer.routes(version.version.experts)] for layer in version.layers]


@st.composite
def pools(draw: st.DrawFn) -> tuple[eplb.MapVersion, list[list[int]], int, int]:
    servers = draw(st.integers(2, 6))
    slots = draw(st.integers(1, 4))
    min_replicas = draw(st.integers(1, min(2, servers)))
    experts = draw(st.integers(1, max(1, servers * slots // min_replicas)))
    budget = draw(st.integers(0, 6))
    # any current map within the slots: possibly short of copies (a failure took some)
    layers = draw(st.integers(1, 2))
    slot_lists = [
        [
            draw(st.lists(st.integers(0, experts - 1), max_size=slots, unique=True))
            for _ in range(servers)
        ]
        for _ in range(layers)
    ]
    counts = [draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))] * layers
    return map_of(slot_lists, experts=experts, slots=slots), counts, min_replicas, budget


@settings(max_examples=300, deadline=None)
@given(pools())
def test_no_phase_of_a_plan_leaves_an_expert_without_an_enabled_copy(
    pool: tuple[eplb.MapVersion, list[list[int]], int, int],
) -> None:
    current, counts, min_replicas, budget = pool
    result = eplb.plan(
        current, counts, min_replicas=min_replicas, budget=budget, threshold_percent=20, now=1.0
    )
    before = enabled_copies(current)
    for version in result.versions:
        for layer, copies in enumerate(enabled_copies(version)):
            for expert, n in enumerate(copies):
                assert n >= min(1, before[layer][expert]), (version.version.phase, layer, expert)
    if result.versions:
        final = enabled_copies(result.versions[-1])
        for lp in result.layers:
            for expert, n in enumerate(final[lp.layer]):
                assert n >= min_replicas or expert in lp.unplaced
            assert lp.time_after <= lp.time_before or any(
                c < min_replicas for c in before[lp.layer]
            )


# --------------------------------------------------------------------------- the decision
def test_a_balanced_pool_is_left_alone_and_a_skewed_one_rebalanced() -> None:
    current = map_of([[[0, 1], [2, 3], []]], experts=4, slots=2)
    calm = eplb.plan(current, [[10, 10, 10, 10]], min_replicas=1, budget=2,
                     threshold_percent=60, now=0.0)  # fmt: skip
    # loads 20, 20, 0: 1.5x the mean, under 60 %
    assert not calm.rebalance
    assert calm.versions == ()
    assert calm.imbalance == pytest.approx(1.5)
    hot = eplb.plan(current, [[100, 10, 10, 10]], min_replicas=1, budget=2,
                    threshold_percent=20, now=0.0)  # fmt: skip
    assert hot.rebalance
    assert next(v.version.phase for v in hot.versions) is P.PREFETCH
    assert hot.moe_time_after < hot.moe_time_before == 110
    mid = eplb.MapVersion(hot.versions[1].version, hot.versions[1].layers)
    assert not eplb.plan(mid, [[100, 10, 10, 10]], min_replicas=1, budget=2,
                         threshold_percent=20, now=0.0).rebalance  # fmt: skip


def test_a_pool_below_its_replicas_is_restored_whatever_the_balance() -> None:
    # server 2 replaced by an empty one: experts 4, 5 lost a copy
    current = map_of([[[0, 1, 4], [2, 3, 5], [], [0, 1, 2], [3]]], experts=6, slots=3)
    result = eplb.plan(current, [[0] * 6], min_replicas=2, budget=0,
                       threshold_percent=1000, now=0.0)  # fmt: skip
    assert result.rebalance
    assert "below its replicas" in result.reason
    assert result.versions[-1].layers[0].slots[2] == [4, 5]  # no tokens: ties to the first
    assert min(enabled_copies(result.versions[-1])[0]) == 2


def test_the_coverage_bound_is_refused_with_the_numbers() -> None:
    current = map_of([[[0], [1]]], experts=4, slots=1)
    with pytest.raises(ValueError, match="2 servers x 1 slots = 2 slots cannot hold 4 experts"):
        eplb.plan(current, [[1, 1, 1, 1]], min_replicas=1, budget=0, threshold_percent=20, now=0.0)


# --------------------------------------------------------------------------- Fig. 11
def zipf_counts(experts: int, hottest_over_mean: float, tokens: int, seed: int) -> list[int]:
    """Zipf popularity whose hottest expert gets ``hottest_over_mean`` times the mean (Fig. 11a's
    30x), experts shuffled so the hot ones land anywhere."""
    lo, hi = 0.0, 4.0
    for _ in range(60):  # hottest/mean = experts / H(experts, s) grows with s
        s = (lo + hi) / 2
        ratio = experts / sum(1 / k**s for k in range(1, experts + 1))
        lo, hi = (s, hi) if ratio < hottest_over_mean else (lo, s)
    weights = [1 / k**s for k in range(1, experts + 1)]
    random.Random(seed).shuffle(weights)
    total = sum(weights)
    return [round(tokens * w / total) for w in weights]


def test_eplb_cuts_the_simulated_moe_time_at_fig_11a_skew() -> None:
    """§7.1's shape scaled down: 256 experts, one redundant slot per server (64 servers x
    (4 + 1) slots), one replica each before (MoE-Native) and the budget spent after."""
    experts, servers, layers = 256, 64, 4
    counts = [zipf_counts(experts, 30.0, 1_000_000, seed) for seed in range(layers)]
    for c in counts:
        assert max(c) / (sum(c) / experts) == pytest.approx(30.0, rel=0.01)
        assert 0.1 < sum(x > sum(c) / experts for x in c) / experts < 0.3  # Fig. 11a: ~20 %
    native = [[[e for e in range(experts) if e % servers == s] for s in range(servers)]] * layers
    current = map_of(native, experts=experts, slots=5)
    result = eplb.plan(current, counts, min_replicas=1, budget=servers, threshold_percent=20,
                       now=0.0)  # fmt: skip
    reduction = 1 - result.moe_time_after / result.moe_time_before
    print(f"EPLB: simulated MoE time per iteration {result.moe_time_before:.0f} -> "
          f"{result.moe_time_after:.0f} tokens, {reduction:.1%} lower")  # fmt: skip
    assert len(result.layers) == layers
    assert all(lp.unplaced == () for lp in result.layers)
    steady = result.versions[-1]
    assert sum(
        eplb.layer_time(layer, c) for layer, c in zip(steady.layers, counts, strict=True)
    ) == (pytest.approx(result.moe_time_after))
    assert reduction >= 0.40  # Fig. 11b: "more than 40%"


def test_a_server_with_room_keeps_the_copy_it_gives_up_enabled_until_the_new_one_is() -> None:
    # server 1 (room for one more) gives expert 1 up to server 2: nothing needs its slot, so
    # expert 1 keeps both copies enabled until Enable; a full server 0 frees its slot first
    current = map_of([[[0, 1], [1], [2]]], experts=3, slots=2)
    versions = eplb.reconfiguration(current, {0: [[0, 2], [], [2, 1]]}, reason="x", now=0.0)
    _prefetch, disable, load, enable, _steady = (v.layers[0] for v in versions)
    assert disable.disabled == [[1], [], []]
    assert load.slots == [[0, 2], [1], [2, 1]]
    assert load.routes(3) == [[0], [1], [2]]  # the new copies disabled while they load
    assert enable.routes(3) == [[0], [2], [0, 2]]
