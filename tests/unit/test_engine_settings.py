"""The engine's environment as one contract (``matrixserve.api.engine_settings``): what the
operator writes into an engine pod, the engine reads back as the same settings; a pod's ``env``
keeps its order; a claimed warm pod's assignment carries the instance's settings alone; the
processes that read a variable by its own constant agree with the contract; one load source
enum serves every side."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from enginestub import timing
from enginestub.engine.config import parse, parse_warm
from enginestub.node.podenv import SSD_MODELS_ENV
from matrixserve import __main__ as operator_main
from matrixserve import coordination
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_settings import (
    ASSIGNMENT_ENV,
    EngineEnv,
    LoadSource,
    downward_env,
)
from matrixserve.api.resources import PDGroupSpec, WarmShape
from matrixserve.api.roles import Role
from matrixserve.domain import scaleout
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.pdgroup import pods as group_pods
from matrixserve.domain.warmpool import pods as warm_pods

SPEC = PDGroupSpec.model_validate(
    {
        "service": "chat",
        "scenario": "general",
        "model": {"name": "llama3-8b", "maxContextTokens": 4096},
        "prefill": {"replicas": 1, "parallelism": {"tp": 2, "ep": 2}, "batchSize": 4},
        "decode": {"replicas": 1, "batchSize": 32},
        "slo": {"tpotMilliseconds": 50},
    }
)
AUTH = zl.Credentials.parse("matrixserve:s3cret")
SETTINGS = EngineSettings(
    "127.0.0.1:2181",
    time_scale="100",
    load_source=LoadSource.HOST_DRAM,
    health_interval_seconds="5",
    admission="queue",
    fault_injection=True,
    pre_load_seconds="0",
    zookeeper_auth=AUTH,
)
# What the kubelet and the node give the pod besides its manifest's values.
DOWNWARD = {"POD_NAME": "g-p-0", "POD_UID": "uid-1", "POD_NAMESPACE": "ns", "POD_IP": "127.0.0.8"}
NODE = EngineEnv(
    npus="0",
    dies="0,1",
    roce_ips="198.19.0.1,198.19.0.2",
    node_name="sp0-server-00",
    superpod="sp0",
    node_pod_ip="127.0.0.8",
).to_dict()


@pytest.fixture
def credentials(tmp_path: Path) -> Path:
    """The file the engine reads ZooKeeper's identity from (a mounted Secret's, in a pod)."""
    path = tmp_path / "auth"
    path.write_text(AUTH.text())
    return path


def _group_pod_env(role: Role) -> list[dict[str, Any]]:
    """The engine container's env of a PDGroup instance's pod."""
    manifest = group_pods.pod_manifest("ns", "g", "uid", "g-p-0", role, SPEC, SETTINGS)
    env: list[dict[str, Any]] = manifest["spec"]["containers"][0]["env"]
    return env


def _warm_pod_env(settings: EngineSettings) -> list[dict[str, Any]]:
    """The engine container's env of a warm pod."""
    shape = WarmShape.model_validate({"size": 1, "devicesPerPod": 2})
    manifest = warm_pods.pod_manifest("ns", "pool", "uid", "w0", "s", shape, "engine:1", settings)
    env: list[dict[str, Any]] = manifest["spec"]["containers"][0]["env"]
    return env


def _process_env(container_env: list[dict[str, Any]], credentials: Path) -> dict[str, str]:
    """The engine process's environment from its container's ``env``: the downward API's fields
    resolved, the credential file where the test keeps it, the node's variables added."""
    env = {e["name"]: e["value"] for e in container_env if "value" in e}
    assert {e["name"] for e in container_env if "valueFrom" in e} == set(DOWNWARD)
    env[EngineEnv.name("zookeeper_auth_file")] = str(credentials)
    return {**env, **DOWNWARD, **NODE}


def test_a_pod_env_keeps_the_order_every_engine_pod_has() -> None:
    """A container's env is a list, compared as one: the contract's declaration order is every
    manifest's order, and a field moved there would show here."""
    downward = ["POD_NAME", "POD_UID", "POD_NAMESPACE", "POD_IP"]
    platform = [
        "ENGINE_LOAD_SOURCE",
        "ENGINE_HEALTH_INTERVAL",
        "ENGINE_LINK_TIMEOUT",
        "MATRIXSERVE_TIME_SCALE",
        "ENGINE_ADMISSION",
        "ENGINE_FAULT_INJECTION",
    ]
    assert [e["name"] for e in _group_pod_env(Role.PREFILL)] == [
        *downward,
        "ENGINE_ROLE",
        "ENGINE_MODEL",
        "ENGINE_MAX_BATCH",
        "ENGINE_MAX_PROMPT_TOKENS",
        "ENGINE_MAX_OUTPUT_TOKENS",
        *platform,
        "ENGINE_PRE_LOAD_SECONDS",
        "MATRIXSERVE_ZK_AUTH_FILE",
        "MATRIXSERVE_GROUP",
        "MATRIXSERVE_ZK",
        "ENGINE_TPOT_SLO_MS",
        "ENGINE_TP",
        "ENGINE_EP",
    ]
    warm = _warm_pod_env(EngineSettings("127.0.0.1:2181"))
    assert [e["name"] for e in warm] == [*downward, "ENGINE_WARM", *platform, "MATRIXSERVE_ZK"]


def test_what_the_operator_writes_the_engine_reads(
    monkeypatch: pytest.MonkeyPatch, credentials: Path
) -> None:
    env = _process_env(_group_pod_env(Role.PREFILL), credentials)
    monkeypatch.setattr(os, "environ", env)
    written = group_pods.engine_settings("ns", "g", Role.PREFILL, SPEC, SETTINGS)
    read = EngineEnv.from_env(env)
    # all the operator wrote, read back (but the credential file, which the test keeps elsewhere)
    elsewhere = {field for field, name in EngineEnv.NAMES.items() if name in {**DOWNWARD, **NODE}}
    elsewhere.add("zookeeper_auth_file")
    assert {f: v for f, v in dataclasses.asdict(read).items() if f not in elsewhere} == {
        f: v for f, v in dataclasses.asdict(written).items() if f not in elsewhere
    }

    config = parse([])
    assert config.role == "auto"
    assert config.model.name == "llama3-8b"
    assert (config.max_batch, config.tp, config.ep) == (4, 2, 2)
    assert (config.max_prompt_tokens, config.max_output_tokens) == (4096, 4096)
    assert config.tpot_slo_ms == 50
    assert config.load_source is LoadSource.HOST_DRAM
    assert (config.time_scale, config.health_interval, config.admission) == (100.0, 5.0, "queue")
    assert config.fault_injection is True
    assert config.pre_load_seconds == 0
    assert config.zookeeper_auth == AUTH
    assert (config.group, config.zookeeper) == ("ns/g", "127.0.0.1:2181")
    assert (config.instance, config.pod, config.pod_uid) == ("g-p-0", "g-p-0", "uid-1")
    assert (config.host, config.node, config.superpod) == ("127.0.0.8", "sp0-server-00", "sp0")
    assert (config.dies, config.roce_ips, config.npus) == (
        [0, 1],
        ["198.19.0.1", "198.19.0.2"],
        [0],
    )


def test_a_warm_pod_is_read_as_a_warm_engine(
    monkeypatch: pytest.MonkeyPatch, credentials: Path
) -> None:
    monkeypatch.setattr(os, "environ", _process_env(_warm_pod_env(SETTINGS), credentials))
    warm = parse_warm([])
    assert warm is not None
    assert (warm.pod, warm.pod_uid, warm.namespace) == ("g-p-0", "uid-1", "ns")
    assert (warm.zookeeper, warm.zookeeper_auth) == ("127.0.0.1:2181", AUTH)
    assert (warm.time_scale, warm.pre_load_seconds) == (100.0, 0.0)


def test_an_assignment_carries_the_instances_settings_in_the_pods_order() -> None:
    for role in Role:
        settings = group_pods.engine_settings("ns", "g", role, SPEC, SETTINGS)
        env = group_pods.engine_env("ns", "g", role, SPEC, SETTINGS)
        expected = [(e["name"], e["value"]) for e in env if e["name"] in ASSIGNMENT_ENV]
        assert list(settings.assignment().items()) == expected
        assert "MATRIXSERVE_ZK" not in settings.assignment()
    assert zl.ASSIGNMENT_ENV is ASSIGNMENT_ENV


def test_every_variable_has_one_name_and_reads_back() -> None:
    names = list(EngineEnv.NAMES.values())
    assert len(set(names)) == len(names)
    every = EngineEnv(**{field: f"value of {field}" for field in EngineEnv.NAMES})
    assert EngineEnv.from_env({**every.to_dict(), "PATH": "/bin"}) == every
    assert EngineEnv.from_env({}) == EngineEnv()
    assert EngineEnv.from_env({"ENGINE_TP": ""}).tp == ""  # set empty is not unset
    with pytest.raises(KeyError):
        EngineEnv.name("no_such_setting")


def test_the_downward_api_gives_the_pods_own_fields() -> None:
    assert downward_env() == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def test_the_processes_own_names_are_the_contracts() -> None:
    """Variables some process reads by a constant of its own: the same names."""
    assert EngineEnv.name("zookeeper_auth") == coordination.AUTH_ENV
    assert EngineEnv.name("zookeeper_auth_file") == coordination.AUTH_FILE_ENV
    assert EngineEnv.name("ssd_models") == SSD_MODELS_ENV


def test_one_load_source_enum_on_both_sides() -> None:
    assert timing.LoadSource is LoadSource
    assert set(scaleout.LOAD_SOURCE.values()) <= set(LoadSource)
    assert set(scaleout.prior_load_seconds(1e10, 2, 1)) == set(LoadSource)
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook"])
    assert config.engine.load_source is LoadSource.SHARED_FILE_SERVICE
    with pytest.raises(SystemExit):
        operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook", "--engine-load-source", "x"])
    for source in LoadSource:
        config, _ = operator_main.parse(
            ["--zookeeper", "zk:2181", "--no-webhook", "--engine-load-source", source.value]
        )
        assert config.engine.load_source is source


def test_only_the_decodes_of_a_disaggregated_group_are_the_pools_attention_clients() -> None:
    """EaaS §5.1: decoding only. A group without ``moe`` writes no pool, as before."""
    raw = SPEC.model_dump(by_alias=True, exclude_none=True)
    moe = {"mode": "Disaggregated", "expertPoolRef": {"name": "experts"}}
    spec = PDGroupSpec.model_validate(raw | {"moe": moe})
    name = EngineEnv.name("expert_pool")
    decode = group_pods.engine_settings("ns", "g", Role.DECODE, spec, SETTINGS).to_dict()
    prefill = group_pods.engine_settings("ns", "g", Role.PREFILL, spec, SETTINGS).to_dict()
    assert decode[name] == "ns/experts"
    assert name not in prefill
    plain = group_pods.engine_settings("ns", "g", Role.DECODE, SPEC, SETTINGS).to_dict()
    assert name not in plain
    assert name in ASSIGNMENT_ENV  # a claimed warm pod becomes a client too
