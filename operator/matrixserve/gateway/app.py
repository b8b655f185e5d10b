"""The gateway's HTTP server: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streaming
and not), ``/v1/models``, ``/v1/routes`` (what it routes by), ``/healthz``, ``/metrics``.

On-demand forwarding with rejection (P/D-Serve §3.5): try the scenario's prefill entrances in the
policy's order; a 429 from a prefill means "busy, try the next"; when every entrance rejected,
re-order and try again after a short pause, until the TTFT budget is spent, then answer 503 with
the reason. The budget is the request's own threshold, by its prompt's length (P/D-Serve §2.2.2):
the group's ``slo.ttftMilliseconds`` plus ``slo.ttftMillisecondsPer1kTokens`` per thousand
prompt tokens. The stream of the accepting prefill (decode -> prefill -> gateway), read through
the gateway's pooled engine client (``upstream``), is relayed as OpenAI chunks; a decode failing
mid-stream ends the client's stream with an error chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from matrixserve.domain.forwarding import (
    BadRequest,
    Completion,
    Entrance,
    Policy,
    TokenBucket,
    bearer,
    estimate_tokens,
    order,
    parse_completion,
    ttft_threshold_ms,
)
from matrixserve.gateway.discovery import Discovery, GroupRoute
from matrixserve.gateway.upstream import EnginePool, EngineStream, UpstreamError

log = logging.getLogger("matrixserve.gateway")
# When every entrance is busy, wait for a slot to be released (a stream's second token or its
# end), at most this long (wall s: other gateways' requests release slots this one cannot see).
RETRY_PAUSE_SECONDS = 0.02
_REFUSAL = {"rejected": "rejected", "timeout": "not answered in time", "unreachable": "unreachable"}


@dataclass(frozen=True)
class GatewayConfig:
    policy: Policy = Policy.ON_DEMAND
    time_scale: float = 1.0  # engines' emulated seconds per wall second
    default_ttft_ms: int = 2000
    max_prompt_chars: int = 200_000
    max_tokens_limit: int = 8192
    report_interval: float = 0.1  # least-loaded baseline: queue report period (emulated s)
    require_keys: bool = False  # API keys configured: /v1/* needs "Authorization: Bearer <key>"
    rate_limit: float = 0.0  # requests per second per key (0: unlimited)
    rate_burst: float = 10.0


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "matrixserve_gateway_requests",
            "Requests by scenario and outcome",
            ["scenario", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "matrixserve_gateway_ttft_seconds",
            "Time to first token seen by the gateway (wall s)",
            ["scenario"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
            registry=r,
        )
        self.attempts = Counter(
            "matrixserve_gateway_forward_attempts",
            "Prefill tries, by answer",
            ["answer"],
            registry=r,
        )
        self.open_streams = Gauge(
            "matrixserve_gateway_open_streams", "Open SSE streams", registry=r
        )
        self.zookeeper_connected = Gauge(
            "matrixserve_gateway_zookeeper_connected",
            "1 while entrances come from ZooKeeper, 0 while they come from PDGroup status",
            registry=r,
        )
        self.zookeeper_sessions_lost = Counter(
            "matrixserve_gateway_zookeeper_sessions_lost",
            "ZooKeeper sessions expired under the gateway (its watches were re-armed)",
            registry=r,
        )


class Gateway:
    def __init__(self, discovery: Discovery, config: GatewayConfig) -> None:
        self.discovery = discovery
        self.config = config
        self.metrics = GatewayMetrics()
        self.metrics.zookeeper_connected.set_function(lambda: float(discovery.zk_connected))
        discovery.on_session_lost = self.metrics.zookeeper_sessions_lost.inc
        self.open: dict[str, int] = {}  # open SSE streams per prefill
        self.prefilling: dict[str, int] = {}  # accepted, no first token yet, per prefill
        self.holding: dict[str, int] = {}  # accepted, KV not yet pulled by a decode, per prefill
        self.released = asyncio.Event()  # set (and replaced) whenever a prefill slot frees
        self.last_accepted: dict[str, str] = {}
        self.reported: dict[str, int] = {}
        self.turns = itertools.count()
        self.engines: EnginePool | None = None  # the relay's connections (the hot path)
        self.session: aiohttp.ClientSession | None = None  # the baseline's queue reports
        self._poller: asyncio.Task[None] | None = None
        self.keys: dict[str, str] = {}  # API key -> its name in the Secret (set by the key loader)
        self.buckets: dict[str, TokenBucket] = {}

    async def start(self) -> None:
        # read_timeout: an engine silent for a minute mid-stream is hung; end the stream (the
        # client gets an error chunk) rather than hold its counters and slot for ever.
        self.engines = EnginePool(connect_timeout=2, read_timeout=60)
        if self.config.policy is Policy.LEAST_LOADED:
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

    # ------------------------------------------------------------------ routing
    def _scenario(self, request: web.Request, completion: Completion) -> str:
        return request.headers.get("X-MatrixServe-Scenario") or completion.model

    def _budget(self, routes: list[GroupRoute], completion: Completion) -> float:
        """The request's TTFT threshold in emulated seconds: the tightest of its groups'
        thresholds for a prompt of this length."""
        tokens = estimate_tokens(completion.prompt)
        slo = min(
            (
                ttft_threshold_ms(g.ttft_ms or 0, g.ttft_per_1k_ms, tokens)
                for g in routes
                if g.ttft_ms or g.ttft_per_1k_ms
            ),
            default=float(self.config.default_ttft_ms),
        )
        return slo / 1000.0

    async def _try(
        self, entrance: Entrance, body: dict[str, Any], remaining: float
    ) -> EngineStream | str:
        """One prefill's answer: its stream if it accepted, else why not (the metric's label).
        The answer is waited for at most the ``remaining`` budget (wall s): a prefill that
        neither accepts nor rejects in time (hung, overloaded) is passed over, never waited on
        past the budget."""
        assert self.engines is not None
        try:
            async with asyncio.timeout(remaining):
                response = await self.engines.post(
                    entrance.address, "/v1/generate", json.dumps(body).encode()
                )
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
        slo = self._budget(routes, completion)  # emulated seconds, as the engines count time
        budget = slo / self.config.time_scale  # wall seconds, as this gateway waits
        started = time.monotonic()
        tried = 0
        refusals: collections.Counter[str] = collections.Counter()
        request_id = f"{scenario}-{uuid.uuid4().hex[:12]}"

        def spent() -> str:
            return (
                f"no prefill accepted within the TTFT budget of {slo * 1000:.0f} ms "
                f"({tried} tries: "
                + (", ".join(f"{n} {_REFUSAL.get(a, a)}" for a, n in refusals.items()) or "none")
                + ")"
            )

        while True:
            entrances = [e for g in routes for e in g.entrances]
            slots = {e.instance: g.prefill_batch for g in routes for e in g.entrances}
            if not entrances:
                return f"scenario {scenario!r} has no prefill entrance open"
            ranked = order(
                self.config.policy,
                entrances,
                self.open,
                last_accepted=self.last_accepted.get(scenario),
                turn=next(self.turns),
                reported_load=self.reported,
                in_prefill=self.prefilling,
            )
            if self.config.policy is not Policy.ON_DEMAND:
                ranked = ranked[:1]  # baselines commit to one choice; their prefills queue
            for entrance in ranked:
                if (
                    self.config.policy is Policy.ON_DEMAND
                    and self.holding.get(entrance.instance, 0) >= slots[entrance.instance]
                ):
                    continue  # every slot it has is held by this gateway's requests: skip the try
                remaining = budget - (time.monotonic() - started)
                if remaining <= 0:
                    return spent()
                body = {
                    "requestId": request_id,
                    "prompt": completion.prompt,
                    "maxTokens": completion.max_tokens,
                    "ttftBudget": remaining * self.config.time_scale,
                    # the baselines' prefills keep a local queue (P/D-Serve's original version)
                    "admission": "reject" if self.config.policy is Policy.ON_DEMAND else "queue",
                }
                tried += 1
                response = await self._try(entrance, body, remaining)
                if not isinstance(response, str):
                    self.last_accepted[scenario] = entrance.instance
                    return entrance, response
                refusals[response] += 1
                if self.last_accepted.get(scenario) == entrance.instance:
                    del self.last_accepted[scenario]  # it is busy: batch forwarding moves on
            remaining = budget - (time.monotonic() - started)
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

    # ------------------------------------------------------------------ API keys
    def authorize(self, request: web.Request) -> web.Response | None:
        """None if the request may proceed, else the 401/429 answer."""
        if not self.config.require_keys:
            return None
        key = bearer(request.headers.get("Authorization"))
        name = self.keys.get(key) if key else None
        if name is None:
            self.metrics.requests.labels(scenario="", outcome="unauthorized").inc()
            return _failure(
                401,
                "missing or invalid API key: send Authorization: Bearer <key>",
                "invalid_request_error",
                "invalid_api_key",
            )
        if self.config.rate_limit > 0:
            now = time.monotonic()
            bucket = self.buckets.setdefault(
                name,
                TokenBucket(
                    self.config.rate_limit, self.config.rate_burst, self.config.rate_burst, now
                ),
            )
            if not bucket.take(now):
                self.metrics.requests.labels(scenario="", outcome="rate_limited").inc()
                return _failure(
                    429,
                    f"rate limit of {self.config.rate_limit:g} requests/s for key {name!r} exceeded",
                    "rate_limit_exceeded",
                    "rate_limited",
                    retry_after=f"{max(bucket.retry_after(), 0.001):.3f}",
                )
        return None

    # ------------------------------------------------------------------ handlers
    async def completions(self, request: web.Request, chat: bool) -> web.StreamResponse:
        denied = self.authorize(request)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(BadRequest("the request body is not valid JSON"))
        try:
            completion = parse_completion(
                body, chat, self.config.max_prompt_chars, self.config.max_tokens_limit
            )
        except BadRequest as exc:
            return _error(exc)
        scenario = self._scenario(request, completion)
        routes = self.discovery.routes(scenario)
        if not routes:
            known = ", ".join(self.discovery.scenarios()) or "none"
            self.metrics.requests.labels(scenario=scenario, outcome="unknown_scenario").inc()
            return _error(
                BadRequest(
                    f"no PDGroup serves scenario {scenario!r} (known: {known})",
                    "model",
                    status=404,
                    code="model_not_found",
                )
            )
        started = time.monotonic()
        chosen = await self.forward(scenario, routes, completion)
        if isinstance(chosen, str):
            self.metrics.requests.labels(scenario=scenario, outcome="rejected").inc()
            return _failure(503, chosen, "server_busy", "no_capacity", retry_after="1")
        entrance, upstream = chosen
        flight = _Flight(self, entrance.instance, scenario, started)
        try:
            if completion.stream:
                return await self._relay_stream(request, completion, scenario, upstream, flight)
            return await self._collect(completion, scenario, upstream, flight)
        finally:
            upstream.release()
            flight.end()

    async def _relay_stream(
        self,
        request: web.Request,
        c: Completion,
        scenario: str,
        upstream: EngineStream,
        flight: _Flight,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        token_frame = _TokenFrame(_chunk(ident, created, c, _PIECE, None))
        outcome = "incomplete"
        try:
            if c.chat:
                await _send(response, _chunk(ident, created, c, {"role": "assistant"}, None))
            # each batch is what arrived in one read: one write to the client per batch
            while batch := await upstream.batch():
                frames: list[bytes] = []
                for event in batch:
                    if event["type"] == "token":
                        flight.token()
                        frames.append(token_frame(event["text"]))
                    elif event["type"] == "done":
                        final = _chunk(ident, created, c, "" if not c.chat else {}, "length")
                        final["usage"] = _usage(event)
                        final["matrixserve"] = {
                            "timings": event["timings"],
                            "instances": event["instances"],
                        }
                        frames.append(_frame(final))
                        outcome = "ok"
                        break
                    elif event["type"] == "error":
                        frames.append(_frame(_error_chunk(event["message"], event.get("code"))))
                        outcome = event.get("code", "error")
                        break
                await response.write(b"".join(frames))
                if outcome != "incomplete":
                    break
            if outcome == "incomplete":
                await _send(
                    response,
                    _error_chunk(
                        "the serving instance closed the stream early", "stream_interrupted"
                    ),
                )
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            outcome = "client_gone"
        self.metrics.requests.labels(scenario=scenario, outcome=outcome).inc()
        return response

    async def _collect(
        self,
        c: Completion,
        scenario: str,
        upstream: EngineStream,
        flight: _Flight,
    ) -> web.Response:
        text: list[str] = []
        done: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        while batch := await upstream.batch():
            for event in batch:
                if event["type"] == "token":
                    flight.token()
                    text.append(event["text"])
                elif event["type"] == "done":
                    done = event
                    break
                elif event["type"] == "error":
                    error = event
                    break
            if done or error:
                break
        if done is None:
            self.metrics.requests.labels(scenario=scenario, outcome="error").inc()
            message = error["message"] if error else "the serving instance closed the stream early"
            return _failure(
                502, message, "server_error", (error or {}).get("code", "stream_interrupted")
            )
        self.metrics.requests.labels(scenario=scenario, outcome="ok").inc()
        full = "".join(text)
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": full},
                "finish_reason": "length",
            }
            if c.chat
            else {"index": 0, "text": full, "logprobs": None, "finish_reason": "length"}
        )
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if c.chat else "text_completion",
                "created": int(time.time()),
                "model": c.model,
                "choices": [choice],
                "usage": _usage(done),
                "matrixserve": {"timings": done["timings"], "instances": done["instances"]},
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        denied = self.authorize(request)
        if denied is not None:
            return denied
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": s, "object": "model", "owned_by": "matrixserve"}
                    for s in self.discovery.scenarios()
                ],
            }
        )

    async def routes(self, request: web.Request) -> web.Response:
        """What the gateway routes by: each group's scenario, TTFT budget and open entrances, and
        where the entrances come from (``zookeeper``, or ``status`` while ZooKeeper is out)."""
        denied = self.authorize(request)
        if denied is not None:
            return denied
        with self.discovery.lock:
            groups = [
                {
                    "namespace": g.namespace,
                    "name": g.name,
                    "scenario": g.scenario,
                    "ttftMilliseconds": g.ttft_ms,
                    "ttftMillisecondsPer1kTokens": g.ttft_per_1k_ms,
                    "entrances": [
                        {"instance": e.instance, "address": e.address} for e in g.entrances
                    ],
                }
                for g in self.discovery.groups.values()
            ]
        return web.json_response({"source": self.discovery.source, "groups": groups})

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=4 * self.config.max_prompt_chars + 65536)

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self.completions(request, chat=False)

        async def chat(request: web.Request) -> web.StreamResponse:
            return await self.completions(request, chat=True)

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(
                text="ok" if self.discovery.synced.is_set() else "syncing",
                status=200 if self.discovery.synced.is_set() else 503,
            )

        app.add_routes(
            [
                web.post("/v1/completions", completions),
                web.post("/v1/chat/completions", chat),
                web.get("/v1/models", self.models),
                web.get("/v1/routes", self.routes),
                web.get("/healthz", healthz),
                web.get("/metrics", self.metrics_endpoint),
            ]
        )
        return app


class _Flight:
    """One forwarded request's share of its prefill's load, as the gateway counts it (the
    prefill's feedback, P/D-Serve §3.5): an open stream until it ends, a prompt in prefill until
    its first token, and a prefill slot until its second token (a decode has pulled the KV) or
    its end."""

    def __init__(self, gateway: Gateway, instance: str, scenario: str, started: float) -> None:
        self.gateway, self.instance, self.tokens = gateway, instance, 0
        self.scenario, self.started = scenario, started
        for counts in (gateway.open, gateway.prefilling, gateway.holding):
            counts[instance] = counts.get(instance, 0) + 1
        gateway.metrics.open_streams.inc()

    def token(self) -> None:
        self.tokens += 1
        if self.tokens == 1:
            self.gateway.prefilling[self.instance] -= 1
            self.gateway.metrics.ttft.labels(scenario=self.scenario).observe(
                time.monotonic() - self.started
            )
        elif self.tokens == 2:
            self.gateway.release_slot(self.instance)

    def end(self) -> None:
        if self.tokens < 1:
            self.gateway.prefilling[self.instance] -= 1
        if self.tokens < 2:
            self.gateway.release_slot(self.instance)
        self.gateway.open[self.instance] -= 1
        self.gateway.metrics.open_streams.dec()


def _chunk(
    ident: str, created: int, c: Completion, piece: Any, finish: str | None
) -> dict[str, Any]:
    if c.chat:
        delta = piece if isinstance(piece, dict) else {"content": piece}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": ident, "object": kind, "created": created, "model": c.model, "choices": [choice]}


def _usage(done: dict[str, Any]) -> dict[str, int]:
    prompt, completion = done["usage"]["promptTokens"], done["usage"]["completionTokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


_PIECE = "\x00piece\x00"  # stands in for a token's text in a serialised chunk


class _TokenFrame:
    """A stream's token events as SSE frames: the chunk around the text is serialised once per
    stream, and each token only has its text encoded (the same bytes ``_frame`` would make)."""

    def __init__(self, chunk: dict[str, Any]) -> None:
        # the text is the chunk's last string: whatever the client named its model, the last
        # occurrence of the stand-in is the text's place
        self.head, _, self.tail = _frame(chunk).rpartition(json.dumps(_PIECE).encode())

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text).encode() + self.tail


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(_frame(payload))


def _error(exc: BadRequest) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _failure(
    status: int, message: str, kind: str, code: str | None, retry_after: str | None = None
) -> web.Response:
    """An OpenAI-style error response."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)


def _error_chunk(message: str, code: str | None) -> dict[str, Any]:
    """The last SSE chunk of a stream that failed after it started."""
    return {"error": {"message": message, "type": "server_error", "code": code}}
