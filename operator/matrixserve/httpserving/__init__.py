"""The HTTP serving shared by the gateway and the engines.

**Errors (the framework's part).** Every error aiohttp makes on its own — 404 for an
unknown path, 405 for a wrong method (its ``Allow`` header kept), 413 for a body over
``client_max_size``, 400 for a body the parser refused (bad chunk framing, bad compression),
417, any uncaught exception (500: logged with its traceback, never shown) — is answered with an
OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}`` and the same status: by
the outermost middleware of every :func:`application`, and for what escapes an application (the
parser's 400 for a malformed request line or header, the 417 of an ``Expect`` header aiohttp
checks before any middleware) by the connection's protocol when the server runs through
:func:`start`. A stream whose response has started is never written into:
an error there drops the connection, so its client sees the stream cut, not a false end.

**Slow and idle connections.** aiohttp bounds header sizes and idle keep-alive
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

The package's modules: :mod:`.errors` (the OpenAI-shaped answers, :func:`application`),
:mod:`.limits` (the deadlines and caps, their flags), :mod:`.connections` (the guarded
protocol that enforces them) and :mod:`.server` (:func:`start`). What the gateway and the
engines use is re-exported here (``from matrixserve import httpserving``).
"""

from __future__ import annotations

from matrixserve.httpserving.connections import (
    MAX_LINGERING_REFUSALS,
    REFUSAL_LINGER_SECONDS,
    ConnectionGuard,
    ConnectionMetrics,
)
from matrixserve.httpserving.errors import (
    Handler,
    RequestBodyTimeout,
    application,
    error_body,
    json_error,
)
from matrixserve.httpserving.limits import (
    RESERVED_FDS,
    ConnectionLimits,
    add_arguments,
    limits_from,
)
from matrixserve.httpserving.server import raised_open_files_limit, start

__all__ = [
    "MAX_LINGERING_REFUSALS",
    "REFUSAL_LINGER_SECONDS",
    "RESERVED_FDS",
    "ConnectionGuard",
    "ConnectionLimits",
    "ConnectionMetrics",
    "Handler",
    "RequestBodyTimeout",
    "add_arguments",
    "application",
    "error_body",
    "json_error",
    "limits_from",
    "raised_open_files_limit",
    "start",
]
