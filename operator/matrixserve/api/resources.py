"""Pydantic models of the MatrixServe custom resources; they mirror ``crds/`` (the contract).

The contract test checks, field by field, that every property in a CRD's spec schema exists here
under the same JSON name and the other way round, and that the samples parse. Parse once at the
boundary: handlers turn a CR's ``spec`` into these models and the domain works on them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DnsLabel = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
BatchSize = Annotated[int, Field(ge=1, le=4096)]
DEFAULT_BATCH = 8


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Ref(_Spec):
    name: str = Field(min_length=1, max_length=253)


# --------------------------------------------------------------------------- PDGroup
class ModelSpec(_Spec):
    name: str = Field(min_length=1, max_length=128)
    size_bytes: int | None = Field(default=None, alias="sizeBytes", ge=1)
    layers: int | None = Field(default=None, ge=1, le=1024)
    hidden_size: int | None = Field(default=None, alias="hiddenSize", ge=1, le=1048576)
    kv_bytes_per_token: int | None = Field(default=None, alias="kvBytesPerToken", ge=1)
    max_context_tokens: int = Field(default=4096, alias="maxContextTokens", ge=1, le=1048576)
    prefill_artifact: str | None = Field(default=None, alias="prefillArtifact", max_length=512)
    decode_artifact: str | None = Field(default=None, alias="decodeArtifact", max_length=512)


class Parallelism(_Spec):
    tp: int | None = Field(default=None, ge=1, le=1024)
    dp: int | None = Field(default=None, ge=1, le=1024)
    ep: int | None = Field(default=None, ge=1, le=1024)


class RoleSpec(_Spec):
    replicas: int = Field(ge=0, le=256)
    devices_per_instance: int = Field(default=2, alias="devicesPerInstance", ge=1, le=64)
    pods_per_instance: int = Field(default=1, alias="podsPerInstance", ge=1, le=1)
    npu_type: str = Field(default="Ascend910C", alias="npuType", max_length=63)
    parallelism: Parallelism = Parallelism()
    batch_size: BatchSize = Field(default=DEFAULT_BATCH, alias="batchSize")
    image: str = Field(default="matrixserve/engine-stub:0.1.0", max_length=512)


class RatioMode(StrEnum):
    FIXED = "Fixed"
    MODEL = "Model"
    FEEDBACK = "Feedback"


class RatioPolicy(_Spec):
    mode: RatioMode = RatioMode.FIXED
    min_prefill: int | None = Field(default=None, alias="minPrefill", ge=1, le=256)
    max_prefill: int | None = Field(default=None, alias="maxPrefill", ge=1, le=256)
    min_decode: int | None = Field(default=None, alias="minDecode", ge=1, le=256)
    max_decode: int | None = Field(default=None, alias="maxDecode", ge=1, le=256)
    step: int = Field(default=1, ge=1, le=16)
    cooldown_seconds: int = Field(default=300, alias="cooldownSeconds", ge=0, le=86400)


class SLO(_Spec):
    ttft_milliseconds: int | None = Field(default=None, alias="ttftMilliseconds", ge=1, le=600000)
    # P/D-Serve §2.2.2: "the timeout threshold for 1k is quite different from that of 8k"
    ttft_per_1k_tokens: int = Field(default=0, alias="ttftMillisecondsPer1kTokens", ge=0, le=600000)
    tpot_milliseconds: int | None = Field(default=None, alias="tpotMilliseconds", ge=1, le=60000)


class RecoveryPolicy(StrEnum):
    MINIMUM_COST = "MinimumCost"
    RESTART_GROUP = "RestartGroup"


class Protect(StrEnum):
    DECODE = "Decode"
    PREFILL = "Prefill"
    NONE = "None"


class Recovery(_Spec):
    policy: RecoveryPolicy = RecoveryPolicy.MINIMUM_COST
    protect: Protect = Protect.DECODE


class MoEMode(StrEnum):
    COLOCATED = "Colocated"
    DISAGGREGATED = "Disaggregated"


class MoESpec(_Spec):
    mode: MoEMode
    dp_domain_ref: Ref | None = Field(default=None, alias="dpDomainRef")
    expert_pool_ref: Ref | None = Field(default=None, alias="expertPoolRef")


class PDGroupSpec(_Spec):
    service: DnsLabel
    scenario: DnsLabel
    model: ModelSpec
    prefill: RoleSpec
    decode: RoleSpec
    ratio_policy: RatioPolicy = Field(default=RatioPolicy(), alias="ratioPolicy")
    slo: SLO = SLO()
    warm_pool_ref: Ref | None = Field(default=None, alias="warmPoolRef")
    recovery: Recovery = Recovery()
    moe: MoESpec | None = None


# --------------------------------------------------------------------------- DPDomain
class DPGroups(_Spec):
    count: int = Field(ge=1, le=1024)
    tensor_parallel: int = Field(default=1, alias="tensorParallel", ge=1, le=64)
    dies_per_group: int = Field(default=1, alias="diesPerGroup", ge=1, le=128)
    batch_size: int = Field(default=96, alias="batchSize", ge=1, le=4096)


class DPLoadBalancing(StrEnum):
    LOWEST_KV_USAGE = "LowestKVUsage"
    ROUND_ROBIN = "RoundRobin"


class DPDomainSpec(_Spec):
    dp_groups: DPGroups = Field(alias="dpGroups")
    microbatches: int = Field(default=2, ge=1, le=8)
    expert_pool_ref: Ref = Field(alias="expertPoolRef")
    load_balancing: DPLoadBalancing = Field(
        default=DPLoadBalancing.LOWEST_KV_USAGE, alias="loadBalancing"
    )
    image: str = Field(default="matrixserve/engine-stub:0.1.0", max_length=512)


# --------------------------------------------------------------------------- ExpertPool
class ExpertModel(_Spec):
    name: str | None = Field(default=None, max_length=128)
    experts: int = Field(ge=1, le=4096)
    layers: int = Field(ge=1, le=1024)
    top_k: int = Field(alias="topK", ge=1, le=64)


class ExpertServers(_Spec):
    replicas: int = Field(ge=0, le=4096)
    slots_per_server: int = Field(default=4, alias="slotsPerServer", ge=1, le=256)
    devices_per_server: int = Field(default=1, alias="devicesPerServer", ge=1, le=8)
    image: str = Field(default="matrixserve/engine-stub:0.1.0", max_length=512)


class Rebalance(_Spec):
    interval_seconds: int = Field(default=60, alias="intervalSeconds", ge=1, le=86400)
    imbalance_percent_threshold: int = Field(
        default=20, alias="imbalancePercentThreshold", ge=1, le=1000
    )


class ExpertAutoscaling(_Spec):
    enabled: bool = False
    min_servers: int | None = Field(default=None, alias="minServers", ge=1, le=4096)
    max_servers: int | None = Field(default=None, alias="maxServers", ge=1, le=4096)
    target_tokens_per_server_per_second: int | None = Field(
        default=None, alias="targetTokensPerServerPerSecond", ge=1
    )


class ExpertPoolSpec(_Spec):
    model: ExpertModel
    servers: ExpertServers
    min_replicas_per_expert: int = Field(default=2, alias="minReplicasPerExpert", ge=1, le=16)
    redundant_expert_budget: int = Field(default=0, alias="redundantExpertBudget", ge=0, le=4096)
    rebalance: Rebalance = Rebalance()
    failover_timeout_milliseconds: int = Field(
        default=1000, alias="failoverTimeoutMilliseconds", ge=1, le=600000
    )
    autoscaling: ExpertAutoscaling = ExpertAutoscaling()


# --------------------------------------------------------------------------- WarmPool
class WarmShape(_Spec):
    name: str | None = Field(default=None, max_length=63)
    size: int = Field(ge=0, le=4096)
    npu_type: str = Field(default="Ascend910C", alias="npuType", max_length=63)
    devices_per_pod: int = Field(alias="devicesPerPod", ge=1, le=64)


class DramPreload(_Spec):
    model: str = Field(min_length=1, max_length=128)
    node_selector: dict[str, str] | None = Field(default=None, alias="nodeSelector")


class RefillPolicy(StrEnum):
    IMMEDIATE = "Immediate"
    SCHEDULED = "Scheduled"
    MANUAL = "Manual"


class WarmPoolSpec(_Spec):
    shapes: list[WarmShape] = Field(min_length=1)
    dram_preload: list[DramPreload] = Field(default=[], alias="dramPreload")
    refill_policy: RefillPolicy = Field(default=RefillPolicy.IMMEDIATE, alias="refillPolicy")
    image: str = Field(default="matrixserve/engine-stub:0.1.0", max_length=512)


SPECS: dict[str, type[_Spec]] = {
    "PDGroup": PDGroupSpec,
    "DPDomain": DPDomainSpec,
    "ExpertPool": ExpertPoolSpec,
    "WarmPool": WarmPoolSpec,
}


def field_errors(exc: ValidationError) -> list[str]:
    """A spec's validation errors as users read them: ``spec.<path>: <message>`` each."""
    return [f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
