"""Issue 16 finding 7 on the real ZooKeeper: digest ACLs on MatrixServe's subtrees. The dev
cluster gives the session an identity ($MATRIXSERVE_ZK_AUTH, set by the cluster fixture): the
operator and gateway the tests start use it, engines mount it from the Secret the operator writes
into their namespace. A client without it can neither read, write nor delete under
``/matrixserve`` (ZooKeeper answers ``NoAuth``), while the group gets Ready and serves; a znode
made before (an upgrade) is closed by the operator at start, but a group's subtree only once
every pod of the group carries the credential (engines started before must survive their next
fault); a session renewed after the server lost its data keeps the identity."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.exceptions import NoAuthError
from kubernetes import client

from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session
from matrixserve.devcluster.cluster import ClusterInfo
from matrixserve.devcluster.procs import Supervisor
from testkit.helpers import Groups, events_of, pdgroup_body, serves, wait_for, zookeeper

ENGINE_SECRET = "matrixserve-engine-zookeeper-auth"  # the operator's default


def refused(call: Callable[[], Any]) -> bool:
    try:
        call()
    except NoAuthError:
        return True
    return False


def test_only_matrixserve_reads_writes_or_deletes_its_znodes(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    serving_group: Callable[..., Any],
    start_gateway: Callable[..., str],
    tmp_path: Path,
) -> None:
    auth = os.environ.get("MATRIXSERVE_ZK_AUTH", "")
    assert cluster.zookeeper_auth, "the dev cluster gives MatrixServe a ZooKeeper identity"
    assert auth == cluster.zookeeper_auth
    # A znode an earlier version made, open to all (here by a client with the identity that
    # leaves kazoo's open default ACL): the operator closes it when it starts. In a folder no
    # kind sweeps (an expert pool's subtree without its pool is swept away).
    legacy = f"{zl.ROOT}/legacy-acl-test/{namespace}/map"
    with zookeeper(cluster.zookeeper) as zk:
        zk.create(legacy, b"kept", makepath=True)
    with zookeeper(cluster.zookeeper, auth="") as anon:
        assert anon.get(legacy)[0] == b"kept"

    serving_group()  # the operator with the identity; engines reach Ready through ZooKeeper
    paths = zl.GroupPaths(namespace, "g")
    with zookeeper(cluster.zookeeper, auth="") as anon:
        wait_for(lambda: refused(lambda: anon.get(legacy)), timeout=30, what="legacy closed")
        attempts: dict[str, Callable[[], Any]] = {
            # what the operator writes ...
            "read the map": lambda: anon.get(paths.roce_map),
            "read the init order": lambda: anon.get(paths.init_order),
            "read an entrance": lambda: anon.get(paths.entrance("g-p-0")),
            # ... and what each engine writes
            "read a report": lambda: anon.get(paths.report("g-p-0")),
            "read a health": lambda: anon.get(paths.health_of("g-d-0")),
            "read a link": lambda: anon.get(paths.link("g-p-1", "g-d-0")),
            "list the members": lambda: anon.get_children(paths.reports),
            "list the groups": lambda: anon.get_children(zl.groups_root(namespace)),
            "list the top": lambda: anon.get_children(zl.TOP),
            "overwrite the map": lambda: anon.set(paths.roce_map, b"{}"),
            "remove a member": lambda: anon.create(paths.removed_of("g-p-0"), b"{}"),
            "add an entrance": lambda: anon.create(paths.entrance("evil"), b"{}"),
            "close an entrance": lambda: anon.delete(paths.entrance("g-p-0")),
            "delete the group": lambda: anon.delete(paths.root, recursive=True),
            "delete the legacy znode": lambda: anon.delete(legacy),
        }
        allowed = [what for what, call in attempts.items() if not refused(call)]
        assert not allowed, f"a client without the identity could {allowed}"
    with zookeeper(cluster.zookeeper) as zk:
        assert zk.get(legacy)[0] == b"kept", "closed, not lost"
        assert zl.RoceMap.parse(zk.get(paths.roce_map)[0]).version >= 1
        assert sorted(zk.get_children(paths.entrances)) == ["g-p-0", "g-p-1"]
        zk.delete(f"{zl.ROOT}/legacy-acl-test/{namespace}", recursive=True)

    # Engines mount the identity from the Secret the operator wrote; no pod spec holds it.
    core = client.CoreV1Api(api_client)
    secret = core.read_namespaced_secret(ENGINE_SECRET, namespace)
    assert secret.metadata.labels["app.kubernetes.io/component"] == "zookeeper-auth"
    pods = core.list_namespaced_pod(namespace).items
    assert len(pods) == 3
    for pod in pods:
        assert ENGINE_SECRET in {v.secret.secret_name for v in pod.spec.volumes if v.secret}
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["MATRIXSERVE_ZK_AUTH_FILE"].endswith("/auth")
        assert "MATRIXSERVE_ZK_AUTH" not in env
        assert auth.split(":", 1)[1] not in json.dumps(api_client.sanitize_for_serialization(pod))

    # The gateway with the identity routes by ZooKeeper's entrances and serves ...
    url = start_gateway()
    serves(url)
    routes = httpx.get(f"{url}/v1/routes", trust_env=False).json()
    assert routes["source"] == "zookeeper"
    # ... one without it is refused by ZooKeeper (it can only route by the groups' status).
    start_gateway("--zookeeper-auth=")
    logs = Supervisor(tmp_path / "gateway")
    wait_for(
        lambda: "not armed" in logs.log_path("gateway-1").read_text(),
        timeout=30,
        what="the gateway without the identity refused its entrance watch",
    )
    assert "not armed" not in logs.log_path("gateway-0").read_text()


def _engine_pid(cluster: ClusterInfo, namespace: str, pod: str) -> int:
    """The engine process of ``pod``, from the dev cluster's node emulator."""
    runs = httpx.get(f"{cluster.node_emulator}/pods", timeout=10, trust_env=False).json()
    (run,) = [r for r in runs if (r["namespace"], r["name"]) == (namespace, pod)]
    (pid,) = run["pids"].values()
    return int(pid)


def _recreated(groups: Groups, pod: str, uid: str) -> bool:
    found = groups.pods("g").get(pod)
    return found is not None and found.metadata.uid != uid


def test_an_upgrade_into_auth_keeps_running_engines_working_until_they_are_replaced(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    start_operator: Callable[..., Any],
    start_zookeeper: Callable[[], Any],
) -> None:
    """Finding 2: a group made by an operator without the identity, then the operator restarted
    with it. Its engines have no credential: their subtree stays open (a Warning Event says
    until when), so an engine killed now restarts, registers and links again and the group is
    Ready again; once its pods are recreated with the credential, the subtree is closed. (A
    ZooKeeper of its own: the cluster's tree is closed already by the other tests' operators.)"""
    core = client.CoreV1Api(api_client)
    server = start_zookeeper().address
    before = ("--zookeeper", server, "--zookeeper-auth=")  # the last --zookeeper counts
    operator = start_operator(namespace, webhook=False, extra=before)
    groups.create(pdgroup_body("g", 1, 1))
    groups.wait_ready("g", "the group Ready without ZooKeeper auth")
    paths = zl.GroupPaths(namespace, "g")
    operator.stop()
    operator.args.remove("--zookeeper-auth=")  # the upgrade: the same operator, with it
    operator.start()

    def warned() -> list[Any]:
        return [e for e in events_of(core, namespace, "g") if e.reason == "ZooKeeperAccessOpen"]

    (warning,) = wait_for(warned, timeout=60, what="the group's access said open")
    assert warning.type == "Warning"
    with zookeeper(server, auth="") as anon:
        assert anon.get(paths.report("g-p-0"))[0], "the engines' subtree closed under them"
        assert refused(lambda: anon.get_children(zl.groups_root(namespace))), "the rest is closed"

    pid = _engine_pid(cluster, namespace, "g-p-0")
    os.kill(pid, signal.SIGKILL)  # the first fault since the upgrade
    wait_for(lambda: not groups.ready("g"), timeout=30, what="the group not Ready after a kill")
    groups.wait_ready("g", "the killed engine back: registered and linked again")
    assert _engine_pid(cluster, namespace, "g-p-0") != pid
    assert len(warned()) == 1, "one Warning Event, not one a pass"

    for pod in ("g-p-0", "g-d-0"):  # replaced one at a time, as the Event says
        old = core.read_namespaced_pod(pod, namespace).metadata.uid
        core.delete_namespaced_pod(pod, namespace)
        wait_for(partial(_recreated, groups, pod, old), what=f"{pod} recreated")
        groups.wait_ready("g", f"the group Ready with {pod} recreated")
    closed = wait_for(
        lambda: [e for e in events_of(core, namespace, "g") if e.reason == "ZooKeeperAccessClosed"],
        what="the group's subtree closed",
    )
    assert closed[0].type == "Normal"
    with zookeeper(server, auth="") as anon:
        for path in (paths.report("g-p-0"), paths.health_of("g-d-0"), paths.roce_map):
            assert refused(partial(anon.get, path)), path
    assert groups.ready("g")


async def test_a_renewed_session_keeps_the_identity(
    start_zookeeper: Callable[[], Any],
) -> None:
    """The server lost its data (reinstalled on an empty volume): the session, SUSPENDED past
    its timeout, is renewed with a fresh client, which must authenticate and create znodes
    closed like the first (else everything it writes is open and nothing it reads allowed)."""
    server = start_zookeeper()
    auth = zl.Credentials(zl.USER, secrets.token_hex(8))
    session = Session(server.address, timeout=2.0, auth=auth)
    path = zl.GroupPaths("ns", "g").roce_map
    try:
        await session.connect(attempt_timeout=5, pause=0.2)
        await session.run(session.put, path, b"before", makepath=True)
        server.stop()
        server.wipe()
        server.start()
        deadline = time.monotonic() + 60
        while not (session.renewals >= 1 and session.connected):
            assert time.monotonic() < deadline, "the session was not renewed"
            await asyncio.sleep(0.1)
        await session.run(session.retry, session.put, path, b"after", makepath=True)
    finally:
        await session.stop()
    with zookeeper(server.address, auth="") as anon:
        for node in (zl.TOP, zl.ROOT, path):
            with pytest.raises(NoAuthError):
                anon.get(node)
    with zookeeper(server.address, auth.text()) as zk:
        assert zk.get(path)[0] == b"after"


CHART = Path(__file__).resolve().parents[2] / "charts" / "matrixserve"


def test_the_charts_password_survives_upgrades_and_reinstalls(
    cluster: ClusterInfo,
    api_client: client.ApiClient,
    namespace: str,
    run_tool: Callable[..., Any],
) -> None:
    """Every znode's ACL carries the password's digest: a new password on an upgrade or a
    reinstall (over kept ZooKeeper data) would lock MatrixServe out of its own znodes."""
    release = f"r{namespace[-6:]}"
    secret_name = f"{release}-matrixserve-zookeeper-auth"
    values = (
        *("-n", namespace, "--set", "operator.replicas=0", "--set", "gateway.replicas=0"),
        *("--set", "operator.webhook.enabled=false", "--set", "networkPolicy.enabled=false"),
        *("--set", f"zookeeper.external={cluster.zookeeper}"),
    )
    core = client.CoreV1Api(api_client)

    def password() -> str:
        secret = core.read_namespaced_secret(secret_name, namespace)
        return str(secret.data[zl.CREDENTIALS_KEY])

    run_tool("helm", "install", release, str(CHART), *values)
    first = password()
    assert zl.Credentials.parse(base64.b64decode(first).decode()).user == zl.USER
    run_tool("helm", "upgrade", release, str(CHART), *values, "--set", "operator.logLevel=DEBUG")
    assert password() == first, "an upgrade made a new password"
    off = ("--set", "zookeeper.auth.enabled=false")
    refused_off = run_tool("helm", "upgrade", release, str(CHART), *values, *off, check=False)
    assert refused_off.returncode != 0, "turning the identity off would lock everyone out"
    assert "Keep zookeeper.auth.enabled=true" in refused_off.stderr
    run_tool("helm", "uninstall", release, "-n", namespace, "--wait")
    assert password() == first, "the uninstall took the password (resource-policy keep)"
    reinstalled_off = run_tool("helm", "install", release, str(CHART), *values, *off, check=False)
    assert reinstalled_off.returncode != 0, "a reinstall without it over the kept identity"
    run_tool("helm", "install", release, str(CHART), *values)
    assert password() == first, "a reinstall made a new password"
    run_tool("helm", "uninstall", release, "-n", namespace, "--wait")
