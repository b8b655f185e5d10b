"""An expert server on a private ZooKeeper, the test playing the pool's controller (it writes the
map's versions as the contract says: the version's znodes whole, then the pointer):

- it registers its ephemeral report (``Loading``, nothing loaded) before any map, loads the
  slots the map gives it, then reports ``Serving`` with ``loaded`` = the version;
- it computes one client's iteration: per layer and microbatch a time from the grouped GEMM
  roofline, the tokens counted per (layer, expert) in its report;
- tokens for an expert it does not hold, or holds disabled, are refused 409
  ``expert_not_held`` naming them; a malformed message is a 400;
- out of the server table of a later version, it reports ``Draining``;
- a version whose head says its rows are unchanged (``rowsAt``) is applied from the head alone,
  its layers unread; a changed stamp, or none, has it read the version whole;
- stopped, its report is gone at once.

:class:`Pool` and :func:`small_moe` are the client tests' too (``test_expert_client``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient

from engine.conftest import EngineProc
from matrixserve.api import zk_layout as zl
from testkit.helpers import wait_for, zookeeper

TIME_SCALE = "10"
EXPERTS = 16
MOE_LAYERS = 3


def small_moe(tmp_path: Path) -> str:
    """A small MoE model (DeepSeek's widths, 4 layers of which 3 MoE, 16 experts, top 4): the
    messages stay small and the tests fast; the paper's shape is the unit tests'."""
    shape = {
        "name": "tiny-moe",
        "layers": MOE_LAYERS + 1,
        "hidden": 7168,
        "heads": 128,
        "intermediate": 18432,
        "vocab": 129280,
        "dense_layers": 1,
        "moe": {
            "routed_experts": EXPERTS,
            "shared_experts": 1,
            "top_k": 4,
            "expert_intermediate": 2048,
            "moe_layers": MOE_LAYERS,
        },
        "mla": {
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "rope_dim": 64,
            "qk_nope_dim": 128,
            "v_head_dim": 128,
        },
        "weight_bytes": 1.0,
        "kv_bytes": 2.0,
    }
    path = tmp_path / "tiny-moe.json"
    path.write_text(json.dumps(shape))
    return str(path)


@dataclass
class Pool:
    """One expert pool in the private ZooKeeper; the test is its controller."""

    zk: KazooClient
    paths: zl.ExpertPoolPaths
    name: str  # <namespace>/<pool>
    hosts: str
    model: str  # the model file

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "MATRIXSERVE_EXPERT_POOL": self.name,
            "MATRIXSERVE_ZK": self.hosts,
            "MATRIXSERVE_ZK_AUTH": "",
            "MATRIXSERVE_ZK_AUTH_FILE": "",
            **extra,
        }

    def args(self, role: str, *more: str) -> tuple[str, ...]:
        return (
            *("--role", role, "--model", self.model, "--time-scale", TIME_SCALE),
            *("--pre-load-seconds", "0", "--load-source", "HostDRAM", "--health-interval", "5"),
            *more,
        )

    def start_server(
        self, start_engine: Callable[..., EngineProc], name: str, *more: str
    ) -> EngineProc:
        return start_engine(
            name,
            *self.args("expert", "--expert-slots", "16", *more),
            env=self.env(),
            wait_ready=False,
        )

    def write(
        self,
        version: int,
        servers: list[str],
        slots: list[list[list[int]]],  # layer -> server -> experts
        disabled: list[list[list[int]]] | None = None,
        reason: str = "test",
        rows_at: dict[str, int] | None = None,
        layers: bool = True,
        origin: float = 1.0,
    ) -> None:
        """A version written whole (without its layer znodes if not ``layers``), then put in
        force (the pointer carries its ``at``, as the controller's does); ``rows_at`` and
        ``origin`` its stamps and their history."""
        self.zk.ensure_path(self.paths.map)
        at = time.time()
        body = zl.ExpertMapVersion(
            version=version,
            layers=len(slots),
            experts=EXPERTS,
            slots=max(len(held) for layer in slots for held in layer),
            servers=servers,
            reason=reason,
            at=at,
            rowsAt=rows_at or {},
            origin=origin,
        )
        self.zk.create(self.paths.version(version), body.dump())
        for layer, held in enumerate(slots if layers else []):
            off = disabled[layer] if disabled else []
            self.zk.create(
                self.paths.layer(version, layer),
                zl.ExpertMapLayer(layer=layer, slots=held, disabled=off).dump(),
            )
        self.zk.set(self.paths.map, zl.ExpertMapPointer(version=version, at=at).dump())

    def report(self, server: str) -> zl.ExpertServerReport | None:
        if not self.zk.exists(self.paths.server(server)):
            return None
        return zl.ExpertServerReport.parse(self.zk.get(self.paths.server(server))[0])

    def serving(self, server: str, version: int) -> bool:
        report = self.report(server)
        return (
            report is not None
            and report.state is zl.ExpertServerState.SERVING
            and report.loaded == version
        )


def every_layer(*per_server: list[int]) -> list[list[list[int]]]:
    """The same slots in every MoE layer: server i holds ``per_server[i]``."""
    return [[list(held) for held in per_server] for _ in range(MOE_LAYERS)]


@pytest.fixture
def pool(
    start_zookeeper: Callable[[], Any], request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Pool]:
    server = start_zookeeper()
    with zookeeper(server.address, auth="") as zk:
        name = request.node.name.lower().replace("_", "-")[-40:].strip("-")
        zk.ensure_path(zl.ExpertPoolPaths("t", name).map)
        zk.set(zl.ExpertPoolPaths("t", name).map, zl.ExpertMapPointer(version=0).dump())
        yield Pool(
            zk, zl.ExpertPoolPaths("t", name), f"t/{name}", server.address, small_moe(tmp_path)
        )


def forward(server: EngineProc, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/expert/forward", json=body, timeout=10, trust_env=False)


def test_server_registers_loads_serves_and_drains(
    pool: Pool, start_engine: Callable[..., EngineProc]
) -> None:
    server = pool.start_server(start_engine, "ex-a")
    first = wait_for(lambda: pool.report("ex-a"), timeout=30, what="ex-a registered", every=0.05)
    assert first.state is zl.ExpertServerState.LOADING
    assert first.loaded == 0
    assert first.pool == pool.name
    assert first.slots == 16
    assert first.pod_ip == server.host

    # experts 0..7 on ex-a, 8..15 on a server that is not there; expert 3 disabled on ex-a
    disabled = [[[3], []] for _ in range(MOE_LAYERS)]
    pool.write(1, ["ex-a", "ex-b"], every_layer(list(range(8)), list(range(8, 16))), disabled)
    wait_for(lambda: pool.serving("ex-a", 1), timeout=30, what="ex-a serving v1", every=0.05)

    body = {
        "client": "att-1",
        "iteration": 1,
        "work": [
            {"layer": 0, "microbatch": 0, "experts": {"0": 40, "1": 40}},
            {"layer": 0, "microbatch": 1, "experts": {"0": 400}},
            {"layer": 2, "microbatch": 0, "experts": {"7": 1}},
        ],
    }
    answer = forward(server, body)
    assert answer.status_code == 200, answer.text
    seconds = answer.json()["seconds"]
    assert len(seconds) == 3
    assert all(s > 0 for s in seconds)
    assert seconds[1] > seconds[0]  # 400 tokens of one expert: compute-bound, more than 80 of two
    print(f"\nper-entry expert seconds (emulated): {seconds}")

    refused = forward(server, {**body, "work": [{"layer": 1, "experts": {"3": 5, "9": 1}}]})
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "expert_not_held"
    assert refused.json()["missing"] == [[1, 3], [1, 9]]
    malformed = forward(server, {"client": "att-1", "work": [{"layer": 99, "experts": {}}]})
    assert malformed.status_code == 400

    report = wait_for(
        lambda: (r := pool.report("ex-a")) is not None and r.tokens.get(0, {}).get(0) == 440 and r,
        timeout=15,
        what="ex-a's tokens reported",
        every=0.1,
    )
    assert report.tokens[0] == {0: 440, 1: 40}
    assert report.tokens[2] == {7: 1}

    pool.write(2, ["ex-b"], every_layer(list(range(16))), reason="ex-a scaled in")
    wait_for(
        lambda: (r := pool.report("ex-a")) is not None and r.state is zl.ExpertServerState.DRAINING,
        timeout=15,
        what="ex-a draining",
        every=0.05,
    )
    server.sup.stop("ex-a", grace=5)
    assert pool.report("ex-a") is None  # the session closed with the process: gone at once


def test_a_server_whose_rows_did_not_change_reads_the_head_alone(
    pool: Pool, start_engine: Callable[..., EngineProc]
) -> None:
    """Its stamp unchanged: the new table and version from the head, its layers never read
    (here there are none: a server that read them would wait for them, never applying v2),
    its rows kept whatever its index now; its stamp moved: the version whole, its new slots
    loaded; the same stamp in another history of the map (the pool made again, its numbers
    from 1 again): the version whole."""
    server = pool.start_server(start_engine, "ex-a")
    # ex-a at index 1 with experts 0..7
    slots = every_layer(list(range(8, 16)), list(range(8)))
    pool.write(1, ["ex-b", "ex-a"], slots, rows_at={"ex-a": 1, "ex-b": 1})
    wait_for(lambda: pool.serving("ex-a", 1), timeout=30, what="ex-a serving v1", every=0.05)

    def computes(layer: int, *experts: int) -> bool:
        work = [{"layer": layer, "experts": {str(e): 1 for e in experts}}]
        answer = forward(server, {"client": "att-1", "work": work})
        assert answer.status_code in (200, 409), answer.text
        return answer.status_code == 200

    # ex-b failed over: ex-a now at index 0, its rows as they were since v1
    unread = every_layer(list(range(8)))
    pool.write(2, ["ex-a"], unread, rows_at={"ex-a": 1}, layers=False, reason="ex-b failed")
    wait_for(lambda: pool.serving("ex-a", 2), timeout=30, what="ex-a applying v2", every=0.05)
    assert computes(1, 0, 7)
    assert not computes(1, 8)

    # its rows changed at v3 (index 1, experts 8..11): read whole, loaded
    grown = every_layer(list(range(12, 16)), list(range(8, 12)))
    pool.write(3, ["ex-c", "ex-a"], grown, rows_at={"ex-a": 3, "ex-c": 3})
    wait_for(lambda: pool.serving("ex-a", 3), timeout=30, what="ex-a applying v3", every=0.05)
    assert computes(2, 8, 11)
    assert not computes(2, 0)

    # the map lost and written again from another history: v3 again, stamp 3 again, other rows
    pool.zk.delete(pool.paths.map, recursive=True)
    pool.zk.ensure_path(pool.paths.map)
    other = every_layer(list(range(12, 16)), list(range(4)))
    pool.write(3, ["ex-c", "ex-a"], other, rows_at={"ex-a": 3, "ex-c": 3}, origin=2.0)
    wait_for(
        lambda: computes(0, 0, 3) and not computes(0, 8),
        timeout=30,
        what="ex-a holding the new history's rows",
        every=0.1,
    )
