"""The status of MatrixServe's custom resources, as the API server stores it (pydantic).

A status is the operator's memory between passes as much as its report: the ratio policy's
window and feedback state, the recoveries under way and the last scale are read back on the
next pass. So it is parsed once, at the boundary, into these models, and the domain reads and
writes their typed fields (a split is a :class:`Split`, a time is epoch seconds) instead of
keys and strings it would parse again on every pass.

What is stored must not change with the typing: the reconciler compares the status it would
write with the one the API server holds and patches only what differs, so a settled object is
never patched. ``dump()`` (``by_alias=True, exclude_none=True``) gives exactly the dict that is
written; ``tests/unit/test_status_models.py`` checks every model against ``crds/`` and
round-trips statuses the planner produced.

Where the CRD keeps unknown fields (``x-kubernetes-preserve-unknown-fields``: state of the
operator's own making, written by whichever version ran last), a value of the wrong shape reads
as absent rather than failing the pass, and the fields a version does not know are carried
over as they were.

WarmPool's status (below PDGroup's) is read the same tolerant way and dumped the same way;
``tests/unit/test_warmpool_status.py`` keeps it in step with its CRD.
"""

from __future__ import annotations

import math
from collections.abc import KeysView, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.alias_generators import to_camel

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import RatioMode
from matrixserve.api.rfc3339 import format as rfc3339
from matrixserve.api.rfc3339 import parse as parse_time

# =================================================================================== PDGroup


# ------------------------------------------------------------------------- stored values
@dataclass(frozen=True)
class Split:
    """A P/D split: ``prefill`` and ``decode`` instances; stored as ``"P:D"``."""

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
        split = cls.read(text)
        if split is None:
            raise ValueError(f"{text!r} is not P:D (two whole numbers, e.g. 3:1)")
        if split.prefill < 1 or split.decode < 1:
            raise ValueError(f"{text!r}: each role needs at least one instance")
        return split

    @classmethod
    def read(cls, text: object) -> Split | None:
        """``"P:D"`` with two whole numbers (a role may have none serving: ``"0:2"``), else
        None."""
        if isinstance(text, Split):
            return text
        if not isinstance(text, str):
            return None
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            return None
        try:
            return cls(int(parts[0]), int(parts[1]))
        except ValueError:  # a digit int() does not take ("²")
            return None

    @property
    def whole(self) -> bool:
        """Both roles have an instance (a split a policy may target)."""
        return self.prefill >= 1 and self.decode >= 1


def _number(value: Any) -> float | None:
    """A finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    """A whole number of at least 0 (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _time(value: Any) -> float | None:
    """Epoch seconds as given (the domain's), or as an RFC 3339 string reads (the stored)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return parse_time(value)


def _role(value: Any) -> str | None:
    return value if isinstance(value, str) and value in ("prefill", "decode") else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _or_none(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """The value as its type reads it, or None if it does not (a hand edit, an older shape)."""
    try:
        return handler(value)
    except ValidationError:
        return None


def _strings(value: Any) -> list[str] | None:
    """A list's strings (anything else in it left out), or None if it is not a list."""
    if not isinstance(value, list):
        return None
    return [v for v in value if isinstance(v, str)]


def _objects(value: Any) -> list[Any] | None:
    """A list's objects (anything else in it left out), or None if it is not a list."""
    if not isinstance(value, list):
        return None
    return [v for v in value if isinstance(v, Mapping | BaseModel)]


SplitText = Annotated[
    Split | None,
    BeforeValidator(Split.read),
    PlainSerializer(str, return_type=str, when_used="unless-none"),
]
Time = Annotated[
    float | None,
    BeforeValidator(_time),
    PlainSerializer(rfc3339, return_type=str, when_used="unless-none"),
]
# A time that is always there: epoch seconds in the domain, RFC 3339 (MicroTime) as stored;
# the epoch seconds an older operator stored read too, anything unreadable as 0 (never).
Instant = Annotated[
    float,
    BeforeValidator(lambda value: _time(value) or 0.0),
    PlainSerializer(rfc3339, return_type=str),
]
Number = Annotated[float | None, BeforeValidator(_number)]
Count = Annotated[int | None, BeforeValidator(_count)]
RoleName = Annotated[str | None, BeforeValidator(_role)]
Flag = Annotated[bool | None, BeforeValidator(_flag)]
# A number a record carries from pass to pass, kept as it reads: the API server gives a whole
# float back as an integer, and the messages that quote it say what they read.
Quoted = int | float

_ALIASES = {"from_": "from", "e2e": "e2e", "baseline_e2e": "baselineE2E"}


def _alias(name: str) -> str:
    return _ALIASES.get(name) or to_camel(name)


class Stored(BaseModel):
    """A part of a status as stored: camelCase keys, ``None`` for a key that is absent."""

    model_config = ConfigDict(
        alias_generator=_alias, populate_by_name=True, frozen=True, extra="ignore"
    )

    def dump(self) -> dict[str, Any]:
        """The dict written to the API server (an absent field has no key)."""
        return self.model_dump(by_alias=True, exclude_none=True)

    @classmethod
    def of(cls, raw: object) -> Self | None:
        """``raw`` as this model: itself, or a stored mapping read (None if it is neither, or
        does not read as one)."""
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls.model_validate(raw)
        except ValidationError:
            return None

    # Read by key as well, as the dict a status was before it was typed (every field, None
    # where absent; what tests and tools inspect); the domain reads the fields, which mypy
    # checks (tests/unit/test_status_models.py keeps it so).
    def _keyed(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)

    def __getitem__(self, key: str) -> Any:
        return self._keyed()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keyed()

    def keys(self) -> KeysView[str]:
        return self._keyed().keys()

    def get(self, key: str, default: Any = None) -> Any:
        return self._keyed().get(key, default)


class Carried(Stored):
    """A part kept under ``x-kubernetes-preserve-unknown-fields``: the fields this version does
    not know are carried over as they were."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------- the ratio block
class TallyStatus(Stored):
    """Windows summed (the feedback rule's and the history's :class:`Tally`)."""

    windows: Count = None
    e2e: Number = None
    finished: Number = None
    seconds: Number = None
    saturated: Number = None


LenientTally = Annotated[TallyStatus | None, WrapValidator(_or_none)]


class FeedbackStatus(Stored):
    """The feedback rule's state between windows (``FeedbackState``); rewritten whole on each
    pass."""

    baseline_e2e: Number = None
    baseline_share: Number = None
    alarm: RoleName = None
    streak: Count = None
    trend: LenientTally = None
    last_change: Number = None
    moving: RoleName = None
    before: LenientTally = None
    refuted: Annotated[list[str] | None, BeforeValidator(_strings)] = None
    calm: Count = None
    judged: LenientTally = None


class MixStatus(Stored):
    prompt_tokens: Number = None
    output_tokens: Number = None


class MeasuredStatus(Stored):
    """One split served under the current load: its windows and the figures said of them."""

    split: SplitText = None
    tally: LenientTally = None
    served: Number = None
    phi: Number = None
    e2e: Number = None
    batch: Number = None
    tpot: Number = None
    at: Number = None


class HistoryStatus(Stored):
    """What the group measured and did under the current load (``History``)."""

    mix: Annotated[MixStatus | None, WrapValidator(_or_none)] = None
    measured: Annotated[list[MeasuredStatus] | None, BeforeValidator(_objects)] = None
    last_move: RoleName = None
    reversals: Count = None
    last_reversal: Flag = None
    flap_said: Flag = None
    drift: Count = None
    shift: Count = None


class RatioWindow(Carried):
    """The observation window under way: when it started, its members (``name@incarnation``),
    and their load counters summed per role at its start."""

    start: Number = None
    members: Annotated[list[str] | None, WrapValidator(_or_none)] = None
    prefill: Annotated[zl.Load | None, WrapValidator(_or_none)] = None
    decode: Annotated[zl.Load | None, WrapValidator(_or_none)] = None


class RatioStatus(Stored):
    """The P/D split: serving now, the policy's target, this pass's counts on the way, and why;
    under a policy, its window, its memory and the figures behind its last decision."""

    current: SplitText = None
    target: SplitText = None
    desired: SplitText = None
    policy: Annotated[
        RatioMode | None,
        WrapValidator(_or_none),
        PlainSerializer(str, return_type=str, when_used="unless-none"),
    ] = None
    reason: str | None = None
    last_change_time: Time = None
    reached_time: Time = None
    from_: SplitText = None
    phi: float | None = None
    prefill_capacity: float | None = None
    decode_capacity: float | None = None
    bottleneck: str | None = None
    numbers: dict[str, float] | None = None
    window: Annotated[RatioWindow | None, WrapValidator(_or_none)] = None
    feedback: Annotated[FeedbackStatus | None, WrapValidator(_or_none)] = None
    history: Annotated[HistoryStatus | None, WrapValidator(_or_none)] = None


# ------------------------------------------------------------------------- records
class FaultStatus(Carried):
    """The fault a recovery is for, as detected."""

    kind: str | None = None
    instances: list[str] | None = None
    detected_by: str | None = None
    at: str | None = None
    detail: str | None = None
    peer: str | None = None


class OptionStatus(Carried):
    """A recovery option as the planner priced it (``recovery.Option.as_status``); the chosen
    one also names the prefills a shrink gives up."""

    action: str | None = None
    instances: list[str] | None = None
    predicted_restore_seconds: Quoted | None = None
    cost: Quoted | None = None
    lost_fraction: Quoted | None = None
    feasible: bool | None = None
    why: str | None = None
    terms: dict[str, Quoted] | None = None
    sacrificed: list[str] | None = None


class RecoveryRecord(Carried):
    """One recovery under way or ended (``status.recovering``, ``status.lastRecovery``): kept as
    it was written, its times as written (RFC 3339), until it ends."""

    fault: FaultStatus | None = None
    detected_at: str | None = None
    detected_after_seconds: Quoted | None = None
    plan: OptionStatus | None = None
    alternatives: list[OptionStatus] | None = None
    pods_restarted: int | None = None
    incarnations: dict[str, str] | None = None
    phase: str | None = None
    restored_at: str | None = None
    restored_after_seconds: Quoted | None = None
    deferred: list[str] | None = None

    @property
    def action(self) -> str:
        return (self.plan.action if self.plan else None) or ""

    @property
    def planned(self) -> list[str]:
        """The instances its plan takes out (restarts, replaces or gives up)."""
        return list((self.plan.instances if self.plan else None) or [])

    @property
    def faulty(self) -> list[str]:
        return list((self.fault.instances if self.fault else None) or [])

    @property
    def sacrificed(self) -> list[str]:
        return list((self.plan.sacrificed if self.plan else None) or [])


class ScaleRecord(Carried):
    """The latest instance to come and serve: the path it came by, where its weights came
    from, the engine's phases (emulated seconds) and the wall seconds to serving."""

    instance: str | None = None
    pod: str | None = None
    pod_uid: str | None = None
    path: str | None = None
    load_source: str | None = None
    fork_source: str | None = None
    estimate_seconds: Quoted | None = None
    phases: dict[str, Quoted] | None = None
    emulated_seconds: Quoted | None = None
    wall_seconds: Quoted | None = None
    started_at: Quoted | None = None


# ------------------------------------------------------------------------- the status
class StoredCondition(Stored):
    """A condition as stored (the reconciler writes them; the planner reads them back)."""

    type: str
    status: str | None = None
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None
    observed_generation: int | None = None

    @property
    def true(self) -> bool:
        return self.status == "True"


class RoleStatus(Stored):
    replicas: int = 0
    ready: int = 0
    summary: str = ""


class InstanceStatus(Stored):
    """One instance's row: its pod, server, RoCE IPs and state. The planner writes ``""`` for
    what it does not know yet, which the API server does not store (read back: None)."""

    name: str = ""
    role: str = ""
    pod: str | None = None
    node: str | None = None
    superpod: str | None = None
    roce_ips: list[str] = Field(default_factory=list)
    state: str = ""
    # podIP:port of its engine, as reported (the gateway's fallback route)
    endpoint: str | None = None
    # an instance of several pods: each pod and its server, in rank order (leader first)
    pods: list[str] | None = None
    servers: list[str] | None = None
    kv_plane: str | None = None  # UB | RoCE


class LinksStatus(Stored):
    expected: int = 0
    verified: int = 0
    summary: str = ""


class PDGroupStatus(Stored):
    """A PDGroup's ``status``. Every field may be absent: a status kept while ZooKeeper cannot
    say better is the last known one, whatever it had.

    A top-level field set to ``None`` explicitly is written as ``null``, which deletes the key
    the API server holds (``adapters.kube.status_patch``); one not set leaves it as it is."""

    observed_generation: int | None = None
    selector: str | None = None
    conditions: list[StoredCondition] | None = None
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    instances: list[InstanceStatus] | None = None
    roce_map_version: int | None = None
    links: LinksStatus | None = None
    entrances: list[str] | None = None
    ratio: RatioStatus | None = None
    last_scale: ScaleRecord | None = None
    last_recovery: RecoveryRecord | None = None
    recovering: list[RecoveryRecord] | None = None
    deferred: list[str] | None = None

    @classmethod
    def read(cls, raw: Mapping[str, Any] | None) -> Self:
        """The status as the API server returned it (None: the object has none yet)."""
        return cls.model_validate(raw or {})

    def dump(self) -> dict[str, Any]:
        cleared = {
            self.__class__.model_fields[name].alias or name: None
            for name in self.model_fields_set
            if getattr(self, name) is None
        }
        return {**cleared, **super().dump()}

    def condition(self, kind: str) -> StoredCondition | None:
        """The stored condition ``kind``, if the status has one."""
        return next((c for c in self.conditions or [] if c.type == kind), None)

    def is_true(self, kind: str) -> bool:
        found = self.condition(kind)
        return found is not None and found.true

    def without_conditions(self) -> PDGroupStatus:
        """The status with its conditions left out (the reconciler merges this pass's)."""
        return PDGroupStatus.model_validate(
            self.model_dump(by_alias=True, exclude_none=True, exclude={"conditions"})
        )


# --------------------------------------------------------------------------- WarmPool
class _WarmPoolStatusPart(BaseModel):
    """Read tolerant of what another operator version may have stored (the schema requires no
    field of a row: each has a default); written as built."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class WarmPoolCondition(_WarmPoolStatusPart):
    """A condition as stored (the loop merges the planner's into these)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = Field(default=None, alias="lastTransitionTime")
    observed_generation: int | None = Field(default=None, alias="observedGeneration")


class WarmShapeStatus(_WarmPoolStatusPart):
    """One shape of the pool: its spec'd size and NPUs, and its pods counted by state."""

    name: str = ""
    size: int = 0
    npu_type: str = Field(default="", alias="npuType")
    devices_per_pod: int = Field(default=0, alias="devicesPerPod")
    ready: int = 0  # warm: claimable now
    warming: int = 0  # the pool's, not warm yet
    claimed: int = 0  # made by the pool, a group's now


class WarmDramStatus(_WarmPoolStatusPart):
    """A server running the pool's warm pods: the models planned for its host DRAM and those its
    warm engines say they hold (DeepServe §6.2 pre-loading)."""

    node: str = ""
    models: list[str] = Field(default_factory=list)
    loaded: list[str] = Field(default_factory=list)
    bytes: int = 0
    capacity_bytes: int = Field(default=0, alias="capacityBytes")


class WarmPoolStatus(_WarmPoolStatusPart):
    """A WarmPool's status. Fields a pass may leave out are None (and not written)."""

    observed_generation: int | None = Field(default=None, alias="observedGeneration")
    ready: int = 0
    warming: int = 0
    claimed: int = 0
    forks_done: int = Field(default=0, alias="forksDone")
    shapes: list[WarmShapeStatus] = Field(default_factory=list)
    # The generation last filled (refillPolicy Manual refills only a new one); None: never.
    filled_generation: int | None = Field(default=None, alias="filledGeneration")
    # Of the pool's claims, the share that found their model warm; None while there is none.
    hit_rate_percent: int | None = Field(default=None, alias="hitRatePercent")
    dram: list[WarmDramStatus] = Field(default_factory=list)
    # Written by the loop beside the planner's status, read back with the rest.
    conditions: list[WarmPoolCondition] | None = None

    def dump(self) -> dict[str, Any]:
        """As the API server stores it (camelCase; a field that is None left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def __getitem__(self, field: str) -> Any:
        """A field by its stored name, as stored (``status["filledGeneration"]``)."""
        return self.dump()[field]


# --------------------------------------------------------------------------- ExpertPool
class _ExpertPoolStatusPart(BaseModel):
    """Read tolerant of what another operator version may have stored; written as built."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class ExpertCoverageStatus(_ExpertPoolStatusPart):
    """Experts short of ``minReplicasPerExpert`` live copies, and with none, in some layer."""

    under_replicated: int = Field(default=0, alias="underReplicated")
    uncovered: int = 0


class ExpertFailoverStatus(_ExpertPoolStatusPart):
    """The last failover: the servers whose reports went, when it was seen, the map
    version that dropped them, and the one that restored every expert's copies (None: not yet)."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    servers: list[str] = Field(default_factory=list)
    at: Instant = 0.0
    version: int = 0
    restored_version: int | None = Field(default=None, alias="restoredVersion")
    restored_at: Time = Field(default=None, alias="restoredAt")
    # The replacement server created for it, the path it was obtained by and its estimate
    # (wall s, claim to serving); None when the server came back by itself (a restart).
    replacement: str | None = None
    replacement_path: str | None = Field(default=None, alias="replacementPath")
    replacement_estimate_seconds: float | None = Field(
        default=None, alias="replacementEstimateSeconds"
    )
    # Recovery's choice for servers whose engine exited (restart in place, or a replacement:
    # warm when a warm pod is there), priced (:func:`matrixserve.domain.recovery.choose`).
    recovery: dict[str, Any] | None = None
    # Wall seconds from the failure seen to every expert's copies restored (``restoredAt -
    # at``): the coverage gap a warm replacement shortens.
    restored_seconds: float | None = Field(default=None, alias="restoredSeconds")


class ExpertScaleStatus(_ExpertPoolStatusPart):
    """The last change of the server count: from, to, by whom (spec or autoscaler), when."""

    from_servers: int = Field(default=0, alias="from")
    to_servers: int = Field(default=0, alias="to")
    by: str = ""
    at: Instant = 0.0


class ExpertTokenSample(_ExpertPoolStatusPart):
    """The servers' cumulative token counts at ``at``, with the time of the report each was
    read from: the autoscaler's last sample (the rate is the next sample's difference over
    each server's time between); and the server counts the last samples asked for (newest
    last: a scale-down's stabilization window)."""

    at: Instant = 0.0
    tokens: dict[str, int] = Field(default_factory=dict)
    reported_at: dict[str, Instant] = Field(default_factory=dict, alias="reportedAt")
    tokens_per_second: float | None = Field(default=None, alias="tokensPerSecond")
    goals: list[int] = Field(default_factory=list)


class ExpertLoadStatus(_ExpertPoolStatusPart):
    """One hot expert of the last rebalance window: its tokens in the window, its share of
    its layer's, and its ratio to the layer's mean expert (xDeepServe Fig. 11a: ~30x)."""

    layer: int = 0
    expert: int = 0
    tokens: int = 0
    share: float = 0.0
    ratio: float = 0.0


class ExpertRebalanceStatus(_ExpertPoolStatusPart):
    """The last EPLB rebalance: when it was decided, why, the simulated imbalance
    (max server load over the mean, the worst layer) and MoE time per iteration (tokens on the
    slowest server, summed over layers) before and after, the map versions of its phases
    (first to last), the layers it changes, and the version it ended at (None: in flight) and
    how (``Completed``, or ``Preempted`` by a failover)."""

    at: Instant = 0.0
    reason: str = ""
    imbalance_before: float = Field(default=0.0, alias="imbalanceBefore")
    imbalance_after: float = Field(default=0.0, alias="imbalanceAfter")
    moe_time_before: float = Field(default=0.0, alias="moeTimeBefore")
    moe_time_after: float = Field(default=0.0, alias="moeTimeAfter")
    versions: list[int] = Field(default_factory=list)
    layers: list[int] = Field(default_factory=list)
    ended_version: int | None = Field(default=None, alias="endedVersion")
    outcome: str | None = None


class ExpertPoolStatus(_ExpertPoolStatusPart):
    """An ExpertPool's status. Fields a pass may leave out are None (and not written)."""

    observed_generation: int | None = Field(default=None, alias="observedGeneration")
    # The server pods' label selector (the scale subresource's labelSelectorPath: an HPA or
    # ``kubectl get pods -l`` finds them by it)
    selector: str | None = None
    ready_servers: int = Field(default=0, alias="readyServers")  # live servers in the map
    servers: list[str] = Field(default_factory=list)  # the map in force's server table
    map_version: int = Field(default=0, alias="mapVersion")
    map_phase: str | None = Field(default=None, alias="mapPhase")
    coverage: ExpertCoverageStatus = Field(default_factory=ExpertCoverageStatus)
    coverage_bound: int | None = Field(default=None, alias="coverageBound")
    hot_experts: list[ExpertLoadStatus] = Field(default_factory=list, alias="hotExperts")
    draining: list[str] = Field(default_factory=list)  # out of the map, finishing, then deleted
    # Each server of the map's engine incarnation when it entered: a restarted engine (same
    # pod, a new process) has lost its slots, and is dropped as failed. A server failed over for
    # an engine that exited keeps its entry while that engine's report lingers.
    members: dict[str, str] = Field(default_factory=dict)
    # Each server of the map's pod's container restarts when it entered: one more is its engine
    # exited (the kubelet says so before the restarted engine reports), and it is failed over.
    member_restarts: dict[str, int] = Field(default_factory=dict, alias="memberRestarts")
    wanted_servers: int | None = Field(default=None, alias="wantedServers")
    last_rebalance: ExpertRebalanceStatus | None = Field(default=None, alias="lastRebalance")
    # When EPLB last looked at a window (rebalanced or not): the next look is intervalSeconds on.
    rebalance_checked_at: Time = Field(default=None, alias="rebalanceCheckedAt")
    last_failover: ExpertFailoverStatus | None = Field(default=None, alias="lastFailover")
    last_scale: ExpertScaleStatus | None = Field(default=None, alias="lastScale")
    token_sample: ExpertTokenSample | None = Field(default=None, alias="tokenSample")
    # Written by the loop beside the planner's status, read back with the rest.
    conditions: list[WarmPoolCondition] | None = None

    @classmethod
    def read(cls, raw: object) -> ExpertPoolStatus:
        """A stored status; an empty one where it does not read (another version's shape)."""
        try:
            return cls.model_validate(raw or {})
        except ValidationError:
            return cls()

    def dump(self) -> dict[str, Any]:
        """As the API server stores it (camelCase; a field that is None left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
