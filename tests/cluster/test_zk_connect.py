"""Issue 31 item 4: connecting to ZooKeeper never hangs on a server that accepts and then says
nothing, or accepts and resets, and connects as soon as a real server answers.

Before the fix, :meth:`matrixserve.coordination.Session.start` used kazoo 2.11's ``start``,
which stops its client before raising, and kazoo's ``stop`` joins the connection thread (and
callback workers) with no timeout: a try against a server that accepts and stays silent held the
caller for the socket's read timeout (the session timeout, 10 s for the operator) instead of the
try's own timeout, and a worker that never returned held it for ever. Now a failed try gives its
client up on a daemon thread and the next try takes a fresh client.

The server is the real ZooKeeper behind a gate on loopback that, by mode, holds each connection
silent, resets it, or forwards it to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from matrixserve.coordination import Session, SessionState


class Gate:
    """A TCP listener on 127.0.0.1 in front of ``upstream`` (``host:port``): ``mode`` is
    ``silent`` (accept, read, never answer), ``reset`` (accept, then RST) or ``forward``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.mode = "silent"
        self.accepted = 0
        self.sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="gate").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.sockets.append(conn)
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
            elif self.mode == "forward":
                upstream = socket.create_connection(self.upstream)
                self.sockets.append(upstream)
                for a, b in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=_pipe, args=(a, b), daemon=True).start()
            # silent: kept open, never answered

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def gate(start_zookeeper: Callable[[], Any]) -> Iterator[Gate]:
    server = start_zookeeper()
    g = Gate(server.address)
    yield g
    g.close()


def _state(session: Session) -> SessionState:
    return session.state  # read afresh (mypy keeps the narrowing of an earlier assertion)


def _stopping_threads() -> int:
    return sum(t.name == "zookeeper-stop" for t in threading.enumerate())


async def test_connect_neither_hangs_on_a_silent_or_resetting_server_nor_misses_a_real_one(
    gate: Gate,
) -> None:
    # the operator's session timeout (10 s: kazoo's read timeout on a silent server) and its
    # connect loop, with a shorter try and pause so the test is short
    session = Session(gate.address, timeout=10.0)
    first = session.client
    tries: list[float] = []
    began = time.monotonic()
    connecting = asyncio.create_task(
        session.connect(
            attempt_timeout=1.0,
            pause=0.1,
            on_retry=lambda exc: tries.append(time.monotonic() - began),
        )
    )
    try:
        # Silent: every try ends within its own timeout (+ the pause and a little slack).
        while len(tries) < 3 and time.monotonic() - began < 20:
            await asyncio.sleep(0.05)
        assert len(tries) >= 3, f"3 tries did not end within 20 s: {tries}"
        assert tries[2] < 3 * 1.1 + 1.5, f"a try outlived its 1 s timeout: {tries}"
        assert gate.accepted >= 3  # each try really reached the gate
        assert session.client is not first  # a failed try's client was given up
        assert session.state is SessionState.CONNECTING  # never said connected meanwhile

        gate.mode = "reset"
        seen = len(tries)
        while len(tries) < seen + 2 and time.monotonic() - began < 30:
            await asyncio.sleep(0.05)
        assert len(tries) >= seen + 2

        gate.mode = "forward"
        opened = time.monotonic()
        async with asyncio.timeout(5):  # the next try connects
            await connecting
        assert time.monotonic() - opened < 3.5
        assert session.connected
        assert _state(session) is SessionState.CONNECTED
        await session.run(session.put, "/matrixserve-gate-check", b"ok")
        assert await session.run(session.get, "/matrixserve-gate-check") == b"ok"
    finally:
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await connecting
        await session.stop()
    # Nothing left behind: once the held connections close, every given-up client has stopped.
    gate.close()
    deadline = time.monotonic() + 20
    while _stopping_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert _stopping_threads() == 0
