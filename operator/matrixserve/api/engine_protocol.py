"""The engine's HTTP protocol (P/D-Serve §3.5-3.6), as the gateway, the engine stub and the
benchmarks' null engine all speak it: one definition of the request bodies, the stream events and
the units of the TTFT budget.

- ``POST /v1/generate`` (gateway -> prefill entrance): :func:`generate_body` writes it,
  :meth:`GenerateRequest.parse` reads it (``prompt`` text or ``promptTokens``).
- ``POST /v1/decode`` (prefill -> decode): :func:`decode_body` writes it, :func:`parse_decode`
  reads it; the same fields plus :class:`PrefillRef`, where the decode pulls the KV from.
- A stream that continues elsewhere: ``resumeAt`` says how many of the request's output tokens its
  caller already has. The engine prefills the prompt plus those tokens (it can write them again: the
  tokens are a function of the prompt and their index, :func:`synthetic_token`), and its stream goes
  on at that index, so the caller sees no token twice and none missing. A decode is always told (at
  least 1: the prefill made the first), a gateway only when it re-offers a stream whose entrance was
  lost.
- The answer: ``200`` and an SSE stream of ``data: <json>`` events, ``token`` ... then one of
  :data:`LAST_EVENTS` (``done`` with usage, timings and instances, or ``error`` with a code and a
  message); or, before any stream, a status with ``{"error": {"code", "message"}}``
  (:class:`EngineError`; 429 means busy, try another).

The events are plain dicts on purpose: the engine's decode loop writes one and the gateway's relay
reads one per token, so the constructors are typed and nothing is validated per token.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

# "reject": busy prefills answer 429 (P/D-Serve's on-demand forwarding); "queue": they keep a
# local queue (the paper's original version, the gateway's baselines).
Admission = Literal["reject", "queue"]
ADMISSIONS: tuple[Admission, ...] = ("reject", "queue")

Event = dict[str, Any]  # one stream event as JSON gives it (readers check it with event_type)
LAST_EVENTS = ("done", "error")  # a stream ends after one of these

_WORDS = ("the", "model", "serves", "tokens", "on", "emulated", "dies", "of", "a", "superpod")


def count_tokens(text: str) -> int:
    """A deterministic stand-in tokenizer: about four characters a token (the engines count
    prompts with it, and the gateway sizes TTFT budgets with it)."""
    return max(1, math.ceil(len(text) / 4))


def token_seed(prompt: str | int) -> int:
    """What a prompt's output tokens are drawn from: a stable digest of its text (or, for a
    prompt given as token ids, of its length: the engines see only that). The same in every
    process and on every instance, so the continuation of a stream on another instance, and an
    unfaulted run of the same prompt, write the same text (a greedy-decoding model does too)."""
    text = prompt if isinstance(prompt, str) else f"{prompt} prompt tokens"
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def choice_seed(prompt: str | int, choice: int) -> int:
    """The seed the gateway gives the ``choice``-th of a prompt's ``n`` choices: the prompt's
    own :func:`token_seed` moved on by the choice, so the choices differ (as sampled ones do)
    while each stays the same on whichever instance writes it, and the first is the prompt's."""
    return (token_seed(prompt) + choice) % (1 << 32)


def synthetic_token(seed: int, index: int) -> str:
    """The text of the ``index``-th output token of a prompt whose :func:`token_seed` is
    ``seed``: the emulated engines generate no language, but what they generate is
    deterministic. The words cycle through ten from where the seed starts them (any ten
    consecutive tokens hold each word once): a token missed or repeated by a stream that moved
    shows in its text."""
    return _WORDS[(seed + index) % len(_WORDS)] + " "


# --------------------------------------------------------------------------- the TTFT budget
@dataclass(frozen=True)
class TtftBudget:
    """A TTFT budget, kept in the engines' emulated seconds (what ``ttftBudget`` carries).

    It changes unit on its way: a group's SLO is in milliseconds, the engines count emulated
    seconds, and the gateway waits in wall seconds (emulated / the engines' time scale). Each
    conversion is written here once."""

    emulated_seconds: float

    @classmethod
    def from_milliseconds(cls, milliseconds: float) -> TtftBudget:
        return cls(milliseconds / 1000.0)

    @classmethod
    def from_wall_seconds(cls, wall_seconds: float, time_scale: float) -> TtftBudget:
        """What is left of a budget the gateway has been waiting on, as an engine counts it."""
        return cls(wall_seconds * time_scale)

    @property
    def milliseconds(self) -> float:
        return self.emulated_seconds * 1000

    def wall_seconds(self, time_scale: float) -> float:
        """How long the gateway waits for it (``time_scale``: emulated seconds per wall second)."""
        return self.emulated_seconds / time_scale


# --------------------------------------------------------------------------- errors
class EngineError(Exception):
    """What an engine answers instead of a stream: an HTTP status and a machine-readable code
    (``{"error": {"code", "message", "type", "param"}}``, OpenAI's error shape, so a bad
    request is a 4xx a client reads, never a 500; ``param`` names the body field at fault, if one
    is)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    @property
    def kind(self) -> str:
        """OpenAI's error ``type`` for the status."""
        if self.status == 429:
            return "rate_limit_exceeded"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "type": self.kind,
                "param": self.param,
            }
        }


def _invalid(message: str) -> EngineError:
    return EngineError(400, "invalid_request", message)


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class GenerateRequest:
    """A ``/v1/generate`` (or ``/v1/decode``) body as the engine reads it (the prompt counted in
    tokens). ``prompt_tokens`` and ``max_tokens`` are always the whole request's: a stream that
    continues elsewhere says how far it got in ``resume_at``."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    ttft_budget: TtftBudget | None = None  # what the caller still allows for the first token
    admission: Admission | None = None  # None: the engine's own ``--admission``
    seed: int = 0  # its output's :func:`token_seed`
    resume_at: int = 0  # output tokens its caller already has: the next one is this index

    @property
    def context_tokens(self) -> int:
        """The tokens a prefill computes (and whose KV it holds): the prompt, and the output
        its caller already has."""
        return self.prompt_tokens + self.resume_at

    @property
    def remaining(self) -> int:
        """Output tokens still to come."""
        return self.max_tokens - self.resume_at

    def resumed(self, at: int) -> GenerateRequest:
        """The same request, its caller holding its first ``at`` output tokens (no TTFT budget:
        its first token was served)."""
        return replace(self, resume_at=at, ttft_budget=None)

    @classmethod
    def parse(cls, body: Any, max_prompt: int, max_output: int) -> GenerateRequest:
        """Read a body, within this engine's prompt and output limits; raises
        :class:`EngineError` (400, or 413 for a prompt over ``max_prompt`` tokens)."""
        if not isinstance(body, dict):
            raise _invalid("body must be a JSON object")
        rid = body.get("requestId")
        if not isinstance(rid, str) or not 0 < len(rid) <= 200:
            raise _invalid("requestId must be a non-empty string (<= 200 chars)")
        if "promptTokens" in body:
            tokens = body["promptTokens"]
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
                raise _invalid("promptTokens must be a positive integer")
            seed = token_seed(tokens)
        elif isinstance(body.get("prompt"), str) and body["prompt"]:
            tokens = count_tokens(body["prompt"])
            seed = token_seed(body["prompt"])
        else:
            raise _invalid("give prompt (non-empty string) or promptTokens")
        if tokens > max_prompt:
            raise EngineError(
                413,
                "prompt_too_long",
                f"prompt has {tokens} tokens; this engine takes at most {max_prompt}",
            )
        max_tokens = body.get("maxTokens", 16)
        if (
            not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool)
            or not 1 <= max_tokens <= max_output
        ):
            raise _invalid(f"maxTokens must be an integer in 1..{max_output}")
        budget = body.get("ttftBudget")
        if budget is not None and (not isinstance(budget, int | float) or budget <= 0):
            raise _invalid("ttftBudget must be a positive number of seconds")
        admission = body.get("admission")
        if admission is not None and admission not in ADMISSIONS:
            raise _invalid('admission must be "reject" or "queue"')
        if "seed" in body:
            seed = body["seed"]
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 32:
                raise _invalid("seed must be an integer in 0..2**32-1")
        resume_at = body.get("resumeAt", 0)
        if (
            not isinstance(resume_at, int)
            or isinstance(resume_at, bool)
            or not 0 <= resume_at < max_tokens
        ):
            raise EngineError(
                400,
                "invalid_request",
                f"resumeAt must be an integer in 0..maxTokens-1 ({max_tokens - 1})",
                param="resumeAt",
            )
        return cls(
            rid,
            tokens,
            max_tokens,
            TtftBudget(float(budget)) if budget is not None else None,
            admission=admission,
            seed=seed,
            resume_at=resume_at,
        )


def generate_body(
    request_id: str,
    prompt: str | int,
    max_tokens: int,
    ttft_budget: TtftBudget,
    admission: Admission,
    resume_at: int = 0,
    seed: int | None = None,
) -> dict[str, Any]:
    """The gateway's ``/v1/generate`` body; ``prompt`` is the text, or the length in tokens of a
    prompt given as token ids; ``resume_at``: the output tokens the client already has of a
    stream re-offered after its entrance was lost (said only then); ``seed``: its choice's
    (:func:`choice_seed`; without it the engine draws from the prompt's)."""
    body: dict[str, Any] = {
        "requestId": request_id,
        ("prompt" if isinstance(prompt, str) else "promptTokens"): prompt,
        "maxTokens": max_tokens,
        "ttftBudget": ttft_budget.emulated_seconds,
        "admission": admission,
    }
    if resume_at:
        body["resumeAt"] = resume_at
    if seed is not None:
        body["seed"] = seed
    return body


@dataclass(frozen=True)
class PrefillRef:
    """The prefill that holds a request's KV, as it names itself to the decode it forwards to."""

    address: str  # host:port of its engine (the pull and the release go there)
    instance: str
    roce_ips: tuple[str, ...]  # its dies' RoCE addresses (a decode with a link down refuses)


def decode_body(request: GenerateRequest, prefill: PrefillRef) -> dict[str, Any]:
    """The prefill's ``/v1/decode`` body: the request (``resumeAt``: the output tokens made
    before the decode takes it, the prefill's first at least; the KV to pull covers the prompt
    and all of them but the last, which the decode's first step reads), its seed, and where its
    KV is."""
    return {
        "requestId": request.request_id,
        "promptTokens": request.prompt_tokens,
        "maxTokens": request.max_tokens,
        "seed": request.seed,
        "resumeAt": request.resume_at,
        "prefill": {
            "address": prefill.address,
            "instance": prefill.instance,
            "roceIps": list(prefill.roce_ips),
        },
    }


def parse_decode(body: Any, max_prompt: int, max_output: int) -> tuple[GenerateRequest, PrefillRef]:
    """Read a ``/v1/decode`` body; raises :class:`EngineError`."""
    if isinstance(body, dict) and "resumeAt" not in body:
        # an engine from before resumeAt (mixed versions in an upgrade): its maxTokens is what
        # is left after the prefill's first token, the request's whole output one more
        left = body.get("maxTokens", 16)
        whole = left + 1 if isinstance(left, int) and not isinstance(left, bool) else left
        body = body | {"resumeAt": 1, "maxTokens": whole}
    request = GenerateRequest.parse(body, max_prompt, max_output)
    if request.resume_at < 1:
        raise EngineError(
            400,
            "invalid_request",
            "resumeAt must be at least 1 for a decode (the prefill makes the first token)",
            param="resumeAt",
        )
    prefill = body.get("prefill")
    if not isinstance(prefill, dict) or not isinstance(prefill.get("address"), str):
        raise _invalid("prefill.address (host:port of the KV holder) is required")
    ips = prefill.get("roceIps")
    return request, PrefillRef(
        prefill["address"],
        str(prefill.get("instance") or ""),
        tuple(str(ip) for ip in ips) if isinstance(ips, list) else (),
    )


# --------------------------------------------------------------------------- stream events
@dataclass(frozen=True)
class Timings:
    """A finished request's timings (emulated seconds), as ``done`` reports them."""

    ttft: float
    prefill: float
    kv_transfer: float
    tpot_mean: float
    e2e: float

    def to_json(self) -> dict[str, float]:
        return {key: getattr(self, name) for name, key in _TIMING_KEYS}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


# (attribute, JSON key), in the order the events have always listed them
_TIMING_KEYS = tuple((f.name, _camel(f.name)) for f in fields(Timings))


def token_event(index: int, text: str, t: float) -> Event:
    """A token: its index in the output, its text, emulated seconds since the request came."""
    return {"type": "token", "index": index, "text": text, "t": t}


def done_event(
    prompt_tokens: int,
    completion_tokens: int,
    timings: Timings,
    prefill_instance: str,
    decode_instance: str,
    migrations: int = 0,
) -> Event:
    """A stream's end after its last token; ``migrations``: how many times it moved to another
    decode on the way (each time its decode was lost mid-stream)."""
    return {
        "type": "done",
        "usage": {"promptTokens": prompt_tokens, "completionTokens": completion_tokens},
        "timings": timings.to_json(),
        "instances": {"prefill": prefill_instance, "decode": decode_instance},
        "migrations": migrations,
    }


def error_event(code: str, message: str) -> Event:
    """A stream's end by failure, after it started."""
    return {"type": "error", "code": code, "message": message}


def event_type(event: object) -> str | None:
    """The event's type if it is a JSON object with a string ``type`` (else not an event)."""
    kind = event.get("type") if isinstance(event, dict) else None
    return kind if isinstance(kind, str) else None


def sse_data(event: Mapping[str, Any]) -> bytes:
    """An event as its SSE frame (``data: <json>`` and a blank line)."""
    return b"data: " + json.dumps(event).encode() + b"\n\n"
