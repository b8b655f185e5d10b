"""Issue 17, the engine's detection tiers, in pure pieces: the flags (a bad number exits 2 naming
its flag; a hang bound must be beats missed), the device faults as the health types them (die,
npu, hbm, each since first seen), a probe answer as sub-link states (blocked, delayed), and the
stream registry a logical removal ends."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from enginestub import calibration as cal
from enginestub.engine.config import ConfigError, EngineConfig, parse
from enginestub.engine.faults import DeviceFaults
from enginestub.engine.heartbeat import hang_bound
from enginestub.engine.linkprobe import verdicts
from enginestub.engine.metrics import EngineMetrics
from enginestub.engine.streams import OpenStreams
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import error_event

FLAGS = [
    ("ENGINE_LOOP_BEAT_INTERVAL", "--loop-beat-interval"),
    ("ENGINE_HANG_BOUND", "--hang-bound"),
    ("ENGINE_LINK_PROBE_INTERVAL", "--link-probe-interval"),
]


def _config(*args: str) -> EngineConfig:
    return parse(["--model", "llama3-8b", "--dies", "0,1,2,3", *args])


@pytest.mark.parametrize(("variable", "flag"), FLAGS)
@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", ""])
def test_a_bad_detection_number_exits_2_naming_its_flag(
    variable: str,
    flag: str,
    value: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        _config()
    assert exited.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the flag itself, the same
        _config(flag, value or "x")


def test_the_detection_numbers_and_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = _config()
    assert defaults.loop_beat_interval == cal.LOOP_BEAT_INTERVAL_SECONDS == 1.0
    assert defaults.hang_bound == 3.0  # B28's [I]: 3 beats of 1 s missed
    assert defaults.link_probe_interval == cal.LINK_PROBE_INTERVAL_SECONDS
    monkeypatch.setenv("ENGINE_HANG_BOUND", "7.5")
    assert _config("--loop-beat-interval", "0.5").hang_bound == 7.5
    # A hang is beats missed: a bound of one beat or less is refused, naming both flags.
    refused = re.escape("--hang-bound 0.5 must be more than --loop-beat-interval 0.5")
    with pytest.raises(ConfigError, match=refused):
        _config("--hang-bound", "0.5", "--loop-beat-interval", "0.5")


def test_the_hang_bound_has_a_wall_floor_whatever_the_time_scale() -> None:
    # At time scale 1 the bound is the flag's; at 100, 3 emulated s would be 30 ms of wall time,
    # less than a pause of a loaded event loop: the floor holds it at 2 wall s.
    assert hang_bound(_config("--time-scale", "1")) == 3.0
    assert hang_bound(_config("--time-scale", "100")) == cal.HANG_WALL_FLOOR_SECONDS * 100


def _status(faults: dict[int, list[str]]) -> dict[str, Any]:
    """A device status file of one node: NPU n holds dies 2n and 2n+1."""
    return {
        "generation": 1,
        "npus": [
            {
                "id": npu,
                "dies": [
                    {
                        "id": die,
                        "health": "Unhealthy" if faults.get(die) else "Healthy",
                        "faults": [{"code": code} for code in faults.get(die, [])],
                    }
                    for die in (2 * npu, 2 * npu + 1)
                ],
            }
            for npu in range(4)
        ],
        "links": [],
    }


def test_device_faults_are_typed_per_npu_with_the_time_first_seen() -> None:
    faults = DeviceFaults(_config(), EngineMetrics("prefill"))
    assert faults.engine_faults() == []
    faults.apply_status(_status({3: ["DIE_DOWN"]}))
    (die,) = faults.engine_faults()
    assert (die.kind, die.dies, die.detail) == (zl.EngineFaultKind.DIE, [3], "die 3: DIE_DOWN")
    # Both dies of NPU 1: one npu fault, since its first die went; NPU 0's die 0 on its own.
    faults.apply_status(_status({3: ["DIE_DOWN"], 2: ["NPU_DOWN"], 0: ["DIE_DOWN"]}))
    die0, npu1 = faults.engine_faults()
    assert (die0.kind, die0.dies) == (zl.EngineFaultKind.DIE, [0])
    assert (npu1.kind, npu1.dies) == (zl.EngineFaultKind.NPU, [2, 3])
    assert npu1.since == die.since
    assert npu1.detail.startswith("NPU 1: ")
    # An HBM error is its own kind; a die healed is forgotten (a new fault is new again).
    faults.apply_status(_status({1: ["HBM_UNCORRECTABLE_ECC"]}))
    (hbm,) = faults.engine_faults()
    assert (hbm.kind, hbm.dies) == (zl.EngineFaultKind.HBM, [1])
    faults.apply_status(_status({}))
    assert faults.engine_faults() == []
    assert faults.first_seen == {}


def test_injected_device_faults_are_typed_too() -> None:
    faults = DeviceFaults(_config(), EngineMetrics("decode"))
    faults.inject("die-down", {"die": 2})
    faults.inject("die-down", {"die": 3})  # replaces the first: healing it heals die 3
    faults.inject("hbm-error", {})
    kinds = [(f.kind, f.dies) for f in faults.engine_faults()]
    assert kinds == [(zl.EngineFaultKind.DIE, [3]), (zl.EngineFaultKind.HBM, [0, 1, 2, 3])]
    faults.heal("hbm-error")
    faults.inject("hbm-error", {"die": 1})
    assert faults.engine_faults()[-1].dies == [1]
    faults.heal("hbm-error")
    faults.heal("die-down")
    assert faults.engine_faults() == []


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"seconds": 1.0, "aloneSeconds": 1.0, "blocked": {}, "backpressure": ""}, {}),
        (
            {"seconds": 1.0, "aloneSeconds": 1.0, "blocked": {"1": "down"}, "backpressure": ""},
            {1: (zl.LinkState.BLOCKED, "ip1", "?")},  # down at a decode that did not say who
        ),
        (  # a third of the link: three times as long, over the factor of two
            {"seconds": 3.1, "aloneSeconds": 1.1, "latencySeconds": 0.1, "blocked": {}},
            {0: (zl.LinkState.DELAYED, "ip0", ""), 1: (zl.LinkState.DELAYED, "ip1", "")},
        ),
        (  # half the link: twice as long, not over it (latency is not a delay)
            {"seconds": 2.1, "aloneSeconds": 1.1, "latencySeconds": 0.1, "blocked": {}},
            {},
        ),
        (  # a full batch holds the KV back; a blocked sub-link stays blocked, down at the decode
            {
                "instance": "g-d-0",
                "seconds": 1,
                "aloneSeconds": 1,
                "blocked": {"0": "x"},
                "backpressure": "full",
            },
            {0: (zl.LinkState.BLOCKED, "ip0", "g-d-0"), 1: (zl.LinkState.DELAYED, "ip1", "")},
        ),
    ],
)
def test_a_probe_answer_as_sub_link_states(
    answer: dict[str, Any], expected: dict[int, tuple[zl.LinkState, str, str]]
) -> None:
    assert verdicts(answer, (0, 1), ("ip0", "ip1")) == expected


async def test_ending_streams_cancels_each_once_and_tells_it_why() -> None:
    streams = OpenStreams()
    told: list[Any] = []
    inside = asyncio.Event()

    async def serve() -> None:
        with streams.track():
            inside.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                told.append(streams.ended())
                told.append(streams.ended())  # asked twice: said once
                await asyncio.sleep(0)  # the cancellation was taken back: it goes on
                told.append("wrote")

    task = asyncio.create_task(serve())
    await inside.wait()
    assert len(streams) == 1
    event = error_event("instance_removed", "gone")
    assert streams.end_all(event) == 1
    assert streams.end_all(event) == 1  # the same stream is not cancelled twice
    await task
    assert told == [event, None, "wrote"]
    assert not task.cancelled()
    assert len(streams) == 0
    assert streams.end_all(event) == 0
