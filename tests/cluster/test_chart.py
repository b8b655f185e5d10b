"""The Helm chart: ``helm lint`` clean, bad values refused by its schema with a clear message;
installed, upgraded and uninstalled on the local cluster; its gateways spread over servers and
replaced after a server is lost (issue 31)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kazoo.client import KazooClient
from kubernetes import client, config

from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import LABEL_GROUP
from matrixserve.devcluster.cluster import ClusterInfo, free_ports
from matrixserve.devcluster.procs import Supervisor
from testkit.chaoskit import emulator_fault
from testkit.helpers import (
    Groups,
    absent,
    explain_namespace,
    pdgroup_body,
    serves,
    service_account_token,
    wait_for,
)

CHART = Path(__file__).resolve().parents[2] / "charts" / "matrixserve"

# An HTTP 403 in a log line ("(403)", " 403 ", "status=403"), not the digits of a port (40379)
# or of a log timestamp's milliseconds (",403").
FORBIDDEN = r"(?<![\w.,:-])403(?!\w)"


def test_helm_lint_is_clean(run_tool: Callable[..., Any]) -> None:
    result = run_tool("helm", "lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_bad_values_fail_with_the_schema_message(run_tool: Callable[..., Any]) -> None:
    bad_scale = run_tool(
        "helm", "template", "x", str(CHART), "--set", "operator.engine.timeScale=-1", check=False
    )
    assert bad_scale.returncode != 0
    assert "/operator/engine/timeScale" in bad_scale.stderr
    many = run_tool(
        "helm", "template", "x", str(CHART), "--set", "operator.replicas=9", check=False
    )
    assert many.returncode != 0
    assert "/operator/replicas" in many.stderr
    typo = run_tool(
        "helm", "template", "x", str(CHART), "--set", "zookeper.external=a:1", check=False
    )
    assert typo.returncode != 0
    assert "zookeper" in typo.stderr
    bad_address = run_tool(
        "helm",
        "template",
        "x",
        str(CHART),
        "--set",
        "zookeeper.external=not an address",
        check=False,
    )
    assert bad_address.returncode != 0
    assert "zookeeper.external" in bad_address.stderr or "external" in bad_address.stderr
    good = run_tool("helm", "template", "x", str(CHART), "--set", "zookeeper.external=zk-0.zk:2181")
    assert good.returncode == 0


def test_the_rendered_chart_runs_locked_down_with_no_wildcard_rbac(
    run_tool: Callable[..., Any],
) -> None:
    rendered = run_tool(
        "helm", "template", "r", str(CHART), "--set", "nodeEmulator.enabled=true",
        "--set", "metrics.serviceMonitor.enabled=true",
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    (operator,) = [d for d in by_kind["Deployment"] if d["metadata"]["name"].endswith("-operator")]
    # two replicas electing a leader on a Lease; a rollout surges (the webhook served throughout)
    assert operator["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert operator["spec"]["replicas"] == 2
    assert "--leader-elect" in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert any(b["metadata"]["name"].endswith("-operator") for b in by_kind["PodDisruptionBudget"])
    assert operator["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]
    for workload in by_kind["Deployment"] + by_kind["DaemonSet"]:
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, workload["metadata"]["name"]
            assert ctx["readOnlyRootFilesystem"] is True, workload["metadata"]["name"]
            assert ctx["runAsNonRoot"] is True, workload["metadata"]["name"]
            assert container["resources"]["limits"], workload["metadata"]["name"]
    for role in by_kind["ClusterRole"] + by_kind["Role"]:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"], role["metadata"]["name"]
            assert "*" not in rule["resources"], role["metadata"]["name"]
            # Secrets by name only; but the operator creates the engines' ZooKeeper credential
            # where it creates engine pods, and RBAC cannot limit a create by name.
            operator_create = (
                rule["verbs"] == ["create"] and "-operator" in role["metadata"]["name"]
            )
            assert (
                not {"secrets"} & set(rule["resources"])
                or rule.get("resourceNames")
                or operator_create
            ), f"{role['metadata']['name']}: Secrets only by name"
    (webhook,) = by_kind["ValidatingWebhookConfiguration"]
    # One entry per admission handler (kopf serves each at /<handler id>): the PDGroup and the
    # ExpertPool themselves, and their scale subresources (`kubectl scale` is checked by the
    # same rules).
    routes = {
        (hook["clientConfig"]["service"]["path"], resource)
        for hook in webhook["webhooks"]
        for rule in hook["rules"]
        for resource in rule["resources"]
    }
    assert routes == {
        ("/pdgroup-rules", "pdgroups"),
        ("/pdgroup-scale", "pdgroups/scale"),
        ("/expertpool-rules", "expertpools"),
        ("/expertpool-scale", "expertpools/scale"),
    }
    assert all(hook["clientConfig"]["caBundle"] for hook in webhook["webhooks"])
    assert {"ServiceMonitor", "PodMonitor", "ConfigMap", "StatefulSet"} <= set(by_kind)


def _service_account_kubeconfig(
    cluster: ClusterInfo, core: client.CoreV1Api, namespace: str, account: str, path: Path
) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount: a token requested for it."""
    value = service_account_token(core, namespace, account)
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": cluster.server,
                            "certificate-authority": cluster.ca_file,
                        },
                    }
                ],
                "users": [{"name": account, "user": {"token": value}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": account}}],
                "current-context": "c",
            }
        )
    )
    return path


def _kubectl_get(run_tool: Callable[..., Any], *what: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(run_tool("kubectl", "get", *what, "-o", "json").stdout)
    return found


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_operator_runs_the_pdgroup_lifecycle_with_only_the_charts_rbac(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    run_tool: Callable[..., Any],
    serving_group: Callable[..., Any],
    tmp_path: Path,
) -> None:
    # Unique per test (the chart's cluster-scoped objects are named after it), and short enough
    # that the chart's names are not truncated.
    release = f"r{namespace[-6:]}"
    run_tool(
        "helm", "install", release, str(CHART), "-n", namespace,
        "--set", f"watchNamespaces={{{namespace}}}",
        "--set", "operator.replicas=0", "--set", "gateway.replicas=0",
        "--set", "operator.webhook.enabled=false",
        "--set", f"zookeeper.external={cluster.zookeeper}",
    )  # fmt: skip
    core = client.CoreV1Api(api_client)
    try:
        account = f"{release}-matrixserve-operator"
        kubeconfig = _service_account_kubeconfig(
            cluster, core, namespace, account, tmp_path / "operator.kubeconfig"
        )
        # The chart's name for the engines' ZooKeeper credential (not the chart's own Secret:
        # the operator writes its copy under a name of its own, the one its RBAC names).
        secret = f"{release}-matrixserve-engine-zookeeper-auth"
        # The engines' NetworkPolicy as the chart gives it (issue 31). The chart's own copy in
        # the watched namespace taken away: the operator writes its own (create, get, by name).
        deployment = client.AppsV1Api(api_client).read_namespaced_deployment(
            f"{release}-matrixserve-operator", namespace
        )
        policy_flags = [
            a for a in deployment.spec.template.spec.containers[0].args
            if a.startswith("--engine-network-policy")
        ]  # fmt: skip
        assert len(policy_flags) == 2, policy_flags
        networking = client.NetworkingV1Api(api_client)
        policy = f"{release}-matrixserve-engines"
        networking.delete_namespaced_network_policy(policy, namespace)
        operator = serving_group(
            webhook=False,
            extra=(
                *("--kubeconfig", str(kubeconfig), "--engine-zookeeper-auth-secret", secret),
                *policy_flags,
            ),
        )
        written = networking.read_namespaced_network_policy(policy, namespace).metadata.labels
        assert written["app.kubernetes.io/managed-by"] == "matrixserve-operator", written
        # The gateway under its own ServiceAccount discovers the group and serves a request.
        gateway_kubeconfig = _service_account_kubeconfig(
            cluster, core, namespace, f"{release}-matrixserve-gateway", tmp_path / "gw.kubeconfig"
        )
        (port,) = free_ports(1)
        supervisor = Supervisor(tmp_path / "gateway")
        supervisor.start(
            "gateway",
            [
                *(
                    sys.executable,
                    "-m",
                    "matrixserve.gateway",
                    "--kubeconfig",
                    str(gateway_kubeconfig),
                ),
                *("--zookeeper", cluster.zookeeper, "--namespace", namespace),
                *("--port", str(port), "--time-scale", "20", "--drain-seconds", "0"),
            ],
            env=dict(os.environ),
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _answers(f"{url}/healthz"), timeout=30, what="the gateway")
            try:
                serves(url)
            except AssertionError as exc:  # (what it answered, and what it logged)
                raise AssertionError(
                    f"{exc}\n{supervisor.log_path('gateway').read_text()[-3000:]}"
                ) from exc
        finally:
            supervisor.stop("gateway")
        gateway_log = supervisor.log_path("gateway").read_text()
        assert "Forbidden" not in gateway_log, gateway_log[-2000:]
        # Scale decode out.
        groups.patch("g", {"decode": {"replicas": 2}})

        def pods() -> list[str]:
            return sorted(groups.pods("g"))

        wait_for(lambda: len(pods()) == 4 and groups.ready("g"), what="decode 1 -> 2")
        # A fault: an engine pod disappears; the operator replaces it.
        core.delete_namespaced_pod("g-d-1", namespace, grace_period_seconds=0)
        wait_for(
            lambda: "g-d-1" in pods() and groups.ready("g"),
            what="the lost decode replaced and the group Ready again",
            explain=lambda: (
                explain_namespace(cluster.state_dir, api_client, namespace)
                + f"\n--- the operator:\n{operator.log()[-4000:]}"
            ),
        )
        # Scale prefill in: the operator deletes the pod it takes out of service.
        groups.patch("g", {"prefill": {"replicas": 1}})
        wait_for(lambda: "g-p-1" not in pods() and groups.ready("g"), what="prefill 2 -> 1")
        groups.delete("g")

        wait_for(lambda: absent(lambda: groups.get("g")), what="the group deleted (finalizer run)")
        log = operator.log()
        refused = [
            line
            for line in log.splitlines()
            if "Forbidden" in line
            or re.search(FORBIDDEN, line)
            or "Failed to post an event" in line
        ]
        assert not refused, "\n".join(refused[:5])
        reasons = {
            e.reason
            for e in core.list_namespaced_event(namespace).items
            if e.involved_object.kind == "PDGroup"
        }
        assert {"CreatedPod", "DeletedPod"} <= reasons, reasons
        assert not re.search(FORBIDDEN, log), log[-3000:]

        # What the chart does not grant is refused.
        with config.new_client_from_config(config_file=str(kubeconfig)) as as_operator:
            denied: list[Callable[[], object]] = [
                lambda: client.CoreV1Api(as_operator).list_namespaced_secret(namespace),
                lambda: client.CoreV1Api(as_operator).delete_node("nonexistent"),
                lambda: client.CoreV1Api(as_operator).list_namespaced_pod("default"),
                lambda: client.CustomObjectsApi(as_operator).list_namespaced_custom_object(
                    *Groups(as_operator, "default").where
                ),
                lambda: client.AppsV1Api(as_operator).list_namespaced_deployment(namespace),
            ]
            for call in denied:
                with pytest.raises(client.ApiException) as denial:
                    call()
                assert denial.value.status == 403
            # ... and the one Secret it may read is its webhook certificate, by name.
            with pytest.raises(client.ApiException) as missing:
                client.CoreV1Api(as_operator).read_namespaced_secret(
                    f"{release}-matrixserve-webhook-tls", namespace
                )
            assert missing.value.status == 404  # allowed, and absent: the webhook is off here
    finally:
        run_tool("helm", "uninstall", release, "-n", namespace, "--wait")


def _webhook_key_folders() -> set[Path]:
    """The operators' webhook key folders (pods here are processes on this machine)."""
    return set(Path(tempfile.gettempdir()).glob("matrixserve-webhook-*"))


def test_helm_install_upgrade_uninstall_on_the_local_cluster(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    crds_installed: list[str],
    groups: Groups,
    run_tool: Callable[..., Any],
) -> None:
    """The chart for real: operator, gateway and ZooKeeper pods run (the node emulator maps the
    images to local commands, gives each pod its ServiceAccount's token and routes Services),
    the chart's webhook refuses an invalid group, a sample group gets Ready, a request through
    the gateway's Service streams; an upgrade rolls the operator and leaves the group's pods
    alone; deleting the group and uninstalling leaves no pods, no znodes, and none of the
    operator's webhook key files (each operator run writes its Secret to a private temporary
    directory: pods here are processes on this machine, so its temporary directory is this one)."""
    key_folders = _webhook_key_folders()
    release = f"r{namespace[-6:]}"
    full = f"{release}-matrixserve"
    core = client.CoreV1Api(api_client)
    common = [
        *("-n", namespace, "--set", f"watchNamespaces={{{namespace}}}"),
        *("--set", "zookeeper.persistence=false", "--set", "gateway.service.port=8080"),
        *("--set", "operator.engine.timeScale=20", "--set", "operator.engine.loadSource=NPUForkUB"),
        *("--set", "gateway.drainSeconds=1"),  # the uninstall's gateways stop in a second
        # one operator: the lifecycle here; two electing a leader: tests/cluster/test_ha.py
        *("--set", "operator.replicas=1"),
    ]
    run_tool("helm", "install", release, str(CHART), *common)

    def component_pods(component: str) -> list[Any]:
        listed = core.list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/component={component}"
        ).items
        return [p for p in listed if not p.metadata.deletion_timestamp]

    def running(component: str, count: int = 1) -> Any:
        """The component's one pod (or ``count`` pods) once all are Running and Ready."""
        pods = component_pods(component)
        ready = [
            p
            for p in pods
            if p.status.phase == "Running"
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]
        if len(pods) != count or len(ready) != count:
            return None
        return ready[0] if count == 1 else ready

    def refusal(bad: dict[str, Any]) -> client.ApiException | None:
        try:
            groups.create(bad, dry_run="All")
        except client.ApiException as exc:
            return exc
        return None

    zk_service = core.read_namespaced_service(f"{full}-zookeeper", namespace)
    zk = KazooClient(hosts=f"{zk_service.spec.cluster_ip}:2181")
    try:
        # the chart's default: an ensemble of three, Ready once a quorum serves
        wait_for(lambda: running("zookeeper", 3), timeout=60, what="the ZooKeeper servers")
        operator_pod = wait_for(lambda: running("operator"), timeout=60, what="the operator pod")
        wait_for(lambda: running("gateway", 2), timeout=60, what="the two gateway pods")
        wait_for(
            lambda: _webhook_key_folders() - key_folders,
            timeout=30,
            what="the operator's webhook key files (else the check after uninstall checks nothing)",
        )
        zk.start(timeout=15)  # through the Service's ClusterIP
        # The operator process runs with its ServiceAccount's token, nothing else.
        emulated = httpx.get(f"{cluster.node_emulator}/pods", trust_env=False).json()
        (pid,) = [
            p["pids"]["operator"] for p in emulated if p["name"] == operator_pod.metadata.name
        ]
        environ = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in item
        )
        used = yaml.safe_load(Path(environ["KUBECONFIG"]).read_text())["users"][0]["user"]["token"]
        # (the API server says whose token it is: one bound to the operator's pod, from the
        # TokenRequest API)
        review = client.AuthenticationV1Api(api_client).create_token_review(
            client.V1TokenReview(spec=client.V1TokenReviewSpec(token=used))
        )
        assert review.status.authenticated, review.status
        assert review.status.user.username == (f"system:serviceaccount:{namespace}:{full}-operator")
        extra = review.status.user.extra or {}
        assert extra.get("authentication.kubernetes.io/pod-name") == [operator_pod.metadata.name], (
            extra
        )

        # The chart's webhook (API server -> Service -> operator pod) refuses an invalid group
        # (a rule only the operator's catalogue can judge: the CRD's own rules are the API
        # server's, refused with no webhook at all).
        bad = pdgroup_body("bad")
        bad["spec"]["model"]["name"] = "gpt3-175b"
        refused = wait_for(
            lambda: refusal(bad), timeout=30, what="the webhook to refuse an invalid group"
        )
        assert refused.status == 422, refused.body
        assert "of weights do not fit 2 NPUs" in refused.body
        bad["spec"]["model"]["name"] = "llama3-8b"
        # Engine resources: a quantity the CRD's pattern refuses (the API server's own
        # message), and a limit below its request, which the webhook refuses.
        bad["spec"]["decode"] = {"replicas": 1, "resources": {"requests": {"cpu": "1.5.3"}}}
        not_a_quantity = refusal(bad)
        assert not_a_quantity is not None
        assert not_a_quantity.status == 422, not_a_quantity.body
        assert "spec.decode.resources.requests.cpu" in not_a_quantity.body
        below = {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}
        bad["spec"]["decode"]["resources"] = below
        limit_below = refusal(bad)
        assert limit_below is not None
        assert "spec.decode.resources.limits.memory: 1Gi is below the request 2Gi" in (
            limit_below.body
        )

        body = pdgroup_body("g")
        body["spec"]["decode"]["resources"] = {"requests": {"cpu": 1, "memory": "512Mi"}}
        groups.create(body)
        groups.wait_ready("g")
        # The engine pods, as the API server stored them (issue 16 finding 8): unprivileged,
        # and Burstable (CPU and memory requested), not BestEffort; the emulator ran them.
        for engine in core.list_namespaced_pod(namespace, label_selector=LABEL_GROUP).items:
            assert engine.status.qos_class == "Burstable", engine.metadata.name
            assert engine.spec.security_context.run_as_non_root is True
            assert engine.spec.security_context.seccomp_profile.type == "RuntimeDefault"
            (container,) = engine.spec.containers
            assert container.security_context.read_only_root_filesystem is True
            assert container.security_context.capabilities.drop == ["ALL"]
            decode = engine.metadata.name.startswith("g-d-")
            assert container.resources.requests["cpu"] == ("1" if decode else "250m")
            assert container.resources.requests["memory"] == ("512Mi" if decode else "256Mi")
        # ... and a scale beyond the rules (the scale subresource: the chart's second entry):
        # a total the ratio policy cannot split on its ladder.
        groups.patch("g", {"ratioPolicy": {"mode": "Model", "ladder": ["2:1"]}})
        with pytest.raises(client.ApiException) as scale_refused:
            groups.custom.patch_namespaced_custom_object_scale(
                *groups.where, "g", {"spec": {"replicas": 3}}
            )
        assert scale_refused.value.status == 422, scale_refused.value.body
        assert "no split of the total of 5 instances" in scale_refused.value.body
        groups.patch("g", {"ratioPolicy": {"mode": "Fixed", "ladder": None}})
        paths = zl.GroupPaths(namespace, "g")
        assert zk.exists(paths.root) is not None, "the group lives in the bundled ZooKeeper"
        gateway_service = core.read_namespaced_service(f"{full}-gateway", namespace)
        url = f"http://{gateway_service.spec.cluster_ip}:8080"
        wait_for(
            lambda: "general" in httpx.get(f"{url}/v1/models", trust_env=False).text,
            timeout=20,
            what="the gateway to see the group",
        )
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={
                "model": "general",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 4,
            },
            timeout=30,
            trust_env=False,
        ) as response:
            assert response.status_code == 200
            chunks = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]"
        assert sum('"content"' in c for c in chunks) >= 4

        def group_pods() -> dict[str, str]:
            listed = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_GROUP}=g")
            return {p.metadata.name: p.metadata.uid for p in listed.items}

        engines = group_pods()
        run_tool(
            "helm", "upgrade", release, str(CHART), *common, "--set", "operator.logLevel=DEBUG",
        )  # fmt: skip

        def rolled() -> bool:
            pod = running("operator")
            return pod is not None and pod.metadata.uid != operator_pod.metadata.uid

        wait_for(rolled, timeout=60, what="the operator rolled by the upgrade")
        assert group_pods() == engines, "the upgrade must not touch the group's pods"
        assert groups.ready("g")
        # Two gateways (the default): a disruption budget keeps one.
        pdb = ("pdb", "-n", namespace, f"{full}-gateway")
        budget = _kubectl_get(run_tool, *pdb)
        assert budget["apiVersion"] == "policy/v1"
        assert budget["spec"]["maxUnavailable"] == 1

        def allowed() -> bool:
            status = _kubectl_get(run_tool, *pdb).get("status", {})
            return (status.get("currentHealthy"), status.get("disruptionsAllowed")) == (2, 1)

        wait_for(allowed, timeout=60, what="both gateways healthy and one disruption allowed")

        groups.delete("g")
        wait_for(lambda: zk.exists(paths.root) is None, what="the group's znodes removed")
        run_tool("helm", "uninstall", release, "-n", namespace, "--wait")
        wait_for(
            lambda: not core.list_namespaced_pod(namespace).items,
            timeout=60,
            what="no pod left in the namespace",
        )
        webhooks = client.AdmissionregistrationV1Api(api_client)
        names = [w.metadata.name for w in webhooks.list_validating_webhook_configuration().items]
        assert f"{full}-pdgroups" not in names, "the chart's webhook goes with the release"
        left = _webhook_key_folders() - key_folders
        assert not left, f"the stopped operators left their webhook key files behind: {left}"
    finally:
        zk.stop()
        run_tool("helm", "uninstall", release, "-n", namespace, check=False)


def test_two_gateways_on_two_servers_one_server_lost_the_service_answers_and_one_is_replaced(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    crds_installed: list[str],
    run_tool: Callable[..., Any],
) -> None:
    """Issue 31 item 1, the gateway: the chart's two gateways run on two servers (the topology
    spread); ``node-down`` of one gateway's server, and requests through the gateway Service
    keep succeeding at once (a client retrying a reset or refused connection once, as the
    openai client does: the emulator's Service passes the dead backend over); after
    controlPlane.tolerationSeconds (5 s here) the taint eviction controller evicts the lost
    gateway and its replacement runs on a third server (never beside the survivor while a
    server is free). Operator and ZooKeeper are not installed (the cluster's ZooKeeper)."""
    core = client.CoreV1Api(api_client)
    control = cluster.node_emulator
    nodes = httpx.get(f"{control}/nodes", trust_env=False).json()
    superpod = nodes[0]["superpod"]
    servers = sorted(n["name"] for n in nodes if n["superpod"] == superpod and not n["down"])
    assert len(servers) >= 3, f"the cluster's emulator has {servers} in {superpod}: 3 needed"
    toleration = 5
    release = f"r{namespace[-6:]}"
    full = f"{release}-matrixserve"
    run_tool(
        "helm", "install", release, str(CHART), "-n", namespace,
        "--set", f"watchNamespaces={{{namespace}}}",
        "--set", "operator.replicas=0", "--set", "operator.webhook.enabled=false",
        "--set", f"zookeeper.external={cluster.zookeeper}",
        "--set", "gateway.service.port=8080",
        # on the cluster's emulator (its Service proxy), not on a private one's servers
        "--set", f"gateway.nodeSelector.matrixserve\\.io/superpod={superpod}",
        "--set", f"controlPlane.tolerationSeconds={toleration}",
        "--set", "gateway.drainSeconds=1", "--set", "gateway.finishSeconds=5",
    )  # fmt: skip

    def gateways() -> list[Any]:
        listed = core.list_namespaced_pod(
            namespace, label_selector="app.kubernetes.io/component=gateway"
        ).items
        return sorted(listed, key=lambda p: p.metadata.creation_timestamp)

    def serving(pod: Any) -> bool:
        return (
            pod.metadata.deletion_timestamp is None
            and pod.status.phase == "Running"
            and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        )

    down: str | None = None
    stop = threading.Event()
    try:
        first = wait_for(
            lambda: (ready := [p for p in gateways() if serving(p)]) and len(ready) == 2 and ready,
            timeout=60,
            what="two gateways Ready",
        )
        placed = {p.spec.node_name for p in first}
        assert len(placed) == 2, f"both gateways on {placed}: not spread over servers"
        url = f"http://{core.read_namespaced_service(f'{full}-gateway', namespace).spec.cluster_ip}:8080"
        wait_for(lambda: _answers(f"{url}/v1/models"), timeout=20, what="the gateway Service")

        outcomes: list[tuple[float, float, str]] = []  # (start, duration, "ok" or the error)

        def load() -> None:
            """Steady requests on a pooled connection, each retried once on a connection
            error (refused, reset, closed)."""
            with httpx.Client(timeout=5, trust_env=False) as http:
                while not stop.is_set():
                    began = time.monotonic()
                    outcome = "ok"
                    for attempt in (1, 2):
                        try:
                            response = http.get(f"{url}/v1/models")
                            if response.status_code != 200:
                                outcome = f"HTTP {response.status_code}"
                            break
                        except httpx.TransportError as exc:
                            if attempt == 2:
                                outcome = repr(exc)
                    outcomes.append((began, time.monotonic() - began, outcome))
                    time.sleep(0.02)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(1)
        lost, kept = first
        down = lost.spec.node_name
        struck = time.monotonic()
        emulator_fault(control, kind="node-down", node=down)

        def replaced() -> Any:
            fresh = [p for p in gateways() if serving(p) and p.metadata.uid != kept.metadata.uid]
            return fresh[0] if fresh else None

        replacement = wait_for(
            replaced, timeout=toleration + 25, what="a replacement gateway Ready"
        )
        took = time.monotonic() - struck
        time.sleep(1)  # requests on the replacement too
        stop.set()
        loader.join(timeout=10)

        evicted = core.read_namespaced_pod(lost.metadata.name, namespace)
        assert evicted.metadata.deletion_timestamp is not None, "the lost gateway not evicted"
        assert replacement.spec.node_name not in (down, kept.spec.node_name), (
            f"the replacement went to {replacement.spec.node_name}: "
            f"lost {down}, survivor {kept.spec.node_name}, free servers left"
        )
        assert toleration <= took <= toleration + 20, f"replaced {took:.1f} s after node-down"
        during = [o for o in outcomes if o[0] >= struck]
        failed = [o for o in outcomes if o[2] != "ok"]
        assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:5]}"
        assert len(during) >= 50, f"only {len(during)} requests during the outage"
        slowest = max(d for _, d, _ in during)
        assert slowest < 2, f"a request took {slowest:.2f} s during the outage (not at once)"

        # More gateways than live servers still schedule, and the down server is no domain of
        # the spread (else its 0 gateways would hold every other server to 1: Pending).
        many = len(servers)
        client.AppsV1Api(api_client).patch_namespaced_deployment_scale(
            f"{full}-gateway", namespace, {"spec": {"replicas": many}}
        )
        wait_for(
            lambda: len([p for p in gateways() if serving(p)]) == many,
            timeout=30,
            what=f"{many} gateways Ready on {many - 1} live servers",
        )
        spread = Counter(p.spec.node_name for p in gateways() if serving(p))
        assert down not in spread
        assert sorted(spread.values()) == [1] * (many - 2) + [2], spread
    finally:
        stop.set()
        if down is not None:
            with contextlib.suppress(RuntimeError):
                emulator_fault(control, heal=True, kind="node-down", node=down)
        run_tool("helm", "uninstall", release, "-n", namespace, check=False)
