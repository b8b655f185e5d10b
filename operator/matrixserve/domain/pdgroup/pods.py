"""The pods of one P/D instance (pure): deterministic names, labels, owner, NPUs, placement, env.

Every pod starts role-less (``ENGINE_ROLE=auto``): its role is bound in the RoCE map when it joins
(P/D-Serve §3.3: "newly added containers (stateless and no P/D role)"). Placement: a group's decode
instances are tightly coupled and stay inside one SuperPod (required pod affinity on the SuperPod
label, 001 §6.1.2); prefill prefers the same SuperPod but may go elsewhere over RoCE. Each pod
runs the hardened engine container (:mod:`matrixserve.domain.enginepod`: least privilege) with
its role's ``resources``, and ZooKeeper's identity as a read-only file.

An instance is an ordered list of pods (:func:`pod_names`): the first, named as the instance, runs
the engine that serves (its leader); the others (``<instance>-1`` ...) hold their NPUs as its
ranks (``ENGINE_RANK`` of ``ENGINE_RANKS``, all under the instance's name). ``devicesPerInstance``
counts the whole instance's NPUs, shared equally by its pods. A pod given a :class:`Seat` (gang
placement, :mod:`.gang`) is created gated, pinned to its server (the scheduler still checks fit)
and told its KV plane.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from matrixserve.api import kinds
from matrixserve.api.engine_settings import EngineEnv, downward_env
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.roles import Role
from matrixserve.domain.enginepod import (
    EngineSettings,
    credential_mounts,
    credential_volumes,
    engine_container,
    owner_reference,
    platform_settings,
    pod_security_context,
    scratch_volumes,
)
from matrixserve.domain.observed import PodView
from matrixserve.domain.pdgroup.validation import ANNOTATION_TEMPLATE, stamp


def role_label(role: Role) -> str:
    return role.label


def role_of(pod: PodView) -> Role:
    """The role a pod was created for, from its label (a decode's unless it says prefill)."""
    return Role.from_label(pod.label(kinds.LABEL_ROLE)) or Role.DECODE


def pod_names(instance: str, pods_per_instance: int = 1) -> list[str]:
    """The instance's pods in order; the first runs the engine that reports for the instance."""
    return [instance] + [f"{instance}-{k}" for k in range(1, pods_per_instance)]


def pod_labels(group: str, role: Role, instance: str) -> dict[str, str]:
    return {
        kinds.LABEL_GROUP: group,
        kinds.LABEL_ROLE: role.label,
        kinds.LABEL_INSTANCE: instance,
        kinds.APP_NAME_LABEL: kinds.ENGINE_APP,
        kinds.MANAGED_BY_LABEL: kinds.OPERATOR_MANAGER,
    }


def _affinity(group: str, role: Role) -> dict[str, Any]:
    decodes = {kinds.LABEL_GROUP: group, kinds.LABEL_ROLE: Role.DECODE.label}
    term = {"labelSelector": {"matchLabels": decodes}, "topologyKey": kinds.LABEL_SUPERPOD}
    if role is Role.DECODE:
        return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 50, "podAffinityTerm": term}
            ]
        }
    }


@dataclass(frozen=True)
class Seat:
    """Where gang placement put a pod: its server (reserved), the SuperPod, the KV plane."""

    server: str
    superpod: str
    kv_plane: str


def pod_manifest(
    namespace: str,
    group: str,
    group_uid: str,
    name: str,
    role: Role,
    spec: PDGroupSpec,
    settings: EngineSettings,
    instance: str | None = None,
    seat: Seat | None = None,
) -> dict[str, Any]:
    r = spec.role_spec(role)
    instance = instance or name
    ranks = pod_names(instance, r.pods_per_instance)
    rank = ranks.index(name) if name in ranks else 0
    settings_env = engine_settings(namespace, group, role, spec, settings)
    if r.pods_per_instance > 1:
        settings_env = dataclasses.replace(
            settings_env, instance=instance, rank=str(rank), ranks=str(r.pods_per_instance)
        )
    if seat is not None:
        settings_env = dataclasses.replace(settings_env, kv_plane=seat.kv_plane)
    env = [*downward_env(), *settings_env.to_env()]
    volumes = [*scratch_volumes(), *credential_volumes(settings)]
    container = engine_container(
        r.image, env, r.npus_per_pod, r.resources, credential_mounts(settings)
    )
    annotations = pod_annotations(spec, role)
    selector = {kinds.LABEL_NPU_TYPE: r.npu_type}
    placed: dict[str, Any] = {}
    if seat is not None:
        selector[kinds.LABEL_SERVER] = seat.server
        annotations[kinds.ANNOTATION_SUPERPOD] = seat.superpod
        annotations[kinds.ANNOTATION_KV_PLANE] = seat.kv_plane
        placed["schedulingGates"] = [{"name": kinds.GANG_GATE}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": pod_labels(group, role, instance),
            "annotations": annotations,
            "ownerReferences": [owner(group, group_uid)],
        },
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 10,
            # Engines talk to ZooKeeper and their peers, never to the Kubernetes API.
            "automountServiceAccountToken": False,
            "nodeSelector": selector,
            "affinity": _affinity(group, role),
            "securityContext": pod_security_context(),
            "containers": [container],
            "volumes": volumes,
            **placed,
        },
    }


def pod_annotations(spec: PDGroupSpec, role: Role) -> dict[str, str]:
    return {
        kinds.ANNOTATION_SERVICE: spec.service,
        kinds.ANNOTATION_SCENARIO: spec.scenario,
        # what it is made from: the reconciler refuses a spec that differs from it
        ANNOTATION_TEMPLATE: stamp(spec, role.spec_key),
    }


def owner(group: str, group_uid: str) -> dict[str, Any]:
    return owner_reference(kinds.PDGROUP.kind, group, group_uid)


def engine_settings(
    namespace: str,
    group: str,
    role: Role,
    spec: PDGroupSpec,
    settings: EngineSettings,
) -> EngineEnv:
    """The engine's settings for an instance of ``role`` (beside the downward API's): what a
    cold pod gets in its environment, and a claimed warm pod in its assignment."""
    r = spec.role_spec(role)
    tpot = spec.slo.tpot_milliseconds  # the decode's batch meets it
    return dataclasses.replace(
        platform_settings(settings),
        role="auto",
        model=spec.model.name,
        max_batch=str(r.batch_size),
        max_prompt_tokens=str(spec.model.max_context_tokens),
        max_output_tokens=str(spec.model.max_context_tokens),
        group=f"{namespace}/{group}",
        zookeeper=settings.zookeeper,
        tpot_slo_ms=None if tpot is None else str(tpot),
        tp=str(r.parallelism.tp) if r.parallelism.tp else None,
        ep=str(r.parallelism.ep) if r.parallelism.ep else None,
        expert_pool=_expert_pool(namespace, role, spec),
    )


def _expert_pool(namespace: str, role: Role, spec: PDGroupSpec) -> str | None:
    """The pool a decode sends its experts' tokens to, as its attention client (EaaS §3.1:
    decoding only, §5.1); prefill keeps its experts inside the instance."""
    moe = spec.moe
    if role is not Role.DECODE or moe is None or moe.expert_pool_ref is None:
        return None
    return f"{namespace}/{moe.expert_pool_ref.name}"


def engine_env(
    namespace: str,
    group: str,
    role: Role,
    spec: PDGroupSpec,
    settings: EngineSettings,
) -> list[dict[str, Any]]:
    """:func:`engine_settings` as a container's ``env`` entries."""
    return engine_settings(namespace, group, role, spec, settings).to_env()
