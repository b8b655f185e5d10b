"""The engine's HTTP protocol (``matrixserve.api.engine_protocol``), as the gateway, the engines
and the null engine speak it: the bodies and events keep their wire shape (key names and order),
what one side writes the other reads back, and the TTFT budget's units convert one way each."""

from __future__ import annotations

import json

import pytest

from matrixserve.api import engine_protocol as ep


def test_the_generate_body_reads_back_as_the_engine_sees_it() -> None:
    budget = ep.TtftBudget.from_milliseconds(1500)
    body = ep.generate_body("r1", "a prompt of some length", 7, budget, "reject")
    assert list(body) == ["requestId", "prompt", "maxTokens", "ttftBudget", "admission"]
    request = ep.GenerateRequest.parse(json.loads(json.dumps(body)), 4096, 64)
    assert request == ep.GenerateRequest(
        "r1", ep.count_tokens("a prompt of some length"), 7, ep.TtftBudget(1.5), "reject"
    )


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
            "param": None,
        }
    }


def test_the_decode_body_carries_where_the_kv_is() -> None:
    prefill = ep.PrefillRef("127.64.0.2:8000", "g-p-0", ("198.18.0.1", "198.18.0.2"))
    body = ep.decode_body("r1", 300, 15, prefill)
    assert list(body) == ["requestId", "promptTokens", "maxTokens", "prefill"]
    assert list(body["prefill"]) == ["address", "instance", "roceIps"]
    request, ref = ep.parse_decode(json.loads(json.dumps(body)), 4096, 64)
    assert (request.request_id, request.prompt_tokens, request.max_tokens) == ("r1", 300, 15)
    assert ref == prefill
    with pytest.raises(ep.EngineError, match=r"prefill\.address"):
        ep.parse_decode({"requestId": "r", "promptTokens": 3}, 4096, 64)


def test_stream_events_keep_their_wire_shape() -> None:
    token = ep.token_event(3, "dies ", 0.25)
    assert token == {"type": "token", "index": 3, "text": "dies ", "t": 0.25}
    done = ep.done_event(10, 4, ep.Timings(0.1, 0.08, 0.01, 0.03, 0.2), "g-p-0", "g-d-0")
    assert list(done) == ["type", "usage", "timings", "instances"]
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
