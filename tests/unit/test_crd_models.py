"""The CRDs are the contract (pure half): the pydantic models agree with them field by field, the
API's names (``matrixserve.api.kinds``) are theirs, and every sample parses with the models. The
real API server's half is ``tests/cluster/test_crd_contract.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from matrixserve.api import kinds
from matrixserve.api.resources import SPECS
from testkit.helpers import CRDS, crd_files, load


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


@pytest.mark.parametrize("path", crd_files(), ids=lambda p: p.stem)
def test_the_api_names_are_the_crds(path: Path) -> None:
    crd = load(path)
    names = crd["spec"]["names"]
    kind = next(k for k in kinds.KINDS if k.kind == names["kind"])
    assert crd["spec"]["group"] == kinds.GROUP
    assert names["plural"] == kind.plural
    assert crd["metadata"]["name"] == kind.crd_name
    assert [v["name"] for v in crd["spec"]["versions"]] == [kinds.VERSION]
    assert {k.kind for k in kinds.KINDS} == {load(p)["spec"]["names"]["kind"] for p in crd_files()}


@pytest.mark.parametrize("sample", sorted((CRDS / "samples").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sample_parses_with_its_model(sample: Path) -> None:
    body = load(sample)
    assert body["apiVersion"] == kinds.API_VERSION
    SPECS[body["kind"]].model_validate(body["spec"])
