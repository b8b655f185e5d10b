"""The server count from the servers' token rate (pure; EaaS §5.3, §2.4).

EaaS scales expert servers "one GPU at a time" (§1, §2.4) and saves 37.5% of them when traffic
falls from 8192 to 5120 (§5.3), but gives no policy (its configurations are static; notes 003
§7). Ours, ``[design]``: the rate is the servers' computed tokens (each report's cumulative
``tokens``, summed over layers and experts) between two samples at least
:data:`SAMPLE_SECONDS` apart, divided by the time between them (a server that restarted counts
from zero); the count wanted is ``ceil(rate / targetTokensPerServerPerSecond)``, clamped to
``[max(minServers, coverage bound), maxServers]``; the pool moves one server towards it at a
time, and not sooner than :data:`COOLDOWN_SECONDS` after its last change (a drain or a new
server must settle, and its rate be seen, before the next step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.api.status import ExpertTokenSample

SAMPLE_SECONDS = 10.0  # [design] the shortest window a rate is measured over
COOLDOWN_SECONDS = 30.0  # [design] between two steps


def tokens_of(report: zl.ExpertServerReport) -> int:
    """A server's cumulative tokens over every layer and expert."""
    return sum(sum(by_expert.values()) for by_expert in report.tokens.values())


def due(previous: ExpertTokenSample | None, now: float) -> bool:
    """Whether a pass at ``now`` takes a new sample (the autoscaler's and EPLB's window)."""
    return previous is None or now - previous.at >= SAMPLE_SECONDS


def sample(
    previous: ExpertTokenSample | None,
    reports: Mapping[str, zl.ExpertServerReport],
    now: float,
) -> ExpertTokenSample:
    """The sample to keep: a new one (with the rate since ``previous``) once
    :data:`SAMPLE_SECONDS` have passed, else ``previous``."""
    tokens = {server: tokens_of(r) for server, r in sorted(reports.items())}
    if previous is not None and not due(previous, now):
        return previous
    rate = None
    if previous is not None and now > previous.at:
        # a server that restarted (fewer tokens than before) counts from zero
        delta = 0
        for server, now_tokens in tokens.items():
            before = previous.tokens.get(server)
            fresh = before is None or now_tokens < before
            delta += now_tokens if fresh else now_tokens - (before or 0)
        rate = round(delta / (now - previous.at), 3)
    return ExpertTokenSample(at=now, tokens=tokens, tokensPerSecond=rate)


def bounds(spec: ExpertPoolSpec, coverage_bound: int) -> tuple[int, int]:
    """``[max(minServers, coverage bound), maxServers]`` (max never below the low end)."""
    a = spec.autoscaling
    low = max(a.min_servers or 1, coverage_bound)
    high = max(a.max_servers or spec.servers.replicas, low)
    return low, high


def servers_wanted(
    spec: ExpertPoolSpec,
    coverage_bound: int,
    rate: float | None,
    last_change: float | None,
    now: float,
) -> int | None:
    """The server count the autoscaler asks for now (one step from ``servers.replicas``), None
    if it asks nothing (off, no rate yet, cooling down, or already there)."""
    a, current = spec.autoscaling, spec.servers.replicas
    if not a.enabled or a.target_tokens_per_server_per_second is None or rate is None:
        return None
    low, high = bounds(spec, coverage_bound)
    goal = min(high, max(low, math.ceil(rate / a.target_tokens_per_server_per_second)))
    if goal == current:
        return None
    if last_change is not None and now - last_change < COOLDOWN_SECONDS:
        return None
    if current < low or current > high:  # outside the bounds (they changed): straight in
        return min(high, max(low, current))
    return current + (1 if goal > current else -1)
