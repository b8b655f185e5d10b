"""The expert pool's ZooKeeper payloads: versioned map paths and the routes a layer gives."""

from __future__ import annotations

import pytest

from matrixserve.api import zk_layout as zl


def test_paths_of_a_version_and_its_layers() -> None:
    paths = zl.ExpertPoolPaths("ns", "experts")
    assert paths.map == "/matrixserve/v1/expertpools/ns/experts/map"
    assert paths.layer(3, 57) == f"{paths.map}/v3/57"
    assert paths.server("srv-0") == "/matrixserve/v1/expertpools/ns/experts/servers/srv-0"
    with pytest.raises(ValueError, match="map version"):
        paths.version(0)
    with pytest.raises(ValueError, match="layer"):
        paths.layer(1, -1)


@pytest.mark.parametrize(
    ("child", "version"), [("v1", 1), ("v12", 12), ("v0", None), ("v01", None), ("x3", None)]
)
def test_only_version_children_name_a_version(child: str, version: int | None) -> None:
    assert zl.ExpertPoolPaths.version_of(child) == version


def test_routes_skip_disabled_slots_and_unknown_experts() -> None:
    layer = zl.ExpertMapLayer(layer=0, slots=[[0, 1], [1, 2, 9]], disabled=[[], [1]])
    assert layer.routes(3) == [[0], [0], [1]]


def test_server_report_round_trips_token_counts() -> None:
    report = zl.ExpertServerReport(
        pod="s0", podUid="u", podIP="127.0.0.9", port=8000, node="n", superpod="sp",
        dies=[0], roceIps=[], incarnation="i", ts=1.0, pool="ns/experts", slots=8,
        state=zl.ExpertServerState.SERVING, tokens={3: {7: 10}},
    )  # fmt: skip
    assert zl.ExpertServerReport.parse(report.dump()).tokens == {3: {7: 10}}
