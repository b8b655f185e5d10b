"""The engine's HTTP protocol (``matrixserve.api.engine_protocol``), as the gateway, the engines
and the null engine speak it: the bodies and events keep their wire shape (key names and order),
what one side writes the other reads back, and the TTFT budget's units convert one way each. A
stream that continues elsewhere (issue 31 item 2): the tokens are a function of the prompt and
their index, in any process, and ``resumeAt`` says where the stream goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from matrixserve.api import engine_protocol as ep


def test_the_generate_body_reads_back_as_the_engine_sees_it() -> None:
    budget = ep.TtftBudget.from_milliseconds(1500)
    body = ep.generate_body("r1", "a prompt of some length", 7, budget, "reject")
    assert list(body) == ["requestId", "prompt", "maxTokens", "ttftBudget", "admission"]
    request = ep.GenerateRequest.parse(json.loads(json.dumps(body)), 4096, 64)
    assert request == ep.GenerateRequest(
        "r1",
        ep.count_tokens("a prompt of some length"),
        7,
        ep.TtftBudget(1.5),
        "reject",
        seed=ep.token_seed("a prompt of some length"),
    )
    assert (request.resume_at, request.context_tokens, request.remaining) == (
        0,
        request.prompt_tokens,
        7,
    )


def test_a_resumed_generate_body_says_where_the_stream_goes_on() -> None:
    budget = ep.TtftBudget.from_milliseconds(1500)
    body = ep.generate_body("r1", 12, 7, budget, "reject", resume_at=3)
    assert list(body) == [
        "requestId",
        "promptTokens",
        "maxTokens",
        "ttftBudget",
        "admission",
        "resumeAt",
    ]
    request = ep.GenerateRequest.parse(json.loads(json.dumps(body)), 4096, 64)
    assert (request.prompt_tokens, request.max_tokens, request.resume_at) == (12, 7, 3)
    assert (request.context_tokens, request.remaining) == (15, 4)  # the prompt and 3 sent
    assert request.seed == ep.token_seed(12)
    again = request.resumed(5)
    assert (again.resume_at, again.ttft_budget, again.seed) == (5, None, request.seed)


def test_tokens_are_a_function_of_the_prompt_and_their_index_in_any_process() -> None:
    """The continuation of a stream on another instance (another process: ``hash`` of a string
    differs between processes) writes what an unfaulted run would."""
    seed = ep.token_seed("the same prompt")
    texts = [ep.synthetic_token(seed, i) for i in range(64)]
    script = (
        "from matrixserve.api import engine_protocol as ep; "
        "s = ep.token_seed('the same prompt'); "
        "print(repr([ep.synthetic_token(s, i) for i in range(64)]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert other.stdout.strip() == repr(texts)
    # ten words in a cycle: a token skipped or repeated shifts the rest, and any ten in a row
    # hold each word once (a stop string among them is met within ten tokens)
    assert all(len(set(texts[i : i + 10])) == 10 for i in range(54))
    assert texts[10:] == texts[:-10]
    assert texts != [ep.synthetic_token(ep.token_seed("another prompt"), i) for i in range(64)]
    assert ep.token_seed(12) == ep.token_seed(12) != ep.token_seed(13)
    assert ep.token_seed("\ud800") >= 0  # a lone surrogate (JSON allows it) has a seed too


def test_the_ttft_budget_converts_each_unit_once() -> None:
    budget = ep.TtftBudget.from_milliseconds(250)
    assert budget.emulated_seconds == pytest.approx(0.25)
    assert budget.milliseconds == pytest.approx(250)
    assert budget.wall_seconds(time_scale=50) == pytest.approx(0.005)  # 50x faster than life
    back = ep.TtftBudget.from_wall_seconds(budget.wall_seconds(50), time_scale=50)
    assert back.emulated_seconds == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ([], 400, "JSON object"),
        ({"prompt": "x"}, 400, "requestId"),
        ({"requestId": "r"}, 400, "prompt"),
        ({"requestId": "r", "promptTokens": True}, 400, "promptTokens"),
        ({"requestId": "r", "promptTokens": 5000}, 413, "at most 4096"),
        ({"requestId": "r", "prompt": "x", "maxTokens": 65}, 400, "1..64"),
        ({"requestId": "r", "prompt": "x", "ttftBudget": "soon"}, 400, "ttftBudget"),
        ({"requestId": "r", "prompt": "x", "admission": "maybe"}, 400, "admission"),
        ({"requestId": "r", "prompt": "x", "maxTokens": 4, "resumeAt": 4}, 400, "resumeAt"),
        ({"requestId": "r", "prompt": "x", "resumeAt": -1}, 400, "resumeAt"),
        ({"requestId": "r", "prompt": "x", "resumeAt": True}, 400, "resumeAt"),
        ({"requestId": "r", "prompt": "x", "seed": 1 << 32}, 400, "seed"),
        ({"requestId": "r", "prompt": "x", "seed": "7"}, 400, "seed"),
    ],
)
def test_a_bad_generate_body_is_refused_with_its_reason(
    body: object, status: int, words: str
) -> None:
    with pytest.raises(ep.EngineError) as refused:
        ep.GenerateRequest.parse(body, 4096, 64)
    assert refused.value.status == status
    assert words in refused.value.message
    assert refused.value.body() == {  # OpenAI's error shape (issue 16 finding 3)
        "error": {
            "code": refused.value.code,
            "message": refused.value.message,
            "type": "invalid_request_error",
            "param": "resumeAt" if words == "resumeAt" else None,
        }
    }


def test_the_decode_body_carries_where_the_kv_is_and_where_the_stream_goes_on() -> None:
    prefill = ep.PrefillRef("127.64.0.2:8000", "g-p-0", ("198.18.0.1", "198.18.0.2"))
    whole = ep.GenerateRequest("r1", 300, 16, seed=77)
    body = ep.decode_body(whole.resumed(1), prefill)
    assert list(body) == ["requestId", "promptTokens", "maxTokens", "seed", "resumeAt", "prefill"]
    assert list(body["prefill"]) == ["address", "instance", "roceIps"]
    request, ref = ep.parse_decode(json.loads(json.dumps(body)), 4096, 64)
    assert (request.request_id, request.prompt_tokens, request.max_tokens) == ("r1", 300, 16)
    assert (request.seed, request.resume_at, request.remaining) == (77, 1, 15)
    assert ref == prefill
    moved = ep.parse_decode(ep.decode_body(whole.resumed(9), prefill), 4096, 64)[0]
    assert (moved.resume_at, moved.context_tokens, moved.remaining) == (9, 309, 7)
    with pytest.raises(ep.EngineError, match=r"prefill\.address"):
        ep.parse_decode({"requestId": "r", "promptTokens": 3}, 4096, 64)
    with pytest.raises(ep.EngineError, match="at least 1"):  # the prefill makes the first
        ep.parse_decode(ep.decode_body(whole, prefill), 4096, 64)


@pytest.mark.parametrize("left", [1, 5])
def test_a_decode_body_from_before_resume_at_keeps_its_meaning(left: int) -> None:
    """An older prefill (no resumeAt, no seed) sends what is left after its first token as
    maxTokens: the decode makes all of it, from index 1 (mixed versions in an upgrade)."""
    old = {"requestId": "r", "promptTokens": 300, "maxTokens": left, "prefill": {"address": "a"}}
    request = ep.parse_decode(old, 4096, 64)[0]
    assert (request.max_tokens, request.resume_at, request.remaining) == (left + 1, 1, left)
    assert request.seed == ep.token_seed(300)


def test_stream_events_keep_their_wire_shape() -> None:
    token = ep.token_event(3, "dies ", 0.25)
    assert token == {"type": "token", "index": 3, "text": "dies ", "t": 0.25}
    done = ep.done_event(10, 4, ep.Timings(0.1, 0.08, 0.01, 0.03, 0.2), "g-p-0", "g-d-0")
    assert list(done) == ["type", "usage", "timings", "instances", "migrations"]
    assert done["migrations"] == 0
    assert list(done["timings"]) == ["ttft", "prefill", "kvTransfer", "tpotMean", "e2e"]
    assert done["usage"] == {"promptTokens": 10, "completionTokens": 4}
    assert done["instances"] == {"prefill": "g-p-0", "decode": "g-d-0"}
    error = ep.error_event("no_decode", "no decode instance is available")
    assert error == {"type": "error", "code": "no_decode", "message": error["message"]}
    assert ep.sse_data(token) == b"data: " + json.dumps(token).encode() + b"\n\n"
    assert set(ep.LAST_EVENTS) == {"done", "error"}


@pytest.mark.parametrize(
    ("event", "kind"),
    [({"type": "token"}, "token"), ({"type": 3}, None), ({}, None), ([], None), ("done", None)],
)
def test_only_a_json_object_with_a_string_type_is_an_event(event: object, kind: str | None) -> None:
    assert ep.event_type(event) == kind
