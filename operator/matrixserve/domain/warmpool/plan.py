"""Planning a WarmPool (pure; issue 18, DeepServe §6.1): keep ``size`` warm pods per shape.

Each pass, per shape:

1. count its pods that are the pool's to give: warm (Ready, past TE-Pre-Load, reported in
   ZooKeeper) and warming (not yet); claimed pods (``claimed-by``: a group's now) are counted
   apart and never touched again;
2. refill: create the missing ones (``Immediate`` and ``Scheduled``: at once; ``Manual``: only
   when the spec changed, so claims are not refilled until the user asks);
3. trim: delete unclaimed pods beyond ``size`` (warming ones first), every unclaimed pod of a
   shape no longer in the spec or made from another template (NPUs, type, selector, image),
   and those that ended (evicted, Failed), each only while it is still at the resourceVersion
   seen (a pod claimed meanwhile is not deleted);
   yield: while serving engine pods of the namespace cannot be placed for want of NPUs, give up
   as many unclaimed warm pods (warming ones first) and do not refill (warm pods run at the
   serving pods' priority, so the scheduler does not preempt them: the pool does);
4. status: ready / warming / claimed per shape and in total, claims by NPU-fork, ``Ready``.

Names are ``<pool>-<shape>-<n>``, the smallest ``n`` no pod of the pool holds (a claimed pod
keeps its name: its group owns it now).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from matrixserve.api import kinds
from matrixserve.api.resources import RefillPolicy, WarmClaim
from matrixserve.domain.conditions import Condition
from matrixserve.domain.effects import Event, PodCreation, PodDeletion
from matrixserve.domain.observed import PodView
from matrixserve.domain.warmpool import dram
from matrixserve.domain.warmpool.pods import pod_manifest, pod_name, template
from matrixserve.domain.warmpool.view import PoolView

READY = "Ready"


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


@dataclass(frozen=True)
class Plan:
    actions: list[PodCreation | PodDeletion]
    status: dict[str, Any]
    conditions: list[Condition]
    dram: dict[str, dram.NodePlan] = field(default_factory=dict)  # every warm server's plan
    recheck_after: float | None = None

    def stored_status(self) -> dict[str, Any]:
        return self.status


def _claim_path(pod: PodView) -> str:
    """The path its claim chose ("" if unreadable)."""
    return WarmClaim.of(pod.annotations).path


def _fork_claim(pod: PodView) -> bool:
    return _claim_path(pod).startswith("WarmFork")


def plan(view: PoolView) -> Plan:
    shapes = view.shapes()
    taken = set(view.pods) | set(view.taken)
    by_shape: dict[str, list[PodView]] = {name: [] for name in shapes}
    actions: list[PodCreation | PodDeletion] = []

    def drop(pod: PodView, why: str) -> None:
        actions.append(DeleteWarmPod(pod.name, pod.uid, why, pod.resource_version))

    for pod in sorted(view.pods.values(), key=lambda p: p.name):
        if view.claimed(pod) or pod.deleting:
            continue
        label = pod.label(kinds.LABEL_WARM_SHAPE) or ""
        if label not in by_shape:
            drop(pod, "its shape is gone")
        elif pod.phase in ("Failed", "Succeeded"):  # evicted, or its engine ended for good
            drop(pod, f"it ended ({pod.phase})")
        elif pod.annotations.get(kinds.ANNOTATION_WARM_TEMPLATE) != template(
            shapes[label], view.spec.image
        ):
            drop(pod, "its shape or image changed")
        else:
            by_shape[label].append(pod)
    yielding = view.starved > 0
    refill = not yielding and (
        view.spec.refill_policy is not RefillPolicy.MANUAL
        or view.previous.get("filledGeneration") != view.generation
    )
    if yielding:  # its NPUs to serving pods the scheduler cannot place (warming ones first)
        spare = sorted(
            (p for ps in by_shape.values() for p in ps),
            key=lambda p: (view.warm(p), p.name),
        )
        for pod in spare[: view.starved]:
            drop(pod, "its NPUs go to a serving pod the scheduler cannot place")
            by_shape[pod.label(kinds.LABEL_WARM_SHAPE) or ""].remove(pod)
    rows: list[dict[str, Any]] = []
    for name, shape in shapes.items():
        mine = by_shape[name]
        warm = [p for p in mine if view.warm(p)]
        warming = [p for p in mine if not view.warm(p)]
        claimed = [
            p
            for p in view.pods.values()
            if view.claimed(p) and p.label(kinds.LABEL_WARM_SHAPE) == name
        ]
        excess = len(mine) - shape.size
        if excess > 0:
            # warming ones first (nothing spent on them yet), the newest first
            for pod in (warming[::-1] + warm[::-1])[:excess]:
                drop(pod, "beyond the size")
        elif excess < 0 and refill and view.connected:
            index = 0
            for _ in range(-excess):
                while pod_name(view.name, name, index) in taken:
                    index += 1
                new = pod_name(view.name, name, index)
                taken.add(new)
                manifest = pod_manifest(
                    view.namespace,
                    view.name,
                    view.uid,
                    new,
                    name,
                    shape,
                    view.spec.image,
                    view.engine,
                )
                actions.append(CreateWarmPod(new, name, manifest))
        rows.append(
            {
                "name": name,
                "size": shape.size,
                "npuType": shape.npu_type,
                "devicesPerPod": shape.devices_per_pod,
                "ready": min(len(warm), shape.size),
                "warming": max(0, min(len(mine), shape.size) - len(warm)),
                "claimed": len(claimed),
            }
        )
    ready = sum(int(r["ready"]) for r in rows)
    size = sum(int(r["size"]) for r in rows)
    claimed_pods = [p for p in view.pods.values() if view.claimed(p)]
    status: dict[str, Any] = {
        "observedGeneration": view.generation,
        "ready": ready,
        "warming": sum(int(r["warming"]) for r in rows),
        "claimed": len(claimed_pods),
        "forksDone": sum(1 for p in claimed_pods if _fork_claim(p)),
        "shapes": rows,
        # stamped once a pass could fill (Manual: a pool made while ZooKeeper was out of
        # reach still fills when it is back)
        "filledGeneration": view.generation
        if refill and view.connected
        else view.previous.get("filledGeneration", 0),
    }
    claimed_paths = [_claim_path(p) for p in claimed_pods]
    found_warm = sum(1 for p in claimed_paths if p == "WarmDRAM" or p.startswith("WarmFork"))
    if claimed_paths:
        status["hitRatePercent"] = round(100 * found_warm / len(claimed_paths))
    plans = dram.plan(view.dram_demand, view.nodes)
    servers = sorted({p.node for p in view.pods.values() if p.node and not view.claimed(p)})
    status["dram"] = [
        {
            "node": node,
            "models": list(plans[node].models),
            "loaded": sorted(
                {
                    m
                    for name, r in view.reports.items()
                    if r.node == node and name in view.pods
                    for m in r.dram_models
                }
            ),
            "bytes": int(plans[node].bytes),
            "capacityBytes": int(plans[node].capacity),
        }
        for node in servers
        if node in plans
    ]
    if not view.connected:
        condition = Condition(
            READY,
            False,
            "ZooKeeperUnreachable",
            "the warm engines' reports cannot be read; nothing is created or counted warm",
        )
    elif yielding:
        condition = Condition(
            READY,
            False,
            "Yielding",
            f"{view.starved} serving pods cannot be placed for want of NPUs: warm pods give "
            "theirs up and the pool is not refilled until they are placed",
        )
    elif ready >= size:
        condition = Condition(READY, True, "Filled", f"{ready} warm pods, as the spec asks")
    elif not refill:
        condition = Condition(
            READY,
            False,
            "NotRefilled",
            f"{ready} of {size} warm pods; refillPolicy Manual: claims are not refilled until "
            "the spec changes",
        )
    else:
        condition = Condition(
            READY, False, "Warming", f"{ready} of {size} warm pods ready, the rest warming"
        )
    return Plan(actions, status, [condition], plans)
