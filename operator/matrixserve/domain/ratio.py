"""P/D ratio control (pure; issue 19): the §2.1 model, the Eq. (1) target, the feedback rule.

P/D-Serve (arXiv:2408.08147) §2.1 gives the model, per group of ``n_p`` prefill and ``n_d``
decode instances:

- ``T_p = TTFT_bs · r_pre`` (the TTFT at the prefill's batch size, ``r_pre`` the benefit of
  prefix-aware KV caches: 1 without a prefix cache, as the engine stub has);
- ``T_d = ξ + TPOT_bs · G`` (``ξ`` the KV transfer, ``G`` the mean tokens generated);
- ``E2E = T_p + T_d``;
- ``Φ = min{I_t, n_p·b_p/T_p, n_d·b_d/T_d} / (n_p + n_d)``: the throughput per instance, the
  numerator's smallest term the bottleneck (:class:`Capacity`, ``C_p`` and ``C_d``).

Two policies choose the split (§3.3, "Ratio Adjustment for Changes"):

- **Model** (:func:`model_target`): Eq. (1), ``n_p·b_p/T_p ≈ n_d·b_d/T_d``, from figures
  observed on the engines (never from the engine stub's timing model): the integer split of the
  total with both roles' capacities closest to balance, i.e. the largest ``min(C_p, C_d)``,
  within the bounds and on the ladder; kept unless the target's capacity is ``margin`` better
  (hysteresis), so figures that wobble around a rounding boundary do not move an instance back
  and forth.
- **Feedback** (:class:`Feedback`): "with the increase on both E2E latency and the proportion of
  TTFT, more prefill instances are needed; ... with the increase on E2E latency but decrease on
  the proportion of TTFT, more decoding instances are needed", and §4.2's "gradually increase the
  instances" — after a move, another in the same direction while it pays (a lower E2E, or, for
  a saturated group, more requests served per second: :func:`compare`), one move back if it
  made things worse, then settled. The paper gives no thresholds, window, step or cooldown:
  those are ours (``[design]``), as is treating prefill refusals as an alarm (with on-demand
  forwarding a prefill that is too weak refuses rather than queues, so the wait is at the
  gateway and the engines' TTFT does not rise: NVIDIA Dynamo's planner misses exactly this
  burst) — for prefill, or for decode when the refusing prefills' slots are mostly held by KV
  that no decode has taken yet (§3.5's back-pressure); such slots are a decode alarm even
  without refusals (§4.2: "some KVCaches wait in prefill for idle decoding"), and slots full of
  prompts a prefill alarm — and judging E2E only against its own baseline, never an SLO (an SLO
  that cannot be met must not freeze the ratio or block a scale-down, Dynamo's third bug). A
  role whose move did not pay is *refuted*: the saturation alarms (refusals, slots) no longer
  ask for it until the load changes (a rise of E2E, a new total, or the saturation gone).

Both give a **target** split; :func:`next_step` walks to it one instance at a time, in one of two
modes (§3.3: "If the overall number of instances is fixed ..., gradually release part of the
instances and add them to the other groups to form new P/D ratio. Otherwise, the adjustments may
involve new instances (for intermediate steps, and may release redundant ones after
adjustments)"): ``FixedTotal`` releases an instance of the role that has too many first, then
adds one of the other; ``Elastic`` adds first, then releases. The paper moves instances between
groups of a scenario; moving them inside one group is our ``[design]``.

Every decision carries its reason and the numbers behind it (:class:`Decision`). No clock here:
callers pass the time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from matrixserve.api import zk_layout as zl

PREFILL = "prefill"
DECODE = "decode"
TRAFFIC = "traffic"


class Transition(StrEnum):
    FIXED_TOTAL = "FixedTotal"  # release first, then add: the total never exceeds the spec's
    ELASTIC = "Elastic"  # add first, then release: capacity never dips during a move


@dataclass(frozen=True)
class Split:
    """A P/D split: ``prefill`` and ``decode`` instances."""

    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"

    @classmethod
    def parse(cls, text: str) -> Split:
        """``"P:D"`` (both whole numbers of at least 1), or ValueError saying why."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{text!r} is not P:D (two whole numbers, e.g. 3:1)")
        p, d = (int(x) for x in parts)
        if p < 1 or d < 1:
            raise ValueError(f"{text!r}: each role needs at least one instance")
        return cls(p, d)


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

    def as_status(self) -> dict[str, float | str]:
        return {
            "phi": _round(self.phi),
            "prefillCapacity": _round(self.c_p),
            "decodeCapacity": _round(self.c_d),
            "bottleneck": self.bottleneck,
        }


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


# ------------------------------------------------------------------------ the observation
# The engines' health reports carry what each has served since its process started
# (zk_layout.Load); a window is the difference of two reports of one process, summed over a
# role's instances. Emulated seconds throughout.
def load_delta(old: zl.Load, new: zl.Load) -> zl.Load | None:
    """What was served between two reports; None if a counter went back (another process)."""
    diff = {}
    for f in zl.Load.model_fields:
        a, b = getattr(old, f), getattr(new, f)
        if b < a:
            return None
        diff[f] = b - a
    return zl.Load.model_validate(diff)


def load_sum(loads: Iterable[zl.Load]) -> zl.Load:
    total: dict[str, float] = dict.fromkeys(zl.Load.model_fields, 0)
    for load in loads:
        for f in total:
            total[f] += getattr(load, f)
    return zl.Load.model_validate(total)


def figures_of(
    prefill: zl.Load,
    decode: zl.Load,
    decode_batch: int,
    least: int = 1,
    kv_share: float | None = None,
    others: Iterable[BatchPoint] = (),
) -> Figures | None:
    """§2.1's inputs from a window's sums, or None with fewer than ``least`` requests through
    either role. ``TTFT_bs`` is the prefills' mean TTFT; their capacity is what they served per
    busy second (prompts share a prefill's compute, so that is its throughput at any batch) and
    ``b_p`` the batch that gives it at that TTFT; ``ξ`` and ``G`` the decodes' means and ``b_d``
    their configured batch. ``TPOT_bs`` is the TPOT at ``b_d``, predicted from the TPOT measured
    at the batch the decodes ran (:func:`decode_line`; ``others``: what other splits of the same
    load measured; ``kv_share``: the model's KV bytes per token over its weight bytes, for the
    roofline's shape): an underloaded decode's TPOT is below its full batch's, and taken as it
    is, it makes the decodes' capacity read high at a split that leaves them half idle — and
    right at one that fills them (issue 29)."""
    if prefill.prefilled < least or decode.decoded < least or decode.tokens < 1:
        return None
    if prefill.busy_s <= 0 or prefill.ttft_s <= 0 or decode.tpot_s <= 0:
        return None
    ttft = prefill.ttft_s / prefill.prefilled
    c_p = prefill.prefilled / prefill.busy_s
    g = max(decode.output_tokens / decode.decoded, 1.0)
    tpot = decode.tpot_s / decode.tokens
    line = None
    batch = decode.batch_sum / decode.iterations if decode.iterations else 0.0
    if batch > 0:
        # a decode's request holds its prompt's KV and, on average, half its answer's
        context = prefill.prompt_tokens / prefill.prefilled + g / 2
        shape = 1.0 / (kv_share * context) if kv_share and context > 0 else None
        line = decode_line(BatchPoint(batch, tpot), others, float(decode_batch), shape)
    return Figures(
        ttft_bs=ttft,
        b_p=c_p * ttft,
        tpot_bs=line.tpot(decode_batch) if line is not None else tpot,
        b_d=float(decode_batch),
        xi=decode.kv_s / decode.kv_pulls if decode.kv_pulls else 0.0,
        g=g,
        line=line,
        batch_seen=batch,
    )


def signal_of(
    prefill: zl.Load,
    decode: zl.Load,
    least: int = 1,
    slot_capacity_s: float = 0.0,
    window_s: float = 0.0,
) -> Signal | None:
    """The feedback rule's inputs from a window's sums, or None with too few requests: T_p the
    prefills' mean TTFT; E2E that plus the mean wait of a prefilled prompt's KV for a decode
    plus the decodes' mean time per request (KV pull to the last token); the refused share of
    the offers, the slots' share waiting for a decode, the share of the prefills' slot capacity
    held (``slot_capacity_s``: the window's emulated seconds times the prefills' slots; 0: not
    known), and the requests the decodes finished over the window's emulated seconds
    (``window_s``; 0: not known)."""
    if prefill.prefilled < least or decode.decoded < least:
        return None
    t_p = prefill.ttft_s / prefill.prefilled
    # a slot is given back once the decode has pulled the KV, and the decode's time starts
    # before its pull: the pull (ξ) is in both, counted once
    xi = decode.kv_s / decode.kv_pulls if decode.kv_pulls else 0.0
    wait = max(prefill.kv_wait_s / prefill.prefilled - xi, 0.0)
    return Signal(
        e2e=t_p + wait + decode.decode_s / decode.decoded,
        t_p=t_p,
        rejected=prefill.refused / prefill.offered if prefill.offered else 0.0,
        kv_wait=prefill.kv_wait_s / prefill.slot_s if prefill.slot_s > 0 else 0.0,
        slots_held=min(prefill.slot_s / slot_capacity_s, 1.0) if slot_capacity_s > 0 else 0.0,
        finished=decode.decoded if window_s > 0 else 0,
        seconds=max(window_s, 0.0),
    )


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


def _round(value: float) -> float:
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
        "Tp": _round(figures.t_p),
        "Td": _round(figures.t_d),
        "E2E": _round(figures.e2e),
        "balancedRatio": _round(figures.balanced_ratio()),
        "capacityNow": _round(served(current)) if current.total == total else 0.0,
        "capacityTarget": _round(served(best)),
    }
    line = figures.line
    if line is not None:
        # each split at its own load: the batch its decodes would run serving what it serves
        def batch_at(split: Split) -> float:
            rate = served(split) / split.decode
            return line.batch_serving(rate, figures.xi, figures.g, figures.b_d)

        numbers |= {
            "batchSeen": _round(figures.batch_seen),
            "tpotSeen": _round(line.tpot(figures.batch_seen)),
            "tpotFullBatch": _round(figures.tpot_bs),
            "batchTarget": _round(batch_at(best)),
            "TdTarget": _round(figures.xi + line.tpot(batch_at(best)) * figures.g),
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


# ---------------------------------------------------------------------------- the feedback
@dataclass(frozen=True)
class Signal:
    """One window's feedback inputs, as the engines saw them (a wait at the gateway is not in
    them): E2E and T_p, the fraction of prefill offers refused, and the rest below."""

    e2e: float
    t_p: float
    rejected: float = 0.0  # refused offers / all offers to the prefills, 0..1
    # of the prefills' slot time, the share spent holding a finished prompt's KV until a decode
    # took it (P/D-Serve §3.5: "a prompt continuously occupies one slot in prefill if it is
    # waiting for KVCache transfer to a decoding"): refusals with most slots waiting are the
    # decodes' back-pressure, not the prefills' weakness
    kv_wait: float = 0.0
    # the share of the prefills' slot capacity held over the window: a gateway that counts the
    # slots it holds offers nothing to a full prefill, so a prefill short of slots shows here,
    # not in refusals (the requests wait at the gateway)
    slots_held: float = 0.0
    # requests finished over the window's ``seconds`` (0 seconds: not known)
    finished: int = 0
    seconds: float = 0.0

    @property
    def served(self) -> float:
        """Requests finished per second (0: not known)."""
        return self.finished / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefill_share(self) -> float:
        """T_p / E2E, the "proportion of TTFT"."""
        return self.t_p / self.e2e if self.e2e > 0 else 0.0


@dataclass(frozen=True)
class FeedbackParams:
    """The feedback rule's knobs (``[design]``: the paper gives none)."""

    e2e_rise: float = 0.2  # "E2E increases dramatically": this fraction over its baseline
    share_delta: float = 0.05  # T_p/E2E moved by this much (absolute) from its baseline
    rejection: float = 0.05  # this fraction of offers refused is an alarm by itself: for ...
    kv_wait: float = 0.4  # ... decode if the prefills' slots waited this much for decodes
    slots_full: float = 0.9  # the prefills' slots held this much, not waiting: a prefill alarm
    windows: int = 3  # an alarm must hold this many windows in a row (the trend)
    # after a move, this much better (served if saturated, else E2E): another the same way;
    # this much worse (saturated: or served less within the noise, still saturated): back
    improve: float = 0.05
    cooldown: float = 300.0  # seconds between two changes


def _number(raw: Mapping[str, object], key: str) -> float | None:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _count(raw: Mapping[str, object], key: str) -> int:
    value = raw.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True)
class Tally:
    """Windows summed, so that a move is judged on their means and not on one window's noise:
    E2E (the windows' means summed), the requests finished and the seconds they took, and how
    many windows found the group saturated."""

    windows: int = 0
    e2e: float = 0.0
    finished: float = 0.0
    seconds: float = 0.0
    saturated: float = 0.0

    def add(self, signal: Signal, saturated: bool, keep: int) -> Tally:
        """With one more window, as a mean of at most the last ``keep`` windows' worth (an
        alarm that lasts through a cooldown is judged on its recent windows, not all of it)."""
        more = Tally(
            self.windows + 1,
            self.e2e + signal.e2e,
            self.finished + signal.finished,
            self.seconds + signal.seconds,
            self.saturated + float(saturated),
        )
        if more.windows <= keep:
            return more
        f = keep / more.windows
        return Tally(keep, more.e2e * f, more.finished * f, more.seconds * f, more.saturated * f)

    @property
    def mean_e2e(self) -> float:
        return self.e2e / self.windows if self.windows else 0.0

    @property
    def served(self) -> float:
        """Requests finished per second (0: not known)."""
        return self.finished / self.seconds if self.seconds > 0 else 0.0

    @property
    def is_saturated(self) -> bool:
        """Saturated in most of its windows."""
        return 2 * self.saturated > self.windows

    def to_status(self) -> dict[str, object]:
        return {
            "windows": self.windows,
            "e2e": self.e2e,
            "finished": self.finished,
            "seconds": self.seconds,
            "saturated": self.saturated,
        }

    @classmethod
    def from_status(cls, raw: object) -> Tally:
        if not isinstance(raw, Mapping):
            return cls()
        windows = _count(raw, "windows")
        sums = [_number(raw, k) for k in ("e2e", "finished", "seconds", "saturated")]
        if not windows or any(v is None or v < 0 for v in sums):
            return cls()
        e2e, finished, seconds, saturated = (float(v or 0.0) for v in sums)
        return cls(windows, e2e, finished, seconds, min(saturated, float(windows)))


# a difference in requests served per second counts only this many standard deviations out
# (the counts' Poisson noise: two windows of 20 requests cannot tell 5 %)
SIGNIFICANT = 2.0


def compare(before: Tally, after: Tally, improve: float) -> tuple[int, str]:
    """+1 if ``after`` is better than ``before`` by ``improve``, -1 if worse by as much, else 0;
    and the figures that say so. A saturated group (its prefills' slots full, or refusing)
    has a backlog the engines do not see — a closed load's clients, the gateway's queue, offers
    tried again — whose wait the engines' E2E does not hold, so it is judged by what it
    serves per second (Little's law: the same backlog served faster waits less): better or
    worse by a difference that is both ``improve`` and ``SIGNIFICANT`` standard deviations of
    the counts' Poisson noise; without one, worse if it served less and is still saturated.
    Unsaturated before and after (the load is served either way), by E2E."""
    if (before.is_saturated or after.is_saturated) and min(before.served, after.served) > 0:
        b, a = before.served, after.served
        noise = math.sqrt(before.finished / before.seconds**2 + after.finished / after.seconds**2)
        served = f"served {b:.3g} requests/s before, {a:.3g} after (saturated)"
        if abs(a - b) >= SIGNIFICANT * noise:
            if a >= b * (1 + improve):
                return 1, served
            if a <= b * (1 - improve):
                return -1, served
        # no clear difference. Not judged by E2E: saturated, the engines' E2E holds the wait
        # in the prefills' slots (a decode-short split) but not the one at the gateway (a
        # prefill-short one), so it prefers the prefill-short split whatever each serves
        # (issue 29). A move whose windows served less, still saturated, is not kept (the step
        # back costs the walk's one reversal, no more); one that served as much or more, or
        # ended the saturation (the load is served now), is.
        if a < b and after.is_saturated:
            return -1, f"{served}: less, within the noise"
        return 0, f"{served}: no less, within the noise"
    b, a = before.mean_e2e, after.mean_e2e
    said = f"E2E {b:.3f} s before, {a:.3f} s after"
    if b <= 0:
        return 0, said
    if a <= b * (1 - improve):
        return 1, said
    if a >= b * (1 + improve):
        return -1, said
    return 0, said


@dataclass(frozen=True)
class FeedbackState:
    """What the rule remembers between windows (kept in the group's status)."""

    baseline_e2e: float | None = None
    baseline_share: float | None = None
    alarm: str | None = None  # the role the current alarm asks for
    trend: Tally = Tally()  # the windows in a row with that alarm
    last_change: float | None = None  # when the split last changed (the caller's clock)
    moving: str | None = None  # the role the last move added, while its effect is judged
    before: Tally | None = None  # the windows that move is judged against
    # the roles whose move made things worse (taken back): the saturation alarms (refusals,
    # slots) no longer ask for them — a group past its capacity refuses at every
    # split, a closed load fills the slots at every split — until the load changes: a rise of
    # E2E, a new total, or ``windows`` windows in a row without saturation (``calm``)
    refuted: tuple[str, ...] = ()
    calm: int = 0
    # after a move: the windows judged so far (judged once there are ``windows`` of them: one
    # window's noise neither takes a move back nor sends it further)
    judged: Tally = Tally()

    @property
    def streak(self) -> int:
        return self.trend.windows

    def to_status(self) -> dict[str, object]:
        return {
            "baselineE2E": self.baseline_e2e,
            "baselineShare": self.baseline_share,
            "alarm": self.alarm,
            "streak": self.streak,
            "trend": self.trend.to_status(),
            "lastChange": self.last_change,
            "moving": self.moving,
            "before": self.before.to_status() if self.before is not None else None,
            "refuted": list(self.refuted),
            "calm": self.calm,
            "judged": self.judged.to_status(),
        }

    @classmethod
    def from_status(cls, raw: Mapping[str, object] | None) -> FeedbackState:
        """Read back what :meth:`to_status` wrote; anything unreadable starts afresh (a status
        of an earlier operator with a move being judged: that move is kept, not judged)."""
        if not raw:
            return cls()

        def role(key: str) -> str | None:
            value = raw.get(key)
            return value if isinstance(value, str) and value in (PREFILL, DECODE) else None

        before = Tally.from_status(raw.get("before"))
        moving = role("moving")
        refuted = raw.get("refuted")
        roles = refuted if isinstance(refuted, list) else []
        return cls(
            baseline_e2e=_number(raw, "baselineE2E"),
            baseline_share=_number(raw, "baselineShare"),
            alarm=role("alarm"),
            trend=Tally.from_status(raw.get("trend")),
            last_change=_number(raw, "lastChange"),
            # a move is judged only against what asked for it
            moving=moving if before.windows else None,
            before=before if before.windows and moving else None,
            refuted=tuple(sorted({r for r in (PREFILL, DECODE) if r in roles})),
            calm=_count(raw, "calm"),
            judged=Tally.from_status(raw.get("judged")),
        )


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def moved(split: Split, role: str, total: int) -> Split:
    """``split`` with one instance more of ``role`` in a group of ``total`` (fixed total: one
    fewer of the other; a total grown or shrunk meanwhile is met by the other role)."""
    p = split.prefill + (1 if role == PREFILL else 0)
    d = split.decode + (1 if role == DECODE else 0)
    if role == PREFILL:
        d = total - p
    else:
        p = total - d
    return Split(p, d)


class Feedback:
    """The §3.3 rule over a stream of windows (pure: state in, decision and state out)."""

    def __init__(self, params: FeedbackParams, bounds: Bounds) -> None:
        self.params = params
        self.bounds = bounds

    def decide(
        self, state: FeedbackState, signal: Signal, current: Split, total: int, now: float
    ) -> tuple[Decision, FeedbackState]:
        p = self.params
        numbers = {
            "E2E": _round(signal.e2e),
            "Tp": _round(signal.t_p),
            "TpShare": _round(signal.prefill_share),
            "rejected": _round(signal.rejected),
            "served": _round(signal.served),
        }
        if current.total != total or not self.bounds.allows(current):
            # the total changed (a scale of the group) or the split is out of bounds: the
            # split of the new total nearest the current ratio, and a fresh baseline after it
            target = fallback_split(total, self.bounds, current)
            return (
                Decision(target, target != current, f"the total is {total}: {target}", numbers),
                replace(FeedbackState(), last_change=now if target != current else None),
            )
        cooling = state.last_change is not None and now - state.last_change < p.cooldown
        saturated = self.saturated(signal)
        # after a move: judged once the cooldown is over (the figures have settled), on as many
        # windows as an alarm's trend
        if state.moving is not None and state.before is not None:
            if cooling:
                return Decision(current, False, "cooling down after a move", numbers), state
            judged = state.judged.add(signal, saturated, p.windows)
            if judged.windows < p.windows:
                why = f"judging one more {state.moving} ({judged.windows}/{p.windows} windows)"
                return Decision(current, False, why, numbers), replace(state, judged=judged)
            return self._judge(
                state.moving, state.before, state, judged, signal, current, total, now, numbers
            )

        # the saturation gone for a trend's windows: the load changed, nothing stays refuted
        calm = 0 if saturated else state.calm + 1
        refuted = () if calm >= p.windows else state.refuted
        state = replace(state, calm=calm, refuted=refuted)
        if state.baseline_e2e is None or state.baseline_share is None:
            fresh = replace(
                state,
                baseline_e2e=signal.e2e,
                baseline_share=signal.prefill_share,
                trend=Tally(),
            )
            return Decision(current, False, "baseline taken", numbers), fresh

        alarm, why, rise = self._alarm(state.baseline_e2e, state.baseline_share, refuted, signal)
        # the alarm's windows in a row: this one added to the last ones if it asks the same
        trend = Tally()
        if alarm is not None:
            since = state.trend if alarm == state.alarm else Tally()
            trend = since.add(signal, saturated, p.windows)
        # E2E lower than the baseline: the baseline follows it down (a later rise is measured
        # from the best the group has done since it settled)
        baseline = min(state.baseline_e2e, signal.e2e)
        state = replace(state, alarm=alarm, trend=trend, baseline_e2e=baseline)
        if alarm is None:
            return Decision(current, False, "no alarm", numbers), state
        streak = trend.windows
        numbers = {**numbers, "baselineE2E": _round(baseline), "streak": float(streak)}
        if streak < p.windows:
            return Decision(current, False, f"{why} ({streak}/{p.windows} windows)", numbers), state
        if cooling:
            return Decision(current, False, f"{why}; cooling down", numbers), state
        target = moved(current, alarm, total)
        if not self.bounds.allows(target):
            return Decision(current, False, f"{why}; {target} is out of bounds", numbers), state
        after = FeedbackState(
            last_change=now,
            moving=alarm,
            before=trend,
            # a rise of E2E is a change of the load: what did not pay before may now
            refuted=() if rise else refuted,
        )
        return Decision(target, True, f"{why}: one more {alarm}", numbers), after

    def saturated(self, signal: Signal) -> bool:
        """The prefills' slots full or refusing: a backlog waits where the engines cannot see
        it (the gateway's queue, a closed load's clients, offers tried again)."""
        p = self.params
        return signal.slots_held >= p.slots_full or signal.rejected >= p.rejection

    def _alarm(
        self, base_e2e: float, base: float, refuted: tuple[str, ...], signal: Signal
    ) -> tuple[str | None, str, bool]:
        """The role the window asks for, why, and whether it is a rise of E2E (§3.3's own
        trigger) rather than a saturation alarm."""
        p = self.params
        waiting = f"slots held by KV waiting for a decode {signal.kv_wait:.0%} of the time"
        # the slots wait for decodes (kvWait of their time): the decodes are short; they
        # compute (waiting less than half of that): the prefills are; in between, neither —
        # a gap, so that the two alarms do not take turns about one threshold
        short = (
            DECODE
            if signal.kv_wait >= p.kv_wait
            else PREFILL
            if signal.kv_wait < p.kv_wait / 2
            else None
        )
        if signal.rejected >= p.rejection:
            if short is not None and short not in refuted:
                refused = f"prefills refused {signal.rejected:.0%} of offers"
                return short, f"{refused}, their {waiting}", False
        elif short == DECODE:
            # §4.2: "some KVCaches wait in prefill for idle decoding" — the decodes are short
            # whether or not the prefills have had to refuse yet (a closed load, spare slots)
            if DECODE not in refuted:
                return DECODE, f"the prefills' {waiting}", False
        elif short == PREFILL and signal.slots_held >= p.slots_full and PREFILL not in refuted:
            # full, and computing (not waiting for decodes): the prefills are short, the
            # requests wait at the gateway for a slot
            return (
                PREFILL,
                f"the prefills' slots held {signal.slots_held:.0%} of the time, "
                f"{1 - signal.kv_wait:.0%} of it prefilling",
                False,
            )
        if signal.e2e < base_e2e * (1 + p.e2e_rise):
            return None, "", False
        rise = f"E2E rose from {base_e2e:.3f} s to {signal.e2e:.3f} s"
        share = signal.prefill_share
        if share >= base + p.share_delta:
            return PREFILL, f"{rise} and T_p/E2E from {base:.2f} to {share:.2f}", True
        if share <= base - p.share_delta:
            return DECODE, f"{rise} and T_p/E2E fell from {base:.2f} to {share:.2f}", True
        return None, "", False

    def _judge(
        self,
        role: str,
        before: Tally,
        state: FeedbackState,
        after: Tally,
        signal: Signal,
        current: Split,
        total: int,
        now: float,
        numbers: dict[str, float],
    ) -> tuple[Decision, FeedbackState]:
        """The last move's effect, the windows after it against those it is judged against
        (:func:`compare`): better -> one more the same way (if allowed); worse -> one back, its
        role refuted, then settled (a move that did not pay is not kept); neither -> settled.
        Settling takes the last window's figures as the new baseline."""
        verdict, figures = compare(before, after, self.params.improve)
        numbers = {
            **numbers,
            "E2EBeforeMove": _round(before.mean_e2e),
            "E2EAfterMove": _round(after.mean_e2e),
            "servedBeforeMove": _round(before.served),
            "servedAfterMove": _round(after.served),
        }
        settled = FeedbackState(
            baseline_e2e=signal.e2e,
            baseline_share=signal.prefill_share,
            last_change=state.last_change,
            refuted=state.refuted,
        )
        target = moved(current, role if verdict > 0 else _other(role), total)
        if verdict > 0:
            if self.bounds.allows(target):
                why = f"one more {role} paid ({figures}): one more {role}"
                return Decision(target, True, why, numbers), FeedbackState(
                    last_change=now, moving=role, before=after, refuted=state.refuted
                )
            why = f"one more {role} paid ({figures}); {target} is out of bounds: settled"
            return Decision(current, False, why, numbers), settled
        if verdict < 0:
            # worse: not kept, and refuted (the saturation alarms no longer ask for it)
            refuted = replace(settled, refuted=tuple(sorted({*state.refuted, role})))
            if self.bounds.allows(target):
                why = f"one more {role} made it worse ({figures}): moved back"
                # settled after the step back: its figures are the next baseline
                return Decision(target, True, why, numbers, measured_better=True), replace(
                    refuted, baseline_e2e=None, baseline_share=None, last_change=now
                )
            why = f"one more {role} made it worse ({figures}); {target} is out of bounds"
            return Decision(current, False, why, numbers), refuted
        # no better, no worse: kept; an alarm that still holds asks again after a new trend
        why = f"one more {role}: no better, no worse ({figures}): settled"
        return Decision(current, False, why, numbers), settled


# ------------------------------------------------------------------------- the load's history
# [design] the load changed: its prompts, its answers or their proportion (the P/D balance moves
# with it) this far from the load's running mean, for CHANGE_WINDOWS windows in a row; or the
# split it serves now finishing this much more or fewer requests per second than it was
# measured to (and CHANGE_SIGMAS standard deviations of the counts' Poisson noise), as long
MIX_CHANGE = 0.2
RATE_CHANGE = 0.15
CHANGE_SIGMAS = 3.0
CHANGE_WINDOWS = 2


@dataclass(frozen=True)
class Mix:
    """What a load's requests are, whatever the split: prompt and answer tokens per request."""

    prompt: float
    output: float

    def differs(self, other: Mix) -> bool:
        pairs = (
            (self.prompt, other.prompt),
            (self.output, other.output),
            (self.prompt / self.output, other.prompt / other.output),
        )
        return any(abs(a - b) > MIX_CHANGE * max(a, b) for a, b in pairs)

    def toward(self, other: Mix, weight: float) -> Mix:
        """A running mean: ``weight`` of the way to ``other``."""
        return Mix(
            self.prompt + weight * (other.prompt - self.prompt),
            self.output + weight * (other.output - self.output),
        )

    def __str__(self) -> str:
        return f"{self.prompt:.0f} tokens in, {self.output:.0f} out"


def mix_of(prefill: zl.Load, decode: zl.Load) -> Mix | None:
    if prefill.prefilled < 1 or decode.decoded < 1 or decode.output_tokens < 1:
        return None
    return Mix(prefill.prompt_tokens / prefill.prefilled, decode.output_tokens / decode.decoded)


@dataclass(frozen=True)
class Measured:
    """What a split served under the current load: its windows (:class:`Tally`), the decodes'
    mean batch and TPOT there (0: not known), and when it was last measured (the caller's
    clock)."""

    split: Split
    tally: Tally
    batch: float = 0.0
    tpot: float = 0.0
    at: float = 0.0

    @property
    def phi(self) -> float:
        """Requests finished per second per instance (0: not known)."""
        return self.tally.served / self.split.total

    def said(self) -> str:
        if self.tally.served > 0:
            return f"{self.tally.served:.3g} req/s (Φ {self.phi:.3g}) at {self.split}"
        return f"E2E {self.tally.mean_e2e:.3f} s at {self.split}"


def _move_role(old: Split, new: Split) -> str:
    """The role a move from ``old`` to ``new`` adds (a split of the same total)."""
    return PREFILL if new.prefill > old.prefill else DECODE


def _rate_moved(tally: Tally, signal: Signal) -> bool:
    """One window's requests per second against a split's measured ones: moved by
    ``RATE_CHANGE`` and ``CHANGE_SIGMAS`` standard deviations (both counts' Poisson noise)."""
    if tally.seconds <= 0 or signal.seconds <= 0 or tally.served <= 0:
        return False
    was, now = tally.served, signal.served
    noise = math.sqrt(tally.finished / tally.seconds**2 + signal.finished / signal.seconds**2)
    return abs(now - was) >= max(CHANGE_SIGMAS * noise, RATE_CHANGE * was)


@dataclass(frozen=True)
class History:
    """What a group measured and did under the current load, for both policies (issue 29):
    each split it served at least a window and what it served there; the role its last move
    added and the reversals (a move against the one before it: a step past the best and
    back) since the load last changed. Kept in ``status.ratio``; forgotten when the load
    changes (its :class:`Mix`, or the rate the current split serves: ``CHANGE_WINDOWS``
    windows in a row) and by the caller on a new total; a measurement older than the caller's
    ``max_age`` is dropped."""

    mix: Mix | None = None  # the load's running mean
    measured: tuple[Measured, ...] = ()
    last_move: str | None = None
    reversals: int = 0
    last_reversal: bool = False  # the last move was a reversal (given back if it is abandoned)
    flap_said: bool = False  # the Warning of a held flap was said (once per load)
    drift: int = 0  # windows in a row whose mix differs from the running mean
    shift: int = 0  # windows in a row whose rate differs from the split's measured one

    def at(self, split: Split) -> Measured | None:
        return next((m for m in self.measured if m.split == split), None)

    def points(self, besides: Split) -> list[BatchPoint]:
        """The decodes' batch and TPOT measured at splits other than ``besides``."""
        return [
            BatchPoint(m.batch, m.tpot)
            for m in self.measured
            if m.split != besides and m.batch > 0 and m.tpot > 0
        ]

    def observe(
        self,
        split: Split,
        mix: Mix | None,
        signal: Signal | None,
        saturated: bool,
        point: BatchPoint | None,
        keep: int,
        now: float = 0.0,
        max_age: float = math.inf,
    ) -> History:
        """With one more window at ``split``: a changed load starts afresh (with this window);
        the split's figures are a mean of its last ``keep`` windows."""
        history = replace(self, measured=tuple(m for m in self.measured if now - m.at <= max_age))
        if mix is not None:
            known = history.mix
            if known is None:
                history = replace(history, mix=mix, drift=0)
            elif mix.differs(known):
                history = replace(history, drift=history.drift + 1)
            else:
                history = replace(history, mix=known.toward(mix, 1 / (keep + 1)), drift=0)
        here = history.at(split)
        if signal is not None and here is not None and here.tally.windows >= keep:
            moved = _rate_moved(here.tally, signal)
            history = replace(history, shift=history.shift + 1 if moved else 0)
        if history.drift >= CHANGE_WINDOWS or history.shift >= CHANGE_WINDOWS:
            history = History(mix=mix)
        if signal is None:
            return history
        old = history.at(split) or Measured(split, Tally())
        tally = old.tally.add(signal, saturated, keep)
        w = old.tally.windows
        batch, tpot = old.batch, old.tpot
        if point is not None and point.batch > 0 and point.tpot > 0:
            # a mean over the windows the tally holds (the old ones weigh as the tally does)
            batch = (old.batch * w + point.batch) / (w + 1) if old.batch else point.batch
            tpot = (old.tpot * w + point.tpot) / (w + 1) if old.tpot else point.tpot
        rest = tuple(m for m in history.measured if m.split != split)
        entry = Measured(split, tally, batch, tpot, now)
        return replace(
            history, measured=tuple(sorted((*rest, entry), key=lambda m: -m.split.prefill))
        )

    def _verdict(self, current: Split, candidate: Split, improve: float) -> tuple[int, str]:
        """+1 if ``candidate`` was measured better than ``current``, -1 worse, else 0. Saturated
        (either), by requests served per second: any difference of ``SIGNIFICANT`` standard
        deviations of the counts' noise (a measurement, unlike a move's first windows, is not
        asked to pay for a move: a split that served less is worse); else by E2E, by
        ``improve``."""
        here, there = self.at(current), self.at(candidate)
        if here is None or there is None:
            return 0, ""
        said = f"{there.said()} against {here.said()}"
        a, b = here.tally, there.tally
        if a.is_saturated or b.is_saturated:
            if min(a.served, b.served) <= 0:
                return 0, said
            noise = math.sqrt(a.finished / a.seconds**2 + b.finished / b.seconds**2)
            if abs(b.served - a.served) < SIGNIFICANT * noise:
                return 0, said
            return (1 if b.served > a.served else -1), said
        verdict, _ = compare(a, b, improve)
        return verdict, said

    def worse(self, current: Split, candidate: Split, improve: float) -> str | None:
        """Why ``candidate`` is not to be moved to, if both were measured and ``candidate``
        served worse than ``current``; else None."""
        verdict, figures = self._verdict(current, candidate, improve)
        return f"{candidate} was measured worse: {figures}" if verdict < 0 else None

    def better(self, current: Split, candidate: Split, improve: float) -> bool:
        """Both measured, and ``candidate`` served better than ``current``."""
        return self._verdict(current, candidate, improve)[0] > 0

    def move(
        self, current: Split, target: Split, better: bool = False
    ) -> tuple[History, str | None]:
        """The history with a move from ``current`` to ``target`` made, or itself and why not.
        A move against the last one (a reversal: a step back) is made only to a split measured
        ``better`` than ``current`` under this load — taking back a move that did not pay; and
        once the group has reversed (a step past the best and back), it makes no move but to
        such a split until the load changes: a policy that would keep walking is held, not
        left to flap."""
        role = _move_role(current, target)
        last = self.last_move
        reversal = last is not None and role != last
        if not better and last is not None and reversal:
            return self, (
                f"{target} would take back the last move (one more {last}) and was not "
                f"measured better than {current} under this load"
            )
        if not better and self.reversals >= 1:
            return self, (
                "the group has reversed once under this load (a step past the best and back); "
                f"it moves now only to a split measured better, and {target} was not"
            )
        moved = replace(
            self,
            last_move=role,
            reversals=self.reversals + int(reversal),
            last_reversal=reversal,
        )
        return moved, None

    def abandoned(self) -> History:
        """A move given up: no policy's reversal (what it counted is given back)."""
        return replace(
            self,
            last_move=None,
            reversals=self.reversals - int(self.last_reversal),
            last_reversal=False,
        )

    def to_status(self) -> dict[str, object]:
        return {
            "mix": (
                {"promptTokens": _round(self.mix.prompt), "outputTokens": _round(self.mix.output)}
                if self.mix is not None
                else None
            ),
            "measured": [
                {
                    "split": str(m.split),
                    "tally": m.tally.to_status(),
                    "served": _round(m.tally.served),
                    "phi": _round(m.phi),
                    "e2e": _round(m.tally.mean_e2e),
                    "batch": _round(m.batch),
                    "tpot": _round(m.tpot),
                    "at": m.at,
                }
                for m in self.measured
            ],
            "lastMove": self.last_move,
            "reversals": self.reversals,
            "lastReversal": self.last_reversal,
            "flapSaid": self.flap_said,
            "drift": self.drift,
            "shift": self.shift,
        }

    @classmethod
    def from_status(cls, raw: Mapping[str, object] | None) -> History:
        """Read back what :meth:`to_status` wrote; what is unreadable is left out."""
        if not raw:
            return cls()
        mix = None
        m = raw.get("mix")
        if isinstance(m, Mapping):
            prompt, output = _number(m, "promptTokens"), _number(m, "outputTokens")
            if prompt is not None and output is not None and prompt > 0 and output > 0:
                mix = Mix(prompt, output)
        measured: list[Measured] = []
        items = raw.get("measured")
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, Mapping):
                continue
            try:
                split = Split.parse(str(item.get("split")))
            except ValueError:
                continue
            tally = Tally.from_status(item.get("tally"))
            if not tally.windows or any(e.split == split for e in measured):
                continue
            batch, tpot = _number(item, "batch") or 0.0, _number(item, "tpot") or 0.0
            at = _number(item, "at") or 0.0
            measured.append(Measured(split, tally, max(batch, 0.0), max(tpot, 0.0), at))
        last = raw.get("lastMove")
        last_move = last if last in (PREFILL, DECODE) else None
        return cls(
            mix=mix,
            measured=tuple(measured),
            last_move=last_move,
            reversals=_count(raw, "reversals"),
            last_reversal=raw.get("lastReversal") is True and last_move is not None,
            flap_said=raw.get("flapSaid") is True,
            drift=_count(raw, "drift"),
            shift=_count(raw, "shift"),
        )


# ------------------------------------------------------------------------------ execution
def toward(current: Split, target: Split, step: int, bounds: Bounds) -> Split:
    """At most ``step`` instances of the way from ``current`` to ``target`` (one change: a
    policy moves the split this far, then observes again). With a ladder, the next rung on the
    way (a split between two rungs is not allowed); a split outside the bounds is never
    returned (``current`` if nothing on the way is allowed)."""
    if current == target or current.total != target.total:
        return target
    sign = 1 if target.prefill > current.prefill else -1
    ahead = [
        s
        for s in bounds.splits(target.total)
        if 0 < (s.prefill - current.prefill) * sign <= abs(target.prefill - current.prefill)
    ]
    if not ahead:
        return current
    if bounds.ladder:
        return min(ahead, key=lambda s: abs(s.prefill - current.prefill))
    within = [s for s in ahead if abs(s.prefill - current.prefill) <= step]
    if not within:
        return min(ahead, key=lambda s: abs(s.prefill - current.prefill))
    return max(within, key=lambda s: abs(s.prefill - current.prefill))


def next_step(current: Split, target: Split, transition: Transition) -> Split:
    """The next split on the way from ``current`` to ``target``, one instance at a time,
    releases and additions alternating: ``FixedTotal`` releases first (an instance of a role
    that has too many) whenever the group is not below the target's total, so it never holds
    more than the larger of the two totals; ``Elastic`` adds first whenever it is not above it,
    so it never holds fewer than the smaller. ``current`` when there. Of two roles to add (or
    release), the one further from its target goes first, prefill on a tie."""
    if current == target:
        return current
    excess = {PREFILL: current.prefill - target.prefill, DECODE: current.decode - target.decode}
    release = [r for r in (PREFILL, DECODE) if excess[r] > 0]
    add = [r for r in (PREFILL, DECODE) if excess[r] < 0]
    if transition is Transition.FIXED_TOTAL:
        releasing = bool(release) and (current.total >= target.total or not add)
    else:
        releasing = not add or (current.total > target.total and bool(release))
    if releasing:
        role, step = max(release, key=lambda r: excess[r]), -1
    else:
        role, step = min(add, key=lambda r: excess[r]), 1
    if role == PREFILL:
        return Split(current.prefill + step, current.decode)
    return Split(current.prefill, current.decode + step)


def parse_ladder(items: Iterable[str]) -> tuple[Split, ...]:
    """A ladder's ``"P:D"`` rungs, or ValueError naming the first bad one."""
    return tuple(Split.parse(item) for item in items)
