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

from matrixserve.api import kinds
from matrixserve.api.resources import SPECS
from matrixserve.devcluster import tools
from matrixserve.domain.pdgroup.validation import MAX_GROUP_NAME, parse_spec, schema_rules
from testkit.helpers import CRDS, load


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
        # defaulted by the schema where the sample leaves it out
        assert created["spec"]["prefill"]["podsPerInstance"] == body["spec"]["prefill"].get(
            "podsPerInstance", 1
        )
        assert created["spec"]["ratioPolicy"]["cooldownSeconds"] == 300


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"spec": {"prefill": {"replicas": -1}}}, "spec.prefill.replicas"),
        ({"spec": {"ratioPolicy": {"mode": "Sometimes"}}}, 'Unsupported value: "Sometimes"'),
        ({"spec": {"service": "Not A DNS Name"}}, "spec.service"),
        ({"spec": {"decode": {"podsPerInstance": 49}}}, "spec.decode.podsPerInstance"),
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
    the API server's error for a field the schema does not have, and stores nothing (server-side
    apply refuses it whatever ``--validate`` says); with ``--validate=warn`` the server's
    warning, and the object without the field (the role's ``batchSize`` at its default, as the
    user will see). (``create`` for the warning: a client-side apply of 512 KiB cannot keep its
    last-applied annotation, at most 256 KiB, whatever the schema.)"""
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    body["metadata"]["namespace"] = namespace
    del body["spec"]["prefill"]["batchSize"]  # meant to be set, by the typo
    body["spec"]["prefill"][field] = value
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump(body))
    name = body["metadata"]["name"]
    strict = run_tool("kubectl", "apply", "-f", str(path), check=False)
    assert strict.returncode != 0
    assert f'strict decoding error: unknown field "spec.prefill.{field}"' in strict.stderr, (
        strict.stderr
    )
    server_side = run_tool("kubectl", "apply", "--server-side", "-f", str(path), check=False)
    assert server_side.returncode != 0
    assert f".spec.prefill.{field}: field not declared in schema" in server_side.stderr, (
        server_side.stderr
    )
    pd = kinds.PDGROUP
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as missing:
        custom.get_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, name)
    assert missing.value.status == 404
    warned = run_tool("kubectl", "create", "--validate=warn", "-f", str(path))
    assert f'Warning: unknown field "spec.prefill.{field}"' in warned.stderr, warned.stderr
    stored = custom.get_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, name)
    assert field not in stored["spec"]["prefill"]
    assert stored["spec"]["prefill"]["batchSize"] == 8  # the schema's default


def _set(body: dict[str, Any], path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _refused(api_client: client.ApiClient, namespace: str, body: dict[str, Any]) -> str:
    """The API server's message refusing the create of ``body`` (422)."""
    pd = kinds.PDGROUP
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as rejected:
        custom.create_namespaced_custom_object(pd.group, pd.version, namespace, pd.plural, body)
    assert rejected.value.status == 422
    return str(json.loads(rejected.value.body)["message"])


# Each rule the CRD states in CEL (issue 30): a change that breaks it, and the field and the words
# the API server must refuse it with — the words ``schema_rules`` says them in (the reconciler's
# check of an object stored without the rule), so that the two cannot drift apart.
CEL_RULES = [
    # prefill and decode of different sizes: the KV mapping's preconditions (CloudMatrix-Infer
    # §4.3.3), each naming the field to change
    (
        {"spec.decode.devicesPerInstance": 4},
        "spec.decode.parallelism.tp",
        "8 does not divide the prefill's tp 4: a prefill and a decode of different sizes (4 and "
        "8 dies) pair by CloudMatrix-Infer §4.3.3's KV mapping, which needs prefill tp to be a "
        "multiple of decode tp",
    ),
    (
        {"spec.prefill.devicesPerInstance": 4, "spec.decode.parallelism": {"tp": 2}},
        "spec.decode.devicesPerInstance",
        "4 dies / decode tp 2 = dp 2 is not a multiple of prefill tp / decode tp = 4: a prefill "
        "and a decode of different sizes (8 and 4 dies) pair by CloudMatrix-Infer §4.3.3's KV "
        "mapping, which needs decode dp to be a multiple of that ratio",
    ),
    (
        {
            "spec.prefill.parallelism": {"tp": 2},
            "spec.decode.devicesPerInstance": 4,
            "spec.decode.parallelism": {"tp": 1},
        },
        "spec.prefill.parallelism.tp",
        "2 is not the prefill's 4 dies: a prefill and a decode of different sizes (4 and 8 dies) "
        "pair by CloudMatrix-Infer §4.3.3's KV mapping, which names prefill TP ranks only, so "
        "the prefill must be one TP group (leave tp out, or set it to 4)",
    ),
    (
        {"spec.prefill.devicesPerInstance": 16, "spec.decode.devicesPerInstance": 16},
        "spec.prefill.devicesPerInstance",
        "16 NPUs over 1 pod(s) are 16 per pod, more than a server has (8 NPUs); an instance runs "
        "one pod per server: set podsPerInstance to at least 2",
    ),
    (
        {"spec.prefill.podsPerInstance": 3},
        "spec.prefill.podsPerInstance",
        "3 pods cannot share 2 NPUs equally; an instance's pods have the same NPUs each",
    ),
    (
        {"spec.prefill.parallelism": {"tp": 3}},
        "spec.prefill.parallelism.tp",
        "3 does not divide the instance's 4 dies",
    ),
    (
        {"spec.prefill.replicas": 0},
        "spec.prefill.replicas",
        "0; a group needs at least 1 prefill (the prefills are the group's entrances: none takes "
        "requests); delete the group to stop it",
    ),
    (
        {"spec.decode.replicas": 0},
        "spec.decode.replicas",
        "0; a group needs at least 1 decode (every request's KV cache moves from a prefill to a "
        "decode); delete the group to stop it",
    ),
    (
        {"spec.decode.replicas": 200},
        "spec.decode.replicas",
        "400 decode NPUs cannot be placed in one SuperPod (384 NPUs); decode instances of a "
        "group stay inside one SuperPod",
    ),
    (
        {"spec.ratioPolicy.minPrefill": 3},
        "spec.prefill.replicas",
        "2 is below ratioPolicy.minPrefill 3",
    ),
    (
        {"spec.ratioPolicy.maxPrefill": 1},
        "spec.prefill.replicas",
        "2 is above ratioPolicy.maxPrefill 1",
    ),
    (
        {"spec.ratioPolicy.minDecode": 2},
        "spec.decode.replicas",
        "1 is below ratioPolicy.minDecode 2",
    ),
    (
        {"spec.decode.replicas": 3, "spec.ratioPolicy.maxDecode": 2},
        "spec.decode.replicas",
        "3 is above ratioPolicy.maxDecode 2",
    ),
    (
        {
            "spec.ratioPolicy.mode": "Model",
            "spec.ratioPolicy.minPrefill": 3,
            "spec.ratioPolicy.maxPrefill": 2,
        },
        "spec.ratioPolicy.minPrefill",
        "3 exceeds maxPrefill 2",
    ),
    (
        {
            "spec.ratioPolicy.mode": "Model",
            "spec.ratioPolicy.minDecode": 3,
            "spec.ratioPolicy.maxDecode": 1,
        },
        "spec.ratioPolicy.minDecode",
        "3 exceeds maxDecode 1",
    ),
    (
        {
            "spec.ratioPolicy.mode": "Model",
            "spec.ratioPolicy.minRatio": 2.5,
            "spec.ratioPolicy.maxRatio": 1.5,
        },
        "spec.ratioPolicy.minRatio",
        "2.5 exceeds maxRatio 1.5",
    ),
    (
        {
            "spec.ratioPolicy.mode": "Model",
            "spec.ratioPolicy.minRatio": 2.0,
            "spec.ratioPolicy.maxRatio": 1,
        },
        "spec.ratioPolicy.minRatio",
        "2 exceeds maxRatio 1",
    ),
    (
        {"spec.moe": {"mode": "Disaggregated"}},
        "spec.moe",
        "Disaggregated needs expertPoolRef",
    ),
    (
        {
            "spec.moe": {
                "mode": "Disaggregated",
                "dpDomainRef": {"name": "d"},
                "expertPoolRef": {"name": "e"},
            }
        },
        "spec.moe.dpDomainRef",
        "DPDomain has no controller yet: remove it; the decodes are the expert pool's attention "
        "clients themselves",
    ),
    # fields accepted and read by nothing before, refused saying what works
    (
        {"spec.moe": {"mode": "Colocated"}},
        "spec.moe",
        "Colocated needs no spec.moe: remove it; an MoE model's experts then run inside each "
        "instance (parallelism.ep)",
    ),
    (
        {"spec.model.prefillArtifact": "s3://bucket/prefill.om"},
        "spec.model.prefillArtifact",
        "per-role compiled artefacts are not supported yet: every engine loads model.name and "
        "compiles it itself; remove the field",
    ),
    (
        {"spec.model.decodeArtifact": "s3://bucket/decode.om"},
        "spec.model.decodeArtifact",
        "per-role compiled artefacts are not supported yet: every engine loads model.name and "
        "compiles it itself; remove the field",
    ),
    (
        {"spec.decode.parallelism": {"tp": 2, "dp": 4}},
        "spec.decode.parallelism.dp",
        "4 is not what runs: an instance's data-parallel degree is its 4 dies / tp 2 = 2 (leave "
        "dp out, or set it to that)",
    ),
]


@pytest.mark.skipif(tools.legacy(), reason="CEL validation rules are 1.29+ (not on 1.20)")
@pytest.mark.parametrize(("changes", "field", "words"), CEL_RULES, ids=lambda v: str(v)[:40])
def test_each_cel_rule_is_the_api_servers_refusal_in_the_operators_words(
    api_client: client.ApiClient,
    crds_installed: list[str],
    namespace: str,
    changes: dict[str, object],
    field: str,
    words: str,
) -> None:
    """A create that breaks one of the CRD's CEL rules is refused by the API server itself (no
    webhook runs here), naming the field, in the words the operator's own check uses."""
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    for path, value in changes.items():
        _set(body, path, value)
    message = _refused(api_client, namespace, body)
    assert f"{field}: Invalid value: {words}" in message, message
    spec, _ = parse_spec(body["spec"], body["metadata"]["name"])
    assert spec is not None
    assert f"{field}: {words}" in schema_rules(spec, body["metadata"]["name"])


def test_a_name_too_long_is_refused_by_the_schema_and_the_reconciler(
    api_client: client.ApiClient, crds_installed: list[str], namespace: str
) -> None:
    """The name's rule is the schema's ``maxLength`` (a CEL rule at the root can read
    ``metadata.name`` but not point its error there): the API server's words, the reconciler's
    own for an object stored without it."""
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    body["metadata"]["name"] = "x" * (MAX_GROUP_NAME + 1)
    message = _refused(api_client, namespace, body)
    assert f"metadata.name: Too long: may not be more than {MAX_GROUP_NAME}" in message, message
    spec, _ = parse_spec(body["spec"], "x")
    assert spec is not None
    assert schema_rules(spec, body["metadata"]["name"])[0].startswith("metadata.name: at most")


def test_a_rule_only_the_operator_can_judge_passes_the_api_server(
    api_client: client.ApiClient, crds_installed: list[str], namespace: str
) -> None:
    """The webhook's rules are not in the CRD (no CEL rule duplicates them): with no webhook,
    a model whose weights do not fit is stored — for the reconciler to refuse (InvalidSpec)."""
    body = load(CRDS / "samples" / "pdgroup-2p1d.yaml")
    body["spec"]["model"]["name"] = "gpt3-175b"
    pd = kinds.PDGROUP
    custom = client.CustomObjectsApi(api_client)
    created = custom.create_namespaced_custom_object(
        pd.group, pd.version, namespace, pd.plural, body
    )
    _, errors = parse_spec(created["spec"], "chat-g0")
    assert any("of weights do not fit 2 NPUs" in e for e in errors), errors


@pytest.mark.skipif(tools.legacy(), reason="CEL validation rules are 1.29+ (not on 1.20)")
def test_a_warm_pool_refilled_on_a_schedule_is_refused_saying_what_works(
    api_client: client.ApiClient, crds_installed: list[str], namespace: str
) -> None:
    """Issue 31: ``refillPolicy: Scheduled`` was accepted and acted as Immediate. The API
    server refuses it, in the words the WarmPool controller's own check uses."""
    from matrixserve.api.resources import WarmPoolSpec
    from matrixserve.domain.warmpool.validation import problems

    body = load(CRDS / "samples" / "warmpool.yaml")
    body["spec"]["refillPolicy"] = "Scheduled"
    wp = kinds.WARMPOOL
    custom = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as rejected:
        custom.create_namespaced_custom_object(wp.group, wp.version, namespace, wp.plural, body)
    assert rejected.value.status == 422
    message = str(json.loads(rejected.value.body)["message"])
    words = (
        "Scheduled is not implemented (there is no schedule to refill by): use Immediate "
        "(refill at once) or Manual (refill on a new generation)"
    )
    assert f"spec.refillPolicy: Invalid value: {words}" in message, message
    spec = WarmPoolSpec.model_validate(body["spec"])
    assert f"spec.refillPolicy: {words}" in problems(body["metadata"]["name"], spec)
    body["spec"]["refillPolicy"] = "Manual"  # what works is accepted
    custom.create_namespaced_custom_object(wp.group, wp.version, namespace, wp.plural, body)
