"""The CRDs are the contract: they install on the real API server, the pydantic models agree with
them field by field, and every sample is accepted by both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from pydantic import BaseModel

from matrixserve.api.resources import SPECS

CRDS = Path(__file__).resolve().parents[2] / "crds"


def crd_files() -> list[Path]:
    return sorted(CRDS.glob("matrixserve.io_*.yaml"))


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    version = crd["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def model_fields(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def nested_model(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        for inner in getattr(candidate, "__args__", ()):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def compare(schema: dict[str, Any], model: type[BaseModel], where: str) -> list[str]:
    problems = []
    props = schema.get("properties", {})
    fields = model_fields(model)
    for name in props.keys() - fields.keys():
        problems.append(f"{where}.{name}: in the CRD, not in {model.__name__}")
    for name in fields.keys() - props.keys():
        problems.append(f"{where}.{name}: in {model.__name__}, not in the CRD")
    required = set(schema.get("required", []))
    for name in props.keys() & fields.keys():
        field = fields[name]
        if (name in required) != field.is_required():
            problems.append(f"{where}.{name}: required in one, optional in the other")
        sub = props[name]
        if sub.get("type") == "array":
            sub = sub["items"]
        inner = nested_model(field.annotation)
        if sub.get("type") == "object" and "properties" in sub:
            if inner is None:
                problems.append(f"{where}.{name}: an object in the CRD, not a model")
            else:
                problems += compare(sub, inner, f"{where}.{name}")
        if (
            "default" in sub
            and field.default != sub["default"]
            and getattr(field.default, "value", None) != sub["default"]
        ):
            problems.append(
                f"{where}.{name}: default {sub['default']!r} in the CRD, {field.default!r} in the model"
            )
    return problems


@pytest.mark.parametrize("path", crd_files(), ids=lambda p: p.stem)
def test_models_agree_with_the_crd_field_by_field(path: Path) -> None:
    crd = load(path)
    kind = crd["spec"]["names"]["kind"]
    assert compare(spec_schema(crd), SPECS[kind], kind) == []


def test_the_comparison_catches_a_drift() -> None:
    crd = load(CRDS / "matrixserve.io_pdgroups.yaml")
    schema = spec_schema(crd)
    schema["properties"]["model"]["properties"]["quantization"] = {"type": "string"}
    del schema["properties"]["slo"]
    problems = compare(schema, SPECS["PDGroup"], "PDGroup")
    assert "PDGroup.model.quantization: in the CRD, not in ModelSpec" in problems
    assert "PDGroup.slo: in PDGroupSpec, not in the CRD" in problems


@pytest.mark.parametrize("sample", sorted((CRDS / "samples").glob("*.yaml")), ids=lambda p: p.stem)
def test_samples_are_accepted_by_the_api_server_and_the_models(
    api_client: client.ApiClient, crds_installed: list[str], namespace: str, sample: Path
) -> None:
    body = load(sample)
    kind = body["kind"]
    plural = {
        "PDGroup": "pdgroups",
        "DPDomain": "dpdomains",
        "ExpertPool": "expertpools",
        "WarmPool": "warmpools",
    }[kind]
    custom = client.CustomObjectsApi(api_client)
    created = custom.create_namespaced_custom_object(
        "matrixserve.io", "v1alpha1", namespace, plural, body
    )
    # The API server applied the schema's defaults; the model must accept what it stored.
    SPECS[kind].model_validate(created["spec"])
    if kind == "PDGroup":
        assert created["spec"]["prefill"]["podsPerInstance"] == 1  # defaulted by the schema
        assert created["spec"]["ratioPolicy"]["cooldownSeconds"] == 300


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"spec": {"prefill": {"replicas": -1}}}, "spec.prefill.replicas"),
        ({"spec": {"ratioPolicy": {"mode": "Sometimes"}}}, 'Unsupported value: "Sometimes"'),
        ({"spec": {"service": "Not A DNS Name"}}, "spec.service"),
        ({"spec": {"decode": {"podsPerInstance": 2}}}, "spec.decode.podsPerInstance"),
        ({"spec": {"slo": {"ttftMillisecondsPer1kTokens": -5}}}, "ttftMillisecondsPer1kTokens"),
    ],
)
def test_schema_rejects_bad_pdgroups_with_the_api_servers_message(
    api_client: client.ApiClient,
    crds_installed: list[str],
    namespace: str,
    patch: dict[str, Any],
    message: str,
) -> None:
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    for key, value in patch["spec"].items():
        if isinstance(value, dict):
            body["spec"][key] = {**body["spec"].get(key, {}), **value}
        else:
            body["spec"][key] = value
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as rejected:
        custom.create_namespaced_custom_object(
            "matrixserve.io", "v1alpha1", namespace, "pdgroups", body
        )
    assert rejected.value.status == 422
    assert message in json.loads(rejected.value.body)["message"]
