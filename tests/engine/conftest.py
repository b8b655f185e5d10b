"""Engine processes on loopback addresses, started per test and stopped after it; a private
ZooKeeper for the tests of the resident process (the cluster tests' ``start_zookeeper``)."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.conftest import start_zookeeper  # noqa: F401  (a private ZooKeeper, as fixture)
from matrixserve.devcluster.procs import Supervisor

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
