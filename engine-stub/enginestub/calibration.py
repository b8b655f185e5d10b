"""Every constant of the emulator, with the paper and section it comes from.

Papers (``../shared/papers``): 000 xDeepServe, 001 CloudMatrix-Infer ("Serving Large Language
Models on Huawei CloudMatrix384"), 002 DeepServe, 003 Expert-as-a-Service, 004 P/D-Serve.
[derived] marks arithmetic on the papers' numbers; [external] a fact from outside the papers
(model shapes), stated with its source. Never change a value here to make a benchmark pass.
"""

from __future__ import annotations

from dataclasses import dataclass

# The facts the operator's validation shares with the emulator are defined once, in the API's
# catalogue, with their sources: servers per SuperPod, NPUs per server, dies per NPU and HBM per
# die (001 §3), GPT-3's shape (004 §2.1): import those from there.

GB = 1e9
GIB = 1024**3
MIB = 1024**2
KIB = 1024
GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# --------------------------------------------------------------------------- hardware (001 §3)
DIE_BF16_FLOPS = 376e12  # 001 §3.3.1 "Each die sustains approximately 376 TFLOPS of dense BF16"
DIE_INT8_OPS = 752e12  # 001 §5.5.3 / T10 "the die's 752 peak INT8 TFLOPS"
DIE_HBM_BANDWIDTH = 1.6e12  # 001 §3.3.1 "1.6 TB/s available per die"

# Unified Bus, per die (001 §3.3.1 and T1)
UB_DIE_BANDWIDTH = 196 * GB  # "196 GB/s unidirectional" to the UB plane
UB_READ_BANDWIDTH_INTRA = 167 * GB  # T1 NPU-NPU read, intra-node
UB_READ_BANDWIDTH_INTER = 164 * GB  # T1 NPU-NPU read, inter-node
UB_LATENCY_INTRA = 1.2e-6  # T1, 512-byte read
UB_LATENCY_INTER = 1.9e-6  # T1

# RoCE (RDMA plane) and VPC
ROCE_DIE_BANDWIDTH = 200 * GBIT  # 001 §3.3.1 "200 Gbps of unidirectional bandwidth" per die
ROCE_LATENCY = 10e-6  # [external] typical RoCE v2 one-hop latency; the papers give none
VPC_NODE_BANDWIDTH = 400 * GBIT  # 001 §3.2 "up to 400 Gbps of unidirectional bandwidth per node"
VPC_LATENCY = 50e-6  # [external] datacenter TCP round trip order; the papers give none
ROCE_CONFLICT_PENALTY = (
    0.3  # 004 §2.2.3/§3.7: a conflict "even leading to hundreds of milliseconds"
)

# Host and storage
HOST_DRAM_BYTES = 1.5e12  # 002 §6.2 "each machine has 1.5TB of DRAM"
SHARED_FILE_SERVICE_BANDWIDTH = (
    2.5 * GB
)  # 001 §4.4.3 "standard 2.5 GB/s access bandwidth per bucket" (nominal)
SSD_NODE_BANDWIDTH = 400 * GBIT  # 001 §4.4.1 EVS access per node "typically under 400 Gbps"

# --------------------------------------------------------------------------- model caching (001 T2)
# Table 2: a 671B INT8 model (~671 GB) loaded into 8 instances of 16 NPUs from an OBS bucket of
# 2.5 GB/s. Row "cold start, no cache": ~2,560 s each, all 8 loading at once. Row "EMS": ~320 s
# (one fetch from OBS, shared through the memory pool). Warm start (DRAM -> NPU): ~5 s. Model
# switch with local DRAM caches: ~281 s at a 12.5 % hit rate (1 of 8 models cached per node).
T2_MODEL_BYTES = 671 * GB
T2_INSTANCE_NPUS = 16
COLD_START_8_INSTANCES_SECONDS = 2560.0
CACHED_COLD_START_SECONDS = 320.0  # EMS
WARM_START_SECONDS = 5.0
LOCAL_DRAM_SWITCH_SECONDS = 281.0
LOCAL_DRAM_HIT_RATE = 0.125
# [derived] The bucket's effective rate: 8 x 671 GB in 2,560 s = 2.10 GB/s (84 % of its nominal
# 2.5 GB/s). The EMS row (one fetch: 320 s) and the model-switch row (281 s) are not used to
# derive it: tests/unit/test_engine_models.py checks them against it.
SHARED_FILE_SERVICE_EFFECTIVE_BANDWIDTH = 8 * T2_MODEL_BYTES / COLD_START_8_INSTANCES_SECONDS
# [derived] Host DRAM -> NPU: the warm start, 671 GB / 5 s / 16 NPUs = 8.4 GB/s per NPU.
DRAM_TO_NPU_BANDWIDTH = T2_MODEL_BYTES / WARM_START_SECONDS / T2_INSTANCE_NPUS
TENSOR_INIT_SECONDS = 0.3  # 002 §6.2 "PyTorch-model tensor initialization (about 0.3s)"

# --------------------------------------------------------------------------- MoE communication (001 T7)
# CANN EP on CM384 at EP >= 128, batch 128 per rank: dispatch 54 GB/s, combine 103 GB/s.
DISPATCH_BANDWIDTH = 54 * GB
COMBINE_BANDWIDTH = 103 * GB
DISPATCH_BYTES_PER_TOKEN = 7.5 * KIB  # 001 §4.2.1 "transfer message size for each token is 7.5 KB"
COMBINE_BYTES_PER_TOKEN = 14 * KIB  # 001 §4.2.1 "14 KB"
MTP_GRAPH_LAUNCH_SECONDS = 0.7e-3  # 001 §4.2.4 "startup latency of 0.6-0.8 ms" per graph
MTP_ACCEPTED_TOKENS_PER_STEP = 1.7  # 001 §4.2.4 "1.7 tokens ... per MTP-enabled iteration"
MOE_ATTENTION_A2E_SECONDS = 172e-6  # 000: attention-to-expert
MOE_ATTENTION_E2A_SECONDS = 193e-6  # 000: expert-to-attention

# --------------------------------------------------------------------------- measured profiles (001 T3, T5)
# DeepSeek-R1 INT8, prefill EP32 on 16 NPUs, 4K-token prompts (T3).
PREFILL_TOKENS_PER_NPU_IDEAL_EPLB = 6688.0  # "Perfect EPLB"
PREFILL_TOKENS_PER_NPU_DEFAULT_EPLB = 5655.0  # "Default"
PREFILL_PROFILE_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class DecodePoint:
    """One measured decode operating point: requests per NPU -> TPOT (001 T5, 4K prompt)."""

    batch_per_npu: int
    tpot_seconds: float
    tokens_per_npu_per_second: float
    kv_tokens: int


DECODE_PROFILE: tuple[DecodePoint, ...] = (
    DecodePoint(8, 14.9e-3, 538.0, 4096 + 256),  # T5, SLO 15 ms
    DecodePoint(24, 24.6e-3, 974.0, 4096 + 256),  # T5, SLO 30 ms
    DecodePoint(96, 49.4e-3, 1943.0, 4096 + 256),  # T4/T5, SLO 50 ms
)
ROOFLINE_FIT_BATCH = 96  # the roofline's efficiency is fitted on this point only

# --------------------------------------------------------------------------- scaling and failures
DEEPSERVE_COLD_SCALE_SECONDS = 42.12  # 002 [secondary], Llama3-8B, per instance
DEEPSERVE_FORK_SCALE_SECONDS = 4.75  # 002 [secondary], with pre-warmed pod + NPU-fork

# --------------------------------------------------------------------------- the engine's start-up phases (002 §6)
# DeepServe splits a scale-out into ScalerPre, TE-Pre-Load, TE-Load, TE-Post-Load, ScalerPost
# (Fig. 8, Table 2); the engine emulates its own three.
# [design] TE-Pre-Load: "loading Python libraries, initializing NPU states, and setting up HCCL
# cross-NPU interconnections" (§6.1). The paper gives no per-phase figure (Fig. 9's bars did not
# survive in the text): it says only that after a ~35% cut the step "still accounts for the
# majority of startup time". So it must stay the dominant engine phase: more than the largest
# load of the model the secondary figure is about (Llama3-8B from the shared file service,
# 7.7 s), and a cold start, ScalerPre + 20 + 7.7 + TE-Post-Load + ScalerPost, of the order of
# the secondary 42.12 s (DEEPSERVE_COLD_SCALE_SECONDS) with ~14 s left to pod start and
# announcement. A warm pod pays it before it is claimed (§6.1: pre-warmed TEs).
TE_PRE_LOAD_SECONDS = 20.0
# [design] TE-Post-Load: warm-up profiling is replaced by "offline profile[d]" KV block sizes
# "stored in configurations" plus "a dummy message post-startup" (§6), so only block allocation
# and one dummy request are left: half a second.
TE_POST_LOAD_SECONDS = 0.5

# --------------------------------------------------------------------------- NPU-fork (002 §6.2)
# "NPU-fork can scale to a large number of TEs by transmitting model weights simultaneously to
# multiple TEs using the broadcast API in the HCCL" (§6.2); Fig. 11 scales up to 32 TEs from one.
FORK_FANOUT = 32
# [design] A fork carries the source's compiled artefacts (graphs, kernels) as well as its
# weights: Dynamo's ModelExpress moves both, since weights without the compiled caches leave
# minutes of compilation to the target. No paper gives their size; graph and kernel caches are
# of the order of hundreds of MB per rank, so 512 MiB per die, small beside the weights (3% of
# Llama3-8B's 16 GB on one die): the fork time stays the weights' time.
COMPILED_ARTIFACT_BYTES_PER_DIE = 512 * MIB
# [design] The pipelined broadcast's slice: each hop of the chain forwards a slice as soon as it
# has it. HCCL does not publish its slice size; 4 MiB is NCCL's default buffer (NCCL_BUFFSIZE).
FORK_CHUNK_BYTES = 4 * MIB
# [design] A target gives up a fork (and loads from its fallback) once it has waited as long as
# the fallback load would take, and never before this much wall time (loopback round trips and
# event-loop pauses on a loaded machine are wall time whatever the time scale).
FORK_WAIT_WALL_FLOOR_SECONDS = 5.0
FAILURES_PER_WEEK_PER_400 = 1.5  # 004 §3.4 "about 1 or 2 faults occur per week ... 400 GPUs"
FAILURES_PER_WEEK_PER_4096 = 8.8  # 003

# --------------------------------------------------------------------------- P/D-Serve (004)
HEALTH_REPORT_INTERVAL_SECONDS = 20.0  # 004 §3.2 "tens of seconds per followup reports"

# --------------------------------------------------------------------------- fault detection
# xDeepServe §6.1 gives no interval, timeout or probe period ("How fast: NOT STATED", notes/000.md
# §2.12); these are ours, stated with their reasons (docs/engine-stub.md, "Detection").
# The serving loop's heartbeat: notes/000.md B28's [I] T2 = 1 s between beats, a fault after 3
# missed beats (emulated s).
LOOP_BEAT_INTERVAL_SECONDS = 1.0
HANG_MISSED_BEATS = 3
# [design] A hang is never declared in under this much wall time, whatever the time scale: the
# watchdog shares the event loop with the beat, and on a loaded 2-core machine a loop can pause
# for a second or so (collections, other processes) without anything being hung.
HANG_WALL_FLOOR_SECONDS = 2.0
# [design] Link probing (000 §6.1, B30): a prefill sends each decode one dummy payload every
# interval (emulated s, floored in wall time so a large time scale does not flood the loopback);
# a probe not answered within the timeout (wall s: a loopback round trip under load) was never
# delivered; one delivered later than PROBE_DELAY_FACTOR times its transfer alone was delayed.
LINK_PROBE_INTERVAL_SECONDS = 2.0
LINK_PROBE_WALL_FLOOR_SECONDS = 0.5
LINK_PROBE_TIMEOUT_WALL_SECONDS = 2.0
LINK_PROBE_BYTES = 1 << 20  # 1 MiB: "dummy payloads", small beside any prompt's KV
PROBE_DELAY_FACTOR = 2.0

# --------------------------------------------------------------------------- disaggregated MoE (000 §5.2, §7.1; 003)
# xDeepServe §7.1's decode iteration with MoE and attention on separate dies: "2 ms scheduler
# overhead, 5 ms for the MTP layer, and layer-wise compute (0.7 x 2 x 61) ms, plus latencies for
# A2E (0.17 ms), MoE (0.12 ms), and E2A (0.19 ms), the total forward time is approximately
# 93 ms" (DeepSeek-R1, 480 attention dies in 3 DP domains of 160, EP288, 96 requests per die,
# 2K+2K workload). The scheduler and MTP terms are taken as stated; the per-layer attention and
# the MoE term are predicted by the roofline (enginestub.disaggregated), and the tests print
# the prediction's error against the stated total.
SCHEDULER_OVERHEAD_SECONDS = 2e-3  # 000 §7.1 "2 ms scheduler overhead"
MTP_LAYER_SECONDS = 5e-3  # 000 §7.1 "5 ms for the MTP layer"
DISAGGREGATED_MICROBATCHES = 2  # 000 §5.2 "two microbatches per domain"
DISAGGREGATED_BATCH_PER_DIE = 96  # 000 §7.1 "Each DP/die processes a local batch size of 96"
DISAGGREGATED_DOMAIN_DIES = 160  # 000 §7.1 "three DP domains, each with 160 DP groups" (TP=1)
DISAGGREGATED_EXPERT_DIES = 288  # 000 §7.1 "The remaining 288 NPU dies run EP288"
DISAGGREGATED_CONTEXT_TOKENS = 2048 + 1024  # [derived] 000 §7.1 "2K+2K": mean context 3K
DISAGGREGATED_ITERATION_SECONDS = 92.9e-3  # 000 §7.1 (2 + 5 + 0.7x2x61 + 0.17 + 0.12 + 0.19)
# 001 §5.5.3 / T10: CANN's INT8 grouped GEMM sustains 77.4-82.7% of the die's 752 TOPS.
GROUPED_GEMM_UTILIZATION = 0.8
# 000 §4.5 / Fig. 11a: "the hottest expert sees 30x more tokens than the average" (ShareGPT,
# one DeepSeek-R1 layer): the Zipf popularity's skew is solved for it.
HOTTEST_EXPERT_OVER_MEAN = 30.0
# [design] EaaS §3.4 gives no value for the client's "pre-defined timeout threshold": a server
# that has not answered an iteration's message in this long (emulated) is dropped and its part
# re-sent; never under the wall floor. The floor is the emulation's, not the paper's: on a
# 2-core machine running a cluster, tens of engines and their clients, an event loop stalls for
# a few hundred ms now and then, and a live server dropped for it (while its replica is the one
# that failed) leaves its experts without a copy: seen at 0.3 s with 4 servers and 2 clients
# under other tests' load. A dead server is found at once anyway (connection refused), or by
# its session's end; the floor only delays telling a hung one (SIGSTOP) from a slow one.
EXPERT_FAILOVER_SECONDS = 0.5
EXPERT_FAILOVER_WALL_FLOOR_SECONDS = 1.0
