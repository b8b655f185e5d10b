"""The server count from the servers' token rate (pure; EaaS §5.3, §2.4).

EaaS scales expert servers "one GPU at a time" (§1, §2.4) and saves 37.5% of them when traffic
falls from 8192 to 5120 (§5.3), but gives no policy (its configurations are static; notes 003
§7). Ours, ``[design]``:

- **the rate**: the servers' computed tokens (each report's cumulative ``tokens``, summed over
  layers and experts) between two samples at least :data:`SAMPLE_SECONDS` apart, each server's
  difference over the time between *its reports* (their ``ts``: a report is rewritten every
  health interval, so the sample's own times would be off by up to one interval per server, a
  noise of the order of the rate's), summed over the servers whose report moved (by more than
  :data:`MOVED_SECONDS`) and scaled to every server of both samples (one that restarted, or
  whose report did not move yet, is taken at their mean; one new since the last sample, a
  scale-up's, has had no traffic to speak of: none);
- **the count**: ``ceil(rate / targetTokensPerServerPerSecond)``, clamped to ``[max(minServers,
  coverage bound), maxServers]``; more servers only once the rate is over :data:`TOLERANCE`
  above what the spec's count is sized for (Kubernetes' HPA: 10%), so noise does not add one;
- **one server at a time**, not sooner than :data:`COOLDOWN_SECONDS` after the last change (a
  drain or a new server must settle, and its rate be seen, before the next step); a step down
  only when every one of the last :data:`STABILIZATION_SAMPLES` samples asked for fewer (HPA's
  downscale stabilization: one low sample is no reason to give a server up; samples are at
  least :data:`SAMPLE_SECONDS` apart, so the window is a minute or more), a step up at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.api.status import ExpertTokenSample

SAMPLE_SECONDS = 10.0  # [design] the shortest window a rate is measured over
COOLDOWN_SECONDS = 30.0  # [design] between two steps
TOLERANCE = 0.1  # [design] Kubernetes HPA's default tolerance
# a report's time as the status keeps it is rounded to the microsecond: a report moved only
# if its time did by more than this
MOVED_SECONDS = 1e-3
# [design] a step down needs this many samples in a row asking for fewer (a minute; the HPA's
# 5-minute default is for pods that come back in seconds, a server loads its slots first)
STABILIZATION_SAMPLES = 6


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
    if previous is not None and not due(previous, now):
        return previous
    tokens = {server: tokens_of(r) for server, r in sorted(reports.items())}
    reported = {server: round(r.ts, 6) for server, r in sorted(reports.items())}
    rate = rate_since(previous, tokens, reported, now) if previous is not None else None
    return ExpertTokenSample(
        at=now,
        tokens=tokens,
        reportedAt=reported,
        tokensPerSecond=rate,
        goals=list(previous.goals) if previous is not None else [],
    )


def rate_since(
    previous: ExpertTokenSample,
    tokens: Mapping[str, int],
    reported: Mapping[str, float],
    now: float,
) -> float | None:
    """Tokens per second of every server since ``previous`` (see the module's docstring);
    None when no server's report moved since."""
    rates = []
    both = [server for server in tokens if server in previous.tokens]  # new ones: none
    for server in both:
        count, before = tokens[server], previous.tokens[server]
        if count < before:  # restarted: its window is not known
            continue
        then, at = previous.reported_at.get(server, 0.0), reported.get(server, now)
        if then <= 0:  # a sample stored without report times (or unreadable): the samples'
            then, at = previous.at, now
        if at - then > MOVED_SECONDS:
            rates.append((count - before) / (at - then))
    if not rates:
        return None
    return round(sum(rates) * len(both) / len(rates), 3)


def recorded(sample: ExpertTokenSample, goal: int) -> ExpertTokenSample:
    """``sample`` with the count it asks for (the last :data:`STABILIZATION_SAMPLES` kept)."""
    goals = [*sample.goals, goal][-STABILIZATION_SAMPLES:]
    return sample.model_copy(update={"goals": goals})


def bounds(spec: ExpertPoolSpec, coverage_bound: int) -> tuple[int, int]:
    """``[max(minServers, coverage bound), maxServers]`` (max never below the low end)."""
    a = spec.autoscaling
    low = max(a.min_servers or 1, coverage_bound)
    high = max(a.max_servers or spec.servers.replicas, low)
    return low, high


def goal(spec: ExpertPoolSpec, coverage_bound: int, rate: float | None) -> int | None:
    """The count the rate asks for, within the bounds; the spec's own while the rate is over
    what it is sized for by no more than :data:`TOLERANCE`; None if it asks nothing (off, no
    rate yet). A count below the spec's is asked at the rate's own (not held at the tolerance's
    edge: one step at a time, each step would stop there)."""
    a, current = spec.autoscaling, spec.servers.replicas
    target = a.target_tokens_per_server_per_second
    if not a.enabled or target is None or rate is None:
        return None
    low, high = bounds(spec, coverage_bound)
    wanted = min(high, max(low, math.ceil(rate / target)))
    if low <= current <= high and current < wanted and rate <= current * target * (1 + TOLERANCE):
        return current
    return wanted


def servers_wanted(
    spec: ExpertPoolSpec,
    coverage_bound: int,
    sample: ExpertTokenSample | None,
    last_change: float | None,
    now: float,
) -> int | None:
    """The server count the autoscaler asks for now (one step from ``servers.replicas``), None
    if it asks nothing (off, no rate yet, cooling down, within the tolerance, a step down not
    asked for by every sample of the stabilization window, or already there)."""
    current = spec.servers.replicas
    wanted = goal(spec, coverage_bound, sample.tokens_per_second if sample else None)
    if sample is None or wanted is None or wanted == current:
        return None
    if last_change is not None and now - last_change < COOLDOWN_SECONDS:
        return None
    low, high = bounds(spec, coverage_bound)
    if current < low or current > high:  # outside the bounds (they changed): straight in
        return min(high, max(low, current))
    if wanted < current:
        window = sample.goals[-STABILIZATION_SAMPLES:]
        if len(window) < STABILIZATION_SAMPLES or max(window) >= current:
            return None
    return current + (1 if wanted > current else -1)
