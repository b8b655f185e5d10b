"""PDGroup's metrics (prefix ``matrixserve_operator_``), on the operator's registry, and how a
pass's plan is recorded in them: set-up phases (P/D-Serve §3.2), recoveries by fault and action
(minimum-cost recovery), scale operations by DeepServe phase and path (DeepServe §6), the P/D
split and Φ (P/D-Serve §2.1)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from matrixserve.adapters.metrics import Milestones
from matrixserve.api.status import (
    FaultStatus,
    LinksStatus,
    OptionStatus,
    PDGroupStatus,
    RatioStatus,
    ScaleRecord,
)
from matrixserve.domain import pdgroup as pd
from matrixserve.domain.effects import Effect
from matrixserve.domain.pdgroup.actions import ReportRatioChange, ReportRecovery
from matrixserve.domain.scaleout import Path, Phase

Key = tuple[str, str]  # (namespace, name)


class PDGroupMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.setup_phase_seconds = Histogram(
            "matrixserve_operator_setup_phase_seconds",
            "PDGroup setup phases (wall seconds): gather (created -> RoCE map), "
            "link (map -> all links), serve (links -> Ready)",
            ["phase"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self.links_verified = Gauge(
            "matrixserve_operator_links_verified",
            "Verified P-D sub-links per group",
            ["namespace", "group"],
            registry=registry,
        )
        self.groups_ready = Gauge(
            "matrixserve_operator_groups_ready", "PDGroups with Ready=True", registry=registry
        )
        # Recovery, by fault type (and by the action taken).
        recovery_buckets = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
        self.detection_seconds = Histogram(
            "matrixserve_operator_fault_detection_seconds",
            "From a fault (as best known) to the operator planning for it (wall seconds)",
            ["fault", "tier"],
            buckets=recovery_buckets,
            registry=registry,
        )
        self.restore_seconds = Histogram(
            "matrixserve_operator_recovery_restore_seconds",
            "From a fault's detection to its instances serving again (wall seconds)",
            ["fault", "action"],
            buckets=recovery_buckets,
            registry=registry,
        )
        self.capacity_lost = Counter(
            "matrixserve_operator_recovery_capacity_lost_seconds_total",
            "Capacity-seconds out of service during recoveries (the planner's weighted capacity "
            "fraction out x seconds until restored)",
            ["fault"],
            registry=registry,
        )
        self.recoveries = Counter(
            "matrixserve_operator_recoveries_total",
            "Recoveries by fault, action and outcome (planned, restored, failed)",
            ["fault", "action", "outcome"],
            registry=registry,
        )
        # Each scale operation's DeepServe phases (engine phases, emulated seconds)
        # and its total (wall seconds), by the path it came by.
        self.scale_phase_seconds = Histogram(
            "matrixserve_operator_scale_phase_seconds",
            "A new instance's engine phases (TEPreLoad, TELoad, TEPostLoad; emulated seconds) "
            "by the path it came by (Cold, WarmForkUB, WarmForkRoCE, WarmDRAM, WarmSSD, "
            "WarmSharedFileService)",
            ["phase", "path"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.scale_seconds = Histogram(
            "matrixserve_operator_scale_seconds",
            "From a new instance's start (its claim, or its pod's creation) to serving (wall "
            "seconds), by path",
            ["path"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=registry,
        )
        # The P/D split, as the ratio policy has it.
        self.ratio_instances = Gauge(
            "matrixserve_operator_ratio_instances",
            "Instances per role: serving now (current) and the policy's target",
            ["namespace", "group", "role", "which"],
            registry=registry,
        )
        self.ratio_changes = Counter(
            "matrixserve_operator_ratio_changes_total",
            "Target splits the ratio policy moved to, by policy",
            ["namespace", "group", "policy"],
            registry=registry,
        )
        self.ratio_phi = Gauge(
            "matrixserve_operator_ratio_phi",
            "Φ from the last observation window (requests per second per instance, P/D-Serve §2.1)",
            ["namespace", "group"],
            registry=registry,
        )
        self.per_group: list[tuple[Gauge | Counter, list[tuple[str, ...]]]] = [
            (self.links_verified, [()]),
            (self.ratio_phi, [()]),
            (self.ratio_changes, [(p,) for p in ("Fixed", "Model", "Feedback")]),
            (
                self.ratio_instances,
                [(r, w) for r in ("prefill", "decode") for w in ("current", "target")],
            ),
        ]
        self.ready: set[Key] = set()  # groups Ready=True
        self.setup = Milestones(
            self.setup_phase_seconds, [("mapped", "gather"), ("linked", "link"), ("ready", "serve")]
        )

    def record(self, key: Key, before: PDGroupStatus, plan: pd.Plan) -> None:
        """A pass's plan (``before``: the status it started from)."""
        self.record_setup(key, plan)
        self.record_recovery(plan.actions)
        self.record_scale(before, plan.status)
        self.record_ratio(*key, plan)
        self.links_verified.labels(*key).set((plan.status.links or LinksStatus()).verified)

    def forget_group(self, namespace: str, group: str) -> None:
        """A deleted group's series go with it (a dashboard must not show it serving)."""
        self.setup.forget((namespace, group))
        self.ready.discard((namespace, group))
        self.groups_ready.set(len(self.ready))
        for metric, rests in self.per_group:
            for rest in rests:
                with contextlib.suppress(KeyError):
                    metric.remove(namespace, group, *rest)

    def record_recovery(self, actions: Sequence[Effect]) -> None:
        """Recovery metrics, from this pass's recovery steps, each with its record: a
        plan is a detection, a restore is a time to restore and the capacity lost meanwhile (the
        plan's weighted capacity fraction out x the seconds until restored), a failure a count."""
        m = self
        for action in actions:
            if not isinstance(action, ReportRecovery) or action.record is None:
                continue
            record = action.record
            fault, plan = record.fault or FaultStatus(), record.plan or OptionStatus()
            kind, how = fault.kind, plan.action
            if action.reason == "RecoveryPlanned":
                m.detection_seconds.labels(kind, fault.detected_by).observe(
                    float(record.detected_after_seconds or 0.0)
                )
                m.recoveries.labels(kind, how, "planned").inc()
            elif action.reason == "Recovered":
                seconds = float(record.restored_after_seconds or 0.0)
                m.restore_seconds.labels(kind, how).observe(seconds)
                m.capacity_lost.labels(kind).inc(float(plan.lost_fraction or 0.0) * seconds)
                m.recoveries.labels(kind, how, "restored").inc()
            elif action.reason == "RecoveryFailed":
                m.recoveries.labels(kind, how, "failed").inc()

    def record_ratio(self, namespace: str, name: str, plan: pd.Plan) -> None:
        """The split's metrics: serving and target counts, Φ, and each change."""
        m, ratio = self, plan.status.ratio or RatioStatus()
        for which, split in (("current", ratio.current), ("target", ratio.target)):
            if split is not None:
                for role, value in (("prefill", split.prefill), ("decode", split.decode)):
                    m.ratio_instances.labels(namespace, name, role, which).set(value)
        if ratio.phi is not None:
            m.ratio_phi.labels(namespace, name).set(ratio.phi)
        else:  # no window observed under this policy (Fixed observes none): no Φ to show
            with contextlib.suppress(KeyError):
                m.ratio_phi.remove(namespace, name)
        changes = sum(1 for a in plan.actions if isinstance(a, ReportRatioChange))
        if changes:
            m.ratio_changes.labels(namespace, name, str(ratio.policy or "")).inc(changes)

    def record_scale(self, before: PDGroupStatus, after: PDGroupStatus) -> None:
        """A new ``lastScale`` record: its engine phases and its wall total."""
        record = after.last_scale
        if record is None or not record.dump():
            return
        if (before.last_scale or ScaleRecord()).pod_uid == record.pod_uid:
            return
        path = str(record.path or "")
        if path not in set(Path):  # a label value from a pod's annotation: only the known ones
            path = "Unknown"
        for phase, seconds in (record.phases or {}).items():
            if phase in set(Phase):  # the engine's keys: only DeepServe's phases
                self.scale_phase_seconds.labels(phase, path).observe(float(seconds))
        self.scale_seconds.labels(path).observe(float(record.wall_seconds or 0.0))

    def record_setup(self, key: Key, plan: pd.Plan) -> None:
        """The setup phases' wall times (gather, link, serve), and the count of Ready groups."""
        links = plan.status.links or LinksStatus()
        reached = {
            "mapped": bool(plan.status.roce_map_version),
            "linked": bool(links.expected) and links.verified == links.expected,
            "ready": plan.ready,
        }
        self.setup.update(key, reached, time.monotonic())
        if plan.ready:
            self.ready.add(key)
        else:
            self.ready.discard(key)
        self.groups_ready.set(len(self.ready))
