"""A saturated closed load on engines' ``/v1/generate`` (no gateway): each target keeps
``streams`` streamed requests running, a new one sent the moment one ends (P/D-Serve §4.2's
method, "one completed triggers new one added"), so every engine's batch stays full.

Kept compact for long runs of many streams: every token's arrival (wall s, ``time.time()``) and
its inter-token latency (emulated s, from the events' own ``t``: the engine's clock, not this
process's delivery) go into two flat arrays; each request's outcome into a list. Targets are
added and stopped live (a load that falls: :meth:`ClosedLoad.stop`; streams stopped so are
closed by the load, not failed). Runs in a thread with its own event loop, beside the caller.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
import threading
import time
from array import array
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Outcome:
    """One request as the load saw it ended (wall s)."""

    target: str
    start: float
    end: float
    outcome: str  # "ok"; the error event's code; "http <status> <code>"; an exception's name
    tokens: int


class ClosedLoad:
    """``streams`` streams on each target added, until :meth:`stop` or :meth:`close`."""

    def __init__(
        self, prompt_tokens: int = 64, max_tokens: tuple[int, int] = (256, 768), seed: int = 0
    ) -> None:
        # each request's output length drawn from ``max_tokens``: streams that began together
        # do not end (and prefill again) together
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self._rng = random.Random(seed)
        self.token_wall = array("d")  # each token's arrival, in arrival order
        self.gap_wall = array("d")  # when each inter-token latency was known (its step's end)
        self.token_gap = array("d")  # the latency (emulated s, the engine's clock)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._http: httpx.AsyncClient | None = None
        self._seq = 0
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control
    def add(self, url: str, streams: int) -> None:
        """``streams`` closed-loop streams on the engine at ``url``."""

        async def start() -> None:
            if self._http is None:
                self._http = httpx.AsyncClient(
                    trust_env=False,
                    timeout=httpx.Timeout(None, connect=10),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                )
            tasks = self._tasks.setdefault(url, [])
            tasks += [asyncio.create_task(self._stream_loop(url)) for _ in range(streams)]

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)

    def stop(self, url: str) -> None:
        """The streams on ``url`` closed (not failures: the load fell)."""

        async def cancel() -> None:
            tasks = self._tasks.pop(url, [])
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(60)

    def close(self) -> None:
        for url in list(self._tasks):
            self.stop(url)

        async def shut() -> None:
            if self._http is not None:
                await self._http.aclose()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> ClosedLoad:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ figures
    def tokens_between(self, start: float, end: float) -> int:
        """Tokens that arrived in ``[start, end)`` (wall s)."""
        with self._lock:
            return bisect.bisect_left(self.token_wall, end) - bisect.bisect_left(
                self.token_wall, start
            )

    def rate(self, start: float, end: float) -> float:
        """Tokens per wall second over ``[start, end)``."""
        return self.tokens_between(start, end) / (end - start) if end > start else 0.0

    def gaps_between(self, start: float, end: float) -> list[float]:
        """The inter-token latencies (emulated s) known in ``[start, end)`` (a step's tokens are
        known once the next step's first arrives, one step after)."""
        with self._lock:
            lo = bisect.bisect_left(self.gap_wall, start)
            hi = bisect.bisect_left(self.gap_wall, end)
            return list(self.token_gap[lo:hi])

    def failed_between(self, start: float, end: float) -> list[Outcome]:
        """Requests that ended in ``[start, end)`` other than well (none is excused)."""
        with self._lock:
            return [o for o in self.outcomes if start <= o.end < end and o.outcome != "ok"]

    # ------------------------------------------------------------------ streams
    async def _stream_loop(self, url: str) -> None:
        while True:
            await self._one(url)

    async def _one(self, url: str) -> None:
        assert self._http is not None
        self._seq += 1
        body = {
            "requestId": f"load-{self._seq}",
            "promptTokens": self.prompt_tokens,
            "maxTokens": self._rng.randint(*self.max_tokens),
        }
        start = time.time()
        outcome, tokens = "incomplete", 0
        steps = _Steps()
        try:
            async with self._http.stream("POST", f"{url}/v1/generate", json=body) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    outcome = f"http {response.status_code} {_code(raw)}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        kind = event.get("type")
                        if kind == "token":
                            tokens += 1
                            self._record(time.time(), steps.token(float(event.get("t", 0.0))))
                        elif kind == "done":
                            outcome = "ok"
                            break
                        elif kind == "error":
                            outcome = str(event.get("code") or "error")
                            break
        except asyncio.CancelledError:
            raise  # stopped: the load fell; not an outcome
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        now = time.time()
        self._record(now, steps.flush())
        with self._lock:
            self.outcomes.append(Outcome(url, start, now, outcome, tokens))
        if outcome != "ok":
            await asyncio.sleep(0.2)  # a refusal is not retried in a tight loop

    def _record(self, now: float, gaps: list[float]) -> None:
        with self._lock:
            self.token_wall.append(now)
            if gaps:
                self.gap_wall.extend([now] * len(gaps))
                self.token_gap.extend(gaps)


class _Steps:
    """A stream's tokens grouped by engine step (the tokens of one step share its ``t``): each
    token of a step gets the step's gap over its tokens (the engine's own TPOT). The first
    step (the prefill's token) has no gap."""

    def __init__(self) -> None:
        self.prev: float | None = None  # the step before the current one
        self.current: float | None = None
        self.count = 0

    def token(self, t: float) -> list[float]:
        """A token at emulated ``t``; the gaps of the step it closes, if any."""
        if t == self.current:
            self.count += 1
            return []
        closed = self.flush()
        self.prev, self.current, self.count = self.current, t, 1
        return closed

    def flush(self) -> list[float]:
        if self.prev is None or self.current is None or not self.count:
            return []
        gap = (self.current - self.prev) / self.count
        count, self.count = self.count, 0
        return [gap] * count


def _code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"
