"""How the group's missing instances are obtained (pure): the ``obtain`` seam.

Per missing instance, :func:`matrixserve.domain.scaleout.choose` picks the fastest path by
estimate (DeepServe §6: a warm pod past TE-Pre-Load, loading by NPU-fork from a live instance of
the model over UB inside its SuperPod or RoCE across, from host DRAM, SSD or the shared file
service; or a cold pod through every phase). A warm path becomes a :class:`ClaimWarmPod` (the pod's
labels, annotations and owner, with its resourceVersion as precondition: the API server lets one
of two claims through); a cold one the usual new role-less pod.

Once claimed, the pod is the instance (:meth:`GroupView.claimed`), and each pass in which it has
not reported to the group and its assignment is not written plans an :class:`AssignWarmPod`
(idempotent): an operator that died between the two writes it after its restart, so a claim is
never left without its assignment, and the pod is never left unowned (it is the group's from
the claim on: deleting the group deletes it).

Estimates: control-plane phases in wall seconds (a pod's start learned from the group's pods;
a claim ``CLAIM_SECONDS``); the engine's phases in emulated seconds learned from the members'
health (``phases`` by load source), else the priors of :mod:`matrixserve.domain.scaleout`,
divided by the engines' time scale so that the two clocks add up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import WarmClaim
from matrixserve.api.status import ScaleRecord
from matrixserve.domain import scaleout as so
from matrixserve.domain import warmclaim
from matrixserve.domain.pdgroup import gang
from matrixserve.domain.pdgroup.actions import Action, AssignWarmPod, ClaimWarmPod, CreatePod
from matrixserve.domain.pdgroup.pods import (
    engine_settings,
    owner,
    pod_annotations,
    pod_labels,
    pod_manifest,
)
from matrixserve.domain.pdgroup.view import GroupView
from matrixserve.domain.pdgroup.warm import estimates, fork_sources, warm_candidates
from matrixserve.domain.warmclaim import claim_of as _claim


def missing_pods(view: GroupView, instance: str, role: zl.Role) -> list[str]:
    return view.missing_pods(instance, role)


def cold_start(view: GroupView, missing: Mapping[str, zl.Role]) -> list[Action]:
    """A new, role-less pod for each missing pod of each instance, its rank's (the leader's
    name is the instance's). The pods of an instance of several pods are created only where
    gang placement seated them all (:mod:`.gang`: gated and pinned), else none of them."""
    seats = gang.plan_seats(view, gang.wanted(view, missing)).seats
    return [
        CreatePod(
            pod,
            role,
            pod_manifest(
                view.namespace,
                view.name,
                view.uid,
                pod,
                role,
                view.spec,
                view.engine,
                instance,
                seat=seats.get(pod),
            ),
        )
        for instance, role in missing.items()
        for pod in view.missing_pods(instance, role)
        if pod not in view.foreign  # taken: creating it would only be refused again
        and (pod in seats or not gang.multi_pod(view, role))
    ]


def warm_or_cold(view: GroupView, missing: Mapping[str, zl.Role]) -> list[Action]:
    """The ``obtain`` seam: a warm pod where one is faster by estimate, else a cold pod; all of
    a role's missing instances chosen at once (one warm pod per instance, a fork source within
    its fan-out over the whole pass)."""
    allowed = {so.Path(p) for p in view.engine.scale_out_paths}
    cold_allowed = not allowed or so.Path.COLD in allowed
    if not view.warm_pods:
        return cold_start(view, missing) if cold_allowed else []
    est = estimates(view)
    actions: list[Action] = []
    cold: dict[str, zl.Role] = {}
    taken: set[str] = set()
    forks: dict[str, int] = {}  # fork targets promised this pass, by source
    for role in (zl.Role.PREFILL, zl.Role.DECODE):
        names = [n for n, r in missing.items() if r is role]
        if not names:
            continue
        spec = view.spec.role_spec(role)
        pods = [p for p in warm_candidates(view, role) if p.name not in taken]
        if role is zl.Role.DECODE and pods:
            # a group's decodes share one SuperPod: with none placed yet, the one with the most
            # warm decodes (warm_candidates keeps them to the placed decodes' otherwise)
            counts: dict[str | None, int] = {}
            for p in pods:
                counts[p.superpod] = counts.get(p.superpod, 0) + 1
            home = max(counts, key=lambda sp: (counts[sp], sp or ""))
            pods = [p for p in pods if p.superpod == home]
        if spec.pods_per_instance != 1 or not pods:
            cold.update({n: role for n in names if cold_allowed})
            continue
        dies = {len(view.warm_reports[p.name].dies) for p in pods}
        sources = [
            dataclasses.replace(s, busy=s.busy + forks.get(s.instance, 0))
            for d in dies
            for s in fork_sources(view, d)
        ]
        wants = [so.Want(n, view.spec.model.name, "", spec.devices_per_instance) for n in names]
        for choice in so.choose(wants, pods, sources, est, allowed):
            if choice.warm_pod is None:
                cold[choice.instance] = role
                continue
            taken.add(choice.warm_pod)
            if choice.fork_source is not None:
                forks[choice.fork_source] = forks.get(choice.fork_source, 0) + 1
            actions.append(_claim_action(view, choice, role))
        # an instance without a choice has no allowed path now (--scale-out-paths): it waits
    return actions + (cold_start(view, cold) if cold else [])


def _claim_action(view: GroupView, choice: so.Choice, role: zl.Role) -> ClaimWarmPod:
    assert choice.warm_pod is not None
    pod = view.warm_pods[choice.warm_pod]
    patch = warmclaim.claim_patch(
        view.claimer,
        owner(view.name, view.uid),
        pod_labels(view.name, role, choice.instance),
        pod_annotations(view.spec, role),
        warmclaim.record(choice, choice.instance, role.value, view.now),
    )
    return ClaimWarmPod(
        pod.name,
        pod.resource_version,
        choice.instance,
        role,
        str(choice.path),
        choice.total,
        choice.fork_source,
        patch,
    )


def assignments(view: GroupView) -> list[Action]:
    """An assignment for each claimed pod that has not reported to the group and whose
    assignment (of its UID) is not written."""
    out: list[Action] = []
    for pod in view.pods.values():
        instance = pod.label(kinds.LABEL_INSTANCE)
        if (
            not view.claimed(pod)
            or instance is None
            or pod.deleting
            or pod.name in view.assigned
            or instance in view.reports
        ):
            continue
        role = zl.Role.PREFILL if _claim(pod).role == zl.Role.PREFILL.value else zl.Role.DECODE
        # the instance's own settings; the rest is the warm pod's (its ZooKeeper, credential
        # file, devices, platform), which an assignment never overrides
        env = engine_settings(view.namespace, view.name, role, view.spec, view.engine)
        assignment = warmclaim.assignment(
            pod,
            owner=f"{view.namespace}/{view.name}",
            instance=instance,
            env=env.assignment(),
            fork_sources=view.fork_sources,
            now=view.now,
        )
        out.append(AssignWarmPod(view.namespace, pod.name, instance, assignment))
    return out


def last_scale(view: GroupView) -> ScaleRecord | None:
    """The latest instance to come and serve, with DeepServe's phases: the path it came by (its
    claim's, or ``Cold``), where its weights actually came from, the engine's phases in emulated
    seconds (its health's), and the wall seconds from its start (the claim, or the pod's creation)
    to the first pass that sees it serving. Kept until a newer instance serves."""
    previous = view.previous.last_scale
    if previous is not None and not previous.dump():
        previous = None  # an empty record is none
    newest: tuple[float, str] | None = None
    for name, instance in view.instances.items():
        health = view.zk.health.get(name)
        if health is None or not health.phases or not view.healthy(name):
            continue
        leader = instance.leader
        start = view.started_at(leader)
        if newest is None or start > newest[0]:
            newest = (start, name)
    if newest is None:
        return previous
    start, name = newest
    leader = view.instances[name].leader
    known = previous or ScaleRecord()
    if known.pod_uid == leader.uid or start <= float(known.started_at or 0):
        return previous
    health = view.zk.health[name]
    claim = _claim(leader) if view.claimed(leader) else WarmClaim()
    engine = {k: round(v, 3) for k, v in health.phases.items()}
    return ScaleRecord(
        instance=name,
        pod=leader.name,
        pod_uid=leader.uid,
        path=claim.path or str(so.Path.COLD),
        load_source=health.load_source,
        fork_source=claim.fork_source,
        estimate_seconds=claim.estimate_seconds,
        phases=engine,
        emulated_seconds=round(sum(engine.values()), 3),
        wall_seconds=round(max(0.0, view.now - start), 3),
        started_at=round(start, 3),
    )
