"""Which models each server keeps in host DRAM (pure; issue 18, DeepServe §6.2 pre-loading).

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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from matrixserve.api import catalog
from matrixserve.api.resources import PDGroupSpec, WarmPoolSpec
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
