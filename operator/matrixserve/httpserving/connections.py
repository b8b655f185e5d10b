"""aiohttp's HTTP/1.1 protocol, guarded: the connection caps (a connection over one answered
503 at once and closed, never read), the header, body and send deadlines, and the errors
aiohttp answers outside any application (a malformed head, an ``Expect`` refused) in JSON;
counted on the server's registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import sys
import termios
from collections import Counter as Tally
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_parser import HttpParser
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client import CollectorRegistry, Counter, Gauge

from matrixserve.httpserving.errors import (
    CODES,
    RequestBodyTimeout,
    closing,
    error_body,
    json_error,
    rendered_as_json,
)
from matrixserve.httpserving.limits import ConnectionLimits

log = logging.getLogger("matrixserve.httpserving")

# a refused connection is kept (reading and discarding) at most this long after its 503, so its
# client reads the answer rather than a reset; past this many such connections at once, more
# are reset at once (a flood must not hold descriptors)
REFUSAL_LINGER_SECONDS = 1.0
MAX_LINGERING_REFUSALS = 256


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

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
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
            resp = rendered_as_json(request, resp)
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
        return closing(
            json_error(status, f"malformed HTTP request: {message or exc}", "malformed_http")
            if status < 500
            else json_error(status, "internal error", CODES.get(status, "internal_error"))
        )


class GuardedServer(web.Server):
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
