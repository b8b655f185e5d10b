"""Two operators elect on a real Lease (issue 31 item 1): one acts, the other stands by and writes
nothing; the leader killed, the standby takes over within the lease and acts on a fault; a
leader stopped cleanly hands over within the retry period; a leader whose Lease is taken from it
stops acting and exits 1."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from kubernetes import client

from conftest import OperatorHandle
from testkit.helpers import Groups, metric, pdgroup_body, wait_for

LEASE, RENEW, RETRY = 3, 2.0, 0.5
TIMING = (
    *("--leader-lease-seconds", str(LEASE)),
    *("--leader-renew-seconds", str(RENEW)),
    *("--leader-retry-seconds", str(RETRY)),
)


def _metrics(op: OperatorHandle) -> str:
    return str(op.metrics_url).removesuffix("/metrics")


def _leads(op: OperatorHandle) -> bool:
    return bool(metric(_metrics(op), "matrixserve_operator_leader") == 1)


def _actions(op: OperatorHandle) -> float:
    """Every action an operator applied (all types)."""
    text = httpx.get(op.metrics_url, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("matrixserve_operator_actions_total{")
    )


def test_one_operator_acts_a_standby_takes_over_and_a_deposed_leader_exits(
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    start_operator: Callable[..., OperatorHandle],
) -> None:
    coordination = client.CoordinationV1Api(api_client)

    def holder() -> str:
        try:
            lease = coordination.read_namespaced_lease("operators", namespace)
        except client.ApiException as exc:
            if exc.status == 404:  # not made yet
                return ""
            raise
        return str(lease.spec.holder_identity or "")

    def elect(identity: str) -> tuple[str, ...]:
        return (
            "--leader-elect",
            *("--leader-lease", f"{namespace}/operators"),
            *("--leader-identity", identity),
            *TIMING,
        )

    # One webhook configuration, managed by a; b serves none here (the chart's replicas each
    # serve the chart's Service: tests/cluster/test_ha.py).
    a = start_operator(namespace, extra=elect("a"))
    wait_for(lambda: holder() == "a", timeout=10, what="a to take the new Lease")
    b = start_operator(namespace, webhook=False, extra=elect("b"))
    wait_for(lambda: _leads(a), timeout=5, what="a's leader metric")
    assert not _leads(b)

    groups.create(pdgroup_body("g"))
    groups.wait_ready("g")
    pods = groups.pods("g")
    assert len(pods) == 3
    # the standby wrote nothing (no action, no status: a only)
    assert _actions(a) >= 3
    assert _actions(b) == 0
    time.sleep(2 * RETRY)
    assert holder() == "a"
    assert not _leads(b)

    # a dies without a word: b waits the Lease out, then leads and repairs a fault
    a.kill()
    killed = time.monotonic()
    wait_for(lambda: holder() == "b", timeout=LEASE + 4 * RETRY + 2, what="b to take over")
    took = time.monotonic() - killed
    assert took <= LEASE + 2 * RETRY + 1.5, f"takeover took {took:.1f} s"
    wait_for(lambda: _leads(b), timeout=5, what="b's leader metric")
    victim, victim_pod = next((n, p) for n, p in pods.items() if "-d-" in n)
    groups.core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)

    def replaced() -> bool:
        now = groups.pods("g")
        return (
            len(now) == 3
            and victim in now
            and now[victim].metadata.uid != victim_pod.metadata.uid
            and groups.ready("g")
        )

    wait_for(replaced, timeout=60, what="b to replace the deleted decode")
    assert _actions(b) >= 1
    lease = coordination.read_namespaced_lease("operators", namespace)
    assert lease.spec.lease_transitions == 1
    said = [
        e.message
        for e in groups.core.list_namespaced_event(namespace).items
        if e.involved_object.kind == "Lease" and e.reason == "LeaderElection"
    ]
    assert "b became the leader" in said, said

    # a comes back: a standby now, b goes on
    a.start()
    wait_for(lambda: _has_metrics(a), timeout=30, what="a back")
    time.sleep(2 * RETRY)
    assert holder() == "b"
    assert not _leads(a)

    # b stops cleanly: it releases the Lease and a leads within about one retry, not a lease
    stopped = time.monotonic()
    b.stop()
    wait_for(lambda: holder().startswith("a"), timeout=LEASE, what="a to lead after b's release")
    assert time.monotonic() - stopped < LEASE, "the release should spare the wait"
    assert "released the leadership" in b.log()

    # the Lease taken from a (a partition, say): a acts no more and exits 1 within the deadline
    wait_for(lambda: _leads(a), timeout=5, what="a's leader metric")
    taken = {"spec": {"holderIdentity": "someone-else", "leaseDurationSeconds": 600}}
    coordination.patch_namespaced_lease("operators", namespace, taken)  # no resourceVersion
    wait_for(lambda: a.supervisor.exited(a.name), timeout=RENEW + 3 * RETRY + 5, what="a to exit")
    assert a.supervisor.returncode(a.name) == 1
    assert "lost the leadership" in a.log()
    # nothing duplicated: the group has its three pods, still Ready
    assert len(groups.pods("g")) == 3
    assert groups.ready("g")


def _has_metrics(op: OperatorHandle) -> bool:
    try:
        metric(_metrics(op), "matrixserve_operator_leader")
    except Exception:
        return False
    return True
