"""The catalogue: the hardware and model facts the API's rules depend on.

The operator's validation (does the model fit the instance's HBM, do decode NPUs fit a SuperPod)
and the engine stub's emulation read the same facts, so they live here, in the API, and the stub
imports them (never the other way round). Every number carries its paper and section; model
shapes of public models are [external]: their published configuration files.

Parameter and KV counts are computed from a model's configuration fields, not typed in, so they
can be checked: DeepSeek-V3/R1 comes out at ~671B parameters (001 §3.5.1 "671B-parameter") and
GPT-3 175B at 4.5 MiB of KV per token (004 §2.1).
"""

from __future__ import annotations

from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, model_validator

GB = 1e9

# --------------------------------------------------------------------------- hardware (001 §3)
SERVERS_PER_SUPERPOD = 48  # 001 §3.3.3 "48 Ascend 910C nodes"
NPUS_PER_SERVER = 8  # 001 §3.3.2
DIES_PER_NPU = 2  # 001 §3.3.1 "dual-die package"
HOST_DRAM_BYTES = 1.5e12  # 002 §6.2 "each machine has 1.5TB of DRAM" (pre-loading's room)
DIE_HBM_BYTES = 64 * GB  # 001 §3.3.1 "64 GB per die"
HBM_USABLE_FRACTION = 0.9  # [design] 10% of HBM kept for activations and comm buffers

# --------------------------------------------------------------------------- GPT-3 (004 §2.1)
GPT3_HIDDEN = 12288  # 004 §2.1 (GPT-3 175B)
GPT3_LAYERS = 96  # 004 §2.1
FP16_BYTES = 2  # 004 §2.1 "2 (bytes for fp16)"


class MoEShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    routed_experts: int = Field(ge=1)
    shared_experts: int = Field(ge=0)
    top_k: int = Field(ge=1)
    expert_intermediate: int = Field(ge=1)
    moe_layers: int = Field(ge=1)


class MLAShape(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3): a compressed KV latent per token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int | None  # None: the query is projected whole (DeepSeek-V2-Lite)
    kv_lora_rank: int
    rope_dim: int
    qk_nope_dim: int
    v_head_dim: int


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int | None = Field(default=None, ge=1)  # GQA; None = MHA
    head_dim: int | None = None
    intermediate: int = Field(ge=1)  # dense FFN width
    vocab: int = Field(ge=1)
    dense_layers: int | None = None  # layers with a dense FFN (all, when no MoE)
    moe: MoEShape | None = None
    mla: MLAShape | None = None
    weight_bytes: float = Field(default=2.0, gt=0)  # 1 = INT8, 2 = BF16
    kv_bytes: float = Field(default=2.0, gt=0)  # bytes per KV element
    gated_ffn: bool = True  # 3 matrices (gate, up, down) per FFN; GPT-3 has 2

    @model_validator(mode="after")
    def _check(self) -> ModelShape:
        if self.moe is not None and self.moe.moe_layers > self.layers:
            raise ValueError("moe_layers exceeds layers")
        return self

    # ------------------------------------------------------------------ parameters
    @property
    def _head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @cached_property
    def attention_params_per_layer(self) -> int:
        h = self.hidden
        if self.mla is not None:
            m = self.mla
            q_width = self.heads * (m.qk_nope_dim + m.rope_dim)
            query = h * q_width if m.q_lora_rank is None else (h + q_width) * m.q_lora_rank
            return (
                query
                + h * (m.kv_lora_rank + m.rope_dim)
                + m.kv_lora_rank * self.heads * (m.qk_nope_dim + m.v_head_dim)
                + self.heads * m.v_head_dim * h
            )
        kv_heads = self.kv_heads or self.heads
        return h * self.heads * self._head_dim * 2 + h * kv_heads * self._head_dim * 2

    def _ffn_params(self, width: int) -> int:
        return (3 if self.gated_ffn else 2) * self.hidden * width

    @cached_property
    def expert_params_per_layer(self) -> int:
        return self._ffn_params(self.moe.expert_intermediate) if self.moe else 0

    @cached_property
    def n_dense_layers(self) -> int:
        if self.dense_layers is not None:
            return self.dense_layers
        return self.layers - (self.moe.moe_layers if self.moe else 0)

    @cached_property
    def dense_ffn_params(self) -> int:
        return self.n_dense_layers * self._ffn_params(self.intermediate)

    @cached_property
    def routed_expert_params(self) -> int:
        return (
            self.moe.routed_experts * self.moe.moe_layers * self.expert_params_per_layer
            if self.moe
            else 0
        )

    @cached_property
    def shared_expert_params(self) -> int:
        return (
            self.moe.shared_experts * self.moe.moe_layers * self.expert_params_per_layer
            if self.moe
            else 0
        )

    @cached_property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden  # input embedding; the LM head is the same size

    @cached_property
    def total_params(self) -> int:
        return (
            self.layers * self.attention_params_per_layer
            + self.dense_ffn_params
            + self.routed_expert_params
            + self.shared_expert_params
            + 2 * self.embedding_params
        )

    @cached_property
    def non_expert_params(self) -> int:
        """Everything but the routed and shared experts (attention, dense FFNs, embedding and
        LM head): what an attention client holds when its experts are served elsewhere (EaaS
        §3.1, xDeepServe §5.2)."""
        return self.total_params - self.routed_expert_params - self.shared_expert_params

    @cached_property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies through (top-k routed + shared experts for MoE)."""
        experts = (
            (self.moe.top_k + self.moe.shared_experts)
            * self.moe.moe_layers
            * self.expert_params_per_layer
            if self.moe
            else 0
        )
        return (
            self.layers * self.attention_params_per_layer
            + self.dense_ffn_params
            + experts
            + self.embedding_params  # LM head
        )

    @property
    def weight_bytes_total(self) -> float:
        return self.total_params * self.weight_bytes

    @property
    def non_expert_weight_bytes(self) -> float:
        return self.non_expert_params * self.weight_bytes

    # ------------------------------------------------------------------ KV cache
    @cached_property
    def kv_elements_per_token_per_layer(self) -> int:
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.rope_dim
        return 2 * (self.kv_heads or self.heads) * self._head_dim  # K and V

    @property
    def kv_bytes_per_token(self) -> float:
        """P/D-Serve §2.1: 2 bytes x hidden x 2 (K, V) x layers for an fp16 MHA model."""
        return self.kv_elements_per_token_per_layer * self.layers * self.kv_bytes

    # ------------------------------------------------------------------ attention FLOPs over context
    def attention_flops_per_context_token(self, decode: bool) -> float:
        """FLOPs per query token per context token (all layers): QK^T plus AV."""
        if self.mla is not None:
            m = self.mla
            if decode:  # absorbed MLA: attend over the latent directly
                per_layer = (
                    2 * self.heads * (m.kv_lora_rank + m.rope_dim) + 2 * self.heads * m.kv_lora_rank
                )
            else:
                per_layer = (
                    2 * self.heads * (m.qk_nope_dim + m.rope_dim) + 2 * self.heads * m.v_head_dim
                )
        else:
            per_layer = 2 * self.heads * self._head_dim * 2
        return float(per_layer * self.layers)


DEEPSEEK_V3 = ModelShape(
    # [external] deepseek-ai/DeepSeek-V3 config.json; 001 serves DeepSeek-R1 (same shape) in INT8.
    name="deepseek-v3",
    layers=61,
    hidden=7168,
    heads=128,
    intermediate=18432,
    vocab=129280,
    dense_layers=3,
    moe=MoEShape(
        routed_experts=256, shared_experts=1, top_k=8, expert_intermediate=2048, moe_layers=58
    ),
    mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, qk_nope_dim=128, v_head_dim=128),
    weight_bytes=1.0,  # 001 §4.5: INT8 weights
    kv_bytes=2.0,  # BF16 latent cache
)

DEEPSEEK_V2_LITE = ModelShape(
    # [external] deepseek-ai/DeepSeek-V2-Lite config.json: DeepSeek-V3's architecture (MLA, fine-
    # grained routed experts plus shared ones) at 15.7B parameters, 64 routed experts over 26 MoE
    # layers: a pool of a few expert servers holds it, so tests and demos run an ExpertPool whole.
    name="deepseek-v2-lite",
    layers=27,
    hidden=2048,
    heads=16,
    intermediate=10944,
    vocab=102400,
    dense_layers=1,
    moe=MoEShape(
        routed_experts=64, shared_experts=2, top_k=6, expert_intermediate=1408, moe_layers=26
    ),
    mla=MLAShape(q_lora_rank=None, kv_lora_rank=512, rope_dim=64, qk_nope_dim=128, v_head_dim=128),
    weight_bytes=2.0,  # BF16, as released
    kv_bytes=2.0,
)

GPT3_175B = ModelShape(
    # 004 §2.1; [external] Brown et al. 2020: 96 layers, hidden 12288, 96 heads, FFN 4x.
    name="gpt3-175b",
    layers=GPT3_LAYERS,
    hidden=GPT3_HIDDEN,
    heads=96,
    intermediate=4 * GPT3_HIDDEN,
    vocab=50257,
    gated_ffn=False,
    weight_bytes=2.0,
    kv_bytes=FP16_BYTES,
)

LLAMA3_8B = ModelShape(
    # [external] meta-llama/Meta-Llama-3-8B config.json (DeepServe 002's scaling example).
    name="llama3-8b",
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    intermediate=14336,
    vocab=128256,
    weight_bytes=2.0,
    kv_bytes=2.0,
)

PRESETS: dict[str, ModelShape] = {
    m.name: m for m in (DEEPSEEK_V3, DEEPSEEK_V2_LITE, GPT3_175B, LLAMA3_8B)
}
