"""Every error the HTTP serving makes on its own answered as OpenAI does: a body
``{"error": {"message", "type", "param", "code"}}`` with the same status, from the outermost
middleware of every :func:`application` (and, for what escapes an application, from the guarded
protocol in :mod:`.connections`). A stream whose response has started is never written into: an
error there drops the connection, so its client sees the stream cut, not a false end.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_request import BaseRequest

log = logging.getLogger("matrixserve.httpserving")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_MAX_MESSAGE_CHARS = 300  # of a client-supplied path or parser message quoted back

CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    500: "internal_error",
}
_BODY_HEADERS = {"content-type", "content-length", "content-encoding", "transfer-encoding"}
_PREPARED = web.RequestKey("matrixserve_httpserving_prepared", web.StreamResponse)


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
    return CODES.get(exc.status) or derived or f"http_{exc.status}"


def rendered_as_json(request: BaseRequest, exc: web.HTTPException) -> web.StreamResponse:
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
    return closing(response) if exc.status in (400, 408, 413) else response


class RequestBodyTimeout(TimeoutError):
    """The request's body did not arrive within the body deadline. A ``TimeoutError`` so that
    aiohttp's lingering read of an unread body (after the response) ends on it and closes."""


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: framework errors and uncaught exceptions as OpenAI JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        rendered = rendered_as_json(request, exc)
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
        return closing(json_error(408, str(exc), "request_timeout"))
    if isinstance(exc, RequestPayloadError):  # the parser refused the body (framing, encoding)
        return closing(json_error(400, f"the request body is malformed: {exc}", "invalid_body"))
    if gone:  # nothing can reach it: the write fails and aiohttp drops the connection quietly
        return web.Response(status=400)
    return json_error(500, "internal error", "internal_error")


def closing(response: web.Response) -> web.Response:
    response.force_close()
    return response


async def _remember_prepared(request: web.Request, response: web.StreamResponse) -> None:
    request[_PREPARED] = response


def application(*, middlewares: Sequence[Any] = (), **kwargs: Any) -> web.Application:
    """A ``web.Application`` whose errors are OpenAI JSON (:func:`_json_errors` outermost)."""
    app = web.Application(middlewares=[_json_errors, *middlewares], **kwargs)
    app.on_response_prepare.append(_remember_prepared)
    return app
