"""Pydantic models of the MatrixServe custom resources; they mirror ``crds/`` (the contract).

The contract test checks, field by field, that every property in a CRD's spec schema exists here
under the same JSON name and the other way round, and that the samples parse. Parse once at the
boundary: handlers turn a CR's ``spec`` into these models and the domain works on them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from matrixserve.api import catalog
from matrixserve.api.kinds import ANNOTATION_CLAIM, ANNOTATION_WARM_TEMPLATE
from matrixserve.api.roles import Role

SUPERPOD_NPUS = catalog.SERVERS_PER_SUPERPOD * catalog.NPUS_PER_SERVER  # 384

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


# --------------------------------------------------------------------------- quantities
# CPU and memory of engine pods (requested, so an engine is not BestEffort). A Kubernetes resource
# quantity (k8s.io/apimachinery's resource.Quantity) without a sign; the CRD carries this pattern,
# so the API server and the models agree on what parses.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[eE][-+]?[0-9]+|[numkMGTPE])?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_BINARY_EXPONENT = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_EXPONENT = {
    **{"n": -9, "u": -6, "m": -3, "": 0},
    **{"k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18},
}


def quantity_value(text: str) -> Decimal:
    """A quantity in base units (CPUs, bytes): ``500m`` -> 0.5, ``1Gi`` -> 2**30, ``1e3`` ->
    1000. Raises ``ValueError`` when ``text`` is not one (:data:`QUANTITY_PATTERN`)."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    amount, suffix = Decimal(match.group(1)), match.group(3) or ""
    if suffix in _BINARY_EXPONENT:
        return amount * Decimal(2) ** _BINARY_EXPONENT[suffix]
    exponent = _DECIMAL_EXPONENT[suffix] if suffix in _DECIMAL_EXPONENT else int(suffix[1:])
    if abs(exponent) > 18:  # beyond what a Kubernetes quantity holds (int64 of nano-units)
        raise ValueError(f"{text!r} is out of a Kubernetes quantity's range")
    return amount.scaleb(exponent)


def _quantity_text(value: Any) -> str:
    """A quantity as written, checked to parse and to be more than 0. YAML gives ``cpu: 2`` and
    ``cpu: 0.5`` as numbers, which a Pod's resources take too; the model keeps them as text (a
    float as Python writes it: ``0.5``, ``1e+20``), so a pod's stamped template is the spec's."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PydanticCustomError(
            "quantity_type", "a quantity is a string (500m, 1Gi) or a number (2, 0.5)"
        )
    text = str(value)
    try:
        amount = quantity_value(text)
    except ValueError as exc:
        raise PydanticCustomError(
            "quantity", "{problem} (e.g. 500m, 2, 512Mi, 4Gi)", {"problem": str(exc)}
        ) from None
    if amount <= 0:
        raise PydanticCustomError(
            "quantity_zero", "{text} must be more than 0", {"text": repr(text)}
        )
    return text


Quantity = Annotated[str, BeforeValidator(_quantity_text)]


# Upper bounds. An instance is one pod on one server (at most 8 NPUs: the validation), and no
# such server has 1024 CPUs or 16 TiB of memory, so more is a typo, which would leave the pod
# Pending for ever (Unschedulable) instead of refused; far beyond them, Kubernetes would cap
# silently what its quantities cannot hold (2^63-1 of a unit: ``99999999999999999999E``).
MAX_CPU, MAX_CPU_TEXT = Decimal(1024), "1024"
MAX_MEMORY, MAX_MEMORY_TEXT = Decimal(16 * 2**40), "16Ti"
RESOURCE_NAMES = ("cpu", "memory")


class CpuMemory(_Spec):
    """CPU (cores: ``2``, ``500m``, ``0.5``) and memory (bytes: ``512Mi``, ``4Gi``) of a
    container: nothing else (NPUs come from ``devicesPerInstance``; other resources, such as
    ``ephemeral-storage``, are not set by a spec)."""

    cpu: Quantity | None = None
    memory: Quantity | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_cpu_and_memory(cls, data: Any) -> Any:
        # The CRD keeps other names (rather than prune them without a word) for this refusal.
        others = sorted(set(data) - set(RESOURCE_NAMES)) if isinstance(data, dict) else []
        if others:
            raise PydanticCustomError(
                "resource_name",
                "{names} is not a resource set here: only cpu and memory (NPUs come from "
                "devicesPerInstance)",
                {"names": ", ".join(map(str, others))},
            )
        return data

    @field_validator("cpu")
    @classmethod
    def _whole_millicores(cls, value: str | None) -> str | None:
        if value is None:
            return value
        # Kubernetes rounds a finer CPU amount up to 1m without a word: refuse it instead.
        if not _whole(quantity_value(value) * 1000):
            raise PydanticCustomError(
                "cpu_precision",
                "{text} is finer than 1m (a thousandth of a CPU), the smallest amount Kubernetes counts",
                {"text": repr(value)},
            )
        return _at_most(value, MAX_CPU, MAX_CPU_TEXT + " CPUs")

    @field_validator("memory")
    @classmethod
    def _whole_bytes(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not _whole(quantity_value(value)):
            raise PydanticCustomError(
                "memory_bytes", "{text} is not a whole number of bytes", {"text": repr(value)}
            )
        return _at_most(value, MAX_MEMORY, MAX_MEMORY_TEXT)


def _whole(amount: Decimal) -> bool:
    return amount == amount.to_integral_value()


def _at_most(value: str, bound: Decimal, bound_text: str) -> str:
    if quantity_value(value) > bound:
        raise PydanticCustomError(
            "quantity_bound",
            "{text} is more than {bound}, more than one server has (each pod of an instance runs "
            "on a server of its own)",
            {"text": repr(value), "bound": bound_text},
        )
    return value


class EngineResources(_Spec):
    """An engine container's CPU and memory requests and limits; a value left out takes the
    operator's default (``matrixserve.domain.enginepod.engine_resources``)."""

    requests: CpuMemory = CpuMemory()
    limits: CpuMemory = CpuMemory()


class RoleSpec(_Spec):
    replicas: int = Field(ge=0, le=256)
    # NPUs of the whole instance, over its pods (each pod ``npus_per_pod`` of them, one pod per
    # server): at most a SuperPod's (001 §3.3.3), the largest block the fabric keeps together.
    devices_per_instance: int = Field(default=2, alias="devicesPerInstance", ge=1, le=SUPERPOD_NPUS)
    pods_per_instance: int = Field(
        default=1, alias="podsPerInstance", ge=1, le=catalog.SERVERS_PER_SUPERPOD
    )
    npu_type: str = Field(default="Ascend910C", alias="npuType", max_length=63)
    parallelism: Parallelism = Parallelism()
    batch_size: BatchSize = Field(default=DEFAULT_BATCH, alias="batchSize")
    image: str = Field(default="matrixserve/engine-stub:0.1.0", max_length=512)
    resources: EngineResources | None = None

    @property
    def npus_per_pod(self) -> int:
        """Each pod's NPUs (validation refuses an instance its pods cannot share equally)."""
        return max(1, self.devices_per_instance // self.pods_per_instance)


class RatioMode(StrEnum):
    FIXED = "Fixed"
    MODEL = "Model"
    FEEDBACK = "Feedback"


class RatioTransition(StrEnum):
    FIXED_TOTAL = "FixedTotal"  # release an instance of one role, then add one of the other
    ELASTIC = "Elastic"  # add first, then release


# A ladder rung: "P:D", both at least 1 (MindCluster's scaling-rule: allowed splits)
LADDER_RUNG = r"^[1-9][0-9]{0,2}:[1-9][0-9]{0,2}$"


class FeedbackTuning(_Spec):
    """The feedback rule's thresholds (P/D-Serve §3.3 gives none: ``[design]``)."""

    e2e_rise: float = Field(default=0.2, alias="e2eRise", gt=0, le=10)
    tp_share_delta: float = Field(default=0.05, alias="tpShareDelta", gt=0, lt=1)
    rejection: float = Field(default=0.05, gt=0, le=1)
    kv_wait: float = Field(default=0.4, alias="kvWait", gt=0, le=1)
    slots_full: float = Field(default=0.9, alias="slotsFull", gt=0, le=1)
    windows: int = Field(default=3, ge=1, le=100)
    improve: float = Field(default=0.05, gt=0, lt=1)


class RatioPolicy(_Spec):
    mode: RatioMode = RatioMode.FIXED
    min_prefill: int | None = Field(default=None, alias="minPrefill", ge=1, le=256)
    max_prefill: int | None = Field(default=None, alias="maxPrefill", ge=1, le=256)
    min_decode: int | None = Field(default=None, alias="minDecode", ge=1, le=256)
    max_decode: int | None = Field(default=None, alias="maxDecode", ge=1, le=256)
    min_ratio: float | None = Field(default=None, alias="minRatio", gt=0, le=256)
    max_ratio: float | None = Field(default=None, alias="maxRatio", gt=0, le=256)
    ladder: list[Annotated[str, Field(pattern=LADDER_RUNG)]] = Field(
        default_factory=list, max_length=64
    )
    transition: RatioTransition = RatioTransition.FIXED_TOTAL
    step: int = Field(default=1, ge=1, le=16)
    cooldown_seconds: int = Field(default=300, alias="cooldownSeconds", ge=0, le=86400)
    window_seconds: int = Field(default=30, alias="windowSeconds", ge=5, le=3600)
    margin: float = Field(default=0.05, ge=0, le=1)
    feedback: FeedbackTuning = FeedbackTuning()

    @property
    def total_driven(self) -> bool:
        """Under a policy the spec's replicas set the total and the policy splits it."""
        return self.mode is not RatioMode.FIXED


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

    def role_spec(self, role: Role) -> RoleSpec:
        """The part of the spec that describes ``role``'s instances."""
        return self.prefill if role is Role.PREFILL else self.decode


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
    # the WarmPool a replacement or new server may be claimed from (DeepServe §6.1); none: any
    # pool of the namespace, as a PDGroup's
    warm_pool_ref: Ref | None = Field(default=None, alias="warmPoolRef")


# --------------------------------------------------------------------------- WarmPool
class WarmShape(_Spec):
    name: str | None = Field(
        default=None, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    )
    size: int = Field(ge=0, le=4096)
    npu_type: str = Field(default="Ascend910C", alias="npuType", max_length=63)
    devices_per_pod: int = Field(alias="devicesPerPod", ge=1, le=64)
    # where its pods go beside the NPU type (e.g. a SuperPod: matrixserve.io/superpod)
    node_selector: dict[str, str] | None = Field(default=None, alias="nodeSelector")


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


class WarmClaim(BaseModel):
    """The record a claimed warm pod carries (``kinds.ANNOTATION_CLAIM``): the instance and role it
    became, the path chosen and its estimate (seconds per phase, every path considered), the fork
    source, when. (The shared file service's readers are not said: the engines count them as they
    load, ``enginestub.engine.bucket``.)"""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    instance: str = ""
    role: str = ""  # a Role's letter: "P", "D"
    path: str = ""  # scaleout.Path values
    estimate_seconds: float | None = Field(default=None, alias="estimateSeconds")
    phases: dict[str, float] = Field(default_factory=dict)
    considered: dict[str, float] = Field(default_factory=dict)
    fork_source: str | None = Field(default=None, alias="forkSource")
    at: float = 0.0

    @classmethod
    def of(cls, annotations: Mapping[str, str]) -> WarmClaim:
        """The record on a pod's annotations; an empty one if absent or unreadable."""
        try:
            return cls.model_validate_json(annotations.get(ANNOTATION_CLAIM) or "{}")
        except ValueError:
            return cls()

    def dump(self) -> str:
        return json.dumps(self.model_dump(by_alias=True, exclude_none=True), sort_keys=True)


class WarmTemplate(BaseModel):
    """What a warm pod is made from (``kinds.ANNOTATION_WARM_TEMPLATE``): a pod of
    another template is replaced by its pool, and a group claims only a pod of its own image."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    image: str = ""
    devices_per_pod: int = Field(default=0, alias="devicesPerPod")
    npu_type: str = Field(default="", alias="npuType")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")

    @classmethod
    def of(cls, annotations: Mapping[str, str]) -> WarmTemplate | None:
        """The template on a pod's annotations; None if absent or unreadable."""
        try:
            return cls.model_validate_json(annotations[ANNOTATION_WARM_TEMPLATE])
        except (KeyError, ValueError):
            return None

    def dump(self) -> str:
        return json.dumps(self.model_dump(by_alias=True), sort_keys=True)


SPECS: dict[str, type[_Spec]] = {
    "PDGroup": PDGroupSpec,
    "DPDomain": DPDomainSpec,
    "ExpertPool": ExpertPoolSpec,
    "WarmPool": WarmPoolSpec,
}


def field_errors(exc: ValidationError) -> list[str]:
    """A spec's validation errors as users read them: ``spec.<path>: <message>`` each."""
    return [f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
