"""The §2.1 model and the Model policy's target (pure): a split, the figures a window gives,
the two roles' capacities and Φ, the decodes' TPOT by batch, the bounds a split must keep, and
Eq. (1)'s target with its hysteresis (:func:`model_target`). The vocabulary every other part of
the ratio control speaks (:class:`Split`, :class:`Decision`, the role names) is here, so the
observation, the feedback rule and the walk depend on it and not on each other."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from matrixserve.api.status import RatioStatus, Split

PREFILL = "prefill"
DECODE = "decode"
TRAFFIC = "traffic"


class Transition(StrEnum):
    FIXED_TOTAL = "FixedTotal"  # release first, then add: the total never exceeds the spec's
    ELASTIC = "Elastic"  # add first, then release: capacity never dips during a move


# ------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Figures:
    """The §2.1 inputs over one window, as observed (seconds, requests)."""

    ttft_bs: float  # TTFT_bs: a prefill's TTFT at its batch size
    b_p: float  # the prefill batch size those TTFTs were at
    tpot_bs: float  # TPOT_bs
    b_d: float  # the decode batch size
    xi: float  # ξ: the KV transfer (the slowest sub-transfer)
    g: float  # G: the mean tokens generated per request
    r_pre: float = 1.0  # the prefix caches' benefit (1: none)
    traffic: float | None = None  # I_t, requests per second (None: not known)
    # how TPOT_bs was had: the decodes' TPOT as a line in their batch (None: TPOT as measured,
    # whatever the batch it was measured at), and the mean batch it was measured at
    line: DecodeLine | None = None
    batch_seen: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_bs", "b_p", "tpot_bs", "b_d", "g", "r_pre"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, not {value!r}")
        if not (math.isfinite(self.xi) and self.xi >= 0):
            raise ValueError(f"xi must be a number of seconds >= 0, not {self.xi!r}")
        if self.r_pre > 1:
            raise ValueError(f"r_pre is in (0, 1], not {self.r_pre!r}")
        if self.traffic is not None and not (math.isfinite(self.traffic) and self.traffic >= 0):
            raise ValueError(f"traffic must be >= 0 requests per second, not {self.traffic!r}")

    @property
    def t_p(self) -> float:
        return self.ttft_bs * self.r_pre

    @property
    def t_d(self) -> float:
        return self.xi + self.tpot_bs * self.g

    @property
    def e2e(self) -> float:
        return self.t_p + self.t_d

    @property
    def c_prefill(self) -> float:
        """One prefill instance's capacity, ``b_p / T_p`` (requests per second)."""
        return self.b_p / self.t_p

    @property
    def c_decode(self) -> float:
        """One decode instance's capacity, ``b_d / T_d``."""
        return self.b_d / self.t_d

    def balanced_ratio(self) -> float:
        """Eq. (1)'s ``n_p / n_d`` (``b_d·T_p / (b_p·T_d)``), before rounding."""
        return self.c_decode / self.c_prefill


@dataclass(frozen=True)
class Capacity:
    """A split's §2.1 figures: the two roles' capacities, Φ and the bottleneck."""

    c_p: float  # n_p · b_p / T_p
    c_d: float  # n_d · b_d / T_d
    phi: float  # Φ, requests per second per instance
    bottleneck: str  # "prefill", "decode", or "traffic" (I_t is the smallest term)

    def as_status(self) -> RatioStatus:
        """The figures ``status.ratio`` says (and nothing else of it)."""
        return RatioStatus(
            phi=rounded(self.phi),
            prefill_capacity=rounded(self.c_p),
            decode_capacity=rounded(self.c_d),
            bottleneck=self.bottleneck,
        )


def capacity(figures: Figures, split: Split) -> Capacity:
    """§2.1's Φ for ``split``; a tie between the roles is called for prefill (the scarcer
    first-token path); the traffic is the bottleneck only when it is below both."""
    c_p = split.prefill * figures.c_prefill
    c_d = split.decode * figures.c_decode
    bottleneck = PREFILL if c_p <= c_d else DECODE
    served = min(c_p, c_d)
    if figures.traffic is not None and figures.traffic < served:
        served, bottleneck = figures.traffic, TRAFFIC
    return Capacity(c_p, c_d, served / split.total, bottleneck)


# ------------------------------------------------------------------ the decode's cost by batch
@dataclass(frozen=True)
class BatchPoint:
    """The decodes' mean batch over a window and their mean TPOT at it (emulated seconds)."""

    batch: float
    tpot: float


@dataclass(frozen=True)
class DecodeLine:
    """TPOT as a line in the decode batch, ``TPOT(b) = fixed + per_request · b``: §2.1 writes
    ``TPOT_bs``, the TPOT at the batch size ``bs``, and a decode step is memory-bound (001
    §4.2: it reads the weights once and every request's KV), so each request in the batch adds
    the same time whatever the batch. ``how`` says where the line came from."""

    fixed: float
    per_request: float
    how: str

    def tpot(self, batch: float) -> float:
        return self.fixed + self.per_request * batch

    def batch_serving(self, rate: float, xi: float, g: float, most: float) -> float:
        """The batch a decode runs to finish ``rate`` requests per second: Little's law,
        ``b = rate · (ξ + G · TPOT(b))``, at most ``most`` (then it is saturated)."""
        room = 1.0 - rate * g * self.per_request
        if room <= 0:
            return most
        return min(most, rate * (xi + g * self.fixed) / room)


# [design] measured batches this far apart (a share of the full batch) give the line its slope;
# closer, the TPOTs' own noise would be most of it
BATCH_SPREAD = 0.25


def decode_line(
    seen: BatchPoint, others: Iterable[BatchPoint], full: float, shape: float | None
) -> DecodeLine | None:
    """The decodes' TPOT by batch from what was measured: ``seen`` (this window) and ``others``
    (the same load served at other splits), by least squares, when their batches spread over
    ``BATCH_SPREAD`` of the ``full`` batch and the line rises; else the line through ``seen``
    with the roofline's shape, ``shape`` being the model's weight bytes over one request's KV
    bytes (a step reads both: the line is 0 at ``-shape`` requests); else None (nothing says
    how TPOT moves with the batch)."""
    if seen.batch <= 0 or seen.tpot <= 0:
        return None
    points = [seen, *(p for p in others if p.batch > 0 and p.tpot > 0)]
    batches = [p.batch for p in points]
    if len(points) > 1 and max(batches) - min(batches) >= BATCH_SPREAD * full:
        n = len(points)
        mean_b = sum(batches) / n
        mean_t = sum(p.tpot for p in points) / n
        var = sum((b - mean_b) ** 2 for b in batches)
        slope = sum((p.batch - mean_b) * (p.tpot - mean_t) for p in points) / var
        fixed = mean_t - slope * mean_b
        if slope > 0 and fixed > 0:
            seen_at = ", ".join(f"{b:.0f}" for b in sorted(batches))
            return DecodeLine(fixed, slope, f"measured at batches {seen_at}")
    if shape is not None and shape > 0 and math.isfinite(shape):
        per = seen.tpot / (shape + seen.batch)
        return DecodeLine(per * shape, per, f"roofline from batch {seen.batch:.1f}")
    return None


# ------------------------------------------------------------------------------ the bounds
@dataclass(frozen=True)
class Bounds:
    """What a split may be: per-role minimum and maximum, the ratio's range, and an optional
    ladder of allowed splits (MindCluster's ``scaling-rule``: the split moves along it)."""

    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None
    min_ratio: float | None = None  # n_p / n_d
    max_ratio: float | None = None
    ladder: tuple[Split, ...] = ()

    def allows(self, split: Split) -> bool:
        p, d = split.prefill, split.decode
        if p < max(1, self.min_prefill) or d < max(1, self.min_decode):
            return False
        if self.max_prefill is not None and p > self.max_prefill:
            return False
        if self.max_decode is not None and d > self.max_decode:
            return False
        if self.min_ratio is not None and p < self.min_ratio * d - 1e-9:
            return False
        if self.max_ratio is not None and p > self.max_ratio * d + 1e-9:
            return False
        return not self.ladder or split in self.ladder

    def splits(self, total: int) -> list[Split]:
        """Every allowed split of ``total`` instances, most prefill first."""
        return [s for p in range(total - 1, 0, -1) if self.allows(s := Split(p, total - p))]


# ------------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Decision:
    """What a policy decided: the target split, whether it differs from the current one, why,
    and the numbers behind it (for the status, the Event and the metrics)."""

    target: Split
    changed: bool
    reason: str
    numbers: Mapping[str, float] = field(default_factory=dict)
    # the target was measured better than the current split (a move taken back because the
    # windows after it were worse than those before it): the walk's guards take it as such
    measured_better: bool = False


def rounded(value: float) -> float:
    return round(value, 4) if math.isfinite(value) else value


def fallback_split(total: int, bounds: Bounds, current: Split) -> Split:
    """The split of ``total`` kept when no figures say better: the current one if allowed and of
    that total, else the allowed split nearest to the current ratio; ValueError if no split of
    ``total`` is allowed (the spec's validation refuses such a spec first)."""
    allowed = bounds.splits(total)
    if not allowed:
        raise ValueError(f"no split of {total} instances is within the ratio policy's bounds")
    if current in allowed:
        return current
    ratio = current.prefill / max(current.decode, 1)
    return min(allowed, key=lambda s: (abs(s.prefill / s.decode - ratio), -s.prefill))


def _at_full_batch(figures: Figures) -> str:
    line = figures.line
    if line is None:
        return ""
    return (
        f" at a full batch of {figures.b_d:.0f}, TPOT {figures.tpot_bs * 1000:.1f} ms "
        f"against {line.tpot(figures.batch_seen) * 1000:.1f} ms at the {figures.batch_seen:.1f} "
        f"seen ({line.how})"
    )


def model_target(
    figures: Figures, total: int, bounds: Bounds, current: Split, margin: float = 0.05
) -> Decision:
    """Eq. (1): the allowed split of ``total`` with the largest ``min(C_p, C_d)``; a tie goes to
    the split nearest ``current``. ``current`` is kept (if it is an allowed split of ``total``)
    unless the best one serves ``margin`` more, so a ratio that sits on a rounding boundary
    stays put."""
    allowed = bounds.splits(total)
    if not allowed:
        raise ValueError(f"no split of {total} instances is within the ratio policy's bounds")

    def served(split: Split) -> float:
        cap = capacity(figures, split)
        return min(cap.c_p, cap.c_d)

    best = max(allowed, key=lambda s: (served(s), -abs(s.prefill - current.prefill)))
    numbers = {
        "Tp": rounded(figures.t_p),
        "Td": rounded(figures.t_d),
        "E2E": rounded(figures.e2e),
        "balancedRatio": rounded(figures.balanced_ratio()),
        "capacityNow": rounded(served(current)) if current.total == total else 0.0,
        "capacityTarget": rounded(served(best)),
    }
    line = figures.line
    if line is not None:
        # each split at its own load: the batch its decodes would run serving what it serves
        def batch_at(split: Split) -> float:
            rate = served(split) / split.decode
            return line.batch_serving(rate, figures.xi, figures.g, figures.b_d)

        numbers |= {
            "batchSeen": rounded(figures.batch_seen),
            "tpotSeen": rounded(line.tpot(figures.batch_seen)),
            "tpotFullBatch": rounded(figures.tpot_bs),
            "batchTarget": rounded(batch_at(best)),
            "TdTarget": rounded(figures.xi + line.tpot(batch_at(best)) * figures.g),
        }
    if current in allowed and served(best) <= served(current) * (1 + margin):
        return Decision(
            current,
            False,
            f"Eq. (1) balances at {figures.balanced_ratio():.2f} prefill per decode; "
            f"{current} is within {margin:.0%} of the best split of {total}",
            numbers,
        )
    why = (
        f"Eq. (1) balances at {figures.balanced_ratio():.2f} prefill per decode "
        f"(T_p {figures.t_p:.3f} s, T_d {figures.t_d:.3f} s{_at_full_batch(figures)}): {best} "
        f"serves {served(best):.2f} req/s"
    )
    if current.total == total:
        why += f" against {served(current):.2f} at {current}"
    return Decision(best, best != current, why, numbers)
