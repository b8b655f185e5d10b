"""An expert server's pod (pure): name, labels, owner, NPUs, the engine as an expert server.

An expert server is a stateless engine (EaaS §2.4, §3.1): ``ENGINE_ROLE=expert`` of the pool
``MATRIXSERVE_EXPERT_POOL=<ns>/<name>``; it registers itself under the pool's ``servers/`` in
ZooKeeper (its pod's name is its id) and loads the slots the map in force gives it. It runs the
engine container every kind runs (:mod:`matrixserve.domain.enginepod`: probes, NPUs, least
privilege, ZooKeeper's identity as a file). Names are ``<pool>-s<n>``, the smallest ``n`` no pod
of the pool holds, so a replacement takes the name its predecessor left.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable
from typing import Any

from matrixserve.api import kinds
from matrixserve.api.engine_settings import EngineEnv, downward_env
from matrixserve.api.resources import ExpertPoolSpec
from matrixserve.domain.enginepod import (
    EngineSettings,
    credential_mounts,
    engine_container,
    engine_pod,
    owner_reference,
    platform_settings,
)
from matrixserve.domain.observed import PodView

LABEL_EXPERTPOOL = f"{kinds.LABEL_PREFIX}/expertpool"  # the pool a server pod belongs to
# JSON: how the server was obtained (path, estimate, phases; :mod:`.obtain`)
ANNOTATION_OBTAINED = f"{kinds.LABEL_PREFIX}/obtained"
# JSON: what a server pod is made from (:func:`template`); its engine reads it at its start
ANNOTATION_EXPERT_TEMPLATE = f"{kinds.LABEL_PREFIX}/expert-template"
EXPERT_ROLE = "expert"


def pod_name(pool: str, index: int) -> str:
    return f"{pool}-s{index}"


def free_names(pool: str, taken: Collection[str], count: int) -> list[str]:
    """``count`` server names, the smallest indices none of ``taken`` holds."""
    out: list[str] = []
    index = 0
    while len(out) < count:
        name = pod_name(pool, index)
        if name not in taken:
            out.append(name)
        index += 1
    return out


def template(spec: ExpertPoolSpec) -> str:
    """What a server pod is made from: its engine takes its model, slots and NPUs at its start,
    so a pod of another template would hold another map's slots."""
    s = spec.servers
    return json.dumps(
        {
            "model": spec.model.name,
            "slotsPerServer": s.slots_per_server,
            "devicesPerServer": s.devices_per_server,
            "image": s.image,
        },
        sort_keys=True,
    )


def template_changes(spec: ExpertPoolSpec, pods: Iterable[PodView]) -> list[str]:
    """What ``spec`` changes of the template its running server pods were made from: refused
    (servers are not replaced in place yet; a new pool takes the new template)."""
    wanted = json.loads(template(spec))
    out: list[str] = []
    for pod in sorted(pods, key=lambda p: p.name):
        made = json.loads(pod.annotations.get(ANNOTATION_EXPERT_TEMPLATE) or "{}")
        for key, value in wanted.items():
            field = "spec.model.name" if key == "model" else f"spec.servers.{key}"
            if key in made and made[key] != value and not any(field in o for o in out):
                out.append(
                    f"{field}: {value!r}, but the running servers were made with "
                    f"{made[key]!r}: a server's template cannot change under it (delete and "
                    "create the pool for another)"
                )
    return out


def selector(pool: str) -> str:
    """The label selector of the pool's server pods (its own and the warm ones it claimed)."""
    return f"{LABEL_EXPERTPOOL}={pool}"


def pod_labels(pool: str) -> dict[str, str]:
    return {
        LABEL_EXPERTPOOL: pool,
        kinds.APP_NAME_LABEL: kinds.ENGINE_APP,
        kinds.MANAGED_BY_LABEL: kinds.OPERATOR_MANAGER,
    }


def engine_settings(
    namespace: str, pool: str, spec: ExpertPoolSpec, settings: EngineSettings
) -> EngineEnv:
    """The engine of a server of the pool: a cold pod's environment, and what a claimed warm
    pod's assignment carries of it (:meth:`EngineEnv.assignment`: role, model, pool, slots)."""
    return dataclasses.replace(
        platform_settings(settings),
        role=EXPERT_ROLE,
        model=spec.model.name,
        expert_pool=f"{namespace}/{pool}",
        expert_slots=str(spec.servers.slots_per_server),
        zookeeper=settings.zookeeper,
    )


def owner(pool: str, pool_uid: str) -> dict[str, Any]:
    """The pool as its server pods' owner (a claimed warm pod's too: it goes with the pool)."""
    return owner_reference(kinds.EXPERTPOOL.kind, pool, pool_uid)


def pod_manifest(
    namespace: str,
    pool: str,
    pool_uid: str,
    name: str,
    spec: ExpertPoolSpec,
    settings: EngineSettings,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    engine = engine_settings(namespace, pool, spec, settings)
    env = [*downward_env(), *engine.to_env()]
    s = spec.servers
    container = engine_container(
        s.image, env, s.devices_per_server, None, credential_mounts(settings)
    )
    return engine_pod(
        namespace,
        name,
        pod_labels(pool),
        {**(annotations or {}), ANNOTATION_EXPERT_TEMPLATE: template(spec)},
        (kinds.EXPERTPOOL.kind, pool, pool_uid),
        container,
        settings,
    )
