"""WarmPool's metrics (prefix ``matrixserve_warmpool_``), on the operator's registry: warm pods
by pool, shape and state, and claims by NPU-fork (DeepServe §6.1)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Gauge

from matrixserve.api.status import WarmPoolStatus


class WarmPoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pods = Gauge(
            "matrixserve_warmpool_pods",
            "Warm pods by pool, shape and state (ready: claimable; warming; claimed: a group's)",
            ["namespace", "pool", "shape", "state"],
            registry=registry,
        )
        self.forks = Gauge(
            "matrixserve_warmpool_fork_claims",
            "Claimed pods of the pool whose claim chose an NPU-fork path",
            ["namespace", "pool"],
            registry=registry,
        )
        self.shown: dict[tuple[str, str], set[str]] = {}  # shapes exported, by pool

    def record(self, namespace: str, pool: str, status: WarmPoolStatus) -> None:
        shapes = {row.name: row for row in status.shapes}
        for gone in self.shown.get((namespace, pool), set()) - set(shapes):
            for state in ("ready", "warming", "claimed"):
                self.pods.remove(namespace, pool, gone, state)
        for shape, row in shapes.items():
            for state in ("ready", "warming", "claimed"):
                self.pods.labels(namespace, pool, shape, state).set(getattr(row, state))
        self.shown[(namespace, pool)] = set(shapes)
        self.forks.labels(namespace, pool).set(status.forks_done)

    def forget(self, namespace: str, pool: str) -> None:
        """A pool that is gone exports nothing."""
        for shape in self.shown.pop((namespace, pool), set()):
            for state in ("ready", "warming", "claimed"):
                self.pods.remove(namespace, pool, shape, state)
        with contextlib.suppress(KeyError):
            self.forks.remove(namespace, pool)
