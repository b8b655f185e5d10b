"""Issue 16 finding 7: ZooKeeper digest ACLs on MatrixServe's subtrees. The credential's format,
the session's clients (renewed ones too) carrying the identity and the ACL, the walk that gives
our ACL to znodes made before, how engines get the credential (a Secret by reference, never the
value in the pod), and the operator's and gateway's flags. The real server's refusals are
``tests/cluster/test_zk_acl.py``."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions, make_digest_acl
from kubernetes import client
from prometheus_client import CollectorRegistry

from enginestub.engine import config as engine_config
from fakes import FakeCore, FakeCustom, FakeKazoo
from matrixserve import __main__ as operator_main
from matrixserve.adapters.kube import SECRET_RECHECK_SECONDS, KubeAdapter, SecretTaken
from matrixserve.adapters.metrics import OperatorMetrics
from matrixserve.adapters.pdgroup_metrics import PDGroupMetrics
from matrixserve.adapters.zk_groups import GroupStore
from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.coordination import Session, SessionState, access
from matrixserve.domain.effects import Event
from matrixserve.domain.enginepod import SECRET_LABELS, EngineSettings, platform_env
from matrixserve.domain.leadership import Timing
from matrixserve.domain.pdgroup.pods import pod_manifest
from matrixserve.gateway import __main__ as gateway_main
from matrixserve.handlers import runtime
from matrixserve.handlers.leadership import Leadership
from matrixserve.handlers.pdgroup import PDGroups
from matrixserve.handlers.reconciler import Reconciler
from matrixserve.handlers.runtime import OperatorConfig, Runtime

LOG = logging.getLogger("test")
AUTH = zl.Credentials("matrixserve", "s3cret:with-colon")
OURS = make_digest_acl("matrixserve", "s3cret:with-colon", all=True)
FOREIGN = ACL(Permissions.ALL, Id("digest", "someone:else"))


# --------------------------------------------------------------------------- the credential
@pytest.mark.parametrize(
    ("text", "user", "password"),
    [("matrixserve:pw", "matrixserve", "pw"), ("u:a:b", "u", "a:b")],
)
def test_credentials_parse_user_and_password(text: str, user: str, password: str) -> None:
    parsed = zl.Credentials.parse(text)
    assert (parsed.user, parsed.password, parsed.text()) == (user, password, text)
    assert password not in repr(parsed), "configurations get logged: the password stays out"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("matrixserve", "user:password"),
        (":pw", "user:password"),
        ("matrixserve:", "user:password"),
        ("matrixserve:pw\n", "whitespace"),  # a Secret written with `echo`
        ("matrix serve:pw", "whitespace"),
    ],
)
def test_bad_credentials_are_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        zl.Credentials.parse(text)


# --------------------------------------------------------------------------- the session
def _identity(kazoo: Any) -> tuple[Any, Any]:
    return kazoo.auth_data, kazoo.default_acl


def test_every_client_of_a_session_carries_the_identity_and_creates_znodes_closed() -> None:
    session = Session("127.0.0.1:1", auth=AUTH)
    assert isinstance(session.client, KazooClient)
    assert _identity(session.client) == ({("digest", AUTH.text())}, [OURS])
    assert OURS.perms == Permissions.ALL
    # Renewed after a server lost its data (SUSPENDED past the timeout): the fresh client is
    # the same identity, or every znode it writes would be open and every read refused.
    first = session.client
    session._on_kazoo_state(first, KazooState.SUSPENDED)
    session._renew(first)
    try:
        assert session.client is not first
        assert session.renewals == 1
        assert _identity(session.client) == ({("digest", AUTH.text())}, [OURS])
    finally:
        session._stopped = True
        session.client.stop()
        session.client.close()
        first.close()


def test_without_credentials_znodes_are_open_as_before() -> None:
    session = Session("127.0.0.1:1")
    assert access(None) == {}
    assert session.client.default_acl is None
    assert not session.client.auth_data


def _tree(fake: FakeKazoo) -> None:
    for path in (
        "/matrixserve/v1/groups/ns/g/reports/g-p-0",
        "/matrixserve/v1/groups/ns/g/roce-map",
        "/matrixserve/v1/groups/ns/h/reports",
        "/matrixserve/v1/expertpools/ns/pool/map",
        "/elsewhere/not-ours",
    ):
        fake.ensure_path(path)


def test_restrict_gives_our_acl_to_every_znode_under_the_top_in_batches() -> None:
    fake = FakeKazoo()
    _tree(fake)
    fake.acls["/matrixserve/v1/groups/ns/g/roce-map"] = [OURS]  # ours already: left alone
    session = Session("zk", client=fake, auth=AUTH)
    done = session.restrict(batch=2)
    under = [p for p in fake.nodes if p == zl.TOP or p.startswith(zl.TOP + "/")]
    assert all(fake.acls.get(p) == [OURS] for p in under), "an open znode is left under the top"
    assert fake.acls.get("/elsewhere/not-ours") is None
    assert "/" not in fake.acls
    assert (done.seen, done.changed, done.refused) == (len(under), len(under) - 1, 0)
    assert ("set_acls", "/matrixserve/v1/groups/ns/g/roce-map") not in fake.calls
    # Run again (the operator's next start): nothing left to change.
    again = session.restrict(batch=2)
    assert (again.seen, again.changed) == (len(under), 0)


def test_restrict_leaves_and_names_what_another_identity_owns() -> None:
    fake = FakeKazoo()
    _tree(fake)
    squatted = "/matrixserve/v1/groups/ns/h"
    fake.foreign.add(squatted)
    fake.acls[squatted] = [FOREIGN]
    done = Session("zk", client=fake, auth=AUTH).restrict()
    assert fake.acls[squatted] == [FOREIGN]
    assert (done.refused, done.examples) == (1, (squatted,))
    assert fake.acls["/matrixserve/v1/groups/ns/g/reports/g-p-0"] == [OURS]


def test_restrict_without_a_tree_or_without_credentials() -> None:
    assert Session("zk", client=FakeKazoo(), auth=AUTH).restrict().seen == 0
    with pytest.raises(ValueError, match="no credentials"):
        Session("zk", client=FakeKazoo()).restrict()


async def test_the_operator_restricts_again_after_a_connection_loss() -> None:
    from kazoo.exceptions import ConnectionLoss

    fake = FakeKazoo()
    _tree(fake)
    fake.fail["get_acls"] = [ConnectionLoss()]
    session = Session("zk", client=fake, auth=AUTH)
    fake.transition(KazooState.CONNECTED)
    assert session.state is SessionState.CONNECTED
    done = await session.restrict_existing(pause=0)
    assert done.refused == 0
    assert fake.acls["/matrixserve/v1/expertpools/ns/pool/map"] == [OURS]


# --------------------------------------------------------------------------- an upgrade
GROUP = zl.GroupPaths("ns", "g")


def _open_group(fake: FakeKazoo) -> None:
    """A group's subtree as a version without ACLs left it: open, its engines writing there."""
    for path in (*GROUP.all_folders(), GROUP.roce_map, GROUP.report("g-p-0")):
        fake.ensure_path(path)
    fake.default_acl = [OURS]  # what a client with the identity makes (kazoo's default_acl)


async def test_at_start_the_operator_closes_everything_but_the_groups_subtrees() -> None:
    """Finding 2: the engines of a group started before the identity have none; closing their
    subtree at the operator's start would refuse their next health write, re-registration or
    link (NoAuth) and the group would never recover from its next fault."""
    fake = FakeKazoo()
    _tree(fake)
    _open_group(fake)
    session = Session("zk", client=fake, auth=AUTH)
    alone = Leadership("", None, Timing(), CollectorRegistry())  # no election: it leads
    await runtime._connect(session, alone, LOG)  # the operator's start, once connected
    for closed in (
        zl.TOP,
        zl.ROOT,
        zl.groups_root("ns"),
        "/matrixserve/v1/expertpools/ns/pool/map",
    ):
        assert fake.acls.get(closed) == [OURS], closed
    group = zl.group_path("ns", "g")
    inside = [p for p in fake.nodes if p == group or p.startswith(group + "/")]
    assert inside
    assert all(fake.acls.get(p) is None for p in inside), "a group's subtree closed"


def test_what_is_made_in_an_open_group_is_open_and_closed_once_the_group_is() -> None:
    """The operator's entrances and removals and a recreated engine's report, link and health
    are read by engines without the identity while their group is open: made open there."""
    fake = FakeKazoo()
    _open_group(fake)
    session = Session("zk", client=fake, auth=AUTH)
    session.put(GROUP.entrance("g-p-0"), b"{}", makepath=True)
    session.own(GROUP.health_of("g-p-1"), b"{}")
    session.put(GROUP.link("g-p-1", "g-d-0"), b"{}")
    made = (GROUP.entrance("g-p-0"), GROUP.entrances, GROUP.health_of("g-p-1"))
    for path in (*made, GROUP.link("g-p-1", "g-d-0")):
        assert fake.acls[path] == OPEN_ACL_UNSAFE, path
    # Outside every group, and in a group made with the identity, znodes are ours at once.
    session.put(zl.expert_pool_path("ns", "pool") + "/map", b"{}", makepath=True)
    assert fake.acls[zl.expert_pool_path("ns", "pool") + "/map"] == [OURS]
    other = zl.GroupPaths("ns", "h")
    session.ensure(*other.all_folders())
    session.put(other.report("h-p-0"), b"{}")
    assert all(fake.acls[p] == [OURS] for p in (other.root, other.reports, other.report("h-p-0")))
    # Closed: everything there is ours, and what is made later too, without asking again.
    done = session.close(GROUP.root)
    group = [p for p in fake.nodes if p.startswith(GROUP.root)]
    assert all(fake.acls[p] == [OURS] for p in group)
    assert done.changed == len(group)
    fake.calls.clear()
    session.put(GROUP.entrance("g-p-1"), b"{}")
    assert fake.acls[GROUP.entrance("g-p-1")] == [OURS]
    assert ("get_acls", GROUP.root) not in fake.calls


class Upgraded:
    """PDGroup ``g``'s controller with the identity, over a subtree and pods made before it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.core, self.custom, self.zk = FakeCore(), FakeCustom(), FakeKazoo()
        _open_group(self.zk)
        kube = KubeAdapter(client.ApiClient(), pod_secrets=SETTINGS.secrets())
        kube.core, kube.custom = self.core, self.custom
        metrics = OperatorMetrics()
        session = Session("zk", client=self.zk, auth=AUTH)
        self.zk.transition(KazooState.CONNECTED)
        config = OperatorConfig(
            kubeconfig=None, zookeeper="zk", engine=SETTINGS, zookeeper_auth=AUTH
        )
        rt = Runtime(config, kube, session, metrics, loop)
        self.events: list[Event] = []
        reconciler = Reconciler(kinds.PDGROUP, kube, metrics, loop, poster=self.record)
        self.groups = PDGroups(
            rt, reconciler, GroupStore(session), PDGroupMetrics(metrics.registry)
        )
        spec = {
            "service": "chat",
            "scenario": "general",
            "model": {"name": "llama3-8b"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
        }
        self.key = (kinds.GROUP, kinds.VERSION, "ns", kinds.PDGROUP.plural, "g")
        self.custom.objects[self.key] = {
            "apiVersion": kinds.API_VERSION,
            "kind": kinds.PDGROUP.kind,
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 1},
            "spec": spec,
        }
        parsed = PDGroupSpec.model_validate(spec)
        old = EngineSettings("zk:2181")  # the operator before: no identity, no volume
        for name, role in (("g-p-0", zl.Role.PREFILL), ("g-d-0", zl.Role.DECODE)):
            pod = pod_manifest("ns", "g", "uid-g", name, role, parsed, old)
            self.core.create_namespaced_pod("ns", pod)

    def record(self, body: Any, event: Event | None) -> None:
        if event is not None:
            self.events.append(event)

    async def reconcile(self) -> None:
        await self.groups.loop.reconcile(self.groups, "ns", "g", LOG)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    def group_acls(self) -> set[tuple[str, ...]]:
        return {
            tuple(f"{a.id.scheme}:{a.id.id}" for a in self.zk.acls.get(p, OPEN_ACL_UNSAFE))
            for p in self.zk.nodes
            if p.startswith(GROUP.root)
        }


async def test_a_group_stays_open_until_every_pod_carries_the_credential() -> None:
    world = Upgraded(asyncio.get_running_loop())
    for _ in range(3):
        await world.reconcile()
    assert world.reasons().count("ZooKeeperAccessOpen") == 1, "one Warning Event, not one a pass"
    (notice,) = [e for e in world.events if e.reason == "ZooKeeperAccessOpen"]
    assert notice.warning
    assert "Delete them one at a time" in notice.message
    assert not any(op == "set_acls" for op, _ in world.zk.calls), "closed under its engines"
    assert world.group_acls() == {("world:anyone",)}
    # One old pod replaced (deleted; the operator recreates it with the credential): still open.
    world.core.pods.pop(("ns", "g-p-0"))
    await world.reconcile()
    new = world.core.pods[("ns", "g-p-0")]
    assert any(v.get("secret", {}).get("secretName") == "zk-auth" for v in new["spec"]["volumes"])
    assert world.group_acls() == {("world:anyone",)}
    # The last one replaced: the whole subtree is MatrixServe's, once, with a Normal Event.
    world.core.pods.pop(("ns", "g-d-0"))
    await world.reconcile()
    await world.reconcile()
    assert world.group_acls() == {(f"digest:{OURS.id.id}",)}
    (closed,) = [e for e in world.events if e.reason == "ZooKeeperAccessClosed"]
    assert not closed.warning
    world.zk.calls.clear()
    await world.reconcile()
    assert not any(op in ("get_acls", "set_acls") for op, _ in world.zk.calls), "walked again"


async def test_an_open_group_made_again_after_data_loss_stays_open_to_its_old_engines() -> None:
    """The server lost its data while the group was still open (an upgrade under way): the
    operator makes the group's folders again open, or the engines without the credential
    could no longer report there and the map would never be rebuilt; the namespace folder
    above them is ours."""
    world = Upgraded(asyncio.get_running_loop())
    await world.reconcile()
    assert world.group_acls() == {("world:anyone",)}
    world.zk.nodes = {"/": (b"", 0, 0)}  # the server came back empty
    world.zk.acls.clear()
    await world.reconcile()
    assert GROUP.reports in world.zk.nodes
    assert world.group_acls() == {("world:anyone",)}
    namespace = zl.groups_root("ns")
    assert [a.id.scheme for a in world.zk.acls[namespace]] == ["digest"]


async def test_no_engine_pod_where_a_tenants_secret_holds_the_name() -> None:
    world = Upgraded(asyncio.get_running_loop())
    world.core.pods.clear()
    theirs = {"metadata": {"name": "zk-auth", "labels": {}}, "data": {"auth": "eA=="}}
    world.core.secrets[("ns", "zk-auth")] = theirs
    for _ in range(2):
        await world.reconcile()
    assert world.core.pods == {}
    (taken,) = [e for e in world.events if e.reason == "EngineSecretTaken"]
    assert taken.warning
    assert "ns/zk-auth is not MatrixServe's" in taken.message
    assert world.core.secrets[("ns", "zk-auth")] == theirs
    del world.core.secrets[("ns", "zk-auth")]  # the tenant removed it: engines come
    await world.reconcile()
    assert sorted(name for _, name in world.core.pods) == ["g-d-0", "g-p-0"]


# --------------------------------------------------------------------------- engines
SPEC = PDGroupSpec.model_validate(
    {
        "service": "chat",
        "scenario": "general",
        "model": {"name": "llama3-8b"},
        "prefill": {"replicas": 1, "image": "engine:1"},
        "decode": {"replicas": 1, "image": "engine:1"},
    }
)
SETTINGS = EngineSettings("zk:2181", zookeeper_auth=AUTH, zookeeper_auth_secret="zk-auth")


def test_engines_read_the_credential_from_a_mounted_secret_never_from_the_pod() -> None:
    pod = pod_manifest("ns", "g", "uid", "g-p-0", zl.Role.PREFILL, SPEC, SETTINGS)
    spec = pod["spec"]
    (container,) = spec["containers"]
    (volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "zk-auth"
    assert volume["secret"]["defaultMode"] == 0o440  # the group's, by the pod's fsGroup
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert (mount["name"], mount["readOnly"]) == (volume["name"], True)
    env = {e["name"]: e for e in container["env"]}
    assert env["MATRIXSERVE_ZK_AUTH_FILE"]["value"] == f"{mount['mountPath']}/auth"
    assert "MATRIXSERVE_ZK_AUTH" not in env, "Secrets as files, not in the environment"
    assert "secretKeyRef" not in json.dumps(pod)
    assert AUTH.password not in json.dumps(pod), "anyone who reads pods would see it"
    (secret,) = SETTINGS.secrets()
    assert secret["metadata"]["name"] == "zk-auth"
    assert base64.b64decode(secret["data"][zl.CREDENTIALS_KEY]).decode() == AUTH.text()
    open_settings = EngineSettings("zk:2181")
    assert open_settings.secrets() == []
    open_pod = pod_manifest("ns", "g", "uid", "g-p-0", zl.Role.PREFILL, SPEC, open_settings)
    assert all("secret" not in v for v in open_pod["spec"]["volumes"])
    assert "MATRIXSERVE_ZK_AUTH_FILE" not in {e["name"] for e in platform_env(open_settings)}


def adapter(clock: list[float] | None = None) -> tuple[KubeAdapter, FakeCore]:
    now = clock if clock is not None else [0.0]
    kube = KubeAdapter(client.ApiClient(), pod_secrets=SETTINGS.secrets(), clock=lambda: now[0])
    core = FakeCore()
    kube.core = core
    return kube, core


def engine_pod(name: str) -> dict[str, Any]:
    return pod_manifest("ns", "g", "uid", name, zl.Role.PREFILL, SPEC, SETTINGS)


async def test_the_secret_is_in_the_namespace_before_the_engine_pod() -> None:
    """Finding 4/5: one ordered record of Secret calls and pod creations. The Secret is written
    before the first pod of a namespace; the next pods cost no Secret call."""
    kube, core = adapter()
    for name in ("g-p-0", "g-d-0"):
        assert await kube.create_pod("ns", engine_pod(name))
    assert await kube.create_pod("other", engine_pod("g-p-0"))
    assert core.calls == [
        ("read_secret", "ns", "zk-auth"),
        ("create_secret", "ns", "zk-auth"),
        ("create_pod", "ns", "g-p-0"),
        ("create_pod", "ns", "g-d-0"),
        ("read_secret", "other", "zk-auth"),
        ("create_secret", "other", "zk-auth"),
        ("create_pod", "other", "g-p-0"),
    ]
    assert core.secrets[("ns", "zk-auth")]["metadata"]["labels"] == SECRET_LABELS


async def test_a_deleted_or_changed_secret_is_put_back_within_the_recheck_period() -> None:
    clock = [0.0]
    kube, core = adapter(clock)
    assert await kube.pod_secrets_taken("ns") == []
    ours = copy.deepcopy(core.secrets[("ns", "zk-auth")])
    core.calls.clear()
    del core.secrets[("ns", "zk-auth")]
    clock[0] = SECRET_RECHECK_SECONDS - 1  # within the period: a pass costs no call
    assert await kube.pod_secrets_taken("ns") == []
    assert core.calls == []
    clock[0] = SECRET_RECHECK_SECONDS  # then one read finds it gone: made again
    assert await kube.pod_secrets_taken("ns") == []
    assert core.calls == [("read_secret", "ns", "zk-auth"), ("create_secret", "ns", "zk-auth")]
    assert core.secrets[("ns", "zk-auth")] == ours
    core.calls.clear()
    core.secrets[("ns", "zk-auth")]["data"] = {"auth": "c3RhbGU="}  # changed by someone
    clock[0] = 2 * SECRET_RECHECK_SECONDS
    assert await kube.pod_secrets_taken("ns") == []
    assert core.calls == [("read_secret", "ns", "zk-auth"), ("patch_secret", "ns", "zk-auth")]
    assert core.secrets[("ns", "zk-auth")]["data"] == ours["data"]
    core.calls.clear()
    clock[0] = 3 * SECRET_RECHECK_SECONDS  # in place: one read, nothing written
    assert await kube.pod_secrets_taken("ns") == []
    assert core.calls == [("read_secret", "ns", "zk-auth")]


async def test_a_tenants_secret_of_that_name_is_never_touched() -> None:
    """Finding 6: a Secret of the engines' Secret's name without our labels is someone else's:
    left as it is, no engine pod created in that namespace (a pod there would mount it)."""
    kube, core = adapter()
    theirs = {"metadata": {"name": "zk-auth", "labels": {"app": "theirs"}}, "data": {"x": "eA=="}}
    core.secrets[("ns", "zk-auth")] = copy.deepcopy(theirs)
    assert await kube.pod_secrets_taken("ns") == ["zk-auth"]
    with pytest.raises(SecretTaken):
        await kube.create_pod("ns", engine_pod("g-p-0"))
    assert core.secrets[("ns", "zk-auth")] == theirs
    assert [c[0] for c in core.calls] == ["read_secret", "read_secret"]  # asked, never written
    assert ("ns", "g-p-0") not in core.pods


# --------------------------------------------------------------------------- flags
@pytest.fixture
def no_auth_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither variable from the shell (a test sets what it needs)."""
    monkeypatch.delenv("MATRIXSERVE_ZK_AUTH", raising=False)
    monkeypatch.delenv("MATRIXSERVE_ZK_AUTH_FILE", raising=False)
    return monkeypatch


def test_the_operator_takes_the_credential_from_a_file_or_its_environment(
    no_auth_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "auth").write_text(AUTH.text())  # as the kubelet writes a Secret's key
    no_auth_env.setenv("MATRIXSERVE_ZK_AUTH_FILE", str(tmp_path / "auth"))
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook"])
    assert config.zookeeper_auth == AUTH == config.engine.zookeeper_auth
    assert config.engine.zookeeper_auth_secret == "matrixserve-engine-zookeeper-auth"
    no_auth_env.delenv("MATRIXSERVE_ZK_AUTH_FILE")
    no_auth_env.setenv("MATRIXSERVE_ZK_AUTH", AUTH.text())  # the dev cluster's and the tests'
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook"])
    assert config.zookeeper_auth == AUTH
    no_auth_env.delenv("MATRIXSERVE_ZK_AUTH")
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook"])
    assert config.zookeeper_auth is None
    assert config.engine.secrets() == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--zookeeper-auth", "no-colon"], "user:password"),
        (["--zookeeper-auth", "u:p", "--engine-zookeeper-auth-secret", "Not_A_Name"], "Not_A"),
        (["--zookeeper-auth-file", "/nonexistent/auth"], "No such file"),
        (["--zookeeper-auth-file", "FILE:newline"], "whitespace"),  # `echo` adds a newline
        (["--zookeeper-auth-file", "FILE:empty"], "user:password"),  # a Secret without it
        (["--zookeeper-auth-file", "FILE", "--zookeeper-auth", "u:p"], "give the ZooKeeper"),
    ],
)
def test_bad_credential_flags_exit_2_with_the_reason(
    no_auth_env: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "auth").write_text(AUTH.text())
    (tmp_path / "newline").write_text(AUTH.text() + "\n")
    (tmp_path / "empty").write_text("")
    argv = [str(tmp_path / a.split(":")[1]) if a.startswith("FILE:") else a for a in argv]
    argv = [str(tmp_path / "auth") if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "zookeeper-auth" in err
    assert says in err


def test_the_gateway_and_the_engine_take_the_credential_the_same_way(
    no_auth_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = gateway_main.parse(["--zookeeper", "zk:2181", "--zookeeper-auth", AUTH.text()])
    assert args.zookeeper_auth == AUTH
    assert (
        gateway_main.parse(["--zookeeper", "zk:2181", "--zookeeper-auth", ""]).zookeeper_auth
        is None
    )
    with pytest.raises(SystemExit):
        gateway_main.parse(["--zookeeper", "zk:2181", "--zookeeper-auth", "x"])
    assert "user:password" in capsys.readouterr().err
    (tmp_path / "auth").write_text(AUTH.text())
    no_auth_env.setenv("MATRIXSERVE_ZK_AUTH_FILE", str(tmp_path / "auth"))
    assert gateway_main.parse(["--zookeeper", "zk:2181"]).zookeeper_auth == AUTH
    # The engine as its pod starts it: the operator's env names the mounted file.
    assert engine_config.parse(["--model", "llama3-8b"]).zookeeper_auth == AUTH
