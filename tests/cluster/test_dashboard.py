"""Issue 16 finding 9: every panel of the chart's Grafana dashboard shows data on a running group.

A 2P1D group serves a few requests through the gateway; then the operator's, the gateway's and
each engine pod's ``/metrics`` are scraped, and every series a panel's query selects must exist
with its label matchers (a counter under ``rate``/``increase`` must have counted something). The
P/D ratio panel counts the engines by role: 2 prefill and 1 decode, not every engine as "auto".
There is no Prometheus here; the selectors are read from the queries (the dashboard uses only
plain selectors with ``=`` matchers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from matrixserve.api.kinds import LABEL_GROUP
from testkit.helpers import Groups, wait_for

DASHBOARD = (
    Path(__file__).resolve().parents[2]
    / "charts"
    / "matrixserve"
    / "dashboards"
    / "matrixserve.json"
)
SELECTOR = re.compile(r"\b(matrixserve_[a-z_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)="([^"]*)"')
COUNTING = re.compile(r"\b(?:rate|increase)\(\s*(matrixserve_[a-z_]+)")

Sample = tuple[str, dict[str, str], float]


def _queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def _scrape(url: str) -> list[Sample]:
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _selected(samples: list[Sample], name: str, labels: dict[str, str]) -> list[Sample]:
    return [s for s in samples if s[0] == name and all(s[1].get(k) == v for k, v in labels.items())]


def test_the_selector_reader_sees_what_a_panel_asks_for() -> None:
    """The reader itself: every query names at least one series (else the test below would
    pass on queries it cannot read)."""
    queries = _queries()
    assert len(queries) >= 10
    for title, expr in queries:
        assert SELECTOR.findall(expr), (title, expr)
    found = SELECTOR.findall('count(matrixserve_engine_info{role="prefill"})')
    assert found == [("matrixserve_engine_info", 'role="prefill"')]


def test_every_dashboard_panel_has_data_on_a_serving_group(
    serving_group: Callable[..., Any],
    gateway: str,
    groups: Groups,
    api_client: client.ApiClient,
) -> None:
    operator = serving_group()
    wait_for(
        lambda: httpx.get(f"{gateway}/v1/models", trust_env=False).json()["data"],
        what="the gateway routing the group's scenario",
    )
    for stream in (False, True, False, True):
        r = httpx.post(
            f"{gateway}/v1/completions",
            json={"model": "general", "prompt": "hi " * 50, "max_tokens": 4, "stream": stream},
            timeout=30,
            trust_env=False,
        )
        assert r.status_code == 200, r.text
    pods = client.CoreV1Api(api_client).list_namespaced_pod(
        groups.namespace, label_selector=f"{LABEL_GROUP}=g"
    )
    engines = [f"http://{p.status.pod_ip}:8000" for p in pods.items]
    assert len(engines) == 3
    samples: list[Sample] = []
    for url in (operator.metrics_url.removesuffix("/metrics"), gateway, *engines):
        samples += _scrape(url)

    empty = []
    for title, expr in _queries():
        counted = set(COUNTING.findall(expr))
        for name, matchers in SELECTOR.findall(expr):
            selected = _selected(samples, name, dict(MATCHER.findall(matchers)))
            if name in counted:
                selected = [s for s in selected if s[2] > 0]
            if "== 1" in expr:
                selected = [s for s in selected if s[2] == 1]
            if not selected:
                empty.append(f"{title}: {name}{{{matchers}}}")
    assert not empty, "panels without data:\n" + "\n".join(empty)

    # the P/D ratio panel's counts are the group's: one info series per engine, by its role
    by_role = [s[1]["role"] for s in samples if s[0] == "matrixserve_engine_info"]
    assert sorted(by_role) == ["decode", "prefill", "prefill"], by_role
