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
``GET /healthz`` ``/readyz``    liveness (hangs with the engine), readiness (serving, no stuck slot)
``GET /metrics`` ``/v1/info``   Prometheus; identity and state
==============================  =============================================================

Stream events are ``data: <json>`` lines with a ``type`` of ``token``, ``done`` or ``error``.
Errors before a stream starts are OpenAI-shaped JSON ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx/5xx status (429 and 503 with ``Retry-After``); malformed bodies (too large,
not UTF-8, a bad content encoding, not JSON, nested too deeply, not an object, fields of the
wrong type) are 4xx, never 500 (issue 16 finding 3). The bodies and events are
:mod:`matrixserve.api.engine_protocol`'s.

Every exchange that takes a prefill slot or a decode place holds it in a ``with`` block around
the whole exchange, response included (issue 16 finding 1), and a caller that goes away cancels
its handler (``handler_cancellation``), so its slot, KV and any decode it had started are given
back at once, not at the end of its tokens (finding 5).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from enginestub import calibration as cal
from enginestub.engine.core import Engine
from enginestub.fabric import link_bandwidth
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
# Seconds a refused caller should wait: a busy engine (429) frees a slot within a prefill or a
# few decode steps; one not serving (503) is loading or faulty for longer.
RETRY_AFTER = {429: "1", 503: "5"}
_JSON_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})  # RFC 8259 §8.1: UTF-8


class _UnreadBody(EngineError):
    """A body that could not be read whole: the connection's framing is not to be trusted, so
    the answer closes it (a keep-alive client would otherwise send into the rest of it)."""


def _error(exc: EngineError) -> web.Response:
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


def _count(body: dict[str, Any], key: str, limit: int) -> int:
    """A body's positive integer field, at most ``limit``."""
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise EngineError(
            400, "invalid_request", f"{key} must be an integer in 1..{limit}", param=key
        )
    return value


async def _stream(request: web.Request, events: AsyncGenerator[Event, None]) -> web.StreamResponse:
    """The events as an SSE response. The generator is closed on every way out, started or
    not (the caller's slot is given back by its own ``with`` block around this)."""
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
        except Exception:
            if not response.prepared:
                raise  # the middleware answers it
            log.exception("stream for %s failed", request.path)  # a fault of ours mid-stream
            with contextlib.suppress(ConnectionError):
                await response.write(sse_data(error_event("internal_error", "the engine failed")))
                await response.write_eof()
        return response


_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


def _host_port(value: Any) -> str:
    """``host:port`` of a peer engine (a name, an IPv4 or a bracketed IPv6), or a 400."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise EngineError(400, "invalid_request", "peer must be host:port", param="peer")
    return f"{host}:{int(port)}"


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
        with engine.admit_prefill(req) as ticket:
            return await _stream(request, engine.generate(ticket))

    async def decode(request: web.Request) -> web.StreamResponse:
        req, prefill = parse_decode(
            await _json(request), cfg.max_prompt_tokens, cfg.max_output_tokens
        )
        with engine.admit_decode(req) as hold:
            return await _stream(request, engine.decode(hold, req, prefill))

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

    async def probe(request: web.Request) -> web.Response:
        """xDeepServe §6.1: a dummy transfer tells a saturated peer from a broken link."""
        body = await _json(request)
        peer = _host_port(body.get("peer"))
        nbytes = _number(body, "bytes", 1, PROBE_MAX_BYTES, 1 << 20)
        peer_ips = body.get("peerRoceIps", [])
        if not isinstance(peer_ips, list) or not all(isinstance(ip, str) for ip in peer_ips):
            raise EngineError(
                400, "invalid_request", "peerRoceIps must be a list of strings", "peerRoceIps"
            )
        down = [ip for ip in peer_ips if ip in engine.device_links_down]
        if down:
            return web.json_response(
                {"peer": peer, "state": "broken", "reason": f"link down to {', '.join(down)}"}
            )
        try:
            response = await engine.http.get(f"http://{peer}/v1/info", timeout=2.0)
            flows = (
                max(int(response.json()["health"].get("kvEgressFlows", 0)), 0)
                if response.status_code == 200
                else 0
            )
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
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
        tokens = _count(await _json(request), "tokens", 1_000_000)
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
        batch = _count(await _json(request), "batch", 100_000)
        engine.require_role("attention")
        engine.check_serving()
        layers = cfg.model.moe.moe_layers if cfg.model.moe else 0
        hops = layers * (
            cal.MOE_ATTENTION_A2E_SECONDS + cal.MOE_ATTENTION_E2A_SECONDS
        )  # 000: A2E/E2A
        step = await engine.compute.consume(hops * engine.slow_factor)
        return web.json_response({"batch": batch, "seconds": step, "a2eE2aSeconds": hops})

    async def faults(request: web.Request) -> web.Response:
        if not cfg.fault_injection:  # issue 16 finding 7: no pod may break an engine at will
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
        # A caller gone cancels its handler (finding 5): its slot, KV and the decode it
        # started are given back at once, not when its last token fails to write.
        handler_args={"handler_cancellation": True},
    )
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
