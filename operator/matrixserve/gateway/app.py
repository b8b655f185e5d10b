"""The gateway's HTTP server: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streaming
and not), ``/v1/models``, ``/v1/routes`` (what it routes by), ``/healthz``, ``/metrics``.

P/D-Serve §3.5: a request is routed by its scenario to the groups serving it, forwarded on demand
to a prefill entrance that accepts within its TTFT budget (:mod:`.forwarder`), and the accepting
prefill's stream (decode -> prefill -> gateway), read through the gateway's pooled engine client
(:mod:`.upstream`), is relayed as OpenAI chunks (:mod:`.openai`). A stream outlives what serves
it: a decode lost mid-stream is replaced behind the prefill, a lost entrance by the forwarder
(another entrance takes the stream on where its client is); the client's stream ends with an
error chunk and ``[DONE]`` only when neither can. API keys: :mod:`.auth`.

Hardened against its clients: a body is decoded here and validated in the domain, so whatever bytes
a client sends get an OpenAI-shaped 4xx, never a 500; metric labels take known values only, so no
request can break ``/metrics`` or grow its series; a request whose client leaves is cancelled
(``handler_cancellation``, set where the server is run) and its legs give their engine streams back,
so the engines stop working on it, streamed or not; ``n``, lists of prompts, ``stop`` and
``stream_options.include_usage`` are honoured. A prefill's refusal of the request itself is the
client's 400 (``context_length_exceeded`` for a prompt the engines do not take), never a 503; an
unexpected failure is counted ``internal_error``, not ``client_gone``; chat answers' ids start
``chatcmpl-``.

A gateway replica going away loses nothing: while :meth:`Gateway.drain` is in effect
(``__main__`` on SIGTERM, for ``--drain-seconds``) ``/healthz`` answers 503 ``draining`` and every
request is still served, its answer with ``Connection: close``.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from matrixserve import httpserving
from matrixserve.api.engine_protocol import Event
from matrixserve.domain.gateway.completions import (
    BadRequest,
    Completion,
    parse_completion,
    parse_json_body,
)
from matrixserve.domain.gateway.labels import UNKNOWN_SCENARIO, error_code
from matrixserve.gateway import openai
from matrixserve.gateway.auth import ApiKeys
from matrixserve.gateway.config import GatewayConfig, GatewayMetrics
from matrixserve.gateway.discovery import Discovery
from matrixserve.gateway.forwarder import Forwarder, Leg, Reader


class Gateway:
    def __init__(self, discovery: Discovery, config: GatewayConfig) -> None:
        self.discovery = discovery
        self.config = config
        self.metrics = GatewayMetrics()
        self.metrics.zookeeper_connected.set_function(lambda: float(discovery.zk_connected))
        discovery.on_session_lost = self.metrics.zookeeper_sessions_lost.inc
        self.forwarder = forwarder = Forwarder(discovery, config, self.metrics)
        self.metrics.in_prefill.set_function(lambda: float(sum(forwarder.prefilling.values())))
        self.metrics.slots_held.set_function(lambda: float(sum(forwarder.holding.values())))
        connections = self.metrics.engine_connections
        connections.labels(state="idle").set_function(
            lambda: float(forwarder.engine_connections()["idle"])
        )
        connections.labels(state="in_use").set_function(
            lambda: float(forwarder.engine_connections()["in_use"])
        )
        self.keys = ApiKeys(config, self.metrics)
        # Set on SIGTERM (``__main__``): /healthz answers 503 so that the Service's endpoints and
        # load balancers drop this replica, while it still serves whatever reaches it; each
        # answer then says ``Connection: close``, so clients' pooled connections move to a
        # replica that stays.
        self.draining = False

    def drain(self) -> None:
        self.draining = True

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
            completion = await self._read(request, chat)
        except BadRequest as exc:
            self.metrics.requests.labels(scenario=UNKNOWN_SCENARIO, outcome="bad_request").inc()
            return openai.error_response(exc)
        scenario = self._scenario(request, completion)
        routes = self.discovery.routes(scenario)
        if not routes:
            self.metrics.requests.labels(
                scenario=UNKNOWN_SCENARIO, outcome="unknown_scenario"
            ).inc()
            return self._no_such_model(scenario)
        # from here the scenario is one this gateway routes: a known label value
        outcome = "client_gone"  # unless it gets further: a cancellation is its client leaving
        try:
            try:
                legs = await self.forwarder.forward_all(scenario, routes, completion)
            except BadRequest as refused:  # a prefill refused the request itself: final
                outcome = "bad_request"
                return openai.error_response(refused)
            if isinstance(legs, str):
                outcome = "rejected"
                return openai.failure(503, legs, "server_busy", "no_capacity", retry_after="1")
            reader = Reader(legs)
            try:
                if completion.stream:
                    streamed, outcome = await self._relay_stream(request, completion, reader)
                    return streamed
                answered, outcome = await self._collect(completion, reader)
                return answered
            finally:  # every leg's stream and prefill share back, whatever happened
                reader.close()
        except ConnectionError:
            raise  # the client went away: client_gone
        except Exception:
            outcome = "internal_error"  # answered 500 by the serving's middleware
            raise
        finally:
            self.metrics.requests.labels(scenario=scenario, outcome=outcome).inc()

    async def _read(self, request: web.Request, chat: bool) -> Completion:
        """The request's body as a validated completion; :class:`BadRequest` otherwise. A body
        over the size limit raises aiohttp's 413, rendered by the app's error middleware."""
        try:
            raw = await request.read()
        except RequestPayloadError:
            raise BadRequest(
                "the request body could not be read: it is not in its Content-Encoding, or its "
                "chunked framing is broken",
                code="invalid_body",
            ) from None
        return parse_completion(
            parse_json_body(raw, request.charset),
            chat,
            self.config.max_prompt_chars,
            self.config.max_tokens_limit,
            self.config.max_choices,
        )

    def _no_such_model(self, name: str) -> web.Response:
        known = ", ".join(self.discovery.scenarios()) or "none"
        return openai.error_response(
            BadRequest(
                f"no PDGroup serves scenario {name[:100]!r} (known: {known})",
                "model",
                status=404,
                code="model_not_found",
            )
        )

    async def _relay_stream(
        self, request: web.Request, c: Completion, reader: Reader
    ) -> tuple[web.StreamResponse, str]:
        """The choices' streams relayed as one SSE stream; the response and its outcome."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        ident, created = openai.completion_id(c), int(time.time())
        token_frames = {
            leg.index: openai.TokenFrame(
                openai.chunk(ident, created, c, openai.PIECE, None, leg.index)
            )
            for leg in reader.legs
        }
        failed: Event | None = None
        failed_on: dict[str, Any] | None = None  # the instances the failed choice was on
        try:
            if c.chat:
                role = {"role": "assistant"}
                await response.write(
                    b"".join(
                        openai.frame(openai.chunk(ident, created, c, role, None, leg.index))
                        for leg in reader.legs
                    )
                )
            # each batch is what arrived in one read: one write to the client per round
            while failed is None and (batches := await reader.next()):
                frames: list[bytes] = []
                for leg, batch in batches:
                    token_frame = token_frames[leg.index]
                    frames += [token_frame(piece) for piece in leg.take(batch)]
                    if leg.error is not None:
                        failed = leg.error
                        failed_on = openai.failed_on(leg.error, leg.instance)
                        break
                    if leg.finish is not None:
                        account = openai.served(leg.done, leg.instance, leg.moves)
                        last = openai.final_chunk(ident, created, c, leg.index, leg.finish, account)
                        frames.append(openai.frame(last))
                        leg.close()  # now: at a stop string, the engines stop there
                await response.write(b"".join(frames))
            if failed is not None:
                outcome = error_code(failed.get("code"))
                chunk = openai.error_chunk(_message(failed), outcome, failed_on)
                await response.write(openai.frame(chunk))
            else:
                outcome = "ok"
                if c.include_usage:
                    totals = _usage(c, reader.legs)
                    await response.write(
                        openai.frame(openai.usage_chunk(ident, created, c, totals))
                    )
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            outcome = "client_gone"
        return response, outcome

    async def _collect(self, c: Completion, reader: Reader) -> tuple[web.Response, str]:
        """The choices read whole: the plain answer (or a 502 if one failed) and its outcome."""
        texts: dict[int, list[str]] = {leg.index: [] for leg in reader.legs}
        while batches := await reader.next():
            for leg, batch in batches:
                texts[leg.index] += leg.take(batch)
                if leg.error is not None:
                    code = error_code(leg.error.get("code"))
                    return openai.failure(502, _message(leg.error), "server_error", code), code
                if leg.ended:
                    leg.close()  # now: at a stop string, the engines stop there
        answers = [
            openai.Answer(
                leg.index,
                "".join(texts[leg.index]),
                leg.finish or "stop",
                openai.served(leg.done, leg.instance, leg.moves),
            )
            for leg in reader.legs
        ]
        return web.json_response(openai.completion(c, answers, _usage(c, reader.legs))), "ok"

    async def models(self, request: web.Request) -> web.Response:
        denied = self.keys.authorize(request)
        if denied is not None:
            return denied
        return web.json_response(
            {"object": "list", "data": [openai.model(s) for s in self.discovery.scenarios()]}
        )

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: a scenario this gateway routes, else 404."""
        denied = self.keys.authorize(request)
        if denied is not None:
            return denied
        name = request.match_info["model"]
        if name not in self.discovery.scenarios():
            return self._no_such_model(name)
        return web.json_response(openai.model(name))

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

    def runner(self, **server: Any) -> web.AppRunner:
        """The gateway's app as it is served (``__main__``, and the tests that serve it): a
        client that leaves cancels its request's handler (``handler_cancellation``: aiohttp >= 3.9
        does not by default), which gives the request's engine streams back, so the engines stop
        working on a request nobody waits for, streamed or not. ``server``: the server's other
        settings."""
        return web.AppRunner(self.app(), access_log=None, handler_cancellation=True, **server)

    def app(self) -> web.Application:
        app = httpserving.application(client_max_size=4 * self.config.max_prompt_chars + 65536)

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self.completions(request, chat=False)

        async def chat(request: web.Request) -> web.StreamResponse:
            return await self.completions(request, chat=True)

        async def healthz(_: web.Request) -> web.Response:
            if self.draining:
                return web.Response(text="draining", status=503)
            return web.Response(
                text="ok" if self.discovery.synced.is_set() else "syncing",
                status=200 if self.discovery.synced.is_set() else 503,
            )

        async def close_while_draining(_: web.Request, response: web.StreamResponse) -> None:
            # before the head is written: the client is told, and the connection is closed
            # after this answer
            if self.draining:
                response.headers[hdrs.CONNECTION] = "close"
                response.force_close()

        app.on_response_prepare.append(close_while_draining)
        app.add_routes(
            [
                web.post("/v1/completions", completions),
                web.post("/v1/chat/completions", chat),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.get("/v1/routes", self.routes),
                web.get("/healthz", healthz),
                web.get("/metrics", self.metrics_endpoint),
            ]
        )
        return app


def _usage(c: Completion, legs: list[Leg]) -> dict[str, int]:
    """A request's usage, as OpenAI counts it: each prompt once, every choice's tokens."""
    return openai.usage(sum(p.tokens for p in c.prompts), sum(leg.tokens for leg in legs))


def _message(error: Event) -> str:
    """An engine's error message as a client gets it (an engine's text is not trusted to be
    a string, or short)."""
    message = error.get("message")
    return message[:500] if isinstance(message, str) else "the serving instance failed"
