"""The engine's HTTP surface (aiohttp). Engine API, health, metrics and fault injection.

==============================  =============================================================
``POST /v1/generate``           entrance (prefill, colocated): accept -> SSE stream; busy -> 429
``POST /v1/decode``             decode (called by a prefill): pull KV, then SSE tokens; full -> 429
``POST /v1/kv/{id}/pull``       prefill: KV metadata for a decode's pull
``POST /v1/kv/{id}/release``    prefill: the decode has the KV; free the slot
``POST /v1/link/handshake``     link verification between peers (device k <-> device k)
``POST /v1/probe``              link probing: dummy transfer, tells saturated from broken
``POST /v1/expert/forward``     expert server role: one expert's FFN for N tokens
``POST /v1/attention/step``     attention client role: one decode step with A2E/E2A hops
``POST|DELETE /v1/faults``      inject / heal: die-down, link-down, slow, hang, hbm-error
``GET /healthz`` ``/readyz``    liveness (hangs with the engine), readiness (serving)
``GET /metrics`` ``/v1/info``   Prometheus; identity and state
==============================  =============================================================

Stream events are ``data: <json>`` lines with a ``type`` of ``token``, ``done`` or ``error``.
Errors before a stream starts are JSON ``{"error": {"code", "message"}}`` with a 4xx/5xx status.
The bodies and events are :mod:`matrixserve.api.engine_protocol`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from enginestub import calibration as cal
from enginestub.engine.core import Engine
from enginestub.fabric import link_bandwidth
from matrixserve.api.engine_protocol import (
    EngineError,
    Event,
    GenerateRequest,
    parse_decode,
    sse_data,
)

log = logging.getLogger("enginestub.engine")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HandshakeCheck = Callable[[dict[str, Any]], dict[str, Any]]


def _error(exc: EngineError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError):
        raise EngineError(400, "invalid_json", "the body is not valid JSON") from None


def _bounded(body: Any, key: str, limit: int) -> int:
    """A body's positive integer field, at most ``limit``."""
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, int) or value < 1 or value > limit:
        raise EngineError(400, "invalid_request", f"{key} must be an integer in 1..{limit}")
    return value


async def _stream(request: web.Request, events: AsyncIterator[Event]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        async for event in events:
            await response.write(sse_data(event))
    except (ConnectionResetError, asyncio.CancelledError):
        await events.aclose()  # type: ignore[attr-defined]
        raise
    with contextlib.suppress(ConnectionResetError):  # the client left after the last event
        await response.write_eof()
    return response


def build_app(
    engine: Engine, handshake: HandshakeCheck | None = None, ready: Callable[[], bool] | None = None
) -> web.Application:
    cfg = engine.config

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/v1/faults":  # the management path stays usable, to heal a hang
            await engine.wait_not_hung()
        try:
            return await handler(request)
        except EngineError as exc:
            return _error(exc)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        ok = engine.serving and (ready() if ready is not None else True)
        return web.json_response(engine.health(), status=200 if ok else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(engine.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def info(_: web.Request) -> web.Response:
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
                "deviceStatusFile": str(cfg.device_status_file or ""),
                "tp": cfg.tp,
                "ep": cfg.ep,
                "maxBatch": cfg.max_batch,
                "timeScale": cfg.time_scale,
                "kvPlane": str(cfg.kv_plane),
                "kvCapacityBytes": cfg.kv_capacity_bytes,
                "weightsBytes": cfg.weights_bytes,
                "loadSeconds": engine.load_seconds,
                "health": engine.health(),
            }
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        req = GenerateRequest.parse(
            await _json(request), cfg.max_prompt_tokens, cfg.max_output_tokens
        )
        ticket = engine.admit_prefill(req)
        return await _stream(request, engine.generate(ticket))

    async def decode(request: web.Request) -> web.StreamResponse:
        req, prefill = parse_decode(
            await _json(request), cfg.max_prompt_tokens, cfg.max_output_tokens
        )
        engine.admit_decode(req)
        return await _stream(request, engine.decode(req, prefill))

    async def kv_pull(request: web.Request) -> web.Response:
        return web.json_response(engine.kv_pull_meta(request.match_info["rid"]))

    async def kv_release(request: web.Request) -> web.Response:
        body = await _json(request)
        engine.kv_release(
            request.match_info["rid"],
            float(body.get("bytes", 0)) if isinstance(body, dict) else 0.0,
        )
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

    async def probe(request: web.Request) -> web.Response:
        """xDeepServe §6.1: a dummy transfer tells a saturated peer from a broken link."""
        body = await _json(request)
        peer = body.get("peer") if isinstance(body, dict) else None
        nbytes = float(body.get("bytes", 1 << 20)) if isinstance(body, dict) else 1 << 20
        if not isinstance(peer, str) or ":" not in peer:
            raise EngineError(400, "invalid_request", "peer must be host:port")
        peer_ips = body.get("peerRoceIps") or []
        down = [ip for ip in peer_ips if ip in engine.device_links_down]
        if down:
            return web.json_response(
                {"peer": peer, "state": "broken", "reason": f"link down to {', '.join(down)}"}
            )
        try:
            response = await engine.http.get(f"http://{peer}/v1/info", timeout=2.0)
            flows = (
                int(response.json()["health"].get("kvEgressFlows", 0))
                if response.status_code == 200
                else 0
            )
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return web.json_response(
                {"peer": peer, "state": "broken", "reason": f"unreachable: {type(exc).__name__}"}
            )
        link = link_bandwidth(cfg.kv_plane, same_node=False) * len(cfg.dies)
        # The dummy transfer is one more flow out of the peer and one more into this instance;
        # the share it gets from the model (not from the wall clock, whose jitter on a loaded
        # machine is multiplied by the time scale) tells a saturated peer from a free one.
        cap = link / (flows + 1)
        share = engine.kv_ingress.share_for(cap)  # max-min fair beside the running transfers
        alone = nbytes / link
        took = await engine.kv_ingress.consume(nbytes, cap=cap)
        state = "saturated" if share < link / 2 else "ok"
        return web.json_response(
            {
                "peer": peer,
                "state": state,
                "seconds": took,
                "aloneSeconds": alone,
                "shareOfLink": share / link,
            }
        )

    async def expert_forward(request: web.Request) -> web.Response:
        tokens = _bounded(await _json(request), "tokens", 1_000_000)
        engine.require_role("expert")
        engine.check_serving()
        model = cfg.model
        layers = model.moe.moe_layers if model.moe else model.layers
        flops = 2.0 * tokens * model.expert_params_per_layer * layers
        work = (
            flops / (cal.DIE_INT8_OPS * len(cfg.dies) * 0.8) * engine.slow_factor
        )  # [design] T10 ~80% GEMM
        seconds = await engine.compute.consume(work)
        return web.json_response({"tokens": tokens, "seconds": seconds})

    async def attention_step(request: web.Request) -> web.Response:
        batch = _bounded(await _json(request), "batch", 100_000)
        engine.require_role("attention")
        engine.check_serving()
        layers = cfg.model.moe.moe_layers if cfg.model.moe else 0
        hops = layers * (
            cal.MOE_ATTENTION_A2E_SECONDS + cal.MOE_ATTENTION_E2A_SECONDS
        )  # 000: A2E/E2A
        step = await engine.compute.consume(hops * engine.slow_factor)
        return web.json_response({"batch": batch, "seconds": step, "a2eE2aSeconds": hops})

    async def faults(request: web.Request) -> web.Response:
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
            raise EngineError(400, "invalid_fault", 'body must be {"kind": ..., ...}')
        if request.method == "DELETE":
            return web.json_response(engine.heal(body["kind"]))
        return web.json_response(engine.inject(body["kind"], body), status=201)

    app = web.Application(middlewares=[errors], client_max_size=1 << 20)
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/metrics", metrics),
            web.get("/v1/info", info),
            web.post("/v1/generate", generate),
            web.post("/v1/decode", decode),
            web.post("/v1/kv/{rid}/pull", kv_pull),
            web.post("/v1/kv/{rid}/release", kv_release),
            web.post("/v1/link/handshake", link_handshake),
            web.post("/v1/probe", probe),
            web.post("/v1/expert/forward", expert_forward),
            web.post("/v1/attention/step", attention_step),
            web.post("/v1/faults", faults),
            web.delete("/v1/faults", faults),
        ]
    )
    return app
