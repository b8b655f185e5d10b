"""Gateway forwarding policies (P/D-Serve §3.5), pure.

- **on-demand** (ours): order the prefill entrances by the requests each is still prefilling as
  the gateway sees them (accepted, no first token yet: the prefill's own feedback, "based on the
  number of connections and prefill feedbacks"), then by fewest open SSE connections (ties keep
  the entrances' order, "organized in order"); try them one after another until one accepts or
  the TTFT budget is spent. Prefill never queues. Batch forwarding ("continuously forwards the
  requests to one idle prefill until it is busy"): the prefill that accepted last goes first
  while it is among the least busy. The engines batch prefill continuously (concurrent prompts
  share its compute, "or using chunked prefill for continuous batching"), so piling a batch onto
  one prefill while another idles would only stretch every prompt's TTFT.
- **round-robin** (baseline): the next entrance in turn.
- **least-loaded** (baseline): the entrance with the smallest queue in its last periodic report,
  which is stale between reports (the P/D-Serve baseline: "reporting the queue every 100ms").

The baselines commit to their one choice and ask the prefill to queue the request (the paper's
original version); each policy is a :class:`ForwardingPolicy` saying so, so the gateway asks the
policy instead of branching on its name. Also here, pure: the request's TTFT threshold by its
prompt's length (§2.2.2), OpenAI request validation, API keys and their rate limit.

Issue 16: a request body decoded to a value or a 400 whatever its bytes (finding 3); every
OpenAI parameter honoured, ignored or refused by name, the stop-string scanner (finding 6); the
known values metric labels take, so nothing a client or an engine sends becomes one (finding 2).
Its review: a prefill's refusal of the request itself (400, 413, 422) is the client's final
answer, worded as OpenAI does (``context_length_exceeded``), never retried into a 503; a
prefill that answered 503 is passed over for its ``Retry-After`` (:func:`engine_refusal`,
:func:`retry_after_seconds`).

Issue 31 item 2: a stream whose entrance was lost (:func:`entrance_lost`) is offered to another
entrance, at most :data:`MAX_REOFFERS` times, from where its client is (:func:`reoffer_stage`).
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from http import HTTPStatus
from typing import Any, TypeGuard

from matrixserve.api.engine_protocol import Admission, Event, TtftBudget, count_tokens


class Policy(StrEnum):
    """The gateway's forwarding policy (``--policy``): ours, or one of the two baselines."""

    ON_DEMAND = "on-demand"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class Entrance:
    """A prefill instance open to new requests (a group's ``entrances/`` in ZooKeeper)."""

    instance: str
    address: str  # host:port of the prefill's engine


def entrances_from_status(status: Mapping[str, Any] | None) -> list[Entrance]:
    """The entrances a PDGroup's status lists, with the endpoints its instance rows report: the
    gateway's route while ZooKeeper is out of reach (the last state the operator published).
    Entrances without a serving instance row or endpoint are left out."""
    if not status:
        return []
    rows = {
        r.get("name"): r
        for r in status.get("instances") or []
        if isinstance(r, Mapping) and r.get("state") == "Serving" and r.get("endpoint")
    }
    found = []
    for name in status.get("entrances") or []:
        row = rows.get(name)
        if row is not None:
            found.append(Entrance(str(name), str(row["endpoint"])))
    return found


# --------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class Loads:
    """What one gateway knows of the prefills when it orders them, for one round (its live
    counts: ordering reads them at once, without awaiting)."""

    open_streams: Mapping[str, int]  # open SSE streams per prefill
    in_prefill: Mapping[str, int] = field(default_factory=dict)  # accepted, no first token yet
    reported: Mapping[str, int] = field(default_factory=dict)  # last periodic queue reports
    last_accepted: str | None = None  # the scenario's prefill that accepted last
    turn: int = 0  # the gateway's round counter


Rank = Callable[[Sequence[Entrance], Loads], list[Entrance]]


def _by_feedback(entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
    """On-demand: fewest prompts in prefill, then fewest open streams; the prefill that accepted
    last first while it is among the least busy (batch forwarding)."""
    prefilling, streams = loads.in_prefill, loads.open_streams

    def load(e: Entrance) -> tuple[int, int]:
        return prefilling.get(e.instance, 0), streams.get(e.instance, 0)

    ranked = sorted(entrances, key=load)  # stable: ties keep the entrances' order
    last = loads.last_accepted
    if last is not None:
        sticky = [e for e in ranked if e.instance == last]
        if sticky and prefilling.get(last, 0) == prefilling.get(ranked[0].instance, 0):
            ranked = sticky + [e for e in ranked if e.instance != last]
    return ranked


def _in_turn(entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
    start = loads.turn % len(entrances)
    return [*entrances[start:], *entrances[:start]]


def _by_reports(entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
    reported = loads.reported
    return sorted(entrances, key=lambda e: reported.get(e.instance, 0))


@dataclass(frozen=True)
class ForwardingPolicy:
    """One forwarding policy: the order it tries entrances in, and what it asks of them. The
    defaults are the baselines' (one try, the prefill queues)."""

    policy: Policy
    rank: Rank
    commits: bool = True  # tries its first choice only (the prefill then queues)
    admission: Admission = "queue"  # what it asks a busy prefill to do
    skips_held: bool = False  # passes over a prefill whose every slot its own requests hold
    polls_reports: bool = False  # orders by the prefills' periodic queue reports

    def order(self, entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
        """The entrances in the order to try them."""
        if not entrances:
            return []
        return self.rank(entrances, loads)

    def choices(self, entrances: Sequence[Entrance], loads: Loads) -> list[Entrance]:
        """The entrances to try this round, in order."""
        ranked = self.order(entrances, loads)
        return ranked[:1] if self.commits else ranked


POLICIES: Mapping[Policy, ForwardingPolicy] = {
    p.policy: p
    for p in (
        ForwardingPolicy(
            Policy.ON_DEMAND, _by_feedback, commits=False, admission="reject", skips_held=True
        ),
        ForwardingPolicy(Policy.ROUND_ROBIN, _in_turn),
        ForwardingPolicy(Policy.LEAST_LOADED, _by_reports, polls_reports=True),
    )
}


def order(
    policy: Policy,
    entrances: Sequence[Entrance],
    open_streams: Mapping[str, int],
    *,
    last_accepted: str | None = None,
    turn: int = 0,
    reported_load: Mapping[str, int] | None = None,
    in_prefill: Mapping[str, int] | None = None,
) -> list[Entrance]:
    """The entrances in the order ``policy`` tries them."""
    loads = Loads(open_streams, in_prefill or {}, reported_load or {}, last_accepted, turn)
    return POLICIES[policy].order(entrances, loads)


# --------------------------------------------------------------------------- OpenAI requests
class BadRequest(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str = "invalid_request",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


estimate_tokens = count_tokens  # the prompt's tokens as the engines count them


def ttft_threshold_ms(base_ms: float, per_1k_tokens_ms: float, prompt_tokens: int) -> float:
    """A prompt's TTFT threshold: P/D-Serve §2.2.2 has thresholds depend on the prompt's length
    ("the timeout threshold for 1k is quite different from that of 8k"); here a base plus a part
    per thousand prompt tokens (``slo.ttftMilliseconds`` + ``slo.ttftMillisecondsPer1kTokens``)."""
    return base_ms + per_1k_tokens_ms * prompt_tokens / 1000.0


def request_budget(
    slos: Iterable[tuple[int | None, int]], prompt_tokens: int, default_ms: int
) -> TtftBudget:
    """A request's TTFT budget: the tightest threshold, for a prompt of this length, among the
    groups serving its scenario that set one (``(ttftMilliseconds, per 1k tokens)`` each);
    ``default_ms`` if none does."""
    return TtftBudget.from_milliseconds(
        min(
            (
                ttft_threshold_ms(base or 0, per_1k, prompt_tokens)
                for base, per_1k in slos
                if base or per_1k
            ),
            default=float(default_ms),
        )
    )


# Issue 16, finding 6: the OpenAI request as the official client sends it. Every parameter is
# either honoured, accepted and ignored (validated as OpenAI does; it cannot change what the
# emulated engines generate), or refused with a 400 naming it unless it has its default value;
# a parameter OpenAI does not define is refused too. docs/gateway.md lists them (a unit test
# keeps that table and these sets the same).
DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 16  # prompts x n per request: each choice is a prefill slot of its own
MAX_MODEL_CHARS = 256  # the model is echoed in every chunk
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1
# JSON's own encodings (RFC 7159 §8.1) and ASCII, its subset; any other charset is refused
JSON_CHARSETS = frozenset(
    {
        "utf-8",
        "utf-8-sig",
        "utf-16",
        "utf-16-le",
        "utf-16-be",
        "utf-32",
        "utf-32-le",
        "utf-32-be",
        "ascii",
    }
)


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engines get it: its text, or (a prompt given as token ids) its length
    alone (the engines count tokens, they read no text)."""

    text: str | None
    tokens: int

    @classmethod
    def of_text(cls, text: str) -> Prompt:
        return cls(text, count_tokens(text))


@dataclass(frozen=True)
class Completion:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` request."""

    model: str
    prompts: tuple[Prompt, ...]  # one for a chat; a completion may give several
    max_tokens: int
    stream: bool
    chat: bool
    n: int = 1  # choices per prompt
    stop: tuple[str, ...] = ()
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> Prompt:
        """Choice ``index``'s prompt: OpenAI numbers the choices prompt by prompt, ``n`` each."""
        return self.prompts[index // self.n]


def parse_json_body(raw: bytes, charset: str | None) -> object:
    """A request body's JSON value (finding 3: whatever the bytes, a :class:`BadRequest`, never
    an exception of the decoder's: an unknown or non-JSON charset, bytes that are not in it,
    nesting past the parser's depth, an integer past Python's 4,300 digits, not JSON at all)."""
    name = (charset or "utf-8").strip().lower()
    try:
        known = codecs.lookup(name).name in JSON_CHARSETS
    except (LookupError, ValueError):  # ValueError: a NUL or a surrogate in the name
        known = False
    if not known:
        raise BadRequest(
            f"the body's charset {name[:40]!r} is not one JSON is written in (send UTF-8)",
            code="unsupported_charset",
        )
    try:
        return json.loads(raw.decode(name))
    except UnicodeError:
        raise BadRequest(f"the request body is not valid {name}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("the request body nests too deeply", code="invalid_json") from None
    except ValueError:
        raise BadRequest("the request body is not valid JSON", code="invalid_json") from None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Ignored:
    """A parameter accepted and validated, with no effect on what is generated."""

    accepts: Callable[[object], bool]
    expected: str  # what the 400 says it must be

    def check(self, name: str, value: object) -> None:
        if value is not None and not self.accepts(value):
            raise BadRequest(f"'{name}' must be {self.expected}", name)


def _between(low: float, high: float) -> Ignored:
    # a NaN is never in range: refused, as OpenAI does
    return Ignored(lambda v: _is_number(v) and low <= v <= high, f"a number in {low:g}..{high:g}")


def _string_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


@dataclass(frozen=True)
class Refused:
    """A feature this gateway does not have: only its defaults (``null`` and these) pass."""

    defaults: tuple[object, ...] = ()

    def check(self, name: str, value: object) -> None:
        if value is None or any(type(value) is type(d) and value == d for d in self.defaults):
            return
        allowed = " or ".join(["null", *(json.dumps(d) for d in self.defaults)])
        raise BadRequest(
            f"'{name}' is not supported by this gateway (leave it out, or send {allowed})",
            name,
            code="unsupported_parameter",
        )


_STRING = Ignored(lambda v: isinstance(v, str), "a string")
_BOOLEAN = Ignored(lambda v: isinstance(v, bool), "a boolean")
# honoured: parsed by parse_completion
SUPPORTED_BOTH = frozenset({"model", "max_tokens", "stream", "stream_options", "n", "stop"})
SUPPORTED_CHAT = SUPPORTED_BOTH | {"messages", "max_completion_tokens"}
SUPPORTED_COMPLETIONS = SUPPORTED_BOTH | {"prompt"}
_IGNORED_BOTH: Mapping[str, Ignored] = {
    "temperature": _between(0, 2),
    "top_p": _between(0, 1),
    "presence_penalty": _between(-2, 2),
    "frequency_penalty": _between(-2, 2),
    "seed": Ignored(_is_int, "an integer"),
    "user": _STRING,
}
IGNORED_CHAT: Mapping[str, Ignored] = {
    **_IGNORED_BOTH,
    "metadata": Ignored(_string_map, "an object of strings"),
    "store": _BOOLEAN,
    "service_tier": _STRING,
    "parallel_tool_calls": _BOOLEAN,
    "prompt_cache_key": _STRING,
    "prompt_cache_retention": _STRING,
    "safety_identifier": _STRING,
}
IGNORED_COMPLETIONS: Mapping[str, Ignored] = _IGNORED_BOTH
REFUSED_CHAT: Mapping[str, Refused] = {
    "logit_bias": Refused(({},)),
    "logprobs": Refused((False,)),
    "top_logprobs": Refused(),
    "tools": Refused(([],)),
    "tool_choice": Refused(("none",)),
    "functions": Refused(([],)),
    "function_call": Refused(("none",)),
    "response_format": Refused(({"type": "text"},)),
    "modalities": Refused((["text"],)),
    "audio": Refused(),
    "prediction": Refused(),
    "reasoning_effort": Refused(),
    "verbosity": Refused(),
    "web_search_options": Refused(),
}
REFUSED_COMPLETIONS: Mapping[str, Refused] = {
    "logit_bias": Refused(({},)),
    "logprobs": Refused(),
    "echo": Refused((False,)),
    "best_of": Refused((1,)),
    "suffix": Refused(("",)),
}


def _check_parameters(body: Mapping[str, object], chat: bool) -> None:
    supported = SUPPORTED_CHAT if chat else SUPPORTED_COMPLETIONS
    ignored = IGNORED_CHAT if chat else IGNORED_COMPLETIONS
    refused = REFUSED_CHAT if chat else REFUSED_COMPLETIONS
    for name, value in body.items():
        if name in supported:
            continue
        rule = ignored.get(name) or refused.get(name)
        if rule is None:
            raise BadRequest(
                f"unrecognized request argument {name[:64]!r}",
                name[:64],
                code="unknown_parameter",
            )
        rule.check(name, value)


def _content(content: object, role: str, where: str) -> str:
    """A message's text: a string, an array of text parts, or (an assistant's) null."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # it called tools instead of answering
        return ""
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content must be a string or an array of text parts", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if isinstance(kind, str) and kind != "text":
            raise BadRequest(
                f"{where}.content[{j}] is a {kind[:40]!r} part; only text parts are supported",
                f"{where}.content[{j}]",
                code="unsupported_content",
            )
        raise BadRequest(
            f'{where}.content[{j}] must be {{"type": "text", "text": <string>}}',
            f"{where}.content[{j}]",
        )
    return "".join(texts)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _chat_prompt(messages: object) -> Prompt:
    """The conversation as one prompt (the engines count its tokens)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages")
    lines = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}", f"{where}.role"
            )
        content = _content(message.get("content"), role, where)
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise BadRequest(f"{where}: a tool message needs a string tool_call_id", where)
        if not isinstance(message.get("name", ""), str):
            raise BadRequest(f"{where}.name must be a string", f"{where}.name")
        lines.append(f"{role}: {content}")
    return Prompt.of_text("\n".join(lines))


def _token_prompt(ids: list[object], where: str) -> Prompt:
    if not ids or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise BadRequest(f"'{where}' must be a non-empty array of token ids (integers)", where)
    return Prompt(None, len(ids))


def _prompts(raw: object) -> tuple[Prompt, ...]:
    """A completion's prompts: a string, an array of strings, an array of token ids, or an
    array of arrays of token ids (one choice each)."""
    if isinstance(raw, str) and raw:
        return (Prompt.of_text(raw),)
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            for i, p in enumerate(raw):
                if not p:
                    raise BadRequest(f"prompt[{i}] must not be empty", f"prompt[{i}]")
            return tuple(Prompt.of_text(p) for p in raw)
        if all(isinstance(p, list) for p in raw):
            return tuple(_token_prompt(p, f"prompt[{i}]") for i, p in enumerate(raw))
        return (_token_prompt(raw, "prompt"),)
    raise BadRequest(
        "'prompt' must be a non-empty string, an array of strings, an array of token ids or "
        "an array of arrays of token ids",
        "prompt",
    )


def _check_sizes(prompts: Sequence[Prompt], max_prompt_chars: int, field: str) -> None:
    """Each prompt within ``max_prompt_chars`` (a prompt of token ids: within the tokens a text
    of that many characters counts); ``field``: where the prompts came from."""
    for i, prompt in enumerate(prompts):
        where = field if len(prompts) == 1 else f"{field}[{i}]"
        if prompt.text is not None and len(prompt.text) > max_prompt_chars:
            size = f"{len(prompt.text)} characters; at most {max_prompt_chars} are accepted"
        elif prompt.text is None and prompt.tokens > count_tokens(" " * max_prompt_chars):
            size = f"{prompt.tokens} tokens; at most as many as {max_prompt_chars} characters"
        else:
            continue
        # 400 context_length_exceeded, as OpenAI answers (and as an engine's 413 reaches the
        # client): the openai client raises BadRequestError for it
        raise BadRequest(f"the {where} has {size}", where, code="context_length_exceeded")


def _max_tokens(body: Mapping[str, object], chat: bool, limit: int) -> int:
    value, name = body.get("max_tokens"), "max_tokens"
    newer = body.get("max_completion_tokens") if chat else None
    if newer is not None:
        if value is not None and value != newer:
            raise BadRequest(
                "give max_tokens or max_completion_tokens, not two different values",
                "max_completion_tokens",
            )
        value, name = newer, "max_completion_tokens"
    if value is None:
        return min(DEFAULT_MAX_TOKENS, limit)
    if _is_int(value) and 1 <= value <= limit:
        return value
    raise BadRequest(f"'{name}' must be an integer in 1..{limit}", name)


def _stop(raw: object) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else None
    if raw is None:
        return ()
    if (
        stops is None
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise BadRequest(
            f"'stop' must be a string or an array of at most {MAX_STOP_STRINGS} strings, each "
            f"of 1..{MAX_STOP_CHARS} characters",
            "stop",
        )
    return tuple(stops)


def _include_usage(raw: object, stream: bool) -> bool:
    if raw is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(raw, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    for key in raw:
        if key != "include_usage":
            raise BadRequest(
                f"unrecognized stream option {str(key)[:64]!r}",
                "stream_options",
                code="unknown_parameter",
            )
    include = raw.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean", "stream_options")
    return bool(include)


def _choices_per_prompt(n: object) -> int:
    if n is None:
        return 1
    if _is_int(n) and n >= 1:
        return n
    raise BadRequest("'n' must be an integer >= 1", "n")


def parse_completion(
    body: object,
    chat: bool,
    max_prompt_chars: int,
    max_tokens_limit: int,
    max_choices: int = MAX_CHOICES,
) -> Completion:
    """Validate an OpenAI ``/v1/completions`` or ``/v1/chat/completions`` body (finding 6)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_parameters(body, chat)
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS:
        raise BadRequest(
            f"'model' is required: a string of 1..{MAX_MODEL_CHARS} characters", "model"
        )
    prompts = (_chat_prompt(body.get("messages")),) if chat else _prompts(body.get("prompt"))
    _check_sizes(prompts, max_prompt_chars, "messages" if chat else "prompt")
    max_tokens = _max_tokens(body, chat, max_tokens_limit)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    n = _choices_per_prompt(body.get("n"))
    if len(prompts) * n > max_choices:
        raise BadRequest(
            f"at most {max_choices} choices per request (prompts x n)", "n" if n > 1 else "prompt"
        )
    return Completion(
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        stream=bool(stream),
        chat=chat,
        n=n,
        stop=_stop(body.get("stop")),
        include_usage=_include_usage(body.get("stream_options"), bool(stream)),
    )


class StopScanner:
    """Where a choice's text meets its first stop string, across tokens: text is passed on as
    it comes but for a tail that could begin a stop string, held until the next token tells.
    As OpenAI, the stop string itself is not returned."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text to pass on now, and whether a stop string ended the choice (the text is
        then what came before it)."""
        buffer = self.held + text
        found = [at for at in (buffer.find(s) for s in self.stops) if at >= 0]
        if found:
            self.held = ""
            return buffer[: min(found)], True
        keep = max(_prefix_at_end(buffer, s) for s in self.stops)
        self.held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """What is held when the choice ends without its stop string."""
        held, self.held = self.held, ""
        return held


def _prefix_at_end(text: str, stop: str) -> int:
    """The length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def finish_reason(completion_tokens: int, max_tokens: int) -> str:
    """Why a choice the engine ended stopped: ``length`` at ``max_tokens``, else ``stop`` (the
    model's own end of sequence)."""
    return "length" if completion_tokens >= max_tokens else "stop"


# --------------------------------------------------------------------------- a lost entrance
# Issue 31 item 2: what the gateway does when the entrance serving a choice is lost. A decode
# lost behind it is the prefill's to mend (enginestub.engine.migration: the prefill sees it,
# holds the request and maybe its KV); a lost entrance breaks the one stream the gateway has,
# and only the gateway can offer the request again. Before the first token that is on-demand
# forwarding again within the TTFT budget (P/D-Serve §3.5); after it, the new entrance is told
# where the client is (``resumeAt``) and re-prefills the prompt with the tokens already sent.

MAX_REOFFERS = 2  # offers of one choice to another entrance after its own was lost
# an entrance's stream ended by one of these, naming no decode: the entrance itself is gone
# (killed: the stream cut; faulty, hung or logically removed: its own error)
ENTRANCE_LOST_CODES = frozenset(
    {"upstream_failed", "stream_interrupted", "instance_removed", "device_fault", "engine_hung"}
)


class ReofferStage(StrEnum):
    """Where a choice was when its entrance was lost (the ``stage`` label of
    ``matrixserve_gateway_migrations_total``)."""

    BEFORE_FIRST_TOKEN = "before_first_token"
    MID_STREAM = "mid_stream"


class ReofferOutcome(StrEnum):
    """How the offer ended (the ``outcome`` label)."""

    MOVED = "moved"  # another entrance took it; its stream goes on
    NO_CAPACITY = "no_capacity"  # none took it within the budget
    BOUND = "bound"  # offered MAX_REOFFERS times already
    REFUSED = "refused"  # an entrance refused it (400/413), or did not resume where it was


def entrance_lost(event: Event) -> bool:
    """Whether a stream's last event says its entrance (the prefill and its relay) was lost,
    not a decode behind it: a decode's failure comes named (the prefill could not move it:
    another entrance of the group would meet the same decodes)."""
    if event.get("type") != "error" or event.get("code") not in ENTRANCE_LOST_CODES:
        return False
    said = event.get("instances")
    return not (isinstance(said, dict) and said.get("decode"))


def reoffer_stage(event: Event, tokens: int, max_tokens: int) -> ReofferStage | None:
    """Where a choice whose stream ended with ``event`` after ``tokens`` of its ``max_tokens``
    tokens is re-offered from; None when it is not (its end stands: not an entrance's loss, or
    nothing was left to serve)."""
    if not entrance_lost(event) or tokens >= max_tokens:
        return None
    return ReofferStage.BEFORE_FIRST_TOKEN if tokens == 0 else ReofferStage.MID_STREAM


# --------------------------------------------------------------------------- metric labels
# Issue 16, finding 2: nothing a client or an engine sends becomes a label value; each label
# takes its values from a known set, so a scrape never fails and the series stay bounded.
UNKNOWN_SCENARIO = "_unknown"  # not a DNS label, so never a routed scenario's name
ENGINE_ERROR_CODES = frozenset(
    {
        "ttft_timeout",
        "kv_exhausted",
        "kv_pull_failed",
        "device_fault",
        "no_decode",
        "decode_failed",
        "unknown_request",
        "upstream_failed",
        "stream_interrupted",
    }
)
_HTTP_STATUSES = frozenset(int(s) for s in HTTPStatus)


def error_code(code: object) -> str:
    """An engine's error code as the gateway passes it on, to clients and as a label: one it
    knows, else ``engine_error``."""
    return code if isinstance(code, str) and code in ENGINE_ERROR_CODES else "engine_error"


def answer_label(status: int) -> str:
    """A prefill's HTTP answer other than accepted or busy, as a label: a status HTTP defines
    (``http_<code>``), else ``http_other``."""
    return f"http_{status}" if status in _HTTP_STATUSES else "http_other"


# --------------------------------------------------------------------------- engine refusals
# A prefill's answer that refuses the request itself: the same request is refused by every
# prefill (the engines of a scenario run one model with one set of limits), so it is final.
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


# --------------------------------------------------------------------------- API keys
@dataclass
class TokenBucket:
    """Per-key rate limit: ``rate`` requests per second, bursts up to ``burst``."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def retry_after(self) -> float:
        return max(0.0, (1.0 - self.tokens) / self.rate)

    def retry_after_header(self) -> str:
        """``Retry-After`` as RFC 9110 writes it: whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after())))


def parse_keys(data: dict[str, str]) -> dict[str, str]:
    """A Secret's data (already decoded): entry name -> API key. Returns key -> entry name."""
    keys = {}
    for name, value in data.items():
        key = value.strip()
        if len(key) < 16:
            raise ValueError(f"API key {name!r} is shorter than 16 characters")
        keys[key] = name
    return keys


def bearer(header: str | None) -> str | None:
    if not header or not header.startswith("Bearer "):
        return None
    return header[len("Bearer ") :].strip() or None
