"""Issue 31 item 1, done when: the chart's control plane survives the loss of any one server.

The chart as its defaults have it (two gateways, two operators electing a leader, a three-server
ZooKeeper ensemble) on three servers of the cluster's emulator, a 2P1D group on a fourth, steady
streamed chat through the gateway Service by the official ``openai`` client (which retries a
refused or reset connection). One at a time, each control-plane server goes down for 60 s
(``node-down``: its processes killed, its Node unreachable): first one holding a gateway, then
the one holding the operator leader, then the last (each holds a ZooKeeper server). While the
leader's server is down, a fault is injected (a prefill pod deleted): the standby, leading by
then, replaces it. Asserted: no request fails that was not in flight at a server's loss or at
the injected fault; the group stays Ready (or is again within ``READY_BOUND``); the standby
takes over within the Lease's bound; nothing is done twice (the group's pods are its three, the
one replaced once, the Lease changed hands once per leader lost)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from kubernetes import client

from matrixserve.api.kinds import LABEL_ROLE
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.chaoskit import emulator_fault
from testkit.helpers import Groups, pdgroup_body, wait_for

CHART = Path(__file__).resolve().parents[2] / "charts" / "matrixserve"
HELD = 60.0  # each server down this long (the issue: >= 60 s)
TOLERATION = 10  # controlPlane.tolerationSeconds: a lost server's control-plane pods move then
READY_BOUND = 30.0  # the longest the group may be not Ready
TAKEOVER_BOUND = 15 + 2 + 5  # the Lease (15 s) + a retry (2 s) + the first look (margin)


@dataclass
class Outcome:
    began: float
    ended: float
    error: str = ""
    text: str = ""


@dataclass
class Traffic:
    url: str
    clients: int = 3
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self) -> None:
        oa = openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key="sk-open",
            max_retries=2,  # the client's default: a refused or reset connection is retried
            timeout=30,
            http_client=openai.DefaultHttpxClient(trust_env=False),
        )
        while not self.stop.is_set():
            outcome = Outcome(time.monotonic(), 0.0)
            try:
                stream = oa.chat.completions.create(
                    model="general",
                    messages=[{"role": "user", "content": "tell me about SuperPods"}],
                    max_tokens=64,
                    stream=True,
                )
                outcome.text = "".join(
                    c.choices[0].delta.content or "" for c in stream if c.choices
                )
                if not outcome.text:
                    outcome.error = "an empty stream"
            except Exception as exc:  # every failure is judged below
                outcome.error = repr(exc)
            outcome.ended = time.monotonic()
            self.outcomes.append(outcome)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=40)


def _serving(pod: Any) -> bool:
    return (
        pod.metadata.deletion_timestamp is None
        and pod.status.phase == "Running"
        and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    )


def test_the_control_plane_survives_the_loss_of_any_one_server(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    crds_installed: list[str],
    groups: Groups,
    run_tool: Callable[..., Any],
) -> None:
    core = client.CoreV1Api(api_client)
    coordination = client.CoordinationV1Api(api_client)
    control = cluster.node_emulator
    emulated = httpx.get(f"{control}/nodes", trust_env=False).json()
    servers = sorted(n["name"] for n in emulated if not n["down"])
    assert len(servers) >= 4, f"the cluster's emulator has {servers}: 4 servers needed"
    planes, engines_on = servers[:3], servers[3]
    every_node = [n.metadata.name for n in core.list_node().items]
    release = f"r{namespace[-6:]}"
    full = f"{release}-matrixserve"

    def cordon(names: list[str], on: bool) -> None:
        for name in names:
            core.patch_node(name, {"spec": {"unschedulable": on or None}})

    def component(name: str) -> list[Any]:
        listed = core.list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/component={name}"
        ).items
        return [p for p in listed if _serving(p)]

    def settled() -> bool:
        return (
            len(component("gateway")) == 2
            and len(component("operator")) == 2
            and len(component("zookeeper")) == 3
        )

    def leader() -> str:
        lease = coordination.read_namespaced_lease(f"{full}-operator", namespace)
        return str(lease.spec.holder_identity or "")

    down: str | None = None
    traffic: Traffic | None = None
    try:
        # The control plane on three servers, the group on the fourth (cordons while each is
        # placed; none left after).
        cordon([n for n in every_node if n not in planes], True)
        run_tool(
            "helm", "install", release, str(CHART), "-n", namespace,
            "--set", f"watchNamespaces={{{namespace}}}",
            "--set", "zookeeper.persistence=false", "--set", "gateway.service.port=8080",
            "--set", "operator.engine.timeScale=5",
            "--set", f"controlPlane.tolerationSeconds={TOLERATION}",
            "--set", "gateway.drainSeconds=1", "--set", "gateway.finishSeconds=5",
        )  # fmt: skip
        wait_for(settled, timeout=120, what="2 gateways, 2 operators, 3 ZooKeeper servers Ready")
        wait_for(leader, timeout=30, what="an operator to lead")
        for name in ("gateway", "operator", "zookeeper"):
            placed = {p.spec.node_name for p in component(name)}
            assert len(placed) == len(component(name)), f"{name}s not spread: {placed}"
        cordon(every_node, False)
        cordon([n for n in every_node if n != engines_on], True)
        groups.create(pdgroup_body("g"))
        groups.wait_ready("g")
        cordon(every_node, False)
        assert {p.spec.node_name for p in groups.pods("g").values()} == {engines_on}
        names = sorted(groups.pods("g"))
        assert len(names) == 3, names

        url = f"http://{core.read_namespaced_service(f'{full}-gateway', namespace).spec.cluster_ip}:8080"
        wait_for(
            lambda: "general" in httpx.get(f"{url}/v1/models", trust_env=False).text,
            timeout=30,
            what="the gateways to see the group",
        )
        not_ready: list[tuple[float, float]] = []  # (from, to) of each not-Ready stretch
        sampling = threading.Event()

        def sample() -> None:
            since: float | None = None
            while not sampling.is_set():
                now = time.monotonic()
                try:
                    ready = groups.ready("g")
                except Exception:  # the API server is not what is tested
                    ready = True
                if not ready and since is None:
                    since = now
                elif ready and since is not None:
                    not_ready.append((since, now))
                    since = None
                time.sleep(0.25)
            if since is not None:
                not_ready.append((since, time.monotonic()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        traffic = Traffic(url)
        t0 = time.monotonic()
        traffic.start()
        time.sleep(3)

        # When a server (or an engine, by the fault) was lost: from the fault's request sent to
        # the processes seen gone (a request begun meanwhile may have reached them).
        losses: list[tuple[float, float]] = []
        gateway_nodes = {p.spec.node_name for p in component("gateway")}
        leader_node = core.read_namespaced_pod(leader(), namespace).spec.node_name
        first = next((n for n in sorted(gateway_nodes) if n != leader_node), min(gateway_nodes))
        order = [first, leader_node, *(n for n in planes if n not in (first, leader_node))]
        assert len(set(order)) == 3, order
        replaced: dict[str, str] = {}
        takeovers = 0
        took = 0.0
        for server in order:
            before = leader()
            leading_here = core.read_namespaced_pod(before, namespace).spec.node_name == server
            down = server
            struck = time.monotonic()
            emulator_fault(control, kind="node-down", node=server)
            losses.append((struck, time.monotonic()))  # its processes are killed before it answers
            if leading_here:
                wait_for(
                    lambda before=before: leader() not in ("", before),
                    timeout=TAKEOVER_BOUND + 10,
                    what="the standby operator to take the Lease",
                )
                took = time.monotonic() - struck
                assert took <= TAKEOVER_BOUND, f"the standby led {took:.1f} s after node-down"
                takeovers += 1
                # A fault during the outage: a prefill pod deleted; the new leader replaces it.
                victim = next(
                    n
                    for n, p in groups.pods("g").items()
                    if p.metadata.labels[LABEL_ROLE] == "prefill"
                )
                old_uid = groups.pods("g")[victim].metadata.uid
                deleted = time.monotonic()
                core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)

                def killed(old_uid: str = old_uid) -> bool:
                    listed = httpx.get(f"{control}/pods", trust_env=False).json()
                    return not any(p["uid"] == old_uid and p["pids"] for p in listed)

                wait_for(killed, timeout=10, what="the deleted prefill's process gone")
                losses.append((deleted, time.monotonic()))

                def renewed(victim: str = victim, old_uid: str = old_uid) -> bool:
                    # the new pod Ready itself (the group's Ready of before the deletion may be
                    # read in the pass that made it)
                    pod = groups.pods("g").get(victim)
                    return (
                        pod is not None
                        and pod.metadata.uid != old_uid
                        and any(
                            c.type == "Ready" and c.status == "True"
                            for c in pod.status.conditions or []
                        )
                        and groups.ready("g")
                    )

                wait_for(renewed, timeout=READY_BOUND, what="the new leader to replace the prefill")
                replaced[victim] = groups.pods("g")[victim].metadata.uid
            left = HELD - (time.monotonic() - struck)
            if left > 0:
                time.sleep(left)
            assert groups.ready("g"), f"the group not Ready {HELD:.0f} s into {server}'s outage"
            emulator_fault(control, heal=True, kind="node-down", node=server)
            down = None
            wait_for(settled, timeout=90, what=f"the control plane whole again after {server}")
        time.sleep(2)
        traffic.finish()
        sampling.set()
        sampler.join(timeout=5)

        # No request failed that was not in flight at a loss.
        outcomes = traffic.outcomes
        failed = [o for o in outcomes if o.error]
        unexplained = [
            o for o in failed if not any(o.began <= to and at <= o.ended for at, to in losses)
        ]
        assert not unexplained, (
            f"{len(unexplained)} of {len(outcomes)} requests failed that were not in flight at "
            f"a loss: {[(o.error, round(o.began - t0, 3), round(o.ended - t0, 3)) for o in unexplained[:3]]} "
            f"losses {[(round(a - t0, 3), round(b - t0, 3)) for a, b in losses]}"
        )
        assert len(outcomes) - len(failed) >= 100, f"only {len(outcomes)} requests"
        longest = max((b - a for a, b in not_ready), default=0.0)
        assert longest <= READY_BOUND, f"the group was not Ready for {longest:.1f} s"
        print(
            f"HA: {len(outcomes)} requests, {len(failed)} failed (in flight at a loss), "
            f"takeover {took:.1f} s, longest not Ready {longest:.1f} s"
        )
        # Nothing done twice.
        assert (
            takeovers >= 1
        )  # the leader lost once at least (twice if the standby was on the last)
        pods = groups.pods("g")
        assert sorted(pods) == names, sorted(pods)
        for victim, uid in replaced.items():
            assert pods[victim].metadata.uid == uid, f"{victim} replaced more than once"
        lease = coordination.read_namespaced_lease(f"{full}-operator", namespace)
        assert (lease.spec.lease_transitions or 0) == takeovers
    finally:
        if traffic is not None:
            traffic.finish()
        if down is not None:
            with contextlib.suppress(RuntimeError):
                emulator_fault(control, heal=True, kind="node-down", node=down)
        cordon(every_node, False)
        run_tool("helm", "uninstall", release, "-n", namespace, "--wait", check=False)
