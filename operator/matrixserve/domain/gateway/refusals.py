"""A prefill's answers that are not an acceptance, as the gateway reads them, pure.

A prefill's refusal of the request itself (400, 413, 422) is refused alike by every prefill (the
engines of a scenario run one model with one set of limits), so it is the client's final answer,
worded as OpenAI does (``context_length_exceeded``), never retried into a 503
(:func:`engine_refusal`); a prefill that answered 503 is passed over for its ``Retry-After``
(:func:`retry_after_seconds`).
"""

from __future__ import annotations

import json

from matrixserve.domain.gateway.completions import BadRequest

FINAL_STATUSES = frozenset({400, 413, 422})
_MAX_ENGINE_MESSAGE_CHARS = 300
# the engine request's fields (api.engine_protocol.GenerateRequest) by the OpenAI field they
# come from; "prompt" stands for the prompt's field, "messages" for a chat
_ENGINE_FIELDS = (("maxTokens", "max_tokens"), ("promptTokens", "prompt"), ("prompt", "prompt"))


def _engine_error(body: bytes) -> tuple[str | None, str, str | None]:
    """An engine's OpenAI-shaped error body read defensively: its code, message and param
    (strings only; an engine's text is not trusted to be JSON, or short)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    if not isinstance(error, dict):
        return None, "no reason given", None
    code, message, param = (error.get(k) for k in ("code", "message", "param"))
    text = message[:_MAX_ENGINE_MESSAGE_CHARS] if isinstance(message, str) else "no reason given"
    return (
        code if isinstance(code, str) else None,
        text,
        param if isinstance(param, str) else None,
    )


def engine_refusal(status: int, body: bytes, chat: bool) -> BadRequest | None:
    """The client's answer to a prefill's refusal of the request itself (a status in
    :data:`FINAL_STATUSES`), as a 400 in OpenAI's words: a prompt too long for the engines
    (their 413: over ``spec.model.maxContextTokens``, or more KV than fits an instance) is
    ``context_length_exceeded`` naming ``messages`` or ``prompt``; any other names what the
    engine said. None for any other status (the prefill, not the request, is at fault)."""
    if status not in FINAL_STATUSES:
        return None
    code, message, param = _engine_error(body)
    prompt_field = "messages" if chat else "prompt"
    if status == 413 or code == "prompt_too_long":
        return BadRequest(
            f"the prompt is longer than the serving instances take ({message})",
            prompt_field,
            code="context_length_exceeded",
        )
    named = dict(_ENGINE_FIELDS).get(param or "") or next(
        (field for name, field in _ENGINE_FIELDS if name in message), None
    )
    return BadRequest(
        f"the serving instance refused the request ({status}): {message}",
        prompt_field if named == "prompt" else named,
    )


def retry_after_seconds(header: str | None, at_most: float) -> float:
    """How long a prefill that answered 503 is passed over: its ``Retry-After`` in whole
    seconds, at most ``at_most`` (also the time without one, or with an HTTP date). The
    engines' own is advice for their clients (5 s while loading or faulty); the gateway checks
    sooner, as a prefill back in service must not wait on it."""
    value = (header or "").strip()
    if 0 < len(value) <= 6 and value.isascii() and value.isdigit():
        return min(float(value), at_most)
    return at_most
