"""Operator metrics, defined once, prefix ``matrixserve_operator_``: the ones every kind shares,
labelled by kind. A kind's own metrics live in its handler module, on the same registry."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ZK_STATES = ("CONNECTED", "SUSPENDED", "LOST", "CONNECTING")


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            "matrixserve_operator_reconcile_seconds",
            "Wall time of one reconcile pass",
            ["kind"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.reconcile_cpu_seconds = Counter(
            "matrixserve_operator_reconcile_cpu_seconds",
            "CPU time spent reconciling",
            ["kind"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "matrixserve_operator_reconcile_errors",
            "Reconcile passes that failed",
            ["kind"],
            registry=r,
        )
        self.actions = Counter(
            "matrixserve_operator_actions", "Actions applied, by type", ["action"], registry=r
        )
        self.zk_state = Gauge(
            "matrixserve_operator_zookeeper_session_state",
            "1 for the current ZooKeeper session state",
            ["state"],
            registry=r,
        )

    def set_zk_state(self, state: str) -> None:
        for s in ZK_STATES:
            self.zk_state.labels(state=s).set(1 if s == state else 0)


class Milestones:
    """When each object first reached each of its milestones (in order: a milestone counts only
    after the one before it), and the wall time of the phase leading to each, observed once per
    object in ``histogram`` under the phase's label."""

    def __init__(self, histogram: Histogram, phases: Sequence[tuple[str, str]]) -> None:
        self.histogram = histogram
        self.phases = phases  # (milestone, the label of the phase that ends there), in order
        self.marks: dict[Hashable, dict[str, float]] = {}

    def start(self, key: Hashable, now: float) -> None:
        self.marks.setdefault(key, {"created": now})

    def update(self, key: Hashable, reached: Mapping[str, bool], now: float) -> None:
        marks = self.marks.setdefault(key, {"created": now})
        previous = "created"
        for milestone, phase in self.phases:
            if milestone not in marks and previous in marks and reached[milestone]:
                marks[milestone] = now
                self.histogram.labels(phase=phase).observe(now - marks[previous])
            previous = milestone

    def forget(self, key: Hashable) -> None:
        self.marks.pop(key, None)
