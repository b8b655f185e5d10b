"""Operator metrics, defined once, prefix ``matrixserve_operator_``: the ones every kind shares
(:class:`OperatorMetrics`, labelled by kind) and each kind's own, on the same registry."""

from __future__ import annotations

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


class PDGroupMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.setup_phase_seconds = Histogram(
            "matrixserve_operator_setup_phase_seconds",
            "PDGroup setup phases (wall seconds): gather (created -> RoCE map), link (map -> all links), "
            "serve (links -> Ready)",
            ["phase"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.links_verified = Gauge(
            "matrixserve_operator_links_verified",
            "Verified P-D sub-links per group",
            ["namespace", "group"],
            registry=r,
        )
        self.groups_ready = Gauge(
            "matrixserve_operator_groups_ready", "PDGroups with Ready=True", registry=r
        )
