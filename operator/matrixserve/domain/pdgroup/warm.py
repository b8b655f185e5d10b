"""What a group knows of warm pods and fork sources, and what each scale-out path would cost it
(pure): the estimates the path choice (:mod:`.obtain`) and the recovery planner's
replacement (:mod:`.recovery`) price new instances by.

Control-plane phases are wall seconds (a pod's start learned from the group's pods; a claim
``CLAIM_SECONDS`` and the announcement ``ANNOUNCE_SECONDS``, ``[design]``); the engine's phases
are the group's engines' own figures (their health's ``phases``, TE-Load by load source),
else the priors of :mod:`matrixserve.domain.scaleout`, divided by the engines' time scale so that
the two clocks add up.
"""

from __future__ import annotations

import statistics

from matrixserve.api import catalog, kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.domain import scaleout as so
from matrixserve.domain import warmclaim
from matrixserve.domain.pdgroup.pods import role_of
from matrixserve.domain.pdgroup.view import GroupView

CLAIM_SECONDS = 0.2  # [design] wall: one conditional patch and an assignment write
ANNOUNCE_SECONDS = 0.5  # [design] wall: the RoCE map names it, its links verified, opened
POD_START_PRIOR_SECONDS = 1.0  # create -> scheduled, container running (until one is seen)


def claimable(spec: PDGroupSpec) -> tuple[str, ...]:
    """The label selector terms of the warm pods a group may claim: the unclaimed pods of the
    pool its ``warmPoolRef`` names, or of any pool of its namespace when it names none."""
    ref = spec.warm_pool_ref
    return warmclaim.claimable(None if ref is None else ref.name)


def estimates(view: GroupView) -> so.Estimates:
    """Each phase's seconds (wall), learned where the group shows it."""
    scale = float(view.engine.time_scale)
    preset = catalog.PRESETS.get(view.spec.model.name)
    weights = float(view.spec.model.size_bytes or (preset.weight_bytes_total if preset else 0))
    npus = view.spec.decode.devices_per_instance
    priors = so.prior_load_seconds(weights, npus * catalog.DIES_PER_NPU, npus)
    learned: dict[str, list[float]] = {}
    pre: list[float] = []
    post: list[float] = []
    for health in view.zk.health.values():
        if not health.phases:
            continue
        if health.load_source and so.TE_LOAD in health.phases:
            learned.setdefault(health.load_source, []).append(lone_load(health))
        if not health.warm and health.phases.get(so.TE_PRE_LOAD):
            pre.append(health.phases[so.TE_PRE_LOAD])
        if so.TE_POST_LOAD in health.phases:
            post.append(health.phases[so.TE_POST_LOAD])
    load = {
        source: (statistics.median(learned[source]) if source in learned else prior) / scale
        for source, prior in priors.items()
    }
    return so.Estimates(
        scaler_pre_cold=view.learned_pod_start(POD_START_PRIOR_SECONDS),
        scaler_pre_warm=CLAIM_SECONDS,
        te_pre_load=(statistics.median(pre) if pre else so.PRIOR_TE_PRE_LOAD_SECONDS) / scale,
        te_post_load=(statistics.median(post) if post else so.PRIOR_TE_POST_LOAD_SECONDS) / scale,
        scaler_post=ANNOUNCE_SECONDS,
        load=load,
    )


def lone_load(health: zl.Health) -> float:
    """The engine's TE-Load (emulated s) as it would have been alone: a load from the shared
    file service shared its bucket with ``loadShare`` readers on average (001 Table 2), which
    a lone replacement or a restart does not."""
    return health.phases.get(so.TE_LOAD, 0.0) / max(health.load_share, 1.0)


def warm_candidates(view: GroupView, role: zl.Role) -> list[so.WarmPod]:
    """The namespace's claimable warm pods that fit an instance of ``role``
    (:func:`~matrixserve.domain.warmclaim.candidates`: Ready, past TE-Pre-Load, of its NPU
    type, NPU count and image; none when the group sets its own CPU and memory, which a warm
    pod, made by the platform, does not have)."""
    spec = view.spec.role_spec(role)
    if spec.resources is not None:
        return []
    # a group's decodes stay inside one SuperPod (the cold pods' required affinity, 001 §6.1.2):
    # a warm decode must be in theirs
    decode_superpods = frozenset(
        p.superpod
        for p in view.pods.values()
        if role_of(p) is zl.Role.DECODE and p.superpod is not None and not p.deleting
    )
    fit = warmclaim.Fit(
        spec.npu_type,
        spec.devices_per_instance,
        spec.image,
        decode_superpods if role is zl.Role.DECODE else frozenset(),
    )
    return warmclaim.candidates(view.warm_pods, view.warm_reports, fit)


def fork_sources(view: GroupView, dies: int) -> list[so.ForkSource]:
    """Live instances of the group's model on as many dies (the source checks the compiled
    artefacts' identity itself: a target whose identity differs falls back)."""
    busy: dict[str, int] = {}
    for pod in view.pods.values():  # forks under way: claimed, not yet reported
        source = warmclaim.claim_of(pod).fork_source
        if source and pod.label(kinds.LABEL_INSTANCE) not in view.reports:
            busy[source] = busy.get(source, 0) + 1
    return [
        so.ForkSource(
            f"{s.group}/{s.instance}",
            s.superpod,
            s.model,
            "",
            s.expert_map,
            busy.get(f"{s.group}/{s.instance}", 0),
        )
        for s in view.fork_sources
        if s.model == view.spec.model.name
        and s.dies == dies
        # a member of this group only while it serves: a killed one's entry outlives it until
        # its ZooKeeper session expires
        and (s.group != f"{view.namespace}/{view.name}" or view.healthy(s.instance))
    ]


def warm_pod_names(view: GroupView) -> frozenset[str]:
    """Every warm pod that could replace an instance of either role (each counted once)."""
    return frozenset(
        p.name for role in (zl.Role.PREFILL, zl.Role.DECODE) for p in warm_candidates(view, role)
    )


def warm_replacement(view: GroupView, role: zl.Role) -> tuple[int, float | None]:
    """How many warm pods could replace an instance of ``role`` now, and the fastest warm
    path's seconds (claim to serving) for one: the recovery planner's warm replacement. None
    for a role of several pods per instance (:func:`~.obtain.warm_or_cold` starts those cold)."""
    spec = view.spec.role_spec(role)
    pods = warm_candidates(view, role) if spec.pods_per_instance == 1 else []
    if not pods:
        return 0, None
    dies = {len(view.warm_reports[p.name].dies) for p in pods}
    sources = [s for d in dies for s in fork_sources(view, d)]
    want = so.Want("replacement", view.spec.model.name, "", spec.devices_per_instance)
    allowed = {so.Path(p) for p in view.engine.scale_out_paths} - {so.Path.COLD}
    if view.engine.scale_out_paths and not allowed:
        return 0, None
    chosen = so.choose(
        [want], pods, sources, estimates(view), allowed or set(so.Path) - {so.Path.COLD}
    )
    if not chosen:
        return 0, None
    return len(pods), chosen[0].total
