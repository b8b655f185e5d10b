"""Instances of several pods, pure parts (``enginestub.engine.ranks``): the configuration of a
rank (refused with one clear message where it cannot be one; the whole instance's shape, weights
and KV), the environment's two variables, the ZooKeeper layout (the ``ranks`` folder, the
payloads; one pod's report unchanged byte for byte), the leader's view of its workers (why a rank
is not a member in good standing, the fault it makes) and one rank's share of a load."""

from __future__ import annotations

import json
import time

import pytest

from enginestub import timing
from enginestub.engine import ranks
from enginestub.engine.config import ConfigError, EngineConfig, parse
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import DEEPSEEK_V3, LLAMA3_8B
from matrixserve.api.engine_settings import ASSIGNMENT_ENV, EngineEnv

GROUP = ("--group", "t/g", "--zookeeper", "127.0.0.1:2181")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in EngineEnv.NAMES.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MATRIXSERVE_ZK_AUTH", "")
    monkeypatch.setenv("MATRIXSERVE_ZK_AUTH_FILE", "")


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--rank", "2", "--ranks", "2", *GROUP],
            "rank 2 of an instance of 2 pod(s): ranks are 0..1",
        ),
        (["--rank", "1", *GROUP], "rank 1 of an instance of 1 pod(s)"),
        (["--rank", "-1", *GROUP], "rank: Input should be greater than or equal to 0"),
        (["--ranks", "0", *GROUP], "ranks: Input should be greater than or equal to 1"),
        (["--ranks", "2"], "an instance of 2 pods needs a group (MATRIXSERVE_GROUP)"),
        (
            ["--ranks", "2", "--dies", "0,1", "--tp", "3", *GROUP],
            "tp 3 does not divide the instance's 4 dies (2 granted to each of its 2 pods)",
        ),
    ],
)
def test_a_rank_that_cannot_be_is_refused_with_one_clear_message(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse(argv)
    assert message in str(refused.value)


def test_a_bad_rank_flag_is_argparses_refusal_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--rank", "one", *GROUP])
    assert exited.value.code == 2
    assert "--rank: invalid int value: 'one'" in capsys.readouterr().err


def test_rank_and_ranks_come_from_the_environment_and_default_to_rank_0_of_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alone = parse([])
    assert (alone.rank, alone.ranks, alone.instance_dies) == (0, 1, 2)
    monkeypatch.setenv("ENGINE_RANK", "3")
    monkeypatch.setenv("ENGINE_RANKS", "4")
    worker = parse([*GROUP])
    assert (worker.rank, worker.ranks) == (3, 4)
    assert (parse(["--rank", "0", *GROUP]).rank, parse(["--ranks", "5", *GROUP]).ranks) == (0, 5)


def test_the_whole_instance_is_timed_loaded_and_sized_not_one_pod() -> None:
    """A 2-pod instance of 16 dies each is the 32-die shape (CloudMatrix-Infer's EP32 prefill):
    the same shape, weights and KV as one process of 32 dies."""
    two = parse(
        [
            "--ranks",
            "2",
            "--model",
            "deepseek-v3",
            "--dies",
            ",".join(map(str, range(16))),
            "--tp",
            "1",
            "--ep",
            "32",
            *GROUP,
        ]
    )
    one = parse(
        [
            "--model",
            "deepseek-v3",
            "--dies",
            ",".join(map(str, range(32))),
            "--tp",
            "1",
            "--ep",
            "32",
        ]
    )
    assert two.model is DEEPSEEK_V3
    assert two.shape == one.shape
    assert two.shape.dies == 32
    assert two.weights_bytes == one.weights_bytes
    assert two.kv_capacity_bytes == one.kv_capacity_bytes
    assert len(two.dies) == 16  # its own, what its node granted
    assert timing.prefill_seconds(DEEPSEEK_V3, two.shape, 4096) == timing.prefill_seconds(
        DEEPSEEK_V3, one.shape, 4096
    )


def test_a_leader_formed_takes_every_ranks_roce_ips_its_own_first() -> None:
    leader = parse(["--ranks", "2", *GROUP])
    own = leader.roce_ips
    formed = leader.formed([*own, "198.19.9.1", "198.19.9.2"])
    assert formed.roce_ips == [*own, "198.19.9.1", "198.19.9.2"]
    assert formed.own_roce_ips == own
    assert formed.dies == leader.dies
    assert formed.shape == leader.shape
    with pytest.raises(ValueError, match="has 4 RoCE IPs, its leader's first"):
        leader.formed(["198.19.9.1", "198.19.9.2", *own])
    with pytest.raises(ValueError, match="has 4 RoCE IPs"):
        leader.formed([*own, "198.19.9.1"])


# ------------------------------------------------------------------ environment
def test_the_environment_names_rank_and_ranks_after_the_instance_and_assignments_carry_them() -> (
    None
):
    names = list(EngineEnv.NAMES)
    assert names[names.index("instance") + 1 : names.index("instance") + 3] == ["rank", "ranks"]
    assert (EngineEnv.name("rank"), EngineEnv.name("ranks")) == ("ENGINE_RANK", "ENGINE_RANKS")
    assert {"ENGINE_RANK", "ENGINE_RANKS"} <= ASSIGNMENT_ENV
    # unset, nothing is written: one pod's manifests are what they were
    assert "ENGINE_RANK" not in EngineEnv(instance="d-0").to_dict()
    assert EngineEnv(instance="d-0", rank="1", ranks="2").to_dict() == {
        "ENGINE_INSTANCE": "d-0",
        "ENGINE_RANK": "1",
        "ENGINE_RANKS": "2",
    }


# ------------------------------------------------------------------ ZooKeeper layout
def test_rank_paths_live_in_the_ranks_folder_the_group_makes() -> None:
    paths = zl.GroupPaths("ns", "g")
    assert paths.rank("d-0", 1) == "/matrixserve/v1/groups/ns/g/ranks/d-0.1"
    assert paths.ranks in paths.all_folders()
    assert zl.group_root_of(paths.rank("d-0", 3)) == paths.root
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match="invalid rank"):
            paths.rank("d-0", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid instance"):
        paths.rank("D_0", 1)


def _rank_report(k: int = 1, **changes: object) -> zl.RankReport:
    base: dict[str, object] = {
        "instance": "d-0",
        "rank": k,
        "pod": f"d-0-{k}",
        "podUid": f"uid-{k}",
        "podIP": f"127.0.0.{k + 1}",
        "port": 8000,
        "node": f"server-{k}",
        "superpod": "sp0",
        "npus": [0],
        "dies": [0, 1],
        "roceIps": [f"198.19.{k}.1", f"198.19.{k}.2"],
        "incarnation": f"inc-{k}",
        "ts": time.time(),
        "state": "Serving",
    }
    return zl.RankReport.model_validate({**base, **changes})


def test_a_rank_report_round_trips_with_the_layouts_aliases() -> None:
    fault = zl.EngineFault(kind=zl.EngineFaultKind.DIE, since=1.0, detail="die 1", dies=[1])
    report = _rank_report(state="Faulty", faults=[fault.model_dump(by_alias=True)])
    raw = json.loads(report.dump())
    assert {"podUid", "podIP", "roceIps", "ts", "state", "faults"} <= set(raw)
    again = zl.RankReport.parse(report.dump())
    assert again == report
    assert again.state is zl.HealthState.FAULTY
    assert again.faults == [fault]
    assert again.entry() == zl.RankEntry(
        rank=1,
        pod="d-0-1",
        podUid="uid-1",
        node="server-1",
        superpod="sp0",
        npus=[0],
        dies=[0, 1],
        roceIps=["198.19.1.1", "198.19.1.2"],
        incarnation="inc-1",
    )
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        _rank_report(k=0)  # rank 0 is the leader: it writes the report, not a rank report
    assert zl.EngineFaultKind("Rank") is zl.EngineFaultKind.RANK


def test_one_pods_report_is_the_report_it_always_was_and_a_leaders_lists_its_ranks() -> None:
    fields = {
        "instance": "p-0",
        "podIP": "127.0.0.1",
        "port": 8000,
        "node": "n",
        "superpod": "sp",
        "dies": [0],
        "roceIps": ["198.19.0.1"],
        "ts": 1.0,
    }
    alone = zl.Report.model_validate(fields)
    assert alone.dump() == (
        b'{"instance":"p-0","role":null,"podIP":"127.0.0.1","port":8000,"node":"n",'
        b'"superpod":"sp","dies":[0],"roceIps":["198.19.0.1"],"ts":1.0,"podUid":"",'
        b'"incarnation":"","tp":null}'
    )
    entries = [_rank_report(k).entry() for k in (0 + 1, 2)]
    leader = zl.Report.model_validate(
        {**fields, "ranks": [e.model_dump(by_alias=True) for e in entries]}
    )
    assert list(json.loads(leader.dump()))[-1] == "ranks"  # at the end of its fields
    assert zl.Report.parse(leader.dump()).ranks == entries


# ------------------------------------------------------------------ the leader's view
def _gang(ranks_: int = 3) -> ranks.RankGang:
    config = parse(["--ranks", str(ranks_), "--health-interval", "2", *GROUP])
    return ranks.RankGang(config.model_copy(update={"instance": "d-0"}), zl.GroupPaths("t", "g"))


def test_the_leader_waits_for_every_worker_serving_and_fresh() -> None:
    gang, now = _gang(), time.time()
    assert gang.stale_after == 3 * 2 + 10  # the operator's rule: 3 intervals and 10 s
    assert gang.waiting(now) == {1: "no report yet", 2: "no report yet"}
    gang._set(1, _rank_report(1).dump())
    gang._set(2, _rank_report(2, state="Faulty").dump())
    assert list(gang.waiting(now)) == [2]
    assert gang.waiting(now)[2].startswith("Faulty")
    gang._set(2, _rank_report(2).dump())
    assert gang.waiting(now) == {}
    assert set(gang.waiting(now + 17)) == {1, 2}  # neither refreshed for over 16 s
    gang._set(2, _rank_report(1).dump())  # another rank's report at rank 2's path
    assert gang.waiting(now) == {2: "no report yet"}


def test_a_formed_instance_lists_its_ranks_in_order_and_a_lost_rank_is_a_fault_naming_it() -> None:
    gang, now = _gang(), time.time()
    for k in (2, 1):
        gang._set(k, _rank_report(k).dump())
    leader = zl.RankEntry(
        rank=0,
        pod="d-0",
        node="server-0",
        superpod="sp0",
        dies=[0, 1],
        roceIps=["a", "b"],
        incarnation="L",
    )
    formed = gang.form(leader)
    assert [e.rank for e in formed] == [0, 1, 2]
    assert ranks.instance_roce_ips(formed) == [
        "a",
        "b",
        "198.19.1.1",
        "198.19.1.2",
        "198.19.2.1",
        "198.19.2.2",
    ]
    assert gang.faults(now) == {}

    gang._set(1, None)
    faults = gang.faults(now)
    assert list(faults) == [1]
    assert faults[1].kind is zl.EngineFaultKind.RANK
    assert faults[1].detail == "rank 1 (pod d-0-1 on server server-1): its report is gone"
    assert faults[1].dies == [0, 1]
    assert faults[1].since == now
    assert gang.faults(now + 1)[1].since == now  # since first seen

    gang._set(1, _rank_report(1, incarnation="inc-1b", podIP="127.0.0.9").dump())
    assert (
        "restarted (incarnation inc-1b, the instance was formed with inc-1)"
        in gang.faults(now)[1].detail
    )
    assert gang.waiting(now) == {}  # serving again: the instance may re-form
    gang._set(2, _rank_report(2, ts=now - 30).dump())
    assert "not refreshed for 30.0 s" in gang.faults(now)[2].detail
    gang._set(2, _rank_report(2).dump())
    assert [e.incarnation for e in gang.form(leader)] == ["L", "inc-1b", "inc-2"]
    assert gang.faults(now) == {}


def test_a_rank_loads_its_share_of_the_weights_by_the_same_load_model() -> None:
    shape = timing.InstanceShape(dies=32, tp=1, ep=32)
    shared = timing.LoadSource.SHARED_FILE_SERVICE
    whole = timing.load_seconds(DEEPSEEK_V3, shape, shared)
    assert timing.rank_load_seconds(DEEPSEEK_V3, shape, shared, 2) == pytest.approx(whole / 2)
    assert timing.rank_load_seconds(DEEPSEEK_V3, shape, shared, 1) == whole
    for local in (timing.LoadSource.SSD, timing.LoadSource.HOST_DRAM):  # per server: in parallel
        assert timing.rank_load_seconds(DEEPSEEK_V3, shape, local, 2) == timing.load_seconds(
            DEEPSEEK_V3, shape, local
        )
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        timing.rank_load_seconds(LLAMA3_8B, timing.InstanceShape(dies=2, tp=2), shared, 0)


def test_a_worker_refuses_the_engine_api_naming_its_leader() -> None:
    config: EngineConfig = parse(["--rank", "1", "--ranks", "2", *GROUP]).model_copy(
        update={"instance": "d-0"}
    )
    error = ranks.refused(config)
    assert (error.status, error.code) == (409, "not_the_leader")
    assert error.message == "rank 1 of d-0: requests go to its leader d-0"
