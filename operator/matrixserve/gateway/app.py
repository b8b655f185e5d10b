"""The gateway's HTTP server: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streaming
and not), ``/v1/models``, ``/v1/routes`` (what it routes by), ``/healthz``, ``/metrics``.

P/D-Serve §3.5: a request is routed by its scenario to the groups serving it, forwarded on demand
to a prefill entrance that accepts within its TTFT budget (:mod:`.forwarder`), and the accepting
prefill's stream (decode -> prefill -> gateway), read through the gateway's pooled engine client
(:mod:`.upstream`), is relayed as OpenAI chunks (:mod:`.openai`); a decode failing mid-stream
ends the client's stream with an error chunk and ``[DONE]``. API keys: :mod:`.auth`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from matrixserve.api.engine_protocol import Event
from matrixserve.domain.forwarding import BadRequest, Completion, Policy, parse_completion
from matrixserve.gateway import openai
from matrixserve.gateway.auth import ApiKeys
from matrixserve.gateway.discovery import Discovery
from matrixserve.gateway.forwarder import Flight, Forwarder
from matrixserve.gateway.upstream import EngineStream


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
        self.forwarder = Forwarder(discovery, config, self.metrics)
        self.keys = ApiKeys(config, self.metrics)

    async def start(self) -> None:
        await self.forwarder.start()

    async def close(self) -> None:
        await self.forwarder.close()

    def _scenario(self, request: web.Request, completion: Completion) -> str:
        return request.headers.get("X-MatrixServe-Scenario") or completion.model

    # ------------------------------------------------------------------ handlers
    async def completions(self, request: web.Request, chat: bool) -> web.StreamResponse:
        denied = self.keys.authorize(request)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return openai.error_response(BadRequest("the request body is not valid JSON"))
        try:
            completion = parse_completion(
                body, chat, self.config.max_prompt_chars, self.config.max_tokens_limit
            )
        except BadRequest as exc:
            return openai.error_response(exc)
        scenario = self._scenario(request, completion)
        routes = self.discovery.routes(scenario)
        if not routes:
            known = ", ".join(self.discovery.scenarios()) or "none"
            self.metrics.requests.labels(scenario=scenario, outcome="unknown_scenario").inc()
            return openai.error_response(
                BadRequest(
                    f"no PDGroup serves scenario {scenario!r} (known: {known})",
                    "model",
                    status=404,
                    code="model_not_found",
                )
            )
        started = time.monotonic()
        chosen = await self.forwarder.forward(scenario, routes, completion)
        if isinstance(chosen, str):
            self.metrics.requests.labels(scenario=scenario, outcome="rejected").inc()
            return openai.failure(503, chosen, "server_busy", "no_capacity", retry_after="1")
        entrance, upstream = chosen
        flight = Flight(self.forwarder, entrance.instance, scenario, started)
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
        flight: Flight,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        token_frame = openai.TokenFrame(openai.chunk(ident, created, c, openai.PIECE, None))
        outcome = "incomplete"
        try:
            if c.chat:
                role = openai.chunk(ident, created, c, {"role": "assistant"}, None)
                await response.write(openai.frame(role))
            # each batch is what arrived in one read: one write to the client per batch
            while batch := await upstream.batch():
                frames: list[bytes] = []
                for event in batch:
                    if event["type"] == "token":
                        flight.token()
                        frames.append(token_frame(event["text"]))
                    elif event["type"] == "done":
                        frames.append(openai.frame(openai.final_chunk(ident, created, c, event)))
                        outcome = "ok"
                        break
                    elif event["type"] == "error":
                        frames.append(
                            openai.frame(openai.error_chunk(event["message"], event.get("code")))
                        )
                        outcome = event.get("code", "error")
                        break
                await response.write(b"".join(frames))
                if outcome != "incomplete":
                    break
            if outcome == "incomplete":
                cut = openai.error_chunk(
                    "the serving instance closed the stream early", "stream_interrupted"
                )
                await response.write(openai.frame(cut))
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
        flight: Flight,
    ) -> web.Response:
        text: list[str] = []
        done: Event | None = None
        error: Event | None = None
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
            return openai.failure(
                502, message, "server_error", (error or {}).get("code", "stream_interrupted")
            )
        self.metrics.requests.labels(scenario=scenario, outcome="ok").inc()
        return web.json_response(openai.completion(c, "".join(text), done))

    async def models(self, request: web.Request) -> web.Response:
        denied = self.keys.authorize(request)
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
        denied = self.keys.authorize(request)
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
