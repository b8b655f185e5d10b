"""An ExpertPool's rules beyond the schema's types and ranges (pure; EaaS §3.1, §3.4).

Expert servers are stateless and interchangeable (EaaS §2.4), so a pool may have any number of
them (no divisor rule, §4.5: "does not restrict the number of experts on each expert server to
the same"); what it may not do is ask for a map that cannot exist:

- **slots**: every expert of every MoE layer ``minReplicasPerExpert`` times, plus the redundant
  budget, must fit the servers' slots: ``servers x slotsPerServer >= experts x
  minReplicasPerExpert + redundantExpertBudget`` (per layer: a server has ``slotsPerServer``
  slots in each layer). The smallest server count that holds that is the pool's *coverage
  bound* (:func:`coverage_bound`): no scale, by hand or by the autoscaler, goes below it (an
  expert's last copy goes only by failure, §3.4);
- **distinct servers**: the copies of one expert are on distinct servers (a copy is a backup
  only if it fails apart, §5.4 "pre-duplicating experts on servers"), so ``minReplicasPerExpert``
  cannot exceed the servers;
- **HBM**: a server holds its slots' experts over every MoE layer: ``slotsPerServer x`` one
  expert's weights over all layers must fit its NPUs' usable HBM (the catalogue's die HBM, 001
  §3.3.1, less the share kept for activations); the model must be one whose expert size the
  platform knows.

The webhook refuses these with the numbers; the reconciler checks them again (an object may be
stored with the webhook off) and touches nothing while they fail.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from matrixserve.api import catalog
from matrixserve.api.resources import ExpertPoolSpec, field_errors

LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
MAX_NAME = 50  # a label value, and room for "-s<index>" in its pods' names


def parse(body: Mapping[str, Any]) -> tuple[ExpertPoolSpec | None, list[str]]:
    """An ExpertPool object's spec parsed and checked: the spec (None if it does not parse)
    and every violation, each naming its field."""
    return parse_spec(body.get("spec") or {}, str(body["metadata"]["name"]))


def parse_spec(raw: Any, name: str) -> tuple[ExpertPoolSpec | None, list[str]]:
    try:
        spec = ExpertPoolSpec.model_validate(dict(raw))
    except ValidationError as exc:
        return None, field_errors(exc)
    return spec, problems(name, spec)


def slots_needed(spec: ExpertPoolSpec) -> int:
    """Slots per layer the map needs: every expert ``minReplicasPerExpert`` times, plus the
    redundant budget."""
    return spec.model.experts * spec.min_replicas_per_expert + spec.redundant_expert_budget


def coverage_bound(spec: ExpertPoolSpec) -> int:
    """The fewest servers that hold the map: ``ceil(slots needed / slotsPerServer)``, and at
    least ``minReplicasPerExpert`` (copies on distinct servers)."""
    return max(
        math.ceil(slots_needed(spec) / spec.servers.slots_per_server),
        spec.min_replicas_per_expert,
    )


def expert_bytes(name: str | None, layers: int) -> float | None:
    """One routed expert's weights over ``layers`` MoE layers, from the catalogue; None if the
    model is not one the platform knows with routed experts."""
    shape = catalog.PRESETS.get(name or "")
    if shape is None or shape.moe is None:
        return None
    return float(shape.expert_params_per_layer * shape.weight_bytes * layers)


def server_hbm_bytes(devices: int) -> float:
    """Usable HBM of a server of ``devices`` NPUs (every die's, less the activations' share)."""
    return devices * catalog.DIES_PER_NPU * catalog.DIE_HBM_BYTES * catalog.HBM_USABLE_FRACTION


def capacity_problems(spec: ExpertPoolSpec, servers: int, field: str) -> list[str]:
    """What ``servers`` servers cannot hold: the slots, and the distinct servers of one
    expert's copies (``field`` names the count in the message)."""
    slots = spec.servers.slots_per_server
    experts, copies = spec.model.experts, spec.min_replicas_per_expert
    budget, needed = spec.redundant_expert_budget, slots_needed(spec)
    out = []
    if servers * slots < needed:
        out.append(
            f"{field}: {servers} servers x {slots} slots = {servers * slots} slots per layer, "
            f"fewer than {experts} experts x {copies} replicas + {budget} redundant = {needed} "
            f"(at least {coverage_bound(spec)} servers of {slots} slots)"
        )
    if copies > servers:
        out.append(
            f"{field}: {servers} servers cannot hold minReplicasPerExpert {copies} copies of an "
            "expert on distinct servers"
        )
    return out


def problems(name: str, spec: ExpertPoolSpec) -> list[str]:
    """What the schema cannot say about an ExpertPool (see the module's docstring)."""
    out = []
    if len(name) > MAX_NAME or not LABEL_VALUE.fullmatch(name):
        out.append(
            f"metadata.name: {name!r}: an ExpertPool's name is a label value and a part of its "
            f"pods' names (at most {MAX_NAME} characters)"
        )
    shape = shape_problems(spec)
    out += shape
    out += capacity_problems(spec, spec.servers.replicas, "spec.servers.replicas")
    if not shape:
        out += hbm_problems(spec)
    out += autoscaling_problems(spec)
    return out


def shape_problems(spec: ExpertPoolSpec) -> list[str]:
    """A model the platform knows is served as it is: its routed experts, MoE layers and top-k
    are the catalogue's (the engines route and time by them; a map of another shape would
    leave experts without a server)."""
    model = spec.model
    shape = catalog.PRESETS.get(model.name or "")
    if shape is None or shape.moe is None:
        return []  # refused by hbm_problems, naming the models known
    moe = shape.moe
    out = []
    for field, given, known, what in (
        ("experts", model.experts, moe.routed_experts, "routed experts"),
        ("layers", model.layers, moe.moe_layers, "MoE layers"),
        ("topK", model.top_k, moe.top_k, "experts per token"),
    ):
        if given != known:
            out.append(f"spec.model.{field}: {given}, but {model.name} has {known} {what}")
    return out


def hbm_problems(spec: ExpertPoolSpec) -> list[str]:
    model, servers = spec.model, spec.servers
    per_expert = expert_bytes(model.name, model.layers)
    if per_expert is None:
        known = ", ".join(n for n, s in sorted(catalog.PRESETS.items()) if s.moe is not None)
        return [
            f"spec.model.name: {model.name!r} is not a MoE model the platform knows the expert "
            f"size of (known: {known}): the slots cannot be checked against a server's HBM"
        ]
    need = servers.slots_per_server * per_expert
    room = server_hbm_bytes(servers.devices_per_server)
    if need <= room:
        return []
    return [
        f"spec.servers.slotsPerServer: {servers.slots_per_server} slots x "
        f"{per_expert / 1e9:.2f} GB (one {model.name} expert over {model.layers} layers) = "
        f"{need / 1e9:.1f} GB, more than {servers.devices_per_server} NPUs' "
        f"{room / 1e9:.1f} GB of usable HBM"
    ]


def autoscaling_problems(spec: ExpertPoolSpec) -> list[str]:
    a = spec.autoscaling
    if not a.enabled:
        return []
    out = []
    if a.target_tokens_per_server_per_second is None:
        out.append(
            "spec.autoscaling.targetTokensPerServerPerSecond: required when autoscaling is enabled"
        )
    if a.max_servers is None:
        out.append("spec.autoscaling.maxServers: required when autoscaling is enabled")
    elif a.max_servers < coverage_bound(spec):
        out.append(
            f"spec.autoscaling.maxServers: {a.max_servers} is below the coverage bound "
            f"{coverage_bound(spec)} (the fewest servers that hold the map)"
        )
    if a.min_servers is not None and a.max_servers is not None and a.min_servers > a.max_servers:
        out.append(
            f"spec.autoscaling.minServers: {a.min_servers} is above maxServers {a.max_servers}"
        )
    return out
