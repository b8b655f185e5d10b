"""Nothing accepted and ignored (issue 31 item 3, its "Done when"): each field the API accepted
and nothing read either changes what runs or is refused saying what works — one row per field,
on the real API server and operator, the table docs/operator.md gives ("Validation").

One namespace, one operator, one group and two WarmPools serve every row (one test, rows in
order, every failure gathered; the table is printed with ``pytest -s``). The group ``g`` (1P+1D)
names pool ``b`` in ``warmPoolRef`` and a TPOT SLO of 1 ms (every batch step is longer); pools
``a`` and ``b`` keep one warm pod each. The refusals are the API server's own (CEL), made as
dry-run creates, in the words the operator's own checks use (the reconciler's for an object
stored before the rule: ``schema_rules``, the WarmPool controller's ``problems``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kubernetes import client

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import WarmPoolSpec
from matrixserve.devcluster import tools
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.domain.enginepod import ENGINE_PORT
from matrixserve.domain.pdgroup.validation import parse_spec, schema_rules
from matrixserve.domain.warmpool.validation import problems
from matrixserve.handlers.unserved import REASON as NO_CONTROLLER
from testkit.helpers import CRDS, Groups, absent, load, pdgroup_body, wait_for, zookeeper

pytestmark = pytest.mark.skipif(
    tools.legacy(), reason="the refusals are CEL validation rules (1.29+, not on 1.20)"
)

TPOT_SLO_MS = 1  # below any batch's modelled step: a decode takes one request at a time
ARTEFACTS = (
    "per-role compiled artefacts are not supported yet: every engine loads model.name and "
    "compiles it itself; remove the field"
)
MOE = (
    "Colocated needs no spec.moe: remove it; an MoE model's experts then run inside each "
    "instance (parallelism.ep)"
)
DP = (
    "4 is not what runs: an instance's data-parallel degree is its 4 dies / tp 2 = 2 (leave dp "
    "out, or set it to that)"
)
SCHEDULED = (
    "Scheduled is not implemented (there is no schedule to refill by): use Immediate (refill "
    "at once) or Manual (refill on a new generation)"
)


def pool_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": kinds.API_VERSION,
        "kind": kinds.WARMPOOL.kind,
        "metadata": {"name": name},
        "spec": {"shapes": [{"name": "two", "size": 1, "devicesPerPod": 2}]},
    }


@dataclass
class Stage:
    """What the rows share: the namespace's API, the group, the pools, ZooKeeper."""

    namespace: str
    api: client.ApiClient
    groups: Groups
    zookeeper: str
    pool_pods: dict[str, dict[str, str]]  # pool -> its warm pods before the group: name -> UID

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def create(self, kind: kinds.Kind, body: dict[str, Any], dry_run: bool = False) -> Any:
        options = {"dry_run": "All"} if dry_run else {}
        return self.custom.create_namespaced_custom_object(
            kind.group, kind.version, self.namespace, kind.plural, body, **options
        )

    def get(self, kind: kinds.Kind, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.custom.get_namespaced_custom_object(
            kind.group, kind.version, self.namespace, kind.plural, name
        )
        return found

    def refused(self, kind: kinds.Kind, body: dict[str, Any]) -> str:
        """The API server's message refusing a (dry-run) create of ``body``."""
        with pytest.raises(client.ApiException) as rejected:
            self.create(kind, body, dry_run=True)
        assert rejected.value.status == 422, rejected.value.body
        return str(json.loads(rejected.value.body)["message"])

    def warm_pods(self, pool: str) -> dict[str, client.V1Pod]:
        items = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{kinds.LABEL_WARMPOOL}={pool}"
        ).items
        return {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}


def group_with(**changes: Any) -> dict[str, Any]:
    """The 2P1D sample (named ``probe``) with ``changes`` (dotted paths) made."""
    body: dict[str, Any] = pdgroup_body("probe")
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node: Any = body
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return body


def refused_in_the_operators_words(stage: Stage, field: str, words: str, **changes: Any) -> str:
    body = group_with(**changes)
    message = stage.refused(kinds.PDGROUP, body)
    assert f"{field}: Invalid value: {words}" in message, message
    spec, _ = parse_spec(body["spec"], "probe")
    assert spec is not None
    assert f"{field}: {words}" in schema_rules(spec, "probe")
    return "refused: " + words[:60] + "..."


# --------------------------------------------------------------------------- the rows
def warm_pool_ref(stage: Stage) -> str:
    """The group claims only its pool's warm pod (b's), never a's."""
    pods = stage.groups.pods("g")
    claimed = {n: p for n, p in pods.items() if kinds.LABEL_CLAIMED_BY in (p.metadata.labels or {})}
    assert set(claimed) == set(stage.pool_pods["b"]), (sorted(pods), stage.pool_pods)
    a_now = {n: p.metadata.uid for n, p in stage.warm_pods("a").items()}
    assert a_now == stage.pool_pods["a"], "pool a's warm pod was claimed or replaced"
    assert not any(
        kinds.LABEL_CLAIMED_BY in (p.metadata.labels or {}) for p in stage.warm_pods("a").values()
    )
    statuses = {pool: (stage.get(kinds.WARMPOOL, pool).get("status") or {}) for pool in "ab"}
    assert (statuses["a"].get("claimed", 0), statuses["b"].get("claimed")) == (0, 1), statuses
    return f"claimed {', '.join(claimed)} (pool b); pool a's {', '.join(a_now)} untouched"


def artefact(role: str) -> Callable[[Stage], str]:
    def row(stage: Stage) -> str:
        field = f"spec.model.{role}Artifact"
        return refused_in_the_operators_words(
            stage, field, ARTEFACTS, **{field: f"s3://bucket/{role}.om"}
        )

    return row


def data_parallel(stage: Stage) -> str:
    """Refused unless it is what runs (dies / tp), which is accepted."""
    said = refused_in_the_operators_words(
        stage, "spec.decode.parallelism.dp", DP, **{"spec.decode.parallelism": {"tp": 2, "dp": 4}}
    )
    stage.create(kinds.PDGROUP, group_with(**{"spec.decode.parallelism": {"tp": 2, "dp": 2}}), True)
    return f"{said} (dp 2 = 4 dies / tp 2 accepted)"


def moe(stage: Stage) -> str:
    return refused_in_the_operators_words(
        stage, "spec.moe", MOE, **{"spec.moe": {"mode": "Colocated"}}
    )


def tpot_slo(stage: Stage) -> str:
    """Every engine gets it (a cold pod in its environment, a claimed warm pod in its
    assignment), and the decode admits a second request only when its batch's step would meet
    it: two requests at once, and the decode turned one away (429, which the prefill retries)
    while its batch had room; both served."""
    pods = stage.groups.pods("g")
    given = {}
    with zookeeper(stage.zookeeper) as zk:
        for name, pod in pods.items():
            if kinds.LABEL_CLAIMED_BY in (pod.metadata.labels or {}):
                raw, _ = zk.get(zl.WarmPaths(stage.namespace).assignment(name))
                given[name] = zl.Assignment.parse(raw).env.get("ENGINE_TPOT_SLO_MS")
            else:
                env = {e.name: e.value for e in pod.spec.containers[0].env}
                given[name] = env.get("ENGINE_TPOT_SLO_MS")
    assert len(given) == 2, given
    assert set(given.values()) == {str(TPOT_SLO_MS)}, given
    by_role = {p.metadata.labels[kinds.LABEL_ROLE]: p for p in pods.values()}
    prefill = f"http://{by_role['prefill'].status.pod_ip}:{ENGINE_PORT}"
    decode = f"http://{by_role['decode'].status.pod_ip}:{ENGINE_PORT}"
    before = rejected(decode)
    ends: list[str] = []

    def one(i: int) -> None:
        body = {"requestId": f"tpot-{i}-{time.monotonic_ns()}", "promptTokens": 64,
                "maxTokens": 400}  # fmt: skip
        with httpx.Client(timeout=60, trust_env=False) as http:
            answer = http.post(f"{prefill}/v1/generate", json=body)
        events = [  # the engine's stream: "data: <json>" lines
            json.loads(x.removeprefix("data: "))
            for x in answer.text.splitlines()
            if x.startswith("data: ")
        ]
        ends.append(str(events[-1].get("type")) if events else f"HTTP {answer.status_code}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert ends == ["done", "done"], ends
    turned_away = rejected(decode) - before
    assert turned_away >= 1, "the decode took both at once: the SLO did not count"
    return f"ENGINE_TPOT_SLO_MS={TPOT_SLO_MS} on {len(given)} engines; 2 at once: {turned_away:g} turned away, both served"


def rejected(engine: str) -> float:
    """The engine's count of decode requests it turned away (its metrics)."""
    text = httpx.get(f"{engine}/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("matrixserve_engine_requests_total{")
        and 'stage="decode"' in line
        and 'outcome="rejected"' in line
    )


def refill_scheduled(stage: Stage) -> str:
    body = pool_body("scheduled")
    body["spec"]["refillPolicy"] = "Scheduled"
    message = stage.refused(kinds.WARMPOOL, body)
    assert f"spec.refillPolicy: Invalid value: {SCHEDULED}" in message, message
    spec = WarmPoolSpec.model_validate(body["spec"])
    assert f"spec.refillPolicy: {SCHEDULED}" in problems("scheduled", spec)
    body["spec"]["refillPolicy"] = "Manual"
    stage.create(kinds.WARMPOOL, body, dry_run=True)  # what works is accepted
    return "refused: " + SCHEDULED[:60] + "..."


def performance(stage: Stage) -> str:
    """Out of the CRD: a status that carries it is stored without it."""
    crd = client.ApiextensionsV1Api(stage.api).read_custom_resource_definition(
        f"{kinds.PDGROUP.plural}.{kinds.GROUP}"
    )
    (version,) = [v for v in crd.spec.versions if v.name == kinds.VERSION]
    status = version.schema.open_apiv3_schema.properties["status"]
    assert "performance" not in (status.properties or {})
    stage.custom.patch_namespaced_custom_object_status(
        *stage.groups.where, "g", {"status": {"performance": {"tokensPerSecond": 1}}}
    )
    assert "performance" not in stage.groups.get("g")["status"]
    return "not in the CRD: a status carrying it is stored without it"


def unserved(kind: kinds.Kind) -> Callable[[Stage], str]:
    def row(stage: Stage) -> str:
        name = f"{kind.plural}-probe"

        def ready() -> dict[str, Any] | None:
            status = stage.get(kind, name).get("status") or {}
            found = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
            return found[0] if found else None

        said = wait_for(ready, 30, f"the {kind.kind}'s Ready condition")
        assert (said["status"], said["reason"]) == ("False", NO_CONTROLLER), said
        assert f"no controller runs {kind.kind} objects" in said["message"]
        return f"Ready=False {NO_CONTROLLER}"

    return row


@dataclass(frozen=True)
class Row:
    field: str
    outcome: str  # "runs" (changes what runs) or "refused" (with what works)
    check: Callable[[Stage], str]


ROWS = [
    Row("spec.warmPoolRef", "runs", warm_pool_ref),
    Row("spec.model.prefillArtifact", "refused", artefact("prefill")),
    Row("spec.model.decodeArtifact", "refused", artefact("decode")),
    Row("spec.<role>.parallelism.dp", "refused", data_parallel),
    Row("spec.moe", "refused", moe),
    Row("spec.slo.tpotMilliseconds", "runs", tpot_slo),
    Row("WarmPool spec.refillPolicy: Scheduled", "refused", refill_scheduled),
    Row("status.performance", "refused", performance),
    Row("DPDomain objects", "runs", unserved(kinds.DPDOMAIN)),
]


def test_each_field_of_issue_31_item_3_changes_what_runs_or_is_refused(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    start_operator: Callable[..., Any],
) -> None:
    began = time.monotonic()
    start_operator(namespace, webhook=False, time_scale="50")
    stage = Stage(namespace, api_client, groups, cluster.zookeeper, {})
    for kind, sample in ((kinds.DPDOMAIN, "dpdomain"),):
        body = load(CRDS / "samples" / f"{sample}.yaml")
        body["metadata"] = {"name": f"{kind.plural}-probe"}
        stage.create(kind, body)
    for pool in "ab":
        stage.create(kinds.WARMPOOL, pool_body(pool))
    for pool in "ab":
        wait_for(
            lambda p=pool: (stage.get(kinds.WARMPOOL, p).get("status") or {}).get("ready") == 1,
            90,
            f"WarmPool {pool} with its warm pod",
        )
        stage.pool_pods[pool] = {n: p.metadata.uid for n, p in stage.warm_pods(pool).items()}
    body = pdgroup_body("g", 1, 1)
    body["spec"]["warmPoolRef"] = {"name": "b"}
    body["spec"]["slo"]["tpotMilliseconds"] = TPOT_SLO_MS
    groups.create(body)
    try:
        groups.wait_ready("g")
        setup = time.monotonic() - began
        table, failed = [], []
        for row in ROWS:
            started = time.monotonic()
            try:
                seen = row.check(stage)
            except (AssertionError, client.ApiException, pytest.fail.Exception) as exc:
                seen = f"FAILED: {str(exc)[:300]}"
                failed.append(f"{row.field}: {exc}")
            table.append((row.field, row.outcome, time.monotonic() - started, seen))
        print(f"\nissue 31 item 3, field by field (set-up {setup:.1f} s)")
        for field, outcome, seconds, seen in table:
            print(f"{field:<40}{outcome:<9}{seconds:>6.2f} s  {seen}")
        assert not failed, "\n".join(failed)
    finally:
        with contextlib.suppress(client.ApiException):
            groups.delete("g")
        wait_for(lambda: absent(lambda: groups.get("g")), 30, "the group deleted")
