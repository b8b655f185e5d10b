"""Leader election: the pure decisions (domain/leadership.py) and the Leadership loop over a
Lease held in memory (one layer's unit test; the real Lease is tests/cluster/test_leader_election.py)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from matrixserve.domain import leadership as le
from matrixserve.domain.leadership import NotLeading, Record, Step, Timing
from matrixserve.handlers.leadership import Leadership, lead_or_gone

T = Timing(lease=15, renew_deadline=10, retry=2)


def rec(holder: str, rv: str = "1", seconds: int = 15, transitions: int = 0) -> Record:
    return Record(holder, seconds, transitions, rv)


def test_no_lease_is_created_and_a_released_one_is_taken() -> None:
    assert le.decide(le.observe(None, None, 0), "a", T, 0) is Step.CREATE
    assert le.decide(le.observe(None, rec(""), 0), "a", T, 0) is Step.TAKE


def test_our_own_lease_is_renewed() -> None:
    assert le.decide(le.observe(None, rec("a"), 0), "a", T, 100) is Step.RENEW


def test_another_holder_is_waited_out_from_when_its_record_last_changed() -> None:
    seen = le.observe(None, rec("b", "1"), now=0)
    assert le.decide(seen, "a", T, 14.9) is Step.WAIT
    # b renewed at 10 (a new resourceVersion): the wait starts again from then
    renewed = le.observe(seen, rec("b", "2"), now=10)
    assert renewed.since == 10
    assert le.decide(renewed, "a", T, 24.9) is Step.WAIT
    assert le.decide(renewed, "a", T, 25) is Step.TAKE
    # the same record read again does not restart the wait
    assert le.observe(renewed, rec("b", "2"), now=20).since == 10


def test_the_lease_duration_of_the_record_counts_not_ours() -> None:
    seen = le.observe(None, rec("b", seconds=1), now=0)
    assert le.decide(seen, "a", T, 0.9) is Step.WAIT
    assert le.decide(seen, "a", T, 1) is Step.TAKE


def test_transitions_count_changes_of_holder() -> None:
    assert le.transitions_after(None, "a") == 0
    assert le.transitions_after(rec("a", transitions=3), "a") == 3
    assert le.transitions_after(rec("b", transitions=3), "a") == 4


def test_a_leader_acts_only_within_the_renew_deadline() -> None:
    assert not le.may_act(None, T, 0)
    assert le.may_act(100, T, 109.9)
    assert not le.may_act(100, T, 110)


def test_timings_that_could_let_two_leaders_act_are_refused() -> None:
    assert T.problems() == []
    assert any("longer than the renew deadline" in p for p in Timing(10, 10, 2).problems())
    assert any("1.2 x the retry" in p for p in Timing(15, 2, 2).problems())
    assert any("> 0" in p for p in Timing(15, 10, 0).problems())
    assert T.takeover_bound() == 19
    assert any("whole number" in p for p in Timing(2.5, 2, 1).problems())


class MemoryLease:
    """A Lease in memory with the API server's optimistic concurrency."""

    namespace, name, uid = "ns", "lease", None

    def __init__(self) -> None:
        self.record: Record | None = None
        self.version = 0
        self.fail = False
        self.events: list[str] = []

    async def event(self, reason: str, message: str) -> None:
        self.events.append(f"{reason}: {message}")

    async def read(self) -> Record | None:
        if self.fail:
            raise ConnectionError("API server away")
        return self.record

    async def create(self, holder: str, seconds: int) -> bool:
        if self.record is not None:
            return False
        self.version += 1
        self.record = Record(holder, seconds, 0, str(self.version))
        return True

    async def write(
        self, record: Record, holder: str, seconds: int, transitions: int, acquired: bool
    ) -> bool:
        if self.fail:
            raise ConnectionError("API server away")
        if self.record is None or self.record.resource_version != record.resource_version:
            return False
        self.version += 1
        self.record = Record(holder, seconds, transitions, str(self.version))
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def leader(lease: MemoryLease, me: str, clock: Clock) -> Leadership:
    return Leadership(me, lease, T, CollectorRegistry(), clock=clock)  # type: ignore[arg-type]


async def test_one_of_two_candidates_leads_and_the_other_takes_over_after_the_lease() -> None:
    lease, clock = MemoryLease(), Clock()
    a, b = leader(lease, "a", clock), leader(lease, "b", clock)
    gained: list[str] = []
    a.on_gained.append(lambda: gained.append("a"))
    b.on_gained.append(lambda: gained.append("b"))
    assert await a._try()
    a.last_renewed = clock.now
    assert not await b._try()
    assert a.may_act()
    assert not b.may_act()
    with pytest.raises(NotLeading):
        b.check()
    assert not await b.wait(timeout=0.01)
    # a dies: b takes the Lease once it has seen it unchanged for the lease's duration
    clock.now += 14
    assert not await b._try()
    clock.now += 1
    assert await b._try()
    assert lease.record is not None
    assert lease.record.holder == "b"
    assert lease.record.transitions == 1
    # a, deposed meanwhile (its renewal overdue), may not act whatever it thinks
    assert not a.may_act()


async def test_the_loop_gains_then_loses_when_renewals_fail_past_the_deadline() -> None:
    lease, clock = MemoryLease(), Clock()
    a = leader(lease, "a", clock)
    a.timing = Timing(lease=0.5, renew_deadline=0.3, retry=0.02)
    lost: list[bool] = []
    a.on_lost.append(lambda: lost.append(True))
    a.clock = asyncio.get_running_loop().time
    task = asyncio.create_task(a.run())
    assert await a.wait(timeout=2)
    assert a.gauge._value.get() == 1
    await asyncio.sleep(0)
    assert lease.events == ["LeaderElection: a became the leader"]
    lease.fail = True  # the API server goes away: no renewal
    await asyncio.wait_for(task, timeout=2)
    assert lost == [True]
    assert not a.may_act()
    assert a.gauge._value.get() == 0


async def test_release_empties_the_holder_so_a_standby_need_not_wait_the_lease_out() -> None:
    lease, clock = MemoryLease(), Clock()
    a, b = leader(lease, "a", clock), leader(lease, "b", clock)
    assert await a._try()
    a.last_renewed = clock.now
    a.leading.set()
    assert not await b._try()
    await a.release()
    assert lease.record is not None
    assert lease.record.holder == ""
    assert not a.may_act()
    assert await b._try()  # at once, not 15 s later


def test_without_a_lease_it_always_leads() -> None:
    alone = Leadership("", None, T, CollectorRegistry())
    assert alone.may_act()
    assert not alone.elected
    alone.check()


async def test_a_leader_that_finds_the_lease_in_other_hands_stops_at_once() -> None:
    lease, clock = MemoryLease(), Clock()
    a = leader(lease, "a", clock)
    lost: list[bool] = []
    a.on_lost.append(lambda: lost.append(True))
    assert await a._try()
    a.last_renewed = clock.now
    a.leading.set()
    lease.version += 1
    lease.record = Record("intruder", 600, 1, str(lease.version))  # edited, or made again
    assert not await a._try()
    assert lost == [True]
    assert not a.may_act()  # well within its renew deadline


async def test_a_renewal_that_never_answers_ends_the_leadership_by_the_deadline() -> None:
    lease, clock = MemoryLease(), Clock()
    a = leader(lease, "a", clock)
    a.timing = Timing(lease=1, renew_deadline=0.3, retry=0.05)
    a.clock = asyncio.get_running_loop().time
    lost: list[bool] = []
    a.on_lost.append(lambda: lost.append(True))
    task = asyncio.create_task(a.run())
    assert await a.wait(timeout=2)
    hang = asyncio.Event()

    async def never(*_: object) -> None:
        await hang.wait()

    lease.read = never  # type: ignore[method-assign]  # the API server holds the call
    await asyncio.wait_for(task, timeout=3)
    assert lost == [True]
    assert not a.may_act()


async def test_a_standbys_handler_waits_until_it_leads_or_the_work_is_gone() -> None:
    lease, clock = MemoryLease(), Clock()
    a = leader(lease, "a", clock)
    lease.record = Record("b", 15, 0, "1")  # another leads
    looks: list[int] = []

    async def pending() -> bool:
        looks.append(1)
        if len(looks) == 1:
            raise ConnectionError("a failed look counts as still pending")
        return len(looks) < 3

    assert not await lead_or_gone(a, pending, every=0.01)
    assert len(looks) == 3
    alone = Leadership("", None, T, CollectorRegistry())
    assert await lead_or_gone(alone, pending, every=0.01)
