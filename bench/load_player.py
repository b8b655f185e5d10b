"""A closed-loop load of streamed completions through the gateway, in a process of its own
(bench-ratio): P/D-Serve §4.2's method, "maintaining the constant requests (one completed
triggers new one added)".

Reads on stdin ``{"gateway": url, "scenario": name, "clients": C, "seconds": T, "seed": s,
"mixes": [[t0, [{"weight", "promptChars", "maxTokens"}, ...]], ...]}``: ``C`` clients, each
sending its next request when the last one ended, for ``T`` seconds; from time ``t0`` (seconds
after the start) each request's class is drawn from that mix by weight (a later entry switches
the mix mid-run). Writes one JSON line per request on stdout: ``[start, firstToken, end,
outcome, tokens, prefill, decode, class]`` (wall seconds; ``outcome`` "ok", an error chunk's
code, or "http <status> <code>").
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testkit
from testkit.chaoskit import StreamRead, refused_code


async def one(
    http: httpx.AsyncClient, url: str, scenario: str, prompt: str, max_tokens: int
) -> tuple[float | None, str, int, str, str]:
    """A streamed completion: its first token's time, outcome, tokens, prefill, decode."""
    body = {"model": scenario, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    read = StreamRead()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                code = refused_code(await response.aread())
                return None, f"http {response.status_code} {code}", 0, "", ""
            async for line in response.aiter_lines():
                if read.feed(line, time.time()):
                    break
        outcome = read.outcome
    except httpx.HTTPError as exc:
        outcome = type(exc).__name__
    first = read.tokens[0] if read.tokens else None
    return first, outcome, len(read.tokens), read.prefill, read.decode


async def play(order: dict[str, Any]) -> None:
    rng = random.Random(int(order.get("seed", 0)))
    mixes = sorted((float(t), classes) for t, classes in order["mixes"])
    began = time.time()
    stop = began + float(order["seconds"])
    clients = int(order["clients"])
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(float(order.get("timeout", 120)))
    out = sys.stdout

    def pick() -> tuple[int, dict[str, Any]]:
        now = time.time() - began
        classes = mixes[0][1]
        for t, later in mixes:  # the last mix begun
            if t <= now:
                classes = later
        weights = [float(c["weight"]) for c in classes]
        index = rng.choices(range(len(classes)), weights)[0]
        return index, classes[index]

    async with httpx.AsyncClient(timeout=timeout, trust_env=False, limits=limits) as http:

        async def client(i: int) -> None:
            n = 0
            while time.time() < stop:
                index, cls = pick()
                phrase = f"client {i} request {n} "
                prompt = (phrase * (int(cls["promptChars"]) // len(phrase) + 1))[
                    : int(cls["promptChars"])
                ]
                start = time.time()
                first, outcome, tokens, prefill, decode = await one(
                    http, order["gateway"], order["scenario"], prompt, int(cls["maxTokens"])
                )
                row = [start, first, time.time(), outcome, tokens, prefill, decode, index]
                out.write(json.dumps(row) + "\n")
                n += 1
                if outcome != "ok":
                    await asyncio.sleep(0.05)  # a failing group is not hammered

        await asyncio.gather(*(client(i) for i in range(clients)))
    out.flush()


def main() -> int:
    asyncio.run(play(json.load(sys.stdin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
