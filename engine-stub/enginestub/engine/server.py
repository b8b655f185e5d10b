"""The engine's HTTP surface (aiohttp). Engine API, health, metrics and fault injection.

==============================  =============================================================
``POST /v1/generate``           entrance (prefill, colocated): accept -> SSE stream; busy -> 429
``POST /v1/decode``             decode (called by a prefill): pull KV, then SSE tokens; full -> 429
``POST /v1/kv/{id}/pull``       prefill: KV metadata for a decode's pull
``POST /v1/kv/{id}/release``    prefill: the decode has the KV; free the slot
``POST /v1/link/handshake``     link verification between peers (device k <-> device k)
``POST /v1/link/probe``         decode: a prefill's dummy payload over its sub-links
``POST /v1/fork``               a fork source: broadcast weights and compiled artefacts to the
                                calling warm target; answered when the transfer ends
``POST /v1/expert/forward``     expert server role: one client's iteration, the tokens per
                                layer, microbatch and expert (:mod:`.experts`); 409
                                ``expert_not_held`` names experts it does not hold enabled
``POST /v1/attention/step``     attention client (the role, or a group's decode with an
                                expert pool): its iteration for ``batch`` requests as
                                predicted over the map in force, no message sent; or,
                                with ``send``, made through the servers as an iteration
                                of its own (a forward probe: ``tokensPerRequest``)
                                (:mod:`.attention`)
``POST|DELETE /v1/faults``      inject / heal: die-down, link-down, slow, hang, hbm-error
``GET /healthz`` ``/readyz``    liveness (answers while hung: alive, no tokens), readiness
                                (serving: not faulty, not removed; no stuck slot)
``GET /metrics`` ``/v1/info``   Prometheus; identity and state
==============================  =============================================================

Stream events are ``data: <json>`` lines with a ``type`` of ``token``, ``done`` or ``error``.
Errors before a stream starts are OpenAI-shaped JSON ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx/5xx status (429 and 503 with ``Retry-After``); malformed bodies (too large,
not UTF-8, a bad content encoding, not JSON, nested too deeply, not an object, fields of the
wrong type) are 4xx, never 500. The bodies and events are :mod:`matrixserve.api.engine_protocol`'s.

Every exchange that takes a prefill slot or a decode place holds it in a ``with`` block around
the whole exchange, response included (given back exactly once, whatever ends it), and a caller that
goes away cancels its handler (``handler_cancellation``), so its slot, KV and any decode it had
started are given back at once, not at the end of its tokens. A stream ended because this instance
was logically removed ends with its ``error`` event, code ``instance_removed``.

A worker of an instance of several pods (rank >= 1, :mod:`.ranks`) serves none of the engine API:
every request but health, metrics, info and fault injection is refused 409 ``not_the_leader``,
naming its leader.

A hung serving loop (the hang tier) holds the requests that need it (generate, decode,
KV, expert, attention) until it runs again or its hang is declared (then 503 ``engine_hung``);
health, metrics, info, link handshakes and probes (the transport's, not the loop's) and fault
injection answer meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from enginestub.engine.attention import check_step
from enginestub.engine.core import Engine
from enginestub.engine.experts import check_forward
from enginestub.engine.fork import FORK_PATH
from enginestub.engine.linkprobe import PROBE_PATH, Probe
from enginestub.engine.ranks import refused
from enginestub.engine.streams import OpenStreams
from matrixserve import httpserving
from matrixserve.api.engine_protocol import (
    EngineError,
    Event,
    GenerateRequest,
    error_event,
    parse_decode,
    sse_data,
)

log = logging.getLogger("enginestub.engine")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HandshakeCheck = Callable[[dict[str, Any]], dict[str, Any]]


MAX_BODY_BYTES = 1 << 20
PROBE_MAX_BYTES = float(1 << 30)  # a dummy transfer; a larger one would only hog the link
PROBE_MAX_DEVICES = 64  # sub-links of one pair: an instance's dies
# Seconds a refused caller should wait: a busy engine (429) frees a slot within a prefill or a
# few decode steps; one not serving (503) is loading or faulty for longer.
RETRY_AFTER = {429: "1", 503: "5"}
_JSON_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})  # RFC 8259 §8.1: UTF-8


class _UnreadBody(EngineError):
    """A body that could not be read whole: the connection's framing is not to be trusted, so
    the answer closes it (a keep-alive client would otherwise send into the rest of it)."""


def error_response(exc: EngineError) -> web.Response:
    retry = RETRY_AFTER.get(exc.status)
    response = web.json_response(
        exc.body(), status=exc.status, headers={"Retry-After": retry} if retry else None
    )
    if isinstance(exc, _UnreadBody):
        response.force_close()
    return response


def _not_json(_: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


async def _read(request: web.Request) -> bytes:
    """The whole body, at most :data:`MAX_BODY_BYTES`, as its Content-Encoding says; or a 4xx
    that closes the connection."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _UnreadBody(
            413, "body_too_large", f"the body is over {MAX_BODY_BYTES} bytes"
        ) from None
    except RequestPayloadError:  # e.g. Content-Encoding: gzip on a body that is not
        raise _UnreadBody(
            400, "invalid_body", "the body cannot be decoded as its Content-Encoding says"
        ) from None


async def _json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, read defensively (:func:`_read`): UTF-8, finite numbers, any
    nesting the parser takes; every way it can be malformed is a 4xx."""
    raw = await _read(request)  # whole first: a refusal leaves no unread body behind it
    charset = request.charset
    if charset and charset.lower() not in _JSON_CHARSETS:
        raise EngineError(415, "unsupported_charset", f"JSON bodies are UTF-8, not {charset!r}")
    try:
        body = json.loads(raw.decode(), parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise EngineError(400, "invalid_json", "the JSON body is nested too deeply") from None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise EngineError(400, "invalid_json", "the body is not valid UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise EngineError(400, "invalid_json", "the body must be a JSON object")
    return body


def _number(body: dict[str, Any], key: str, low: float, high: float, default: float) -> float:
    """A body's numeric field (not a boolean) in ``low..high``, ``default`` when absent."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise EngineError(
            400, "invalid_request", f"{key} must be a number in {low:g}..{high:g}", param=key
        )
    return float(value)


async def _stream(
    request: web.Request, events: AsyncGenerator[Event, None], streams: OpenStreams
) -> web.StreamResponse:
    """The events as an SSE response. The generator is closed on every way out, started or
    not (the caller's slot is given back by its own ``with`` block around this); a stream
    ``streams`` ends (this instance removed) ends with its error event, or, not started yet,
    as that error's 503."""
    async with contextlib.aclosing(events):
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(request)
            async for event in events:
                await response.write(sse_data(event))
            await response.write_eof()
        except ConnectionError:
            pass  # the caller is gone (aiohttp takes the unfinished response quietly)
        except asyncio.CancelledError:
            ending = streams.ended()
            if ending is None:
                raise  # the caller gone (handler cancellation), or the server stopping
            if not response.prepared:
                raise EngineError(503, ending["code"], ending["message"]) from None
            with contextlib.suppress(ConnectionError):
                await response.write(sse_data(ending))
                await response.write_eof()
        except Exception:
            if not response.prepared:
                raise  # the middleware answers it
            log.exception("stream for %s failed", request.path)  # a fault of ours mid-stream
            with contextlib.suppress(ConnectionError):
                await response.write(sse_data(error_event("internal_error", "the engine failed")))
                await response.write_eof()
        return response


ExpertCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def build_app(
    engine: Engine,
    handshake: HandshakeCheck | None = None,
    ready: Callable[[], bool] | None = None,
    expert_forward: ExpertCall | None = None,
    attention_step: ExpertCall | None = None,
) -> web.Application:
    cfg = engine.config

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except EngineError as exc:
            return error_response(exc)

    def loop_bound(handler: Handler) -> Handler:
        """A handler that needs the serving loop: it waits while the loop is hung (until it
        runs again, or its hang is declared and admission refuses)."""

        async def bound(request: web.Request) -> web.StreamResponse:
            await engine.wait_serving_loop()
            return await handler(request)

        return bound

    def leader_only(handler: Handler) -> Handler:
        """The engine API: a worker refuses it (its leader serves the instance)."""
        if cfg.rank == 0:
            return handler

        async def refuse(request: web.Request) -> web.StreamResponse:
            await _read(request)  # a body there is read, or refused, whole
            raise refused(cfg)

        return refuse

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        if engine.ready and (ready() if ready is not None else True):
            return web.json_response(engine.health())
        return web.json_response(
            engine.health(), status=503, headers={"Retry-After": RETRY_AFTER[503]}
        )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(engine.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def info(_: web.Request) -> web.Response:
        cfg = engine.config  # the instance's now (a leader's RoCE IPs become every rank's)
        return web.json_response(
            {
                "instance": cfg.instance,
                "pod": cfg.instance,
                "namespace": cfg.pod_namespace,
                "role": engine.role,
                "model": cfg.model.name,
                "node": cfg.node,
                "superpod": cfg.superpod,
                "dies": cfg.dies,
                "roceIps": cfg.roce_ips,
                "npus": cfg.npus,
                "rank": cfg.rank,
                "ranks": cfg.ranks,
                "instanceDies": cfg.instance_dies,
                "deviceStatusFile": str(cfg.device_status_file or ""),
                "tp": cfg.tp,
                "ep": cfg.ep,
                "maxBatch": cfg.max_batch,
                "timeScale": cfg.time_scale,
                "kvPlane": str(cfg.kv_plane),
                "kvCapacityBytes": cfg.kv_capacity_bytes,
                "weightsBytes": cfg.weights_bytes,
                "loadSeconds": engine.load_seconds,
                "forkWindows": list(engine.forks.windows),
                "health": engine.health(),
            }
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        req = GenerateRequest.parse(
            await _json(request), cfg.max_prompt_tokens, cfg.max_output_tokens
        )
        with engine.admit_prefill(req) as ticket, engine.streams.track():
            return await _stream(request, engine.generate(ticket), engine.streams)

    async def decode(request: web.Request) -> web.StreamResponse:
        req, prefill = parse_decode(
            await _json(request), cfg.max_prompt_tokens, cfg.max_output_tokens
        )
        with engine.admit_decode(req) as hold, engine.streams.track():
            return await _stream(request, engine.decode(hold, req, prefill), engine.streams)

    async def kv_pull(request: web.Request) -> web.Response:
        await _read(request)  # no body is needed; one there is read, or refused, whole
        return web.json_response(engine.kv_pull_meta(request.match_info["rid"]))

    async def kv_release(request: web.Request) -> web.Response:
        _number(await _json(request), "bytes", 0, math.inf, 0)  # the prefill counts its own
        engine.kv_release(request.match_info["rid"])
        return web.json_response({"released": True})

    async def link_handshake(request: web.Request) -> web.Response:
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("instance"), str):
            raise EngineError(400, "invalid_request", "handshake needs instance, role and roceIps")
        if handshake is not None:
            return web.json_response(handshake(body))
        return web.json_response(
            {"instance": cfg.instance, "role": engine.role, "roceIps": cfg.roce_ips}
        )

    async def link_probe(request: web.Request) -> web.Response:
        """Link probing (xDeepServe §6.1): a prefill's dummy payload over the sub-links it names;
        the fabric model says when it lands, or that a sub-link is down."""
        body = await _json(request)
        ips = body.get("roceIps")
        if (
            not isinstance(body.get("instance"), str)
            or not isinstance(ips, list)
            or not 0 < len(ips) <= PROBE_MAX_DEVICES
            or not all(isinstance(ip, str) for ip in ips)
        ):
            raise EngineError(
                400,
                "invalid_request",
                f"a probe needs instance and roceIps (1..{PROBE_MAX_DEVICES} strings)",
                "roceIps",
            )
        # A sub-link is named by its decode die (kvmapping: one per decode die of the pair).
        devices = body.get("devices", list(range(len(cfg.roce_ips))))
        if not isinstance(devices, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < PROBE_MAX_DEVICES
            for k in devices
        ):
            raise EngineError(
                400, "invalid_request", "devices must be sub-link (decode die) indices", "devices"
            )
        tp = body.get("tp")
        if tp is not None and (
            not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= len(ips)
        ):
            raise EngineError(
                400, "invalid_request", "tp must be an integer from 1 to the roceIps given", "tp"
            )
        probe = Probe(
            body["instance"],
            tuple(ips),
            tuple(sorted(set(devices))),
            _number(body, "bytes", 1, PROBE_MAX_BYTES, float(1 << 20)),
            int(_number(body, "egressFlows", 0, 1_000_000, 0)),
            tp,
        )
        engine.require_role("decode", "attention")  # the side KV lands on
        return web.json_response(engine.receiver.receive(probe))

    async def npu_fork(request: web.Request) -> web.Response:
        """NPU-fork (DeepServe §6.2): a warm target asks for this instance's weights and compiled
        artefacts; the answer comes when the emulated broadcast ends. Not bound to the serving
        loop: the NPU's AICPUs move the data, its compute goes on serving."""
        return web.json_response(await engine.forks.serve(await _json(request)))

    def expert_call(
        roles: tuple[str, ...], check: Callable[[dict[str, Any]], object], call: ExpertCall | None
    ) -> Handler:
        """An expert server's or attention client's call (:mod:`.experts`, :mod:`.attention`):
        the body read whole and its shape checked, the role checked, then the call (an
        attention client may be a group's decode)."""

        async def handle(request: web.Request) -> web.Response:
            body = await _json(request)
            check(body)
            engine.require_role(*roles)
            engine.check_serving()
            if call is None:  # its pool's side is not running (an engine built without it)
                raise EngineError(503, "not_ready", f"this {engine.role} engine has no expert pool")
            return web.json_response(await call(body))

        return handle

    async def faults(request: web.Request) -> web.Response:
        if not cfg.fault_injection:  # no pod may break an engine at will
            raise EngineError(
                403,
                "fault_injection_disabled",
                "fault injection is disabled on this engine (start it with --fault-injection "
                "or ENGINE_FAULT_INJECTION=1)",
            )
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
            raise EngineError(400, "invalid_fault", 'body must be {"kind": ..., ...}')
        if request.method == "DELETE":
            return web.json_response(engine.heal(body["kind"]))
        return web.json_response(engine.inject(body["kind"], body), status=201)

    app = httpserving.application(
        middlewares=[errors],
        client_max_size=MAX_BODY_BYTES,
        # A caller gone cancels its handler: its slot, KV and the decode it
        # started are given back at once, not when its last token fails to write.
        handler_args={"handler_cancellation": True},
    )
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/metrics", metrics),
            web.get("/v1/info", info),
            web.post("/v1/generate", leader_only(loop_bound(generate))),
            web.post("/v1/decode", leader_only(loop_bound(decode))),
            web.post("/v1/kv/{rid}/pull", leader_only(loop_bound(kv_pull))),
            web.post("/v1/kv/{rid}/release", leader_only(loop_bound(kv_release))),
            web.post("/v1/link/handshake", leader_only(link_handshake)),
            web.post(PROBE_PATH, leader_only(link_probe)),
            web.post(FORK_PATH, leader_only(npu_fork)),
            web.post(
                "/v1/expert/forward",
                leader_only(loop_bound(expert_call(("expert",), check_forward, expert_forward))),
            ),
            web.post(
                "/v1/attention/step",
                leader_only(
                    loop_bound(expert_call(("attention", "decode"), check_step, attention_step))
                ),
            ),
            web.post("/v1/faults", faults),
            web.delete("/v1/faults", faults),
        ]
    )
    return app
