"""The CRDs are the contract (the real API server's half): every sample is accepted by the API
server and what it stored by the models, and the schema rejects bad objects with the server's
own message. The pure half is ``tests/unit/test_crd_models.py``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from helpers import CRDS, load
from matrixserve.api import kinds
from matrixserve.api.resources import SPECS
from matrixserve.devcluster import tools
from matrixserve.domain.pdgroup.validation import parse_spec


@pytest.mark.parametrize("sample", sorted((CRDS / "samples").glob("*.yaml")), ids=lambda p: p.stem)
def test_samples_are_accepted_by_the_api_server_and_the_models(
    api_client: client.ApiClient, crds_installed: list[str], namespace: str, sample: Path
) -> None:
    body = load(sample)
    kind = body["kind"]
    api = next(k for k in kinds.KINDS if k.kind == kind)
    custom = client.CustomObjectsApi(api_client)
    created = custom.create_namespaced_custom_object(
        api.group, api.version, namespace, api.plural, body
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
    pd = kinds.PDGROUP
    with pytest.raises(client.ApiException) as rejected:
        custom.create_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, body)
    assert rejected.value.status == 422
    assert message in json.loads(rejected.value.body)["message"]


def test_engine_resources_are_stored_as_written_for_the_models_to_judge(
    api_client: client.ApiClient, crds_installed: list[str], namespace: str
) -> None:
    """Issue 16 finding 8: quantities as numbers (``cpu: 0.5``, as a Pod takes them) pass the
    API server, and resource names the schema does not list are stored, not pruned without a
    word, so that the operator refuses them by name; a string that is no quantity is the API
    server's to refuse."""
    custom, pd = client.CustomObjectsApi(api_client), kinds.PDGROUP
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    resources = {
        "requests": {"cpu": 0.5, "memory": 536870912, "ephemeral-storage": "1Gi"},
        "limits": {"cpu": 2, "nvidia.com/gpu": 1},
    }
    body["spec"]["decode"]["resources"] = resources
    created = custom.create_namespaced_custom_object(
        pd.group, pd.version, namespace, pd.plural, body
    )
    assert created["spec"]["decode"]["resources"] == resources
    _, errors = parse_spec(created["spec"], "chat-g0")
    assert [e.split(" is not a resource")[0] for e in errors] == [
        "spec.decode.resources.requests: ephemeral-storage",
        "spec.decode.resources.limits: nvidia.com/gpu",
    ]
    body["metadata"]["name"] = "words"
    body["spec"]["decode"]["resources"] = {"requests": {"cpu": "half"}}
    with pytest.raises(client.ApiException) as rejected:
        custom.create_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, body)
    assert rejected.value.status == 422
    assert "spec.decode.resources.requests.cpu" in json.loads(rejected.value.body)["message"]


@pytest.mark.skipif(tools.legacy(), reason="server-side field validation is 1.25+ (not on 1.20)")
@pytest.mark.parametrize(
    ("field", "value"),
    [("batchsize", 64), ("notes", "x" * 512 * 1024)],
    ids=["a typo", "an unknown 512 KiB field"],
)
def test_an_unknown_field_is_the_servers_error_or_its_warning_not_pruned_in_silence(
    api_client: client.ApiClient,
    crds_installed: list[str],
    namespace: str,
    run_tool: Callable[..., subprocess.CompletedProcess[str]],
    tmp_path: Path,
    field: str,
    value: object,
) -> None:
    """Server-side field validation (issue 30): ``kubectl apply`` (strict, its default) gets
    the API server's error for a field the schema does not have, and stores nothing; with
    ``--validate=warn`` the server's warning, and the object without the field (the role's
    ``batchSize`` at its default, as the user will see)."""
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    body["metadata"]["namespace"] = namespace
    del body["spec"]["prefill"]["batchSize"]  # meant to be set, by the typo
    body["spec"]["prefill"][field] = value
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump(body))
    name = body["metadata"]["name"]
    strict = run_tool("kubectl", "apply", "-f", str(path), check=False)
    assert strict.returncode != 0
    assert f'unknown field "spec.prefill.{field}"' in strict.stderr, strict.stderr
    pd = kinds.PDGROUP
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as missing:
        custom.get_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, name)
    assert missing.value.status == 404
    warned = run_tool("kubectl", "apply", "--validate=warn", "-f", str(path))
    assert f'unknown field "spec.prefill.{field}"' in warned.stderr, warned.stderr
    stored = custom.get_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, name)
    assert field not in stored["spec"]["prefill"]
    assert stored["spec"]["prefill"]["batchSize"] == 8  # the schema's default
