"""A PDGroup's rules beyond the schema's types and ranges, and the rules for changing an
existing group.

Which rule lives where (``docs/operator.md``): the per-object rules the CRD states to
the API server itself — CEL ``x-kubernetes-validations`` (Kubernetes 1.29+) and the name's
``maxLength`` — are :func:`schema_rules`; the API server refuses a create, an update or a scale
that breaks them, in the words these functions use (the name's rule in the schema's own). The
validating admission webhook (:func:`admit`), which the API server calls only after its own
checks passed, judges what the API server cannot: :func:`admission_rules` (the model catalogue:
weights and KV in HBM; quantities, which may be numbers like ``0.5`` that CEL's typed view of
the schema cannot read; the ratio policy's splits of the total) and the changes to an existing
group (the old object and the running pods). It checks :func:`schema_rules` too, which reach it
only where the API server did not: a CRD not upgraded with the chart (helm never upgrades CRDs),
or a server without CEL (the 1.20 opt-in). The reconciler checks both sets again
(:func:`validate_pdgroup`: an object stored before its CRD had the rules), with the instance
template the running pods were made from
(:func:`running_template_changes`), and on a violation sets Ready=False, reason InvalidSpec and
touches nothing. Pure: the hardware facts (CloudMatrix384, 001 §3) and the model shapes come
from the API's catalogue (:mod:`matrixserve.api.catalog`), which the engine stub emulates. A
role's ``resources`` (CPU and memory) have their quantities checked by the model and their limits
against their requests here.

What may change on an existing group: the replicas (scale out and in by dynamic RoCE
construction, P/D-Serve §3.3), and ``service``, ``scenario``, ``slo``, ``ratioPolicy``,
``recovery`` (the gateway and the status follow them at once). The instance template (the model,
each role's fields but its replicas, its ``resources`` included, ``moe``, ``warmPoolRef``)
reaches a pod only when the pod is made; the operator does not roll a changed template out to
running instances yet, so it is immutable until it does, rather than accepted and ignored. A
pod's stamped template names the fields its operator knew: one it does not name (``resources``
on a pod made before they existed) is held to the old spec by the webhook, so adding it is
refused too (the reconciler, with no old spec, cannot tell it from a default).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from matrixserve.api import catalog, kinds, kvmapping
from matrixserve.api.catalog import HBM_USABLE_FRACTION, PRESETS
from matrixserve.api.resources import (
    MoEMode,
    PDGroupSpec,
    RoleSpec,
    field_errors,
    quantity_value,
)
from matrixserve.api.roles import Role
from matrixserve.domain import ratio
from matrixserve.domain.observed import PodView

MAX_GROUP_NAME = 50  # pod names are <group>-p-<ordinal> and must stay within 63 characters


@dataclass(frozen=True)
class ModelFacts:
    weight_bytes: float
    kv_bytes_per_token: float
    # the weights but the routed and shared experts (all of them for a model without)
    non_expert_bytes: float


def model_facts(spec: PDGroupSpec) -> ModelFacts | None:
    m = spec.model
    preset = PRESETS.get(m.name)
    if preset is not None:
        weights = float(m.size_bytes) if m.size_bytes else preset.weight_bytes_total
        kv = float(m.kv_bytes_per_token) if m.kv_bytes_per_token else preset.kv_bytes_per_token
        # a size given scales the catalogue's share of the experts with it
        non_expert = weights * preset.non_expert_weight_bytes / preset.weight_bytes_total
        return ModelFacts(weights, kv, non_expert)
    if m.size_bytes and m.layers and m.hidden_size:
        kv = float(m.kv_bytes_per_token or 2 * m.hidden_size * 2 * m.layers)  # P/D-Serve §2.1
        return ModelFacts(float(m.size_bytes), kv, float(m.size_bytes))
    return None


def attention_clients(spec: PDGroupSpec) -> bool:
    """The decodes are an ExpertPool's attention clients (``moe: Disaggregated`` with an
    ``expertPoolRef``): their experts live in the pool."""
    moe = spec.moe
    return moe is not None and moe.mode is MoEMode.DISAGGREGATED and moe.expert_pool_ref is not None


def held_weights(spec: PDGroupSpec, role: Role, facts: ModelFacts) -> float:
    """The weights an instance of ``role`` holds in HBM: the model's; an attention client's
    (EaaS §3.1, xDeepServe §5.2) the non-expert ones once per TP group (with data-parallel
    attention each group of ``tp`` dies holds its copy, as the engine does; ``tp`` defaults to
    the instance's dies, one copy)."""
    if role is not Role.DECODE or not attention_clients(spec):
        return facts.weight_bytes
    r = spec.role_spec(role)
    dies = r.devices_per_instance * catalog.DIES_PER_NPU
    return facts.non_expert_bytes * max(1, dies // (r.parallelism.tp or dies))


def _resource_rules(role: str, r: RoleSpec) -> list[str]:
    """A limit below its request, both given (what is left out is defaulted so as to fit)."""
    if r.resources is None:
        return []
    errors = []
    for name in ("cpu", "memory"):
        request = getattr(r.resources.requests, name)
        limit = getattr(r.resources.limits, name)
        if (
            request is not None
            and limit is not None
            and quantity_value(limit) < quantity_value(request)
        ):
            errors.append(
                f"spec.{role}.resources.limits.{name}: {limit} is below the request "
                f"{request} (requests.{name}); a limit must be at least its request"
            )
    return errors


def _role_shape(role: str, r: RoleSpec) -> list[str]:
    """A role's own rules the CRD states (CEL on the role)."""
    errors = []
    dies = r.devices_per_instance * catalog.DIES_PER_NPU
    npus, pods, server = r.devices_per_instance, r.pods_per_instance, catalog.NPUS_PER_SERVER
    if npus % pods:
        errors.append(
            f"spec.{role}.podsPerInstance: {pods} pods cannot share {npus} NPUs equally; an "
            "instance's pods have the same NPUs each"
        )
    elif npus > server * pods:
        errors.append(
            f"spec.{role}.devicesPerInstance: {npus} NPUs over {pods} pod(s) are {npus // pods} "
            f"per pod, more than a server has ({server} NPUs); an instance runs one pod per "
            f"server: set podsPerInstance to at least {-(-npus // server)}"
        )
    tp = r.parallelism.tp
    if tp is not None and dies % tp:
        errors.append(
            f"spec.{role}.parallelism.tp: {tp} does not divide the instance's {dies} dies"
        )
    dp = r.parallelism.dp
    runs = tp or dies  # the engine's tp: the instance's dies when not given
    if dp is not None and dp * runs != dies:
        errors.append(
            f"spec.{role}.parallelism.dp: {dp} is not what runs: an instance's data-parallel "
            f"degree is its {dies} dies / tp {runs} = {dies // runs} (leave dp out, or set it to "
            "that)"
        )
    return errors


def _pairing_rules(spec: PDGroupSpec) -> list[str]:
    """A prefill and a decode of different sizes pair their dies by CloudMatrix-Infer §4.3.3's
    mapping (:mod:`matrixserve.api.kvmapping`): each precondition it breaks, naming the field to
    change (the same size pairs device k with device k, always). Judged only where each role's
    tp divides its dies (the role's own rule says so otherwise)."""
    sides = []
    for r in (spec.prefill, spec.decode):
        dies = r.devices_per_instance * catalog.DIES_PER_NPU
        tp = r.parallelism.tp or dies  # the engine's tp: the instance's dies when not given
        if dies % tp:
            return []
        sides.append(kvmapping.Side(dies, tp))
    p, d = sides
    why = (
        f"a prefill and a decode of different sizes ({p.dies} and {d.dies} dies) pair by "
        "CloudMatrix-Infer §4.3.3's KV mapping, which "
    )
    errors = []
    for broken in kvmapping.broken(p, d):
        if broken is kvmapping.Precondition.PREFILL_ONE_TP_GROUP:
            errors.append(
                f"spec.prefill.parallelism.tp: {p.tp} is not the prefill's {p.dies} dies: {why}"
                f"names prefill TP ranks only, so the prefill must be one TP group (leave tp "
                f"out, or set it to {p.dies})"
            )
        elif broken is kvmapping.Precondition.TP_DIVIDES:
            errors.append(
                f"spec.decode.parallelism.tp: {d.tp} does not divide the prefill's tp {p.tp}: "
                f"{why}needs prefill tp to be a multiple of decode tp"
            )
        else:
            errors.append(
                f"spec.decode.devicesPerInstance: {d.dies} dies / decode tp {d.tp} = dp {d.dp} "
                f"is not a multiple of prefill tp / decode tp = {p.tp // d.tp}: {why}needs "
                "decode dp to be a multiple of that ratio"
            )
    return errors


def _role_fit(spec: PDGroupSpec, role: Role, facts: ModelFacts | None) -> list[str]:
    """A role's resources, and the weights its instances hold and their KV in their HBM."""
    r, key, context = spec.role_spec(role), role.spec_key, spec.model.max_context_tokens
    errors = _resource_rules(key, r)
    if facts is None:
        return errors
    dies = r.devices_per_instance * catalog.DIES_PER_NPU
    usable = dies * catalog.DIE_HBM_BYTES * HBM_USABLE_FRACTION
    weights = held_weights(spec, role, facts)
    what = "weights" if weights == facts.weight_bytes else "non-expert weights (experts pooled)"
    if weights > usable:
        errors.append(
            f"spec.{key}.devicesPerInstance: {weights / 1e9:.1f} GB of {what} do not fit "
            f"{r.devices_per_instance} NPUs ({usable / 1e9:.1f} GB usable HBM)"
        )
        return errors
    kv_need = r.batch_size * context * facts.kv_bytes_per_token
    kv_room = usable - weights
    if kv_need > kv_room:
        errors.append(
            f"spec.{key}.batchSize: {r.batch_size} requests x {context} tokens need "
            f"{kv_need / 1e9:.1f} GB of KV cache; {kv_room / 1e9:.1f} GB of HBM is left after the {what}"
        )
    return errors


def validate_pdgroup(spec: PDGroupSpec, name: str) -> list[str]:
    """Every violation, each a message naming the field; empty when the spec is valid (the
    reconciler's check: :func:`schema_rules` and :func:`admission_rules`)."""
    return schema_rules(spec, name) + admission_rules(spec)


def schema_rules(spec: PDGroupSpec, name: str) -> list[str]:
    """The rules the CRD states to the API server (``crds/matrixserve.io_pdgroups.yaml``: the
    name's ``maxLength``, the ``x-kubernetes-validations`` of the spec, each role, the ratio
    policy and ``moe``), as this module words them; ``tests/cluster/test_crd_contract.py``
    checks that the API server refuses each CEL rule with the same words."""
    errors: list[str] = []
    if len(name) > MAX_GROUP_NAME:
        errors.append(
            f"metadata.name: at most {MAX_GROUP_NAME} characters (pod names derive from it)"
        )
    for each in Role:
        errors += _role_shape(each.spec_key, spec.role_spec(each))
    errors += _pairing_rules(spec)
    for role, r, why in (
        ("prefill", spec.prefill, "the prefills are the group's entrances: none takes requests"),
        ("decode", spec.decode, "every request's KV cache moves from a prefill to a decode"),
    ):
        if r.replicas < 1:
            errors.append(
                f"spec.{role}.replicas: {r.replicas}; a group needs at least 1 {role} ({why}); "
                "delete the group to stop it"
            )
    superpod_npus = catalog.SERVERS_PER_SUPERPOD * catalog.NPUS_PER_SERVER
    decode_npus = spec.decode.replicas * spec.decode.devices_per_instance
    if decode_npus > superpod_npus:
        errors.append(
            f"spec.decode.replicas: {decode_npus} decode NPUs cannot be placed in one SuperPod "
            f"({superpod_npus} NPUs); decode instances of a group stay inside one SuperPod"
        )
    errors += _ratio_bound_errors(spec)
    errors += _moe_rules(spec)
    for field, given in (
        ("prefillArtifact", spec.model.prefill_artifact),
        ("decodeArtifact", spec.model.decode_artifact),
    ):
        if given is not None:
            errors.append(f"spec.model.{field}: {ARTIFACT_UNSUPPORTED}")
    return errors


MOE_COLOCATED = (
    "Colocated needs no spec.moe: remove it; an MoE model's experts then run inside each "
    "instance (parallelism.ep)"
)
DP_DOMAIN_UNSUPPORTED = (
    "DPDomain has no controller yet: remove it; the decodes are the expert pool's attention "
    "clients themselves"
)


def _moe_rules(spec: PDGroupSpec) -> list[str]:
    """``moe``: experts as a service (EaaS §3.1): ``Disaggregated`` with an ``expertPoolRef``
    runs the decodes as the pool's attention clients. ``Colocated`` is what an MoE model does
    without ``moe`` (its experts inside each instance), and DP domains have no controller yet."""
    moe = spec.moe
    if moe is None:
        return []
    if moe.mode is MoEMode.COLOCATED:
        return [f"spec.moe: {MOE_COLOCATED}"]
    errors = []
    shape = PRESETS.get(spec.model.name)
    if shape is not None and shape.moe is None:
        errors.append(
            f"spec.moe: Disaggregated needs an MoE model: {spec.model.name} has no routed experts "
            "(remove spec.moe)"
        )
    if moe.expert_pool_ref is None:
        errors.append("spec.moe: Disaggregated needs expertPoolRef")
    if moe.dp_domain_ref is not None:
        errors.append(f"spec.moe.dpDomainRef: {DP_DOMAIN_UNSUPPORTED}")
    return errors


def expert_pool_errors(spec: PDGroupSpec, pool: Mapping[str, Any] | None) -> list[str]:
    """What the pool ``spec.moe.expertPoolRef`` names refuses of the group: one serving another
    model (its experts are not this model's), or fewer experts or MoE layers than the model has
    (the decodes would never find every expert covered, so never serve). A pool not there yet is
    waited for (the decodes serve once its map is in force), not refused."""
    moe = spec.moe
    if moe is None or moe.expert_pool_ref is None or pool is None:
        return []
    held = (pool.get("spec") or {}).get("model") or {}
    model, name = held.get("name"), moe.expert_pool_ref.name
    if model is not None and model != spec.model.name:
        return [
            f"spec.moe.expertPoolRef: ExpertPool {name} serves model "
            f"{model}, not this group's {spec.model.name}"
        ]
    shape = PRESETS.get(spec.model.name)
    if shape is None or shape.moe is None:
        return []
    want = (shape.moe.routed_experts, shape.moe.moe_layers)
    if (held.get("experts"), held.get("layers")) != want:
        return [
            f"spec.moe.expertPoolRef: ExpertPool {name} holds {held.get('experts')} experts x "
            f"{held.get('layers')} layers; {spec.model.name} has {want[0]} x {want[1]} "
            "(its decodes need every one covered)"
        ]
    return []


ARTIFACT_UNSUPPORTED = (
    "per-role compiled artefacts are not supported yet: every engine loads model.name and "
    "compiles it itself; remove the field"
)


def admission_rules(spec: PDGroupSpec) -> list[str]:
    """What only the operator can judge, the webhook's part: the model against the engine's
    catalogue, its weights and KV in each role's HBM, the resources' limits against their
    requests, and a split of the total within the ratio policy's bounds."""
    errors: list[str] = []
    facts = model_facts(spec)
    if spec.model.name not in PRESETS:
        errors.append(
            f"spec.model.name: the engine stub emulates {', '.join(sorted(PRESETS))}; "
            f"{spec.model.name!r} cannot be served yet"
        )
    elif facts is None:
        errors.append(
            f"spec.model: {spec.model.name!r} is not a known model ({', '.join(sorted(PRESETS))}); "
            "give sizeBytes, layers and hiddenSize"
        )
    for role in Role:
        errors += _role_fit(spec, role, facts)
    if attention_clients(spec) and spec.decode.pods_per_instance > 1:
        errors.append(
            f"spec.decode.podsPerInstance: {spec.decode.pods_per_instance}: an ExpertPool's "
            "attention client is an instance of one pod (its experts are the pool's: "
            f"devicesPerInstance up to {catalog.NPUS_PER_SERVER} NPUs hold its weights)"
        )
    errors += _ratio_split_errors(spec)
    return errors


def _bounds_apart(spec: PDGroupSpec) -> list[str]:
    """Each lower bound of the ratio policy above its upper bound."""
    errors = []
    rp = spec.ratio_policy
    for role, lo, hi in (
        ("Prefill", rp.min_prefill, rp.max_prefill),
        ("Decode", rp.min_decode, rp.max_decode),
    ):
        if lo is not None and hi is not None and lo > hi:
            errors.append(f"spec.ratioPolicy.min{role}: {lo} exceeds max{role} {hi}")
    if rp.min_ratio is not None and rp.max_ratio is not None and rp.min_ratio > rp.max_ratio:
        # (as CEL's %s prints a double: 2 for 2.0)
        errors.append(
            f"spec.ratioPolicy.minRatio: {rp.min_ratio:g} exceeds maxRatio {rp.max_ratio:g}"
        )
    return errors


def _ratio_bound_errors(spec: PDGroupSpec) -> list[str]:
    """The ratio policy's bounds against each other, and under ``Fixed`` (which keeps the
    replicas) each role's replicas within its bounds."""
    errors = _bounds_apart(spec)
    rp = spec.ratio_policy
    if rp.total_driven:
        return errors
    for role, lo, hi, n in (
        ("Prefill", rp.min_prefill, rp.max_prefill, spec.prefill.replicas),
        ("Decode", rp.min_decode, rp.max_decode, spec.decode.replicas),
    ):
        if lo is not None and n < lo:
            errors.append(f"spec.{role.lower()}.replicas: {n} is below ratioPolicy.min{role} {lo}")
        if hi is not None and n > hi:
            errors.append(f"spec.{role.lower()}.replicas: {n} is above ratioPolicy.max{role} {hi}")
    return errors


def _ratio_split_errors(spec: PDGroupSpec) -> list[str]:
    """Under ``Model`` and ``Feedback`` the replicas set the total and the policy splits it:
    some split of the total must be within the bounds (and on the ladder, if one is given)."""
    rp = spec.ratio_policy
    if not rp.total_driven or _bounds_apart(spec):
        return []  # (bounds apart: the schema's rule says so)
    total = spec.prefill.replicas + spec.decode.replicas
    if ratio_bounds(spec).splits(total):
        return []
    rungs = f" and the ladder {', '.join(rp.ladder)}" if rp.ladder else ""
    return [
        f"spec.ratioPolicy: no split of the total of {total} instances (prefill.replicas + "
        f"decode.replicas, which {rp.mode} splits) is within its bounds{rungs}"
    ]


def ratio_bounds(spec: PDGroupSpec) -> ratio.Bounds:
    """The policy's bounds as the ratio model takes them."""
    rp = spec.ratio_policy
    return ratio.Bounds(
        min_prefill=rp.min_prefill or 1,
        max_prefill=rp.max_prefill,
        min_decode=rp.min_decode or 1,
        max_decode=rp.max_decode,
        min_ratio=rp.min_ratio,
        max_ratio=rp.max_ratio,
        ladder=ratio.parse_ladder(rp.ladder),
    )


def parse_spec(raw: Any, name: str) -> tuple[PDGroupSpec | None, list[str]]:
    """A PDGroup's spec parsed and checked: the spec (None if it does not parse) and every
    violation of the schema's and the cross-field rules, each naming its field."""
    try:
        parsed = PDGroupSpec.model_validate(dict(raw))
    except ValidationError as exc:
        return None, field_errors(exc)
    return parsed, validate_pdgroup(parsed, name)


# --------------------------------------------------------------------------- changes
ROLES = tuple(role.spec_key for role in Role)  # ("prefill", "decode")
# On each pod: the canonical JSON of the instance template it was made from (:func:`stamp`).
ANNOTATION_TEMPLATE = f"{kinds.LABEL_PREFIX}/instance-template"
NOT_ROLLED_OUT = (
    "the operator does not roll out changes to the instance template (model; a role's "
    "devicesPerInstance, podsPerInstance, npuType, parallelism, batchSize, image, resources; "
    "moe; slo.tpotMilliseconds; warmPoolRef) yet: set it back, or create a new PDGroup"
)


def instance_template(spec: PDGroupSpec, role: str) -> dict[str, Any]:
    """What an instance of ``role`` (``prefill`` or ``decode``) is made from, in the spec's shape
    and JSON names: the model, the role's fields but its replicas, ``moe``,
    ``slo.tpotMilliseconds``, ``warmPoolRef``."""
    r = spec.role_spec(Role.from_spec_key(role))
    return {
        "model": spec.model.model_dump(mode="json", by_alias=True),
        role: r.model_dump(mode="json", by_alias=True, exclude={"replicas"}),
        "moe": None if spec.moe is None else spec.moe.model_dump(mode="json", by_alias=True),
        # the decodes' batch meets it (ENGINE_TPOT_SLO_MS), so it is the instances'
        "slo": {"tpotMilliseconds": spec.slo.tpot_milliseconds},
        "warmPoolRef": (
            None
            if spec.warm_pool_ref is None
            else spec.warm_pool_ref.model_dump(mode="json", by_alias=True)
        ),
    }


def stamp(spec: PDGroupSpec, role: str) -> str:
    """The :data:`ANNOTATION_TEMPLATE` value of a pod of ``role``: its template as canonical
    JSON (sorted keys, no spaces), so equal templates give equal strings."""
    return json.dumps(instance_template(spec, role), sort_keys=True, separators=(",", ":"))


# What a pod's template cannot say: a field it does not name (made by an operator older than
# the field), compared with the old spec when there is one (:func:`admit`), else not at all.
_UNKNOWN: Any = object()


def _changes(
    made_from: Any, now: Any, path: str, before: Any = _UNKNOWN
) -> list[tuple[str, Any, Any]]:
    """Each leaf ``now`` differs in from the template ``made_from``: (spec path, was, now). A
    field ``made_from`` does not name (a pod of an older operator) is compared with the same
    field of ``before``, the old spec's template, when given: otherwise adding it (``resources``
    to a group made before they existed) would be accepted and never applied."""
    if isinstance(made_from, dict) and isinstance(now, dict):
        old = before if isinstance(before, dict) else {}
        found = []
        for key in sorted(made_from.keys() | now.keys()):
            where = f"{path}.{key}"
            if key in made_from:
                found += _changes(made_from[key], now.get(key), where, old.get(key, _UNKNOWN))
            elif key in old:
                found += _changes(old[key], now.get(key), where)
        return found
    return [] if made_from == now else [(path, made_from, now)]


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _immutable(path: str, was: Any, now: Any) -> str:
    return (
        f"{path}: cannot change from {_show(was)} to {_show(now)} on an existing group; "
        + NOT_ROLLED_OUT
    )


def validate_update(old: PDGroupSpec, new: PDGroupSpec) -> list[str]:
    """The instance template fields that ``new`` changes from ``old`` (an existing group's
    spec), one message each; empty when only what may change did."""
    errors: list[str] = []
    for role in ROLES:
        for path, was, now in _changes(
            instance_template(old, role), instance_template(new, role), "spec"
        ):
            message = _immutable(path, was, now)
            if message not in errors:  # model, moe and warmPoolRef are in both roles' templates
                errors.append(message)
    return errors


def _running_changes(
    spec: PDGroupSpec, pods: Iterable[PodView], old: PDGroupSpec | None = None
) -> list[tuple[str, Any, Any, PodView]]:
    """(spec path, the pod's value, the spec's, the first pod in name order that differs) for
    each template field ``spec`` differs in from a running pod's stamped template (or, for a
    field that template does not name, from the ``old`` spec's, when given)."""
    found: dict[str, tuple[str, Any, Any, PodView]] = {}
    for pod, role, made_from in _stamped(pods):
        before = _UNKNOWN if old is None else instance_template(old, role)
        for path, was, now in _changes(made_from, instance_template(spec, role), "spec", before):
            found.setdefault(path, (path, was, now, pod))
    return list(found.values())


def running_template_changes(spec: PDGroupSpec, pods: Iterable[PodView]) -> list[str]:
    """The instance template fields ``spec`` differs in from the template a running pod of the
    group was made from (its :data:`ANNOTATION_TEMPLATE`), one message each. A pod being
    deleted, or without the annotation (made by an older operator), counts as matching."""
    return [
        f"{path}: {_show(now)} differs from {_show(was)}, which the running pod {pod.name} was "
        "made from; " + NOT_ROLLED_OUT
        for path, was, now, pod in _running_changes(spec, pods)
    ]


def _stamped(pods: Iterable[PodView]) -> list[tuple[PodView, str, dict[str, Any]]]:
    """The running pods that carry a readable template, with their role, in name order."""
    found = []
    for pod in sorted(pods, key=lambda p: p.name):
        role = Role.from_label(pod.label(kinds.LABEL_ROLE))
        raw = pod.annotations.get(ANNOTATION_TEMPLATE)
        if pod.deleting or role is None or raw is None:
            continue
        try:
            made_from = json.loads(raw)
        except ValueError:
            continue
        if isinstance(made_from, dict):
            found.append((pod, role.spec_key, made_from))
    return found


# --------------------------------------------------------------------------- admission
def spec_changes(
    operation: str, old_raw: Mapping[str, Any] | None, new_raw: Mapping[str, Any] | None
) -> bool:
    """Whether a request writes a spec: a create, or an update whose spec differs (not an update
    of metadata only: labels, annotations, finalizers, the finalizer's removal included)."""
    if operation == "CREATE":
        return True
    return operation == "UPDATE" and dict(old_raw or {}) != dict(new_raw or {})


def admit(
    operation: str,
    old_raw: Mapping[str, Any] | None,
    new_raw: Mapping[str, Any] | None,
    deleting: bool,
    name: str,
    running: Iterable[PodView] = (),
) -> list[str]:
    """The webhook's decision on a request (``CREATE`` or ``UPDATE``, with the old and the new
    raw spec): every reason to refuse it, empty to admit it.

    Never refused: an update of metadata only, and anything on an object being deleted (an
    invalid object can always be fixed or deleted). A new spec must pass :func:`parse_spec`
    (:func:`schema_rules` reach the webhook only where the API server did not check them: a CRD
    not upgraded, a server without CEL); an update must keep the instance template of what runs: the ``running`` pods' (the group's pods,
    when they carry their template; a field their template does not name, the old spec's), else
    the old spec's (when it was valid: a spec that never was is not what runs)."""
    if deleting or not spec_changes(operation, old_raw, new_raw):
        return []
    new, errors = parse_spec(new_raw or {}, name)
    if operation != "UPDATE" or new is None:
        return errors
    old, old_errors = parse_spec(old_raw or {}, name)
    valid_old = old if old is not None and not old_errors else None
    running = tuple(running)
    if _stamped(running):
        return errors + [
            _immutable(p, was, now) for p, was, now, _ in _running_changes(new, running, valid_old)
        ]
    if valid_old is not None:
        errors += validate_update(valid_old, new)
    return errors


def with_decode_replicas(spec_raw: Mapping[str, Any], replicas: Any) -> dict[str, Any]:
    """The spec a write of the scale subresource makes: ``replicas`` (the Scale's
    ``spec.replicas``) at the CRD's ``specReplicasPath``, ``spec.decode.replicas``."""
    scaled = copy.deepcopy(dict(spec_raw))
    scaled["decode"] = {**(scaled.get("decode") or {}), "replicas": replicas}
    return scaled
