"""Gateway policies and OpenAI request validation (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from matrixserve.domain.gateway.completions import (
    BadRequest,
    Prompt,
    estimate_tokens,
    parse_completion,
)
from matrixserve.domain.gateway.routing import (
    POLICIES,
    Entrance,
    Loads,
    Policy,
    entrances_from_status,
    order,
    ttft_threshold_ms,
)

E = [Entrance("p0", "a:1"), Entrance("p1", "b:1"), Entrance("p2", "c:1")]


def names(entrances: list[Entrance]) -> list[str]:
    return [e.instance for e in entrances]


def test_on_demand_prefers_fewest_open_streams_keeping_the_order_on_ties() -> None:
    assert names(order(Policy.ON_DEMAND, E, {"p0": 3, "p1": 1, "p2": 1})) == ["p1", "p2", "p0"]
    assert names(order(Policy.ON_DEMAND, E, {})) == ["p0", "p1", "p2"]


def test_on_demand_keeps_feeding_the_prefill_that_accepted_last_while_it_is_least_busy() -> None:
    assert names(order(Policy.ON_DEMAND, E, {"p0": 5}, last_accepted="p0")) == ["p0", "p1", "p2"]
    busy = {"p0": 1}
    assert names(order(Policy.ON_DEMAND, E, {}, last_accepted="p0", in_prefill=busy)) == [
        "p1",
        "p2",
        "p0",
    ]


def test_on_demand_prefers_the_prefill_with_fewest_prompts_still_prefilling() -> None:
    ranked = order(Policy.ON_DEMAND, E, {"p1": 9, "p2": 1}, in_prefill={"p0": 2, "p2": 1})
    assert names(ranked) == ["p1", "p2", "p0"]


def test_round_robin_rotates() -> None:
    assert [names(order(Policy.ROUND_ROBIN, E, {}, turn=t))[0] for t in range(4)] == [
        "p0",
        "p1",
        "p2",
        "p0",
    ]


def test_least_loaded_follows_the_last_reports_even_when_stale() -> None:
    assert (
        names(order(Policy.LEAST_LOADED, E, {"p2": 99}, reported_load={"p0": 4, "p1": 0, "p2": 7}))[
            0
        ]
        == "p1"
    )


def test_no_entrances_no_order() -> None:
    assert order(Policy.ON_DEMAND, [], {}) == []


def ok(**extra: Any) -> dict[str, Any]:
    return {"model": "general", "prompt": "hello", **extra}


def test_completion_and_chat_bodies_parse() -> None:
    c = parse_completion(ok(max_tokens=5, stream=True), False, 1000, 100)
    assert (c.model, c.prompts, c.max_tokens, c.stream, c.chat) == (
        "general",
        (Prompt("hello", 2),),
        5,
        True,
        False,
    )
    chat = parse_completion(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True, 1000, 100
    )
    assert chat.prompts == (Prompt.of_text("user: hi"),)
    assert chat.max_tokens == 16


@pytest.mark.parametrize(
    ("body", "chat", "param", "status"),
    [
        ([], False, None, 400),
        ({"prompt": "x"}, False, "model", 400),
        (ok(prompt=""), False, "prompt", 400),
        (ok(prompt=5), False, "prompt", 400),
        (ok(max_tokens=0), False, "max_tokens", 400),
        (ok(max_tokens=10**9), False, "max_tokens", 400),
        (ok(max_tokens="3"), False, "max_tokens", 400),
        (ok(stream="yes"), False, "stream", 400),
        (ok(prompt="x" * 2000), False, "prompt", 400),
        ({"model": "m", "messages": []}, True, "messages", 400),
        ({"model": "m", "messages": [{"role": "user"}]}, True, "messages[0].content", 400),
    ],
)
def test_bad_requests_get_openai_style_errors(
    body: Any, chat: bool, param: str | None, status: int
) -> None:
    with pytest.raises(BadRequest) as err:
        parse_completion(body, chat, 1000, 100)
    assert err.value.param == param
    assert err.value.status == status
    error = err.value.body()["error"]
    assert isinstance(error, dict)
    assert error["type"] == "invalid_request_error"


def test_token_bucket_limits_a_key_and_refills() -> None:
    from matrixserve.domain.gateway.keys import TokenBucket

    bucket = TokenBucket(rate=2.0, burst=2.0, tokens=2.0, updated=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [True, True, False]
    assert bucket.retry_after() == pytest.approx(0.5)
    assert bucket.take(0.5) is True
    assert bucket.take(0.5) is False
    # the header in whole seconds, rounded up, at least 1 (RFC 9110 §10.2.3)
    assert bucket.retry_after_header() == "1"
    slow = TokenBucket(rate=0.01, burst=1.0, tokens=0.25, updated=0.0)
    assert slow.retry_after_header() == "75"


@pytest.mark.parametrize(
    ("status", "body", "chat", "param", "code", "said"),
    [
        (
            413,
            b'{"error": {"code": "prompt_too_long", "message": "at most 8192"}}',
            True,
            "messages",
            "context_length_exceeded",
            "at most 8192",
        ),
        (413, b"not json", False, "prompt", "context_length_exceeded", "no reason given"),
        (
            400,
            b'{"error": {"code": "invalid_request", "message": "maxTokens must be in 1..9"}}',
            False,
            "max_tokens",
            "invalid_request",
            "maxTokens must be in 1..9",
        ),
        (
            400,
            b'{"error": {"message": "promptTokens must be a positive integer"}}',
            True,
            "messages",
            "invalid_request",
            "promptTokens",
        ),
        (
            422,
            b'{"error": {"message": 5, "param": ["x"]}}',
            False,
            None,
            "invalid_request",
            "no reason given",
        ),
        (400, b"[" * 100_000, False, None, "invalid_request", "no reason given"),
    ],
)
def test_a_prefills_refusal_of_the_request_itself_is_worded_as_openai(
    status: int, body: bytes, chat: bool, param: str | None, code: str, said: str
) -> None:
    from matrixserve.domain.gateway.refusals import engine_refusal

    refused = engine_refusal(status, body, chat)
    assert refused is not None
    assert (refused.status, refused.param, refused.code) == (400, param, code)
    assert said in refused.message


@pytest.mark.parametrize("status", [404, 405, 408, 415, 429, 500, 503])
def test_other_answers_are_the_prefills_not_the_requests(status: int) -> None:
    from matrixserve.domain.gateway.refusals import engine_refusal

    assert engine_refusal(status, b'{"error": {"message": "x"}}', False) is None


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("1", 1.0),
        (" 0 ", 0.0),
        ("5", 2.0),
        ("3600", 2.0),
        (None, 2.0),
        ("", 2.0),
        ("-1", 2.0),
        ("1.5", 2.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 2.0),
        ("9" * 5000, 2.0),
        ("٣", 2.0),
    ],
)
def test_a_503s_retry_after_is_honoured_up_to_a_bound(header: str | None, seconds: float) -> None:
    from matrixserve.domain.gateway.refusals import retry_after_seconds

    assert retry_after_seconds(header, 2.0) == seconds


def test_api_keys_and_bearer_parsing() -> None:
    from matrixserve.domain.gateway.keys import bearer, parse_keys

    assert parse_keys({"team-a": "sk-0123456789abcdef\n"}) == {"sk-0123456789abcdef": "team-a"}
    with pytest.raises(ValueError, match="shorter than 16"):
        parse_keys({"weak": "abc"})
    assert bearer("Bearer sk-1") == "sk-1"
    assert bearer("Basic xyz") is None
    assert bearer(None) is None


def test_entrances_from_status_take_serving_rows_with_an_endpoint_in_entrance_order() -> None:
    status = {
        "entrances": ["g-p-1", "g-p-0", "g-p-2", "g-p-3"],
        "instances": [
            {"name": "g-p-0", "state": "Serving", "endpoint": "127.0.1.2:8000"},
            {"name": "g-p-1", "state": "Serving", "endpoint": "127.0.1.3:8000"},
            {"name": "g-p-2", "state": "Removing", "endpoint": "127.0.1.4:8000"},
            {"name": "g-p-3", "state": "Serving"},
            {"name": "g-d-0", "state": "Serving", "endpoint": "127.0.1.5:8000"},
        ],
    }
    assert entrances_from_status(status) == [
        Entrance("g-p-1", "127.0.1.3:8000"),
        Entrance("g-p-0", "127.0.1.2:8000"),
    ]
    assert entrances_from_status(None) == []
    assert entrances_from_status({"entrances": ["x"]}) == []


def test_the_gateway_counts_prompt_tokens_as_the_engines_do() -> None:
    from matrixserve.api.engine_protocol import count_tokens

    for n in (1, 3, 4, 5, 399, 400, 401, 40_000):
        assert estimate_tokens("x" * n) == count_tokens("x" * n)


def test_the_ttft_threshold_grows_with_the_prompt() -> None:
    assert ttft_threshold_ms(2000, 0, 10_000) == 2000
    assert ttft_threshold_ms(2000, 1000, 25) == 2025
    assert ttft_threshold_ms(100, 30, 8192) == pytest.approx(345.76)


# --------------------------------------------------------------------------- the policy objects
def test_on_demand_tries_every_entrance_and_asks_busy_prefills_to_reject() -> None:
    policy = POLICIES[Policy.ON_DEMAND]
    entrances = [Entrance("a", "127.0.0.2:1"), Entrance("b", "127.0.0.3:1")]
    loads = Loads(open_streams={"a": 3}, in_prefill={"a": 1})
    assert [e.instance for e in policy.choices(entrances, loads)] == ["b", "a"]
    assert (policy.commits, policy.admission, policy.skips_held, policy.polls_reports) == (
        False,
        "reject",
        True,
        False,
    )


@pytest.mark.parametrize("which", [Policy.ROUND_ROBIN, Policy.LEAST_LOADED])
def test_the_baselines_commit_to_one_choice_and_let_the_prefill_queue(which: Policy) -> None:
    policy = POLICIES[which]
    entrances = [Entrance("a", "127.0.0.2:1"), Entrance("b", "127.0.0.3:1")]
    loads = Loads(open_streams={}, reported={"a": 5, "b": 0}, turn=1)
    (choice,) = policy.choices(entrances, loads)
    assert choice.instance == "b"  # the next in turn, and the least reported queue
    assert (policy.commits, policy.admission, policy.skips_held) == (True, "queue", False)
    assert policy.polls_reports is (which is Policy.LEAST_LOADED)
    assert policy.choices([], loads) == []
