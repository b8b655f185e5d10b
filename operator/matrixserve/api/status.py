"""The kinds' status subresources as typed models (pure), in the CRDs' camelCase names.

A planner returns its kind's status as one of these and reads the previous one (what the object
stored) the same way; the status is dumped to the API server's JSON in one place, where it is
written. ``crds/`` holds the schemas they mirror, and a unit test keeps the two in step (every
field in both, compatible types): the API server prunes a field its schema does not name, so a
model field missing there would be written and silently lost.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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
