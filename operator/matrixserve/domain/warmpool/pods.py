"""A warm pod (pure): name, labels, template, owner, NPUs, the engine in warm mode.

A warm pod runs the engine container every kind runs (:mod:`matrixserve.domain.enginepod`) with
``ENGINE_WARM=1`` and no model, role or group: the engine goes through TE-Pre-Load (Python, NPU
state, HCCL) and waits for an assignment in ZooKeeper (DeepServe §6.1: "workload-independent"
pods and "model-agnostic" pre-warmed TEs). It runs at the serving pods' priority: a pod's
priority is fixed at its creation, so a warm pod made at a low one would stay preemptible once
claimed and serving; the pool gives its NPUs up itself instead, to a serving pod the scheduler
cannot place (:mod:`.plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from matrixserve.api import kinds
from matrixserve.api.engine_settings import downward_env, switch
from matrixserve.api.resources import WarmShape, WarmTemplate
from matrixserve.domain.enginepod import (
    EngineSettings,
    credential_mounts,
    engine_container,
    engine_pod,
    platform_settings,
)


def pod_name(pool: str, shape: str, index: int) -> str:
    return f"{pool}-{shape}-w{index}"


def template(s: WarmShape, image: str) -> str:
    """What a warm pod is made from (its ``ANNOTATION_WARM_TEMPLATE``)."""
    return WarmTemplate(
        image=image,
        devicesPerPod=s.devices_per_pod,
        npuType=s.npu_type,
        nodeSelector=dict(s.node_selector or {}),
    ).dump()


def pod_labels(pool: str, shape: str, s: WarmShape) -> dict[str, str]:
    return {
        kinds.LABEL_WARMPOOL: pool,
        kinds.LABEL_WARM_SHAPE: shape,
        kinds.LABEL_WARM_NPUS: str(s.devices_per_pod),
        kinds.LABEL_NPU_TYPE: s.npu_type,
        kinds.APP_NAME_LABEL: kinds.ENGINE_APP,
        kinds.MANAGED_BY_LABEL: kinds.OPERATOR_MANAGER,
    }


def pod_manifest(
    namespace: str,
    pool: str,
    pool_uid: str,
    name: str,
    shape: str,
    s: WarmShape,
    image: str,
    settings: EngineSettings,
) -> dict[str, Any]:
    engine = dataclasses.replace(
        platform_settings(settings), warm=switch(True), zookeeper=settings.zookeeper
    )
    env = [*downward_env(), *engine.to_env()]
    container = engine_container(image, env, s.devices_per_pod, None, credential_mounts(settings))
    return engine_pod(
        namespace,
        name,
        pod_labels(pool, shape, s),
        {kinds.ANNOTATION_WARM_TEMPLATE: template(s, image)},
        (kinds.WARMPOOL.kind, pool, pool_uid),
        container,
        settings,
        nodeSelector={**(s.node_selector or {}), kinds.LABEL_NPU_TYPE: s.npu_type},
    )
