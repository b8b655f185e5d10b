"""Which models each server keeps in host DRAM (pure; DeepServe §6.2 pre-loading).

"The cluster manager predicts models that are likely to scale and pre-loads them into DRAM page
cache using pre-warmed TEs. When scaling is triggered, the master prioritizes selecting
pre-warmed TEs with the required model already loaded" (§6.2; 1.5 TB per server, "sufficient
for pre-loading 10 70B models or 100 7B models").

The prediction (``[design]``: the paper does not say how it predicts): first the models the
namespace's WarmPools name in ``dramPreload`` (in the pools' order, each on the servers its
``nodeSelector`` picks), then the models of the namespace's PDGroups, the group with the most
instances first (a group that serves more is likelier to scale). Each server that runs a warm
pod gets the longest prefix of that list whose weights fit in ``DRAM_PRELOAD_FRACTION`` of its
DRAM (a model that does not fit is skipped, a smaller one after it may still go). Every pool of
a namespace computes the same plan from the same inputs, so their writes agree.

The plans reach the warm engines through ZooKeeper (``/matrixserve/v1/warm/<ns>/dram/<node>``):
:func:`writes` compares them with what is there and asks for the servers whose plan changed
(:class:`WriteDramPlans`, an effect like any other), so a settled namespace writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError

from matrixserve.api import catalog
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec, WarmPoolSpec
from matrixserve.domain.effects import ZnodeChange
from matrixserve.domain.observed import NodeView, PodView

Spec = TypeVar("Spec", WarmPoolSpec, PDGroupSpec)
DRAM_PRELOAD_FRACTION = 0.9  # [design] the rest for the OS and the pods' own memory


@dataclass(frozen=True)
class Demand:
    """A model to pre-load, where (a node selector; None: every server), and its size."""

    model: str
    bytes: float
    selector: Mapping[str, str] | None = None
    why: str = ""


@dataclass(frozen=True)
class NodePlan:
    node: str
    models: tuple[str, ...]
    bytes: float
    capacity: float


def model_bytes(name: str, size_bytes: float | None = None) -> float | None:
    """A model's weights: the size a spec gives, else the catalogue's; None if unknown."""
    if size_bytes:
        return float(size_bytes)
    preset = catalog.PRESETS.get(name)
    return float(preset.weight_bytes_total) if preset is not None else None


def plan(
    demand: Sequence[Demand],
    nodes: Mapping[str, Mapping[str, str]],  # the servers with warm pods -> their labels
    capacity: float = catalog.HOST_DRAM_BYTES,
) -> dict[str, NodePlan]:
    room = capacity * DRAM_PRELOAD_FRACTION
    out = {}
    for node, labels in sorted(nodes.items()):
        chosen: list[str] = []
        used = 0.0
        for d in demand:
            if d.model in chosen:
                continue
            if d.selector and any(labels.get(k) != v for k, v in d.selector.items()):
                continue
            if used + d.bytes > room:
                continue
            chosen.append(d.model)
            used += d.bytes
        out[node] = NodePlan(node, tuple(chosen), used, capacity)
    return out


def demand(
    pools: Iterable[Mapping[str, Any]], groups: Iterable[Mapping[str, Any]]
) -> tuple[Demand, ...]:
    """What to pre-load, in order, from the namespace's WarmPool and PDGroup objects (as
    stored): every pool's ``dramPreload`` (pools in name order), then the groups' models, the
    group with the most instances first. An object whose spec does not parse asks for nothing
    (its own controller reports it); nor does a model of unknown size."""
    out: list[Demand] = []
    for pool in sorted(pools, key=lambda o: str(o["metadata"]["name"])):
        spec = _parsed(WarmPoolSpec, pool)
        for entry in spec.dram_preload if spec is not None else ():
            size = model_bytes(entry.model)
            if size is not None:
                why = f"WarmPool {pool['metadata']['name']}"
                out.append(Demand(entry.model, size, entry.node_selector, why))
    served = []
    for group in groups:
        g = _parsed(PDGroupSpec, group)
        size = model_bytes(g.model.name, g.model.size_bytes) if g is not None else None
        if g is not None and size is not None:
            instances = g.prefill.replicas + g.decode.replicas
            served.append((-instances, str(group["metadata"]["name"]), g.model.name, size))
    out += [Demand(model, size, None, f"PDGroup {g}") for _, g, model, size in sorted(served)]
    return tuple(out)


def _parsed(model: type[Spec], body: Mapping[str, Any]) -> Spec | None:
    """An object's spec, None if it does not parse."""
    try:
        return model.model_validate(body.get("spec") or {})
    except ValidationError:
        return None


def servers(
    warm_pods: Iterable[PodView], nodes: Mapping[str, NodeView]
) -> dict[str, dict[str, str]]:
    """The servers running those of ``warm_pods`` (the namespace's unclaimed ones) not being
    deleted, with their labels (for the pre-loads' node selectors; none for a server not
    listed)."""
    return {
        p.node: dict(nodes[p.node].labels) if p.node in nodes else {}
        for p in warm_pods
        if p.node and not p.deleting
    }


@dataclass(frozen=True)
class WriteDramPlans(ZnodeChange[zl.WarmPaths]):
    """Make the namespace's ``dram/`` say the plans: ``plans`` written (the servers whose plan
    changed), the plans of the servers in ``removed`` (no warm pod there any more) deleted.
    Independent of the pass's pods: a pod creation that fails does not hold it back."""

    independent: ClassVar[bool] = True
    plans: tuple[zl.DramPlan, ...] = ()
    removed: tuple[str, ...] = ()

    @property
    def nodes(self) -> list[str]:
        """The servers whose plan this changes."""
        return sorted({*self.removed, *(p.node for p in self.plans)})

    def znodes(self, paths: zl.WarmPaths) -> list[zl.ZnodeOp]:
        return [
            *(zl.Delete(paths.dram(node)) for node in self.removed),
            *(zl.Put(paths.dram(p.node), p.dump()) for p in self.plans),
        ]


def writes(
    plans: Mapping[str, NodePlan], written: Mapping[str, zl.DramPlan | None], now: float
) -> WriteDramPlans | None:
    """What makes ``dram/`` (``written``: node -> its plan there, None if unreadable) say
    ``plans``: a server's plan where it has none or its models or size changed (stamped
    ``now``), a plan removed where its server is no longer in ``plans``; None if nothing
    changed."""
    removed = tuple(node for node in written if node not in plans)
    changed = []
    for node, p in plans.items():
        old = written.get(node)
        if old is None or (old.models, old.bytes) != (list(p.models), p.bytes):
            changed.append(
                zl.DramPlan(
                    node=node,
                    models=list(p.models),
                    bytes=p.bytes,
                    capacityBytes=p.capacity,
                    ts=now,
                )
            )
    return WriteDramPlans(tuple(changed), removed) if changed or removed else None
