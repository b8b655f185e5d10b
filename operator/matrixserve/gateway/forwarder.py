"""On-demand forwarding with rejection (P/D-Serve §3.5), the gateway's side: try the scenario's
prefill entrances in the policy's order; a 429 from a prefill means "busy, try the next"; when
every entrance rejected, wait for a slot this gateway holds to be released (or a short pause) and
try again (waiters in line: each freed slot wakes the first request in line that may use it),
until the TTFT budget is spent, then give the reason. The budget is the request's own threshold
by its prompt's length (§2.2.2).

The policy (:class:`matrixserve.domain.gateway.routing.ForwardingPolicy`) says the order, whether it
commits to one choice, what it asks a busy prefill to do, whether prefills whose slots this
gateway holds are passed over, and whether it needs the prefills' queue reports (polled here).
What the gateway counts per prefill (open streams, prompts still in prefill, slots held) is the
prefill's feedback; a :class:`Flight` is one request's share of it.

A request has one choice per prompt and ``n``; each is forwarded on its own, together, and is a
:class:`Leg`: its prefill's stream, its flight, its text up to a stop string. A request goes ahead
only when every choice was accepted; else the accepted ones are dropped at once — every try's stream
that was not handed out as a leg, whether its try ended before, with or after the refusal, so none
is left holding an engine's slot. A leg that ends (its last event, a stop string, a failure) gives
its stream back, so a stop string ends the upstream work there and then.

A prefill's answer other than accepted or busy: a refusal of the request itself (400, 413, 422:
every prefill would refuse it) is final, the client's 400 (:class:`BadRequest`, raised); a 503
passes the prefill over for its ``Retry-After``, at most :data:`PASSED_OVER_SECONDS` (it is not
tried again before, even when it is the only one); a prefill that could not be reached, did not
answer in time or answered another status is passed over for a while, while another is open.

A stream survives its entrance: a leg whose entrance is lost (its stream cut, or ended by the
entrance's own fault, hang or removal: ``domain.gateway.reoffer.entrance_lost``) is offered to
another entrance (:class:`Again`), the lost one passed over: before its first token within what is
left of its TTFT budget (P/D-Serve §3.5's on-demand forwarding, again), after it with ``resumeAt``
(the tokens its client has; the new entrance re-prefills the prompt with them and goes on with the
next, under a fresh budget for that longer prompt). At most ``MAX_REOFFERS`` times per choice; the
client gets the error only when no entrance takes it. A decode lost behind the entrance is the
prefill's to mend (``enginestub.engine.migration`` says why it lives there), so its named errors are
not re-offered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass

import aiohttp

from matrixserve.api.engine_protocol import (
    Event,
    TtftBudget,
    choice_seed,
    error_event,
    generate_body,
)
from matrixserve.domain.gateway.completions import (
    BadRequest,
    Completion,
    Prompt,
    StopScanner,
    finish_reason,
)
from matrixserve.domain.gateway.labels import answer_label
from matrixserve.domain.gateway.refusals import engine_refusal, retry_after_seconds
from matrixserve.domain.gateway.reoffer import (
    MAX_REOFFERS,
    ReofferOutcome,
    ReofferStage,
    reoffer_stage,
)
from matrixserve.domain.gateway.routing import POLICIES, Entrance, Loads, request_budget
from matrixserve.gateway.config import GatewayConfig, GatewayMetrics
from matrixserve.gateway.discovery import Discovery, GroupRoute
from matrixserve.gateway.upstream import EnginePool, EngineStream, UpstreamError

# When every entrance is busy, wait for a slot to be released (a stream's second token or its
# end), at most this long (wall s: other gateways' requests release slots this one cannot see).
RETRY_PAUSE_SECONDS = 0.02
# Passive health: a prefill that could not be reached (or did not answer in time) is passed over
# for this long (wall s), while another entrance is open; its routes may be stale (ZooKeeper out
# of reach, the group's status the last known one).
PASSED_OVER_SECONDS = 2.0
# A refusal's body (an engine's JSON error) is waited for at most this long (wall s) after its
# head: it comes in the same packet but for a broken engine.
REFUSAL_BODY_SECONDS = 1.0
_REFUSAL = {"rejected": "rejected", "timeout": "not answered in time", "unreachable": "unreachable"}
# a stream whose body ended without its last event
_CUT = error_event("stream_interrupted", "the serving instance closed the stream early")


class Forwarder:
    def __init__(
        self, discovery: Discovery, config: GatewayConfig, metrics: GatewayMetrics
    ) -> None:
        self.discovery = discovery
        self.config = config
        self.metrics = metrics
        self.policy = POLICIES[config.policy]
        self.open: dict[str, int] = {}  # open SSE streams per prefill
        self.prefilling: dict[str, int] = {}  # accepted, no first token yet, per prefill
        self.holding: dict[str, int] = {}  # accepted, KV not yet pulled by a decode, per prefill
        # Requests waiting for a slot, oldest first, each with the prefills it may use: a slot
        # freed wakes the oldest waiter that may use it, one per slot
        self.waiting: collections.deque[_Waiter] = collections.deque()
        self.last_accepted: dict[str, str] = {}  # per scenario
        self.reported: dict[str, int] = {}  # the prefills' last queue reports
        self.failing: dict[str, float] = {}  # passed over until (monotonic s), per prefill
        self.resting: dict[str, float] = {}  # answered 503: not tried until (monotonic s)
        self.turns = itertools.count()
        self.engines: EnginePool | None = None  # the relay's connections (the hot path)
        self.session: aiohttp.ClientSession | None = None  # the queue reports' polls
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # read_timeout: an engine silent for a minute mid-stream is hung; end the stream (the
        # client gets an error chunk) rather than hold its counters and slot for ever.
        self.engines = EnginePool(connect_timeout=2, read_timeout=60)
        if self.policy.polls_reports:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1))
            self._poller = asyncio.create_task(self._poll_reports())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.session is not None:
            await self.session.close()
        if self.engines is not None:
            self.engines.close()

    async def _poll_reports(self) -> None:
        """The baseline's periodic queue reports: stale between polls by design."""
        assert self.session is not None
        while True:
            entrances = {
                e.instance: e for g in list(self.discovery.groups.values()) for e in g.entrances
            }
            for name, e in entrances.items():
                try:
                    async with self.session.get(f"http://{e.address}/v1/info") as r:
                        health = (await r.json())["health"]
                        self.reported[name] = health["prefillSlots"]["used"] + health.get(
                            "prefillQueue", 0
                        )
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                    continue
            await asyncio.sleep(self.config.report_interval / self.config.time_scale)

    def engine_connections(self) -> dict[str, int]:
        """The relay's connections to engines: ``idle`` (pooled) and ``in_use``."""
        if self.engines is None:
            return {"idle": 0, "in_use": 0}
        idle = self.engines.idle_total()
        return {"idle": idle, "in_use": self.engines.open_count() - idle}

    def _budget(self, routes: list[GroupRoute], prompt: Prompt, sent: int = 0) -> TtftBudget:
        """The request's TTFT threshold: the tightest of its groups' for a prompt of this length
        (with the ``sent`` tokens a re-offered stream's new entrance prefills with it)."""
        return request_budget(
            ((g.ttft_ms, g.ttft_per_1k_ms) for g in routes),
            prompt.tokens + sent,
            self.config.default_ttft_ms,
        )

    async def _try(
        self, entrance: Entrance, body: bytes, remaining: float, chat: bool
    ) -> EngineStream | str:
        """One prefill's answer: its stream if it accepted, else why not (the metric's label);
        raises :class:`BadRequest` if it refused the request itself (final: every prefill
        would). The answer is waited for at most the ``remaining`` budget (wall s) and the
        answer deadline (an engine answers at admission): a prefill that neither accepts nor
        rejects in time (hung, overloaded) is passed over, never waited on past either; so is
        one that cannot be reached or answers an unexpected status (for
        :data:`PASSED_OVER_SECONDS`), and one that answers 503 (for its Retry-After)."""
        assert self.engines is not None
        began = time.monotonic()
        try:
            async with asyncio.timeout(min(remaining, self.config.answer_timeout)):
                response = await self.engines.post(entrance.address, "/v1/generate", body)
        except UpstreamError:  # a connect timeout too: "unreachable", not "timeout"
            answer = "unreachable"
        except TimeoutError:
            answer = "timeout"
        else:
            status = response.status
            if status == 200:
                self.metrics.attempts.labels(answer="accepted").inc()
                return response
            answer = "rejected" if status == 429 else answer_label(status)
            try:
                # its body (if late) waited for within the request's budget too
                left = remaining - (time.monotonic() - began)
                said = await response.refusal(max(0.0, min(REFUSAL_BODY_SECONDS, left)))
                refused = engine_refusal(status, said, chat)
            finally:  # read whole: pooled (or dropped if it never ended)
                response.release()
            self.metrics.attempts.labels(answer=answer).inc()
            if refused is not None:
                raise refused
            if status == 503:  # "not now": honoured (up to 2 s), even if it is the only one
                pause = retry_after_seconds(
                    response.headers.get("retry-after"), PASSED_OVER_SECONDS
                )
                self.resting[entrance.instance] = time.monotonic() + pause
            elif status != 429:  # the prefill failed (5xx) or is not an engine: as unreachable
                self.failing[entrance.instance] = time.monotonic() + PASSED_OVER_SECONDS
            return answer
        self.metrics.attempts.labels(answer=answer).inc()
        self.failing[entrance.instance] = time.monotonic() + PASSED_OVER_SECONDS
        return answer

    async def forward_all(
        self, scenario: str, routes: list[GroupRoute], completion: Completion
    ) -> list[Leg] | str:
        """Every choice of the request accepted by a prefill, in choice order, or why not (the
        first refusal: the choices accepted are dropped at once, the others no longer tried).
        Raises :class:`BadRequest` if a prefill refused the request itself."""
        started = time.monotonic()
        if completion.choices == 1:  # the common case: no task
            chosen = await self.forward(scenario, routes, completion, completion.prompts[0], 0)
            if isinstance(chosen, str):
                return chosen
            return [self._leg(0, completion, scenario, started, *chosen)]
        tries = [
            asyncio.ensure_future(
                self.forward(scenario, routes, completion, completion.prompt_of(i), i)
            )
            for i in range(completion.choices)
        ]
        legs: list[Leg] = []  # handed out: the tries before len(legs) are the legs' now
        try:
            waiting = set(tries)
            while waiting:
                finished, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    answer = task.result()  # raises a try's BadRequest
                    if isinstance(answer, str):
                        return answer
            for task in tries:
                accepted = task.result()
                assert not isinstance(accepted, str)  # every try accepted: the loop ended
                legs.append(self._leg(len(legs), completion, scenario, started, *accepted))
            return legs
        except BaseException:  # a leg made before a failure is given back too
            for leg in legs:
                leg.close()
            raise
        finally:
            # refused, failed or cancelled (the client left): every try's stream not handed
            # out as a leg goes, whether its try is done (several end in one round: one refused
            # and others accepted) or not yet (its stream goes when it ends)
            for task in tries[len(legs) :]:
                if task.done():
                    _drop_accepted(task)
                else:
                    task.cancel()
                    task.add_done_callback(_drop_accepted)

    def _leg(
        self,
        index: int,
        completion: Completion,
        scenario: str,
        started: float,
        entrance: Entrance,
        stream: EngineStream,
    ) -> Leg:
        flight = Flight(self, entrance.instance, scenario, started)
        again = Again(self, scenario, completion, completion.prompt_of(index), index, started)
        return Leg(index, completion, entrance.instance, stream, flight, again)

    async def forward(
        self,
        scenario: str,
        routes: list[GroupRoute],
        completion: Completion,
        prompt: Prompt | None = None,
        choice: int = 0,
        sent: int = 0,
        since: float | None = None,
    ) -> tuple[Entrance, EngineStream] | str:
        """An accepting prefill and its stream for ``prompt`` (the request's first if not
        given) as the request's ``choice``-th choice (its tokens drawn from that choice's
        seed), or why there is none. A stream offered again after its entrance was lost:
        ``sent``, the tokens its client has (the engine resumes there); ``since``, when its
        budget began (monotonic s: the request's arrival, for one with no token yet)."""
        prompt = prompt or completion.prompts[0]
        given = prompt.text if prompt.text is not None else prompt.tokens
        seed = choice_seed(given, choice % completion.n)
        budget = self._budget(routes, prompt, sent)
        wall_budget = budget.wall_seconds(self.config.time_scale)  # as this gateway waits
        policy = self.policy
        started = time.monotonic() if since is None else since
        tried = 0
        refusals: collections.Counter[str] = collections.Counter()
        request_id = f"{scenario}-{uuid.uuid4().hex[:12]}"

        def spent() -> str:
            return (
                f"no prefill accepted within the TTFT budget of {budget.milliseconds:.0f} ms "
                f"({tried} tries: "
                + (", ".join(f"{n} {_REFUSAL.get(a, a)}" for a, n in refusals.items()) or "none")
                + ")"
            )

        waiter: _Waiter | None = None
        try:
            while True:
                entrances = [e for g in routes for e in g.entrances]
                slots = {e.instance: g.prefill_batch for g in routes for e in g.entrances}
                if not entrances:
                    return f"scenario {scenario!r} has no prefill entrance open"
                now = time.monotonic()
                awake = [e for e in entrances if self.resting.get(e.instance, 0.0) <= now]
                if not awake:  # every one answered 503: wait for the first back, if in the budget
                    back = min(self.resting[e.instance] for e in entrances) - now
                    if back >= wall_budget - (now - started):
                        return (
                            f"every prefill of scenario {scenario!r} is unavailable (503) for "
                            f"{back:.1f} s more"
                        )
                    await asyncio.sleep(back)
                    continue
                entrances = [e for e in awake if self.failing.get(e.instance, 0.0) <= now] or awake
                loads = Loads(
                    self.open,
                    self.prefilling,
                    self.reported,
                    self.last_accepted.get(scenario),
                    next(self.turns),
                )
                for entrance in policy.choices(entrances, loads):
                    if (
                        policy.skips_held
                        and self.holding.get(entrance.instance, 0) >= slots[entrance.instance]
                    ):
                        continue  # every slot it has is held by this gateway's requests: skip the try
                    remaining = wall_budget - (time.monotonic() - started)
                    if remaining <= 0:
                        return spent()
                    body = generate_body(
                        request_id,
                        given,
                        completion.max_tokens,
                        TtftBudget.from_wall_seconds(remaining, self.config.time_scale),
                        policy.admission,
                        sent,
                        seed,
                    )
                    tried += 1
                    response = await self._try(
                        entrance, json.dumps(body).encode(), remaining, completion.chat
                    )
                    if not isinstance(response, str):
                        self.last_accepted[scenario] = entrance.instance
                        self.failing.pop(entrance.instance, None)
                        return entrance, response
                    refusals[response] += 1
                    if self.last_accepted.get(scenario) == entrance.instance:
                        del self.last_accepted[scenario]  # it is busy: batch forwarding moves on
                remaining = wall_budget - (time.monotonic() - started)
                if remaining <= 0:
                    return spent()
                instances = frozenset(e.instance for e in entrances)
                if waiter is None:  # in line from its first wait to its end, in arrival order
                    waiter = self.join_line(instances)
                waiter.instances = instances  # the routes may change between rounds
                await self.wait_for_slot(waiter, min(remaining, RETRY_PAUSE_SECONDS))
        finally:
            if waiter is not None:
                self.leave_line(waiter)

    def join_line(self, instances: frozenset[str]) -> _Waiter:
        """A request waiting for a slot of one of ``instances`` takes its place in line (at the
        end) until :meth:`leave_line`: between waits it keeps its place."""
        waiter = _Waiter(instances)
        self.waiting.append(waiter)
        return waiter

    def leave_line(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self.waiting.remove(waiter)

    async def wait_for_slot(self, waiter: _Waiter, timeout: float) -> str | None:
        """Wait for a slot this gateway holds of one of ``waiter.instances`` to be freed, at
        most ``timeout`` (wall s: other gateways' requests free slots this one cannot see):
        the instance whose slot woke it, or None. A wake that reaches a waiter being cancelled
        (its client gone) goes on to the next in line."""
        woken: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiter.woken = woken
        try:
            async with asyncio.timeout(timeout):
                return await woken
        except TimeoutError:
            return None
        except asyncio.CancelledError:
            if woken.done() and not woken.cancelled():
                self.wake_next(woken.result())  # not lost: the next may use it
            raise
        finally:
            waiter.woken = None

    def release_slot(self, instance: str) -> None:
        """A slot of ``instance`` is free: the request first in line that may use it and is
        waiting tries again (one per slot; the others keep waiting, rather than all trying for
        the one slot)."""
        self.holding[instance] -= 1
        self.wake_next(instance)

    def wake_next(self, instance: str) -> None:
        for waiter in self.waiting:
            woken = waiter.woken
            if instance in waiter.instances and woken is not None and not woken.done():
                woken.set_result(instance)
                return


class _Waiter:
    """A request in line for a slot: the prefills it may use, and, while it waits, what wakes
    it."""

    __slots__ = ("instances", "woken")

    def __init__(self, instances: frozenset[str]) -> None:
        self.instances = instances
        self.woken: asyncio.Future[str] | None = None


class Flight:
    """One forwarded request's share of its prefill's load, as the gateway counts it (the
    prefill's feedback, P/D-Serve §3.5): an open stream until it ends, a prompt in prefill until
    its first token, and a prefill slot until its second token (a decode has pulled the KV) or
    its end. A stream offered again mid-way (``resumed``) counts the same on its new entrance,
    its first token there not a TTFT."""

    def __init__(
        self,
        forwarder: Forwarder,
        instance: str,
        scenario: str,
        started: float,
        resumed: bool = False,
    ) -> None:
        self.forwarder, self.instance, self.tokens = forwarder, instance, 0
        self.scenario, self.started, self.resumed = scenario, started, resumed
        for counts in (forwarder.open, forwarder.prefilling, forwarder.holding):
            counts[instance] = counts.get(instance, 0) + 1
        forwarder.metrics.open_streams.inc()

    def token(self) -> None:
        self.tokens += 1
        if self.tokens == 1:
            self.forwarder.prefilling[self.instance] -= 1
            if not self.resumed:
                self.forwarder.metrics.ttft.labels(scenario=self.scenario).observe(
                    time.monotonic() - self.started
                )
        elif self.tokens == 2:
            self.forwarder.release_slot(self.instance)

    def end(self) -> None:
        if self.tokens < 1:
            self.forwarder.prefilling[self.instance] -= 1
        if self.tokens < 2:
            self.forwarder.release_slot(self.instance)
        self.forwarder.open[self.instance] -= 1
        self.forwarder.metrics.open_streams.dec()


def _drop_accepted(task: asyncio.Future[tuple[Entrance, EngineStream] | str]) -> None:
    """A try cancelled once its request was given up: its stream, if it got one meanwhile, goes."""
    if not task.cancelled() and task.exception() is None:
        answer = task.result()
        if not isinstance(answer, str):
            answer[1].release()


@dataclass
class Again:
    """How a leg is offered to another entrance when its own is lost: the request it belongs
    to, and when it came (its TTFT budget counts from then)."""

    forwarder: Forwarder
    scenario: str
    completion: Completion
    prompt: Prompt  # the leg's
    choice: int  # the leg's index in the request (its seed)
    started: float  # monotonic s: the request's arrival

    async def offer(self, leg: Leg, sent: int, stage: ReofferStage) -> str | None:
        """Offer ``leg`` (its client holding ``sent`` tokens) to another entrance, the lost one
        passed over: None once one took it (the leg now reads that entrance's stream, its lost
        stream and flight given back), else why not."""
        f = self.forwarder
        if leg.moves >= MAX_REOFFERS:
            f.metrics.migrations.labels(stage=stage, outcome=ReofferOutcome.BOUND).inc()
            return f"offered to another entrance {MAX_REOFFERS} times already (the bound)"
        leg.moves += 1
        f.failing[leg.instance] = time.monotonic() + PASSED_OVER_SECONDS
        try:
            chosen = await f.forward(
                self.scenario,
                f.discovery.routes(self.scenario),
                self.completion,
                self.prompt,
                self.choice,
                sent,
                self.started if stage is ReofferStage.BEFORE_FIRST_TOKEN else None,
            )
        except BadRequest as refused:  # e.g. the prompt with the tokens sent is too long now
            f.metrics.migrations.labels(stage=stage, outcome=ReofferOutcome.REFUSED).inc()
            return f"an entrance refused it: {refused.message}"
        if isinstance(chosen, str):
            f.metrics.migrations.labels(stage=stage, outcome=ReofferOutcome.NO_CAPACITY).inc()
            return chosen
        entrance, stream = chosen
        leg.upstream.release()  # broken: dropped
        leg.flight.end()
        leg.upstream, leg.instance = stream, entrance.instance
        leg.flight = Flight(f, entrance.instance, self.scenario, self.started, resumed=sent > 0)
        return None  # counted by the leg once the new stream goes on where it should

    def counted(self, stage: ReofferStage, outcome: ReofferOutcome) -> None:
        self.forwarder.metrics.migrations.labels(stage=stage, outcome=outcome).inc()


def _not_resumed(events: list[Event], sent: int) -> str | None:
    """Why a stream re-offered with ``sent`` tokens sent does not go on where it should (its
    first token not the one due), or None."""
    index = next((e.get("index") for e in events if e["type"] == "token"), sent)
    if index == sent:
        return None
    return f"an entrance refused it: its stream began at token {index!r}, not {sent}"


class Leg:
    """One choice of a request: its prefill's stream and flight, the tokens it relayed, its text
    up to the first stop string, and how it ended (a finish reason, or the engine's error).
    Its stream may come from several entrances in turn (:meth:`batch`, :class:`Again`)."""

    def __init__(
        self,
        index: int,
        completion: Completion,
        instance: str,
        upstream: EngineStream,
        flight: Flight,
        again: Again | None = None,
    ) -> None:
        self.index, self.instance = index, instance
        self.upstream, self.flight = upstream, flight
        self.again = again  # None: never offered to another entrance
        self.moves = 0  # offers to another entrance after its own was lost
        self.max_tokens = completion.max_tokens
        self.scanner = StopScanner(completion.stop) if completion.stop else None
        self.tokens = 0  # token events relayed (the usage's completion tokens)
        self.finish: str | None = None  # "stop" or "length" once it ended well
        self.done: Event | None = None  # the engine's own end
        self.error: Event | None = None  # the engine's failure, or the stream cut short
        self._lost: Event | None = None  # a lost entrance's error, after its tokens are taken
        self._closed = False

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None

    async def batch(self) -> list[Event]:
        """Its stream's next events (``[]``: the stream ended without its last event). A lost
        entrance (the batch's last event says so, or the stream ended early) is not the end:
        the tokens before the loss are returned first (taken on the flight they belong to, and
        a stop string among them ends the choice there), then the leg is offered to another
        (:class:`Again`), whose stream it reads from then on, once its first token is the one
        due (an entrance that does not resume there, one from before ``resumeAt``, is a
        refusal). When no entrance takes it, the loss ends it, its message saying why it did
        not move."""
        if self._lost is not None:  # a loss kept while the tokens before it were taken
            events, self._lost = [self._lost], None
        else:
            events = await self.upstream.batch()
        while True:
            if self.again is None or (events and events[-1]["type"] != "error"):
                return events  # the hot path: tokens, or the end
            last = events[-1] if events else _CUT
            if len(events) > 1:
                self._lost = last
                return events[:-1]
            stage = reoffer_stage(last, self.tokens, self.max_tokens)
            if stage is None:
                return events
            why_not = await self.again.offer(self, self.tokens, stage)
            if why_not is None:
                events = await self.upstream.batch()
                why_not = _not_resumed(events, self.tokens)
                outcome = ReofferOutcome.MOVED if why_not is None else ReofferOutcome.REFUSED
                self.again.counted(stage, outcome)
                if why_not is None:
                    continue  # its tokens, or another loss
            said = last.get("message")
            message = said[:400] if isinstance(said, str) else "the serving instance failed"
            return [last | {"message": f"{message}; not moved: {why_not}"}]

    def take(self, batch: list[Event]) -> list[str]:
        """The texts to pass on for a batch of its stream's events (an empty batch: the stream
        ended without its last event); ``ended`` says whether the choice is over."""
        pieces: list[str] = []
        if not batch:
            self.error = dict(_CUT)
        for event in batch:
            kind = event["type"]
            if kind == "token":
                self.flight.token()
                self.tokens += 1
                text = event.get("text")
                if not isinstance(text, str):  # an engine's text is not trusted to be one
                    text = ""
                if self.scanner is None:
                    pieces.append(text)
                    continue
                passed, stopped = self.scanner.feed(text)
                if passed:
                    pieces.append(passed)
                if stopped:
                    self.finish = "stop"
                    break
            elif kind == "done":
                if self.scanner is not None and (held := self.scanner.flush()):
                    pieces.append(held)
                self.done, self.finish = event, finish_reason(self.tokens, self.max_tokens)
                break
            elif kind == "error":
                self.error = event
                break
        return pieces

    def close(self) -> None:
        """Give its stream and its share of the prefill back (once): a stream not read to its
        end is dropped, so the engines stop working on it."""
        if not self._closed:
            self._closed = True
            self.upstream.release()
            self.flight.end()


class Reader:
    """A request's choices read together: the batches of whichever streams have events."""

    def __init__(self, legs: list[Leg]) -> None:
        self.legs = legs
        self._reads: dict[asyncio.Task[list[Event]], Leg] = {}

    async def next(self) -> list[tuple[Leg, list[Event]]]:
        """The next batches (each leg's), or ``[]`` once every leg has ended."""
        going = [leg for leg in self.legs if not leg.ended]
        if not going:
            return []
        if len(self.legs) == 1:  # one choice (the hot path): no task per batch
            return [(going[0], await going[0].batch())]
        reading = set(self._reads.values())
        for leg in going:
            if leg not in reading:
                self._reads[asyncio.ensure_future(leg.batch())] = leg
        finished, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
        return [(self._reads.pop(task), task.result()) for task in finished]

    def close(self) -> None:
        """Stop every read under way, then give every leg back."""
        for task in self._reads:
            task.cancel()
        self._reads.clear()
        for leg in self.legs:
            leg.close()
