"""Decode DP load balancing (pure): which DP group of a domain takes a request (xDeepServe §4.3;
notes 000 §2.5, B1-B3).

The paper: "Each DP group supports a fixed batch size. When full, it must block incoming
requests until others finish, which increases both time-to-second-token (TTST) and TPOT ... we
first exclude DP groups that have reached their batch limit. Among the rest, we select the group
with the lowest KV cache usage, accounting for reserved space needed for long outputs." The
TE-shell "updates the pending request count on dispatch and completion, and collects periodic KV
cache stats".

Here, :attr:`~matrixserve.api.resources.DPLoadBalancing.LOWEST_KV_USAGE`:

- a group's running count goes up when a request is dispatched to it and down when it completes
  (the chooser's own counters, exact between two stats);
- its KV load is its last stats' (the tokens its requests hold, and the tokens they may still
  take: each running request's output bound less what it has generated, the reservation for
  long outputs), plus the whole reservation (prompt and output bound) of each request
  dispatched to it that those stats did not count yet;
- excluded: a group not healthy, at its batch limit, or without room for the request's own
  reservation; among the rest, the lowest load over capacity (the request's reservation
  included), ties to the lower index;
- None when every group is excluded: the request waits; it is not assigned (B1).

:attr:`~matrixserve.api.resources.DPLoadBalancing.ROUND_ROBIN`, the baseline (a prefill's turn
over its decodes today): the next healthy group in turn that is not at its batch limit, whatever
its KV.

In ``matrixserve.api`` because both sides use it: the domain's dispatcher in the engine stub
(which may import only ``matrixserve.api``) and the controller, for the groups' status.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from matrixserve.api.resources import DPLoadBalancing


@dataclass
class GroupLoad:
    """One DP group as the chooser sees it."""

    index: int
    batch_limit: int  # requests it decodes at once (the domain's ``batchSize``)
    kv_capacity: int  # KV tokens it can hold
    healthy: bool = True
    kv_used: int = 0  # tokens its requests hold, as of its last stats
    kv_reserved: int = 0  # tokens its requests may still take (output bounds), same stats
    counted: frozenset[str] = frozenset()  # the requests those stats counted
    running: dict[str, int] = field(default_factory=dict)  # request -> its whole reservation

    def load(self) -> int:
        """KV tokens it holds or keeps for its requests: the stats', and the whole reservation
        of each request dispatched that they did not count yet."""
        fresh = sum(r for request, r in self.running.items() if request not in self.counted)
        return self.kv_used + self.kv_reserved + fresh

    def usage(self) -> float:
        """Its KV load over its capacity (0..1, more when it overcommitted)."""
        return self.load() / self.kv_capacity if self.kv_capacity > 0 else 1.0

    def full(self) -> bool:
        return len(self.running) >= self.batch_limit


class Balancer:
    """A domain's DP groups and the policy that picks one per request."""

    def __init__(self, policy: DPLoadBalancing, groups: Sequence[GroupLoad]) -> None:
        if not groups:
            raise ValueError("a domain has at least one DP group")
        indices = [g.index for g in groups]
        if len(set(indices)) != len(indices):
            raise ValueError(f"DP group indices repeat: {indices}")
        self.policy = policy
        self.groups = {g.index: g for g in sorted(groups, key=lambda g: g.index)}
        self._turn = 0  # RoundRobin: where the next search starts, in index order

    def choose(self, reservation: int) -> int | None:
        """The group to dispatch a request of ``reservation`` KV tokens (its prompt and its
        output bound) to, or None: every group is excluded, the request waits."""
        if reservation < 0:
            raise ValueError(f"a reservation is not negative: {reservation}")
        order = list(self.groups.values())
        if self.policy is DPLoadBalancing.ROUND_ROBIN:
            for step in range(len(order)):
                group = order[(self._turn + step) % len(order)]
                if group.healthy and not group.full():
                    self._turn = (self._turn + step + 1) % len(order)
                    return group.index
            return None
        open_ = [
            g
            for g in order
            if g.healthy and not g.full() and g.load() + reservation <= g.kv_capacity
        ]
        if not open_:
            return None
        best = min(open_, key=lambda g: ((g.load() + reservation) / g.kv_capacity, g.index))
        return best.index

    def dispatched(self, index: int, request: str, reservation: int) -> None:
        """``request`` went to group ``index`` (its counter up, its reservation kept)."""
        group = self.groups[index]
        if request in group.running:
            raise ValueError(f"request {request} is already running on DP group {index}")
        group.running[request] = reservation

    def completed(self, index: int, request: str) -> None:
        """``request`` ended on group ``index``, however it ended (its counter down); one that
        is not running there (completed twice, or never dispatched) changes nothing."""
        self.groups[index].running.pop(request, None)

    def stats(
        self,
        index: int,
        kv_used: int,
        kv_reserved: int,
        counted: Collection[str],
        healthy: bool = True,
    ) -> None:
        """Group ``index``'s periodic stats: the tokens its requests hold and may still take,
        the requests they count, whether it is healthy."""
        if kv_used < 0 or kv_reserved < 0:
            raise ValueError(f"negative KV stats for DP group {index}: {kv_used}, {kv_reserved}")
        group = self.groups[index]
        group.kv_used, group.kv_reserved = kv_used, kv_reserved
        group.counted = frozenset(counted)
        group.healthy = healthy
