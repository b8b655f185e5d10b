"""How a new expert server is obtained and what it is expected to cost (pure; DeepServe §6,
EaaS §3.5).

A server is obtained as any new engine is: :func:`matrixserve.domain.scaleout.choose` picks the
fastest feasible path by estimate (DeepServe Table 2's five phases), cold or from a warm pod
(§6.1: past TE-Pre-Load; its claim instead of a pod's start, :mod:`.warm`). An expert server's
weights are its slots' experts over every MoE layer (``slotsPerServer x`` one expert's
weights), not the model's, so its load is short; its announcement is the map version that
names it (no RoCE construction: EaaS §4.4, a server "only needs to register"). A warm pod
loads from host DRAM or its SSD when the model is there, else from the shared file service;
never by NPU-fork (no live instance holds a server's few experts as a fork would send them).
The choice is recorded on the pod (:data:`ANNOTATION_OBTAINED`) and in ``lastFailover`` for a
replacement.
"""

from __future__ import annotations

from collections.abc import Sequence

from matrixserve.api import catalog
from matrixserve.api.resources import ExpertPoolSpec, WarmClaim
from matrixserve.domain import scaleout as so
from matrixserve.domain import warmclaim
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.expertpool.validation import expert_bytes

POD_START_PRIOR_SECONDS = 1.0  # [design] wall: create -> scheduled -> container running
ROLE = "E"  # a server, in the record a claim or a creation leaves
CLAIM_SECONDS = 0.2  # [design] wall: one conditional patch and the assignment written
MAP_VERSION_SECONDS = 0.1  # [design] wall: a version's znodes and the pointer written


def estimates(spec: ExpertPoolSpec, engine: EngineSettings) -> so.Estimates:
    """Each phase's wall seconds for one server of the pool (priors: the engine's phases in
    emulated seconds over the time scale)."""
    scale = float(engine.time_scale)
    s = spec.servers
    weights = (expert_bytes(spec.model.name, spec.model.layers) or 0.0) * s.slots_per_server
    priors = so.prior_load_seconds(
        weights, s.devices_per_server * catalog.DIES_PER_NPU, s.devices_per_server
    )
    return so.Estimates(
        scaler_pre_cold=POD_START_PRIOR_SECONDS,
        scaler_pre_warm=CLAIM_SECONDS,
        te_pre_load=so.PRIOR_TE_PRE_LOAD_SECONDS / scale,
        te_post_load=so.PRIOR_TE_POST_LOAD_SECONDS / scale,
        scaler_post=MAP_VERSION_SECONDS,
        load={source: seconds / scale for source, seconds in priors.items()},
    )


def paths(
    spec: ExpertPoolSpec,
    engine: EngineSettings,
    servers: Sequence[str],
    warm: Sequence[so.WarmPod] = (),
) -> list[so.Choice]:
    """How each of ``servers`` is obtained, in order: the fastest allowed path by estimate,
    cold or from one of the ``warm`` pods (each taken once). A server without a choice has no
    path allowed (the operator's ``--scale-out-paths``) and waits."""
    wants = [
        so.Want(s, spec.model.name or "", "", spec.servers.devices_per_server) for s in servers
    ]
    allowed = [so.Path(p) for p in engine.scale_out_paths] or list(so.Path)
    return so.choose(wants, warm, [], estimates(spec, engine), allowed)


def choose(
    spec: ExpertPoolSpec, engine: EngineSettings, server: str, now: float
) -> WarmClaim | None:
    """How ``server`` is obtained cold or not at all, as a record (path, estimate, phases, the
    paths considered); None if no path is allowed."""
    choices = paths(spec, engine, [server])
    return warmclaim.record(choices[0], server, ROLE, now) if choices else None
