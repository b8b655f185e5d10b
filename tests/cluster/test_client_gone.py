"""Issue 31 item 4: work whose client is gone is freed within 0.5 s, whether the client resets
(RST) or closes (FIN), one request or many, streamed or not. Tried with raw sockets against the
gateway, engines in real time (a request of 8,192 tokens would decode for minutes)."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import httpx

from testkit.helpers import Groups, metric, wait_for

BOUND = 0.5  # seconds from the clients' leaving to engines with nothing of theirs


def _open(gateway: str, body: dict[str, Any]) -> socket.socket:
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    raw = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    return sock


def _leave(sock: socket.socket, how: str) -> None:
    if how == "rst":  # SO_LINGER 0: close() sends a reset
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # else a FIN


def test_clients_that_leave_free_the_engines_within_half_a_second(
    groups: Groups,
    serving_group: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> None:
    # (start-up at its fastest: TE-Pre-Load off, weights by NPU-fork; neither is looked at)
    fast = ("--engine-pre-load-seconds", "0", "--engine-load-source", "NPUForkUB")
    serving_group(prefill=2, decode=1, time_scale="1", extra=fast)
    gateway = start_gateway("--time-scale", "1")
    engines = {
        name: groups.core.read_namespaced_pod(name, groups.namespace).status.pod_ip
        for name in groups.pods("g")
    }

    def busy() -> dict[str, int]:
        """What each engine holds: decode batch entries, prefill slots."""
        out = {}
        for name, ip in engines.items():
            health = httpx.get(f"http://{ip}:8000/v1/info", timeout=5, trust_env=False).json()
            health = health["health"]
            out[name] = int(health["decodeBatch"]["running"]) if "-d-" in name else 0
            out[name] += int(health["prefillSlots"]["used"]) if "-p-" in name else 0
        return out

    def streams() -> dict[str, Any]:
        """Each engine's open streams (for a failure's account)."""
        return {
            name: httpx.get(f"http://{ip}:8000/v1/info", timeout=5, trust_env=False).json()[
                "health"
            ]["streams"]
            for name, ip in engines.items()
        }

    def freed_after(left: float) -> float:
        wait_for(
            lambda: not any(busy().values()),
            timeout=10,
            every=0.02,
            what="the engines freed",
            explain=lambda: f"{busy()}, open streams {streams()}",
        )
        return time.monotonic() - left

    for how in ("rst", "fin"):
        # 10 plain chats, each left 0.3 s after it was sent
        plain = {
            "model": "general",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 8192,
        }
        socks = [_open(gateway, plain) for _ in range(10)]
        wait_for(lambda: sum(busy().values()) >= 10, timeout=10, every=0.02, what="10 decoding")
        time.sleep(0.3)
        left = time.monotonic()
        for sock in socks:
            _leave(sock, how)
        plain_freed = freed_after(left)

        # 30 streams, each cut after its first tokens
        streamed = {**plain, "stream": True}
        socks = [_open(gateway, streamed) for _ in range(30)]
        for sock in socks:
            sock.settimeout(10)
            got = b""
            while got.count(b"data: ") < 3:
                chunk = sock.recv(65536)
                assert chunk, "the stream ended before its third event"
                got += chunk
        left = time.monotonic()
        for sock in socks:
            _leave(sock, how)
        streams_freed = freed_after(left)
        print(f"{how}: 10 plain freed in {plain_freed:.3f} s, 30 streams in {streams_freed:.3f} s")
        assert plain_freed < BOUND, (
            f"10 plain requests left ({how}): freed after {plain_freed:.2f} s"
        )
        assert streams_freed < BOUND, f"30 streams cut ({how}): freed after {streams_freed:.2f} s"
        for name in ("open_streams", "prompts_in_prefill", "prefill_slots_held"):
            assert metric(gateway, f"matrixserve_gateway_{name}") == 0, name
