"""Engine pods run with least privilege and CPU/memory from their group's spec (issue 16,
finding 8): the security context, the resources and their defaults, the quantities and the
limit-versus-request rule through the validation path the webhook and the reconciler share, and
``resources`` as part of the immutable instance template."""

from __future__ import annotations

import copy
import json
import re
from decimal import Decimal
from typing import Any

import pytest

from enginestub.node import podspec
from enginestub.node.state import DEFAULT_IMAGE_MAP
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import QUANTITY_PATTERN, PDGroupSpec, quantity_value
from matrixserve.domain.enginepod import (
    DEFAULT_LIMITS,
    DEFAULT_REQUESTS,
    ENGINE_UID,
    TMP_SIZE_LIMIT,
    EngineSettings,
)
from matrixserve.domain.observed import PodView
from matrixserve.domain.pdgroup.pods import pod_labels, pod_manifest, role_label
from matrixserve.domain.pdgroup.validation import (
    ANNOTATION_TEMPLATE,
    NOT_ROLLED_OUT,
    admit,
    parse_spec,
    running_template_changes,
    stamp,
    validate_update,
)
from testkit.helpers import CRDS, load

P, D = zl.Role.PREFILL, zl.Role.DECODE
SETTINGS = EngineSettings(zookeeper="127.0.0.1:2181")


def raw(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A valid 2P1D spec; ``prefill`` / ``decode`` as the roles' ``resources`` when given."""
    spec: dict[str, Any] = {
        "service": "chat",
        "scenario": "general",
        "model": {"name": "llama3-8b"},
        "prefill": {"replicas": 2},
        "decode": {"replicas": 1},
    }
    for role, resources in (("prefill", prefill), ("decode", decode)):
        if resources is not None:
            spec[role]["resources"] = resources
    return spec


def spec_of(body: dict[str, Any]) -> PDGroupSpec:
    parsed, errors = parse_spec(body, "g")
    assert errors == []
    assert parsed is not None
    return parsed


def engine(spec: PDGroupSpec, role: zl.Role) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and the engine container the operator creates for ``role``."""
    manifest = pod_manifest("ns", "g", "uid-g", "g-x-0", role, spec, SETTINGS)
    (container,) = manifest["spec"]["containers"]
    return manifest["spec"], container


# --------------------------------------------------------------------------- security context
@pytest.mark.parametrize("role", [P, D])
def test_engine_pods_run_unprivileged_as_the_images_non_root_user(role: zl.Role) -> None:
    pod, container = engine(spec_of(raw()), role)
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_UID,
        "fsGroup": ENGINE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    ctx = container["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["privileged"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["runAsNonRoot"] is True
    # Engines never call the Kubernetes API, and write only their /tmp, a small emptyDir.
    assert pod["automountServiceAccountToken"] is False
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}]
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert quantity_value(TMP_SIZE_LIMIT) == 64 * 2**20
    for host_namespace in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host_namespace)


def test_the_engine_uid_is_the_engine_images_user() -> None:
    dockerfile = (CRDS.parent / "Dockerfile").read_text()
    assert f"useradd --uid {ENGINE_UID}" in dockerfile
    assert re.search(rf"^USER {ENGINE_UID}\b", dockerfile, re.MULTILINE)


def test_the_node_emulator_runs_the_hardened_pod_as_it_is() -> None:
    """The local cluster's emulator accepts the new fields (and does not enforce them: it runs
    processes as its own user): the engine's command, env and probes are planned as before, and
    CPU and memory beside the NPUs do not change the NPUs it allocates."""
    spec = spec_of(raw(decode={"requests": {"cpu": "2", "memory": "1Gi"}}))
    manifest = pod_manifest("ns", "g", "uid-g", "g-d-0", D, spec, SETTINGS)
    manifest["status"] = {"podIP": "127.1.2.3"}
    (plan,) = podspec.plan_containers(manifest, DEFAULT_IMAGE_MAP, lambda kind, name: None, {})
    assert plan.argv == tuple(DEFAULT_IMAGE_MAP["matrixserve/engine-stub"])
    assert plan.env["POD_IP"] == "127.1.2.3"
    assert plan.readiness is not None
    assert plan.readiness.path == "/readyz"
    assert podspec.npu_request(manifest) == 2


# --------------------------------------------------------------------------- resources
@pytest.mark.parametrize("role", [P, D])
def test_without_resources_an_engine_gets_the_defaults_beside_its_npus(role: zl.Role) -> None:
    _, container = engine(spec_of(raw()), role)
    npus = {kinds.NPU_RESOURCE: "2"}
    assert container["resources"] == {
        "requests": {**DEFAULT_REQUESTS, **npus},
        "limits": {**DEFAULT_LIMITS, **npus},
    }
    # Burstable, not BestEffort: every default request is within its limit and more than 0.
    for name in ("cpu", "memory"):
        assert 0 < quantity_value(DEFAULT_REQUESTS[name]) <= quantity_value(DEFAULT_LIMITS[name])


def test_each_role_gets_the_resources_its_spec_gives() -> None:
    prefill = {"requests": {"cpu": 4, "memory": "8Gi"}, "limits": {"cpu": "6", "memory": "12Gi"}}
    decode = {"requests": {"cpu": "1500m", "memory": "2Gi"}, "limits": {"cpu": 2, "memory": "2Gi"}}
    spec = spec_of(raw(prefill, decode))
    _, p = engine(spec, P)
    _, d = engine(spec, D)
    npus = {kinds.NPU_RESOURCE: "2"}
    assert p["resources"]["requests"] == {"cpu": "4", "memory": "8Gi", **npus}
    assert p["resources"]["limits"] == {"cpu": "6", "memory": "12Gi", **npus}
    assert d["resources"]["requests"] == {"cpu": "1500m", "memory": "2Gi", **npus}
    assert d["resources"]["limits"] == {"cpu": "2", "memory": "2Gi", **npus}


@pytest.mark.parametrize(
    ("given", "requests", "limits"),
    [
        # A request above the default limit raises the limit to it ...
        ({"requests": {"cpu": "8", "memory": "16Gi"}}, {"cpu": "8", "memory": "16Gi"},
         {"cpu": "8", "memory": "16Gi"}),
        # ... one below keeps the default limit.
        ({"requests": {"cpu": "500m"}}, {"cpu": "500m", "memory": DEFAULT_REQUESTS["memory"]},
         DEFAULT_LIMITS),
        # A limit below the default request lowers the request to it ...
        ({"limits": {"cpu": "100m", "memory": "128Mi"}}, {"cpu": "100m", "memory": "128Mi"},
         {"cpu": "100m", "memory": "128Mi"}),
        # ... one above keeps the default request.
        ({"limits": {"memory": "64Gi"}}, DEFAULT_REQUESTS,
         {"cpu": DEFAULT_LIMITS["cpu"], "memory": "64Gi"}),
        ({}, DEFAULT_REQUESTS, DEFAULT_LIMITS),
    ],
)  # fmt: skip
def test_what_is_left_out_is_defaulted_to_fit_what_is_given(
    given: dict[str, Any], requests: dict[str, str], limits: dict[str, str]
) -> None:
    _, container = engine(spec_of(raw(decode=given)), D)
    resources = container["resources"]
    assert {k: v for k, v in resources["requests"].items() if k != kinds.NPU_RESOURCE} == requests
    assert {k: v for k, v in resources["limits"].items() if k != kinds.NPU_RESOURCE} == limits


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"requests": {"cpu": "1.5.3"}},
         "spec.decode.resources.requests.cpu: '1.5.3' is not a Kubernetes quantity"),
        ({"limits": {"memory": "4GB"}},
         "spec.decode.resources.limits.memory: '4GB' is not a Kubernetes quantity"),
        ({"limits": {"memory": "-1Gi"}},
         "spec.decode.resources.limits.memory: '-1Gi' is not a Kubernetes quantity"),
        ({"requests": {"memory": "0"}}, "spec.decode.resources.requests.memory: '0' must be more than 0"),
        ({"requests": {"cpu": 0}}, "spec.decode.resources.requests.cpu: '0' must be more than 0"),
        ({"requests": {"cpu": "0.0001"}},
         "spec.decode.resources.requests.cpu: '0.0001' is finer than 1m"),
        ({"limits": {"memory": "1.5"}},
         "spec.decode.resources.limits.memory: '1.5' is not a whole number of bytes"),
        ({"limits": {"cpu": True}}, "spec.decode.resources.limits.cpu: a quantity is a string"),
        ({"limits": {"cpu": [1]}}, "spec.decode.resources.limits.cpu: a quantity is a string"),
        ({"limits": {"cpu": -0.5}},
         "spec.decode.resources.limits.cpu: '-0.5' is not a Kubernetes quantity"),
        # Only CPU and memory: any other name is refused by name (the CRD keeps it for that).
        ({"limits": {"nvidia.com/gpu": "1"}},
         "spec.decode.resources.limits: nvidia.com/gpu is not a resource set here: only cpu and "
         "memory (NPUs come from devicesPerInstance)"),
        ({"requests": {"ephemeral-storage": "1Gi", "cpu": "1"}},
         "spec.decode.resources.requests: ephemeral-storage is not a resource set here"),
        ({"claims": [{"name": "x"}]}, "spec.decode.resources.claims: Extra inputs are not permitted"),
        # Bounded: more than one server has is a typo (the pod would stay Pending for ever), and
        # Kubernetes would silently cap what its quantities cannot hold.
        ({"limits": {"memory": "99999999999999999999E"}},
         "spec.decode.resources.limits.memory: '99999999999999999999E' is more than 16Ti"),
        ({"requests": {"memory": "17Ti"}}, "spec.decode.resources.requests.memory: '17Ti' is more than 16Ti"),
        ({"requests": {"cpu": "1025"}}, "spec.decode.resources.requests.cpu: '1025' is more than 1024"),
        ({"limits": {"cpu": 2048.0}}, "spec.decode.resources.limits.cpu: '2048.0' is more than 1024"),
        ({"limits": {"cpu": 1e20}},
         "spec.decode.resources.limits.cpu: '1e+20' is out of a Kubernetes quantity's range"),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}},
         "spec.decode.resources.limits.cpu: 1500m is below the request 2 (requests.cpu); "
         "a limit must be at least its request"),
        ({"requests": {"memory": "1Gi"}, "limits": {"memory": "1000Mi"}},
         "spec.decode.resources.limits.memory: 1000Mi is below the request 1Gi"),
    ],
)  # fmt: skip
def test_bad_resources_are_refused_with_the_field_named(
    resources: dict[str, Any], message: str
) -> None:
    _, errors = parse_spec(raw(decode=resources), "g")
    assert len(errors) == 1, errors
    assert errors[0].startswith(message), errors
    # The webhook refuses the create with the same message, and nothing else.
    assert admit("CREATE", None, raw(decode=resources), False, "g") == errors


@pytest.mark.parametrize(
    ("given", "written"),
    [
        # YAML and JSON numbers, as a Pod's resources take them (0.5 CPU is 500m).
        ({"cpu": 0.5, "memory": 1073741824}, {"cpu": "0.5", "memory": "1073741824"}),
        ({"cpu": 2, "memory": "1.5Gi"}, {"cpu": "2", "memory": "1.5Gi"}),
        # The bounds themselves: one server's worth at most.
        ({"cpu": "1024", "memory": "16Ti"}, {"cpu": "1024", "memory": "16Ti"}),
        ({"cpu": "1024000m", "memory": "17592186044416"},
         {"cpu": "1024000m", "memory": "17592186044416"}),
    ],
)  # fmt: skip
def test_quantities_as_numbers_and_up_to_the_bounds_are_valid(
    given: dict[str, Any], written: dict[str, str]
) -> None:
    _, container = engine(spec_of(raw(decode={"requests": given, "limits": given})), D)
    for kind in ("requests", "limits"):
        assert {k: v for k, v in container["resources"][kind].items() if k in written} == written


def test_equal_limits_and_requests_in_other_units_are_valid() -> None:
    same = {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "1000m", "memory": "1024Mi"},
    }
    assert parse_spec(raw(prefill=same), "g")[1] == []


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")), ("2", Decimal(2)), ("1Gi", Decimal(2**30)),
        ("1.5Gi", Decimal(3 * 2**29)), ("512Mi", Decimal(2**29)), ("1e3", Decimal(1000)),
        ("1E", Decimal(10**18)), ("2k", Decimal(2000)), ("250M", Decimal(250_000_000)),
        (".5", Decimal("0.5")), ("100n", Decimal("1e-7")),
    ],
)  # fmt: skip
def test_quantities_have_their_kubernetes_values(text: str, value: Decimal) -> None:
    assert quantity_value(text) == value


def test_the_crd_refuses_the_quantities_the_model_cannot_parse() -> None:
    """The API server (the CRD's pattern) and the models agree on what a quantity is. The CRD
    types no quantity: a number with a fraction (``cpu: 0.5``, which a Pod takes) passes, where
    int-or-string would refuse it; a string must match the pattern. ``resources`` and its
    ``requests`` and ``limits`` keep the keys they do not list, so that the operator refuses
    ``nvidia.com/gpu`` or ``ephemeral-storage`` by name rather than the API server pruning them
    without a word (tests/cluster/test_crd_contract.py: what the API server stores)."""
    crd = load(CRDS / "matrixserve.io_pdgroups.yaml")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for role in ("prefill", "decode"):
        resources = spec["properties"][role]["properties"]["resources"]
        assert resources["x-kubernetes-preserve-unknown-fields"] is True
        for kind in ("requests", "limits"):
            cpu_memory = resources["properties"][kind]
            assert cpu_memory["x-kubernetes-preserve-unknown-fields"] is True
            assert set(cpu_memory["properties"]) == {"cpu", "memory"}
            for name in ("cpu", "memory"):
                field = cpu_memory["properties"][name]
                assert "type" not in field
                assert "x-kubernetes-int-or-string" not in field
                assert field["x-kubernetes-preserve-unknown-fields"] is True
                assert field["pattern"] == QUANTITY_PATTERN
    pattern = re.compile(QUANTITY_PATTERN)
    for good in ("1", "500m", "1.5Gi", "1e3", "1E", ".5", "1.", "64Mi"):
        assert pattern.search(good), good
        quantity_value(good)
    for bad in ("-1", "+1", "1.5.3", "4GB", "1 Gi", "", "Gi", "1e", "1e1.5", "0x10"):
        assert not pattern.search(bad), bad
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            quantity_value(bad)


# --------------------------------------------------------------------------- immutable template
BIGGER = {"requests": {"cpu": "1", "memory": "1Gi"}}


def running_pod(name: str, role: zl.Role, stamped: str | None) -> PodView:
    annotations = {} if stamped is None else {ANNOTATION_TEMPLATE: stamped}
    labels = pod_labels("g", role, name)
    return PodView(
        name, f"uid-{name}", labels, "Running", True, False, "n1", "sp0", 0.0, annotations
    )


@pytest.mark.parametrize(
    ("before", "after"),
    [(None, BIGGER), (BIGGER, None), (BIGGER, {"requests": {"cpu": "2", "memory": "1Gi"}})],
)
def test_resources_are_part_of_the_immutable_instance_template(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> None:
    old, new = spec_of(raw(decode=before)), spec_of(raw(decode=after))
    (error,) = validate_update(old, new)
    assert error.startswith("spec.decode.resources"), error
    assert "on an existing group" in error
    assert "image, resources;" in error  # the refusal lists resources among the template
    # The pods carry them in their template, so the reconciler and the webhook see the change.
    pods = [running_pod("g-d-0", D, stamp(old, "decode"))]
    (running,) = running_template_changes(new, pods)
    assert running.startswith("spec.decode.resources")
    assert "the running pod g-d-0" in running
    refused = admit("UPDATE", raw(decode=before), raw(decode=after), False, "g", pods)
    assert len(refused) == 1, refused
    assert refused[0].startswith("spec.decode.resources"), refused
    # The other role's resources are its own: prefill pods do not mind a decode change.
    assert running_template_changes(new, [running_pod("g-p-0", P, stamp(old, "prefill"))]) == []


def test_the_pods_template_carries_the_resources_as_written() -> None:
    spec = spec_of(raw(decode={"limits": {"cpu": 2}}))
    manifest = pod_manifest("ns", "g", "uid-g", "g-d-0", D, spec, SETTINGS)
    template = json.loads(manifest["metadata"]["annotations"][ANNOTATION_TEMPLATE])
    assert template[role_label(D)]["resources"] == {
        "requests": {"cpu": None, "memory": None},
        "limits": {"cpu": "2", "memory": None},
    }


def test_a_group_made_before_resources_existed_refuses_adding_them() -> None:
    """A pod made before ``resources`` existed has no such field in its template, so the pod
    cannot say; the webhook compares the old spec with the new there instead (as without any
    template): adding ``resources`` is refused like any template change, not accepted and never
    applied. What the pods do name is still compared with them, and a spec that leaves the
    field as it was (a scale, a mutable field) still passes."""
    old = spec_of(raw())
    made_before = json.loads(stamp(old, "decode"))
    del made_before["decode"]["resources"]
    pods = [running_pod("g-d-0", D, json.dumps(made_before))]
    (refused,) = admit("UPDATE", raw(), raw(decode=BIGGER), False, "g", pods)
    assert refused.startswith(
        'spec.decode.resources: cannot change from null to {"limits": {"cpu": null, '
    ), refused
    assert refused.endswith(NOT_ROLLED_OUT)
    # Nothing else changed: admitted, and a spec that kept resources as they were too.
    scaled = copy.deepcopy(raw())
    scaled["decode"]["replicas"] = 3
    assert admit("UPDATE", raw(), scaled, False, "g", pods) == []
    kept = copy.deepcopy(raw(decode=BIGGER))
    kept["service"] = "other"
    assert admit("UPDATE", raw(decode=BIGGER), kept, False, "g", pods) == []
    # What the pod's template names is compared with the pod, not with the old spec.
    image = copy.deepcopy(raw())
    image["decode"]["image"] = "x:2"
    (changed,) = admit("UPDATE", image, image | {"scenario": "other"}, False, "g", pods)
    assert changed.startswith('spec.decode.image: cannot change from "matrixserve/engine-stub')
