"""The status models (``matrixserve.api.status``) are the CRD's status, and what they write is
what the planner wrote before them.

- Field by field against ``crds/``: every model field is a property of the status schema with a
  compatible type (the type the field is written as: a split and a time are strings), and every
  property of the schema is a field; where the CRD keeps unknown fields, any object will do.
- Statuses the planner wrote before the models (``tests/fixtures/pdgroup_statuses.json``: a group
  under the Feedback policy judging a move, a recovery under way, the last scale) read and dump
  as they were, and as the API server stores them.
- Statuses the planner writes now survive the API server's form (empty strings and nulls left
  out, whole floats given back as integers): read back, they dump the same, and the reconciler
  would patch nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_ratio_load import policy_spec
from test_recovery_planner import die, group_view, serving

from matrixserve.adapters.kube import as_stored, status_patch
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import RatioMode
from matrixserve.api.status import ExpertPoolStatus, PDGroupStatus, RatioStatus, Split
from matrixserve.domain import pdgroup
from ratio_plant import Driven, Plant
from testkit.helpers import CRDS, load

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pdgroup_statuses.json"
WRITTEN: dict[str, dict[str, Any]] = json.loads(FIXTURES.read_text())


def status_schema() -> dict[str, Any]:
    crd = load(CRDS / "matrixserve.io_pdgroups.yaml")
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(schema["properties"]["status"])


def model_schema() -> dict[str, Any]:
    """The status as the models write it (JSON schema of their serialized form)."""
    return PDGroupStatus.model_json_schema(mode="serialization", by_alias=True)


def resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The node with its ``$ref`` followed and an optional's ``null`` left out."""
    while True:
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        elif "anyOf" in node:
            kinds = [n for n in node["anyOf"] if n.get("type") != "null"]
            types = {n.get("type") for n in kinds}
            if types == {"integer", "number"}:  # a number as it reads (int | float)
                return {"type": "number"}
            assert len(kinds) == 1, node
            node = kinds[0]
        else:
            return node


def compare(
    crd: dict[str, Any], model: dict[str, Any], defs: dict[str, Any], where: str
) -> list[str]:
    """How a model node (JSON schema) disagrees with the CRD's node."""
    model = resolve(model, defs)
    want, got = crd.get("type"), model.get("type")
    if want == "number" and got in ("number", "integer"):
        return []
    if want != got:
        return [f"{where}: {want} in the CRD, {got} in the model"]
    if want == "array":
        return compare(crd["items"], model.get("items", {}), defs, f"{where}[]")
    if want != "object":
        return []
    if crd.get("x-kubernetes-preserve-unknown-fields") and "properties" not in crd:
        return []  # any object: the operator's own state, of whichever version wrote it
    if isinstance(crd.get("additionalProperties"), dict):
        values = model.get("additionalProperties")
        if not isinstance(values, dict):
            return [f"{where}: a map in the CRD, not in the model"]
        return compare(crd["additionalProperties"], values, defs, f"{where}{{}}")
    props, fields = crd.get("properties", {}), model.get("properties", {})
    problems = [f"{where}.{n}: in the CRD, not in the model" for n in props.keys() - fields.keys()]
    problems += [f"{where}.{n}: in the model, not in the CRD" for n in fields.keys() - props.keys()]
    for name in sorted(props.keys() & fields.keys()):
        problems += compare(props[name], fields[name], defs, f"{where}.{name}")
    return problems


def test_the_models_are_the_crds_status_field_by_field() -> None:
    schema = model_schema()
    assert compare(status_schema(), schema, schema.get("$defs", {}), "status") == []


def test_the_comparison_sees_a_field_the_crd_lacks_and_a_wrong_type() -> None:
    """The check above can fail: a renamed field and a number where a string is stored."""
    schema = model_schema()
    defs = schema.get("$defs", {})
    crd = status_schema()
    renamed = json.loads(json.dumps(crd))
    renamed["properties"]["ratio"]["properties"]["lastChange"] = renamed["properties"]["ratio"][
        "properties"
    ].pop("lastChangeTime")
    assert compare(renamed, schema, defs, "status") == [
        "status.ratio.lastChange: in the CRD, not in the model",
        "status.ratio.lastChangeTime: in the model, not in the CRD",
    ]
    retyped = json.loads(json.dumps(crd))
    retyped["properties"]["ratio"]["properties"]["target"] = {"type": "integer"}
    assert compare(retyped, schema, defs, "status") == [
        "status.ratio.target: integer in the CRD, string in the model"
    ]


def without_nested_nulls(value: Any, top: bool = True) -> Any:
    """What the planner wrote, less the nulls below the top (a null there deletes a key the
    new status does not have either; at the top it deletes the stored key)."""
    if isinstance(value, dict):
        return {k: without_nested_nulls(v, False) for k, v in value.items() if top or v is not None}
    if isinstance(value, list):
        return [without_nested_nulls(v, False) for v in value]
    return value


def as_the_server_returns(value: Any) -> Any:
    """The API server's JSON: no empty strings or nulls, and a whole float read back as an
    integer."""
    if isinstance(value, dict):
        return {k: as_the_server_returns(v) for k, v in as_stored(value).items()}
    if isinstance(value, list):
        return [as_the_server_returns(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_status_the_planner_wrote_before_the_models_reads_and_dumps_as_it_was(name: str) -> None:
    written = WRITTEN[name]
    status = PDGroupStatus.read(written)
    assert status.dump() == without_nested_nulls(written)
    stored = as_the_server_returns(written)
    again = PDGroupStatus.read(stored)
    assert as_the_server_returns(again.dump()) == stored
    assert status_patch(stored, again.dump()) == {}


def planned() -> dict[str, pdgroup.Plan]:
    """Three passes of today's planner: Feedback judging a move, a recovery, a warm scale."""
    plant = Plant(prompt=6000, output=40, decode_batch=32)
    run = Driven(policy_spec(Split(4, 4), "Feedback", 32), Split(4, 4), plant.window)
    for _ in range(100):
        run.step(8.0)
        if run.status is not None and run.status.feedback and run.status.feedback.moving:
            break
    feedback = pdgroup.plan(run.view())
    recovery = pdgroup.plan(group_view(serving(**{"g-d-0": die("g-d-0")})))
    return {"feedback": feedback, "recovery": recovery}


def test_what_the_planner_writes_now_survives_the_api_server() -> None:
    plans = planned()
    for name, plan in plans.items():
        written = plan.status.dump()
        stored = as_the_server_returns(written)
        again = PDGroupStatus.read(stored)
        assert as_the_server_returns(again.dump()) == stored, name
        assert status_patch(stored, again.dump()) == {}, name
    # typed on the way back: the split, the policy, the times, the feedback's move
    ratio = PDGroupStatus.read(as_the_server_returns(plans["feedback"].status.dump())).ratio
    assert isinstance(ratio, RatioStatus)
    assert ratio.policy is RatioMode.FEEDBACK
    said = plans["feedback"].status.ratio
    assert said is not None
    assert ratio.target == said.target
    assert isinstance(ratio.target, Split)
    assert ratio.last_change_time is not None
    assert ratio.feedback is not None
    assert ratio.feedback.moving in ("prefill", "decode")
    assert isinstance(ratio.window.prefill if ratio.window else None, zl.Load)
    (record,) = PDGroupStatus.read(plans["recovery"].status.dump()).recovering or []
    assert (record.action, record.faulty) == ("Replace", ["g-d-0"])


def test_a_shape_an_older_operator_left_reads_as_absent_not_as_an_error() -> None:
    stored = {
        "ratio": {
            "policy": "Sideways",
            "target": "3",
            "lastChangeTime": "yesterday",
            "window": "not an object",
            "feedback": {"moving": "sideways", "calm": -1, "trend": [1, 2]},
            "history": {"measured": ["x", {"split": "2:2", "at": "now"}], "mix": 3},
        },
        "lastScale": {"instance": "g-p-1", "from": "an older operator"},
    }
    status = PDGroupStatus.read(stored)
    ratio = status.ratio
    assert ratio is not None
    assert (ratio.policy, ratio.target, ratio.last_change_time, ratio.window) == (None,) * 4
    assert ratio.feedback is not None
    assert (ratio.feedback.moving, ratio.feedback.calm, ratio.feedback.trend) == (None,) * 3
    assert ratio.history is not None
    assert ratio.history.mix is None
    assert [(m.split, m.at) for m in ratio.history.measured or []] == [(Split(2, 2), None)]
    # a record the operator keeps carries what it does not know
    assert status.dump()["lastScale"] == {"instance": "g-p-1", "from": "an older operator"}


def test_a_top_level_field_set_to_none_is_written_as_null_one_not_set_is_not_written() -> None:
    assert PDGroupStatus(last_recovery=None, deferred=[]).dump() == {
        "lastRecovery": None,
        "deferred": [],
    }
    assert PDGroupStatus.read({"deferred": []}).dump() == {"deferred": []}


DOMAIN = Path(__file__).resolve().parents[2] / "operator" / "matrixserve" / "domain"
BY_KEY = ("previous.get(", "previous[", "status.get(", "status[", ".ratio.get(", ".ratio[")


def test_the_pdgroup_domain_reads_statuses_by_field_not_by_key() -> None:
    """The models can be read by key (as a status from the API server is, in tests and tools);
    the planner reads their fields, which mypy checks."""
    found = [
        f"{path.relative_to(DOMAIN)}:{n}: {line.strip()}"
        for folder in ("pdgroup", "ratio")
        for path in sorted((DOMAIN / folder).glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(key in line for key in BY_KEY)
    ]
    assert found == []


def test_an_expert_pools_times_are_stored_as_rfc3339_and_read_back_as_epoch_seconds() -> None:
    """Kubernetes' convention (and PDGroup's): times in a status are RFC 3339 strings, with
    microseconds (the autoscaler's rate is a difference of them); what an older operator
    stored (epoch seconds) still reads."""
    at = 1796291601.778466
    status = ExpertPoolStatus.model_validate(
        {
            "lastFailover": {"servers": ["s2"], "at": at, "restoredAt": at + 5.182},
            "lastScale": {"from": 6, "to": 5, "by": "spec", "at": at},
            "tokenSample": {"at": at, "tokens": {"s0": 7}},
            "lastRebalance": {"at": at, "reason": "imbalance"},
            "rebalanceCheckedAt": at,
        }
    )
    stored = status.dump()
    assert stored["lastFailover"]["at"] == "2026-12-03T09:53:21.778466Z"
    assert stored["lastFailover"]["restoredAt"] == "2026-12-03T09:53:26.960466Z"
    for part in ("lastScale", "tokenSample", "lastRebalance"):
        assert stored[part]["at"] == "2026-12-03T09:53:21.778466Z", part
    assert stored["rebalanceCheckedAt"] == "2026-12-03T09:53:21.778466Z"
    again = ExpertPoolStatus.read(stored)
    assert again.last_failover is not None
    assert again.last_failover.at == pytest.approx(at, abs=1e-6)
    assert again.token_sample is not None
    assert again.token_sample.at == pytest.approx(at, abs=1e-6)
    assert again.dump() == stored
