"""The PDGroup controller: what the kind keeps at run time (its per-object loop, its ZooKeeper
store, its metrics) and its set-up, including the sweep of subtrees whose group is gone on every
new ZooKeeper session (issue 15)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.domain.pdgroup import cleanup
from matrixserve.handlers.metrics import Milestones
from matrixserve.handlers.reconciler import Key, Reconciler
from matrixserve.handlers.runtime import Runtime

KIND = kinds.PDGROUP
API = (KIND.group, KIND.version, KIND.plural)
log = logging.getLogger("matrixserve.pdgroup")


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
        # Issue 17: recovery, by fault type (and by the action taken).
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
        # Issue 18: each scale operation's DeepServe phases (engine phases, emulated seconds)
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
        # Issue 19: the P/D split, as the ratio policy has it.
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
        self.setup = Milestones(
            self.setup_phase_seconds, [("mapped", "gather"), ("linked", "link"), ("ready", "serve")]
        )

    def forget_group(self, namespace: str, group: str) -> None:
        """A deleted group's series go with it (a dashboard must not show it serving)."""
        for metric, rests in self.per_group:
            for rest in rests:
                with contextlib.suppress(KeyError):
                    metric.remove(namespace, group, *rest)


@dataclass
class PDGroups:
    """The PDGroup controller: its loop, its ZooKeeper store, its metrics."""

    rt: Runtime
    loop: Reconciler
    store: GroupStore
    metrics: PDGroupMetrics
    ready: set[Key] = field(default_factory=set)
    # Groups whose ZooKeeper subtree this run has closed (or found closed): not walked again.
    closed: set[Key] = field(default_factory=set)
    kind: kinds.Kind = KIND

    def forget(self, key: Key) -> None:
        self.metrics.setup.forget(key)
        self.ready.discard(key)
        self.closed.discard(key)
        self.metrics.groups_ready.set(len(self.ready))
        self.metrics.forget_group(*key)


def install(rt: Runtime) -> PDGroups:
    groups = PDGroups(
        rt, rt.reconciler(KIND), GroupStore(rt.session), PDGroupMetrics(rt.metrics.registry)
    )
    rt.add_sweep(lambda: sweep(groups))
    return groups


async def sweep(groups: PDGroups) -> None:
    """Remove the subtrees of groups that no longer exist (ZooKeeper listed first: see
    :func:`cleanup.orphans`), and the fork-source folders their engines left empty (a source
    is an engine's ephemeral znode: its key's folder, and its namespace's, outlive it)."""
    namespaces = groups.rt.config.namespaces
    try:
        in_zookeeper = await groups.store.groups(namespaces)
        in_kubernetes = await groups.rt.kube.names(KIND, namespaces)
        for namespace, name in cleanup.orphans(in_zookeeper, in_kubernetes):
            await groups.store.delete(namespace, name)
            log.info(
                "swept the ZooKeeper subtree of %s/%s: the group no longer exists", namespace, name
            )
        for folder in await groups.store.prune_fork_sources(namespaces):
            log.info("swept the empty fork-source folder %s", folder)
    except Exception as exc:  # retried on the next sweep
        log.warning("sweep of ZooKeeper subtrees failed: %s", exc)


def groups_of(memo: kopf.Memo) -> PDGroups:
    groups: PDGroups = memo.runtime.controllers[KIND.kind]
    return groups
