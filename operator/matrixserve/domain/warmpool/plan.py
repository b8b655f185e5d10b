"""Planning a WarmPool (pure; DeepServe §6.1): keep ``size`` warm pods per shape.

Each pass, in stages (each a function below, :func:`plan` composes them):

1. :func:`sort_pods`: the pool's unclaimed pods by shape, those it can still give: warm (Ready,
   past TE-Pre-Load, reported in ZooKeeper) or warming (not yet); every unclaimed pod of a shape
   no longer in the spec or made from another template (NPUs, type, selector, image), and those
   that ended (evicted, Failed), are deleted. Claimed pods (``claimed-by``: a group's now) are
   counted apart and never touched again;
2. :func:`yield_npus`: while serving engine pods of the namespace cannot be placed for want of
   NPUs, give up as many unclaimed pods (warming ones first) and do not refill (warm pods run at
   the serving pods' priority, so the scheduler does not preempt them: the pool does);
3. :func:`size_shape`, per shape: trim the pods beyond ``size`` (warming ones first), or refill
   the missing ones when :func:`may_refill` (``Immediate``: at once; ``Manual``: only when the
   spec changed, so claims are not refilled until the user asks);
4. :func:`shape_row` and :func:`pool_status`: ready / warming / claimed per shape and in total,
   claims by NPU-fork, the claims' hit rate;
5. :func:`dram_stage`: every warm server's host-DRAM plan (:mod:`.dram`), in the status and
   written to ZooKeeper where it changed;
6. :func:`ready_condition`: ``Ready`` and why.

Every deletion holds only while the pod is still at the resourceVersion seen (a pod claimed
meanwhile is not deleted). Names are ``<pool>-<shape>-w<n>``, the smallest ``n`` no pod of the
pool holds (a claimed pod keeps its name: its group owns it now).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from matrixserve.api import kinds
from matrixserve.api.resources import RefillPolicy, WarmClaim, WarmShape
from matrixserve.api.status import WarmDramStatus, WarmPoolStatus, WarmShapeStatus
from matrixserve.domain.conditions import Condition
from matrixserve.domain.effects import Event, PodCreation, PodDeletion
from matrixserve.domain.observed import PodView
from matrixserve.domain.warmpool import dram
from matrixserve.domain.warmpool.dram import WriteDramPlans
from matrixserve.domain.warmpool.pods import pod_manifest, pod_name, template
from matrixserve.domain.warmpool.view import PoolView

READY = "Ready"
ByShape = dict[str, list[PodView]]  # shape name -> its unclaimed pods the pool keeps, by name


@dataclass(frozen=True)
class CreateWarmPod(PodCreation):
    name: str
    shape: str
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> Event:
        return Event("CreatedWarmPod", f"Created warm pod {self.name} (shape {self.shape})")


@dataclass(frozen=True)
class DeleteWarmPod(PodDeletion):
    name: str
    uid: str
    reason: str
    resource_version: str | None = None
    force: bool = False

    def describe(self) -> Event:
        return Event("DeletedWarmPod", f"Deleted warm pod {self.name}: {self.reason}")


Action = CreateWarmPod | DeleteWarmPod | WriteDramPlans


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    status: WarmPoolStatus
    conditions: list[Condition]
    dram: dict[str, dram.NodePlan] = field(default_factory=dict)  # every warm server's plan
    recheck_after: float | None = None

    def stored_status(self) -> dict[str, Any]:
        return self.status.dump()


def plan(view: PoolView) -> Plan:
    shapes = view.shapes()
    by_shape, dropped = sort_pods(view, shapes)
    by_shape, given = yield_npus(view, by_shape)
    refill = may_refill(view)
    taken = set(view.pods) | set(view.taken)
    sized: list[Action] = []
    for name, shape in shapes.items():
        sized += size_shape(view, name, shape, by_shape[name], refill, taken)
    plans, dram_rows, write = dram_stage(view)
    rows = [shape_row(view, name, shape, by_shape[name]) for name, shape in shapes.items()]
    status = pool_status(view, rows, dram_rows, refill)
    actions: list[Action] = [*([write] if write else []), *dropped, *given, *sized]
    return Plan(actions, status, [ready_condition(view, status, rows, refill)], plans)


# --------------------------------------------------------------------------- the stages
def sort_pods(view: PoolView, shapes: Mapping[str, WarmShape]) -> tuple[ByShape, list[Action]]:
    """The pool's unclaimed pods it keeps, by shape (each in name order), and the deletions of
    those it does not: of a shape gone, ended, or made from another template."""
    by_shape: ByShape = {name: [] for name in shapes}
    dropped: list[Action] = []
    for pod in sorted(view.pods.values(), key=lambda p: p.name):
        if view.claimed(pod) or pod.deleting:
            continue
        label = pod.label(kinds.LABEL_WARM_SHAPE) or ""
        if label not in by_shape:
            dropped.append(_drop(pod, "its shape is gone"))
        elif pod.phase in ("Failed", "Succeeded"):  # evicted, or its engine ended for good
            dropped.append(_drop(pod, f"it ended ({pod.phase})"))
        elif pod.annotations.get(kinds.ANNOTATION_WARM_TEMPLATE) != template(
            shapes[label], view.spec.image
        ):
            dropped.append(_drop(pod, "its shape or image changed"))
        else:
            by_shape[label].append(pod)
    return by_shape, dropped


def yield_npus(view: PoolView, by_shape: ByShape) -> tuple[ByShape, list[Action]]:
    """While serving pods cannot be placed for want of NPUs, as many of the kept pods deleted
    (warming ones first), and what is left by shape."""
    spare = sorted(
        (p for pods in by_shape.values() for p in pods), key=lambda p: (view.warm(p), p.name)
    )
    given = spare[: view.starved]
    left = {name: [p for p in pods if p not in given] for name, pods in by_shape.items()}
    reason = "its NPUs go to a serving pod the scheduler cannot place"
    return left, [_drop(pod, reason) for pod in given]


def may_refill(view: PoolView) -> bool:
    """Not while yielding; ``Manual``: only a generation not filled yet."""
    return view.starved <= 0 and (
        view.spec.refill_policy is not RefillPolicy.MANUAL
        or view.previous.filled_generation != view.generation
    )


def size_shape(
    view: PoolView,
    name: str,
    shape: WarmShape,
    mine: Sequence[PodView],
    refill: bool,
    taken: set[str],
) -> list[Action]:
    """The shape's pods beyond its size deleted (warming ones first, nothing spent on them yet;
    the newest first), or the missing ones created (not while ZooKeeper is out of reach) under
    names no pod holds (added to ``taken``)."""
    warm = [p for p in mine if view.warm(p)]
    warming = [p for p in mine if not view.warm(p)]
    excess = len(mine) - shape.size
    if excess > 0:
        return [_drop(pod, "beyond the size") for pod in (warming[::-1] + warm[::-1])[:excess]]
    if excess == 0 or not refill or not view.connected:
        return []
    created: list[Action] = []
    index = 0
    for _ in range(-excess):
        while pod_name(view.name, name, index) in taken:
            index += 1
        new = pod_name(view.name, name, index)
        taken.add(new)
        manifest = pod_manifest(
            view.namespace, view.name, view.uid, new, name, shape, view.spec.image, view.engine
        )
        created.append(CreateWarmPod(new, name, manifest))
    return created


def shape_row(
    view: PoolView, name: str, shape: WarmShape, mine: Sequence[PodView]
) -> WarmShapeStatus:
    """A shape's counts: ready and warming within its size, claimed apart."""
    warm = sum(1 for p in mine if view.warm(p))
    claimed = [p for p in _claimed(view) if p.label(kinds.LABEL_WARM_SHAPE) == name]
    return WarmShapeStatus(
        name=name,
        size=shape.size,
        npuType=shape.npu_type,
        devicesPerPod=shape.devices_per_pod,
        ready=min(warm, shape.size),
        warming=max(0, min(len(mine), shape.size) - warm),
        claimed=len(claimed),
    )


def pool_status(
    view: PoolView,
    rows: Sequence[WarmShapeStatus],
    dram_rows: Sequence[WarmDramStatus],
    refill: bool,
) -> WarmPoolStatus:
    claimed = _claimed(view)
    paths = [_claim_path(p) for p in claimed]
    found_warm = sum(1 for p in paths if p == "WarmDRAM" or p.startswith("WarmFork"))
    return WarmPoolStatus(
        observedGeneration=view.generation,
        ready=sum(r.ready for r in rows),
        warming=sum(r.warming for r in rows),
        claimed=len(claimed),
        forksDone=sum(1 for p in paths if p.startswith("WarmFork")),
        shapes=list(rows),
        # stamped once a pass could fill (Manual: a pool made while ZooKeeper was out of
        # reach still fills when it is back)
        filledGeneration=view.generation
        if refill and view.connected
        else (view.previous.filled_generation or 0),
        hitRatePercent=round(100 * found_warm / len(paths)) if paths else None,
        dram=list(dram_rows),
    )


def dram_stage(
    view: PoolView,
) -> tuple[dict[str, dram.NodePlan], list[WarmDramStatus], WriteDramPlans | None]:
    """Every warm server's host-DRAM plan; the status rows of the servers running the pool's
    unclaimed pods (planned and loaded models); the plans to write where ZooKeeper's differ
    (none without ZooKeeper)."""
    plans = dram.plan(view.dram_demand, view.nodes)
    servers = sorted({p.node for p in view.pods.values() if p.node and not view.claimed(p)})
    rows = [
        WarmDramStatus(
            node=node,
            models=list(plans[node].models),
            loaded=sorted(
                {
                    m
                    for name, r in view.reports.items()
                    if r.node == node and name in view.pods
                    for m in r.dram_models
                }
            ),
            bytes=int(plans[node].bytes),
            capacityBytes=int(plans[node].capacity),
        )
        for node in servers
        if node in plans
    ]
    write = dram.writes(plans, view.dram_written, view.now) if view.connected else None
    return plans, rows, write


def ready_condition(
    view: PoolView, status: WarmPoolStatus, rows: Sequence[WarmShapeStatus], refill: bool
) -> Condition:
    ready, size = status.ready, sum(r.size for r in rows)
    if not view.connected:
        return Condition(
            READY,
            False,
            "ZooKeeperUnreachable",
            "the warm engines' reports cannot be read; nothing is created or counted warm",
        )
    if view.starved > 0:
        return Condition(
            READY,
            False,
            "Yielding",
            f"{view.starved} serving pods cannot be placed for want of NPUs: warm pods give "
            "theirs up and the pool is not refilled until they are placed",
        )
    if ready >= size:
        return Condition(READY, True, "Filled", f"{ready} warm pods, as the spec asks")
    if not refill:
        return Condition(
            READY,
            False,
            "NotRefilled",
            f"{ready} of {size} warm pods; refillPolicy Manual: claims are not refilled until "
            "the spec changes",
        )
    return Condition(
        READY, False, "Warming", f"{ready} of {size} warm pods ready, the rest warming"
    )


# --------------------------------------------------------------------------- helpers
def _drop(pod: PodView, why: str) -> DeleteWarmPod:
    return DeleteWarmPod(pod.name, pod.uid, why, pod.resource_version)


def _claimed(view: PoolView) -> list[PodView]:
    return [p for p in view.pods.values() if view.claimed(p)]


def _claim_path(pod: PodView) -> str:
    """The path its claim chose ("" if unreadable)."""
    return WarmClaim.of(pod.annotations).path
