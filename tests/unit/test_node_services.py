"""The node emulator's Service proxy (kube-proxy's userspace mode, on loopback): a connection
whose backend refuses it goes on to the next ready backend (issue 31: a client of a Service
whose one replica just died reaches a live one at once); with none answering it is closed."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from kubernetes import client

from enginestub.node import services
from matrixserve.devcluster.cluster import free_ports


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"live:" + await reader.read(100))
    await writer.drain()
    writer.close()


async def _ask(address: tuple[str, int]) -> bytes:
    """What the Service answers "hi" with; empty if it closes or resets the connection."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(b"hi")
        await writer.drain()
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def test_a_refused_backend_is_passed_over_for_the_next_ready_one() -> None:
    live = await asyncio.start_server(_echo, "127.0.0.1", 0)
    live_port = live.sockets[0].getsockname()[1]
    # nothing listens on the one: refused, as a pod whose process just died; the Service's port
    dead_port, service_port = free_ports(2)
    ready = {
        "dead": services.Backend("127.0.0.1", {"http": dead_port}),
        "live": services.Backend("127.0.0.1", {"http": live_port}),
    }
    current = ["dead", "live"]

    def backends(namespace: str, selector: Mapping[str, str]) -> list[services.Backend]:
        assert (namespace, selector) == ("ns", {"app": "gw"})
        return [ready[name] for name in current]

    proxy = services.ServiceProxy(client.ApiClient(), backends, ("127.0.0.1", 1))
    address = ("127.0.0.1", service_port)
    service = {
        "metadata": {"namespace": "ns", "name": "gw"},
        "spec": {
            "clusterIP": address[0],
            "selector": {"app": "gw"},
            "ports": [{"port": address[1], "targetPort": "http", "protocol": "TCP"}],
        },
    }
    try:
        await proxy._on_service("ADDED", service)
        # round-robin starts on each backend in turn: every connection reaches the live one
        assert [await _ask(address) for _ in range(4)] == [b"live:hi"] * 4
        current = ["dead"]  # none answers: the client's connection is closed, nothing relayed
        assert await _ask(address) == b""
        current = []  # no ready backend at all: the same
        assert await _ask(address) == b""
    finally:
        await proxy._on_service("DELETED", service)
        live.close()
        await live.wait_closed()
