"""Gateway forwarding policies (P/D-Serve §3.5), pure.

- **on-demand** (ours): order the prefill entrances by the requests each is still prefilling as
  the gateway sees them (accepted, no first token yet: the prefill's own feedback, "based on the
  number of connections and prefill feedbacks"), then by fewest open SSE connections (ties keep
  the entrances' order, "organized in order"); try them one after another until one accepts or
  the TTFT budget is spent. Prefill never queues. Batch forwarding ("continuously forwards the
  requests to one idle prefill until it is busy"): the prefill that accepted last goes first
  while it is among the least busy. The engines batch prefill continuously (concurrent prompts
  share its compute, "or using chunked prefill for continuous batching"), so piling a batch onto
  one prefill while another idles would only stretch every prompt's TTFT.
- **round-robin** (baseline): the next entrance in turn.
- **least-loaded** (baseline): the entrance with the smallest queue in its last periodic report,
  which is stale between reports (the P/D-Serve baseline: "reporting the queue every 100ms").

The baselines commit to their one choice and ask the prefill to queue the request (the paper's
original version); each policy is a :class:`ForwardingPolicy` saying so, so the gateway asks the
policy instead of branching on its name. Also here: a request's TTFT threshold by its prompt's
length (§2.2.2), the budget the forwarding spends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from matrixserve.api.engine_protocol import Admission, TtftBudget


class Policy(StrEnum):
    """The gateway's forwarding policy (``--policy``): ours, or one of the two baselines."""

    ON_DEMAND = "on-demand"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class Entrance:
    """A prefill instance open to new requests (a group's ``entrances/`` in ZooKeeper)."""

    instance: str
    address: str  # host:port of the prefill's engine


def entrances_from_status(status: Mapping[str, Any] | None) -> list[Entrance]:
    """The entrances a PDGroup's status lists, with the endpoints its instance rows report: the
    gateway's route while ZooKeeper is out of reach (the last state the operator published).
    Entrances without a serving instance row or endpoint are left out."""
    if not status:
        return []
    rows = {
        r.get("name"): r
        for r in status.get("instances") or []
        if isinstance(r, Mapping) and r.get("state") == "Serving" and r.get("endpoint")
    }
    found = []
    for name in status.get("entrances") or []:
        row = rows.get(name)
        if row is not None:
            found.append(Entrance(str(name), str(row["endpoint"])))
    return found


# --------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class Loads:
    """What one gateway knows of the prefills when it orders them, for one round (its live
    counts: ordering reads them at once, without awaiting)."""

    open_streams: Mapping[str, int]  # open SSE streams per prefill
    in_prefill: Mapping[str, int] = field(default_factory=dict)  # accepted, no first token yet
    reported: Mapping[str, int] = field(default_factory=dict)  # last periodic queue reports
    last_accepted: str | None = None  # the scenario's prefill that accepted last
    turn: int = 0  # the gateway's round counter


Rank = Callable[[Sequence[Entrance], Loads], list[Entrance]]


def _by_feedback(entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
    """On-demand: fewest prompts in prefill, then fewest open streams; the prefill that accepted
    last first while it is among the least busy (batch forwarding)."""
    prefilling, streams = loads.in_prefill, loads.open_streams

    def load(e: Entrance) -> tuple[int, int]:
        return prefilling.get(e.instance, 0), streams.get(e.instance, 0)

    ranked = sorted(entrances, key=load)  # stable: ties keep the entrances' order
    last = loads.last_accepted
    if last is not None:
        sticky = [e for e in ranked if e.instance == last]
        if sticky and prefilling.get(last, 0) == prefilling.get(ranked[0].instance, 0):
            ranked = sticky + [e for e in ranked if e.instance != last]
    return ranked


def _in_turn(entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
    start = loads.turn % len(entrances)
    return [*entrances[start:], *entrances[:start]]


def _by_reports(entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
    reported = loads.reported
    return sorted(entrances, key=lambda e: reported.get(e.instance, 0))


@dataclass(frozen=True)
class ForwardingPolicy:
    """One forwarding policy: the order it tries entrances in, and what it asks of them. The
    defaults are the baselines' (one try, the prefill queues)."""

    policy: Policy
    rank: Rank
    commits: bool = True  # tries its first choice only (the prefill then queues)
    admission: Admission = "queue"  # what it asks a busy prefill to do
    skips_held: bool = False  # passes over a prefill whose every slot its own requests hold
    polls_reports: bool = False  # orders by the prefills' periodic queue reports

    def order(self, entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
        """The entrances in the order to try them."""
        if not entrances:
            return []
        return self.rank(entrances, loads)

    def choices(self, entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
        """The entrances to try this round, in order."""
        ranked = self.order(entrances, loads)
        return ranked[:1] if self.commits else ranked


POLICIES: Mapping[Policy, ForwardingPolicy] = {
    p.policy: p
    for p in (
        ForwardingPolicy(
            Policy.ON_DEMAND, _by_feedback, commits=False, admission="reject", skips_held=True
        ),
        ForwardingPolicy(Policy.ROUND_ROBIN, _in_turn),
        ForwardingPolicy(Policy.LEAST_LOADED, _by_reports, polls_reports=True),
    )
}


def order(
    policy: Policy,
    entrances: Sequence[Entrance],
    open_streams: Mapping[str, int],
    *,
    last_accepted: str | None = None,
    turn: int = 0,
    reported_load: Mapping[str, int] | None = None,
    in_prefill: Mapping[str, int] | None = None,
) -> list[Entrance]:
    """The entrances in the order ``policy`` tries them."""
    loads = Loads(open_streams, in_prefill or {}, reported_load or {}, last_accepted, turn)
    return POLICIES[policy].order(entrances, loads)


def ttft_threshold_ms(base_ms: float, per_1k_tokens_ms: float, prompt_tokens: int) -> float:
    """A prompt's TTFT threshold: P/D-Serve §2.2.2 has thresholds depend on the prompt's length
    ("the timeout threshold for 1k is quite different from that of 8k"); here a base plus a part
    per thousand prompt tokens (``slo.ttftMilliseconds`` + ``slo.ttftMillisecondsPer1kTokens``)."""
    return base_ms + per_1k_tokens_ms * prompt_tokens / 1000.0


def request_budget(
    slos: Iterable[tuple[int | None, int]], prompt_tokens: int, default_ms: int
) -> TtftBudget:
    """A request's TTFT budget: the tightest threshold, for a prompt of this length, among the
    groups serving its scenario that set one (``(ttftMilliseconds, per 1k tokens)`` each);
    ``default_ms`` if none does."""
    return TtftBudget.from_milliseconds(
        min(
            (
                ttft_threshold_ms(base or 0, per_1k, prompt_tokens)
                for base, per_1k in slos
                if base or per_1k
            ),
            default=float(default_ms),
        )
    )
