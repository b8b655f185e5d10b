"""ExpertPool's metrics (prefix ``matrixserve_expertpool_``), on the operator's registry: the
servers wanted and serving, the map version, experts short of copies or uncovered (EaaS §3.4,
§4.4), failovers restored by the path their replacement came (a warm pod's, cold, or the engine
restarted in place; DeepServe §6) with the seconds to coverage restored, and scale events by
who asked (spec or autoscaler; EaaS §5.3).

Gauges follow the status of every pass; the counters count an event once, when a pass first
shows it (its time differs from the last one seen), and not the one an operator finds in the
status at its start (counted by the operator that saw it happen)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from matrixserve.api.status import ExpertPoolStatus

IN_PLACE = "InPlace"  # a failover restored by the failed server's own restart (no replacement)


class ExpertPoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["namespace", "pool"]
        self.servers = Gauge(
            "matrixserve_expertpool_servers",
            "Expert servers by state (desired: the spec's; serving: live in the map in force)",
            [*labels, "state"],
            registry=registry,
        )
        self.map_version = Gauge(
            "matrixserve_expertpool_map_version",
            "Version of the expert map in force in ZooKeeper",
            labels,
            registry=registry,
        )
        self.experts = Gauge(
            "matrixserve_expertpool_experts",
            "Experts short of copies in some layer (underReplicated: fewer than "
            "minReplicasPerExpert live; uncovered: none live)",
            [*labels, "coverage"],
            registry=registry,
        )
        self.failovers = Counter(
            "matrixserve_expertpool_failovers",
            "Failovers restored, by the path of the replacement (a scale-out path, or InPlace: "
            "the server's own restart)",
            [*labels, "path"],
            registry=registry,
        )
        self.restore_seconds = Gauge(
            "matrixserve_expertpool_failover_restore_seconds",
            "The last failover's seconds from the failure seen to every expert's copies "
            "restored, by path",
            [*labels, "path"],
            registry=registry,
        )
        self.scales = Counter(
            "matrixserve_expertpool_scale_events",
            "Changes of the server count, by who asked (spec or autoscaler)",
            [*labels, "by"],
            registry=registry,
        )
        # per pool: the last failover restored and scale event seen (their times)
        self.seen: dict[tuple[str, str], tuple[float | None, float | None]] = {}
        self.shown: dict[tuple[str, str], set[tuple[str, str]]] = {}  # labelled series

    def record(self, namespace: str, pool: str, status: ExpertPoolStatus) -> None:
        key = (namespace, pool)
        self.servers.labels(namespace, pool, "desired").set(status.wanted_servers or 0)
        self.servers.labels(namespace, pool, "serving").set(status.ready_servers)
        self.map_version.labels(namespace, pool).set(status.map_version)
        coverage = status.coverage
        self.experts.labels(namespace, pool, "underReplicated").set(coverage.under_replicated)
        self.experts.labels(namespace, pool, "uncovered").set(coverage.uncovered)
        failover, scale = status.last_failover, status.last_scale
        restored = failover.restored_at if failover else None
        scaled = scale.at if scale else None
        if key in self.seen:
            last_restored, last_scaled = self.seen[key]
            if failover is not None and restored is not None and restored != last_restored:
                path = failover.replacement_path or IN_PLACE
                self.failovers.labels(namespace, pool, path).inc()
                self.restore_seconds.labels(namespace, pool, path).set(
                    failover.restored_seconds or 0.0
                )
                self.shown.setdefault(key, set()).add(("path", path))
            if scale is not None and scaled != last_scaled:
                self.scales.labels(namespace, pool, scale.by).inc()
                self.shown.setdefault(key, set()).add(("by", scale.by))
        self.seen[key] = (restored, scaled)

    def forget(self, namespace: str, pool: str) -> None:
        """A pool that is gone (or no longer this replica's) exports nothing."""
        key = (namespace, pool)
        self.seen.pop(key, None)
        for state in ("desired", "serving"):
            with contextlib.suppress(KeyError):
                self.servers.remove(namespace, pool, state)
        for coverage in ("underReplicated", "uncovered"):
            with contextlib.suppress(KeyError):
                self.experts.remove(namespace, pool, coverage)
        with contextlib.suppress(KeyError):
            self.map_version.remove(namespace, pool)
        for kind, value in self.shown.pop(key, set()):
            series = (self.failovers, self.restore_seconds) if kind == "path" else (self.scales,)
            for metric in series:
                with contextlib.suppress(KeyError):
                    metric.remove(namespace, pool, value)
