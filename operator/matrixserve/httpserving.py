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
  read that ended a body-less request before it (pipelined) is held to it too; one begun in the
  read that ended a request with a body has the idle limit (where that body ends in the read is
  not looked for: each read is fed to the parser whole, whatever its bytes);
- a **body deadline**: the body must arrive whole within ``body_timeout`` of its head; past it
  the handler reading it gets a 408 ``request_timeout`` and the connection is closed;
- an **idle limit**: aiohttp's keep-alive timeout, ``idle_timeout`` between requests;
- a **send deadline**: a response's write that stalls — the connection's send buffer full,
  its client reading nothing — for ``send_timeout`` is given up and the connection aborted, so
  a client that stops reading does not hold its stream (and the engine work behind it) for
  ever. Progress is what the client has not taken yet (transport buffer and kernel queue)
  going down; with the kernel's buffers (MBs on a fast link) a client reading far below
  buffer / ``send_timeout`` (about 30 KB/s at 60 s) can look stalled and be cut;
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
import contextlib
import fcntl
import functools
import json
import logging
import math
import os
import resource
import sys
import termios
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
    """aiohttp's request parser, with the heads it completes reported to the connection. Each
    read is fed whole (one call into the parser: its cost stays the parser's, whatever the
    bytes — a body of blank lines included)."""

    def __init__(self, parser: Any, on_messages: Callable[[list[Any]], None]) -> None:
        self._parser = parser
        self._on_messages = on_messages

    def feed_data(self, data: bytes) -> Any:
        parsed = self._parser.feed_data(data)
        if parsed[0]:
            self._on_messages(parsed[0])
        return parsed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def _unsent(transport: asyncio.Transport) -> int:
    """Bytes written to the connection its client has not taken yet: the transport's buffer and
    the kernel's send queue (which, several MB on a fast link, absorbs a slow client's reads:
    the transport's buffer alone would not move for them)."""
    queued = 0
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            queued = int.from_bytes(out, sys.byteorder)
    return transport.get_write_buffer_size() + queued


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
        self._send_buffered = 0  # the write buffer's size when the send deadline was armed
        self._head_done = False  # a head ended in the read being handled
        self._last_bodiless = False  # ... and the last one has no body
        # the parser is aiohttp's (C or Python): wrapped, not replaced
        self._parser = cast("HttpParser[Any]", _ParserTap(self._parser, self._heads_parsed))

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
        in_head = self._body is None
        self._head_done = self._last_bodiless = False
        super().data_received(data)
        if not data or self._head_timer is not None or self.transport is None:
            return
        if in_head and not self._head_done:
            self._arm_head()  # a head's bytes, not ended in this read
        elif self._last_bodiless:
            # a body-less request ended in this read: the bytes after its blank line begin the
            # next head (pipelined). After a request with a body, where it ends in the read is
            # not looked for (a scan per read): such a head has the idle limit.
            end = data.rfind(b"\r\n\r\n")
            if end >= 0 and data[end + 4 :].strip(b"\r\n"):
                self._arm_head()

    def _heads_parsed(self, messages: list[Any]) -> None:
        self._head_done = True
        message = messages[-1][0]
        self._last_bodiless = not message.chunked and message.headers.get(
            "Content-Length", "0"
        ) in ("", "0")
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
        if self._address is not None and self.transport is not None:
            # a served connection (a refused one lingers 1 s at most)
            self._send_buffered = _unsent(self.transport)
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
        buffered = _unsent(self.transport)
        if buffered < self._send_buffered:  # the client took some meanwhile: slow, not stalled
            self._send_buffered = buffered
            self._send_timer = self._loop.call_later(
                self._guard.limits.send_timeout, self._send_overdue
            )
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
