"""The chart ships the repository's CRDs unchanged (Helm installs ``crds/`` but never upgrades
them, so a drift here would mean installs and ``kubectl apply -f crds/`` disagree)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_chart_crds_are_the_repository_crds_byte_for_byte() -> None:
    ours = {p.name: p.read_bytes() for p in (REPO / "crds").glob("matrixserve.io_*.yaml")}
    chart = {
        p.name: p.read_bytes() for p in (REPO / "charts" / "matrixserve" / "crds").glob("*.yaml")
    }
    assert sorted(ours) == sorted(chart)
    assert len(ours) == 4
    for name, text in ours.items():
        assert chart[name] == text, f"charts/matrixserve/crds/{name} differs from crds/{name}"
