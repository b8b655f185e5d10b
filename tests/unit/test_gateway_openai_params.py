"""The OpenAI request as the gateway reads it (issue 16, findings 3 and 6), pure: every
parameter honoured, ignored (validated) or refused with a 400 naming it; bodies decoded to a 400,
never an exception; stop strings found across tokens; the metric labels bounded; and
docs/gateway.md's parameter table true to the code."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from matrixserve.domain.gateway import completions, labels
from matrixserve.domain.gateway.completions import BadRequest, Prompt, StopScanner, parse_completion

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "general", "messages": [{"role": "user", "content": "hi"}], **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "general", "prompt": "hello", **extra}


def parse(body: Any, is_chat: bool = True, max_choices: int = 16) -> completions.Completion:
    return parse_completion(body, is_chat, 1000, 100, max_choices)


def refused(body: Any, is_chat: bool = True) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse(body, is_chat)
    error = err.value.body()["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    return err.value


# --------------------------------------------------------------------------- honoured
def test_max_completion_tokens_is_honoured_and_may_not_contradict_max_tokens() -> None:
    assert parse(chat(max_completion_tokens=7)).max_tokens == 7
    assert parse(chat(max_completion_tokens=7, max_tokens=7)).max_tokens == 7
    assert parse(chat(max_completion_tokens=None, max_tokens=5)).max_tokens == 5
    error = refused(chat(max_completion_tokens=7, max_tokens=8))
    assert error.param == "max_completion_tokens"
    assert refused(chat(max_completion_tokens=0)).param == "max_completion_tokens"
    assert refused(completion(max_completion_tokens=5), is_chat=False).code == "unknown_parameter"


def test_nulls_are_the_defaults() -> None:
    c = parse(chat(max_tokens=None, stream=None, n=None, stop=None, stream_options=None, user=None))
    assert (c.max_tokens, c.stream, c.n, c.stop, c.include_usage) == (16, False, 1, (), False)


def test_n_gives_choices_per_prompt_in_openai_order() -> None:
    c = parse(completion(prompt=["a", "bb"], n=3), is_chat=False)
    assert c.choices == 6
    assert [c.prompt_of(i).text for i in range(6)] == ["a"] * 3 + ["bb"] * 3
    for bad in (0, -1, True, 1.5, "2"):
        assert refused(chat(n=bad)).param == "n"
    assert refused(chat(n=17)).param == "n"  # over the choices per request
    assert refused(completion(prompt=["x"] * 17), is_chat=False).param == "prompt"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abcdefgh", (Prompt("abcdefgh", 2),)),
        (["a", "bcdef"], (Prompt("a", 1), Prompt("bcdef", 2))),
        ([1, 2, 3], (Prompt(None, 3),)),
        ([[1, 2], [3]], (Prompt(None, 2), Prompt(None, 1))),
    ],
    ids=["text", "texts", "token-ids", "lists-of-token-ids"],
)
def test_completion_prompts_in_every_openai_form(prompt: Any, expected: tuple[Prompt, ...]) -> None:
    assert parse(completion(prompt=prompt), is_chat=False).prompts == expected


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ("", "prompt"),
        ([], "prompt"),
        ([[]], "prompt[0]"),
        ([[1], [2, "x"]], "prompt[1]"),
        ([1, "a"], "prompt"),
        ([-1], "prompt"),
        ([True], "prompt"),
        ([2**31], "prompt"),
        (["a", ""], "prompt[1]"),
        ({"text": "a"}, "prompt"),
        (7, "prompt"),
    ],
)
def test_malformed_prompts_are_refused_naming_the_prompt(prompt: Any, param: str) -> None:
    assert refused(completion(prompt=prompt), is_chat=False).param == param


def test_a_token_prompt_is_bounded_as_a_text_of_the_size_limit_is() -> None:
    assert parse(completion(prompt=[1] * 250), is_chat=False).prompts == (Prompt(None, 250),)
    error = refused(completion(prompt=[[1], [1] * 251]), is_chat=False)
    assert (error.status, error.param, error.code) == (400, "prompt[1]", "context_length_exceeded")


def test_a_conversation_over_the_size_limit_names_the_messages() -> None:
    error = refused(chat(messages=[{"role": "user", "content": "x" * 1000}]))
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")


def test_message_content_as_text_parts_null_for_an_assistant_and_tool_messages() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "developer", "content": "x", "name": "dev"},
    ]
    (prompt,) = parse(chat(messages=messages)).prompts
    assert prompt.text == "system: be brief\nuser: ab\nassistant: \ntool: 42\ndeveloper: x"


@pytest.mark.parametrize(
    ("message", "param", "code"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0]",
            "unsupported_content",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0]", None),
        ({"role": "user", "content": [7]}, "messages[0].content[0]", None),
        ({"role": "user", "content": None}, "messages[0].content", None),
        ({"role": "user", "content": {"text": "x"}}, "messages[0].content", None),
        ({"role": "robot", "content": "x"}, "messages[0].role", None),
        ({"role": ["user"], "content": "x"}, "messages[0].role", None),
        ({"role": "tool", "content": "x"}, "messages[0]", None),
        ({"role": "user", "content": "x", "name": 5}, "messages[0].name", None),
        ("hello", "messages[0]", None),
    ],
)
def test_malformed_messages_are_refused_naming_the_part(
    message: Any, param: str, code: str | None
) -> None:
    error = refused(chat(messages=[message]))
    assert error.param == param
    assert error.code == (code or "invalid_request")


def test_stop_strings_are_parsed_and_bounded() -> None:
    assert parse(chat(stop="END")).stop == ("END",)
    assert parse(chat(stop=["a", "b"])).stop == ("a", "b")
    assert parse(chat(stop=[])).stop == ()
    for bad in ("", [""], ["a"] * 5, [1], {"a": 1}, "x" * 257):
        assert refused(chat(stop=bad)).param == "stop"


def test_include_usage_only_with_a_stream() -> None:
    assert parse(chat(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse(chat(stream=True, stream_options={})).include_usage
    assert refused(chat(stream_options={"include_usage": True})).param == "stream_options"
    assert refused(chat(stream=True, stream_options={"include_usage": 1})).param == (
        "stream_options"
    )
    error = refused(chat(stream=True, stream_options={"other": True}))
    assert (error.param, error.code) == ("stream_options", "unknown_parameter")
    assert refused(chat(stream=True, stream_options=[])).param == "stream_options"


# --------------------------------------------------------------------------- ignored, refused
def test_harmless_parameters_are_accepted_within_openai_ranges() -> None:
    parse(
        chat(
            temperature=0,
            top_p=1,
            presence_penalty=-2,
            frequency_penalty=2.0,
            seed=7,
            user="u",
            metadata={"k": "v"},
            store=False,
            service_tier="auto",
            parallel_tool_calls=True,
            prompt_cache_key="k",
            safety_identifier="s",
        )
    )
    parse(completion(temperature=2, top_p=0.5, seed=-1, user="u"), is_chat=False)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", 2.01),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", 1.5),
        ("top_p", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("seed", 1.5),
        ("user", 5),
        ("metadata", {"k": 1}),
        ("metadata", ["k"]),
        ("store", "yes"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(name: str, value: Any) -> None:
    error = refused(chat(**{name: value}))
    assert (error.status, error.param) == (400, name)


@pytest.mark.parametrize(
    ("name", "value", "is_chat"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}], True),
        ("tool_choice", "auto", True),
        ("functions", [{"name": "f"}], True),
        ("function_call", "auto", True),
        ("logprobs", True, True),
        ("top_logprobs", 2, True),
        ("response_format", {"type": "json_object"}, True),
        ("modalities", ["text", "audio"], True),
        ("audio", {"voice": "x"}, True),
        ("logit_bias", {"50256": -100}, True),
        ("reasoning_effort", "low", True),
        ("logprobs", 0, True),  # not false: 0 is not a boolean
        ("echo", True, False),
        ("best_of", 2, False),
        ("best_of", True, False),
        ("suffix", "end", False),
        ("logprobs", 2, False),
    ],
)
def test_unsupported_features_are_refused_not_ignored(name: str, value: Any, is_chat: bool) -> None:
    error = refused((chat if is_chat else completion)(**{name: value}), is_chat)
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")


@pytest.mark.parametrize(
    ("name", "value", "is_chat"),
    [
        ("tools", [], True),
        ("tool_choice", "none", True),
        ("logprobs", False, True),
        ("response_format", {"type": "text"}, True),
        ("modalities", ["text"], True),
        ("logit_bias", {}, True),
        ("echo", False, False),
        ("best_of", 1, False),
        ("suffix", "", False),
        ("logprobs", None, False),
    ],
)
def test_unsupported_features_at_their_defaults_pass(name: str, value: Any, is_chat: bool) -> None:
    parse((chat if is_chat else completion)(**{name: value}), is_chat)


def test_an_unknown_parameter_is_refused() -> None:
    error = refused(chat(top_k=5))
    assert (error.param, error.code) == ("top_k", "unknown_parameter")
    assert refused(chat(messages=None, prompt="x")).param == "prompt"


def test_the_model_is_a_bounded_string() -> None:
    assert parse(chat(model="m" * 256)).model == "m" * 256
    for bad in ("", "m" * 257, None, 5, ["m"]):
        assert refused(chat(model=bad)).param == "model"


# --------------------------------------------------------------------------- bodies
@pytest.mark.parametrize(
    ("raw", "charset", "code"),
    [
        (b"[" * 100_000, None, "invalid_json"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, None, "invalid_json"),
        (b'{"model": "m"}', "no-such-charset", "unsupported_charset"),
        (b'{"model": "m"}', "rot13", "unsupported_charset"),
        (b'{"model": "m"}', "latin-1", "unsupported_charset"),
        (b'{"model": "m"}', "utf-8\x00", "unsupported_charset"),
        (b'{"model": "m"}', "\ud800", "unsupported_charset"),
        (b'{"model": "\xff"}', None, "invalid_json"),
        (b'{"model": 1' + b"1" * 5000 + b"}", None, "invalid_json"),
        (b"{not json", None, "invalid_json"),
        (b"", None, "invalid_json"),
        (b"\x00\x01", "utf-16", "invalid_json"),
    ],
    ids=[
        "deep-array",
        "deep-object",
        "unknown-charset",
        "not-a-text-codec",
        "not-a-json-charset",
        "nul-in-charset",
        "surrogate-charset",
        "bad-utf8",
        "5000-digit-int",
        "not-json",
        "empty",
        "bad-utf16",
    ],
)
def test_any_body_decodes_to_a_value_or_a_bad_request(
    raw: bytes, charset: str | None, code: str
) -> None:
    with pytest.raises(BadRequest) as err:
        completions.parse_json_body(raw, charset)
    assert (err.value.status, err.value.code) == (400, code)


@given(st.binary(max_size=64), st.none() | st.text(max_size=12) | st.sampled_from(["utf-16"]))
def test_any_bytes_in_any_charset_decode_or_are_a_bad_request(
    raw: bytes, charset: str | None
) -> None:
    try:
        completions.parse_json_body(raw, charset)
    except BadRequest as exc:  # anything else fails the test
        assert exc.status == 400  # noqa: PT017


def test_json_in_its_own_encodings_decodes() -> None:
    body = {"model": "m", "prompt": "ünï"}
    for charset in ("utf-8", "UTF8", "utf-16", "utf-32-le", "us-ascii"):
        encoded = json.dumps(body, ensure_ascii=charset == "us-ascii").encode(
            "ascii" if charset == "us-ascii" else charset
        )
        assert completions.parse_json_body(encoded, charset) == body
    assert completions.parse_json_body(b'"\\ud800"', None) == "\ud800"  # a lone surrogate is JSON


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists, max_leaves=8))
def test_any_json_value_parses_or_is_a_bad_request(value: Any) -> None:
    statuses = []
    for body in (value, {"model": "m", "prompt": value}, {"model": "m", "messages": value}):
        for is_chat in (True, False):
            try:
                parse(body, is_chat)
            except BadRequest as exc:  # anything else fails the test
                statuses.append(exc.status)
    assert all(400 <= status < 500 for status in statuses)


# --------------------------------------------------------------------------- stop strings
def cut(tokens: list[str], stops: list[str]) -> tuple[str, bool]:
    """What OpenAI returns: generation stops at the first token after which the text holds a
    stop string (a longer one begun earlier but not complete by then does not count: the text
    after that token is never generated), and the text is cut before it."""
    text = ""
    for token in tokens:
        text += token
        found = [at for at in (text.find(s) for s in stops) if at >= 0]
        if found:
            return text[: min(found)], True
    return text, False


@given(
    st.lists(st.text("ab\n", max_size=4), max_size=12),
    st.lists(st.text("ab\n", min_size=1, max_size=3), min_size=1, max_size=4),
)
@example(["b", "\n", "b"], ["\n", "b\nb"])  # "\n" ends first: "b\nb" is never generated
def test_a_stop_string_is_found_across_tokens(tokens: list[str], stops: list[str]) -> None:
    scanner = StopScanner(stops)
    passed, stopped = "", False
    for token in tokens:
        piece, stopped = scanner.feed(token)
        passed += piece
        if stopped:
            break
    if not stopped:
        passed += scanner.flush()
    assert (passed, stopped) == cut(tokens, stops)


def test_text_that_may_begin_a_stop_string_is_held_until_the_next_token_tells() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("the E") == ("the ", False)
    assert scanner.feed("N") == ("", False)
    assert scanner.feed("ough") == ("ENough", False)
    assert scanner.feed(" EN") == (" ", False)
    assert scanner.feed("D and more") == ("", True)


def test_the_finish_reason_is_length_at_max_tokens() -> None:
    assert completions.finish_reason(16, 16) == "length"
    assert completions.finish_reason(3, 16) == "stop"


# --------------------------------------------------------------------------- metric labels
def test_an_engines_error_code_and_answer_become_known_labels_only() -> None:
    assert labels.error_code("ttft_timeout") == "ttft_timeout"
    for hostile in ("\ud800", "x" * 10_000, None, 5, {"a": 1}, "made-up"):
        assert labels.error_code(hostile) == "engine_error"
    assert labels.answer_label(503) == "http_503"
    assert {labels.answer_label(s) for s in range(0, 1000)} <= {
        f"http_{s}" for s in range(100, 600)
    } | {"http_other"}
    assert labels.answer_label(599) == labels.answer_label(999) == "http_other"
    assert not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", labels.UNKNOWN_SCENARIO)


# --------------------------------------------------------------------------- the docs' table
def _documented() -> dict[str, tuple[str, str]]:
    """docs/gateway.md's parameter table: name -> (chat, completions)."""
    text = DOCS.read_text()
    section = text[text.index("## OpenAI parameters") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([a-z_]+)` \| (\w+|—) \| (\w+|—) \|", section, re.MULTILINE)
    assert rows, "no parameter rows found"
    return {name: (on_chat, on_completions) for name, on_chat, on_completions in rows}


def _handling(name: str, is_chat: bool) -> str:
    if name in (completions.SUPPORTED_CHAT if is_chat else completions.SUPPORTED_COMPLETIONS):
        return "supported"
    if name in (completions.IGNORED_CHAT if is_chat else completions.IGNORED_COMPLETIONS):
        return "ignored"
    if name in (completions.REFUSED_CHAT if is_chat else completions.REFUSED_COMPLETIONS):
        return "refused"
    return "—"


def test_the_docs_parameter_table_is_the_codes() -> None:
    in_code = (
        completions.SUPPORTED_CHAT
        | completions.SUPPORTED_COMPLETIONS
        | set(completions.IGNORED_CHAT)
        | set(completions.IGNORED_COMPLETIONS)
        | set(completions.REFUSED_CHAT)
        | set(completions.REFUSED_COMPLETIONS)
    )
    documented = _documented()
    assert set(documented) == in_code
    for name, (on_chat, on_completions) in documented.items():
        assert (on_chat, on_completions) == (_handling(name, True), _handling(name, False)), name
