"""A stream survives its entrance (issue 31 item 2), the gateway's side: a choice whose prefill
entrance is lost — its stream cut, or ended by the entrance's own fault — is offered to another
entrance: before its first token within its TTFT budget, after it with ``resumeAt`` (the tokens
its client has), so the client sees one stream, every token once, usage counted once; at most
``MAX_REOFFERS`` times, the error only when no entrance takes it; a decode's named failure (the
prefill's to mend) is not offered again; the counts and connections are given back whatever
happens. Served as ``__main__`` serves the gateway, in front of scripted engines on 127.0.0.1
(``test_gateway_requests``'s)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from test_gateway_requests import FakeEngine, served

from matrixserve.api.engine_protocol import (
    Timings,
    done_event,
    error_event,
    sse_data,
    token_event,
    token_seed,
)
from matrixserve.domain.gateway.reoffer import (
    MAX_REOFFERS,
    ReofferStage,
    entrance_lost,
    reoffer_stage,
)

N = 6


@dataclass
class Entrance(FakeEngine):  # type: ignore[misc]  # a sibling module mypy does not resolve
    """A prefill entrance that honours ``resumeAt`` (token i is ``t<i>`` wherever it is made)
    and whose n-th stream ``plan(n)`` ends early: after that many tokens it is cut (an ``int``),
    or it ends with that error event (a ``(tokens, event)`` pair); ``None`` serves it whole, a
    status refuses it."""

    plan: Callable[[int], Any] = lambda n: None
    refused: int = 0
    log: list[tuple[int, int]] = field(default_factory=list)  # (resumeAt, tokens written)
    burst: bool = False  # a planned end's tokens and its error in one write (one batch)
    first_delay: float = 0.0  # s before its first token (its prefill)
    old: bool = False  # from before resumeAt: starts at token 0 whatever it is told

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        plan = self.plan(len(self.bodies))
        if isinstance(plan, int) and plan >= 400:
            self.refused += 1
            error = {"code": "rejected", "message": "busy", "type": "x", "param": None}
            return web.json_response({"error": error}, status=plan)
        start, end = 0 if self.old else body.get("resumeAt", 0), body["maxTokens"]
        cut, ending = (plan, None) if isinstance(plan, int) else plan or (None, None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self.first_delay)
        if self.burst and ending is not None:
            assert cut is not None
            tokens = [sse_data(token_event(i, f"t{i} ", 0.0)) for i in range(start, start + cut)]
            await response.write(b"".join([*tokens, sse_data(ending)]))
            await response.write_eof()
            return response
        written = 0
        for i in range(start, end):
            if cut is not None and written == cut:
                break
            await response.write(sse_data(token_event(i, f"t{i} ", 0.0)))
            written += 1
            await asyncio.sleep(0.001)
        self.log.append((start, written))
        if cut is not None and written == cut:
            if ending is not None:
                await response.write(sse_data(ending))
                await response.write_eof()
                return response
            assert request.transport is not None
            request.transport.close()  # cut mid-stream, as a killed prefill's stream ends
            return response
        done = done_event(1, end, Timings(0.1, 0.1, 0.0, 0.01, 0.2), "x", "g-d-0")
        await response.write(sse_data(done))
        await response.write_eof()
        return response


BODY = {
    "model": "general",
    "prompt": "hi",
    "max_tokens": N,
    "stream": True,
    "stream_options": {"include_usage": True},
}
PLAIN = {"model": "general", "prompt": "hi", "max_tokens": N}
WHOLE = "".join(f"t{i} " for i in range(N))


def _text(chunks: list[Any]) -> str:
    return "".join(
        c["choices"][0]["text"] for c in chunks if isinstance(c, dict) and c.get("choices")
    )


def _moves(text: str, stage: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "matrixserve_gateway_migrations"
        for s in family.samples
        if s.name.endswith("_total") and s.labels["stage"] == stage
    }


@pytest.mark.parametrize(
    ("plan", "stage", "sent"),
    [
        (lambda n: 0, "before_first_token", 0),  # killed while prefilling
        (lambda n: 2, "mid_stream", 2),  # killed while relaying
        (lambda n: (3, error_event("instance_removed", "removed")), "mid_stream", 3),
        (lambda n: (0, error_event("engine_hung", "hung")), "before_first_token", 0),
    ],
    ids=["cut-before-first", "cut-mid-stream", "removed-mid-stream", "hung-before-first"],
)
async def test_a_lost_entrance_hands_the_stream_to_another_and_the_client_sees_one_stream(
    plan: Callable[[int], Any], stage: str, sent: int
) -> None:
    lost, other = Entrance(plan=plan), Entrance()
    async with served(lost, others=[other]) as s:
        chunks = await s.stream("/v1/completions", BODY)
        assert _text(chunks) == WHOLE  # every token once, in order
        usage, final = chunks[-2], chunks[-3]
        assert usage["usage"]["completion_tokens"] == N  # counted once
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["matrixserve"]["migrations"] == 1
        assert [b.get("resumeAt", 0) for b in other.bodies] == [sent]
        assert other.log == [(sent, N - sent)]
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)
        scrape = await s.scrape()
    assert _moves(scrape, stage) == {"moved": 1, "no_capacity": 0, "bound": 0, "refused": 0}
    assert 'matrixserve_gateway_requests_total{outcome="ok",scenario="general"} 1.0' in scrape


async def test_a_plain_request_whose_entrance_is_lost_is_answered_whole() -> None:
    lost, other = Entrance(plan=lambda n: 4), Entrance()
    async with served(lost, others=[other]) as s:
        status, answer = await s.post("/v1/completions", PLAIN)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == WHOLE
    assert answer["usage"]["completion_tokens"] == N


async def test_each_choice_moves_on_its_own() -> None:
    lost = Entrance(plan=lambda n: 1 if n == 1 else None)
    async with served(lost, others=[Entrance()]) as s:
        status, answer = await s.post("/v1/completions", {**PLAIN, "n": 2})
        assert status == 200, answer
        assert [c["text"] for c in answer["choices"]] == [WHOLE, WHOLE]
        assert answer["usage"]["completion_tokens"] == 2 * N
        assert sorted(c["matrixserve"]["migrations"] for c in answer["choices"]) == [0, 1]
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)


async def test_each_choice_has_its_own_seed_and_keeps_it_when_offered_again() -> None:
    """n > 1 choices differ (each drawn from its own seed), and a choice re-offered is written
    from the same seed on its new entrance."""
    lost, other = Entrance(plan=lambda n: 1 if n == 1 else None), Entrance()
    async with served(lost, others=[other]) as s:
        status, answer = await s.post("/v1/completions", {**PLAIN, "n": 3})
    assert status == 200, answer
    first = [b for b in lost.bodies + other.bodies if "resumeAt" not in b]
    assert sorted(b["seed"] for b in first) == [token_seed("hi") + i for i in range(3)]
    [again] = [b for b in other.bodies if "resumeAt" in b]
    assert again["seed"] == lost.bodies[0]["seed"]


async def test_a_decodes_failure_the_prefill_could_not_mend_is_not_offered_again() -> None:
    named = error_event("device_fault", "die down") | {"instances": {"decode": "g-d-0"}}
    lost, other = Entrance(plan=lambda n: (2, named)), Entrance()
    async with served(lost, others=[other]) as s:
        chunks = await s.stream("/v1/completions", BODY)
    assert chunks[-2]["error"]["code"] == "device_fault"
    assert other.bodies == []


async def test_offers_are_bounded_and_the_error_says_why_it_did_not_move() -> None:
    first, second = Entrance(plan=lambda n: 1), Entrance(plan=lambda n: 1)
    async with served(first, others=[second]) as s:
        chunks = await s.stream("/v1/completions", BODY)
        error = chunks[-2]["error"]
        assert error["code"] == "upstream_failed"
        assert f"not moved: offered to another entrance {MAX_REOFFERS} times" in error["message"]
        assert _text(chunks) == WHOLE[: len("t0 ") * (1 + MAX_REOFFERS)]  # none twice
        assert len(first.bodies) + len(second.bodies) == 1 + MAX_REOFFERS
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)
        scrape = await s.scrape()
    assert _moves(scrape, "mid_stream") == {
        "moved": MAX_REOFFERS,
        "no_capacity": 0,
        "bound": 1,
        "refused": 0,
    }


async def test_no_entrance_taking_it_within_its_budget_ends_it() -> None:
    lost, busy = Entrance(plan=lambda n: 0), Entrance(plan=lambda n: 429)
    async with served(lost, others=[busy], default_ttft_ms=200) as s:
        chunks = await s.stream("/v1/completions", BODY)
        error = chunks[-2]["error"]
        assert error["code"] == "upstream_failed"
        assert "not moved: no prefill accepted within the TTFT budget" in error["message"]
        assert busy.refused >= 1
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)
        scrape = await s.scrape()
    assert _moves(scrape, "before_first_token") == {
        "moved": 0,
        "no_capacity": 1,
        "bound": 0,
        "refused": 0,
    }


async def test_an_entrance_refusing_the_resumed_request_itself_ends_it_not_the_gateway() -> None:
    """The prompt with the tokens sent may be over what an entrance takes (413): the choice
    ends with its loss, saying so; the gateway's handler does not fail."""
    lost, refusing = Entrance(plan=lambda n: 3), Entrance(plan=lambda n: 413)
    async with served(lost, others=[refusing]) as s:
        chunks = await s.stream("/v1/completions", BODY)
        error = chunks[-2]["error"]
        assert error["code"] == "upstream_failed"
        assert "not moved: an entrance refused it" in error["message"]
        assert chunks[-1] == "[DONE]"
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)
        scrape = await s.scrape()
    assert _moves(scrape, "mid_stream") == {"moved": 0, "no_capacity": 0, "bound": 0, "refused": 1}


async def test_an_entrance_that_does_not_resume_where_the_stream_was_is_a_refusal() -> None:
    """One from before resumeAt starts again at token 0: none of its tokens reach the client
    (it would get tokens twice, more than its max_tokens)."""
    lost, old = Entrance(plan=lambda n: 2), Entrance(old=True)
    async with served(lost, others=[old]) as s:
        chunks = await s.stream("/v1/completions", BODY)
        error = chunks[-2]["error"]
        assert error["code"] == "upstream_failed"
        assert (
            "not moved: an entrance refused it: its stream began at token 0, not 2"
            in error["message"]
        )
        assert _text(chunks) == "t0 t1 "
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)
        scrape = await s.scrape()
    assert _moves(scrape, "mid_stream") == {"moved": 0, "no_capacity": 0, "bound": 0, "refused": 1}


async def test_tokens_before_a_loss_in_the_same_batch_are_taken_first() -> None:
    """The lost entrance's last tokens and its error arrive together: the tokens count on its
    own flight (the new entrance's prompt is in prefill, its slot held, until its own first
    token), and a stop string among them ends the choice without an offer."""
    removed = error_event("instance_removed", "removed")
    lost = Entrance(plan=lambda n: (3, removed), burst=True)
    other = Entrance(first_delay=0.3)
    async with served(lost, others=[other]) as s:
        reading = asyncio.create_task(s.stream("/v1/completions", BODY))
        while not other.bodies:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # the new entrance prefilling
        f = s.gateway.forwarder
        assert (f.prefilling["g-p-1"], f.holding["g-p-1"]) == (1, 1)
        chunks = await reading
        assert _text(chunks) == WHOLE
        stopped = Entrance(plan=lambda n: (3, removed), burst=True)
        again = Entrance()
    async with served(stopped, others=[again]) as s:
        chunks = await s.stream("/v1/completions", {**BODY, "stop": ["t2"]})
        assert _text(chunks) == "t0 t1 "
        assert chunks[-3]["choices"][0]["finish_reason"] == "stop"
        assert again.bodies == []
        await asyncio.sleep(0.05)
        assert s.counters() == (0, 0, 0)


@pytest.mark.parametrize(
    ("event", "tokens", "stage"),
    [
        (error_event("upstream_failed", "cut"), 0, ReofferStage.BEFORE_FIRST_TOKEN),
        (error_event("stream_interrupted", "cut"), 3, ReofferStage.MID_STREAM),
        (error_event("instance_removed", "x"), 3, ReofferStage.MID_STREAM),
        (error_event("device_fault", "x"), 0, ReofferStage.BEFORE_FIRST_TOKEN),
        (error_event("engine_hung", "x"), 1, ReofferStage.MID_STREAM),
        # a decode's failure, named: the prefill's to mend (it did not): the end stands
        (error_event("device_fault", "x") | {"instances": {"decode": "d"}}, 3, None),
        (error_event("decode_failed", "x"), 3, None),
        (error_event("ttft_timeout", "x"), 0, None),  # the budget, not a loss
        (error_event("upstream_failed", "cut"), N, None),  # every token served
        ({"type": "done"}, 3, None),
    ],
)
def test_which_ends_are_a_lost_entrance_and_where_it_is_offered_from(
    event: dict[str, Any], tokens: int, stage: ReofferStage | None
) -> None:
    assert reoffer_stage(event, tokens, N) == stage
    every_token_served = tokens == N and event["type"] == "error"
    assert entrance_lost(event) == (stage is not None or every_token_served)
