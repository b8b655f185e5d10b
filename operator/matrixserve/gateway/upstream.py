"""The gateway's client for engine streams (``POST /v1/generate``): HTTP/1.1 on asyncio
protocols, keep-alive connections pooled per engine address.

This is the gateway's hot path (P/D-Serve §3.5: the gateway relays each request's stream from
the prefill that accepted it). Tokens are a TPOT apart, so every token arrives as a read of its
own and is relayed on its own. Through aiohttp's client each token took a trip through its
parser, a ``StreamReader``, a waiter future, the handler task's wake-up and an async generator,
and each try at a prefill built a full client request. Here the connection's protocol decodes
the chunked body and the SSE events inside ``data_received`` and the handler task wakes once per
read, with the events parsed, to write them to its client (``make bench-gateway-overhead``
measures the difference: docs/gateway.md).

It speaks what engines answer, nothing more: a status line and headers, then a body framed by
``Transfer-Encoding: chunked`` (streams) or ``Content-Length`` (refusals), or ended by the
connection's close. A refusal's body is kept (its first :data:`MAX_REFUSAL_BYTES`), so the
gateway can tell its client what an engine refused (:meth:`EngineStream.refusal`); reading it
whole keeps the connection's framing, so it is pooled afterwards. Anything else (an oversize
head or event, bad chunk framing, an event that is not a JSON object with a type, a connection
lost mid-body, a minute of silence) is a broken upstream: the stream's events end with one
``error`` event (``upstream_failed``), never a hang, and the connection is dropped, not pooled.
A stream released at its last event waits briefly for its body's end (the engine writes it
separately) and is then pooled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

from matrixserve.api.engine_protocol import LAST_EVENTS, Event, error_event, event_type

MAX_HEAD_BYTES = 64 * 1024  # an engine's status line and headers
MAX_EVENT_BYTES = 1 << 20  # one SSE line from an engine; longer is a broken upstream
MAX_CHUNK_LINE_BYTES = 1024  # a chunk-size line (hex size and extensions)
MAX_REFUSAL_BYTES = 8192  # of a refusal's body kept (an engine's JSON error is a few hundred)
# Events read but not yet taken by a handler (its client is slow): past this many the
# connection stops reading, so a slow client holds the engine back instead of the gateway's memory.
MAX_PENDING_EVENTS = 256
# A stream released after its last event (``done`` or ``error``) whose body's end has not
# arrived yet (the engine writes it separately) is kept this long (s) for that end, then pooled;
# past it the connection is dropped.
LINGER_SECONDS = 1.0
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")  # no sign, prefix or separator: int() takes those

_IDLE, _HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(9)


class UpstreamError(Exception):
    """The engine could not be reached, or its connection failed before it answered."""


class _Stale(UpstreamError):
    """A pooled connection the engine had closed before it read the request (safe to retry)."""


class EngineStream(asyncio.Protocol):
    """One connection to an engine, and the response to the request on it.

    After :meth:`EnginePool.post` returns, ``status`` is the answer's HTTP status; for a 200,
    :meth:`batch` gives the stream's events as they arrive. :meth:`release` hands the connection
    back to the pool once the body is read whole, or drops it (an unread or broken body)."""

    def __init__(self, pool: EnginePool, address: str) -> None:
        self.pool, self.address = pool, address
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.headers: dict[str, str] = {}  # the answer's (names and values in lower case)
        self.reused = False
        self._state = _IDLE
        self._buffer = b""
        self._left = 0  # bytes left in this chunk (or in a Content-Length body)
        self._partial = b""  # an SSE line not yet ended
        self._sse = False  # the body is the stream's events (a 200), else a refusal's (kept)
        self._refusal = bytearray()  # a refusal's body, up to MAX_REFUSAL_BYTES
        self._keep_alive = True
        self._paused = False  # reading paused: too many events wait for the handler
        self._ended = False  # the stream's last event (or a refusal's head) has been read
        self._lingering = False  # released before the body's end: pooled when it arrives
        self._events: list[Event] = []
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._last = 0.0  # loop time of the last read
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif self._state == _HEAD and not self._buffer and self.reused:  # not a byte answered
            self._fail(_Stale("the engine closed a pooled connection"))
        elif self._state not in (_IDLE, _DONE):
            self._fail(UpstreamError("the engine closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self._state in (_IDLE, _DONE):
            # bytes nobody asked for: this connection's framing is lost, never pool it
            self.abort()
            return
        self._last = self.loop.time()
        self._buffer += data
        try:
            if self._state == _HEAD:
                self._read_head()
            if self._state != _HEAD:
                self._read_body()
        except (UpstreamError, ValueError) as exc:  # ValueError: an event that is not JSON
            self._fail(exc)
            return
        if self._lingering:
            return  # the handler is gone: only the body's end matters (pooled in _finish)
        if len(self._events) > MAX_PENDING_EVENTS and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        waiter = self._waiter
        if waiter is not None and (self._events or self._state == _DONE) and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------ the caller's side
    async def _send(self, request: bytes) -> None:
        """Write the request and wait for the answer's head (``status`` set)."""
        assert self.transport is not None
        self._state, self.status = _HEAD, 0
        self._sse, self._keep_alive, self._events = False, True, []
        self._buffer, self._partial, self._left = b"", b"", 0
        self._refusal = bytearray()
        self._ended = self._lingering = False
        self._resume()
        self._last = self.loop.time()
        self._head = self.loop.create_future()
        self._timer = self.loop.call_at(self._last + self.pool.read_timeout, self._check_silence)
        self.transport.write(request)
        try:
            await self._head
        except BaseException:  # cancelled (the caller's budget) or failed: the connection goes
            self.abort()
            raise

    async def batch(self) -> list[Event]:
        """The events that arrived since the last call, waiting for at least one; ``[]`` once
        the body has ended (a failure is an ``error`` event before that)."""
        while not self._events and self._state != _DONE:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        self._resume()
        return events

    async def refusal(self, timeout: float) -> bytes:
        """A refusal's body (its first :data:`MAX_REFUSAL_BYTES`), waiting at most ``timeout``
        s for its end; what has arrived by then, if it does not end in time."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self._state != _DONE:
                    self._waiter = self.loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
        return bytes(self._refusal)

    def _resume(self) -> None:
        """Read again after a pause (not the engine's silence: the clock restarts)."""
        if self._paused and self.transport is not None:
            self._paused = False
            self._last = self.loop.time()
            self.transport.resume_reading()

    def release(self) -> None:
        """Back to the pool if the answer was read whole on a connection that stays open, or
        once its body's end arrives if only that is missing after the stream's last event (a
        refusal's body, the end of a chunked stream); dropped otherwise (the engine sees a
        stream cut short as its client gone)."""
        if self._state == _DONE:
            self._cancel_timer()
            if self._keep_alive and self.transport is not None:
                self._state = _IDLE
                self.pool.idle(self)
            else:
                self.abort()
        elif self._ended and self._keep_alive and self._state != _UNTIL_CLOSE:
            self._lingering = True
            self._events = []
            self._resume()
            self._cancel_timer()
            self._timer = self.loop.call_later(LINGER_SECONDS, self.abort)
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the connection now; a caller waiting on it gets its failure (an error event,
        or ``post()`` raises)."""
        self._keep_alive = False
        self.pool.forget(self)
        if self._state not in (_IDLE, _DONE):
            self._fail(UpstreamError("the gateway dropped the connection"))
        self._cancel_timer()
        self._state = _DONE
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------------ parsing
    def _read_head(self) -> None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise UpstreamError(f"a response head over {MAX_HEAD_BYTES} bytes")
            return
        lines = self._buffer[:end].decode("latin-1").split("\r\n")
        self._buffer = self._buffer[end + 4 :]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise UpstreamError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(rest[:3])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamError(f"a malformed response header: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip().lower()
        self.headers = headers
        self._keep_alive = version == "HTTP/1.1" and headers.get("connection") != "close"
        self._sse = self.status == 200
        self._ended = not self._sse  # a refusal's head is all its caller reads
        if "chunked" in headers.get("transfer-encoding", ""):
            self._state = _SIZE
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise UpstreamError(f"a bad Content-Length: {length[:40]!r}")
            self._state, self._left = _LENGTH, int(length)
            if self._left == 0:
                self._finish()
        else:
            self._state, self._keep_alive = _UNTIL_CLOSE, False
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)

    def _read_body(self) -> None:
        buffer, at, size = self._buffer, 0, len(self._buffer)  # read on from ``at``: no copies
        try:
            while at < size:
                state = self._state
                if state in (_DATA, _LENGTH, _UNTIL_CLOSE):
                    end = size if state == _UNTIL_CLOSE else min(size, at + self._left)
                    if state != _UNTIL_CLOSE:
                        self._left -= end - at
                    if self._sse:
                        self._parse_events(buffer[at:end])
                    elif len(self._refusal) < MAX_REFUSAL_BYTES:
                        room = MAX_REFUSAL_BYTES - len(self._refusal)
                        self._refusal += buffer[at : min(end, at + room)]
                    at = end
                    if self._left == 0 and state == _DATA:
                        self._state = _DATA_END
                    elif self._left == 0 and state == _LENGTH:
                        self._finish()
                elif state in (_SIZE, _DATA_END, _TRAILER):
                    end = buffer.find(b"\r\n", at)
                    if end < 0:
                        if size - at > MAX_CHUNK_LINE_BYTES:
                            raise UpstreamError("a chunk line too long")
                        return
                    line, at = buffer[at:end], end + 2
                    if state == _DATA_END:
                        if line:
                            raise UpstreamError("a chunk not ended by CRLF")
                        self._state = _SIZE
                    elif state == _TRAILER:
                        if not line:
                            self._finish()
                    else:
                        hex_size = line.split(b";", 1)[0].strip()
                        if not _CHUNK_SIZE.fullmatch(hex_size):
                            raise UpstreamError(f"a bad chunk size: {hex_size[:20]!r}")
                        self._left = int(hex_size, 16)
                        self._state = _DATA if self._left else _TRAILER
                else:  # bytes past the answer's end: this connection's framing is lost
                    at = size
                    if state == _IDLE:  # pooled by a lingering release just now
                        self.abort()
                    self._keep_alive = False
        finally:
            self._buffer = buffer[at:] if at < size else b""

    def _parse_events(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n") if self._partial else data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_EVENT_BYTES:
            raise UpstreamError(f"an upstream event over {MAX_EVENT_BYTES} bytes")
        for line in lines:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                kind = event_type(event)
                if kind is None:
                    raise UpstreamError("an event that is not a JSON object with a type")
                self._events.append(event)
                if kind in LAST_EVENTS:
                    self._ended = True

    # ------------------------------------------------------------------ endings
    def _finish(self) -> None:
        self._state = _DONE
        self._cancel_timer()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._lingering:  # released by its handler: the body's end came, so pool it
            self._lingering = False
            self.release()

    def _fail(self, exc: Exception) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(exc)  # before the head: the caller's post() raises it
        else:
            self._events.append(
                error_event("upstream_failed", f"the serving instance failed mid-stream ({exc})")
            )
        self._keep_alive = self._lingering = False
        self._finish()
        if self.transport is not None:
            self.transport.abort()

    def _check_silence(self) -> None:
        self._timer = None
        if self._state in (_IDLE, _DONE):
            return
        if self._paused:  # not the engine's silence: this side stopped reading
            self._last = self.loop.time()
        due = self._last + self.pool.read_timeout
        if self.loop.time() >= due:
            self._fail(UpstreamError(f"no data for {self.pool.read_timeout:g} s"))
        else:
            self._timer = self.loop.call_at(due, self._check_silence)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class EnginePool:
    """Keep-alive connections to engines, by address (``host:port``)."""

    def __init__(
        self, connect_timeout: float = 2.0, read_timeout: float = 60.0, max_idle: int = 256
    ) -> None:
        self.connect_timeout = connect_timeout
        # an engine silent this long mid-answer is hung: its stream ends with an error event
        # (the client gets an error chunk) rather than hold the gateway's counters for ever
        self.read_timeout = read_timeout
        self.max_idle = max_idle  # per engine
        self._idle: dict[str, list[EngineStream]] = {}
        self._open: set[EngineStream] = set()

    async def post(self, address: str, path: str, body: bytes) -> EngineStream:
        """Send ``body`` (JSON) and return the connection with the answer's head read. Raises
        :class:`UpstreamError` if the engine cannot be reached or fails before answering; the
        caller's cancellation (its timeout) drops the connection."""
        request = (
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), address.encode(), len(body), body)
        )
        idle = self._idle.get(address)
        while idle:
            stream = idle.pop()
            stream.reused = True
            try:
                await stream._send(request)
            except _Stale:
                # closed by the engine (its keep-alive timeout) before it answered a byte:
                # the next idle connection, or a new one
                continue
            return stream
        self._idle.pop(address, None)
        stream = await self._connect(address)
        await stream._send(request)
        return stream

    async def _connect(self, address: str) -> EngineStream:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")  # [::1]:8000
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout) as deadline:
                _, protocol = await loop.create_connection(
                    lambda: EngineStream(self, address), host, int(port)
                )
        except TimeoutError as exc:  # this deadline's, or the kernel's (ETIMEDOUT)
            raise UpstreamError(
                f"no connection to {address} within {self.connect_timeout:g} s"
                if deadline.expired()
                else f"cannot connect to {address}: {exc}"
            ) from None
        except (OSError, ValueError) as exc:
            raise UpstreamError(f"cannot connect to {address}: {exc}") from exc
        self._open.add(protocol)
        return protocol

    def idle(self, stream: EngineStream) -> None:
        idle = self._idle.setdefault(stream.address, [])
        if len(idle) < self.max_idle:
            idle.append(stream)
        else:
            stream.abort()

    def forget(self, stream: EngineStream) -> None:
        self._open.discard(stream)
        idle = self._idle.get(stream.address)
        if idle and stream in idle:
            idle.remove(stream)

    def idle_count(self, address: str) -> int:
        return len(self._idle.get(address, ()))

    def idle_total(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def open_count(self) -> int:
        """Connections open, pooled or in use."""
        return len(self._open)

    def close(self) -> None:
        """Drop every connection, pooled or in use."""
        for stream in list(self._open):
            stream.abort()
        self._idle.clear()
