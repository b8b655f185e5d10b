"""What the PDGroup planner knows: the group's spec, its pods (as instances), its ZooKeeper
subtree, and how the platform starts engines. Frozen; built by the handler each pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.observed import InstanceView, PodView, group_instances
from matrixserve.domain.pdgroup.pods import pod_names, role_of


@dataclass(frozen=True)
class ZkView:
    """The group's subtree as read in one pass (P/D-Serve §3.2-3.4); ``connected=False``: no
    coordination, so nothing destructive may be planned."""

    connected: bool
    reports: Mapping[str, zl.Report] = field(default_factory=dict)
    roce_map: zl.RoceMap | None = None
    init_order: zl.InitOrder | None = None
    links: Mapping[tuple[str, str], zl.Link] = field(default_factory=dict)
    health: Mapping[str, zl.Health] = field(default_factory=dict)
    decode_meta: zl.DecodeMeta | None = None
    entrances: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GroupView:
    namespace: str
    name: str
    generation: int
    spec: PDGroupSpec
    pods: Mapping[str, PodView]  # by pod name
    zk: ZkView
    now: float
    uid: str  # the PDGroup's, for its pods' owner reference
    engine: EngineSettings

    @cached_property
    def instances(self) -> dict[str, InstanceView]:
        """The group's pods gathered into instances: a pod belongs to the instance its label
        names only if its name is one of that instance's pod names; any other pod (a stray
        carrying the group's label) is an instance of its own, which the plan releases."""
        return group_instances(self.pods, self._instance_of)

    def _instance_of(self, pod: PodView) -> str:
        instance = pod.label(kinds.LABEL_INSTANCE)
        if instance is None:
            return pod.name
        role = self.spec.prefill if role_of(pod) is zl.Role.PREFILL else self.spec.decode
        return instance if pod.name in pod_names(instance, role.pods_per_instance) else pod.name

    def healthy(self, instance: str) -> bool:
        """Its engine reports itself serving (ZooKeeper health, P/D-Serve §3.2)."""
        health = self.zk.health.get(instance)
        return health is not None and health.state is zl.HealthState.SERVING
