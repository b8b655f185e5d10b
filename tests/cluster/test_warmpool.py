"""WarmPool + NPU-fork on the local cluster (issue 18): a group's scale-out claims a warm pod (no
new pod is created for it), forks its weights from a live member, joins without restarting
anyone; the pool refills; two groups scaling at once from a pool of one never share the pod; a
claim whose operator died before the assignment is finished by the next operator, nothing
leaked; a fork whose source is killed mid-transfer completes by the shared file service. Real API server, scheduler, ZooKeeper, node emulator and engine processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kubernetes import client

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.cluster import ClusterInfo
from testkit.chaoskit import pod_runs
from testkit.helpers import Groups, events_of, pdgroup_body, wait_for, zookeeper

WHERE = (kinds.WARMPOOL.group, kinds.WARMPOOL.version)


def warmpool_body(name: str = "wp", size: int = 1, refill: str = "Immediate") -> dict[str, Any]:
    return {
        "apiVersion": kinds.API_VERSION,
        "kind": kinds.WARMPOOL.kind,
        "metadata": {"name": name},
        "spec": {
            "shapes": [{"name": "two", "size": size, "devicesPerPod": 2}],
            "refillPolicy": refill,
        },
    }


class Pools:
    def __init__(self, api_client: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace

    def create(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(
            *WHERE, self.namespace, kinds.WARMPOOL.plural, body
        )

    def status(self, name: str = "wp") -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(
            *WHERE, self.namespace, kinds.WARMPOOL.plural, name
        )
        return dict(obj.get("status") or {})

    def pods(self, name: str = "wp") -> dict[str, client.V1Pod]:
        items = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{kinds.LABEL_WARMPOOL}={name}"
        ).items
        return {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}

    def warm(self, name: str = "wp") -> list[str]:
        """Its pods that are claimable (Ready, not claimed)."""
        return [
            n
            for n, p in self.pods(name).items()
            if kinds.LABEL_CLAIMED_BY not in (p.metadata.labels or {})
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]

    def wait_ready(self, count: int, name: str = "wp") -> None:
        wait_for(
            lambda: self.status(name).get("ready") == count and len(self.warm(name)) >= count,
            timeout=90,
            what=f"WarmPool {name} with {count} warm pods",
        )


def identities(pods: dict[str, client.V1Pod]) -> dict[str, tuple[str, int]]:
    return {
        n: (p.metadata.uid, p.status.container_statuses[0].restart_count) for n, p in pods.items()
    }


def health_of(cluster: ClusterInfo, namespace: str, group: str, instance: str) -> zl.Health:
    with zookeeper(cluster.zookeeper) as zk:
        raw, _ = zk.get(zl.GroupPaths(namespace, group).health_of(instance))
    return zl.Health.parse(raw)


def pod_log(cluster: ClusterInfo, namespace: str, pod: str) -> str:
    """The tail of a pod's engine log, as the node emulator keeps it."""
    found = sorted(
        (Path(cluster.state_dir) / "emulator" / "pods").glob(f"{namespace}_{pod}_*/*.log")
    )
    return "\n".join(p.read_text()[-3000:] for p in found) or f"(no log of {pod})"


def ready_with(groups: Groups, prefills: int, what: str, timeout: float = 90) -> None:
    """Wait until group ``g`` is Ready with ``prefills`` prefills ready."""
    wait_for(
        lambda: (
            groups.get("g").get("status", {}).get("prefill", {}).get("ready") == prefills
            and groups.ready("g")
        ),
        timeout=timeout,
        what=what,
        explain=groups.explain,
    )


class OpenAIStreams:
    """The official ``openai`` client streaming chat completions through the gateway, one after
    another on a thread, until the ``with`` block ends: how many completed, every error."""

    def __init__(self, gateway: str) -> None:
        self.client = openai.OpenAI(
            base_url=f"{gateway}/v1",
            api_key="sk-unused-by-an-open-gateway",
            max_retries=0,  # every answer as the gateway gave it
            timeout=30,
            http_client=openai.DefaultHttpxClient(trust_env=False),
        )
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream = self.client.chat.completions.create(
                    model="general",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=8,
                    stream=True,
                )
                tokens = sum(
                    1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content
                )
                if tokens != 8:
                    self.errors.append(f"{tokens} tokens of 8")
                self.done += 1
            except openai.OpenAIError as exc:
                self.errors.append(repr(exc))

    def __enter__(self) -> OpenAIStreams:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.client.close()


@pytest.fixture
def pools(api_client: client.ApiClient, namespace: str) -> Pools:
    return Pools(api_client, namespace)


def test_a_scale_out_claims_a_warm_pod_forks_from_a_live_member_and_the_pool_refills(
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    pools: Pools,
    serving_group: Callable[..., Any],
    run_tool: Callable[..., Any],
    gateway: str,
) -> None:
    serving_group(prefill=2, decode=1)
    pools.create(warmpool_body(size=1))
    pools.wait_ready(1)
    (warm,) = pools.warm()
    before = identities(groups.pods("g"))
    # The official openai client streams through the gateway during the whole scale-out
    with OpenAIStreams(gateway) as streams:
        wait_for(lambda: streams.done >= 2, timeout=30, what="completions before the scale-out")
        groups.patch("g", {"prefill": {"replicas": 3}})
        ready_with(groups, 3, "the group Ready with 3 prefills", timeout=90)
        served = streams.done
        wait_for(lambda: streams.done >= served + 2, timeout=30, what="completions after it")
    assert streams.errors == [], streams.errors[:3]
    pods = groups.pods("g")
    # No pod was created for the new instance: the warm pod is it, now the group's.
    assert "g-p-2" not in pods
    assert warm in pods
    claimed = pods[warm]
    assert claimed.metadata.labels[kinds.LABEL_INSTANCE] == "g-p-2"
    assert claimed.metadata.labels[kinds.LABEL_CLAIMED_BY] == "g"
    assert [(o.kind, o.name) for o in claimed.metadata.owner_references] == [("PDGroup", "g")]
    claim = json.loads(claimed.metadata.annotations[kinds.ANNOTATION_CLAIM])
    assert claim["path"] == "WarmForkUB"  # one SuperPod: a live prefill forks over UB
    assert claim["forkSource"] in {f"{namespace}/g/{n}" for n in ("g-p-0", "g-p-1", "g-d-0")}
    # It forked, warm (its TE-Pre-Load paid before the claim), and nobody restarted.
    health = health_of(cluster, namespace, "g", "g-p-2")
    assert health.warm is True
    assert health.load_source == "NPUForkUB", pod_log(cluster, namespace, warm)
    assert health.phases["TEPreLoad"] == 0
    assert identities({n: p for n, p in pods.items() if n in before}) == before
    status = groups.get("g")["status"]
    assert status["lastScale"]["instance"] == "g-p-2"
    assert status["lastScale"]["path"] == "WarmForkUB"
    assert status["lastScale"]["loadSource"] == "NPUForkUB"
    assert set(status["lastScale"]["phases"]) == {"TEPreLoad", "TELoad", "TEPostLoad"}
    reasons = {e.reason for e in events_of(groups.core, namespace, "g")}
    assert {"ClaimedWarmPod", "AssignedWarmPod"} <= reasons
    # The pool refills under a new name, and counts the claim and its fork.
    pools.wait_ready(1)
    assert pools.warm() != [warm]
    pool = pools.status()
    assert pool["claimed"] == 1
    assert pool["forksDone"] == 1
    # kubectl shows it: the counts, and with -o wide the forks, the hit rate and the reason
    table = run_tool("kubectl", "get", "warmpool", "wp", "-n", namespace, "-o", "wide").stdout
    header, row = (line.split() for line in table.strip().splitlines())
    assert header == ["NAME", "READY", "CLAIMED", "WARMING", "FORKS", "HITRATE", "REASON", "AGE"]
    cells = dict(zip(header, row, strict=True))
    assert (cells["READY"], cells["CLAIMED"], cells["FORKS"]) == ("1", "1", "1")
    assert cells["HITRATE"] == str(pool["hitRatePercent"])
    assert cells["REASON"] == next(c for c in pool["conditions"] if c["type"] == "Ready")["reason"]
    # Scaling in releases the claimed instance like any other; its assignment goes with it.
    groups.patch("g", {"prefill": {"replicas": 2}})
    wait_for(lambda: warm not in groups.pods("g"), timeout=60, what="the claimed pod released")
    with zookeeper(cluster.zookeeper) as zk:
        wait_for(
            lambda: not zk.exists(zl.WarmPaths(namespace).assignment(warm)),
            timeout=60,
            what="the released pod's assignment removed",
        )


def test_two_groups_scaling_at_once_from_a_pool_of_one_never_share_the_pod(
    namespace: str,
    groups: Groups,
    pools: Pools,
    start_operator: Callable[..., Any],
) -> None:
    start_operator(namespace)
    for name in ("a", "b"):
        groups.create(pdgroup_body(name, 1, 1))
    for name in ("a", "b"):
        groups.wait_ready(name)
    pools.create(warmpool_body(size=1, refill="Manual"))
    pools.wait_ready(1)
    (warm,) = pools.warm()
    for name in ("a", "b"):
        groups.patch(name, {"prefill": {"replicas": 2}})
    for name in ("a", "b"):
        wait_for(
            lambda n=name: groups.get(n).get("status", {}).get("prefill", {}).get("ready") == 2,
            timeout=90,
            what=f"group {name} with 2 prefills",
            explain=groups.explain,
        )
    holders = [n for n in ("a", "b") if warm in groups.pods(n)]
    assert len(holders) == 1, holders
    other = "b" if holders == ["a"] else "a"
    assert f"{other}-p-1" in groups.pods(other)  # the other one started cold
    pod = pools.pods()[warm]
    assert [o.name for o in pod.metadata.owner_references] == holders
    # one claim went through (a second one at the same resourceVersion is refused: 409)
    claims = [
        e
        for n in ("a", "b")
        for e in events_of(groups.core, namespace, n)
        if e.reason == "ClaimedWarmPod" and warm in e.message
    ]
    assert len(claims) == 1, [e.message for e in claims]
    assert pools.status()["claimed"] == 1
    assert pools.warm() == []  # Manual: the claim is not refilled


def test_a_claim_left_by_an_operator_that_died_is_finished_by_the_next_one(
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    pools: Pools,
    start_operator: Callable[..., Any],
) -> None:
    operator = start_operator(namespace, webhook=False)  # the group is patched while it is down
    groups.create(pdgroup_body("g", 1, 1))
    groups.wait_ready("g")
    pools.create(warmpool_body(size=1))
    pools.wait_ready(1)
    (warm,) = pools.warm()
    operator.kill()
    # What the operator's claim had written when it died: the pod is the group's (labels,
    # owner, claim) and no assignment exists yet.
    group = groups.get("g")
    pod = pools.pods()[warm]
    claim = {"instance": "g-p-1", "role": "P", "path": "WarmSharedFileService", "at": 0}
    labels = {
        kinds.LABEL_GROUP: "g",
        kinds.LABEL_ROLE: "prefill",
        kinds.LABEL_INSTANCE: "g-p-1",
        kinds.LABEL_CLAIMED_BY: "g",
    }
    template = groups.pods("g")["g-p-0"].metadata.annotations
    groups.core.patch_namespaced_pod(
        warm,
        namespace,
        {
            "metadata": {
                "resourceVersion": pod.metadata.resource_version,
                "labels": labels,
                "annotations": {**template, kinds.ANNOTATION_CLAIM: json.dumps(claim)},
                "ownerReferences": [
                    {
                        "apiVersion": kinds.API_VERSION,
                        "kind": "PDGroup",
                        "name": "g",
                        "uid": group["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            }
        },
        _content_type="application/merge-patch+json",
    )
    groups.patch("g", {"prefill": {"replicas": 2}})
    operator.start()
    ready_with(groups, 2, "the claimed pod joined", timeout=90)
    pods = groups.pods("g")
    assert sorted(pods) == sorted(["g-p-0", "g-d-0", warm])  # no pod created for g-p-1
    assert health_of(cluster, namespace, "g", "g-p-1").load_source == "SharedFileService"
    pools.wait_ready(1)  # and the pool refilled: nothing leaked, nothing lost
    assert len(pools.pods()) == 2


def test_a_fork_whose_source_is_killed_mid_transfer_completes_by_another_path(
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    pools: Pools,
    serving_group: Callable[..., Any],
) -> None:
    # Engines at time scale 5 and the sources slowed 1000 times: a fork over UB of 26 emulated
    # s, 5.2 wall s, longer than the target's 5 s wall bound on any fork, so only the kill can
    # end it before the bound; the fallback (the shared file service) is 1.5 wall s.
    serving_group(prefill=1, decode=1, time_scale="5")
    sources = {n: health_of(cluster, namespace, "g", n) for n in ("g-p-0", "g-d-0")}
    for health in sources.values():
        slowed = httpx.post(
            f"http://{health.pod_ip}:{health.port}/v1/faults",
            json={"kind": "slow", "factor": 1000},
            timeout=10,
            trust_env=False,
        )
        assert slowed.status_code == 201, slowed.text
    pools.create(warmpool_body(size=1))
    pools.wait_ready(1)
    (warm,) = pools.warm()
    groups.patch("g", {"prefill": {"replicas": 2}})

    def forking() -> str | None:
        for name, health in sources.items():
            info = httpx.get(
                f"http://{health.pod_ip}:{health.port}/v1/info", timeout=5, trust_env=False
            ).json()
            if info["health"]["forkTargets"] == 1:
                return name
        return None

    source = wait_for(forking, timeout=60, what="a source forking to the claimed pod", every=0.05)
    with httpx.Client(base_url=cluster.node_emulator, timeout=10, trust_env=False) as http:
        (pid,) = pod_runs(http.get("/pods").json(), namespace)[source].pids
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    ready_with(groups, 2, "the group Ready again with the new instance", timeout=120)
    print(f"\nthe group Ready again {time.monotonic() - killed:.1f} wall s after the kill")
    health = health_of(cluster, namespace, "g", "g-p-1")
    log = pod_log(cluster, namespace, warm)
    assert health.warm is True
    assert health.load_source == "SharedFileService", log
    assert f"NPU-fork from {source} failed" in log
    assert "no answer" not in log, "the kill ended the fork, not the target's wait bound"
    claim = json.loads(groups.pods("g")[warm].metadata.annotations[kinds.ANNOTATION_CLAIM])
    assert claim["path"] == "WarmForkUB"
    assert claim["forkSource"] == f"{namespace}/g/{source}"
