"""The HTTP serving shared by the gateway and the engines (issue 16, findings 3 and 4).

**Errors (finding 3, the framework's part).** Every error aiohttp makes on its own — 404 for an
unknown path, 405 for a wrong method (its ``Allow`` header kept), 413 for a body over
``client_max_size``, 400 for a body the parser refused (bad chunk framing, bad compression),
417, any uncaught exception (500: logged with its traceback, never shown) — is answered with an
OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}`` and the same status: by
the outermost middleware of every :func:`application`, and for what escapes an application (the
parser's 400 for a malformed request line or header, the 417 of an ``Expect`` header aiohttp
checks before any middleware) by the connection's protocol when the server runs through
:func:`start`. A stream whose response has started is never written into:
an error there drops the connection, so its client sees the stream cut, not a false end.

**Slow and idle connections (finding 4).** aiohttp bounds header sizes and idle keep-alive
connections but has no read deadlines and no connection caps. :func:`start` serves an
``AppRunner`` with them, around aiohttp's own protocol (``RequestHandler``):

- a **header deadline**: a request head (line and headers) must arrive whole within
  ``header_timeout`` of its first byte — of the connection's opening for its first request — or
  the connection is closed (a slowloris sends a header a byte at a time). A head begun in the
  read that ended the request before it (pipelined) is held to it too: the parser is fed up to
  each place a message can end and asked whether one did (:class:`_ParserTap`);
- a **body deadline**: the body must arrive whole within ``body_timeout`` of its head; past it
  the handler reading it gets a 408 ``request_timeout`` and the connection is closed;
- an **idle limit**: aiohttp's keep-alive timeout, ``idle_timeout`` between requests;
- a **send deadline**: a response's write that stalls — the connection's send buffer full,
  its client reading nothing — for ``send_timeout`` is given up and the connection aborted, so
  a client that stops reading does not hold its stream (and the engine work behind it) for
  ever; a client that reads, however slowly, is never cut;
- **connection caps**: at most ``max_connections`` open at once, and ``max_connections_per_client``
  from one client address. A connection over a cap is answered at once with 503
  ``too_many_connections`` and ``Retry-After`` and closed, never read.

None of the read limits touches a request being served: a response streaming for minutes (an
engine's tokens, the gateway's SSE relay, the prefill -> decode relay) has had its head and its
body read, and only a connection waiting for its next request is idle. The gateway's pool of
connections to engines (:mod:`matrixserve.gateway.upstream`) has no idle-time limit of its own
(it keeps at most 256 idle connections per engine) and passes over one the engine has closed,
so the engines' idle limit is a trade (a longer one keeps more of the pool warm), not a
correctness bound; the engines' other clients (httpx, 5 s; aiohttp, 15 s) drop idle connections
before any engine does.

**Open files.** :func:`start` raises the process's soft open-file limit to its hard limit (a
soft limit of 1,024, common, would otherwise hold a server to 480 connections), then fits the
caps to it, and logs the limits in effect.

Counted in ``matrixserve_http_connections_open``, ``…_refused_total{reason}`` and
``…_timed_out_total{phase}`` (``header``, ``body``, ``send``), on the registry the server passes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import os
import resource
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, cast

from aiohttp import web
from aiohttp.http_parser import HttpParser
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("matrixserve.httpserving")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# file descriptors kept for everything but the served connections (logs, ZooKeeper, listeners)
RESERVED_FDS = 64
# a refused connection is kept (reading and discarding) at most this long after its 503, so its
# client reads the answer rather than a reset; past this many such connections at once, more
# are reset at once (a flood must not hold descriptors)
REFUSAL_LINGER_SECONDS = 1.0
MAX_LINGERING_REFUSALS = 256
_MAX_MESSAGE_CHARS = 300  # of a client-supplied path or parser message quoted back

_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    500: "internal_error",
}
_BODY_HEADERS = {"content-type", "content-length", "content-encoding", "transfer-encoding"}
_PREPARED = web.RequestKey("matrixserve_httpserving_prepared", web.StreamResponse)


# --------------------------------------------------------------------------- errors
def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_error(
    status: int, message: str, code: str, headers: Iterable[tuple[str, str]] = ()
) -> web.Response:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response(
        error_body(message[:_MAX_MESSAGE_CHARS], kind, code), status=status, headers=dict(headers)
    )


def _code(exc: web.HTTPException) -> str:
    derived = "_".join(exc.reason.lower().replace("-", " ").split())
    return _CODES.get(exc.status) or derived or f"http_{exc.status}"


def _rendered(request: BaseRequest, exc: web.HTTPException) -> web.StreamResponse:
    """``exc`` as a JSON answer; as it is if it is no error or already JSON."""
    if exc.status < 400 or exc.content_type == "application/json":
        return exc
    default = f"{exc.status}: {exc.reason}"
    message = exc.text if exc.text and exc.text != default else None
    if message is None:
        message = f"{exc.reason}: {request.method} {request.path[:_MAX_MESSAGE_CHARS]}"
        if exc.status == 405:
            message += f" (allowed: {exc.headers.get('Allow', 'none')})"
    kept = [(k, v) for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS]
    response = json_error(exc.status, message, _code(exc), kept)
    # after these the request's framing or body is not to be trusted
    return _closing(response) if exc.status in (400, 408, 413) else response


class RequestBodyTimeout(TimeoutError):
    """The request's body did not arrive within the body deadline. A ``TimeoutError`` so that
    aiohttp's lingering read of an unread body (after the response) ends on it and closes."""


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: framework errors and uncaught exceptions as OpenAI JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        rendered = _rendered(request, exc)
        if rendered is exc:
            raise
        return rendered
    except Exception as exc:
        return _failure(request, exc)


def _failure(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The answer to a handler's exception: the client's fault (a body late or malformed, the
    client gone) quietly, anything else as a logged 500; once the answer has started, none."""
    prepared: web.StreamResponse | None = request.get(_PREPARED)
    transport = request.transport
    gone = isinstance(exc, ConnectionError) and (transport is None or transport.is_closing())
    if not (gone or isinstance(exc, RequestBodyTimeout | RequestPayloadError)):
        log.exception("unhandled error serving %s %s", request.method, request.path, exc_info=exc)
    if prepared is not None:
        # the answer has started: no second one; its client sees the stream cut
        if transport is not None:
            transport.abort()
        return prepared
    if isinstance(exc, RequestBodyTimeout):
        return _closing(json_error(408, str(exc), "request_timeout"))
    if isinstance(exc, RequestPayloadError):  # the parser refused the body (framing, encoding)
        return _closing(json_error(400, f"the request body is malformed: {exc}", "invalid_body"))
    if gone:  # nothing can reach it: the write fails and aiohttp drops the connection quietly
        return web.Response(status=400)
    return json_error(500, "internal error", "internal_error")


def _closing(response: web.Response) -> web.Response:
    response.force_close()
    return response


async def _remember_prepared(request: web.Request, response: web.StreamResponse) -> None:
    request[_PREPARED] = response


def application(*, middlewares: Sequence[Any] = (), **kwargs: Any) -> web.Application:
    """A ``web.Application`` whose errors are OpenAI JSON (:func:`_json_errors` outermost)."""
    app = web.Application(middlewares=[_json_errors, *middlewares], **kwargs)
    app.on_response_prepare.append(_remember_prepared)
    return app


# --------------------------------------------------------------------------- limits
@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # s from a request head's first byte to its end
    body_timeout: float = 60.0  # s from a request's head to its body's end
    idle_timeout: float = 75.0  # s a keep-alive connection may wait for its next request
    send_timeout: float = 60.0  # s a response's write may stall (its client reading nothing)
    max_connections: int = 8192
    max_connections_per_client: int = 4096

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "idle_timeout", "send_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value}")
        for name in ("max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value}")

    def within_open_files(self, soft_limit: int) -> ConnectionLimits:
        """The caps fitted to the process's open-file limit: every relayed stream holds its
        outgoing connection too, so at most half of what is left after :data:`RESERVED_FDS`."""
        if soft_limit < 0:  # RLIM_INFINITY
            return self
        room = max(1, (soft_limit - RESERVED_FDS) // 2)
        if self.max_connections <= room:
            return self
        return replace(
            self,
            max_connections=room,
            max_connections_per_client=min(self.max_connections_per_client, room),
        )


_FLAGS = {
    "header_timeout": "s a request's line and headers may take from their first byte",
    "body_timeout": "s a request's body may take from the end of its head (then 408)",
    "idle_timeout": "s a keep-alive connection may wait for its next request",
    "send_timeout": "s a response's write may stall, its client reading nothing (then closed)",
    "max_connections": "connections open at once (more are refused: 503 with Retry-After)",
    "max_connections_per_client": "connections open at once from one client address",
}


def _positive_seconds(text: str, env: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds ({env})")
    return value


def _positive_count(text: str, env: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer ({env})")
    return value


def add_arguments(
    parser: argparse.ArgumentParser, env_prefix: str, defaults: ConnectionLimits
) -> None:
    """``--header-timeout``, ``--body-timeout``, ``--idle-timeout``, ``--send-timeout``,
    ``--max-connections``, ``--max-connections-per-client``, each defaulting to
    ``$<env_prefix><NAME>`` or ``defaults``. Bad values (from a flag or the environment) are
    argparse errors: exit 2 with the flag named."""
    group = parser.add_argument_group("connection limits")
    for field in fields(ConnectionLimits):
        default = getattr(defaults, field.name)
        env = env_prefix + field.name.upper()
        kind = _positive_seconds if isinstance(default, float) else _positive_count
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=functools.partial(kind, env=f"the flag, or ${env}"),
            # a string default goes through ``type`` too: a bad environment value is reported
            default=os.environ.get(env, str(default)),
            help=f"{_FLAGS[field.name]} (default {default}; ${env})",
        )


def limits_from(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(**{f.name: getattr(args, f.name) for f in fields(ConnectionLimits)})


# --------------------------------------------------------------------------- connections
class ConnectionMetrics:
    def __init__(self, registry: CollectorRegistry, guard: ConnectionGuard) -> None:
        self.refused = Counter(
            "matrixserve_http_connections_refused",
            "Connections refused over a cap (503), by cap",
            ["reason"],
            registry=registry,
        )
        self.timed_out = Counter(
            "matrixserve_http_connections_timed_out",
            "Connections closed because a request's head or body did not arrive in time, or "
            "a response's write stalled",
            ["phase"],
            registry=registry,
        )
        gauge = Gauge(
            "matrixserve_http_connections_open", "Client connections open", registry=registry
        )
        gauge.set_function(lambda: float(guard.open))
        for reason in ("total", "per_client"):  # every series scraped from the start, at 0
            self.refused.labels(reason=reason)
        for phase in ("header", "body", "send"):
            self.timed_out.labels(phase=phase)


class ConnectionGuard:
    """The connection caps, counted over one server's connections."""

    def __init__(self, limits: ConnectionLimits, registry: CollectorRegistry | None) -> None:
        self.limits = limits
        self.open = 0
        self.by_address: Tally[str] = Tally()
        self._lingering: dict[asyncio.Transport, asyncio.TimerHandle] = {}
        self.metrics = ConnectionMetrics(registry, self) if registry is not None else None

    def admit(self, address: str) -> str | None:
        """Count a new connection in, or say which cap refuses it."""
        if self.open >= self.limits.max_connections:
            return "total"
        if self.by_address[address] >= self.limits.max_connections_per_client:
            return "per_client"
        self.open += 1
        self.by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]

    def refuse(self, transport: asyncio.Transport, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(reason=reason).inc()
        if len(self._lingering) >= MAX_LINGERING_REFUSALS:
            transport.abort()
            return
        transport.write(_refusal(reason, self.limits))
        if transport.can_write_eof():
            transport.write_eof()
        loop = asyncio.get_running_loop()
        self._lingering[transport] = loop.call_later(REFUSAL_LINGER_SECONDS, transport.abort)

    def refusal_closed(self, transport: asyncio.Transport) -> None:
        timer = self._lingering.pop(transport, None)
        if timer is not None:
            timer.cancel()

    def timed_out(self, phase: str) -> None:
        if self.metrics is not None:
            self.metrics.timed_out.labels(phase=phase).inc()

    def close_refusals(self) -> None:
        for transport, timer in list(self._lingering.items()):
            timer.cancel()
            transport.abort()
        self._lingering.clear()


def _refusal(reason: str, limits: ConnectionLimits) -> bytes:
    cap = (
        f"{limits.max_connections} connections are open"
        if reason == "total"
        else f"{limits.max_connections_per_client} connections from this address are open"
    )
    body = json.dumps(
        error_body(
            f"too many connections: {cap}; retry later", "server_busy", "too_many_connections"
        )
    ).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


class _ParserTap:
    """aiohttp's request parser, with the heads it completes reported to the connection, and
    whether the bytes after the last whole message begin another head (:attr:`partial`: the
    header deadline runs). The parser (aiohttp's C parser: its state is not readable) is fed up
    to each place a message can end — a blank line (a head's end, a chunked body's end) and a
    Content-Length body's last byte — and asked whether one did. Should the parser's own
    buffering (flow control, an upgrade) hide where messages end, :attr:`partial` stays False
    for the connection: its idle limit still bounds it."""

    def __init__(self, parser: Any, on_messages: Callable[[list[Any]], None]) -> None:
        self._parser = parser
        self._on_messages = on_messages
        self._left = 0  # bytes of a Content-Length body still to come
        self._chunked: StreamReader | None = None  # a chunked body, until its end
        self._carry = b""  # the last bytes fed outside a Content-Length body (a blank line
        # may straddle two reads)
        self._lost = False  # where messages end is no longer known
        self.partial = False  # a head has begun (a byte other than CR or LF) and not ended

    def feed_data(self, data: bytes) -> Any:
        if self._lost or not data:  # nothing new (flow control resumed): the parser's buffer
            parsed = self._parser.feed_data(data)
            if parsed[0] or parsed[1]:  # heads it had buffered: where they ended is unknown
                self._lost, self.partial = True, False
        else:
            parsed = self._feed_pieces(data)
        if parsed[0]:
            self._on_messages(parsed[0])
        return parsed

    def _feed_pieces(self, data: bytes) -> tuple[list[Any], bool, bytes]:
        messages: list[Any] = []
        at, size = 0, len(data)
        while at < size:
            end = self._piece_end(data, at)
            piece = data if end - at == size else data[at:end]
            in_body = self._left > 0
            got, upgraded, tail = self._parser.feed_data(piece)
            messages += got
            at = end
            if upgraded or (got and in_body) or len(got) > 1:
                # an upgrade, or heads the parser had buffered: positions are lost, and the
                # rest goes as aiohttp would send it (an upgrade's tail is the connection's)
                self._lost, self.partial = True, False
                if upgraded:
                    return messages, upgraded, tail + data[at:]
                if at < size:
                    more, upgraded, tail = self._parser.feed_data(data[at:])
                    messages += more
                return messages, upgraded, tail
            if in_body:
                self._left -= len(piece)
                if not self._left:
                    self._at_message_end()
            elif got:
                self._head_ended(*got[0])
            elif self._chunked is not None and self._chunked.is_eof():
                self._at_message_end()
            else:  # a head's bytes, or a chunked body's
                self.partial = self.partial or (
                    self._chunked is None and bool(piece.strip(b"\r\n"))
                )
                self._carry = (self._carry + piece)[-3:]
        return messages, False, b""

    def _piece_end(self, data: bytes, at: int) -> int:
        """Where the next piece to feed ends: a Content-Length body's end, else a blank line's."""
        if self._left:
            return min(len(data), at + self._left)
        if self._carry:
            found = (self._carry + data[at : at + 3]).find(b"\r\n\r\n")
            if found >= 0:
                return at + found + 4 - len(self._carry)
        found = data.find(b"\r\n\r\n", at)
        return len(data) if found < 0 else found + 4

    def _head_ended(self, message: Any, payload: StreamReader) -> None:
        self.partial, self._carry = False, b""
        if payload.is_eof():  # no body
            self._at_message_end()
        elif message.chunked:
            self._chunked = payload
        else:
            try:
                self._left = int(message.headers.get("Content-Length", ""))
            except ValueError:
                self._lost = True

    def _at_message_end(self) -> None:
        self._left, self._chunked, self._carry, self.partial = 0, None, b"", False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class _GuardedHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol with the caps, the header, body and send deadlines, and
    errors it answers itself (a malformed head, an ``Expect`` refused) in JSON."""

    def __init__(self, manager: _GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager.guard
        self._address: str | None = None  # counted in the guard while set
        self._refused: asyncio.Transport | None = None  # answered 503, being closed
        self._head_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # a body still arriving
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        # the parser is aiohttp's (C or Python): wrapped, not replaced
        self._tap = _ParserTap(self._parser, self._heads_parsed)
        self._parser = cast("HttpParser[Any]", self._tap)

    # ------------------------------------------------------------------ caps
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        refusal = self._guard.admit(address)
        if refusal is not None:
            self._refused = transport
            self._guard.refuse(transport, refusal)
            return
        self._address = address
        super().connection_made(transport)
        self._arm_head()  # a connection that never sends a byte is a head that never ends

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is not None:
            self._guard.refusal_closed(self._refused)
            return
        self._cancel_timers()
        if self._address is not None:
            self._guard.release(self._address)
            self._address = None
        super().connection_lost(exc)

    # ------------------------------------------------------------------ deadlines
    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # discarded: the 503 is all this connection gets
        super().data_received(data)
        # a head begun, in this read or before: from its first read, whether a request is being
        # served or the connection waits (a head pipelined behind the end of the last one)
        if self._tap.partial and self._head_timer is None and self.transport is not None:
            self._arm_head()

    def _heads_parsed(self, messages: list[Any]) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        payload = messages[-1][1]  # only the last head read can have a body still arriving
        if not payload.is_eof():
            self._body = payload
            self._body_timer = self._loop.call_later(
                self._guard.limits.body_timeout, self._body_overdue
            )
            payload.on_eof(self._body_arrived)

    def _arm_head(self) -> None:
        self._head_timer = self._loop.call_later(
            self._guard.limits.header_timeout, self._head_overdue
        )

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport is None:
            return
        if self._request_in_progress or self._messages:
            # a head pipelined behind a request still being served: judged once that is done
            self._arm_head()
            return
        log.debug("closing a connection from %s: no request head in time", self._address)
        self._guard.timed_out("header")
        self.force_close()

    def _body_arrived(self) -> None:
        self._body = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_overdue(self) -> None:
        self._body_timer = None
        payload, self._body = self._body, None
        if payload is None or payload.is_eof() or self.transport is None:
            return
        self._guard.timed_out("body")
        payload.set_exception(
            RequestBodyTimeout(
                f"the request body did not arrive within {self._guard.limits.body_timeout:g} s"
            )
        )

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._address is not None:  # a served connection (a refused one lingers 1 s at most)
            self._send_timer = self._loop.call_later(
                self._guard.limits.send_timeout, self._send_overdue
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_overdue(self) -> None:
        """The send buffer stayed full: its client reads nothing. Aborted (a close would wait
        for the buffer to drain): the handler writing gets its connection lost, or is cancelled,
        and gives back what it holds."""
        self._send_timer = None
        if self.transport is None or not self.writing_paused:
            return
        log.debug("aborting a connection from %s: it read nothing for a while", self._address)
        self._guard.timed_out("send")
        self.transport.abort()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._send_timer = None
        self._body = None

    # ------------------------------------------------------------------ errors outside the app
    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException):  # raised outside the middlewares (417)
            resp = _rendered(request, resp)
        return await super().finish_response(request, resp, start_time)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what its parser refused (400) or what escaped every middleware
        (500, 504), in JSON; a client's malformed request is no server error to log loudly."""
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            log.debug("refused a malformed request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started: no error answer can follow")
        return _closing(
            json_error(status, f"malformed HTTP request: {message or exc}", "malformed_http")
            if status < 500
            else json_error(status, "internal error", _CODES.get(status, "internal_error"))
        )


class _GuardedServer(web.Server):
    """aiohttp's server (the protocol factory) for a runner's application, with the same
    settings, making :class:`_GuardedHandler` connections; the idle limit is aiohttp's
    keep-alive timeout."""

    def __init__(self, base: web.Server, guard: ConnectionGuard) -> None:
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **{**base._kwargs, "keepalive_timeout": guard.limits.idle_timeout},
        )
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)

    async def shutdown(self, timeout: float | None = None) -> None:
        await super().shutdown(timeout)
        self.guard.close_refusals()


def raised_open_files_limit() -> int:
    """The process's open-file limit, its soft limit raised to the hard one first (the soft
    one is often 1,024, which would hold a server to 480 connections); -1: unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft not in (hard, resource.RLIM_INFINITY):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit over nr_open
            log.warning("the open-file limit stays %d (raising it to %d: %s)", soft, hard, exc)
        else:
            soft = hard
    return soft


async def start(
    runner: web.AppRunner,
    host: str,
    port: int,
    limits: ConnectionLimits,
    registry: CollectorRegistry | None = None,
) -> ConnectionGuard:
    """Set ``runner`` up and serve it on ``host:port`` under ``limits`` (fitted to the open-file
    limit), whatever else the runner was made with (``handler_cancellation``, ...); the caller
    stops it with ``runner.cleanup()``. Raises ``OSError`` if the address cannot be bound."""
    open_files = raised_open_files_limit()
    fitted = limits.within_open_files(open_files)
    if fitted != limits:
        log.warning(
            "at most %d connections (%d per client): the open-file limit (%d) allows no more",
            fitted.max_connections,
            fitted.max_connections_per_client,
            open_files,
        )
    log.info(
        "serving %s:%d with %s (open-file limit %d)",
        host,
        port,
        ", ".join(f"{f.name} {getattr(fitted, f.name)}" for f in fields(fitted)),
        open_files,
    )
    await runner.setup()
    assert runner.server is not None  # set by setup()
    guard = ConnectionGuard(fitted, registry)
    # the runner's own server, made by setup() from the application, is never listened on:
    # the site listens with this one, and the runner's cleanup shuts this one down
    runner._server = _GuardedServer(runner.server, guard)
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return guard
