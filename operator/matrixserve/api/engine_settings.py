"""The engine's environment: the one contract between whoever starts an engine and the engine.

An engine learns what it is from its environment: the operator writes the platform's settings
and the instance's into a cold pod's manifest (and a claimed warm pod's assignment carries the
instance's: DeepServe §6.1), the kubelet adds the downward API's (the pod's name, UID, namespace
and IP), the node (the Ascend device plugin, emulated) its NPUs, dies, RoCE IPs and server. The
engine reads it all at start, as defaults of its flags. :class:`EngineEnv` names every variable
once: writers build one and write it with :meth:`EngineEnv.to_env` (a container's ``env``) or
:meth:`EngineEnv.to_dict`; the engine reads :meth:`EngineEnv.from_env`.

Values stay the environment's strings, as written: a writer's string reaches the engine
unchanged (a time scale given as ``"100"`` is written ``"100"``), and parsing them (numbers,
switches, lists) is the engine's, with the same rules and messages as its flags'. A field left
None is not written, and reads as None when the variable is absent (an empty variable reads as
``""``: the engine tells the two apart where its defaults do).

Order: :meth:`EngineEnv.to_env` writes the fields in the order they are declared here. A
container's ``env`` is a list, compared as one, so the declaration order is the order of every
engine pod's manifest: moving a field changes every engine pod the operator makes (and the
operator then sees its pods as different from what it would make).

:class:`LoadSource`, where an engine's weights come from (DeepServe §6.2), is the engine's
``ENGINE_LOAD_SOURCE``, an assignment's ``loadSource`` and the operator's scale-out paths' load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar, Self

_NAME = "env"  # the variable's name, in a field's metadata
_FIELD_REF = "fieldRef"  # the downward API's field that gives its value, if any


class LoadSource(StrEnum):
    """Where an engine's weights come from at TE-Load (DeepServe 002 §6.2; 001 Table 2)."""

    SHARED_FILE_SERVICE = "SharedFileService"
    SSD = "SSD"
    HOST_DRAM = "HostDRAM"
    NPU_FORK_UB = "NPUForkUB"
    NPU_FORK_ROCE = "NPUForkRoCE"


def _var(name: str, field_ref: str | None = None) -> Any:
    metadata = {_NAME: name} if field_ref is None else {_NAME: name, _FIELD_REF: field_ref}
    return dataclasses.field(default=None, metadata=metadata)


@dataclass(frozen=True)
class EngineEnv:
    """Every variable of an engine's environment, by what it means (None: not set)."""

    # --- the pod's own, from the downward API (written as field references: downward_env)
    pod_name: str | None = _var("POD_NAME", "metadata.name")
    pod_uid: str | None = _var("POD_UID", "metadata.uid")  # reported as part of who it is
    pod_namespace: str | None = _var("POD_NAMESPACE", "metadata.namespace")
    pod_ip: str | None = _var("POD_IP", "status.podIP")

    # --- what the operator writes, in the order of its engine pods' manifests
    warm: str | None = _var("ENGINE_WARM")  # "1": a pre-warmed engine, no model, role or group
    role: str | None = _var("ENGINE_ROLE")  # prefill | decode | colocated | ... | auto
    model: str | None = _var("ENGINE_MODEL")  # a catalog preset, or a ModelShape's JSON file
    max_batch: str | None = _var("ENGINE_MAX_BATCH")
    max_prompt_tokens: str | None = _var("ENGINE_MAX_PROMPT_TOKENS")
    max_output_tokens: str | None = _var("ENGINE_MAX_OUTPUT_TOKENS")
    load_source: str | None = _var("ENGINE_LOAD_SOURCE")  # a LoadSource value
    health_interval: str | None = _var("ENGINE_HEALTH_INTERVAL")  # emulated s
    link_timeout: str | None = _var("ENGINE_LINK_TIMEOUT")  # emulated s
    time_scale: str | None = _var("MATRIXSERVE_TIME_SCALE")  # emulated s per wall s
    admission: str | None = _var("ENGINE_ADMISSION")  # reject | queue
    fault_injection: str | None = _var("ENGINE_FAULT_INJECTION")  # a switch: 1/true, 0/false
    pre_load_seconds: str | None = _var("ENGINE_PRE_LOAD_SECONDS")  # emulated s of TE-Pre-Load
    zookeeper_auth_file: str | None = _var("MATRIXSERVE_ZK_AUTH_FILE")  # a mounted Secret's file
    group: str | None = _var("MATRIXSERVE_GROUP")  # <namespace>/<name>
    zookeeper: str | None = _var("MATRIXSERVE_ZK")  # host:port[/chroot]
    tpot_slo_ms: str | None = _var("ENGINE_TPOT_SLO_MS")  # the decode batch's step bound
    tp: str | None = _var("ENGINE_TP")
    ep: str | None = _var("ENGINE_EP")

    # --- more of an instance's settings (an assignment may carry them), and who it is once
    # claimed (a warm pod reports under its assignment's instance name, not its pod's)
    mtp: str | None = _var("ENGINE_MTP")  # "1": multi-token prediction
    kv_plane: str | None = _var("ENGINE_KV_PLANE")  # UB | RoCE
    instance: str | None = _var("ENGINE_INSTANCE")
    # An instance of several pods (one per server): this pod's rank in it ("0": the leader,
    # which serves and reports to the group; its workers hold their dies) and how many pods it
    # has. Unset: rank 0 of 1, an instance of one pod.
    rank: str | None = _var("ENGINE_RANK")
    ranks: str | None = _var("ENGINE_RANKS")
    # Experts as a service (EaaS §3.1; xDeepServe §4.5): an ``expert`` server or an
    # ``attention`` client of the pool <namespace>/<name> (its map and servers in ZooKeeper);
    # ``eaas`` (default: clients drop a failed server and re-send to a replica) or
    # ``monolithic`` (the baseline: one static EP group, a server's failure stops every client
    # until all restart, EaaS §2.2).
    expert_pool: str | None = _var("MATRIXSERVE_EXPERT_POOL")
    expert_mode: str | None = _var("ENGINE_EXPERT_MODE")
    # An expert server's slots per MoE layer (default: as many experts as fit its HBM); a
    # client's failover timeout (emulated ms: a server silent this long is dropped, its part
    # re-sent, EaaS §3.4) and the experts' popularity (uniform | zipf | a JSON trace's path).
    expert_slots: str | None = _var("ENGINE_EXPERT_SLOTS")
    expert_failover_ms: str | None = _var("ENGINE_EXPERT_FAILOVER_MS")
    expert_popularity: str | None = _var("ENGINE_EXPERT_POPULARITY")
    # without ZooKeeper: how many read the shared file service with it
    concurrent_loaders: str | None = _var("ENGINE_CONCURRENT_LOADERS")

    # --- what the node gives every pod it runs (comma-separated lists)
    npus: str | None = _var("MATRIXSERVE_NPUS")  # NPU ids granted
    dies: str | None = _var("MATRIXSERVE_DIES")  # their dies' ids
    roce_ips: str | None = _var("MATRIXSERVE_ROCE_IPS")  # by die
    ub_addresses: str | None = _var("MATRIXSERVE_UB_ADDRESSES")  # by die
    device_status_file: str | None = _var("MATRIXSERVE_DEVICE_STATUS_FILE")
    node_name: str | None = _var("MATRIXSERVE_NODE_NAME")
    superpod: str | None = _var("MATRIXSERVE_SUPERPOD")
    node_pod_ip: str | None = _var("MATRIXSERVE_POD_IP")  # the pod's IP, as its node says
    ssd_models: str | None = _var("MATRIXSERVE_SSD_MODELS")  # what the server's SSD holds

    # --- the engine's own, for engines started by hand (tests, benchmarks, demos)
    port: str | None = _var("ENGINE_PORT")
    zookeeper_auth: str | None = _var("MATRIXSERVE_ZK_AUTH")  # user:password itself
    loop_beat_interval: str | None = _var("ENGINE_LOOP_BEAT_INTERVAL")  # emulated s
    hang_bound: str | None = _var("ENGINE_HANG_BOUND")  # emulated s
    link_probe_interval: str | None = _var("ENGINE_LINK_PROBE_INTERVAL")  # emulated s
    decode_peers: str | None = _var("ENGINE_DECODE_PEERS")  # host:port, without ZooKeeper
    step_scheduling: str | None = _var("ENGINE_STEP_SCHEDULING")  # absolute | relative

    NAMES: ClassVar[Mapping[str, str]]  # field -> variable, in declaration order

    @classmethod
    def name(cls, field: str) -> str:
        """The variable a field is written as (KeyError for no field of that name)."""
        return cls.NAMES[field]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Self:
        """What ``env`` (a process's environment) says; the rest None."""
        return cls(**{field: env[name] for field, name in cls.NAMES.items() if name in env})

    def to_dict(self) -> dict[str, str]:
        """The variables set, by name, in declaration order."""
        values = ((name, getattr(self, field)) for field, name in self.NAMES.items())
        return {name: value for name, value in values if value is not None}

    def to_env(self) -> list[dict[str, Any]]:
        """The variables set as a container's ``env`` entries, in declaration order."""
        return [{"name": name, "value": value} for name, value in self.to_dict().items()]

    def assignment(self) -> dict[str, str]:
        """The instance's settings a claimed warm pod's assignment carries
        (:data:`ASSIGNMENT_ENV`), in declaration order."""
        return {k: v for k, v in self.to_dict().items() if k in ASSIGNMENT_ENV}


EngineEnv.NAMES = {f.name: f.metadata[_NAME] for f in fields(EngineEnv)}


def downward_env() -> list[dict[str, Any]]:
    """The pod's own name, UID, namespace and IP as a container's ``env`` entries, from the
    downward API (the engine binds and reports the IP, and reports the UID as part of who it
    is)."""
    return [
        {
            "name": f.metadata[_NAME],
            "valueFrom": {"fieldRef": {"fieldPath": f.metadata[_FIELD_REF]}},
        }
        for f in fields(EngineEnv)
        if _FIELD_REF in f.metadata
    ]


def switch(on: bool) -> str:
    """A switch's value as written (the engine reads 1/true as on, 0/false or unset as off)."""
    return "1" if on else "0"


# The engine settings an assignment may carry: the instance's own (the rest of a warm engine's
# environment is its pod's: ZooKeeper, credentials, devices, node, fault injection, platform).
ASSIGNMENT_ENV = frozenset(
    EngineEnv.name(field)
    for field in (
        "role",
        "model",
        "max_batch",
        "tpot_slo_ms",
        "max_prompt_tokens",
        "max_output_tokens",
        "tp",
        "ep",
        "mtp",
        "kv_plane",
        "rank",
        "ranks",
        "expert_pool",
        "expert_mode",
        "expert_slots",
        "expert_failover_ms",
        "expert_popularity",
    )
)

# Keys an older operator wrote in assignments that no engine setting takes now: ignored, not
# refused (a pod claimed before an upgrade still becomes its instance). The shared file
# service's readers are counted by the engines themselves (enginestub.engine.bucket).
RETIRED_ASSIGNMENT_ENV = frozenset({EngineEnv.name("concurrent_loaders")})
