"""Engine processes on loopback addresses, started per test and stopped after it; a private
ZooKeeper for the tests of the resident process (the cluster tests' ``start_zookeeper``), and a
P/D group in it whose operator the test plays (:class:`Group`)."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient

from cluster.conftest import start_zookeeper  # noqa: F401  (a private ZooKeeper, as fixture)
from matrixserve.api import zk_layout as zl
from matrixserve.devcluster.procs import Supervisor
from testkit.helpers import wait_for, zookeeper

_hosts = itertools.count(1)


class EngineProc:
    def __init__(self, sup: Supervisor, name: str, host: str, port: int) -> None:
        self.sup = sup
        self.name = name
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def log(self) -> str:
        return self.sup.log_path(self.name).read_text()

    @property
    def pid(self) -> int:
        record = self.sup.record(self.name)
        assert record is not None, f"{self.name} was not started"
        return record.pid

    def alive(self) -> bool:
        return not self.sup.exited(self.name)


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[Callable[..., EngineProc]]:
    sup = Supervisor(tmp_path / "engines")
    started: list[str] = []

    def start(
        name: str, *args: str, env: dict[str, str] | None = None, wait_ready: bool = True
    ) -> EngineProc:
        host = f"127.77.{os.getpid() % 200}.{next(_hosts) % 250 + 1}"
        port = 8000
        sup.start(
            name,
            [sys.executable, "-m", "enginestub", "--host", host, "--port", str(port), *args],
            # fault injection on: the tests inject faults (it is off unless enabled)
            env={**os.environ, "POD_NAME": name, "ENGINE_FAULT_INJECTION": "1", **(env or {})},
        )
        started.append(name)
        proc = EngineProc(sup, name, host, port)
        if wait_ready:
            deadline = time.monotonic() + 30
            while True:
                if sup.exited(name):
                    pytest.fail(f"engine {name} exited:\n{proc.log()[-2000:]}")
                try:
                    if (
                        httpx.get(f"{proc.url}/readyz", timeout=1, trust_env=False).status_code
                        == 200
                    ):
                        return proc
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"engine {name} not ready within 30s:\n{proc.log()[-2000:]}")
                time.sleep(0.05)
        return proc

    yield start
    for name in started:
        sup.stop(name, grace=5)


@pytest.fixture
def stream() -> Callable[..., tuple[int, list[dict[str, Any]]]]:
    """POST and read an SSE stream: ``stream(url, body, timeout)`` -> (status, events)."""
    return sse_post


def concurrent_streams(
    engine: EngineProc, n: int, tokens: int, prompt: int = 64
) -> list[tuple[int, list[dict[str, Any]]]]:
    """``n`` generate streams at once to ``engine``, each ``tokens`` long: (status, events)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        futures = [
            ex.submit(
                sse_post,
                f"{engine.url}/v1/generate",
                {"requestId": f"r{i}", "promptTokens": prompt, "maxTokens": tokens},
                120,
            )
            for i in range(n)
        ]
        return [f.result() for f in futures]


def sse_post(
    url: str, body: dict[str, Any], timeout: float = 60
) -> tuple[int, list[dict[str, Any]]]:
    """POST and read an SSE stream; returns the status and the events (or the error body)."""
    import json

    with httpx.stream("POST", url, json=body, timeout=timeout, trust_env=False) as response:
        if response.status_code != 200:
            return response.status_code, [json.loads(response.read())]
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
        return 200, events


# ------------------------------------------------------------------ a group, the test its operator
@dataclass
class Group:
    """One P/D group in the private ZooKeeper; the test is its operator."""

    zk: KazooClient
    paths: zl.GroupPaths
    name: str  # <namespace>/<group>
    hosts: str  # ZooKeeper, for the engines

    def env(self, roce: str, **extra: str) -> dict[str, str]:
        return {
            "MATRIXSERVE_GROUP": self.name,
            "MATRIXSERVE_ZK": self.hosts,
            "MATRIXSERVE_ROCE_IPS": roce,
            # open znodes, whatever the environment says (this ZooKeeper has no identity)
            "MATRIXSERVE_ZK_AUTH": "",
            "MATRIXSERVE_ZK_AUTH_FILE": "",
            **extra,
        }

    def form(self, prefills: list[str], decodes: list[str]) -> zl.RoceMap:
        """Gather the reports, write the map, the init order and the decode meta; wait until
        every member serves."""
        names = [*prefills, *decodes]
        wait_for(
            lambda: (
                self.zk.exists(self.paths.reports)
                and set(names) <= set(self.zk.get_children(self.paths.reports))
            ),
            timeout=30,
            what=f"reports from {names}",
            every=0.05,
        )
        reports = [zl.Report.parse(self.zk.get(self.paths.report(n))[0]) for n in names]
        roles = dict.fromkeys(prefills, zl.Role.PREFILL) | dict.fromkeys(decodes, zl.Role.DECODE)
        roce_map = zl.build_roce_map(reports, roles, version=1)
        self.zk.create(self.paths.roce_map, roce_map.dump(), makepath=True)
        self.zk.create(
            self.paths.decode_meta, zl.DecodeMeta(version=1, decodes=roce_map.decode).dump()
        )
        self.zk.create(self.paths.init_order, zl.InitOrder(epoch=1, roceMapVersion=1).dump())
        for name in names:
            wait_for(
                lambda n=name: (
                    (h := self.health(n)) is not None and h.state is zl.HealthState.SERVING
                ),
                timeout=60,
                what=f"{name} serving",
                every=0.05,
            )
        return roce_map

    def start(
        self,
        start_engine: Callable[..., EngineProc],
        args: tuple[str, ...],
        *members: tuple[str, ...],
    ) -> dict[str, EngineProc]:
        """An engine process per member ``(name, role, RoCE IPs, *its own flags)``, in this
        group, with ``args`` each (not waited for: :meth:`form` waits until they serve)."""
        return {
            name: start_engine(
                name, "--role", role, *args, *own, env=self.env(roce), wait_ready=False
            )
            for name, role, roce, *own in members
        }

    def health(self, name: str) -> zl.Health | None:
        stat = self.zk.exists(self.paths.health_of(name))
        return zl.Health.parse(self.zk.get(self.paths.health_of(name))[0]) if stat else None

    def report_kept(self, name: str) -> bool:
        return bool(self.zk.exists(self.paths.report(name)))

    def remove(self, name: str) -> None:
        removal = zl.Removal(instance=name, reason="test: logical removal", at=time.time())
        self.zk.create(self.paths.removed_of(name), removal.dump(), makepath=True)


@pytest.fixture
def group(start_zookeeper: Callable[[], Any], request: pytest.FixtureRequest) -> Iterator[Group]:  # noqa: F811
    server = start_zookeeper()
    with zookeeper(server.address, auth="") as zk:
        name = request.node.name.lower().replace("_", "-")[-40:].strip("-")
        yield Group(zk, zl.GroupPaths("t", name), f"t/{name}", server.address)
