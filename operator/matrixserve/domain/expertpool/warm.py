"""Expert servers from a WarmPool (pure; DeepServe §6.1-6.2, EaaS §4.4).

**Why.** A failed expert server leaves its experts one copy short until a replacement serves
(EaaS §3.4-§4.4: clients re-send to the replicas at once; the controller restores the copies).
That gap is the replacement's start: a cold pod pays every phase of DeepServe Table 2 (the pod's
creation and scheduling, TE-Pre-Load, the weights, TE-Post-Load), a pre-warmed pod (§6.1: past
TE-Pre-Load, no model, no role) only the claim, its slots' weights and TE-Post-Load. Which is
faster is priced, not assumed (:func:`.obtain.paths`: :func:`matrixserve.domain.scaleout.choose`
over the pool's warm candidates, DRAM or SSD when the model is there, else the shared file
service; never an NPU-fork: an expert server's weights are a few experts, no instance holds
them as a fork would send them).

**How**, with the claim every kind shares (:mod:`matrixserve.domain.warmclaim`):

- :class:`ClaimWarmServer`: the pod's labels, annotations and owner become a server pod's of the
  pool (``claimed-kind: ExpertPool``), conditional on its resourceVersion (of two claims, one
  wins). The server's id is the warm pod's name: an expert server's id is its pod's name;
- :class:`AssignWarmServer`, each pass while the claimed pod has not reported to the pool and
  its assignment (of its UID) is not written: the engine's settings a cold server pod would have
  (``ENGINE_ROLE=expert``, the model, ``MATRIXSERVE_EXPERT_POOL``, ``ENGINE_EXPERT_SLOTS``) and
  its load source; the warm engine becomes that server (it registers under ``servers/`` and
  loads the slots the map gives it). An operator that died between claim and assignment writes
  it after its restart;
- **released on every path**: a claimed pod that ended, or has not reported within
  :data:`CLAIM_BOUND_SECONDS` of its claim or of its engine's last exit (an assignment it
  refused: its engine exits, and exits again once restarted), is deleted with its
  assignment (:func:`releases`, :class:`ForgetAssignment`), and the next pass obtains another
  server. A pool deleted meanwhile
  takes its claimed pods with it (they name it as owner; a claim on a pool already gone names an
  owner that is not there, and the garbage collector deletes the pod), and its finalizer removes
  their assignments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.domain import recovery as rc
from matrixserve.domain import scaleout as so
from matrixserve.domain import warmclaim
from matrixserve.domain.effects import Event, PodClaim, ZnodeChange
from matrixserve.domain.expertpool import obtain
from matrixserve.domain.expertpool.pods import (
    ANNOTATION_EXPERT_TEMPLATE,
    ANNOTATION_OBTAINED,
    engine_settings,
    owner,
    pod_labels,
    template,
)
from matrixserve.domain.expertpool.view import ENDED, PoolView
from matrixserve.domain.observed import Fault, FaultKind, PodView, Tier

# A server pod asks NPUs of no particular type; the warm pods that stand in for one are of
# CloudMatrix384's (its WarmPool shape's default).
NPU_TYPE = "Ascend910C"
CLAIM_BOUND_SECONDS = 60.0  # [design] a claimed pod not serving the pool by then is released


@dataclass(frozen=True)
class ClaimWarmServer(PodClaim):
    """Claim warm pod ``name`` as a server of the pool, while it is at ``resource_version``."""

    name: str
    resource_version: str
    why: str
    path: str
    estimate_seconds: float
    patch: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> Event:
        return Event(
            "ClaimedWarmServer",
            f"Claimed warm pod {self.name} as an expert server: {self.why}; {self.path}, "
            f"est. {self.estimate_seconds:.1f} s to serve",
        )


@dataclass(frozen=True)
class AssignWarmServer(ZnodeChange[zl.ExpertPoolPaths]):
    """Tell a claimed warm pod's engine it is a server of the pool (its assignment znode,
    bound to the pod's UID)."""

    namespace: str
    pod: str
    assignment: zl.Assignment

    def znodes(self, paths: zl.ExpertPoolPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(zl.WarmPaths(self.namespace).assignment(self.pod), self.assignment.dump())]

    def describe(self) -> Event:
        return Event(
            "AssignedWarmServer",
            f"Assigned warm pod {self.pod} to the pool as an expert server: loads its slots "
            f"from {self.assignment.load_source}",
        )


@dataclass(frozen=True)
class ForgetAssignment(ZnodeChange[zl.ExpertPoolPaths]):
    """Remove a released pod's assignment (idempotent: an absent one is fine)."""

    namespace: str
    pod: str

    def znodes(self, paths: zl.ExpertPoolPaths) -> list[zl.ZnodeOp]:
        return [zl.Delete(zl.WarmPaths(self.namespace).assignment(self.pod))]


def claimer(pool: str) -> warmclaim.Claimer:
    """Pool ``pool`` as the claimer of warm pods."""
    return warmclaim.Claimer(kinds.EXPERTPOOL.kind, pool)


def claimable(spec: ExpertPoolSpec) -> tuple[str, ...]:
    """The label selector terms of the warm pods the pool may claim: its ``warmPoolRef``'s
    unclaimed pods, or any pool's of its namespace when it names none."""
    ref = spec.warm_pool_ref
    return warmclaim.claimable(None if ref is None else ref.name)


def candidates(view: PoolView) -> list[so.WarmPod]:
    """The claimable warm pods that stand in for a server's cold pod: its NPU count and image."""
    fit = warmclaim.Fit(NPU_TYPE, view.spec.servers.devices_per_server, view.spec.servers.image)
    return warmclaim.candidates(view.warm_pods, view.warm_reports, fit)


def claim(view: PoolView, choice: so.Choice, why: str) -> ClaimWarmServer:
    """The claim of ``choice``'s warm pod: a server pod's labels and annotations (its template,
    how it was obtained), the pool's claim labels and record, the pool as its owner."""
    assert choice.warm_pod is not None
    pod = view.warm_pods[choice.warm_pod]
    record = warmclaim.record(choice, pod.name, obtain.ROLE, view.now)
    patch = warmclaim.claim_patch(
        claimer(view.name),
        owner(view.name, view.uid),
        pod_labels(view.name),
        {ANNOTATION_EXPERT_TEMPLATE: template(view.spec), ANNOTATION_OBTAINED: record.dump()},
        record,
    )
    return ClaimWarmServer(
        pod.name, pod.resource_version, why, str(choice.path), round(choice.total, 3), patch
    )


def waiting(view: PoolView) -> list[str]:
    """The pool's claimed pods that have not reported to it yet (their assignments are read)."""
    mine = claimer(view.name)
    return sorted(
        name
        for name, pod in view.pods.items()
        if mine.claimed(pod) and not pod.deleting and view.report(name) is None
    )


def assignments(view: PoolView) -> list[AssignWarmServer]:
    """An assignment for each claimed pod that has not reported and whose assignment (of its
    UID) is not written."""
    out = []
    for name in waiting(view):
        pod = view.pods[name]
        if name in view.assigned or pod.phase in ENDED or _overdue(view, pod):
            continue
        env = engine_settings(view.namespace, view.name, view.spec, view.engine)
        assignment = warmclaim.assignment(
            pod,
            owner=f"{view.namespace}/{view.name}",
            instance=name,
            env=env.assignment(),
            fork_sources=(),
            now=view.now,
        )
        out.append(AssignWarmServer(view.namespace, name, assignment))
    return out


def releases(view: PoolView) -> dict[str, str]:
    """Claimed pods that did not become servers, and why: ended, or not reporting within
    :data:`CLAIM_BOUND_SECONDS` of their claim (each deleted with its assignment)."""
    out = {}
    for name in waiting(view):
        pod = view.pods[name]
        if pod.phase in ENDED:
            out[name] = f"a claimed warm pod that ended ({pod.phase}) before serving"
        elif _overdue(view, pod):
            out[name] = (
                f"a claimed warm pod not serving {CLAIM_BOUND_SECONDS:.0f} s after its claim "
                "or its engine's last exit (its engine refused the assignment?)"
            )
    return out


def claimed_at(pod: PodView) -> float:
    """When the pod became the pool's: its claim (0 for a pod that was not claimed)."""
    return warmclaim.claim_of(pod).at


def _overdue(view: PoolView, pod: PodView) -> bool:
    """Not reporting :data:`CLAIM_BOUND_SECONDS` after its claim, or after its engine last
    exited: a claimed server whose engine exited is restarted in place (recovery's choice) and
    its new engine has the bound to report again, as a new claim has (its pod is not released
    the moment its old engine's session ends)."""
    at = claimed_at(pod)
    since = max(at, pod.last_exit_at or 0.0)
    return bool(at) and view.now - since >= CLAIM_BOUND_SECONDS


# --------------------------------------------------------------------------- recovery
TAG: rc.Tag = "expert"  # an expert server, as recovery tags its members


def replacements(view: PoolView, exited: list[str]) -> tuple[list[str], rc.Option | None]:
    """Of the servers whose engine ``exited`` (their pods restart them in place), those to
    replace instead, by recovery's minimum-cost choice (:func:`matrixserve.domain.recovery.choose`:
    a restart in place costs the kubelet's back-off and a cold engine's start, a replacement a
    warm pod's claim and load when one is there, else a new pod's start; ties stay in place):
    (the servers, the option chosen; None when nothing was priced)."""
    current = view.current
    restarting = [
        s
        for s in exited
        if (pod := view.pods.get(s)) is not None and not pod.deleting and pod.phase not in ENDED
    ]
    if current is None or not restarting:
        return [], None
    spec, pods = view.spec, candidates(view)
    est = obtain.estimates(spec, view.engine)
    cold = sum(est.phases(so.Path.COLD).values())
    ready: dict[rc.Tag, float] = {}
    warm = [c for c in obtain.paths(spec, view.engine, ["replacement"], pods) if c.warm_pod]
    if warm:
        ready[TAG] = warm[0].total
    members = {
        s: rc.Member(
            s,
            TAG,
            spec.servers.devices_per_server,
            pod.node if pod else None,
            restarts=pod.restarts if pod else 0,
            superpod=pod.superpod if pod else None,
        )
        for s in {*current.servers, *restarting}
        for pod in [view.pods.get(s)]
    }
    backoff = max((view.pods[s].restart_backoff or 0.0 for s in restarting), default=0.0)
    estimates = rc.Estimates(
        pod_delete=0.0,  # a replacement has a name of its own: the old pod's going is not waited
        pod_start=est.scaler_pre_cold,
        engine_ready=cold - est.scaler_pre_cold,
        restart_backoff=backoff,
        warm_pods={TAG: len(pods)} if ready else {},
        warm_ready=ready,
        warm_total=len(pods) if ready else None,
    )
    fault = Fault(FaultKind.KILL, tuple(restarting), Tier.POD, view.now)
    plan = rc.choose(fault, rc.Topology(members), rc.Policy(), estimates, connected=view.connected)
    chosen = plan.chosen
    if chosen is None or chosen.action is not rc.ActionKind.REPLACE:
        return [], chosen
    return list(chosen.instances), chosen


def needed(view: PoolView) -> tuple[bool, list[str]]:
    """What a pass must read of the warm pods: whether a server may be obtained or replaced
    (fewer live pods than the spec's, or a server of the map gone or its engine exited: the
    warm pods are then read), and the claimed pods waiting for their assignment."""
    alive = [p for p in view.pods.values() if not p.deleting and p.phase not in ENDED]
    servers = view.current.servers if view.current else ()
    short = len(alive) < view.spec.servers.replicas or any(
        view.report(s) is None or view.exited(s) for s in servers
    )
    return short, waiting(view)
