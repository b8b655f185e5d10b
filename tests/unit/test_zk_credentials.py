"""Issue 16 finding 7: ZooKeeper digest ACLs on MatrixServe's subtrees. The credential's format,
the session's clients (renewed ones too) carrying the identity and the ACL, the walk that gives
our ACL to znodes made before, how engines get the credential (a Secret by reference, never the
value in the pod), and the operator's and gateway's flags. The real server's refusals are
``tests/cluster/test_zk_acl.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.security import ACL, Id, Permissions, make_digest_acl
from kubernetes import client

from fakes import FakeCore, FakeKazoo
from matrixserve import __main__ as operator_main
from matrixserve.adapters.kube import KubeAdapter
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.coordination import Session, SessionState, access
from matrixserve.domain.enginepod import EngineSettings, platform_env
from matrixserve.domain.pdgroup.pods import pod_manifest
from matrixserve.gateway import __main__ as gateway_main

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


def test_engines_read_the_credential_from_a_secret_never_from_the_pod() -> None:
    settings = EngineSettings("zk:2181", zookeeper_auth=AUTH, zookeeper_auth_secret="zk-auth")
    pod = pod_manifest("ns", "g", "uid", "g-p-0", zl.Role.PREFILL, SPEC, settings)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["MATRIXSERVE_ZK_AUTH"] == {
        "name": "MATRIXSERVE_ZK_AUTH",
        "valueFrom": {"secretKeyRef": {"name": "zk-auth", "key": zl.CREDENTIALS_KEY}},
    }
    assert AUTH.password not in json.dumps(pod), "anyone who reads pods would see it"
    (secret,) = settings.secrets()
    assert secret["metadata"]["name"] == "zk-auth"
    assert secret["stringData"] == {zl.CREDENTIALS_KEY: AUTH.text()}
    open_settings = EngineSettings("zk:2181")
    assert open_settings.secrets() == []
    assert "MATRIXSERVE_ZK_AUTH" not in {e["name"] for e in platform_env(open_settings)}


async def test_the_secret_is_in_the_namespace_before_the_engine_pod() -> None:
    settings = EngineSettings("zk:2181", zookeeper_auth=AUTH, zookeeper_auth_secret="zk-auth")
    adapter = KubeAdapter(client.ApiClient(), pod_secrets=settings.secrets())
    core = FakeCore()
    adapter.core = core
    core.secrets[("ns", "zk-auth")] = {"metadata": {"name": "zk-auth"}, "data": {"auth": "b2xk"}}
    for name in ("g-p-0", "g-d-0"):
        pod = pod_manifest("ns", "g", "uid", name, zl.Role.PREFILL, SPEC, settings)
        assert await adapter.create_pod("ns", pod)
    # There already (a stale copy): given our data once; the second pod only finds it.
    assert core.secret_calls == [
        ("create", "ns", "zk-auth"),
        ("patch", "ns", "zk-auth"),
        ("create", "ns", "zk-auth"),
    ]
    assert core.secrets[("ns", "zk-auth")]["stringData"] == {"auth": AUTH.text()}
    assert await adapter.create_pod("other", pod)
    assert core.secrets[("other", "zk-auth")]["metadata"]["labels"]
    assert list(core.pods) == [("ns", "g-p-0"), ("ns", "g-d-0"), ("other", "g-d-0")]


# --------------------------------------------------------------------------- flags
def test_the_operator_takes_the_credential_from_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MATRIXSERVE_ZK_AUTH", AUTH.text())
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook"])
    assert config.zookeeper_auth == AUTH == config.engine.zookeeper_auth
    assert config.engine.zookeeper_auth_secret == "matrixserve-zookeeper-auth"
    monkeypatch.delenv("MATRIXSERVE_ZK_AUTH")
    config, _ = operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook"])
    assert config.zookeeper_auth is None
    assert config.engine.secrets() == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--zookeeper-auth", "no-colon"],
        ["--zookeeper-auth", "u:p", "--engine-zookeeper-auth-secret", "Not_A_Name"],
    ],
)
def test_bad_credential_flags_exit_2_with_the_reason(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        operator_main.parse(["--zookeeper", "zk:2181", "--no-webhook", *argv])
    assert exit_.value.code == 2
    assert "zookeeper-auth" in capsys.readouterr().err


def test_the_gateway_takes_the_credential_and_refuses_a_bad_one(
    capsys: pytest.CaptureFixture[str],
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
