"""What every test layer shares: the markers, applied here, not by hand.

Tests under ``tests/unit`` are ``unit``; any test that uses the ``cluster`` fixture (directly or
through another fixture) is ``cluster``. So ``pytest -m unit`` is the fast, cluster-free subset.

The fixtures live with the layer that uses them: ``tests/cluster/conftest.py`` (the local
cluster, namespaces, ZooKeeper, node emulators, operators), ``tests/engine/conftest.py`` (engine
processes on loopback); plain helpers are in ``testkit/helpers.py`` (shared with the benchmarks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

UNIT_TESTS = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(UNIT_TESTS):
            item.add_marker(pytest.mark.unit)
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
