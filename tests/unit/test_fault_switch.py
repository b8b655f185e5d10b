"""Issue 16 finding 7: fault injection is off unless enabled, at every layer that decides it:
the engine's flag and environment, the engine pods the operator creates, the operator's flag."""

from __future__ import annotations

import pytest

from enginestub.engine.config import ConfigError, parse
from matrixserve import __main__ as operator_main
from matrixserve.domain.enginepod import EngineSettings, platform_env


@pytest.mark.parametrize(
    ("env", "argv", "enabled"),
    [
        (None, [], False),  # the default: off
        ("1", [], True),
        ("true", [], True),
        ("0", [], False),
        (None, ["--fault-injection"], True),
        ("1", ["--no-fault-injection"], False),  # the flag wins over the environment
    ],
)
def test_the_engine_takes_faults_only_when_switched_on(
    monkeypatch: pytest.MonkeyPatch, env: str | None, argv: list[str], enabled: bool
) -> None:
    monkeypatch.delenv("ENGINE_FAULT_INJECTION", raising=False)
    if env is not None:
        monkeypatch.setenv("ENGINE_FAULT_INJECTION", env)
    assert parse(argv).fault_injection is enabled


def test_a_misspelt_switch_is_refused_not_read_as_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_FAULT_INJECTION", "yes please")
    with pytest.raises(ConfigError, match="ENGINE_FAULT_INJECTION"):
        parse([])


@pytest.mark.parametrize(("argv", "value"), [([], "0"), (["--engine-fault-injection"], "1")])
def test_the_operator_switches_it_on_its_engines(argv: list[str], value: str) -> None:
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook", *argv])
    env = {e["name"]: e.get("value") for e in platform_env(config.engine)}
    assert env["ENGINE_FAULT_INJECTION"] == value
    assert EngineSettings("zk:2181").fault_injection is False
