"""``make demo``: MatrixServe's main job on the local cluster, end to end.

1. the cluster (etcd, API server, controller-manager, scheduler, ZooKeeper, node emulator);
2. ``helm upgrade --install`` of ``charts/matrixserve`` in ``matrixserve-system``, the way users
   install it: CRDs, the operator (its webhook served through the chart's Service), the gateway,
   the bundled ZooKeeper, least-privilege RBAC; the node emulator runs those pods;
3. the sample PDGroup (``crds/samples/pdgroup-2p1d.yaml``: 2 prefill + 1 decode, 2 NPUs = 4 dies
   each) in namespace ``matrixserve-demo``, until Ready;
4. its status table, its RoCE map read back from the chart's ZooKeeper, and one OpenAI-style
   streamed chat completion through the gateway's Service, which forwards it on demand to a
   prefill entrance (the answer, the instances that served it, emulated timings).

Everything stays up; ``make cluster-down`` stops it. Re-running upgrades the release and replaces
the group.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from kazoo.client import KazooClient
from kubernetes import client, config

from matrixserve.api import zk_layout as zl
from matrixserve.api.kinds import PDGROUP
from matrixserve.devcluster import tools
from matrixserve.devcluster.cluster import ClusterInfo
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


RELEASE = "matrixserve"
SYSTEM = "matrixserve-system"
# The chart's values for the local cluster: no storage provisioner, no root needed for ports;
# one ZooKeeper server, not the chart's ensemble of three (a lighter demo on a small machine; the
# ensemble's own test is tests/cluster/test_zookeeper_ensemble.py); engines take injected faults
# (POST /v1/faults), to try recovery on the demo. The group runs outside the release namespace:
# the engines' NetworkPolicy goes there too.
LOCAL_VALUES = (
    "zookeeper.persistence=false",
    "zookeeper.replicas=1",
    "gateway.service.port=8080",
    f"operator.engine.timeScale={TIME_SCALE}",
    "operator.engine.faultInjection=true",
    f"networkPolicy.engineNamespaces={{{NAMESPACE}}}",
)


def install_release(info: ClusterInfo) -> None:
    env = {**os.environ, "KUBECONFIG": info.kubeconfig}
    args = [info.helm, "upgrade", "--install", RELEASE, str(REPO / "charts" / "matrixserve")]
    args += ["-n", SYSTEM, "--create-namespace", "--wait", "--timeout", "3m"]
    for value in LOCAL_VALUES:
        args += ["--set", value]
    print(f"$ helm upgrade --install {RELEASE} charts/matrixserve -n {SYSTEM} ...")
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"helm failed ({done.returncode}):\n{done.stderr.strip()}")
    for line in done.stdout.splitlines()[:4]:
        print(f"  {line}")


def service_address(api: client.ApiClient, name: str, port: int) -> str:
    svc = client.CoreV1Api(api).read_namespaced_service(f"{RELEASE}-{name}", SYSTEM)
    return f"{svc.spec.cluster_ip}:{port}"


def create_group_namespace(api: client.ApiClient) -> None:
    """The group's namespace, before the release: the chart puts the engines' NetworkPolicy
    there (``networkPolicy.engineNamespaces``), which needs the namespace to exist."""
    try:
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def apply_group(api: client.ApiClient) -> None:
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    create_group_namespace(api)
    wait_for_service_account(core, NAMESPACE)
    body = yaml.safe_load((REPO / "crds" / "samples" / "pdgroup-2p1d.yaml").read_text())
    try:
        custom.delete_namespaced_custom_object(
            PDGROUP.group, PDGROUP.version, NAMESPACE, PDGROUP.plural, GROUP
        )
        _until("the previous group to go", 60, lambda: not _exists(custom))
        _until("its pods to go", 60, lambda: not core.list_namespaced_pod(NAMESPACE).items)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    custom.create_namespaced_custom_object(
        PDGROUP.group, PDGROUP.version, NAMESPACE, PDGROUP.plural, body
    )


def _exists(custom: client.CustomObjectsApi) -> bool:
    try:
        custom.get_namespaced_custom_object(
            PDGROUP.group, PDGROUP.version, NAMESPACE, PDGROUP.plural, GROUP
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
                PDGROUP.group, PDGROUP.version, NAMESPACE, PDGROUP.plural, GROUP
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


def zookeeper_auth(api: client.ApiClient) -> list[tuple[str, str]] | None:
    """The chart's ZooKeeper identity (its znodes are readable by it alone), as kazoo's
    ``auth_data``; None if the release runs without one."""
    try:
        secret = client.CoreV1Api(api).read_namespaced_secret(f"{RELEASE}-zookeeper-auth", SYSTEM)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return [("digest", base64.b64decode(secret.data[zl.CREDENTIALS_KEY]).decode())]


def show(info: ClusterInfo, zookeeper: str, auth: list[tuple[str, str]] | None) -> None:
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
    zk = KazooClient(hosts=zookeeper, auth_data=auth)
    zk.start(timeout=10)
    try:
        paths = zl.GroupPaths(NAMESPACE, GROUP)
        roce_map = zl.RoceMap.parse(zk.get(paths.roce_map)[0])
        print(
            f"\nRoCE map v{roce_map.version} from the chart's ZooKeeper {zookeeper} ({paths.roce_map}):"
        )
        for role, entries in (("P", roce_map.prefill), ("D", roce_map.decode)):
            for e in entries:
                print(f"  {role}  {e.instance:<14} pod {e.pod_ip:<12} RoCE {', '.join(e.roce_ips)}")
        links = zk.get_children(paths.links)
        subs = sum(len(zl.Link.parse(zk.get(f"{paths.links}/{c}")[0]).sub_links) for c in links)
        print(f"  links: {len(links)} P-D links, {subs} verified sub-links (device k <-> device k)")
        print(f"  entrances: {', '.join(sorted(zk.get_children(paths.entrances)))}")
    finally:
        zk.stop()


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
        "stream_options": {"include_usage": True},  # the usage: a last chunk, as OpenAI
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
    # the choice's last chunk (its matrixserve account), else the last one (an error)
    final = next((c for c in chunks if "matrixserve" in c), chunks[-1] if chunks else {})
    print(f"  answer  : {text.strip()}")
    if "matrixserve" not in final:
        print(f"  error   : {final}")
        return
    t, served = final["matrixserve"]["timings"], final["matrixserve"]["instances"]
    print(
        f"  served  : prefill {served['prefill']}, decode {served['decode']}; usage {chunks[-1].get('usage')}"
    )
    print(
        f"  timings : TTFT {t['ttft'] * 1000:.1f} ms, KV transfer {t['kvTransfer'] * 1000:.2f} ms, "
        f"TPOT {t['tpotMean'] * 1000:.2f} ms, e2e {t['e2e'] * 1000:.0f} ms (emulated)"
    )


def run(info: ClusterInfo) -> int:
    with config.new_client_from_config(config_file=info.kubeconfig) as api:
        print("\nInstalling MatrixServe with its Helm chart ...")
        create_group_namespace(api)
        install_release(info)
        print(
            f"Applying crds/samples/pdgroup-2p1d.yaml as {NAMESPACE}/{GROUP} (2 prefill + 1 decode, 4 dies each):"
        )
        apply_group(api)
        seconds = wait_ready(api)
        print(f"Ready after {seconds:.1f}s (engine time scale {TIME_SCALE}).")
        zookeeper = service_address(api, "zookeeper", 2181)
        auth = zookeeper_auth(api)
        url = f"http://{service_address(api, 'gateway', 8080)}"
    show(info, zookeeper, auth)
    ask_gateway(url)
    print(
        f"\nThe gateway Service stays up at {url} (OpenAI API: /v1/models, /v1/completions, "
        "/v1/chat/completions); `helm uninstall matrixserve -n matrixserve-system` after deleting "
        "the group removes MatrixServe."
    )
    return 0
