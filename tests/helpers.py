"""Small helpers shared by the tests (``pythonpath`` in pyproject puts this folder on the path)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60, what: str = "condition", every: float = 0.1
) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class TcpProxy:
    """A loopback TCP forwarder whose link can be cut and restored: ``cut()`` closes every
    connection and refuses new ones (as a dead server would), ``restore()`` accepts again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.open = True
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if not self.open:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            self.open = False
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.sockets.clear()

    def restore(self) -> None:
        with self.lock:
            self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


def assert_emulated(
    measured: float, expected: float, scale: float, *, late: float = 0.05, steps: int = 1
) -> None:
    """An emulated duration matches the model: never shorter (beyond 2 %), and longer only by what
    ``late`` wall seconds of event-loop lateness make at this time scale, spread over ``steps``
    (a mean over many steps). A loaded machine only ever makes emulated durations longer."""
    low = expected * 0.98
    high = expected * 1.02 + late * scale / steps
    assert low <= measured <= high, (
        f"emulated {measured:.6f}s outside [{low:.6f}, {high:.6f}] "
        f"(model {expected:.6f}s, time scale {scale:g})"
    )
