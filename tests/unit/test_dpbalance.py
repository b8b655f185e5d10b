"""Decode DP load balancing (xDeepServe §4.3; notes 000 §5.1 B1-B3): full groups excluded, the
lowest KV usage with the long outputs' reservation, counters on dispatch and completion, stats
periodic; round-robin the baseline."""

from __future__ import annotations

import pytest

from matrixserve.api.dpbalance import Balancer, GroupLoad
from matrixserve.api.resources import DPLoadBalancing

pytestmark = pytest.mark.unit
LOWEST, RR = DPLoadBalancing.LOWEST_KV_USAGE, DPLoadBalancing.ROUND_ROBIN


def groups(*used: int, limit: int = 4, capacity: int = 1000) -> list[GroupLoad]:
    return [GroupLoad(i, limit, capacity, kv_used=u) for i, u in enumerate(used)]


def test_the_lowest_kv_usage_wins_among_groups_not_full() -> None:
    b = Balancer(LOWEST, groups(700, 200, 500, limit=1))
    assert b.choose(10) == 1  # B2: 0.7 / 0.2 / 0.5
    b.dispatched(1, "r1", 10)  # now at its batch limit of 1
    assert b.choose(10) == 2  # B1: the full one excluded, the next lowest
    b.dispatched(2, "r2", 10)
    b.dispatched(0, "r3", 10)
    assert b.choose(10) is None  # every group full: the request waits
    b.completed(1, "r1")  # B3: its counter down on completion
    assert b.choose(10) == 1


def test_the_reservation_for_long_outputs_counts_with_the_kv_held() -> None:
    b = Balancer(LOWEST, groups(100, 300))
    # group 0 holds little but its running requests may still take 400 tokens of output
    b.stats(0, kv_used=100, kv_reserved=400, counted=[])
    assert b.choose(10) == 1
    # a request too big for what group 1 has left goes where it fits
    assert b.choose(800) is None  # neither has 800 free: 500 and 700 taken
    b.stats(0, kv_used=100, kv_reserved=0, counted=[])
    assert b.choose(800) == 0


def test_a_request_dispatched_since_the_stats_counts_its_whole_reservation() -> None:
    b = Balancer(LOWEST, groups(0, 0, limit=8))
    assert b.choose(300) == 0  # a tie: the lower index
    b.dispatched(0, "long", 300)  # not in any stats yet: its prompt and output bound count
    assert b.groups[0].load() == 300
    assert b.choose(100) == 1
    b.dispatched(1, "short", 100)
    assert b.choose(100) == 1  # 200 / 1000 against 400 / 1000
    # group 0's next stats count the long request: its held and still-to-come tokens instead
    b.stats(0, kv_used=120, kv_reserved=150, counted=["long"])
    assert b.groups[0].load() == 270
    b.completed(0, "long")
    b.stats(0, kv_used=0, kv_reserved=0, counted=[])
    assert b.groups[0].load() == 0
    assert b.choose(100) == 0


def test_an_unhealthy_group_takes_nothing_under_either_policy() -> None:
    for policy in (LOWEST, RR):
        b = Balancer(policy, groups(0, 500))
        b.stats(0, kv_used=0, kv_reserved=0, counted=[], healthy=False)
        assert [b.choose(10) for _ in range(3)] == [1, 1, 1], policy
        b.stats(1, kv_used=500, kv_reserved=0, counted=[], healthy=False)
        assert b.choose(10) is None


def test_round_robin_takes_turns_whatever_the_kv_passing_over_full_groups() -> None:
    b = Balancer(RR, groups(900, 0, 0, limit=1))
    assert b.choose(10) == 0  # its KV is nothing to it
    b.dispatched(0, "a", 10)
    assert b.choose(10) == 1
    b.dispatched(1, "b", 10)
    assert b.choose(10) == 2
    b.dispatched(2, "c", 10)
    assert b.choose(10) is None
    b.completed(1, "b")
    assert b.choose(10) == 1


def test_counters_and_bad_input() -> None:
    b = Balancer(LOWEST, groups(0, 0))
    b.dispatched(0, "r", 10)
    with pytest.raises(ValueError, match="already running"):
        b.dispatched(0, "r", 10)
    b.completed(0, "r")
    b.completed(0, "r")  # twice: nothing more
    b.completed(1, "never")
    assert all(not g.running for g in b.groups.values())
    with pytest.raises(ValueError, match="negative"):
        b.stats(0, kv_used=-1, kv_reserved=0, counted=[])
    with pytest.raises(ValueError, match="not negative"):
        b.choose(-5)
    with pytest.raises(ValueError, match="at least one"):
        Balancer(LOWEST, [])
    with pytest.raises(ValueError, match="repeat"):
        Balancer(LOWEST, [GroupLoad(0, 1, 10), GroupLoad(0, 1, 10)])
