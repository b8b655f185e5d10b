"""Issue 31 item 4: engines in a namespace the chart's values do not list got no NetworkPolicy.
The operator writes the engines' policy where it creates engine pods, before the first, and keeps
it there as it keeps the engines' Secret: its manifest (pure), the flags that give it, the
adapter's writes (made, put back after the recheck period, someone else's left alone) and a
group's pass (the policy before the pods; a foreign one said once, the pods made anyway). The
chart's side (the same rules as its own policy, RBAC) and the real API server are
``tests/cluster/test_network_policy.py``."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any

import pytest
from kazoo.client import KazooState
from kubernetes import client

from fakes import FakeCore, FakeCustom, FakeKazoo, FakeNetworking
from matrixserve import __main__ as operator_main
from matrixserve.adapters.kube import SECRET_RECHECK_SECONDS, KubeAdapter
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.adapters.pdgroup_metrics import PDGroupMetrics
from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.coordination import Session
from matrixserve.domain.effects import Event
from matrixserve.domain.enginepod import (
    ENGINE_SELECTOR,
    POLICY_LABELS,
    EngineSettings,
    engine_network_policy,
    policy_taken,
)
from matrixserve.domain.leadership import NotLeading
from matrixserve.handlers.pdgroup import PDGroups
from matrixserve.handlers.reconciler import Reconciler
from matrixserve.handlers.runtime import OperatorConfig, Runtime

pytestmark = pytest.mark.unit

LOG = logging.getLogger("test")
GATEWAY = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ms"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}},
}
ENGINES = {"namespaceSelector": {}, "podSelector": ENGINE_SELECTOR}
SPEC: dict[str, Any] = {  # as the chart renders it: who may reach the engine port
    "podSelector": ENGINE_SELECTOR,
    "policyTypes": ["Ingress"],
    "ingress": [{"from": [GATEWAY, ENGINES], "ports": [{"port": "engine", "protocol": "TCP"}]}],
}
SETTINGS = EngineSettings("zk:2181", network_policy=json.dumps(SPEC), network_policy_name="np")


# --------------------------------------------------------------------------- the manifest
def test_the_policy_selects_every_engine_pod_written_as_the_api_server_keeps_it() -> None:
    (policy,) = SETTINGS.policies()
    assert policy == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np", "labels": POLICY_LABELS},
        "spec": SPEC,
    }
    assert policy["metadata"]["labels"] is not POLICY_LABELS  # a copy: never shared
    assert EngineSettings("zk:2181").policies() == []  # off by default
    # What the API server would fill in is written out, so that what is read back compares
    # equal: the selector, the policy types (Egress when there are egress rules), the protocol.
    short = {"ingress": [{"from": [GATEWAY], "ports": [{"port": 8000}]}], "egress": [{}]}
    spec = engine_network_policy("np", short)["spec"]
    assert spec["podSelector"] == ENGINE_SELECTOR
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert spec["egress"] == [{}]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({**SPEC, "podSelector": {}}, "must select the engine pods"),
        ({**SPEC, "podSelector": {"matchLabels": {"app": "x"}}}, "must select the engine pods"),
        ({"podSelector": ENGINE_SELECTOR}, "must restrict Ingress"),
        ({**SPEC, "policyTypes": ["Egress"]}, "must restrict Ingress"),
        ([SPEC], "must be a JSON object"),
    ],
)
def test_a_policy_that_would_not_guard_the_engines_is_refused(spec: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        engine_network_policy("np", spec)


def test_the_flags_give_the_policy_and_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--zookeeper", "zk:2181", "--no-webhook"]
    config, _ = operator_main.parse(base)
    assert (config.engine.network_policy, config.engine.network_policy_name) == (
        "",
        "matrixserve-engines",
    )
    flags = ["--engine-network-policy", json.dumps(SPEC), "--engine-network-policy-name", "r-e"]
    config, _ = operator_main.parse([*base, *flags])
    assert [p["metadata"]["name"] for p in config.engine.policies()] == ["r-e"]
    assert config.engine.policies()[0]["spec"] == SPEC
    for bad, says in (
        ("{", "--engine-network-policy: Expecting"),
        (json.dumps({**SPEC, "podSelector": {}}), "must select the engine pods"),
    ):
        with pytest.raises(SystemExit) as exited:
            operator_main.parse([*base, "--engine-network-policy", bad])
        assert exited.value.code == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        operator_main.parse([*base, "--engine-network-policy-name", "Not_A_Name"])
    assert "a lower-case DNS name" in capsys.readouterr().err


# --------------------------------------------------------------------------- the adapter
def adapter(clock: list[float]) -> tuple[KubeAdapter, FakeCore, FakeNetworking]:
    kube = KubeAdapter(client.ApiClient(), clock=lambda: clock[0], pod_policies=SETTINGS.policies())
    core = FakeCore()
    networking = FakeNetworking(calls=core.calls)
    kube.core, kube.networking = core, networking
    return kube, core, networking


def engine_pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {kinds.APP_NAME_LABEL: kinds.ENGINE_APP}}}


async def test_the_policy_is_in_the_namespace_before_the_first_engine_pod() -> None:
    kube, core, networking = adapter([0.0])
    for name in ("g-p-0", "g-d-0"):
        assert await kube.create_pod("ns", engine_pod(name))
    assert await kube.create_pod("other", engine_pod("g-p-0"))
    assert core.calls == [
        ("read_policy", "ns", "np"),
        ("create_policy", "ns", "np"),
        ("create_pod", "ns", "g-p-0"),
        ("create_pod", "ns", "g-d-0"),  # in place: no call before the next pod
        ("read_policy", "other", "np"),
        ("create_policy", "other", "np"),
        ("create_pod", "other", "g-p-0"),
    ]
    assert networking.policies[("ns", "np")] == SETTINGS.policies()[0]


async def test_a_deleted_or_changed_policy_is_put_back_within_the_recheck_period() -> None:
    clock = [0.0]
    kube, core, networking = adapter(clock)
    assert await kube.pod_policies_taken("ns") == {}
    ours = copy.deepcopy(networking.policies[("ns", "np")])
    core.calls.clear()
    del networking.policies[("ns", "np")]
    clock[0] = SECRET_RECHECK_SECONDS - 1  # within the period: a pass costs no call
    assert await kube.pod_policies_taken("ns") == {}
    assert core.calls == []
    clock[0] = SECRET_RECHECK_SECONDS  # then one read finds it gone: made again
    assert await kube.pod_policies_taken("ns") == {}
    assert core.calls == [("read_policy", "ns", "np"), ("create_policy", "ns", "np")]
    # someone opens it (a rule for everyone, another pod selector): our spec put back whole
    opened = networking.policies[("ns", "np")]["spec"]
    opened["ingress"].append({})
    opened["podSelector"] = {"matchLabels": {"app": "x"}, "matchExpressions": []}
    opened["egress"] = [{}]
    core.calls.clear()
    clock[0] = 2 * SECRET_RECHECK_SECONDS
    assert await kube.pod_policies_taken("ns") == {}
    assert core.calls == [("read_policy", "ns", "np"), ("patch_policy", "ns", "np")]
    assert networking.policies[("ns", "np")] == ours
    core.calls.clear()
    clock[0] = 3 * SECRET_RECHECK_SECONDS  # as we wrote it: one read, nothing written
    assert await kube.pod_policies_taken("ns") == {}
    assert core.calls == [("read_policy", "ns", "np")]


async def test_a_policy_of_that_name_that_is_not_ours_is_left_alone_and_pods_are_made() -> None:
    """Not ours (without our labels): the chart's own where its values list the namespace, or
    a tenant's. Never written; unlike a Secret so taken, it keeps no engine pod out (it guards
    them, as its owner wants); a tenant's is said, the chart's is not."""
    kube, core, networking = adapter([0.0])
    chart_labels = {kinds.APP_NAME_LABEL: "matrixserve", kinds.MANAGED_BY_LABEL: "Helm"}
    theirs = {"metadata": {"name": "np", "labels": chart_labels}, "spec": {"podSelector": {}}}
    networking.policies[("ns", "np")] = copy.deepcopy(theirs)
    assert await kube.create_pod("ns", engine_pod("g-p-0"))
    assert networking.policies[("ns", "np")] == theirs
    assert [c[0] for c in core.calls] == ["read_policy", "create_pod"]
    assert await kube.pod_policies_taken("ns") == {"np": chart_labels}  # asked again: not ours
    assert policy_taken("ns", "np", chart_labels) is None
    notice = policy_taken("ns", "np", {"team": "a"})
    assert notice is not None
    event = notice.describe()
    assert (event.reason, event.warning) == ("EnginePolicyTaken", True)
    assert "NetworkPolicy ns/np is not MatrixServe's" in event.message
    assert "--engine-network-policy-name" in event.message


async def test_a_replica_that_does_not_lead_writes_no_policy() -> None:
    """Every write is fenced where it is made (the operator's leadership): the policy's too."""
    kube, core, networking = adapter([0.0])

    def deposed() -> None:
        raise NotLeading("not the leader")

    kube.fence = deposed
    with pytest.raises(NotLeading):
        await kube.pod_policies_taken("ns")
    assert networking.policies == {}
    assert [c[0] for c in core.calls] == ["read_policy"]


# --------------------------------------------------------------------------- a group's pass
class World:
    """PDGroup ``g`` (1P+1D) in namespace ``ns``, not made yet, its operator given the engines'
    policy."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.core, self.custom, self.zk = FakeCore(), FakeCustom(), FakeKazoo()
        self.networking = FakeNetworking(calls=self.core.calls)
        kube = KubeAdapter(client.ApiClient(), pod_policies=SETTINGS.policies())
        kube.core, kube.custom, kube.networking = self.core, self.custom, self.networking
        metrics = OperatorMetrics()
        session = Session("zk", client=self.zk)
        self.zk.transition(KazooState.CONNECTED)
        rt = Runtime(OperatorConfig(kubeconfig=None, zookeeper="zk", engine=SETTINGS), kube,
                     session, metrics, loop)  # fmt: skip
        self.events: list[Event] = []
        reconciler = Reconciler(kinds.PDGROUP, kube, metrics, loop, poster=self.record)
        self.groups = PDGroups(
            rt, reconciler, GroupStore(session), PDGroupMetrics(metrics.registry)
        )
        key = (kinds.GROUP, kinds.VERSION, "ns", kinds.PDGROUP.plural, "g")
        self.custom.objects[key] = {
            "apiVersion": kinds.API_VERSION,
            "kind": kinds.PDGROUP.kind,
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 1},
            "spec": {
                "service": "chat",
                "scenario": "general",
                "model": {"name": "llama3-8b"},
                "prefill": {"replicas": 1},
                "decode": {"replicas": 1},
            },
        }

    def record(self, body: Any, event: Event | None) -> None:
        if event is not None:
            self.events.append(event)

    async def reconcile(self) -> None:
        await self.groups.loop.reconcile(self.groups, "ns", "g", LOG)


async def test_a_groups_first_pass_writes_the_policy_before_its_pods() -> None:
    world = World(asyncio.get_running_loop())
    await world.reconcile()
    calls = [c for c in world.core.calls if c[0] in ("create_policy", "create_pod")]
    assert calls[0] == ("create_policy", "ns", "np")
    assert sorted(calls[1:]) == [("create_pod", "ns", "g-d-0"), ("create_pod", "ns", "g-p-0")]
    assert world.networking.policies[("ns", "np")]["metadata"]["labels"] == POLICY_LABELS


async def test_a_tenants_policy_of_that_name_is_said_once_and_the_pods_are_made() -> None:
    world = World(asyncio.get_running_loop())
    theirs = {"metadata": {"name": "np", "labels": {"team": "a"}}, "spec": {"podSelector": {}}}
    world.networking.policies[("ns", "np")] = copy.deepcopy(theirs)
    for _ in range(3):
        await world.reconcile()
    assert world.networking.policies[("ns", "np")] == theirs
    assert {("ns", "g-p-0"), ("ns", "g-d-0")} <= set(world.core.pods)
    taken = [e for e in world.events if e.reason == "EnginePolicyTaken"]
    assert len(taken) == 1, "one Warning Event, not one a pass"
    assert taken[0].warning


async def test_a_policy_that_cannot_be_checked_makes_the_pass_create_no_pod() -> None:
    world = World(asyncio.get_running_loop())

    def refused(*_: Any, **__: Any) -> None:
        raise client.ApiException(status=403, reason="Forbidden")

    world.networking.read_namespaced_network_policy = refused
    await world.reconcile()
    assert not world.core.pods, "an engine made where its guard could not be checked"
