"""The Helm chart: ``helm lint`` clean, bad values refused by its schema with a clear message."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parents[2] / "charts" / "matrixserve"


def test_helm_lint_is_clean(run_tool: Callable[..., Any]) -> None:
    result = run_tool("helm", "lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_bad_values_fail_with_the_schema_message(run_tool: Callable[..., Any]) -> None:
    bad_scale = run_tool(
        "helm", "template", "x", str(CHART), "--set", "engineTimeScale=-1", check=False
    )
    assert bad_scale.returncode != 0
    assert "engineTimeScale" in bad_scale.stderr
    typo = run_tool(
        "helm", "template", "x", str(CHART), "--set", "zookeper.external=a:1", check=False
    )
    assert typo.returncode != 0
    assert "zookeper" in typo.stderr
    bad_address = run_tool(
        "helm",
        "template",
        "x",
        str(CHART),
        "--set",
        "zookeeper.external=not an address",
        check=False,
    )
    assert bad_address.returncode != 0
    assert "zookeeper.external" in bad_address.stderr or "external" in bad_address.stderr
    good = run_tool("helm", "template", "x", str(CHART), "--set", "zookeeper.external=zk-0.zk:2181")
    assert good.returncode == 0
