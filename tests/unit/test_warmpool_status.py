"""WarmPool's status model is the CRD's status schema: every field in both (the API server prunes
a field its schema does not name: written, then silently lost), of compatible types, and what a
pass writes reads back as the same model."""

from __future__ import annotations

import copy
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel
from test_crd_models import compare, model_fields

from matrixserve.api.status import WarmPoolStatus
from testkit.helpers import CRDS, load

pytestmark = pytest.mark.unit
SCALARS = {int: "integer", str: "string", float: "number", bool: "boolean"}


def status_schema() -> dict[str, Any]:
    crd = load(CRDS / "matrixserve.io_warmpools.yaml")
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(schema["properties"]["status"])


def type_problems(schema: dict[str, Any], annotation: Any, where: str) -> list[str]:
    """Where the model's type (``annotation``, None allowed: an absent field) cannot hold what
    the schema's type says, or holds what it does not."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if len(args) != 1:
            return [f"{where}: {annotation} is no one type"]
        annotation = args[0]
    kind = schema.get("type")
    if typing.get_origin(annotation) is typing.Literal:
        values = set(typing.get_args(annotation))
        if kind != "string" or set(schema.get("enum", ())) != values:
            return [
                f"{where}: {sorted(values)} in the model, {kind} {schema.get('enum')} in the CRD"
            ]
        return []
    if typing.get_origin(annotation) is list:
        if kind != "array":
            return [f"{where}: a list in the model, {kind} in the CRD"]
        (item,) = typing.get_args(annotation)
        return type_problems(schema["items"], item, f"{where}[]")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if kind != "object":
            return [f"{where}: a model in the model, {kind} in the CRD"]
        fields = model_fields(annotation)
        return [
            problem
            for name, sub in schema.get("properties", {}).items()
            if name in fields
            for problem in type_problems(sub, fields[name].annotation, f"{where}.{name}")
        ]
    if SCALARS.get(annotation) != kind:
        return [f"{where}: {annotation} in the model, {kind} in the CRD"]
    return []


def test_the_status_model_has_every_field_of_the_crds_status_and_no_other() -> None:
    assert compare(status_schema(), WarmPoolStatus, "WarmPool.status") == []


def test_the_status_models_types_are_the_crds() -> None:
    assert type_problems(status_schema(), WarmPoolStatus, "status") == []


def test_the_comparisons_catch_a_drift() -> None:
    schema = status_schema()
    drifted = copy.deepcopy(schema)
    drifted["properties"]["shapes"]["items"]["properties"]["ready"]["type"] = "string"
    drifted["properties"]["conditions"]["items"]["properties"]["status"]["enum"].append("Maybe")
    assert type_problems(drifted, WarmPoolStatus, "status") == [
        "status.conditions[].status: ['False', 'True', 'Unknown'] in the model, "
        "string ['True', 'False', 'Unknown', 'Maybe'] in the CRD",
        "status.shapes[].ready: <class 'int'> in the model, string in the CRD",
    ]
    del drifted["properties"]["dram"]["items"]["properties"]["loaded"]
    assert compare(drifted, WarmPoolStatus, "status") == [
        "status.dram.loaded: in WarmDramStatus, not in the CRD"
    ]


def test_a_written_status_reads_back_as_the_same_model() -> None:
    stored = {
        "observedGeneration": 3,
        "ready": 1,
        "warming": 1,
        "claimed": 2,
        "forksDone": 1,
        "shapes": [
            {
                "name": "two",
                "size": 2,
                "npuType": "Ascend910C",
                "devicesPerPod": 2,
                "ready": 1,
                "warming": 1,
                "claimed": 2,
            }
        ],
        "filledGeneration": 3,
        "hitRatePercent": 50,
        "dram": [
            {
                "node": "n1",
                "models": ["llama3-8b"],
                "loaded": [],
                "bytes": 16_000_000_000,
                "capacityBytes": 1_500_000_000_000,
            }
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "Warming",
                "message": "1 of 2 warm pods ready, the rest warming",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
                "observedGeneration": 3,
            }
        ],
    }
    status = WarmPoolStatus.model_validate(stored)
    assert status.dump() == stored
    assert status.shapes[0].npu_type == "Ascend910C"
    assert status["filledGeneration"] == 3
    assert WarmPoolStatus().dump() == {
        "ready": 0,
        "warming": 0,
        "claimed": 0,
        "forksDone": 0,
        "shapes": [],
        "dram": [],
    }
