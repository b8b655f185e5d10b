"""The placement policy (``domain/placement.py``): best fit within and across SuperPods, the
preferred SuperPod when it fits, the required one always, reasons naming every SuperPod's free
NPUs; property tests (no server over-committed, an instance in one SuperPod one pod per server,
a request alone placed whenever some SuperPod could hold it, determinism); the KV plane; and a
short run of ``bench-placement``'s simulation (ours ahead of first fit and spreading on the same
stream, nothing over-committed)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginestub.fabric import Plane
from matrixserve.domain.placement import (
    KvPlane,
    Placement,
    Request,
    Server,
    Unplaceable,
    fits_any_superpod,
    free_by_superpod,
    kv_plane,
    place,
)
from testkit import placement_sim as sim

pytestmark = pytest.mark.unit


def servers(**superpods: list[int]) -> list[Server]:
    """``sp_a=[8, 3]``: SuperPod ``sp-a`` with servers ``sp-a-0`` (8 free) and ``sp-a-1`` (3)."""
    return [
        Server(f"{sp.replace('_', '-')}-{i}", sp.replace("_", "-"), free)
        for sp, frees in superpods.items()
        for i, free in enumerate(frees)
    ]


# --------------------------------------------------------------------------- the policy
def test_best_fit_takes_the_fullest_superpod_and_the_fullest_servers_that_hold_the_instance() -> (
    None
):
    pool = servers(sp_0=[8, 8, 8, 8], sp_1=[8, 6, 5, 1])
    placed, refused = place([Request("i", (5, 5))], pool)
    assert refused == []
    assert placed == [Placement("i", "sp-1", ("sp-1-2", "sp-1-1"))]


def test_the_servers_come_back_in_rank_order_the_leader_s_first() -> None:
    pool = servers(sp_0=[7, 3])
    placed, _ = place([Request("i", (3, 7))], pool)
    assert placed == [Placement("i", "sp-0", ("sp-0-1", "sp-0-0"))]


def test_the_preferred_superpod_is_taken_when_it_fits_even_if_another_fits_better() -> None:
    pool = servers(sp_0=[8, 8], sp_1=[4])
    placed, _ = place([Request("p", (4,), prefer_superpod="sp-0")], pool)
    assert placed[0].superpod == "sp-0"
    placed, _ = place([Request("p", (8, 8, 8), prefer_superpod="sp-0")], pool)
    assert placed == []  # nowhere
    placed, _ = place([Request("p", (6,), prefer_superpod="sp-1")], pool)
    assert placed[0].superpod == "sp-0"  # the preferred one cannot hold it


def test_the_required_superpod_is_a_hard_requirement() -> None:
    pool = servers(sp_0=[8], sp_1=[2])
    placed, refused = place([Request("d", (4,), superpod="sp-1", prefer_superpod="sp-0")], pool)
    assert placed == []
    assert refused[0].reason.startswith("needs 1 server with 4 free NPUs in SuperPod sp-1;")


def test_requests_are_placed_in_order_each_seeing_what_the_ones_before_left() -> None:
    pool = servers(sp_0=[8])
    placed, refused = place([Request("a", (6,)), Request("b", (4,)), Request("c", (2,))], pool)
    assert [p.name for p in placed] == ["a", "c"]
    assert [u.name for u in refused] == ["b"]


def test_a_server_without_the_superpod_label_is_never_used() -> None:
    pool = [Server("loose", None, 8), *servers(sp_0=[2])]
    placed, refused = place([Request("i", (4,))], pool)
    assert placed == []
    assert refused == [
        Unplaceable(
            "i",
            "needs 1 server with 4 free NPUs in one SuperPod; free NPUs per SuperPod: "
            "sp-0 2 (largest server 2)",
        )
    ]
    _, refused = place([Request("i", (4,))], [Server("loose", None, 8)])
    assert "no server carries a SuperPod label" in refused[0].reason


def test_the_reason_says_what_it_needs_and_every_superpod_s_free_npus() -> None:
    pool = servers(sp_0=[6, 6], sp_1=[0, 0])
    _, refused = place([Request("d", (8, 8))], pool)
    assert refused[0].reason == (
        "needs 2 servers with 8 free NPUs each in one SuperPod; free NPUs per SuperPod: "
        "sp-0 12 (largest server 6), sp-1 0 (largest server 0)"
    )
    _, refused = place([Request("d", (7, 6, 6))], pool)
    assert refused[0].reason.startswith("needs 3 servers with at least 7, 6, 6 free NPUs in")
    _, refused = place([Request("d", (1,), superpod="sp-9")], pool)
    assert "in SuperPod sp-9 (no server carries it)" in refused[0].reason


@pytest.mark.parametrize(
    ("requests", "pool", "message"),
    [
        ([Request("i", ())], servers(sp_0=[8]), "instance i has no pods"),
        ([Request("i", (0,))], servers(sp_0=[8]), "a pod of 0 NPUs"),
        ([Request("i", (1,)), Request("i", (1,))], servers(sp_0=[8]), "asked to be placed twice"),
        ([Request("i", (1,))], [Server("s", "sp", 8), Server("s", "sp", 8)], "listed twice"),
        ([Request("i", (1,))], [Server("s", "sp", -1)], "has -1 free NPUs"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(
    requests: list[Request], pool: list[Server], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        place(requests, pool)


def test_free_by_superpod_counts_labelled_servers_only() -> None:
    pool = [*servers(sp_1=[3, 4], sp_0=[8]), Server("loose", None, 8)]
    assert free_by_superpod(pool) == {"sp-0": 8, "sp-1": 7}
    assert list(free_by_superpod(pool)) == ["sp-0", "sp-1"]


def test_an_instance_larger_than_any_superpod_does_not_fit_one() -> None:
    capacity = {"sp-0": (48, 8), "sp-1": (28, 8)}
    assert fits_any_superpod((8,) * 48, capacity)
    assert not fits_any_superpod((8,) * 49, capacity)  # more pods than servers
    assert not fits_any_superpod((9,), capacity)  # a pod larger than a server
    assert not fits_any_superpod((1,), {})
    with pytest.raises(ValueError, match="no pods"):
        fits_any_superpod((), capacity)


def test_the_kv_plane_is_ub_only_inside_one_known_superpod() -> None:
    assert kv_plane("sp-0", "sp-0") is KvPlane.UB
    assert kv_plane("sp-0", "sp-1") is KvPlane.ROCE
    assert kv_plane(None, None) is KvPlane.ROCE
    assert kv_plane("sp-0", None) is KvPlane.ROCE


def test_the_kv_plane_values_are_the_engine_s() -> None:
    assert {p.value for p in KvPlane} <= {p.value for p in Plane}
    assert Plane(KvPlane.UB.value) is Plane.UB
    assert Plane(KvPlane.ROCE.value) is Plane.ROCE


# --------------------------------------------------------------------------- properties
SUPERPODS = ["sp-a", "sp-b", "sp-c"]

server_lists = st.lists(
    st.tuples(st.sampled_from([*SUPERPODS, None]), st.integers(0, 8)), min_size=0, max_size=14
).map(lambda xs: [Server(f"s{i:02d}", sp, free) for i, (sp, free) in enumerate(xs)])

request_lists = st.lists(
    st.tuples(
        st.lists(st.integers(1, 8), min_size=1, max_size=4),
        st.sampled_from([*SUPERPODS, None]),
        st.sampled_from([*SUPERPODS, None]),
    ),
    min_size=1,
    max_size=6,
).map(
    lambda xs: [
        Request(f"r{i}", tuple(pods), superpod=need, prefer_superpod=prefer)
        for i, (pods, need, prefer) in enumerate(xs)
    ]
)


@settings(max_examples=300, deadline=None)
@given(requests=request_lists, pool=server_lists)
def test_placements_never_overcommit_and_keep_each_instance_in_one_superpod_one_pod_per_server(
    requests: list[Request], pool: list[Server]
) -> None:
    placed, refused = place(requests, pool)
    assert {p.name for p in placed} | {u.name for u in refused} == {r.name for r in requests}
    by_name = {s.name: s for s in pool}
    pods = {r.name: r for r in requests}
    used: Counter[str] = Counter()
    for p in placed:
        r = pods[p.name]
        assert len(p.servers) == len(r.pods)
        assert len(set(p.servers)) == len(p.servers)  # one pod per server
        assert {by_name[s].superpod for s in p.servers} == {p.superpod}  # one SuperPod
        assert r.superpod in (None, p.superpod)
        for s, npus in zip(p.servers, r.pods, strict=True):
            used[s] += npus
    for s, npus in used.items():
        assert npus <= by_name[s].free_npus


def _fits_alone(r: Request, pool: list[Server]) -> bool:
    """Brute force: some SuperPod (the required one) has distinct servers that hold the pods."""
    for sp in {s.superpod for s in pool} - {None}:
        if r.superpod not in (None, sp):
            continue
        mine = [s for s in pool if s.superpod == sp]
        for combo in itertools.permutations(mine, len(r.pods)):
            if all(s.free_npus >= n for s, n in zip(combo, r.pods, strict=True)):
                return True
    return False


@settings(max_examples=300, deadline=None)
@given(requests=request_lists, pool=server_lists.filter(lambda p: len(p) <= 9))
def test_a_request_alone_is_placed_whenever_some_superpod_could_hold_it(
    requests: list[Request], pool: list[Server]
) -> None:
    r = requests[0]
    placed, _ = place([r], pool)
    assert bool(placed) == _fits_alone(r, pool)
    if placed and r.prefer_superpod is not None:
        preferred = Request(r.name, r.pods, superpod=r.prefer_superpod)
        if r.superpod in (None, r.prefer_superpod) and _fits_alone(preferred, pool):
            assert placed[0].superpod == r.prefer_superpod


@settings(max_examples=200, deadline=None)
@given(requests=request_lists, pool=server_lists)
def test_every_reason_names_every_superpod_s_free_npus(
    requests: list[Request], pool: list[Server]
) -> None:
    _, refused = place(requests, pool)
    for u in refused:
        for sp in {s.superpod for s in pool} - {None}:
            assert f" {sp} " in u.reason


@settings(max_examples=200, deadline=None)
@given(requests=request_lists, pool=server_lists, data=st.data())
def test_placement_is_deterministic_whatever_the_servers_order(
    requests: list[Request], pool: list[Server], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(pool))
    assert place(requests, pool) == place(requests, shuffled)


# --------------------------------------------------------------------------- the simulation
def test_the_block_sizes_have_the_paper_s_mean_and_every_size_up_to_48() -> None:
    weights = sim.block_weights()
    assert len(weights) == 48
    assert min(weights) > 0
    assert sum(weights) == pytest.approx(1.0)
    assert sum(n * p for n, p in enumerate(weights, start=1)) == pytest.approx(10.08, abs=1e-6)


@pytest.mark.parametrize(
    ("npus", "pods"),
    [(1, (1,)), (8, (8,)), (9, (5, 4)), (10, (5, 5)), (17, (6, 6, 5)), (48, (8,) * 6)],
)
def test_an_instance_spans_ceil_n_over_8_servers_in_near_equal_pods(
    npus: int, pods: tuple[int, ...]
) -> None:
    assert sim.pods_of(npus) == pods


@pytest.mark.parametrize(
    ("npus", "pods"),
    [(1, (1,)), (8, (8,)), (9, (8, 1)), (10, (8, 2)), (17, (8, 8, 1)), (48, (8,) * 6)],
)
def test_a_server_aligned_instance_takes_whole_servers_and_the_remainder(
    npus: int, pods: tuple[int, ...]
) -> None:
    assert sim.pods_of(npus, aligned=True) == pods


def test_a_short_simulation_ours_ahead_of_both_baselines_and_nothing_overcommitted() -> None:
    cluster = sim.Cluster(superpods=3, servers_per_superpod=28)
    runs = {
        name: sim.simulate(fn, cluster, seed=5, warmup=1.0, horizon=6.0)
        for name, fn in (("ours", place), ("firstfit", sim.first_fit), ("spread", sim.spread))
    }
    for out in runs.values():
        assert out.overcommits == 0
        assert out.split_instances == 0
        assert out.instances_placed > 200
    # in near-equal pods, nobody beats their bound by more than the placed mix drifting from the
    # offered one; server-aligned pods do (they leave holes only on their last server)
    equal = sim.simulate(place, dataclasses.replace(cluster, aligned=False), 5, 1.0, 6.0)
    bound = sim.one_pod_per_server_bound(sim.block_weights())
    assert equal.allocation < bound + 0.02
    assert runs["ours"].allocation > bound
    assert runs["ours"].allocation > runs["firstfit"].allocation
    assert runs["ours"].allocation > runs["spread"].allocation
    assert runs["ours"].pairs_same_superpod / runs["ours"].pairs > (
        runs["spread"].pairs_same_superpod / runs["spread"].pairs
    )


def test_the_same_seed_gives_the_same_stream_and_the_same_run() -> None:
    a = list(itertools.islice(sim.stream(3), 50))
    assert a == list(itertools.islice(sim.stream(3), 50))
    assert a != list(itertools.islice(sim.stream(4), 50))
    cluster = sim.Cluster(superpods=2, servers_per_superpod=4)
    assert sim.simulate(place, cluster, 3, 0.5, 2.0) == sim.simulate(place, cluster, 3, 0.5, 2.0)
