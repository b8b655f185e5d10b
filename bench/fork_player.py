"""Play NPU-fork targets against live sources, in a process of its own (bench-scale-out).

Reads ``{"pause": s, "rounds": [[{"url": ..., "body": ...}, ...], ...]}`` on stdin: each job is
one target's ``POST /v1/fork`` (DeepServe §6.2; :mod:`enginestub.engine.fork`), its assignment
already written by the caller. A round's jobs are sent at once (a scale-out's fan-out: up to 32
targets per source) and answered together; then ``pause`` seconds, then the next round. Prints
``{"served": n, "refused": [...], "spans": [[begin, end], ...]}`` (each round's wall times,
from its first request to its last answer). A process of its own, so
the benchmark's clients, whose timestamps are the sources' TTFT and TPOT, do not share an
interpreter with the fork requests; bench-scale-out runs it at the lowest CPU priority (the
targets' side: other servers on a SuperPod).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx


async def play(pause: float, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    served, refused, spans = 0, [], []
    size = max((len(jobs) for jobs in rounds), default=1)
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    async with httpx.AsyncClient(timeout=120, trust_env=False, limits=limits) as client:

        async def target(job: dict[str, Any]) -> None:
            nonlocal served
            answer = await client.post(job["url"], json=job["body"])
            if answer.status_code == 200:
                served += 1
            else:
                refused.append(f"{answer.status_code} {answer.text[:200]}")

        for n, jobs in enumerate(rounds):
            if n:
                await asyncio.sleep(pause)
            begin = time.time()
            await asyncio.gather(*(target(job) for job in jobs))
            spans.append([begin, time.time()])
    return {"served": served, "refused": refused, "spans": spans}


def main() -> int:
    order = json.load(sys.stdin)
    print(json.dumps(asyncio.run(play(float(order["pause"]), order["rounds"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
