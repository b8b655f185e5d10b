"""How each new instance is obtained: the scale-out path choice (pure).

DeepServe §6 (Table 2, Fig. 8) splits a scale operation into five phases and attacks each:

| phase | what | cold | warm pod |
|---|---|---|---|
| ``ScalerPre`` | a pod to hold the engine (TE) | create, schedule, start a pod | claim a pre-warmed pod |
| ``TEPreLoad`` | the engine up without a model: Python, NPU state, HCCL | all of it | done already (§6.1) |
| ``TELoad`` | the weights (and compiled artefacts) onto the NPUs | shared file service | DRAM, SSD, shared file service, or NPU-fork from a live peer (§6.2) |
| ``TEPostLoad`` | warm-up, block allocation | as warm | offline-profiled sizes, a dummy request |
| ``ScalerPost`` | announced: traffic reaches it | dynamic RoCE construction, entrance or decode meta |

Per new instance, the cheapest of these paths by estimated time, each estimate the sum of its
phases (the caller's :class:`Estimates`, learned or configured; control-plane phases in wall
seconds, engine phases in emulated seconds divided by the time scale, so they add up):

- ``WarmForkUB`` / ``WarmForkRoCE``: a warm pod, its weights broadcast by a live instance of the
  same model, compiled artefacts and expert map (a *fork source*) over UB inside a SuperPod or
  RoCE across (§6.2); a source serves at most ``FORK_FANOUT`` targets at once (Fig. 11's 32),
  and there is no fork without one ("cannot be used during cold start", §6.2);
- ``WarmDRAM``: a warm pod on a server whose host DRAM holds the model (§6.2 pre-loading);
- ``WarmSSD``, ``WarmSharedFileService``: a warm pod loading from local SSD or the shared file
  service;
- ``Cold``: a new pod through every phase.

A warm pod is promised to one new instance only, and a fork source to at most its fan-out: the
caller passes every instance a pass needs at once (the PDGroup plan's ``obtain`` seam).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from matrixserve.api.engine_settings import LoadSource

FORK_FANOUT = 32  # 002 §6.2, Fig. 11: one source broadcasts to up to 32 pre-warmed TEs


class Path(StrEnum):
    WARM_FORK_UB = "WarmForkUB"
    WARM_FORK_ROCE = "WarmForkRoCE"
    WARM_DRAM = "WarmDRAM"
    WARM_SSD = "WarmSSD"
    WARM_SHARED = "WarmSharedFileService"
    COLD = "Cold"


class Phase(StrEnum):
    SCALER_PRE = "ScalerPre"
    TE_PRE_LOAD = "TEPreLoad"
    TE_LOAD = "TELoad"
    TE_POST_LOAD = "TEPostLoad"
    SCALER_POST = "ScalerPost"


TE_PRE_LOAD = Phase.TE_PRE_LOAD.value  # the engine's health names its phases the same way
TE_LOAD = Phase.TE_LOAD.value
TE_POST_LOAD = Phase.TE_POST_LOAD.value

# The operator's priors before it has seen an engine go through a phase (emulated seconds; each
# replaced by what the group's engines report). [design] DeepServe §6.1 gives no per-phase
# figure for TE-Pre-Load beyond "the majority of startup time"; the engine stub's value.
PRIOR_TE_PRE_LOAD_SECONDS = 20.0
PRIOR_TE_POST_LOAD_SECONDS = 0.5  # [design] warm-up replaced by profiled sizes + a dummy request
# Nominal rates of each load path (the platform's, as the engine stub is calibrated): UB 164 GB/s
# per die (CloudMatrix-Infer T1), RoCE 200 Gbps per die (001 §3.3.1), host DRAM 8.4 GB/s per NPU
# plus 0.3 s tensor init (001 Table 2's warm start; 002 §6.2), SSD 400 Gbps per node (001 §4.4.1),
# the shared file service 2.1 GB/s per bucket (001 Table 2's cold start).
_GB = 1e9
PRIOR_RATES = {
    LoadSource.NPU_FORK_UB: 164 * _GB,  # per die
    LoadSource.NPU_FORK_ROCE: 25 * _GB,  # per die
    LoadSource.HOST_DRAM: 8.4 * _GB,  # per NPU
    LoadSource.SSD: 50 * _GB,
    LoadSource.SHARED_FILE_SERVICE: 2.1 * _GB,
}
TENSOR_INIT_SECONDS = 0.3  # 002 §6.2


def prior_load_seconds(weights: float, dies: int, npus: int) -> dict[str, float]:
    """TE-Load by source before any is observed (emulated seconds)."""
    dies, npus = max(dies, 1), max(npus, 1)
    return {
        LoadSource.NPU_FORK_UB: weights / dies / PRIOR_RATES[LoadSource.NPU_FORK_UB],
        LoadSource.NPU_FORK_ROCE: weights / dies / PRIOR_RATES[LoadSource.NPU_FORK_ROCE],
        LoadSource.HOST_DRAM: weights / npus / PRIOR_RATES[LoadSource.HOST_DRAM]
        + TENSOR_INIT_SECONDS,
        LoadSource.SSD: weights / PRIOR_RATES[LoadSource.SSD],
        LoadSource.SHARED_FILE_SERVICE: weights / PRIOR_RATES[LoadSource.SHARED_FILE_SERVICE],
    }


# Where each path's weights come from: the engine's load source for it.
LOAD_SOURCE = {
    Path.WARM_FORK_UB: LoadSource.NPU_FORK_UB,
    Path.WARM_FORK_ROCE: LoadSource.NPU_FORK_ROCE,
    Path.WARM_DRAM: LoadSource.HOST_DRAM,
    Path.WARM_SSD: LoadSource.SSD,
    Path.WARM_SHARED: LoadSource.SHARED_FILE_SERVICE,
    Path.COLD: LoadSource.SHARED_FILE_SERVICE,
}
SHARED_FILE_SERVICE = LOAD_SOURCE[Path.COLD]  # the one source whose readers share a bucket


@dataclass(frozen=True)
class WarmPod:
    """A pre-warmed, model-agnostic engine pod (past TE-Pre-Load) that may be claimed."""

    name: str
    node: str
    superpod: str | None
    npus: int
    dram_models: frozenset[str] = frozenset()  # what its server's host DRAM holds
    ssd_models: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ForkSource:
    """A live instance that can broadcast its weights and compiled artefacts (its identity is
    content-addressed: model, artefact version, expert-map version)."""

    instance: str
    superpod: str | None
    model: str
    artifacts: str
    expert_map: int | None = None
    busy: int = 0  # targets it is broadcasting to now


@dataclass(frozen=True)
class Want:
    """One new instance to obtain: its name, model and identity, NPUs."""

    instance: str
    model: str
    artifacts: str
    npus: int
    expert_map: int | None = None


@dataclass(frozen=True)
class Estimates:
    """Seconds each phase takes, by path where it differs (wall seconds; the caller converts
    engine phases from emulated time). ``load`` maps a load source to its seconds."""

    scaler_pre_cold: float  # create + schedule + start a pod
    scaler_pre_warm: float  # claim and adopt a warm pod
    te_pre_load: float  # Python, NPU state, HCCL (a warm pod has done it)
    te_post_load: float
    scaler_post: float
    load: Mapping[str, float]

    def phases(self, path: Path) -> dict[Phase, float]:
        warm = path is not Path.COLD
        return {
            Phase.SCALER_PRE: self.scaler_pre_warm if warm else self.scaler_pre_cold,
            Phase.TE_PRE_LOAD: 0.0 if warm else self.te_pre_load,
            Phase.TE_LOAD: self.load[LOAD_SOURCE[path]],
            Phase.TE_POST_LOAD: self.te_post_load,
            Phase.SCALER_POST: self.scaler_post,
        }


@dataclass(frozen=True)
class Choice:
    """How one instance is obtained, and the estimate it was chosen by."""

    instance: str
    path: Path
    phases: Mapping[Phase, float]
    warm_pod: str | None = None
    fork_source: str | None = None
    considered: Mapping[Path, float] = field(default_factory=dict)  # every feasible path's total

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def choose(
    wants: Sequence[Want],
    pods: Sequence[WarmPod],
    sources: Sequence[ForkSource],
    est: Estimates,
    allowed: Collection[Path] = (),
) -> list[Choice]:
    """A path for each wanted instance, in order: the fastest feasible by estimate (among
    ``allowed``, if given: an instance with no allowed path gets no choice and waits), never one
    warm pod twice, never a source past its fan-out."""
    free = list(pods)
    load = {s.instance: s.busy for s in sources}
    permitted = set(allowed) or set(Path)
    out = []
    for want in wants:
        options: dict[Path, tuple[float, WarmPod | None, ForkSource | None]] = {}
        if Path.COLD in permitted:
            options[Path.COLD] = (sum(est.phases(Path.COLD).values()), None, None)
        for pod in (p for p in free if p.npus == want.npus):
            for path, source in _warm_paths(want, pod, sources, load):
                if path not in permitted:
                    continue
                total = sum(est.phases(path).values())
                if path not in options or total < options[path][0]:
                    options[path] = (total, pod, source)
        if not options:
            continue
        path = min(options, key=lambda p: (options[p][0], list(Path).index(p)))
        _, taken, fork = options[path]
        if taken is not None:
            free.remove(taken)
        if fork is not None:
            load[fork.instance] += 1
        out.append(
            Choice(
                want.instance,
                path,
                est.phases(path),
                taken.name if taken else None,
                fork.instance if fork else None,
                {p: round(t, 3) for p, (t, _, _) in sorted(options.items())},
            )
        )
    return out


def _warm_paths(
    want: Want, pod: WarmPod, sources: Sequence[ForkSource], load: Mapping[str, int]
) -> list[tuple[Path, ForkSource | None]]:
    paths: list[tuple[Path, ForkSource | None]] = [(Path.WARM_SHARED, None)]
    if want.model in pod.ssd_models:
        paths.append((Path.WARM_SSD, None))
    if want.model in pod.dram_models:
        paths.append((Path.WARM_DRAM, None))
    for source in sources:
        same = (source.model, source.artifacts, source.expert_map) == (
            want.model,
            want.artifacts,
            want.expert_map,
        )
        if not same or load[source.instance] >= FORK_FANOUT:
            continue
        near = source.superpod is not None and source.superpod == pod.superpod
        paths.append((Path.WARM_FORK_UB if near else Path.WARM_FORK_ROCE, source))
    return paths
