"""The OpenAI request as the official client sends it, validated, pure.

A request body is decoded to a value or a 400 whatever its bytes (:func:`parse_json_body`). Every
parameter of ``/v1/completions`` and ``/v1/chat/completions`` is either honoured, accepted and
ignored (validated as OpenAI does; it cannot change what the emulated engines generate), or
refused with a 400 naming it unless it has its default value; a parameter OpenAI does not define
is refused too (:func:`parse_completion`). Also here: the stop-string scanner, and why a choice
finished.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from matrixserve.api.engine_protocol import count_tokens


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


# docs/gateway.md lists the parameters (a unit test keeps that table and these sets the same).
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
    """A request body's JSON value (whatever the bytes, a :class:`BadRequest`, never
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
    """Validate an OpenAI ``/v1/completions`` or ``/v1/chat/completions`` body."""
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
