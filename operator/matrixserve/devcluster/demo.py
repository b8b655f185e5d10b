"""``make demo``: MatrixServe's main job on the local cluster, end to end.

1. the cluster (etcd, API server, controller-manager, scheduler, ZooKeeper, node emulator);
2. the CRDs, and the operator (validating webhook on, certificate from the cluster's CA);
3. the sample PDGroup (``crds/samples/pdgroup-2p1d.yaml``: 2 prefill + 1 decode, 2 NPUs = 4 dies
   each) in namespace ``matrixserve-demo``, until Ready;
4. its status table, its RoCE map read back from ZooKeeper, and one OpenAI-style streamed chat
   completion through the gateway (``python -m matrixserve.gateway``), which forwards it on demand
   to a prefill entrance (the answer, the instances that served it, emulated timings).

Everything stays up; ``make cluster-down`` stops it. Re-running replaces the group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from kazoo.client import KazooClient
from kubernetes import client, config

from matrixserve.api import zk_layout as zl
from matrixserve.devcluster import pki, tools
from matrixserve.devcluster.cluster import ClusterInfo, DevCluster, free_ports
from matrixserve.devcluster.namespaces import wait_for_service_account

NAMESPACE = "matrixserve-demo"
GROUP = "chat-g0"
REPO = Path(__file__).resolve().parents[3]
TIME_SCALE = "20"


def _until(what: str, timeout: float, attempt: Any, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = attempt()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: {what} within {timeout:.0f}s")
        time.sleep(every)


def install_crds(api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api)
    for path in sorted((REPO / "crds").glob("matrixserve.io_*.yaml")):
        body = yaml.safe_load(path.read_text())
        try:
            ext.create_custom_resource_definition(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            current = ext.read_custom_resource_definition(body["metadata"]["name"])
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            ext.replace_custom_resource_definition(body["metadata"]["name"], body)
    for name in (
        yaml.safe_load(p.read_text())["metadata"]["name"]
        for p in (REPO / "crds").glob("matrixserve.io_*.yaml")
    ):
        _until(
            f"CRD {name} established",
            30,
            lambda n=name: any(
                c.type == "Established" and c.status == "True"
                for c in ext.read_custom_resource_definition(n).status.conditions or []
            ),
        )


def ensure_operator(cluster: DevCluster, info: ClusterInfo) -> None:
    record = cluster.supervisor.record("operator")
    if record is not None and record.alive():
        return
    pki_dir = Path(info.state_dir) / "pki"
    ca = pki.KeyPair(pki_dir / "ca.crt", pki_dir / "ca.key")
    cert = pki.issue_certificate(ca, pki_dir, "webhook", "matrixserve-webhook", ["IP:127.0.0.1"])
    metrics, liveness, webhook = free_ports(3)
    cluster.supervisor.start(
        "operator",
        [
            sys.executable,
            "-m",
            "matrixserve",
            "--zookeeper",
            info.zookeeper,
            "--engine-time-scale",
            TIME_SCALE,
            "--metrics-port",
            str(metrics),
            "--liveness-port",
            str(liveness),
            "--webhook-port",
            str(webhook),
            "--webhook-cert",
            str(cert.cert),
            "--webhook-key",
            str(cert.key),
            "--webhook-ca",
            str(ca.cert),
        ],
        env={**os.environ, "KUBECONFIG": info.kubeconfig},
    )
    _until("the operator to be live", 30, lambda: _live(liveness))
    (Path(info.state_dir) / "operator.json").write_text(
        json.dumps(
            {
                "metrics": f"http://127.0.0.1:{metrics}/metrics",
                "liveness": f"http://127.0.0.1:{liveness}/healthz",
            }
        )
    )


def _live(port: int) -> bool:
    try:
        return (
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1, trust_env=False).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


def apply_group(api: client.ApiClient) -> None:
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    try:
        core.create_namespace({"metadata": {"name": NAMESPACE}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    wait_for_service_account(core, NAMESPACE)
    body = yaml.safe_load((REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text())
    try:
        custom.delete_namespaced_custom_object(
            "matrixserve.io", "v1alpha1", NAMESPACE, "pdgroups", GROUP
        )
        _until("the previous group to go", 60, lambda: not _exists(custom))
        _until("its pods to go", 60, lambda: not core.list_namespaced_pod(NAMESPACE).items)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    custom.create_namespaced_custom_object(
        "matrixserve.io", "v1alpha1", NAMESPACE, "pdgroups", body
    )


def _exists(custom: client.CustomObjectsApi) -> bool:
    try:
        custom.get_namespaced_custom_object(
            "matrixserve.io", "v1alpha1", NAMESPACE, "pdgroups", GROUP
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def wait_ready(api: client.ApiClient) -> float:
    custom = client.CustomObjectsApi(api)
    started = time.monotonic()
    last = ""

    def ready() -> bool:
        nonlocal last
        status = (
            custom.get_namespaced_custom_object(
                "matrixserve.io", "v1alpha1", NAMESPACE, "pdgroups", GROUP
            ).get("status")
            or {}
        )
        conds = {c["type"]: c for c in status.get("conditions", [])}
        line = (
            f"  {time.monotonic() - started:5.1f}s  {conds.get('Ready', {}).get('reason', 'Pending'):<10} "
            f"{conds.get('Ready', {}).get('message', '')}  links {status.get('links', {}).get('summary', '-')}"
        )
        if line.split("s ", 1)[1] != last:
            print(line, flush=True)
            last = line.split("s ", 1)[1]
        return bool(conds.get("Ready", {}).get("status") == "True")

    _until("the PDGroup to become Ready", 180, ready, every=0.3)
    return time.monotonic() - started


def show(info: ClusterInfo) -> None:
    env = {**os.environ, "KUBECONFIG": info.kubeconfig}
    kubectl = str(tools.kubectl_path())
    for args in (
        ["get", "pdgroups", "-n", NAMESPACE, "-o", "wide"],
        ["get", "pods", "-n", NAMESPACE, "-o", "wide"],
    ):
        print(f"\n$ kubectl {' '.join(args)}")
        print(
            subprocess.run(
                [kubectl, *args], env=env, capture_output=True, text=True, check=False
            ).stdout.rstrip()
        )
    zk = KazooClient(hosts=info.zookeeper)
    zk.start(timeout=10)
    try:
        paths = zl.GroupPaths(NAMESPACE, GROUP)
        roce_map = zl.RoceMap.parse(zk.get(paths.roce_map)[0])
        print(f"\nRoCE map v{roce_map.version} from ZooKeeper ({paths.roce_map}):")
        for role, entries in (("P", roce_map.prefill), ("D", roce_map.decode)):
            for e in entries:
                print(f"  {role}  {e.instance:<14} pod {e.pod_ip:<12} RoCE {', '.join(e.roce_ips)}")
        links = zk.get_children(paths.links)
        subs = sum(len(zl.Link.parse(zk.get(f"{paths.links}/{c}")[0]).sub_links) for c in links)
        print(f"  links: {len(links)} P-D links, {subs} verified sub-links (device k <-> device k)")
        print(f"  entrances: {', '.join(sorted(zk.get_children(paths.entrances)))}")
    finally:
        zk.stop()


def ensure_gateway(cluster: DevCluster, info: ClusterInfo) -> str:
    state = Path(info.state_dir) / "gateway.json"
    record = cluster.supervisor.record("gateway")
    if record is not None and record.alive() and state.exists():
        return str(json.loads(state.read_text())["url"])
    (port,) = free_ports(1)
    cluster.supervisor.start(
        "gateway",
        [
            sys.executable,
            "-m",
            "matrixserve.gateway",
            "--zookeeper",
            info.zookeeper,
            "--port",
            str(port),
            "--time-scale",
            TIME_SCALE,
        ],
        env={**os.environ, "KUBECONFIG": info.kubeconfig},
    )
    url = f"http://127.0.0.1:{port}"
    _until("the gateway to be up", 30, lambda: _get_ok(f"{url}/healthz"))
    state.write_text(json.dumps({"url": url}))
    return url


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _knows(url: str, scenario: str) -> bool:
    models = httpx.get(f"{url}/v1/models", timeout=5, trust_env=False).json()["data"]
    return scenario in [m["id"] for m in models]


def ask_gateway(url: str) -> None:
    """One OpenAI-style streamed chat completion through the gateway."""
    body = {
        "model": "general",
        "messages": [
            {"role": "user", "content": "Explain disaggregated prefill and decode serving. " * 30}
        ],
        "max_tokens": 24,
        "stream": True,
    }
    print(
        f'\nOne OpenAI chat completion through the gateway ({url}/v1/chat/completions, model "general"):'
    )
    _until("the gateway to know the scenario", 30, lambda: _knows(url, "general"))
    chunks = []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=60, trust_env=False
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    final = chunks[-1] if chunks else {}
    print(f"  answer  : {text.strip()}")
    if "matrixserve" not in final:
        print(f"  error   : {final}")
        return
    t, served = final["matrixserve"]["timings"], final["matrixserve"]["instances"]
    print(
        f"  served  : prefill {served['prefill']}, decode {served['decode']}; usage {final['usage']}"
    )
    print(
        f"  timings : TTFT {t['ttft'] * 1000:.1f} ms, KV transfer {t['kvTransfer'] * 1000:.2f} ms, "
        f"TPOT {t['tpotMean'] * 1000:.2f} ms, e2e {t['e2e'] * 1000:.0f} ms (emulated)"
    )


def run(cluster: DevCluster, info: ClusterInfo) -> int:
    with config.new_client_from_config(config_file=info.kubeconfig) as api:
        print("\nInstalling the CRDs and starting the operator ...")
        install_crds(api)
        ensure_operator(cluster, info)
        print(
            f"Applying crds/samples/pdgroup-2p1d.yaml as {NAMESPACE}/{GROUP} (2 prefill + 1 decode, 4 dies each):"
        )
        apply_group(api)
        seconds = wait_ready(api)
        print(f"Ready after {seconds:.1f}s (engine time scale {TIME_SCALE}).")
    show(info)
    url = ensure_gateway(cluster, info)
    ask_gateway(url)
    print(
        f"\nThe gateway stays up at {url} (OpenAI API: /v1/models, /v1/completions, /v1/chat/completions)."
    )
    return 0
