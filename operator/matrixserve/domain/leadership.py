"""Leader election on a ``coordination.k8s.io`` Lease: the decisions, as client-go's
``leaderelection`` makes them (P/D-Serve §3.7 asks for no single point of failure, and the anchors
run their controllers replicated with leader election).

Every replica of the operator serves the admission webhook; one, the leader, acts (plans,
creates, deletes, writes status, sweeps). A candidate reads the Lease every ``retry`` seconds:

- none: it creates one naming itself (the API server lets one create win);
- held by another: it waits until it has seen the same record, unchanged, for ``lease`` seconds
  (measured on its own clock from when it saw the record change: clocks need not agree), then
  takes it with an update conditional on the record's resourceVersion (one update wins);
- its own: it renews (the same conditional update), and it acts only until ``renew_deadline``
  after its last successful renewal. Past that it stops acting and exits, before any other
  candidate may take the Lease (``renew_deadline`` < ``lease``): two leaders never act at once
  whatever the network does, as long as clocks run at about the same rate.

A leader that stops releases the Lease (holder emptied), so a standby takes over within one
``retry``, not a whole ``lease``. No clock here: times come in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class NotLeading(Exception):
    """A write refused: this replica is not the leader (or its renewal is overdue)."""


@dataclass(frozen=True)
class Timing:
    """client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry."""

    lease: float = 15.0
    renew_deadline: float = 10.0
    retry: float = 2.0

    def problems(self) -> list[str]:
        out = []
        if self.lease != int(self.lease) or self.lease < 1:
            out.append(f"the lease ({self.lease:g} s) must be a whole number of seconds >= 1")
        if not self.retry > 0:
            out.append(f"the retry period ({self.retry:g} s) must be > 0")
        if not self.renew_deadline > self.retry * 1.2:
            out.append(
                f"the renew deadline ({self.renew_deadline:g} s) must exceed 1.2 x the retry "
                f"period ({self.retry:g} s)"
            )
        if not self.lease > self.renew_deadline:
            out.append(
                f"the lease ({self.lease:g} s) must be longer than the renew deadline "
                f"({self.renew_deadline:g} s): a deposed leader stops before another may lead"
            )
        return out

    def takeover_bound(self) -> float:
        """The longest a dead leader's Lease keeps the others waiting (seconds): the lease from
        when a candidate saw its last renewal, which it sees up to one retry late, and a retry
        more before it tries again."""
        return self.lease + 2 * self.retry


@dataclass(frozen=True)
class Record:
    """A Lease's spec as read (``holder`` empty: released), and its resourceVersion."""

    holder: str
    lease_seconds: int
    transitions: int
    resource_version: str
    acquire_time: str = ""  # as stored (MicroTime), kept by a renewal


class Step(Enum):
    CREATE = "create"  # no Lease: create one naming us
    TAKE = "take"  # held by no one (released or expired): take it
    RENEW = "renew"  # ours: renew it
    WAIT = "wait"  # another's, still live


@dataclass(frozen=True)
class Observed:
    """The record a candidate last saw and when it first saw it so (its own clock)."""

    record: Record | None
    since: float


def observe(previous: Observed | None, record: Record | None, now: float) -> Observed:
    """A changed record (another renewal, a new holder) restarts the candidate's wait."""
    if previous is not None and previous.record == record:
        return previous
    return Observed(record, now)


def decide(observed: Observed, me: str, timing: Timing, now: float) -> Step:
    record = observed.record
    if record is None:
        return Step.CREATE
    if record.holder == me:
        return Step.RENEW
    if not record.holder:
        return Step.TAKE
    duration = record.lease_seconds or timing.lease
    if now - observed.since >= duration:
        return Step.TAKE
    return Step.WAIT


def transitions_after(record: Record | None, me: str) -> int:
    """The Lease's leaseTransitions once we hold it: one more when the holder changes."""
    if record is None:
        return 0
    return record.transitions if record.holder == me else record.transitions + 1


def may_act(last_renewed: float | None, timing: Timing, now: float) -> bool:
    """A leader acts only within ``renew_deadline`` of its last successful renewal."""
    return last_renewed is not None and now - last_renewed < timing.renew_deadline
