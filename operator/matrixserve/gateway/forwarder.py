"""On-demand forwarding with rejection (P/D-Serve §3.5), the gateway's side: try the scenario's
prefill entrances in the policy's order; a 429 from a prefill means "busy, try the next"; when
every entrance rejected, wait for a slot this gateway holds to be released (or a short pause) and
try again, until the TTFT budget is spent, then give the reason. The budget is the request's own
threshold by its prompt's length (§2.2.2).

The policy (:class:`matrixserve.domain.forwarding.ForwardingPolicy`) says the order, whether it
commits to one choice, what it asks a busy prefill to do, whether prefills whose slots this
gateway holds are passed over, and whether it needs the prefills' queue reports (polled here).
What the gateway counts per prefill (open streams, prompts still in prefill, slots held) is the
prefill's feedback; a :class:`Flight` is one request's share of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import time
import uuid
from typing import TYPE_CHECKING

import aiohttp

from matrixserve.api.engine_protocol import TtftBudget, generate_body
from matrixserve.domain.forwarding import (
    POLICIES,
    Completion,
    Entrance,
    Loads,
    estimate_tokens,
    request_budget,
)
from matrixserve.gateway.discovery import Discovery, GroupRoute
from matrixserve.gateway.upstream import EnginePool, EngineStream, UpstreamError

if TYPE_CHECKING:  # the app composes this module's parts; they only name its types
    from matrixserve.gateway.app import GatewayConfig, GatewayMetrics

# When every entrance is busy, wait for a slot to be released (a stream's second token or its
# end), at most this long (wall s: other gateways' requests release slots this one cannot see).
RETRY_PAUSE_SECONDS = 0.02
# Passive health: a prefill that could not be reached (or did not answer in time) is passed over
# for this long (wall s), while another entrance is open; its routes may be stale (ZooKeeper out
# of reach, the group's status the last known one).
PASSED_OVER_SECONDS = 2.0
_REFUSAL = {"rejected": "rejected", "timeout": "not answered in time", "unreachable": "unreachable"}


class Forwarder:
    def __init__(
        self, discovery: Discovery, config: GatewayConfig, metrics: GatewayMetrics
    ) -> None:
        self.discovery = discovery
        self.config = config
        self.metrics = metrics
        self.policy = POLICIES[config.policy]
        self.open: dict[str, int] = {}  # open SSE streams per prefill
        self.prefilling: dict[str, int] = {}  # accepted, no first token yet, per prefill
        self.holding: dict[str, int] = {}  # accepted, KV not yet pulled by a decode, per prefill
        self.released = asyncio.Event()  # set (and replaced) whenever a prefill slot frees
        self.last_accepted: dict[str, str] = {}  # per scenario
        self.reported: dict[str, int] = {}  # the prefills' last queue reports
        self.failing: dict[str, float] = {}  # passed over until (monotonic s), per prefill
        self.turns = itertools.count()
        self.engines: EnginePool | None = None  # the relay's connections (the hot path)
        self.session: aiohttp.ClientSession | None = None  # the queue reports' polls
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # read_timeout: an engine silent for a minute mid-stream is hung; end the stream (the
        # client gets an error chunk) rather than hold its counters and slot for ever.
        self.engines = EnginePool(connect_timeout=2, read_timeout=60)
        if self.policy.polls_reports:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1))
            self._poller = asyncio.create_task(self._poll_reports())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.session is not None:
            await self.session.close()
        if self.engines is not None:
            self.engines.close()

    async def _poll_reports(self) -> None:
        """The baseline's periodic queue reports: stale between polls by design."""
        assert self.session is not None
        while True:
            entrances = {
                e.instance: e for g in list(self.discovery.groups.values()) for e in g.entrances
            }
            for name, e in entrances.items():
                try:
                    async with self.session.get(f"http://{e.address}/v1/info") as r:
                        health = (await r.json())["health"]
                        self.reported[name] = health["prefillSlots"]["used"] + health.get(
                            "prefillQueue", 0
                        )
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                    continue
            await asyncio.sleep(self.config.report_interval / self.config.time_scale)

    def _budget(self, routes: list[GroupRoute], completion: Completion) -> TtftBudget:
        """The request's TTFT threshold: the tightest of its groups' for a prompt of this length."""
        return request_budget(
            ((g.ttft_ms, g.ttft_per_1k_ms) for g in routes),
            estimate_tokens(completion.prompt),
            self.config.default_ttft_ms,
        )

    async def _try(self, entrance: Entrance, body: bytes, remaining: float) -> EngineStream | str:
        """One prefill's answer: its stream if it accepted, else why not (the metric's label).
        The answer is waited for at most the ``remaining`` budget (wall s): a prefill that
        neither accepts nor rejects in time (hung, overloaded) is passed over, never waited on
        past the budget."""
        assert self.engines is not None
        try:
            async with asyncio.timeout(remaining):
                response = await self.engines.post(entrance.address, "/v1/generate", body)
        except UpstreamError:  # a connect timeout too: "unreachable", not "timeout"
            answer = "unreachable"
        except TimeoutError:
            answer = "timeout"
        else:
            if response.status == 200:
                self.metrics.attempts.labels(answer="accepted").inc()
                return response
            answer = "rejected" if response.status == 429 else f"http_{response.status}"
            response.release()
        self.metrics.attempts.labels(answer=answer).inc()
        return answer

    async def forward(
        self, scenario: str, routes: list[GroupRoute], completion: Completion
    ) -> tuple[Entrance, EngineStream] | str:
        """An accepting prefill and its stream, or why there is none."""
        budget = self._budget(routes, completion)
        wall_budget = budget.wall_seconds(self.config.time_scale)  # as this gateway waits
        policy = self.policy
        started = time.monotonic()
        tried = 0
        refusals: collections.Counter[str] = collections.Counter()
        request_id = f"{scenario}-{uuid.uuid4().hex[:12]}"

        def spent() -> str:
            return (
                f"no prefill accepted within the TTFT budget of {budget.milliseconds:.0f} ms "
                f"({tried} tries: "
                + (", ".join(f"{n} {_REFUSAL.get(a, a)}" for a, n in refusals.items()) or "none")
                + ")"
            )

        while True:
            entrances = [e for g in routes for e in g.entrances]
            slots = {e.instance: g.prefill_batch for g in routes for e in g.entrances}
            if not entrances:
                return f"scenario {scenario!r} has no prefill entrance open"
            now = time.monotonic()
            entrances = [
                e for e in entrances if self.failing.get(e.instance, 0.0) <= now
            ] or entrances
            loads = Loads(
                self.open,
                self.prefilling,
                self.reported,
                self.last_accepted.get(scenario),
                next(self.turns),
            )
            for entrance in policy.choices(entrances, loads):
                if (
                    policy.skips_held
                    and self.holding.get(entrance.instance, 0) >= slots[entrance.instance]
                ):
                    continue  # every slot it has is held by this gateway's requests: skip the try
                remaining = wall_budget - (time.monotonic() - started)
                if remaining <= 0:
                    return spent()
                body = generate_body(
                    request_id,
                    completion.prompt,
                    completion.max_tokens,
                    TtftBudget.from_wall_seconds(remaining, self.config.time_scale),
                    policy.admission,
                )
                tried += 1
                response = await self._try(entrance, json.dumps(body).encode(), remaining)
                if not isinstance(response, str):
                    self.last_accepted[scenario] = entrance.instance
                    self.failing.pop(entrance.instance, None)
                    return entrance, response
                refusals[response] += 1
                if response in ("unreachable", "timeout"):
                    self.failing[entrance.instance] = time.monotonic() + PASSED_OVER_SECONDS
                if self.last_accepted.get(scenario) == entrance.instance:
                    del self.last_accepted[scenario]  # it is busy: batch forwarding moves on
            remaining = wall_budget - (time.monotonic() - started)
            if remaining <= 0:
                return spent()
            released = self.released
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, RETRY_PAUSE_SECONDS)):
                    await released.wait()

    def release_slot(self, instance: str) -> None:
        self.holding[instance] -= 1
        old, self.released = self.released, asyncio.Event()
        old.set()


class Flight:
    """One forwarded request's share of its prefill's load, as the gateway counts it (the
    prefill's feedback, P/D-Serve §3.5): an open stream until it ends, a prompt in prefill until
    its first token, and a prefill slot until its second token (a decode has pulled the KV) or
    its end."""

    def __init__(self, forwarder: Forwarder, instance: str, scenario: str, started: float) -> None:
        self.forwarder, self.instance, self.tokens = forwarder, instance, 0
        self.scenario, self.started = scenario, started
        for counts in (forwarder.open, forwarder.prefilling, forwarder.holding):
            counts[instance] = counts.get(instance, 0) + 1
        forwarder.metrics.open_streams.inc()

    def token(self) -> None:
        self.tokens += 1
        if self.tokens == 1:
            self.forwarder.prefilling[self.instance] -= 1
            self.forwarder.metrics.ttft.labels(scenario=self.scenario).observe(
                time.monotonic() - self.started
            )
        elif self.tokens == 2:
            self.forwarder.release_slot(self.instance)

    def end(self) -> None:
        if self.tokens < 1:
            self.forwarder.prefilling[self.instance] -= 1
        if self.tokens < 2:
            self.forwarder.release_slot(self.instance)
        self.forwarder.open[self.instance] -= 1
        self.forwarder.metrics.open_streams.dec()
