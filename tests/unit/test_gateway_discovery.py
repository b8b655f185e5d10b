"""The gateway's PDGroup routes (``matrixserve.gateway.discovery``): a spec is read as a
``PDGroupSpec``, and a spec that does not validate keeps the group routed by its last valid one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import pytest
from kubernetes import client

from matrixserve.coordination import Session
from matrixserve.domain.gateway.routing import Entrance
from matrixserve.gateway.discovery import Discovery


class _Zk:
    """What the discovery asks of its ZooKeeper session before it starts (nothing is watched
    here)."""

    connected = False

    def add_listener(self, listener: Callable[[str], None]) -> None:
        pass


def _spec(scenario: str = "general", ttft_ms: int = 2000, batch: int = 8) -> dict[str, Any]:
    return {
        "service": "chat",
        "scenario": scenario,
        "model": {"name": "llama3-8b"},
        "prefill": {"replicas": 2, "batchSize": batch},
        "decode": {"replicas": 1},
        "slo": {"ttftMilliseconds": ttft_ms, "ttftMillisecondsPer1kTokens": 30},
    }


def _group(generation: int, spec: dict[str, Any], *prefills: str) -> dict[str, Any]:
    """A PDGroup as the API server lists it, its status naming ``prefills`` as entrances."""
    rows = [
        {"name": p, "state": "Serving", "endpoint": f"127.0.1.{i + 2}:8000"}
        for i, p in enumerate(prefills)
    ]
    return {
        "metadata": {"namespace": "ns", "name": "g", "generation": generation},
        "spec": spec,
        "status": {"entrances": list(prefills), "instances": rows},
    }


@pytest.fixture
def discovery() -> Discovery:
    return Discovery(client.ApiClient(), cast(Session, _Zk()), "ns")


def _invalid_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "invalid spec" in r.getMessage()]


def test_a_valid_spec_sets_the_route(discovery: Discovery) -> None:
    discovery._upsert(_group(1, _spec(ttft_ms=500, batch=4), "g-p-0"))
    (route,) = discovery.routes("general")
    assert (route.scenario, route.ttft_ms, route.ttft_per_1k_ms, route.prefill_batch) == (
        "general",
        500,
        30,
        4,
    )
    assert route.entrances == [Entrance("g-p-0", "127.0.1.2:8000")]


def test_an_invalid_spec_keeps_the_last_valid_settings_and_follows_the_entrances(
    discovery: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="matrixserve.gateway")
    discovery._upsert(_group(1, _spec(ttft_ms=500), "g-p-0"))
    bad = _spec(scenario="Not A Scenario", ttft_ms=9)  # fails the scenario's pattern
    discovery._upsert(_group(2, bad, "g-p-0", "g-p-1"))
    discovery._upsert(_group(2, bad, "g-p-1"))  # a status update of the same generation

    (route,) = discovery.routes("general")
    assert discovery.routes("Not A Scenario") == []
    assert route.ttft_ms == 500
    assert route.entrances == [Entrance("g-p-1", "127.0.1.2:8000")]
    logs = _invalid_logs(caplog)
    assert len(logs) == 1
    assert "generation 2" in logs[0]
    assert "spec.scenario" in logs[0]
    assert "still routed by its last valid spec" in logs[0]

    discovery._upsert(_group(3, {**bad, "slo": {"ttftMilliseconds": 0}}, "g-p-1"))
    assert len(_invalid_logs(caplog)) == 2  # a new generation is said again

    discovery._upsert(_group(4, _spec(scenario="batch", ttft_ms=700), "g-p-1"))
    (route,) = discovery.routes("batch")
    assert route.ttft_ms == 700
    assert discovery.routes("general") == []


def test_a_group_never_valid_here_is_routed_by_its_scenario_and_slo_if_those_parse(
    discovery: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway restarted while a group's spec is invalid keeps the group reachable (the
    operator keeps it serving); one without even a valid scenario is not routed."""
    caplog.set_level(logging.WARNING, logger="matrixserve.gateway")
    broken = {**_spec(ttft_ms=600, batch=4), "decode": {"replicas": -1}}
    assert discovery._upsert(_group(1, broken, "g-p-0")) == ("ns", "g")
    (route,) = discovery.routes("general")
    assert (route.ttft_ms, route.ttft_per_1k_ms, route.prefill_batch) == (600, 30, 4)
    assert route.entrances == [Entrance("g-p-0", "127.0.1.2:8000")]
    (log,) = _invalid_logs(caplog)
    assert "spec.decode.replicas" in log

    other = Discovery(client.ApiClient(), cast(Session, _Zk()), "ns")
    other._upsert(_group(1, {"scenario": "Not A Scenario"}, "g-p-0"))
    assert other.scenarios() == []
