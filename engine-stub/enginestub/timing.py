"""Serving timing model: prefill time, decode step time (TPOT), KV size and transfer, model load.

Two sources, as serving engines use them (001 §5.2; 004 §2.1):

- **Measured profile**: where CloudMatrix-Infer measured a configuration (DeepSeek-R1 INT8:
  prefill 6,688 tokens/s per NPU at 4K prompts with ideal EPLB, T3; decode TPOT 14.9 / 24.6 /
  49.4 ms at 8 / 24 / 96 requests per NPU, T5) the engine interpolates between those points.
- **Roofline** elsewhere: per die, ``max(compute / peak, memory / bandwidth) / efficiency`` plus
  MoE dispatch/combine over UB (001 T7 bandwidths and §4.2.1 message sizes) and MTP graph
  launches (§4.2.4). One efficiency factor is fitted on one documented point (decode: batch 96,
  :data:`calibration.ROOFLINE_FIT_BATCH`; prefill: the 4K T3 point); the other profile points
  are then *predicted*, and the tests print the error.

Decode semantics (001 §1.11 note 3): the T5 batch is requests per NPU; with MTP one speculative
token is computed per request per step and 1.7 tokens are accepted, so TPOT = step / 1.7.

Everything is pure and in emulated seconds.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from functools import cache

from enginestub import calibration as cal
from enginestub.fabric import Plane, link_bandwidth, link_latency
from matrixserve.api import catalog, engine_settings
from matrixserve.api.catalog import DEEPSEEK_V3, ModelShape


@dataclass(frozen=True)
class InstanceShape:
    """How one instance spreads over dies (DeepSeek decode: 320 dies, DP320 attention, EP320)."""

    dies: int
    tp: int = 1  # tensor parallel degree for attention and dense layers
    ep: int = 1  # expert parallel degree (MoE)
    mtp: bool = False  # one speculative token per step (001 §4.2.4)
    precision_ops: float = cal.DIE_INT8_OPS  # GEMM peak per die

    def __post_init__(self) -> None:
        if self.dies < 1 or self.tp < 1 or self.ep < 1:
            raise ValueError("dies, tp and ep must be >= 1")
        if self.dies % self.tp:
            raise ValueError(f"tp {self.tp} does not divide dies {self.dies}")

    @property
    def dp(self) -> int:
        return self.dies // self.tp

    @property
    def npus(self) -> float:
        return self.dies / catalog.DIES_PER_NPU

    @property
    def tokens_per_step(self) -> int:
        return 2 if self.mtp else 1

    @property
    def accepted_per_step(self) -> float:
        return cal.MTP_ACCEPTED_TOKENS_PER_STEP if self.mtp else 1.0


PAPER_DECODE_SHAPE = InstanceShape(dies=320, tp=1, ep=320, mtp=True)  # 001 §4.1, §5.1
PAPER_PREFILL_SHAPE = InstanceShape(dies=32, tp=1, ep=32, mtp=False)  # 001 §4.1 (EP32, 16 NPUs)


@dataclass(frozen=True)
class StepCost:
    """The parts of one decode step on one die, in seconds at 100% efficiency (comm excluded)."""

    compute: float
    memory: float
    comm: float

    def time(self, efficiency: float) -> float:
        return max(self.compute, self.memory) / efficiency + self.comm

    @property
    def bound(self) -> str:
        return "compute" if self.compute >= self.memory else "memory"


def non_expert_weights_per_die(model: ModelShape, shape: InstanceShape) -> float:
    """Bytes of the weights that are not routed or shared experts (attention, dense FFNs,
    embedding) each die holds: its tensor-parallel share. What an attention client holds when
    its experts are served elsewhere (xDeepServe §5.2; EaaS §3.1)."""
    return (
        (
            model.layers * model.attention_params_per_layer
            + model.dense_ffn_params
            + model.embedding_params
        )
        / shape.tp
        * model.weight_bytes
    )


def _weights_per_die(model: ModelShape, shape: InstanceShape) -> float:
    """Bytes of weights each die reads per step: its share of the replicated/TP'd layers and
    the experts it hosts (routed experts spread over the EP ranks)."""
    non_expert = non_expert_weights_per_die(model, shape) / model.weight_bytes
    experts = 0.0
    if model.moe is not None:
        all_experts = model.routed_expert_params + model.shared_expert_params
        experts = (
            all_experts / min(shape.ep, shape.dies) if shape.ep > 1 else all_experts / shape.tp
        )
    return (non_expert + experts) * model.weight_bytes


def decode_step_cost(
    model: ModelShape, shape: InstanceShape, batch_per_npu: float, kv_tokens: int
) -> StepCost:
    requests = batch_per_npu * shape.npus  # the instance's batch
    tokens = requests * shape.tokens_per_step
    tokens_per_die_group = tokens / shape.dp  # tokens each DP group (of tp dies) computes
    # Compute: GEMMs over active parameters (INT8/BF16 peak) + attention over the context (BF16).
    gemm_flops = 2.0 * model.active_params_per_token * tokens / shape.dies
    attn_flops = (
        model.attention_flops_per_context_token(decode=True)
        * kv_tokens
        * tokens_per_die_group
        / shape.tp
    )
    compute = gemm_flops / shape.precision_ops + attn_flops / cal.DIE_BF16_FLOPS
    # Memory: weights once per step + the KV of the requests this die serves.
    kv_share = requests / shape.dp if model.mla is not None else requests / shape.dies
    memory = (
        _weights_per_die(model, shape) + kv_share * kv_tokens * model.kv_bytes_per_token
    ) / cal.DIE_HBM_BANDWIDTH
    # MoE dispatch/combine over UB (001 T7, §4.2.1) and MTP graph launches (§4.2.4).
    comm = 0.0
    if model.moe is not None and shape.ep > 1:
        per_layer = (
            tokens_per_die_group
            * model.moe.top_k
            * (
                cal.DISPATCH_BYTES_PER_TOKEN / cal.DISPATCH_BANDWIDTH
                + cal.COMBINE_BYTES_PER_TOKEN / cal.COMBINE_BANDWIDTH
            )
        )
        comm += per_layer * model.moe.moe_layers
    if shape.mtp:
        comm += shape.tokens_per_step * cal.MTP_GRAPH_LAUNCH_SECONDS
    return StepCost(compute, memory, comm)


@cache
def decode_efficiency() -> float:
    """The one roofline efficiency, fitted on the paper's batch-96 decode point."""
    point = next(p for p in cal.DECODE_PROFILE if p.batch_per_npu == cal.ROOFLINE_FIT_BATCH)
    cost = decode_step_cost(DEEPSEEK_V3, PAPER_DECODE_SHAPE, point.batch_per_npu, point.kv_tokens)
    measured_step = point.tpot_seconds * PAPER_DECODE_SHAPE.accepted_per_step
    return max(cost.compute, cost.memory) / (measured_step - cost.comm)


def roofline_tpot(
    model: ModelShape, shape: InstanceShape, batch_per_npu: float, kv_tokens: int
) -> float:
    cost = decode_step_cost(model, shape, batch_per_npu, kv_tokens)
    return cost.time(decode_efficiency()) / shape.accepted_per_step


def profile_tpot(batch_per_npu: float) -> float:
    """TPOT from the measured points, linear in batch between them (001 T5, 4K prompts)."""
    points = cal.DECODE_PROFILE
    batches = [p.batch_per_npu for p in points]
    if batch_per_npu <= batches[0] or batch_per_npu >= batches[-1]:
        edge = points[0] if batch_per_npu <= batches[0] else points[-1]
        ratio = roofline_tpot(
            DEEPSEEK_V3, PAPER_DECODE_SHAPE, batch_per_npu, edge.kv_tokens
        ) / roofline_tpot(DEEPSEEK_V3, PAPER_DECODE_SHAPE, edge.batch_per_npu, edge.kv_tokens)
        return edge.tpot_seconds * ratio
    i = bisect_left(batches, batch_per_npu)
    lo, hi = points[i - 1], points[i]
    if hi.batch_per_npu == batch_per_npu:
        return hi.tpot_seconds
    w = (batch_per_npu - lo.batch_per_npu) / (hi.batch_per_npu - lo.batch_per_npu)
    return lo.tpot_seconds + w * (hi.tpot_seconds - lo.tpot_seconds)


def has_profile(model: ModelShape, shape: InstanceShape) -> bool:
    return model == DEEPSEEK_V3 and shape == PAPER_DECODE_SHAPE


def tpot(model: ModelShape, shape: InstanceShape, batch_per_npu: float, kv_tokens: int) -> float:
    """Seconds per output token per request: the profile where measured, else the roofline."""
    if batch_per_npu <= 0:
        raise ValueError("batch must be positive")
    if has_profile(model, shape):
        profiled_kv = cal.DECODE_PROFILE[0].kv_tokens
        scale = roofline_tpot(model, shape, batch_per_npu, kv_tokens) / roofline_tpot(
            model, shape, batch_per_npu, profiled_kv
        )
        return profile_tpot(batch_per_npu) * scale
    return roofline_tpot(model, shape, batch_per_npu, kv_tokens)


# --------------------------------------------------------------------------- prefill
def _prefill_seconds_per_token_peak(
    model: ModelShape, shape: InstanceShape, prompt_tokens: int
) -> float:
    gemm = 2.0 * model.active_params_per_token / (shape.precision_ops * shape.dies)
    # Causal attention: on average each token attends to half the prompt.
    attn = (
        model.attention_flops_per_context_token(decode=False)
        * prompt_tokens
        / 2
        / (cal.DIE_BF16_FLOPS * shape.dies)
    )
    return gemm + attn


@cache
def prefill_efficiency(ideal_eplb: bool = True) -> float:
    measured = (
        cal.PREFILL_TOKENS_PER_NPU_IDEAL_EPLB
        if ideal_eplb
        else cal.PREFILL_TOKENS_PER_NPU_DEFAULT_EPLB
    )
    peak = _prefill_seconds_per_token_peak(
        DEEPSEEK_V3, PAPER_PREFILL_SHAPE, cal.PREFILL_PROFILE_PROMPT_TOKENS
    )
    measured_per_token = 1.0 / (measured * PAPER_PREFILL_SHAPE.npus)
    return peak / measured_per_token


def prefill_seconds(
    model: ModelShape,
    shape: InstanceShape,
    prompt_tokens: int,
    cached_tokens: int = 0,
    ideal_eplb: bool = True,
) -> float:
    """Time to prefill one prompt on the instance (compute-bound; cached prefix skipped)."""
    if prompt_tokens < 1:
        raise ValueError("a prompt has at least one token")
    new_tokens = max(prompt_tokens - cached_tokens, 1)
    per_token = _prefill_seconds_per_token_peak(model, shape, prompt_tokens) / prefill_efficiency(
        ideal_eplb
    )
    return new_tokens * per_token


def prefill_tokens_per_npu_per_second(
    model: ModelShape, shape: InstanceShape, prompt_tokens: int
) -> float:
    return prompt_tokens / prefill_seconds(model, shape, prompt_tokens) / shape.npus


# --------------------------------------------------------------------------- KV and loading
def kv_bytes(model: ModelShape, tokens: int) -> float:
    return model.kv_bytes_per_token * tokens


def kv_pull_links(decode_tp: int, prefill_dies: int, egress_flows: int) -> float:
    """How many die links' bandwidth one request's KV pull may use (each die has one port on
    the KV plane, :func:`~enginestub.fabric.link_bandwidth`).

    The request decodes on one DP group of the decode, its ``decode_tp`` dies, and each of them
    pulls over its own sub-link from the prefill die :mod:`matrixserve.api.kvmapping` gives it;
    a DP group's TP ranks have distinct sources under either rule (k <-> k, or
    ``group_id x decode_tp + tp_rank``), so the KV, moved once, is split over ``decode_tp``
    links. The prefill's egress, one link per die, is shared fairly by the pulls out of it. A
    decode whose TP spans its dies (the default) uses every link of a same-size pair, as
    before. Not modelled: under MLA each TP rank holds a whole copy (001 §4.3.3), which would
    move it ``decode_tp`` times; the KV budget counts a request's KV once too."""
    if decode_tp < 1 or prefill_dies < 1 or egress_flows < 1:
        raise ValueError("decode_tp, prefill_dies and egress_flows must be at least 1")
    return min(float(decode_tp), prefill_dies / egress_flows)


LoadSource = engine_settings.LoadSource  # the operator's too (an assignment's, a health's)
FORK_PLANES = {LoadSource.NPU_FORK_UB: Plane.UB, LoadSource.NPU_FORK_ROCE: Plane.ROCE}


def fork_source_for(plane: Plane) -> LoadSource:
    """The load source a fork over ``plane`` is (UB or RoCE)."""
    return next(source for source, p in FORK_PLANES.items() if p is plane)


def load_seconds(
    model: ModelShape, shape: InstanceShape, source: LoadSource, concurrent_loaders: int = 1
) -> float:
    """Time to load the instance's weights (DeepServe 002 §6.2; 001 T2).

    Shared file service: one bucket's effective 2.1 GB/s (its nominal 2.5 GB/s, as T2's
    8-instance cold start delivered it) shared by all concurrent loaders. SSD: 400 Gbps per
    node. Host DRAM: the T2-derived per-NPU rate, plus 0.3 s tensor init (002). NPU-fork: one
    target alone on a source's broadcast (:func:`fork_seconds`).
    """
    if concurrent_loaders < 1:
        raise ValueError("concurrent_loaders must be >= 1")
    if source in FORK_PLANES:
        return fork_seconds(model, shape, FORK_PLANES[source])
    seconds = model.weight_bytes_total / source_bandwidth(shape, source)
    if source is LoadSource.SHARED_FILE_SERVICE:
        return seconds * concurrent_loaders
    if source is LoadSource.HOST_DRAM:
        return seconds + cal.TENSOR_INIT_SECONDS
    return seconds


def source_bandwidth(shape: InstanceShape, source: LoadSource) -> float:
    """Bytes per second an instance of ``shape`` reads its weights at from ``source``, alone:
    the shared file service's effective bucket rate (001 T2), its servers' SSDs (400 Gbps per
    node, 001 §4.4.1), host DRAM at the T2-derived rate per NPU, or an NPU-fork's link per die
    (002 §6.2: each die receives its own shard)."""
    if source is LoadSource.SHARED_FILE_SERVICE:
        return cal.SHARED_FILE_SERVICE_EFFECTIVE_BANDWIDTH
    if source is LoadSource.SSD:
        return cal.SSD_NODE_BANDWIDTH * max(shape.npus / catalog.NPUS_PER_SERVER, 1.0)
    if source is LoadSource.HOST_DRAM:
        return cal.DRAM_TO_NPU_BANDWIDTH * shape.npus
    return link_bandwidth(FORK_PLANES[source], same_node=False) * shape.dies


def rank_load_seconds(
    model: ModelShape, shape: InstanceShape, source: LoadSource, ranks: int
) -> float:
    """One pod's TE-Load of an instance of ``ranks`` pods, alone: its own dies' share of the
    instance's weights (``shape`` is the whole instance's). The shared file service is one
    bucket for the cluster: a pod reads its 1/``ranks`` share alone in 1/``ranks`` of the
    whole's time (the ranks reading at once share the bucket: :mod:`enginestub.engine.bucket`).
    SSD and host DRAM are per server: each pod reads its share over its own servers in the time
    the whole instance takes over all of them."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    whole = load_seconds(model, shape, source)
    return whole / ranks if source is LoadSource.SHARED_FILE_SERVICE else whole


def dram_preload_seconds(model: ModelShape) -> float:
    """Time to pre-load a model's weights into a server's host DRAM from the shared file service
    (DeepServe 002 §6.2: "pre-loads them into DRAM page cache using pre-warmed TEs"): one
    loader's effective bandwidth, one model after another."""
    return model.weight_bytes_total / cal.SHARED_FILE_SERVICE_EFFECTIVE_BANDWIDTH


# --------------------------------------------------------------------------- NPU-fork (002 §6.2)
def fork_bytes_per_die(model: ModelShape, shape: InstanceShape) -> float:
    """What each die of a fork source sends: the weights it holds (its tensor-parallel share,
    the experts it hosts: a die of a data-parallel replica holds its replica's whole share, not
    the instance's total over its dies) and its compiled artefacts (a target without them would
    compile for minutes)."""
    return _weights_per_die(model, shape) + cal.COMPILED_ARTIFACT_BYTES_PER_DIE


def fork_hop_seconds(plane: Plane) -> float:
    """One hop of a pipelined chain: a slice over one link and the link's latency."""
    return cal.FORK_CHUNK_BYTES / link_bandwidth(plane, same_node=False) + link_latency(
        plane, same_node=False
    )


def fork_seconds(
    model: ModelShape,
    shape: InstanceShape,
    plane: Plane,
    position: int = 1,
    share: float = 1.0,
) -> float:
    """An NPU-fork's time for the target at ``position`` of its source's broadcast chain, the
    chain getting ``share`` of each source die's link (the rest to the source's KV transfers).

    Each die sends its shard over its own link (UB or RoCE, the cross-node rates: DeepServe's
    fork measurements are cross-node, §6.2). Concurrent targets share one pipelined HCCL
    broadcast (§6.2 "broadcast API"): a chain whose every hop forwards each slice as soon as it
    has it, so the target at position j gets ``bytes / rate + (j - 1) * hop`` (the linear
    pipeline's ``(P - 1 + n_s)(alpha + m_s beta)``, Pješivac-Grbović et al., "Performance analysis of
    MPI collective operations", Cluster Computing 2007), not ``j * bytes / rate``.
    """
    if position < 1 or not 0 < share <= 1:
        raise ValueError("position >= 1 and 0 < share <= 1")
    rate = link_bandwidth(plane, same_node=False) * share
    return (
        link_latency(plane, same_node=False)
        + fork_bytes_per_die(model, shape) / rate
        + (position - 1) * fork_hop_seconds(plane)
    )
