"""Issue 18's engine side without processes: what a warm engine accepts as an assignment, what a
fork source accepts as a request and how it counts its targets, the session bridge's
re-registration, the DRAM pre-load timing, the fork's own TE-Load, and the parsing of a peer's
flow counts."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from enginestub import calibration as cal
from enginestub import timing
from enginestub.engine import fork, kvpull, warm, zkbridge
from enginestub.engine.clock import Clock
from enginestub.engine.config import ConfigError, EngineConfig, WarmConfig, parse, parse_warm
from enginestub.engine.core import Engine
from enginestub.engine.metrics import EngineMetrics
from enginestub.fabric import Plane, link_latency
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import DEEPSEEK_V3, LLAMA3_8B
from matrixserve.api.engine_protocol import EngineError
from matrixserve.coordination import SessionState

POD_ENV = {
    "POD_NAME": "w-0",
    "POD_UID": "uid-0",
    "POD_NAMESPACE": "t",
    "MATRIXSERVE_ZK": "127.0.0.1:1",
    "MATRIXSERVE_ZK_AUTH": "matrixserve:pod-secret",  # the pod's own identity
    "MATRIXSERVE_POD_IP": "127.0.0.9",
    "ENGINE_PORT": "8000",
    "MATRIXSERVE_DIES": "0,1",
    "MATRIXSERVE_NPUS": "0",
    "MATRIXSERVE_ROCE_IPS": "198.19.9.1,198.19.9.2",
    "MATRIXSERVE_NODE_NAME": "sp0-server-00",
    "MATRIXSERVE_SUPERPOD": "sp0",
    "ENGINE_WARM": "1",
}


@pytest.fixture
def pod_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The process environment of a warm pod (only this: nothing of the test's own), restored
    after (``assigned`` updates the environment)."""
    env = dict(POD_ENV)
    monkeypatch.setattr(os, "environ", env)
    return env


def _warm_config() -> WarmConfig:
    cfg = parse_warm([])
    assert cfg is not None
    return cfg


def _fixed_config(**over: Any) -> WarmConfig:
    """A warm engine's configuration, whatever the environment says."""
    fields: dict[str, Any] = {
        "host": "127.0.0.9",
        "port": 8000,
        "pod": "w-0",
        "pod_uid": "uid-0",
        "namespace": "t",
        "node": "n",
        "superpod": "sp0",
        "npus": [0],
        "dies": [0],
        "roce_ips": ["198.19.9.1"],
        "zookeeper": "127.0.0.1:1",
        "time_scale": 1,
        "pre_load_seconds": 0,
    }
    return WarmConfig(**(fields | over))


def _ref(**over: Any) -> zl.ForkRef:
    fields: dict[str, Any] = {
        "group": "t/src",
        "instance": "src-p-0",
        "podIP": "127.0.0.20",
        "port": 8000,
        "plane": "UB",
        "key": "llama3-8b.000000000000",
    }
    return zl.ForkRef.model_validate(fields | over)


def _assignment(**over: Any) -> zl.Assignment:
    fields: dict[str, Any] = {
        "podUid": "uid-0",
        "group": "t/g",
        "instance": "g-p-0",
        "env": {"ENGINE_MODEL": "llama3-8b", "ENGINE_ROLE": "prefill", "ENGINE_MAX_BATCH": "4"},
        "loadSource": "HostDRAM",
    }
    return zl.Assignment.model_validate(fields | over)


def _claim(assignment: zl.Assignment) -> warm.Claim:
    return warm.Claim(assignment, time.time())


# ----------------------------------------------------------------------------- the assignment


def test_a_claimed_engine_keeps_its_pods_environment_and_takes_only_the_instances_settings(
    pod_env: dict[str, str],
) -> None:
    cfg = _warm_config()
    config, plan = warm.assigned(cfg, _claim(_assignment()), [])
    assert (config.instance, config.group, config.role) == ("g-p-0", "t/g", "prefill")
    assert (config.model.name, config.max_batch, config.pod) == ("llama3-8b", 4, "w-0")
    assert plan == fork.LoadPlan(timing.LoadSource.HOST_DRAM)
    # what the pod has is the pod's: its ZooKeeper, its identity, its devices and address
    assert config.zookeeper == "127.0.0.1:1"
    assert config.zookeeper_auth == zl.Credentials("matrixserve", "pod-secret")
    assert (config.host, config.port, config.dies, config.node) == (
        "127.0.0.9",
        8000,
        [0, 1],
        "sp0-server-00",
    )
    assert pod_env["MATRIXSERVE_ZK_AUTH"] == "matrixserve:pod-secret"
    assert pod_env["ENGINE_LOAD_SOURCE"] == "HostDRAM"


@pytest.mark.parametrize(
    "key", ["MATRIXSERVE_ZK_AUTH_FILE", "MATRIXSERVE_ZK", "PATH", "MATRIXSERVE_GROUP", "POD_UID"]
)
def test_an_assignment_env_key_that_is_not_an_instance_setting_is_refused_by_name(
    pod_env: dict[str, str], key: str
) -> None:
    """The operator once sent its whole environment, MATRIXSERVE_ZK_AUTH_FILE pointing at a
    path only the operator has: the claimed engine could not start. Only ASSIGNMENT_ENV keys."""
    cfg = _warm_config()
    env = {"ENGINE_MODEL": "llama3-8b", key: "/var/run/secrets/matrixserve/zk-auth"}
    with pytest.raises(ConfigError, match=f"env {key}: not an instance setting"):
        warm.assigned(cfg, _claim(_assignment(env=env)), [])
    assert pod_env.get(key) == POD_ENV.get(key), "nothing of it reached the environment"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dies", [0]),
        ("roce_ips", ["198.19.1.1", "198.19.1.2"]),
        ("node", "sp0-server-01"),
        ("superpod", "sp1"),
        ("npus", [1]),
        ("pod_uid", "uid-9"),
        ("host", "127.0.0.10"),
        ("port", 8001),
    ],
)
def test_an_engine_that_is_not_of_this_pod_is_an_invalid_assignment(
    pod_env: dict[str, str], field: str, value: Any
) -> None:
    cfg = _warm_config().model_copy(update={field: value})
    with pytest.raises(ConfigError, match=f"it makes an engine with {field} "):
        warm.assigned(cfg, _claim(_assignment()), [])


@pytest.mark.parametrize(
    ("pod_ip", "port"),
    [
        ("10.0.0.1", 8000),  # not loopback
        ("::1", 8000),  # not IPv4
        ("localhost", 8000),  # a name, not an address
        ("127.0.0.1:9", 8000),
        ("127.0.0.1/8", 8000),
        ("127.0.0.1\n", 8000),
        ("", 8000),
        ("127.0.0.1", 0),
        ("127.0.0.1", 65536),
        ("127.0.0.1", -1),
    ],
)
def test_a_fork_ref_not_at_a_loopback_ipv4_address_and_port_is_an_invalid_assignment(
    pod_env: dict[str, str], pod_ip: str, port: int
) -> None:
    a = _assignment(loadSource="NPUForkUB", fork=_ref(podIP=pod_ip, port=port))
    with pytest.raises(ConfigError, match=r"fork (podIP|port)"):
        warm.assigned(_warm_config(), _claim(a), [])


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"fallback": "NPUForkUB"}, "fallback NPUForkUB is an NPU-fork"),
        ({"fallback": "NPUForkRoCE", "loadSource": "NPUForkRoCE", "fork": _ref(plane="RoCE")}, ""),
        ({"loadSource": "NPUForkUB"}, "loadSource NPUForkUB names no fork"),
        ({"loadSource": "NPUForkRoCE"}, "loadSource NPUForkRoCE names no fork"),
        ({"loadSource": "HostDRAM", "fork": _ref()}, "a fork with loadSource HostDRAM"),
        ({"loadSource": "NPUForkUB", "fork": _ref(plane="RoCE")}, "with a fork over RoCE"),
        ({"loadSource": "NPUForkUB", "fork": _ref(plane="VPC")}, "fork plane 'VPC'"),
        ({"group": "other/g"}, "not in the pod's namespace t"),
        ({"group": "t/G"}, "invalid group"),
        ({"loadSource": "Floppy"}, "Floppy"),
        ({"loadSource": "NPUForkUB", "fork": _ref(instance="Src")}, "invalid instance"),
    ],
)
def test_a_nonsense_load_plan_is_an_invalid_assignment(
    pod_env: dict[str, str], over: dict[str, Any], why: str
) -> None:
    with pytest.raises(ConfigError, match=why or "NPU-fork"):
        warm.assigned(_warm_config(), _claim(_assignment(**over)), [])


def test_a_fork_plan_over_its_own_plane_is_taken() -> None:
    cfg = _fixed_config()
    for source, plane in (("NPUForkUB", "UB"), ("NPUForkRoCE", "RoCE")):
        a = _assignment(loadSource=source, fork=_ref(plane=plane), fallback="SSD")
        assert warm.load_plan(cfg, a) == fork.LoadPlan(
            timing.LoadSource(source), a.fork, timing.LoadSource.SSD
        )


def test_a_claim_counts_readiness_from_itself_unless_the_process_never_was_warm() -> None:
    a = _assignment()
    claimed = warm.Claim(a, at=1000.0, restarted=False, pre_load_seconds=20.0, process_start=900.0)
    assert (claimed.started, claimed.pre_loaded) == (1000.0, 0.0)
    restarted = warm.Claim(a, at=1000.0, restarted=True, pre_load_seconds=20.0, process_start=900.0)
    assert (restarted.started, restarted.pre_loaded) == (900.0, 20.0)


async def test_a_claimed_engine_says_the_pre_load_it_paid_and_counts_from_its_claim() -> None:
    config = parse(["--model", "llama3-8b", "--dies", "0", "--time-scale", "1000"])
    claimed_at = time.time() - 100.0  # a claim that came long before the engine was built
    engine = Engine(config, warm=True, started_wall=claimed_at)
    await engine.pre_load()
    assert engine.started_wall == claimed_at
    assert engine.phases["TEPreLoad"] == 0.0
    restarted = Engine(config, warm=True, pre_loaded=20.0)
    await restarted.pre_load()
    assert restarted.phases["TEPreLoad"] == 20.0
    await engine.close()
    await restarted.close()


# ----------------------------------------------------------------------------- the fork's key


def test_the_fork_key_says_mtp_and_the_die_count() -> None:
    base = ["--model", "llama3-8b", "--dies", "0", "--host", "127.0.0.1"]
    plain, mtp = parse(base), parse([*base, "--mtp"])
    assert fork.artifacts(mtp) == zl.artifact_id(
        "llama3-8b+mtp", 1, 1, 1, __import__("enginestub").__version__
    )
    assert fork.fork_key(plain) != fork.fork_key(mtp)
    assert fork.fork_key(mtp).startswith("llama3-8b.")  # the model part is the model's name
    assert fork.fork_key(plain) != fork.fork_key(parse([*base[:3], "0,1", *base[4:]]))


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1", True),
        ("127.255.255.254", True),
        ("127.0.0.1.nip.io", False),  # starts with "127." and is a name
        ("127.example", False),
        ("1270.0.0.1", False),
        ("::1", False),
        ("10.0.0.1", False),
    ],
)
def test_engines_bind_loopback_ipv4_addresses_only(host: str, ok: bool) -> None:
    args = ["--model", "llama3-8b", "--dies", "0", "--host", host]
    if ok:
        assert parse(args).host == host
    else:
        with pytest.raises(ConfigError, match=r"loopback addresses \(127.0.0.0/8\) only"):
            parse(args)


# ----------------------------------------------------------------------------- timing


def test_a_die_sends_what_it_holds_not_the_total_over_the_dies() -> None:
    """A data-parallel die holds its replica's whole share: two dies at TP1 each hold the whole
    model, and each sends it (total / dies would send half)."""
    for shape in (
        timing.InstanceShape(dies=2, tp=1),
        timing.InstanceShape(dies=4, tp=2),
        timing.InstanceShape(dies=1, tp=1),
    ):
        held = timing._weights_per_die(LLAMA3_8B, shape)
        per_die = timing.fork_bytes_per_die(LLAMA3_8B, shape)
        assert per_die == pytest.approx(held + cal.COMPILED_ARTIFACT_BYTES_PER_DIE)
        assert timing.load_seconds(
            LLAMA3_8B, shape, timing.LoadSource.NPU_FORK_UB
        ) == timing.fork_seconds(LLAMA3_8B, shape, Plane.UB)
    two = timing.InstanceShape(dies=2, tp=1)
    assert timing.fork_bytes_per_die(LLAMA3_8B, two) > (
        LLAMA3_8B.weight_bytes_total / 2 + cal.COMPILED_ARTIFACT_BYTES_PER_DIE
    )
    ep = timing.InstanceShape(dies=32, tp=1, ep=32)  # MoE: the experts a die hosts
    assert timing.fork_bytes_per_die(DEEPSEEK_V3, ep) == pytest.approx(
        timing._weights_per_die(DEEPSEEK_V3, ep) + cal.COMPILED_ARTIFACT_BYTES_PER_DIE
    )


def test_a_dram_pre_load_takes_the_shared_file_services_effective_bandwidth() -> None:
    seconds = timing.dram_preload_seconds(LLAMA3_8B)
    assert seconds == pytest.approx(
        LLAMA3_8B.weight_bytes_total / cal.SHARED_FILE_SERVICE_EFFECTIVE_BANDWIDTH
    )
    assert seconds == timing.load_seconds(
        LLAMA3_8B, timing.InstanceShape(1), timing.LoadSource.SHARED_FILE_SERVICE
    )


async def test_a_successful_forks_te_load_is_the_sources_transfer_and_one_latency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not the target's wall time times the time scale: at time scale 1000 the 50 wall ms of the
    request would read 50 emulated s, slower than any local load."""

    async def fetch(*_args: Any) -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"seconds": 0.1, "plane": "UB", "position": 1}

    monkeypatch.setattr(fork, "fetch", fetch)
    config = parse(["--model", "llama3-8b", "--dies", "0", "--time-scale", "1000"])
    plan = fork.LoadPlan(timing.LoadSource.NPU_FORK_UB, _ref(key=fork.fork_key(config)))
    engine = Engine(config, plan=plan, warm=True)
    seconds = await engine.load_model()
    assert seconds == pytest.approx(0.1 + link_latency(Plane.UB, same_node=False))
    assert engine.load_source == "NPUForkUB"
    assert engine.phases["TELoad"] == pytest.approx(seconds)
    await engine.close()


# ----------------------------------------------------------------------------- the source's side
def _server(
    config: EngineConfig | None = None, scale: float = 10.0
) -> tuple[fork.ForkServer, list[tuple[str, str]]]:
    """A source's fork server whose gate lets every target in (and notes who asked)."""
    config = config or parse(["--model", "llama3-8b", "--dies", "0", "--time-scale", str(scale)])
    server = fork.ForkServer(
        config, Clock(scale), EngineMetrics("prefill"), lambda: 0, lambda: None, lambda: 1.0
    )
    asked: list[tuple[str, str]] = []

    async def gate(pod: str, uid: str) -> None:
        asked.append((pod, uid))

    server.gate = gate
    return server, asked


def _body(server: fork.ForkServer, **over: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "key": server.key,
        "target": "g-p-1",
        "pod": "w-1",
        "podUid": "uid-1",
        "plane": "UB",
        "dies": 1,
        "node": "n",
        "superpod": "local",
    }
    return fields | over


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"node": None}, "node"),
        ({"node": 3}, "node"),
        ({"superpod": ["local"]}, "superpod"),
        ({"key": {"k": 1}}, "key"),
        ({"key": "k" * 254}, "key"),
        ({"target": 7}, "target"),
        ({"target": "G-P-1"}, "target"),
        ({"target": "g-p-1\n"}, "target"),
        ({"target": "a" * 254}, "target"),
        ({"target": ""}, "target"),
        ({"pod": "w_1"}, "pod"),
        ({"pod": None}, "pod"),
        ({"podUid": ""}, "podUid"),
        ({"podUid": "u" * 129}, "podUid"),
        ({"podUid": "uid 1"}, "podUid"),
        ({"plane": "VPC"}, "plane"),
        ({"dies": True}, "dies"),
        ({"dies": 10**5000}, "dies"),
        ({"dies": 0}, "dies"),
    ],
)
async def test_a_fork_request_with_a_field_of_the_wrong_kind_is_400_naming_it(
    over: dict[str, Any], param: str
) -> None:
    server, asked = _server()
    body = _body(server, **over)
    if over.get(param) is None:
        del body[param]
    with pytest.raises(EngineError) as refused:
        await server.serve(body)
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "invalid_request",
        param,
    )
    assert asked == [], "nothing is looked up for a request that is not one"


async def test_a_fork_source_never_echoes_a_key_and_asks_the_gate_first() -> None:
    server, asked = _server()
    wrong = "llama3-8b.secretsecret1"
    with pytest.raises(EngineError) as refused:
        await server.serve(_body(server, key=wrong))
    assert (refused.value.status, refused.value.code) == (409, "fork_mismatch")
    assert wrong not in refused.value.message
    assert server.key not in refused.value.message
    assert asked == [("w-1", "uid-1")]
    # an engine in no group: no assignment can name it
    server.gate = fork.no_group
    with pytest.raises(EngineError) as alone:
        await server.serve(_body(server))
    assert (alone.value.status, alone.value.code) == (403, "fork_not_assigned")


async def test_targets_in_the_pipelines_fill_count_and_positions_never_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 17: a target whose bytes have all left the source still waits for the pipeline
    to bring it the last slice; it counts against the fan-out meanwhile, and a target that
    joins then does not get the position of one that has gone."""
    monkeypatch.setattr(timing, "fork_hop_seconds", lambda _plane: 2.0)  # emulated: 0.2 wall s
    monkeypatch.setattr(cal, "FORK_FANOUT", 2)
    server, _ = _server()
    first = asyncio.create_task(server.serve(_body(server, pod="w-1")))
    second = asyncio.create_task(server.serve(_body(server, pod="w-2")))
    answer = await asyncio.wait_for(first, 5)  # position 1: no fill beyond the latency
    assert answer["position"] == 1
    assert not second.done()
    assert server.active == 1, "the second target waits in the fill: it still counts"
    assert server.flows(Plane.UB) == 0, "its bytes have all left the source"
    third = asyncio.create_task(server.serve(_body(server, pod="w-3")))
    await asyncio.sleep(0.01)
    assert server.active == 2
    with pytest.raises(EngineError) as busy:
        await server.serve(_body(server, pod="w-4"))
    assert busy.value.code == "fork_busy"
    with pytest.raises(EngineError) as twice:
        await server.serve(_body(server, pod="w-2"))
    assert (twice.value.status, twice.value.code) == (409, "fork_in_progress")
    answers = [answer, await asyncio.wait_for(second, 5), await asyncio.wait_for(third, 5)]
    assert [a["position"] for a in answers] == [1, 2, 3]
    assert server.active == 0
    again = await asyncio.wait_for(server.serve(_body(server, pod="w-5")), 5)
    assert again["position"] == 1, "a new chain starts at the head"


async def test_a_shutdown_aborts_every_fork_and_refuses_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timing, "fork_hop_seconds", lambda _plane: 2.0)
    server, _ = _server(scale=0.01)  # 0.1 emulated s of transfer: 10 wall s
    receiving = asyncio.create_task(server.serve(_body(server, pod="w-1")))
    await asyncio.sleep(0.05)
    assert server.active == 1
    server.shutdown("instance g-p-0 is closing")
    with pytest.raises(EngineError) as aborted:
        await asyncio.wait_for(receiving, 1)
    assert (aborted.value.status, aborted.value.code) == (503, "fork_aborted")
    assert "closing" in aborted.value.message
    with pytest.raises(EngineError) as refused:
        await server.serve(_body(server, pod="w-2"))
    assert (refused.value.status, refused.value.code) == (503, "not_ready")
    assert server.active == 0
    await server.close()


async def test_a_target_in_the_fill_is_aborted_by_a_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timing, "fork_hop_seconds", lambda _plane: 100.0)  # 10 wall s of fill
    server, _ = _server()
    head = asyncio.create_task(server.serve(_body(server, pod="w-1")))
    filling = asyncio.create_task(server.serve(_body(server, pod="w-2")))
    await asyncio.wait_for(head, 5)
    assert server.active == 1
    server.shutdown("stopping")
    with pytest.raises(EngineError) as aborted:
        await asyncio.wait_for(filling, 1)
    assert aborted.value.code == "fork_aborted"


async def test_a_broadcast_that_fails_aborts_its_chain_rather_than_leaving_it_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, _ = _server()

    def broken(_plane: Plane) -> float:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(server, "rate", broken)
    with pytest.raises(EngineError) as aborted:
        await asyncio.wait_for(server.serve(_body(server)), 2)
    assert aborted.value.code == "fork_aborted"
    assert "ZeroDivisionError" in aborted.value.message
    assert server.active == 0


async def test_a_closing_engine_forks_nobody() -> None:
    config = parse(["--model", "llama3-8b", "--dies", "0", "--time-scale", "1000"])
    engine = Engine(config)
    engine.loaded = True
    assert engine._why_not_serving() is None
    engine.shutdown("instance g-p-0 is closing")
    assert engine._why_not_serving() == "instance g-p-0 is closing"
    await engine.close()


# ----------------------------------------------------------------------------- the target's side
async def test_a_fork_answer_too_large_or_not_understood_is_a_fork_failure() -> None:
    import httpx

    config = parse(["--model", "llama3-8b", "--dies", "0", "--host", "127.0.0.1"])
    ref = _ref(key=fork.fork_key(config))
    answers = {
        "huge": httpx.Response(200, content=b" " * (fork.MAX_ANSWER_BYTES + 1)),
        "nan": httpx.Response(200, content=b'{"seconds": NaN}'),
        "negative": httpx.Response(200, content=b'{"seconds": -1}'),
        "list": httpx.Response(200, content=b"[1]"),
        "error": httpx.Response(503, json={"error": {"code": "fork_busy", "message": "busy"}}),
    }
    for name, response in answers.items():

        def handler(_request: httpx.Request, response: httpx.Response = response) -> httpx.Response:
            return response

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            with pytest.raises(fork.ForkFailed):
                await fork.fetch(http, config, ref, 5.0)
            assert name

    def crash(_request: httpx.Request) -> httpx.Response:
        raise RuntimeError("anything at all")

    async with httpx.AsyncClient(transport=httpx.MockTransport(crash)) as http:
        with pytest.raises(fork.ForkFailed, match="RuntimeError"):
            await fork.fetch(http, config, ref, 5.0)

    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"seconds": 0.1, "position": 1})

    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as http:
        assert (await fork.fetch(http, config, ref, 5.0))["seconds"] == 0.1
    assert str(seen[0].url) == "http://127.0.0.20:8000/v1/fork"


# ----------------------------------------------------------------------------- KV pull metadata
@pytest.mark.parametrize(
    "flows", [float("inf"), float("-inf"), float("nan"), "x", None, [1], "1e999"]
)
def test_a_flow_count_that_is_not_a_number_is_refused(flows: Any) -> None:
    meta = {"bytes": 1.0, "egressFlows": flows}
    with pytest.raises((ValueError, TypeError)):
        kvpull._KvMeta.parse(meta)
    with pytest.raises((ValueError, TypeError)):
        kvpull._KvMeta.parse({"bytes": 1.0, "egressFlows": 1, "forkFlows": {"RoCE": flows}})


def test_flow_counts_are_clamped_to_what_an_engine_can_have() -> None:
    meta = kvpull._KvMeta.parse(
        {"bytes": 1.0, "egressFlows": 10**30, "forkFlows": {"RoCE": 1e300, "UB": -5}}
    )
    assert meta.egress_flows == kvpull.MAX_EGRESS_FLOWS
    assert meta.fork_flows == {"RoCE": 1, "UB": 0}
    assert kvpull._KvMeta.parse({"bytes": 1.0, "egressFlows": -3}).egress_flows == 1


def test_a_kv_size_out_of_range_is_refused() -> None:
    for nbytes in (10**400, float("inf"), -1.0):
        with pytest.raises((ValueError, OverflowError)):
            kvpull._KvMeta.parse({"bytes": nbytes, "egressFlows": 1})


# ----------------------------------------------------------------------------- the session bridge
class _Session:
    """What the bridge uses of a session: its listeners (the test says the states)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[SessionState], None]] = []

    def add_listener(self, listener: Callable[[SessionState], None]) -> None:
        self.listeners.append(listener)

    def say(self, state: SessionState) -> None:
        for listener in self.listeners:
            listener(state)


async def _until(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_what_a_session_keeps_is_written_again_after_a_lost_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 1: the loop cleared its event, waited, and then wrote only while the event was
    not set, which it always was: nothing was ever written again."""
    monkeypatch.setattr(zkbridge, "RETRY_SECONDS", 0.01)
    session = _Session()
    bridge = zkbridge.SessionBridge(session)  # type: ignore[arg-type]
    bridge.start()
    writes: list[float] = []
    failures = [RuntimeError("no folder yet")]

    async def write() -> None:
        if failures:
            raise failures.pop()
        writes.append(time.monotonic())

    keeper = asyncio.create_task(bridge.keep_registered(write, "the report", now=True))
    await _until(lambda: len(writes) == 1)  # the first write, through the retry
    session.say(SessionState.SUSPENDED)
    session.say(SessionState.LOST)
    await asyncio.sleep(0.05)
    assert len(writes) == 1, "nothing is tried while the session is not there"
    failures.append(RuntimeError("connection loss"))
    session.say(SessionState.CONNECTED)
    await _until(lambda: len(writes) == 2)  # once more, after one failure
    session.say(SessionState.CONNECTED)  # a reconnection within the session: again
    await _until(lambda: len(writes) == 3)
    keeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await keeper


# ----------------------------------------------------------------------------- the warm report
class _Zk:
    """A warm engine's session as far as its writes go: each write takes 0.1 s (in ZooKeeper),
    the log says when it started and ended, and when the report was deleted."""

    def __init__(self, fail: int = 0) -> None:
        self.log: list[str] = []
        self.fail = fail  # watch registrations that fail first (a connection lost)
        self.watched: list[str] = []

    def delete(self, path: str) -> None:
        raise AssertionError("run() stands for it")

    def watch_data(self, path: str, callback: Any) -> None:
        raise AssertionError("run() stands for it")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if fn == self.delete:
            self.log.append("delete")
            return True
        if fn == self.watch_data:
            if self.fail:
                self.fail -= 1
                raise ConnectionError("connection loss")
            self.watched.append(args[0])
            return None
        self.log.append("write")
        await asyncio.sleep(0.1)
        self.log.append("written")
        return None


def _warm_engine(zk: _Zk) -> warm.WarmEngine:
    engine = warm.WarmEngine(_fixed_config(node="n-0"))
    engine.zk = zk  # type: ignore[assignment]
    return engine


async def test_a_claimed_pod_is_not_advertised_again_by_a_write_under_way() -> None:
    """Finding 5: the claim cancelled the keeper and deleted the report while a write was under
    way in ZooKeeper: the write landed after the delete and the claimed pod was warm again."""
    zk = _Zk()
    engine = _warm_engine(zk)
    writing = asyncio.create_task(engine._write_report())
    await asyncio.sleep(0.02)
    writing.cancel()  # as the claim cancels the keeper
    await engine._withdraw()
    assert zk.log == ["write", "written", "delete"]
    await engine._write_report()
    assert zk.log == ["write", "written", "delete"], "never written once claimed"


async def test_the_watches_and_the_first_report_go_through_the_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(zkbridge, "RETRY_SECONDS", 0.01)
    zk = _Zk(fail=2)
    engine = _warm_engine(zk)
    engine.bridge = zkbridge.SessionBridge(_Session())  # type: ignore[arg-type]
    engine.bridge.start()
    keeper = asyncio.create_task(engine.bridge.keep_registered(engine._register, "r", now=True))
    await _until(lambda: engine.reported)
    assert zk.watched == [zl.WarmPaths("t").assignment("w-0"), zl.WarmPaths("t").dram("n-0")]
    assert zk.log == ["write", "written"]
    keeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await keeper
