"""Claiming a pre-warmed pod, for any kind that runs engines (pure).

**Why.** DeepServe §6.1 keeps pods past TE-Pre-Load (Python, NPU state, HCCL up; no model, no
role) so that a scale-out skips ``ScalerPre`` and ``TEPreLoad``; §6.2 then loads the weights by
the fastest path (:mod:`matrixserve.domain.scaleout`). Any kind that needs an engine fast can
take one: a PDGroup for a new or replacement instance, an ExpertPool for a replacement expert
server (EaaS §4.4: coverage restored after a failure). What a claim is does not depend on the
kind, so it lives here, once:

- **who claimed it** (:class:`Claimer`): the ``claimed-by`` label names the claimer and
  ``claimed-kind`` its kind, so a PDGroup's claim and an ExpertPool's of the same name are told
  apart. A pod claimed before the kind was written carries a bare name: a PDGroup's (the only
  kind that claimed then). The claim is the labels, written with the pod's resourceVersion as
  precondition (:class:`~matrixserve.domain.effects.PodClaim`): of two claims, one wins;
- **which pods fit** (:func:`candidates`): Ready, unclaimed, past TE-Pre-Load (their engine's
  report, of this pod), of the NPU type, NPU count and image the claimer's cold pod would have,
  in a required SuperPod if any;
- **the patch** (:func:`claim_patch`) and the record it carries (:func:`record`: the path
  chosen and its estimate, for the scale record);
- **the assignment** (:func:`assignment`): what the claimed engine becomes, the settings a cold
  pod would have, and how it loads (the fork source named by the claim if it still serves,
  else the fallback at once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_settings import LoadSource
from matrixserve.api.resources import WarmClaim, WarmTemplate
from matrixserve.domain import scaleout as so
from matrixserve.domain.observed import PodView


@dataclass(frozen=True)
class Claimer:
    """Who claims a warm pod: a kind (``kinds.Kind.kind``, e.g. ``"ExpertPool"``) and the name
    of its object (in the pod's namespace)."""

    kind: str
    name: str

    @classmethod
    def of(cls, pod: PodView) -> Claimer | None:
        """Who claimed ``pod`` (None: unclaimed). A bare ``claimed-by`` is a PDGroup's."""
        name = pod.label(kinds.LABEL_CLAIMED_BY)
        if name is None:
            return None
        return cls(pod.label(kinds.LABEL_CLAIMED_KIND) or kinds.PDGROUP.kind, name)

    def claimed(self, pod: PodView) -> bool:
        """Whether ``pod`` is a warm pod this claimer claimed."""
        return Claimer.of(pod) == self

    def labels(self) -> dict[str, str]:
        """The labels that make a pod this claimer's."""
        return {kinds.LABEL_CLAIMED_BY: self.name, kinds.LABEL_CLAIMED_KIND: self.kind}


def claimable(pool: str | None) -> tuple[str, ...]:
    """The label selector terms of the warm pods one may claim: the unclaimed pods of WarmPool
    ``pool``, or of any pool of the namespace when None."""
    of_pool = kinds.LABEL_WARMPOOL if pool is None else f"{kinds.LABEL_WARMPOOL}={pool}"
    return (of_pool, f"!{kinds.LABEL_CLAIMED_BY}")


@dataclass(frozen=True)
class Fit:
    """What a warm pod must be to stand in for the claimer's cold pod."""

    npu_type: str
    devices: int
    image: str
    superpods: frozenset[str] = frozenset()  # it must be in one of these (empty: anywhere)


def candidates(
    warm_pods: Mapping[str, PodView], reports: Mapping[str, zl.WarmReport], fit: Fit
) -> list[so.WarmPod]:
    """The claimable warm pods that fit: Ready, unclaimed, not being deleted, past TE-Pre-Load
    (a report of this pod's UID), of the NPU type, NPU count and image (its template's), in
    one of ``fit.superpods`` if given."""
    out = []
    for pod in warm_pods.values():
        report = reports.get(pod.name)
        if (
            pod.deleting
            or not pod.ready
            or pod.label(kinds.LABEL_CLAIMED_BY) is not None
            or report is None
            or report.pod_uid != pod.uid
            or pod.label(kinds.LABEL_NPU_TYPE) != fit.npu_type
            or pod.label(kinds.LABEL_WARM_NPUS) != str(fit.devices)
            or _image(pod) != fit.image
            or (fit.superpods and report.superpod not in fit.superpods)
        ):
            continue
        out.append(
            so.WarmPod(
                pod.name,
                report.node,
                report.superpod,
                fit.devices,
                frozenset(report.dram_models),
                frozenset(report.ssd_models),
            )
        )
    return out


def record(choice: so.Choice, instance: str, role: str, now: float) -> WarmClaim:
    """The record a claim leaves on the pod: what it became, the path chosen and its
    estimate (per phase, and every path considered), the fork source, when."""
    return WarmClaim(
        instance=instance,
        role=role,
        path=str(choice.path),
        estimateSeconds=round(choice.total, 3),
        phases={str(k): round(v, 3) for k, v in choice.phases.items()},
        considered={str(k): v for k, v in choice.considered.items()},
        forkSource=choice.fork_source,
        at=round(now, 3),
    )


def claim_patch(
    claimer: Claimer,
    owner: Mapping[str, Any],
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    claim: WarmClaim,
) -> dict[str, Any]:
    """The metadata patch that claims a warm pod: the labels and annotations a cold pod of the
    claimer would have, the claimer's labels, the claim's record, and the claimer as the pod's
    owner (deleting the claimer deletes the pod)."""
    return {
        "labels": {**labels, **claimer.labels()},
        "annotations": {**annotations, kinds.ANNOTATION_CLAIM: claim.dump()},
        "ownerReferences": [dict(owner)],
    }


def claim_of(pod: PodView) -> WarmClaim:
    """The record a claimed pod carries (empty if none)."""
    return WarmClaim.of(pod.annotations)


def assignment(
    pod: PodView,
    *,
    owner: str,
    instance: str,
    env: Mapping[str, str],
    fork_sources: Iterable[zl.ForkSource],
    now: float,
) -> zl.Assignment:
    """What claimed ``pod`` becomes: ``instance`` of ``owner`` (``<namespace>/<name>``) with
    the settings ``env`` (keys of ``ASSIGNMENT_ENV``), loading by its claim's path: from the
    fork source the claim names if it still serves, else (a fork whose source is gone since
    the claim) from the shared file service at once."""
    claim = claim_of(pod)
    path = so.Path(claim.path) if claim.path in set(so.Path) else so.Path.WARM_SHARED
    fork = None
    for s in fork_sources:
        if claim.fork_source == f"{s.group}/{s.instance}":
            plane = "UB" if path is so.Path.WARM_FORK_UB else "RoCE"
            fork = zl.ForkRef(
                group=s.group, instance=s.instance, podIP=s.pod_ip, port=s.port, plane=plane,
                key=s.key,
            )  # fmt: skip
    forking = path in (so.Path.WARM_FORK_UB, so.Path.WARM_FORK_ROCE)
    load = so.LOAD_SOURCE[so.Path.WARM_SHARED if forking and fork is None else path]
    return zl.Assignment(
        podUid=pod.uid,
        group=owner,
        instance=instance,
        env=dict(env),
        loadSource=load,
        fork=fork,
        fallback=LoadSource.SHARED_FILE_SERVICE,
        ts=now,
    )


def _image(pod: PodView) -> str | None:
    """The engine image a warm pod runs (its template annotation)."""
    made = WarmTemplate.of(pod.annotations)
    return made.image if made is not None else None
