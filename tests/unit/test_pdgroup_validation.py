"""Changing a PDGroup: what the webhook admits (create, update, the scale subresource; never a
metadata-only update or an object being deleted), the instance template that is immutable until
the operator rolls it out, the template each pod carries and the reconciler's check against it;
and the webhook handlers themselves with the Kubernetes adapter over a scripted API."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, cast

import kopf
import pytest
from kubernetes import client

from fakes import FakeCore, FakeCustom
from matrixserve.adapters.kube import KubeAdapter
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.adapters.pdgroup_metrics import PDGroupMetrics
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import PRESETS
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.roles import Role
from matrixserve.domain.effects import Event
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import PodView
from matrixserve.domain.pdgroup.pods import pod_labels, pod_manifest, role_label
from matrixserve.domain.pdgroup.validation import (
    ANNOTATION_TEMPLATE,
    admission_rules,
    admit,
    expert_pool_errors,
    held_weights,
    model_facts,
    parse_spec,
    running_template_changes,
    stamp,
    validate_pdgroup,
    validate_update,
    with_decode_replicas,
)
from matrixserve.handlers import kinds as registration
from matrixserve.handlers.pdgroup import PDGroups
from matrixserve.handlers.reconciler import Reconciler

P, D = zl.Role.PREFILL, zl.Role.DECODE
ROLLOUT = "the operator does not roll out changes to the instance template"


def raw(p: int = 2, d: int = 1) -> dict[str, Any]:
    return {
        "service": "chat",
        "scenario": "general",
        "model": {"name": "llama3-8b"},
        "prefill": {"replicas": p, "devicesPerInstance": 2},
        "decode": {"replicas": d, "devicesPerInstance": 2, "batchSize": 32},
    }


def changed(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (the default spec) with the field at dotted ``path`` set to ``value``."""
    out = copy.deepcopy(base if base is not None else raw())
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


def parsed(body: dict[str, Any]) -> PDGroupSpec:
    return PDGroupSpec.model_validate(body)


def pod(name: str, role: zl.Role, spec: PDGroupSpec | None, deleting: bool = False) -> PodView:
    """A running pod of group ``g``, stamped with ``spec``'s template (None: an older operator's
    pod, without the annotation)."""
    annotations = {} if spec is None else {ANNOTATION_TEMPLATE: stamp(spec, role_label(role))}
    labels = pod_labels("g", role, name)
    return PodView(
        name, f"uid-{name}", labels, "Running", True, deleting, "n1", "sp0", 0.0, annotations
    )


# --------------------------------------------------------------------------- create and update
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_group_needs_at_least_one_prefill_and_one_decode(role: str) -> None:
    (error,) = validate_pdgroup(parsed(changed(f"{role}.replicas", 0)), "g")
    assert error.startswith(f"spec.{role}.replicas: 0; a group needs at least 1 {role}")
    assert validate_pdgroup(parsed(changed(f"{role}.replicas", 1)), "g") == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("model.name", "deepseek-v3"),
        ("model.maxContextTokens", 8192),
        ("model.sizeBytes", 16_000_000_000),
        ("prefill.devicesPerInstance", 4),
        ("decode.devicesPerInstance", 4),
        ("decode.npuType", "Ascend910B"),
        ("prefill.parallelism", {"tp": 2}),
        ("decode.batchSize", 16),
        ("prefill.image", "matrixserve/engine-stub:0.2.0"),
        ("decode.image", "matrixserve/engine-stub:0.2.0"),
        ("moe", {"mode": "Colocated"}),
        ("slo.tpotMilliseconds", 40),  # the decodes' batch meets it (issue 31)
        ("warmPoolRef", {"name": "pool"}),
    ],
)
def test_the_instance_template_cannot_change_on_an_existing_group(path: str, value: Any) -> None:
    errors = validate_update(parsed(raw()), parsed(changed(path, value)))
    assert len(errors) == 1, errors  # model, moe and warmPoolRef: once, though in both templates
    assert errors[0].startswith(f"spec.{path}"), errors
    assert "cannot change from" in errors[0]
    assert "on an existing group" in errors[0]
    assert ROLLOUT in errors[0]


def test_the_changed_leaf_is_named_with_both_values() -> None:
    (error,) = validate_update(parsed(raw()), parsed(changed("decode.image", "x:2")))
    assert error.startswith(
        'spec.decode.image: cannot change from "matrixserve/engine-stub:0.1.0" to "x:2"'
    )
    (tp,) = validate_update(parsed(raw()), parsed(changed("prefill.parallelism", {"tp": 2})))
    assert tp.startswith("spec.prefill.parallelism.tp: cannot change from null to 2")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("prefill.replicas", 3),
        ("decode.replicas", 2),
        ("service", "other"),
        ("scenario", "coding"),
        ("slo", {"ttftMilliseconds": 500}),
        ("ratioPolicy", {"mode": "Feedback", "minDecode": 1}),
        ("recovery", {"policy": "RestartGroup"}),
        ("decode.batchSize", 32),  # as it was
        ("prefill.batchSize", 8),  # the default, now written out: not a change
    ],
)
def test_what_the_gateway_and_the_status_follow_stays_mutable(path: str, value: Any) -> None:
    assert validate_update(parsed(raw()), parsed(changed(path, value))) == []
    assert admit("UPDATE", raw(), changed(path, value), False, "g") == []


# --------------------------------------------------------------------------- the webhook's decision
def test_a_create_is_checked_by_every_rule() -> None:
    assert admit("CREATE", None, raw(), False, "g") == []
    errors = admit("CREATE", None, changed("decode.replicas", 0), False, "g")
    assert [e.split(":")[0] for e in errors] == ["spec.decode.replicas"]
    assert admit("CREATE", None, {"service": "chat"}, False, "g")  # no model, no roles: refused


def test_an_update_is_checked_by_every_rule_and_keeps_the_template() -> None:
    errors = admit("UPDATE", raw(), changed("prefill.replicas", 0), False, "g")
    assert errors[0].startswith("spec.prefill.replicas: 0;")
    errors = admit("UPDATE", raw(), changed("decode.batchSize", 16), False, "g")
    (error,) = errors
    assert error.startswith("spec.decode.batchSize: cannot change")
    # a template change that also breaks a rule: both reasons
    errors = admit("UPDATE", raw(), changed("decode.devicesPerInstance", 4), False, "g")
    assert any("CloudMatrix-Infer §4.3.3's KV mapping" in e for e in errors)
    assert any(e.startswith("spec.decode.devicesPerInstance: cannot change") for e in errors)


def test_metadata_only_updates_and_objects_being_deleted_are_never_refused() -> None:
    """An invalid object (stored while the webhook was off, or by a scale that slipped through)
    can always get its labels, its annotations, its finalizer removed, and be deleted."""
    invalid = changed("decode.replicas", 200)
    assert admit("CREATE", None, invalid, False, "g")  # refused as a spec
    assert admit("UPDATE", invalid, copy.deepcopy(invalid), False, "g") == []
    assert admit("UPDATE", invalid, changed("decode.image", "x:2", invalid), True, "g") == []
    assert admit("CREATE", None, invalid, True, "g") == []
    assert admit("DELETE", invalid, None, False, "g") == []


def test_an_invalid_object_can_be_fixed() -> None:
    invalid = changed("decode.replicas", 200)
    assert admit("UPDATE", invalid, raw(), False, "g") == []
    assert admit("UPDATE", invalid, changed("decode.replicas", 193), False, "g")  # 386 NPUs


def test_a_template_that_never_ran_is_checked_against_the_running_pods() -> None:
    """A spec stored while the webhook was off (a new image the pods do not run) can be set back
    to what the pods run, and not to a third template; with no stamped pod, an old spec that was
    itself invalid never ran, so only the new spec's own rules apply."""
    running = [pod("g-p-0", P, parsed(raw())), pod("g-d-0", D, parsed(raw()))]
    drifted = changed("decode.image", "x:2")
    assert admit("UPDATE", drifted, raw(), False, "g", running) == []
    (error,) = admit("UPDATE", drifted, changed("decode.image", "y:3"), False, "g", running)
    assert error.startswith(
        'spec.decode.image: cannot change from "matrixserve/engine-stub:0.1.0" to "y:3" on an '
        "existing group"
    )
    never_valid = changed("decode.devicesPerInstance", 4)
    assert admit("UPDATE", never_valid, raw(), False, "g") == []


def test_a_scale_applies_its_replicas_to_decode_and_is_checked_as_an_update() -> None:
    spec = raw()
    scaled = with_decode_replicas(spec, 200)
    assert scaled["decode"] == {**spec["decode"], "replicas": 200}
    assert spec["decode"]["replicas"] == 1, "the stored spec is not modified"
    (beyond,) = admit("UPDATE", spec, scaled, False, "g")
    assert beyond.startswith("spec.decode.replicas: 400 decode NPUs cannot be placed in one")
    (zero,) = admit("UPDATE", spec, with_decode_replicas(spec, 0), False, "g")
    assert zero.startswith("spec.decode.replicas: 0; a group needs at least 1 decode")
    assert admit("UPDATE", spec, with_decode_replicas(spec, 3), False, "g") == []
    assert admit("UPDATE", spec, with_decode_replicas(spec, 0), True, "g") == []  # deleting


# --------------------------------------------------------------------------- the pods' template
def test_each_pod_carries_the_template_of_its_role() -> None:
    spec = parsed(raw())
    settings = EngineSettings(zookeeper="127.0.0.1:2181")
    for role in (P, D):
        manifest = pod_manifest("ns", "g", "uid-g", "g-x-0", role, spec, settings)
        stamped = manifest["metadata"]["annotations"][ANNOTATION_TEMPLATE]
        assert stamped == stamp(spec, role_label(role))
        template = json.loads(stamped)
        assert set(template) == {"model", role_label(role), "moe", "slo", "warmPoolRef"}
        assert template["slo"] == {"tpotMilliseconds": None}  # the TTFT SLO is the gateway's
        assert "replicas" not in template[role_label(role)]
        assert template[role_label(role)]["image"] == manifest["spec"]["containers"][0]["image"]
    # Stable: equal specs, equal strings; replicas and the mutable fields do not enter it.
    other = parsed(
        changed("slo.ttftMilliseconds", 500, changed("service", "x", changed("decode.replicas", 5)))
    )
    assert stamp(other, "decode") == stamp(spec, "decode")
    assert stamp(parsed(changed("decode.image", "x:2")), "decode") != stamp(spec, "decode")


def test_the_reconciler_refuses_a_template_the_running_pods_were_not_made_from() -> None:
    spec = parsed(raw())
    running = [pod("g-p-0", P, spec), pod("g-p-1", P, spec), pod("g-d-0", D, spec)]
    assert running_template_changes(spec, running) == []
    new_image = parsed(changed("decode.image", "x:2"))
    (error,) = running_template_changes(new_image, running)
    assert error.startswith(
        'spec.decode.image: "x:2" differs from "matrixserve/engine-stub:0.1.0", which the '
        "running pod g-d-0 was made from"
    )
    assert ROLLOUT in error
    (model,) = running_template_changes(parsed(changed("model.name", "deepseek-v3")), running)
    assert model.startswith('spec.model.name: "deepseek-v3" differs from "llama3-8b"')
    assert "g-d-0" in model  # named once, by the first pod in name order


def test_pods_without_a_readable_template_or_being_deleted_count_as_matching() -> None:
    new_image = parsed(changed("prefill.image", "x:2"))
    old = parsed(raw())
    assert running_template_changes(new_image, [pod("g-p-0", P, None)]) == []
    assert running_template_changes(new_image, [pod("g-p-0", P, old, deleting=True)]) == []
    garbled = PodView(
        "g-p-0", "u", pod_labels("g", P, "g-p-0"), "Running", True, False, None, None, 0.0,
        {ANNOTATION_TEMPLATE: "{not json"},
    )  # fmt: skip
    assert running_template_changes(new_image, [garbled]) == []
    # A field the pod's template does not name (an older operator's) is not a change.
    older = json.loads(stamp(old, "prefill"))
    del older["prefill"]["npuType"]
    partial = PodView(
        "g-p-0", "u", pod_labels("g", P, "g-p-0"), "Running", True, False, None, None, 0.0,
        {ANNOTATION_TEMPLATE: json.dumps(older)},
    )  # fmt: skip
    assert running_template_changes(parsed(changed("prefill.npuType", "X")), [partial]) == []
    assert running_template_changes(new_image, [partial])  # what it names is still compared


# --------------------------------------------------------------------------- the handlers
KEY = (kinds.GROUP, kinds.VERSION, "ns", kinds.PDGROUP.plural, "g")


class Api:
    """The Kubernetes adapter over a scripted API holding group ``g`` and its pods."""

    def __init__(self, spec: dict[str, Any], pods_from: PDGroupSpec | None = None) -> None:
        self.core, self.custom = FakeCore(), FakeCustom()
        self.kube = KubeAdapter(client.ApiClient())
        self.kube.core, self.kube.custom = self.core, self.custom
        self.custom.objects[KEY] = {
            "apiVersion": kinds.API_VERSION,
            "kind": kinds.PDGROUP.kind,
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 2},
            "spec": spec,
        }
        settings = EngineSettings(zookeeper="zk:2181")
        for name, role in (("g-p-0", P), ("g-p-1", P), ("g-d-0", D)):
            if pods_from is not None:
                manifest = pod_manifest("ns", "g", "uid-g", name, role, pods_from, settings)
                self.core.create_namespaced_pod("ns", manifest)

    @property
    def memo(self) -> Any:
        runtime = SimpleNamespace(kube=self.kube)
        groups = SimpleNamespace(rt=runtime)
        return SimpleNamespace(runtime=SimpleNamespace(kube=self.kube, controllers={PDG: groups}))


PDG = kinds.PDGROUP
RULES, SCALE = (registration.admission_handler(PDG, a) for a in PDGroups.admissions)


def scale_body(replicas: int) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g"},
            "spec": {"replicas": replicas},
        }
    )


async def test_the_scale_webhook_checks_the_stored_group_with_the_new_decode_replicas() -> None:
    api = Api(raw())
    call = SCALE
    with pytest.raises(kopf.AdmissionError) as refused:
        await call(body=scale_body(200), name="g", namespace="ns", memo=api.memo)
    assert refused.value.code == 422
    assert "spec.decode.replicas: 400 decode NPUs cannot be placed in one SuperPod" in str(
        refused.value
    )
    with pytest.raises(kopf.AdmissionError, match="a group needs at least 1 decode"):
        await call(body=scale_body(0), name="g", namespace="ns", memo=api.memo)
    await call(body=scale_body(2), name="g", namespace="ns", memo=api.memo)
    api.custom.objects[KEY]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await call(body=scale_body(0), name="g", namespace="ns", memo=api.memo)  # being deleted
    del api.custom.objects[KEY]
    await call(body=scale_body(0), name="g", namespace="ns", memo=api.memo)  # gone: the API's 404


async def test_the_update_webhook_reads_the_pods_only_for_a_spec_change() -> None:
    drifted = changed("decode.image", "x:2")
    api = Api(drifted, pods_from=parsed(raw()))

    async def call(
        operation: str, old: Mapping[str, Any] | None, new: dict[str, Any], deleting: bool = False
    ) -> None:
        meta = {"name": "g", "namespace": "ns"}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        body = kopf.Body(cast(Any, {"metadata": meta, "spec": new}))
        await RULES(
            body=body,
            old=None if old is None else kopf.Body(cast(Any, {"metadata": meta, "spec": old})),
            operation=operation,
            name="g",
            namespace="ns",
            memo=api.memo,
        )

    await call("UPDATE", drifted, copy.deepcopy(drifted))  # metadata only
    invalid = changed("decode.replicas", 200)  # stored by a scale that slipped through
    await call("UPDATE", invalid, copy.deepcopy(invalid))  # e.g. the finalizer's removal
    await call("UPDATE", invalid, changed("decode.image", "y:3", invalid), deleting=True)
    assert api.core.selectors == []
    await call("UPDATE", drifted, raw())  # set back to what the pods run
    with pytest.raises(
        kopf.AdmissionError, match=r"spec\.decode\.image: cannot change from \".*\" to \"y:3\""
    ):
        await call("UPDATE", drifted, changed("decode.image", "y:3"))
    assert api.core.selectors == [f"{kinds.LABEL_GROUP}=g"] * 2
    with pytest.raises(kopf.AdmissionError, match=r"invalid PDGroup: spec\.prefill\.replicas: 0"):
        await call("CREATE", None, changed("prefill.replicas", 0))


def test_refusals_are_logged_as_the_users_error_and_failures_stay_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    objects = logging.getLogger("kopf.objects")
    hook = registration.RefusalsAreWarnings([a.id for a in PDGroups.admissions])
    objects.addFilter(hook)
    try:
        with caplog.at_level(logging.INFO, logger="kopf.objects"):
            # what kopf logs for an AdmissionError (execution: "<handler> failed permanently")
            objects.error(
                "Webhook 'pdgroup-scale' failed permanently: invalid PDGroup: x",
                extra={"k8s_ref": {"namespace": "ns", "name": "g"}},
            )
            objects.error("Webhook 'pdgroup-rules' failed with an exception and will stop now: y")
    finally:
        objects.removeFilter(hook)
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        ("WARNING", "refused a change of ns/g (pdgroup-scale): invalid PDGroup: x"),
        ("ERROR", "Webhook 'pdgroup-rules' failed with an exception and will stop now: y"),
    ]


async def test_reconcile_refuses_a_template_change_and_touches_nothing() -> None:
    """With the webhook off: the pods run the old image, the spec names a new one."""
    api = Api(changed("decode.image", "x:2"), pods_from=parsed(raw()))
    events: list[Event] = []
    loop = Reconciler(
        kinds.PDGROUP,
        api.kube,
        OperatorMetrics(),
        asyncio.get_running_loop(),
        poster=lambda _body, event: events.append(cast(Event, event)),
    )
    groups = PDGroups(
        api.memo.runtime, loop, cast(Any, None), PDGroupMetrics(OperatorMetrics().registry)
    )
    pods = copy.deepcopy(api.core.pods)
    outcome = await loop.reconcile(groups, "ns", "g", logging.getLogger("test"))
    assert outcome.busy is False
    status = api.custom.objects[KEY]["status"]
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"].startswith('spec.decode.image: "x:2" differs from')
    assert [e.reason for e in events] == ["InvalidSpec"]
    assert api.core.pods == pods
    assert api.core.deletes == []
    # Set back: valid again (the next stage needs ZooKeeper, which this test does not have).
    api.custom.objects[KEY]["spec"] = raw()
    spec, errors = parse_spec(raw(), "g")
    assert spec is not None
    assert errors == []
    views = await api.kube.list_pods("ns", {kinds.LABEL_GROUP: "g"})
    assert running_template_changes(spec, views.values()) == []


# --------------------------------------------------------------------------- issue 31
@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (
            "moe",
            {"mode": "Colocated"},
            "spec.moe: Colocated needs no spec.moe: remove it; an MoE model's experts then run "
            "inside each instance (parallelism.ep)",
        ),
        (
            "model.prefillArtifact",
            "s3://bucket/prefill.om",
            "spec.model.prefillArtifact: per-role compiled artefacts are not supported yet: every "
            "engine loads model.name and compiles it itself; remove the field",
        ),
        (
            "model.decodeArtifact",
            "s3://bucket/decode.om",
            "spec.model.decodeArtifact: per-role compiled artefacts are not supported yet: every "
            "engine loads model.name and compiles it itself; remove the field",
        ),
        (
            "prefill.parallelism",
            {"dp": 2},
            "spec.prefill.parallelism.dp: 2 is not what runs: an instance's data-parallel degree "
            "is its 4 dies / tp 4 = 1 (leave dp out, or set it to that)",
        ),
        (
            "decode.parallelism",
            {"tp": 2, "dp": 4},
            "spec.decode.parallelism.dp: 4 is not what runs: an instance's data-parallel degree "
            "is its 4 dies / tp 2 = 2 (leave dp out, or set it to that)",
        ),
    ],
)
def test_a_field_nothing_reads_is_refused_saying_what_works(
    path: str, value: Any, words: str
) -> None:
    """Issue 31: these were accepted and read by nothing; now each is refused (by the CRD's CEL
    rule, in these words; by the webhook and the reconciler where the API server did not)."""
    errors = validate_pdgroup(parsed(changed(path, value)), "g")
    assert words in errors, errors


def sized(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """The default spec with these prefill and decode fields."""
    base = raw()
    return {
        **base,
        "prefill": {**base["prefill"], **prefill},
        "decode": {**base["decode"], **decode},
    }


MAPPING = "pair by CloudMatrix-Infer §4.3.3's KV mapping"


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ({"devicesPerInstance": 2}, {"devicesPerInstance": 4, "parallelism": {"tp": 1}}),
        ({"devicesPerInstance": 2}, {"devicesPerInstance": 8, "parallelism": {"tp": 2}}),
        ({"devicesPerInstance": 4}, {"devicesPerInstance": 8, "parallelism": {"tp": 8}}),
        ({"devicesPerInstance": 1}, {"devicesPerInstance": 2, "parallelism": {"tp": 1}}),
        # the same size pairs device k with device k, whatever the TPs
        ({"devicesPerInstance": 4, "parallelism": {"tp": 2}}, {"devicesPerInstance": 4}),
    ],
)
def test_prefill_and_decode_of_different_sizes_are_accepted_when_the_mapping_pairs_them(
    prefill: dict[str, Any], decode: dict[str, Any]
) -> None:
    assert validate_pdgroup(parsed(sized(prefill, decode)), "g") == []


@pytest.mark.parametrize(
    ("prefill", "decode", "words"),
    [
        (
            {"devicesPerInstance": 2},
            {"devicesPerInstance": 4},
            "spec.decode.parallelism.tp: 8 does not divide the prefill's tp 4: a prefill and a "
            f"decode of different sizes (4 and 8 dies) {MAPPING}, which needs prefill tp to be a "
            "multiple of decode tp",
        ),
        (
            {"devicesPerInstance": 4},
            {"devicesPerInstance": 2, "parallelism": {"tp": 2}},
            "spec.decode.devicesPerInstance: 4 dies / decode tp 2 = dp 2 is not a multiple of "
            f"prefill tp / decode tp = 4: a prefill and a decode of different sizes (8 and 4 dies) "
            f"{MAPPING}, which needs decode dp to be a multiple of that ratio",
        ),
        (
            {"devicesPerInstance": 2, "parallelism": {"tp": 2}},
            {"devicesPerInstance": 4, "parallelism": {"tp": 1}},
            "spec.prefill.parallelism.tp: 2 is not the prefill's 4 dies: a prefill and a decode "
            f"of different sizes (4 and 8 dies) {MAPPING}, which names prefill TP ranks only, so "
            "the prefill must be one TP group (leave tp out, or set it to 4)",
        ),
    ],
)
def test_a_broken_precondition_of_the_mapping_is_refused_naming_the_field(
    prefill: dict[str, Any], decode: dict[str, Any], words: str
) -> None:
    errors = validate_pdgroup(parsed(sized(prefill, decode)), "g")
    assert errors == [words]
    assert admit("CREATE", None, sized(prefill, decode), False, "g") == [words]


def test_the_mapping_is_not_judged_where_a_roles_tp_does_not_divide_its_dies() -> None:
    """The role's own rule says so; the mapping's would only repeat it in other words."""
    (error,) = validate_pdgroup(
        parsed(
            sized({"devicesPerInstance": 2}, {"devicesPerInstance": 4, "parallelism": {"tp": 3}})
        ),
        "g",
    )
    assert error == "spec.decode.parallelism.tp: 3 does not divide the instance's 8 dies"


@pytest.mark.parametrize("parallelism", [{"dp": 1}, {"tp": 2, "dp": 2}, {"tp": 4, "dp": 1}])
def test_a_dp_that_is_what_runs_is_accepted(parallelism: dict[str, int]) -> None:
    assert validate_pdgroup(parsed(changed("decode.parallelism", parallelism)), "g") == []


async def test_reconcile_reports_a_rule_error_and_a_template_change_together() -> None:
    """With the webhook off, a spec both invalid by its rules and naming a template its pods do
    not run is refused with both reasons at once (not the second only once the first is
    fixed, under a new generation)."""
    both = changed("decode.replicas", 200, changed("decode.image", "x:2"))
    api = Api(both, pods_from=parsed(raw()))
    loop = Reconciler(
        kinds.PDGROUP,
        api.kube,
        OperatorMetrics(),
        asyncio.get_running_loop(),
        poster=lambda _body, _event: None,
    )
    groups = PDGroups(
        api.memo.runtime, loop, cast(Any, None), PDGroupMetrics(OperatorMetrics().registry)
    )
    await loop.reconcile(groups, "ns", "g", logging.getLogger("test"))
    status = api.custom.objects[KEY]["status"]
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert "spec.decode.replicas: 400 decode NPUs cannot be placed" in ready["message"]
    assert 'spec.decode.image: "x:2" differs from' in ready["message"]


# --------------------------------------------------------------------------- expert pools
def _pool(model: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"experts": 256, "layers": 58, "topK": 8}
    if model is not None:
        spec["name"] = model
    return {"spec": {"model": spec, "servers": {"replicas": 8}}}


@pytest.mark.parametrize(
    ("pool", "errors"),
    [
        (_pool("llama3-8b"), []),
        (_pool(None), []),  # a pool that names no model serves whichever
        (None, []),  # not there yet: waited for
        (
            _pool("deepseek-v3"),
            [
                "spec.moe.expertPoolRef: ExpertPool experts serves model deepseek-v3, not this "
                "group's llama3-8b"
            ],
        ),
    ],
)
def test_a_pool_of_another_model_is_refused(pool: dict[str, Any] | None, errors: list[str]) -> None:
    moe = {"mode": "Disaggregated", "expertPoolRef": {"name": "experts"}}
    assert expert_pool_errors(parsed(changed("moe", moe)), pool) == errors
    assert expert_pool_errors(parsed(raw()), _pool("deepseek-v3")) == []  # no moe, no pool


# ------------------------------------------------------------------ experts pooled: the decode's HBM
def _deepseek(decode: dict[str, Any], moe: bool) -> PDGroupSpec:
    body = changed("model.name", "deepseek-v3")
    body["prefill"] = {"replicas": 1, "devicesPerInstance": 8}
    body["decode"] = {"replicas": 1, **decode}
    if moe:
        body["moe"] = {"mode": "Disaggregated", "expertPoolRef": {"name": "experts"}}
    return parsed(body)


def test_a_deepseek_decode_of_two_npus_fits_once_its_experts_are_pooled() -> None:
    """671B INT8 weights need six NPUs' HBM; without its experts (EaaS §3.1) a decode holds
    about 14.5 GB and fits two NPUs with its KV. The prefill of the same group keeps its experts."""
    decode = {"devicesPerInstance": 2, "batchSize": 32}
    (alone,) = [e for e in admission_rules(_deepseek(decode, moe=False)) if "spec.decode" in e]
    assert alone.startswith("spec.decode.devicesPerInstance: 6")
    assert "GB of weights do not fit 2 NPUs (230.4 GB usable HBM)" in alone
    assert admission_rules(_deepseek(decode, moe=True)) == []
    spec, facts = _deepseek(decode, moe=True), model_facts(_deepseek(decode, moe=True))
    assert facts is not None
    shape = PRESETS["deepseek-v3"]
    assert held_weights(spec, Role.DECODE, facts) == shape.non_expert_weight_bytes
    assert 14e9 < shape.non_expert_weight_bytes < 15e9  # attention, 3 dense FFNs, embeddings
    assert held_weights(spec, Role.PREFILL, facts) == shape.weight_bytes_total


def test_a_pooled_decode_counts_a_copy_per_tp_group_and_its_kv() -> None:
    """Data-parallel attention (tp 1 on 4 dies): four copies of the non-expert weights, as the
    engine holds them; the KV left is counted after them and said so."""
    tp1 = _deepseek({"devicesPerInstance": 2, "batchSize": 32, "parallelism": {"tp": 1}}, True)
    facts = model_facts(tp1)
    assert facts is not None
    assert held_weights(tp1, Role.DECODE, facts) == 4 * facts.non_expert_bytes
    big = _deepseek({"devicesPerInstance": 1, "batchSize": 4096}, moe=True)
    (kv,) = admission_rules(big)
    assert kv.startswith("spec.decode.batchSize: 4096 requests x")
    assert kv.endswith("GB of HBM is left after the non-expert weights (experts pooled)")


def test_a_pooled_decode_is_an_instance_of_one_pod() -> None:
    two_pods = _deepseek({"devicesPerInstance": 16, "podsPerInstance": 2, "batchSize": 32}, True)
    assert admission_rules(two_pods) == [
        "spec.decode.podsPerInstance: 2: an ExpertPool's attention client is an instance of "
        "one pod (its experts are the pool's: devicesPerInstance up to 8 NPUs hold its weights)"
    ]


@pytest.mark.parametrize(
    ("experts", "layers", "refused"),
    [(256, 58, False), (8, 58, True), (256, 3, True)],
)
def test_a_pool_short_of_the_models_experts_is_refused(
    experts: int, layers: int, refused: bool
) -> None:
    spec = _deepseek({"devicesPerInstance": 2, "batchSize": 32}, moe=True)
    pool = {"spec": {"model": {"name": "deepseek-v3", "experts": experts, "layers": layers}}}
    errors = expert_pool_errors(spec, pool)
    assert errors == (
        [
            f"spec.moe.expertPoolRef: ExpertPool experts holds {experts} experts x {layers} "
            "layers; deepseek-v3 has 256 x 58 (its decodes need every one covered)"
        ]
        if refused
        else []
    )
