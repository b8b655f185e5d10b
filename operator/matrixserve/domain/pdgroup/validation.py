"""Cross-field rules for a PDGroup that a schema cannot express on Kubernetes 1.20 (no CEL).

The validating admission webhook rejects a spec that breaks them; the reconciler checks them
again (Ready=False, reason InvalidSpec) and touches nothing. Pure: the hardware facts
(CloudMatrix384, 001 §3) and the model shapes come from the API's catalogue
(:mod:`matrixserve.api.catalog`), which the engine stub emulates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from matrixserve.api import catalog
from matrixserve.api.catalog import HBM_USABLE_FRACTION, PRESETS
from matrixserve.api.resources import MoEMode, PDGroupSpec, RoleSpec, field_errors

MAX_GROUP_NAME = 50  # pod names are <group>-p-<ordinal> and must stay within 63 characters


@dataclass(frozen=True)
class ModelFacts:
    weight_bytes: float
    kv_bytes_per_token: float


def model_facts(spec: PDGroupSpec) -> ModelFacts | None:
    m = spec.model
    preset = PRESETS.get(m.name)
    if preset is not None:
        weights = float(m.size_bytes) if m.size_bytes else preset.weight_bytes_total
        kv = float(m.kv_bytes_per_token) if m.kv_bytes_per_token else preset.kv_bytes_per_token
        return ModelFacts(weights, kv)
    if m.size_bytes and m.layers and m.hidden_size:
        kv = float(m.kv_bytes_per_token or 2 * m.hidden_size * 2 * m.layers)  # P/D-Serve §2.1
        return ModelFacts(float(m.size_bytes), kv)
    return None


def _role_rules(role: str, r: RoleSpec, facts: ModelFacts | None, context: int) -> list[str]:
    errors = []
    dies = r.devices_per_instance * catalog.DIES_PER_NPU
    if r.devices_per_instance > catalog.NPUS_PER_SERVER:
        errors.append(
            f"spec.{role}.devicesPerInstance: {r.devices_per_instance} NPUs do not fit one server "
            f"({catalog.NPUS_PER_SERVER} NPUs); an instance is one pod on one server"
        )
    tp = r.parallelism.tp
    if tp is not None and dies % tp:
        errors.append(
            f"spec.{role}.parallelism.tp: {tp} does not divide the instance's {dies} dies"
        )
    if facts is None:
        return errors
    usable = dies * catalog.DIE_HBM_BYTES * HBM_USABLE_FRACTION
    if facts.weight_bytes > usable:
        errors.append(
            f"spec.{role}.devicesPerInstance: {facts.weight_bytes / 1e9:.1f} GB of weights do not fit "
            f"{r.devices_per_instance} NPUs ({usable / 1e9:.1f} GB usable HBM)"
        )
        return errors
    kv_need = r.batch_size * context * facts.kv_bytes_per_token
    kv_room = usable - facts.weight_bytes
    if kv_need > kv_room:
        errors.append(
            f"spec.{role}.batchSize: {r.batch_size} requests x {context} tokens need "
            f"{kv_need / 1e9:.1f} GB of KV cache; {kv_room / 1e9:.1f} GB of HBM is left after the weights"
        )
    return errors


def validate_pdgroup(spec: PDGroupSpec, name: str) -> list[str]:
    """Every violation, each a message naming the field; empty when the spec is valid."""
    errors: list[str] = []
    if len(name) > MAX_GROUP_NAME:
        errors.append(
            f"metadata.name: at most {MAX_GROUP_NAME} characters (pod names derive from it)"
        )
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
    context = spec.model.max_context_tokens
    errors += _role_rules("prefill", spec.prefill, facts, context)
    errors += _role_rules("decode", spec.decode, facts, context)
    if spec.prefill.devices_per_instance != spec.decode.devices_per_instance:
        errors.append(
            "spec.decode.devicesPerInstance: KV moves device k -> device k (P/D-Serve §2.1), so prefill "
            f"and decode need the same devices per instance ({spec.prefill.devices_per_instance} vs "
            f"{spec.decode.devices_per_instance})"
        )
    superpod_npus = catalog.SERVERS_PER_SUPERPOD * catalog.NPUS_PER_SERVER
    decode_npus = spec.decode.replicas * spec.decode.devices_per_instance
    if decode_npus > superpod_npus:
        errors.append(
            f"spec.decode.replicas: {decode_npus} decode NPUs cannot be placed in one SuperPod "
            f"({superpod_npus} NPUs); decode instances of a group stay inside one SuperPod"
        )
    rp = spec.ratio_policy
    for role, lo, hi, n in (
        ("Prefill", rp.min_prefill, rp.max_prefill, spec.prefill.replicas),
        ("Decode", rp.min_decode, rp.max_decode, spec.decode.replicas),
    ):
        if lo is not None and hi is not None and lo > hi:
            errors.append(f"spec.ratioPolicy.min{role}: {lo} exceeds max{role} {hi}")
        if lo is not None and n < lo:
            errors.append(f"spec.{role.lower()}.replicas: {n} is below ratioPolicy.min{role} {lo}")
        if hi is not None and n > hi:
            errors.append(f"spec.{role.lower()}.replicas: {n} is above ratioPolicy.max{role} {hi}")
    moe = spec.moe
    if (
        moe is not None
        and moe.mode is MoEMode.DISAGGREGATED
        and (moe.dp_domain_ref is None or moe.expert_pool_ref is None)
    ):
        errors.append("spec.moe: Disaggregated needs dpDomainRef and expertPoolRef")
    return errors


def parse_spec(raw: Any, name: str) -> tuple[PDGroupSpec | None, list[str]]:
    """A PDGroup's spec parsed and checked: the spec (None if it does not parse) and every
    violation of the schema's and the cross-field rules, each naming its field."""
    try:
        parsed = PDGroupSpec.model_validate(dict(raw))
    except ValidationError as exc:
        return None, field_errors(exc)
    return parsed, validate_pdgroup(parsed, name)
