"""The decode iteration with experts served apart from attention: roofline per layer, the
combine barrier, microbatch overlap; expert popularity and routing over replicas. Pure, emulated
seconds.

What each side computes:

- **Attention client** (xDeepServe §5.2: "Attention DP groups execute full MLA computation,
  including MLAProlog, Attention, gating, output projection"): per layer and microbatch, on each
  of its dies (TP=1, one DP group per die), the roofline ``max(compute / peak, memory /
  bandwidth) / efficiency`` of MLA over its requests' context, the attention projections, the
  gate, and on the dense layers the dense FFN; the efficiency is the decode roofline's one
  (:func:`enginestub.timing.decode_efficiency`, fitted on CloudMatrix-Infer's batch-96 point,
  not on this section's figures).
- **Expert server** (EaaS §3.3: "grouped GEMM"; xDeepServe §5.2 "MoE NPUs run only A2E, MoE
  computation, and E2A"): per layer, its experts' tokens as one grouped GEMM at CANN's INT8
  utilization (001 T10), or the read of their weights if that is longer.
- **A layer ends at its slowest server** (the combine barrier, notes 000 §3.6): a microbatch's
  hop is A2E + the slowest server's MoE + E2A (000 §3.3: 172 and 193 µs).
- **Microbatches overlap the hops** (000 §7.1; two per domain, §5.2): while one microbatch is
  away at the experts, the attention dies compute the other; only the last microbatch's last
  hop is not hidden. :func:`iteration_seconds` walks the two-stage pipeline, and adds the
  scheduler overhead and the MTP layer as §7.1 states them.

Routing (xDeepServe §4.5 step 4, "Communication-Free Load Balancing"): an expert's tokens are
spread over the servers that hold it enabled, rotating by token position, so each replica gets
``c // n`` or ``c // n + 1`` of its ``c`` tokens. Popularity (which experts a layer's tokens go
to): uniform, Zipf solved so the hottest expert gets ``HOTTEST_EXPERT_OVER_MEAN`` times the mean
(000 §4.5, Fig. 11a), or a trace file.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from enginestub import calibration as cal
from enginestub import timing
from matrixserve.api.catalog import DEEPSEEK_V3, ModelShape


# --------------------------------------------------------------------------- attention side
def attention_layer_seconds(
    model: ModelShape,
    requests: int,
    kv_tokens: float,
    tokens_per_request: int,
    dense: bool,
) -> float:
    """One layer of one microbatch on one attention die: ``requests`` of mean context
    ``kv_tokens``, each computing ``tokens_per_request`` tokens (2 with MTP's draft)."""
    if requests <= 0:
        return 0.0
    tokens = requests * tokens_per_request
    per_layer_attention = model.attention_flops_per_context_token(decode=True) / model.layers
    gate = model.hidden * model.moe.routed_experts if model.moe else 0
    dense_ffn = model.dense_ffn_params / max(model.n_dense_layers, 1) if dense else 0
    params = model.attention_params_per_layer + gate + dense_ffn
    compute = (
        per_layer_attention * kv_tokens * tokens / cal.DIE_BF16_FLOPS
        + 2.0 * params * tokens / cal.DIE_INT8_OPS
    )
    kv_bytes = requests * kv_tokens * model.kv_elements_per_token_per_layer * model.kv_bytes
    memory = (params * model.weight_bytes + kv_bytes) / cal.DIE_HBM_BANDWIDTH
    return max(compute, memory) / timing.decode_efficiency()


# --------------------------------------------------------------------------- expert side
def expert_layer_seconds(model: ModelShape, counts: Iterable[int], dies: int) -> float:
    """One layer's grouped GEMM on a server of ``dies`` dies: ``counts`` tokens for each expert
    it computes in that layer (its weights read once each)."""
    tokens = experts = 0
    for count in counts:
        if count > 0:
            tokens += count
            experts += 1
    if not tokens:
        return 0.0
    params = model.expert_params_per_layer
    compute = 2.0 * tokens * params / (cal.DIE_INT8_OPS * cal.GROUPED_GEMM_UTILIZATION * dies)
    memory = experts * params * model.weight_bytes / (cal.DIE_HBM_BANDWIDTH * dies)
    return max(compute, memory)


def hop_seconds(moe: float) -> float:
    """A microbatch's trip to the experts and back: A2E, the slowest server's MoE, E2A."""
    return cal.MOE_ATTENTION_A2E_SECONDS + moe + cal.MOE_ATTENTION_E2A_SECONDS


def slot_load_seconds(
    model: ModelShape, slots: int, shape: timing.InstanceShape, source: timing.LoadSource
) -> float:
    """An expert server's load of ``slots`` (layer, expert) weights from ``source`` (stateless:
    nothing but weights, EaaS §2.4)."""
    if slots <= 0:
        return 0.0
    return (
        slots
        * model.expert_params_per_layer
        * model.weight_bytes
        / timing.source_bandwidth(shape, source)
    )


# --------------------------------------------------------------------------- the iteration
def iteration_seconds(
    attention: Sequence[Sequence[float]], hops: Sequence[Sequence[float]], mtp: bool
) -> float:
    """The iteration: the scheduler's overhead, the MTP layer (with MTP), and the layers as a
    two-stage pipeline: ``attention[l][m]`` on the attention dies (one microbatch at a time),
    then ``hops[l][m]`` away at the experts (0 on a dense layer); microbatch ``m`` of layer
    ``l + 1`` starts once its hop of layer ``l`` is back and the dies are free."""
    dies_free = 0.0
    ready: list[float] = []
    for layer, costs in enumerate(attention):
        if len(ready) < len(costs):
            ready.extend([0.0] * (len(costs) - len(ready)))
        for m, cost in enumerate(costs):
            start = max(dies_free, ready[m])
            dies_free = start + cost
            ready[m] = dies_free + hops[layer][m]
    layers = max(ready, default=0.0)
    return cal.SCHEDULER_OVERHEAD_SECONDS + (cal.MTP_LAYER_SECONDS if mtp else 0.0) + layers


def microbatches(requests: int, count: int) -> list[int]:
    """``requests`` split into ``count`` microbatches as evenly as can be (none empty)."""
    count = max(1, min(count, requests))
    return [requests // count + (1 if m < requests % count else 0) for m in range(count)]


@dataclass(frozen=True)
class PaperPrediction:
    """xDeepServe §7.1's disaggregated iteration, predicted: its parts and total (s)."""

    attention_layer: float  # one MoE layer of one microbatch on one attention die
    moe: float  # one layer on one expert die
    iteration: float

    @property
    def error(self) -> float:
        """Relative error against the section's ≈ 92.9 ms."""
        return self.iteration / cal.DISAGGREGATED_ITERATION_SECONDS - 1.0


def paper_prediction(model: ModelShape = DEEPSEEK_V3) -> PaperPrediction:
    """§7.1's shape through this module: 96 requests per attention die in two microbatches of
    48 (each with MTP's draft token), a 3K mean context; one domain of 160 dies at the experts
    at a time (§5.2), whose tokens spread evenly over the 256 routed experts, one per expert die
    (the 32 shared-expert dies see as many tokens each: 160 x 48 x 2 / 32 = 480)."""
    assert model.moe is not None
    mbs = microbatches(cal.DISAGGREGATED_BATCH_PER_DIE, cal.DISAGGREGATED_MICROBATCHES)
    tokens_per_request = 2  # the main model verifies MTP's draft (000 §4.6)
    attention = [
        [
            attention_layer_seconds(
                model, n, cal.DISAGGREGATED_CONTEXT_TOKENS, tokens_per_request, layer < dense
            )
            for n in mbs
        ]
        for dense in [model.n_dense_layers]
        for layer in range(model.layers)
    ]
    per_expert = (
        cal.DISAGGREGATED_DOMAIN_DIES
        * mbs[0]
        * tokens_per_request
        * model.moe.top_k
        // model.moe.routed_experts
    )
    moe = expert_layer_seconds(model, [per_expert], dies=1)
    hops = [
        [0.0 if layer < model.n_dense_layers else hop_seconds(moe) for _ in mbs]
        for layer in range(model.layers)
    ]
    return PaperPrediction(
        attention_layer=attention[-1][0],
        moe=moe,
        iteration=iteration_seconds(attention, hops, mtp=True),
    )


# --------------------------------------------------------------------------- popularity
def zipf_exponent(experts: int, hottest_over_mean: float) -> float:
    """The exponent ``s`` of ``p(rank) ∝ rank^-s`` over ``experts`` whose hottest gets
    ``hottest_over_mean`` times the mean (bisection: the ratio grows with ``s``)."""
    if not 1.0 <= hottest_over_mean <= experts:
        raise ValueError(f"hottest over mean must be in 1..{experts}, not {hottest_over_mean}")

    def ratio(s: float) -> float:
        return experts / sum(math.pow(r, -s) for r in range(1, experts + 1))

    low, high = 0.0, 8.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if ratio(mid) < hottest_over_mean else (low, mid)
    return (low + high) / 2


_CACHE_ENTRIES = 8192  # a Popularity's apportionments kept (layer, tokens, top-k)


@dataclass
class Popularity:
    """Which experts a layer's tokens go to: a weight per expert per layer (summing to 1).
    ``counts`` gives a layer's tokens times top-k as whole tokens per expert (largest
    remainders; an expert gets at most every token: top-k picks distinct experts)."""

    experts: int
    weights: dict[int, list[float]] = field(
        default_factory=dict
    )  # layer -> weights; absent: uniform
    default: list[float] | None = None
    kind: str = "uniform"
    _cache: dict[tuple[int, int, int], tuple[list[int], int, list[list[int]]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def parse(cls, spec: str, experts: int, layers: int, seed: int = 0) -> Popularity:
        """``uniform``, ``zipf`` (the hottest 30x the mean, a different hot expert per layer)
        or the path of a JSON trace: a list of weights per expert (every layer), or an object
        of layer -> such a list (layers absent: uniform). ValueError with the reason."""
        if spec in ("", "uniform"):
            return cls(experts)
        if spec == "zipf":
            s = zipf_exponent(experts, cal.HOTTEST_EXPERT_OVER_MEAN)
            ranked = [math.pow(r, -s) for r in range(1, experts + 1)]
            total = sum(ranked)
            weights: dict[int, list[float]] = {}
            for layer in range(layers):
                order = list(range(experts))
                random.Random(seed * 1_000_003 + layer).shuffle(order)
                row = [0.0] * experts
                for rank, expert in enumerate(order):
                    row[expert] = ranked[rank] / total
                weights[layer] = row
            return cls(experts, weights, kind="zipf")
        path = Path(spec)
        if not path.is_file():
            raise ValueError(
                f"expert popularity {spec!r}: uniform, zipf or the path of a JSON trace file"
            )
        try:
            trace = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"expert popularity trace {spec}: not readable JSON ({exc})") from None
        if isinstance(trace, list):
            return cls(experts, default=_normalised(trace, experts, spec), kind=f"trace:{spec}")
        if isinstance(trace, dict):
            rows: dict[int, list[float]] = {}
            for key, row in trace.items():
                if not str(key).isdigit() or not 0 <= int(key) < layers:
                    raise ValueError(
                        f"expert popularity trace {spec}: layer {key!r} not in 0..{layers - 1}"
                    )
                rows[int(key)] = _normalised(row, experts, f"{spec} layer {key}")
            return cls(experts, rows, kind=f"trace:{spec}")
        raise ValueError(f"expert popularity trace {spec}: a list or an object of lists expected")

    def of(self, layer: int) -> list[float] | None:
        return self.weights.get(layer, self.default)

    def counts(self, layer: int, tokens: int, top_k: int, offset: int = 0) -> list[int]:
        """Tokens per expert in ``layer`` for ``tokens`` tokens choosing ``top_k`` each. The
        fractions left over go to the largest remainders; among equal ones (a uniform layer's
        every expert) from ``offset`` on, so a batch too small to reach every expert reaches
        different ones as its token positions move on (pass the positions used before)."""
        key = (layer if self.of(layer) is not None else -1, tokens, top_k)
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= _CACHE_ENTRIES:  # probes of any size: kept bounded
                self._cache.clear()
            weights = self.of(layer) or [1.0 / self.experts] * self.experts
            cached = self._cache[key] = _apportion(weights, tokens, top_k)
        base, left, ties = cached
        counts = list(base)
        for group in ties:
            if left <= 0:
                break
            start = offset % len(group)
            for e in (group[start:] + group[:start])[:left]:
                counts[e] += 1
            left -= min(left, len(group))
        return counts


def _normalised(row: object, experts: int, what: str) -> list[float]:
    if (
        not isinstance(row, list)
        or len(row) != experts
        or not all(isinstance(w, int | float) and not isinstance(w, bool) for w in row)
        or any(not math.isfinite(w) or w < 0 for w in row)
        or sum(row) <= 0
    ):
        raise ValueError(
            f"expert popularity trace {what}: {experts} finite weights >= 0 (not all 0) expected"
        )
    total = float(sum(row))
    return [w / total for w in row]


def _apportion(
    weights: Sequence[float], tokens: int, top_k: int
) -> tuple[list[int], int, list[list[int]]]:
    """``tokens * top_k`` whole choices over the experts by weight, each capped at ``tokens``:
    the whole parts, the choices left, and the experts that may take one more (not at the cap)
    in groups of equal remainder, largest first."""
    total = tokens * min(top_k, len(weights))
    shares = [min(w * total, float(tokens)) for w in weights]
    base = [int(s) for s in shares]
    left = total - sum(base)
    groups: dict[float, list[int]] = {}
    for e, share in enumerate(shares):
        if base[e] < tokens:
            groups.setdefault(round(share - base[e], 9), []).append(e)
    return base, left, [groups[r] for r in sorted(groups, reverse=True)]


def rotate(expert: int, count: int, replicas: Sequence[int]) -> list[tuple[int, int]]:
    """An expert's ``count`` tokens over its ``replicas`` (server indices), rotating by token
    position (xDeepServe §4.5 step 4): ``(server, tokens)`` for each replica that gets any. The
    rotation starts at an offset of the expert's id, so the extra tokens of different experts
    fall on different replicas."""
    n = len(replicas)
    if n == 0 or count <= 0:
        return []
    base, extra = divmod(count, n)
    out = []
    for i, server in enumerate(replicas):
        share = base + (1 if (i - expert) % n < extra else 0)
        if share:
            out.append((server, share))
    return out
