"""Forwarding to decode, the prefill's side (P/D-Serve §3.5-3.6): after the first token, the
request goes to a decode (round robin over the decodes the group's ``decode-meta`` names, less the
logically removed ones); a decode that is full (429) or refuses is passed over, and when every
decode refused, the prefill keeps the slot and the KV and tries again shortly (a finishing request
frees a decode slot). The decode's stream is relayed (its tokens numbered in the request's
output) and its ``done`` rewritten with the whole request's timings. A decode lost mid-way (its
stream broken or ended by its error) is not the end: the request moves to another decode, with
the KV still held here or re-prefilled with the output so far (:mod:`.migration` says why here and
the bound).

Until a decode has pulled the KV, the wait is bounded: a decode answering, even 429, is progress;
decodes that cannot be reached, or take the request and never pull it, end it with
``kv_pull_timeout`` after :func:`enginestub.engine.kvpull.kv_wait_bound` without progress, and the
slot is free. Closing the relay (its caller gone) closes the connection to the decode, whose handler
is cancelled in turn (so it stops generating for nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

import httpx

from enginestub.engine.kvpull import KvHoldings, PendingKV, kv_wait_bound
from enginestub.engine.migration import MOVED, Outcome, Relayed
from enginestub.engine.parts import Part, Shared
from enginestub.engine.prefill import Prefill, PrefillTicket
from enginestub.engine.progress import Progress
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import (
    EngineError,
    Event,
    GenerateRequest,
    PrefillRef,
    decode_body,
    error_event,
    synthetic_token,
    token_event,
)

log = logging.getLogger("enginestub.engine")
RETRY_SECONDS = 0.005  # emulated: after every decode refused
_T = TypeVar("_T")


class DecodeForwarder(Part):
    def __init__(
        self,
        shared: Shared,
        prefill: Prefill,
        holdings: KvHoldings,
        decodes: Callable[[], list[str]],
        entries: Callable[[], Sequence[zl.MapEntry]] = list,
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__(shared)
        self.prefill = prefill  # its slots and compute: a re-prefill takes them
        self.holdings = holdings  # the KV held for decodes to pull
        self._decodes = decodes  # host:port of the decodes open to this prefill now
        self._entries = entries  # the decode meta's: who is at which host:port
        self._serving = serving  # whether this prefill can compute (not faulty, hung, removed)
        self._turn = itertools.count()
        self._closing: set[asyncio.Task[None]] = set()  # decode streams being closed

    def _name(self, peer: str) -> str | None:
        """The instance of the decode at ``peer`` (host:port), as the decode meta names it."""
        return next((e.instance for e in self._entries() if f"{e.pod_ip}:{e.port}" == peer), None)

    def _named(self, event: Event, peer: str) -> Event:
        """An error of a stream the decode at ``peer`` took, naming that decode (the
        gateway passes the instances on, so a client tells a failure on a faulty instance from
        one elsewhere)."""
        # its host:port if the decode meta no longer lists it: a decode's error always names
        # one, so the gateway never takes it for its entrance's own
        on = {"prefill": self.config.instance, "decode": self._name(peer) or peer}
        return event | {"instances": on} if event.get("type") == "error" else event

    def candidates(self) -> list[str]:
        """The decodes to try, in this request's turn."""
        peers = self._decodes()
        if not peers:
            return []
        start = next(self._turn) % len(peers)
        return peers[start:] + peers[:start]

    async def relay(self, ticket: PrefillTicket, progress: Progress) -> AsyncGenerator[Event, None]:
        """The rest of the stream of a request prefilled here (``ticket``: its slot and KV, held
        until a decode has pulled it), from the decodes that take it. A decode lost on the way
        moves it (:mod:`.migration`): to another decode pulling the KV still held, or after a
        re-prefill here of the prompt and the output so far; at most ``MAX_MIGRATIONS`` times,
        else the lost decode's error ends the stream. Whatever it holds is dropped on every way
        out."""
        req = ticket.request
        moved = Relayed(sent=req.resume_at + 1)  # the prefill's token went first
        pending = self.holdings.hold(ticket)
        try:
            while True:
                async with contextlib.aclosing(
                    self._from_decode(req, progress, pending, moved)
                ) as events:
                    async for event in events:
                        yield event
                if moved.lost is None:
                    return  # its end (done, or an error no move mends)
                self.holdings.unpulled(pending)  # the lost decode's pull, if any, ended with it
                if moved.sent >= req.max_tokens:  # every token relayed: only its end was lost
                    yield progress.done(
                        req, moved.sent, [], 0.0, self._name(moved.lost_on), moved.migrations
                    )
                    return
                outcome = moved.plan(
                    not pending.released.is_set(), self._serving(), self._decodes()
                )
                if outcome is Outcome.REPREFILL:
                    self.holdings.drop(pending)  # what the lost decode took is lost with it
                    try:
                        ticket = await self.prefill.retake(
                            req.resumed(moved.sent), self.clock.to_wall(self._bound())
                        )
                    except TimeoutError:
                        outcome = Outcome.NO_SLOT
                    except EngineError:  # its context never fits: no wait would help
                        outcome = Outcome.TOO_LONG
                    else:
                        pending = self.holdings.hold(ticket)  # dropped below, on every way out
                        if not self._serving():  # it became faulty, hung or removed meanwhile
                            outcome = Outcome.UNAVAILABLE
                self.metrics.migrations.labels(outcome=outcome).inc()
                if outcome not in MOVED:
                    log.warning(
                        "request %s lost decode %s; not moved: %s",
                        req.request_id,
                        moved.lost_on,
                        outcome,
                    )
                    yield self._named(moved.refusal(outcome), moved.lost_on)
                    return
                lost_on = moved.lost_on
                moved.moved()
                log.info(
                    "request %s lost decode %s at token %d; moving (%s)",
                    req.request_id,
                    lost_on,
                    moved.sent,
                    outcome,
                )
                if outcome is Outcome.PULL:
                    continue
                progress.prefill += await self.prefill.run(ticket)
                ticket.prefilled_at = self.clock.now()  # its wait for a decode begins
                yield self._token(req, progress, moved)
                if moved.sent >= req.max_tokens:  # that was the last
                    yield progress.done(
                        req, moved.sent, [], 0.0, self.config.instance, moved.migrations
                    )
                    return
                moved.kv_at = moved.sent
        finally:
            self.holdings.drop(pending)

    @staticmethod
    def _token(req: GenerateRequest, progress: Progress, moved: Relayed) -> Event:
        """The next token of the request, made here (a re-prefill's)."""
        index = moved.sent
        moved.reprefilled()
        return token_event(index, synthetic_token(req.seed, index), progress.elapsed())

    def _decoded(self, moved: Relayed) -> None:
        """A decode's token goes to the caller (``moved.sent`` advances): a stall after a loss
        ends."""
        stalled = moved.token(self.clock.now())
        if stalled is not None:
            self.metrics.migration_stall.observe(stalled)

    async def _from_decode(
        self, req: GenerateRequest, progress: Progress, pending: PendingKV, moved: Relayed
    ) -> AsyncGenerator[Event, None]:
        """The stream of the decode that takes the request now (from output index
        ``moved.sent``, the KV held in ``pending``), relayed. Until a decode has pulled the KV,
        every wait is bounded by :func:`kv_wait_bound` counted from the request's last progress
        (prefill done, a decode answering, its pull starting): a decode that refuses (429) is
        alive and busy, and the prefill keeps trying; decodes that cannot be reached or do not
        answer make it give up with ``kv_pull_timeout``. A decode that took it and failed is
        left in ``moved.lost``, nothing yielded for it (the relay moves the request)."""
        cfg = self.config
        body = decode_body(
            req.resumed(moved.sent),
            PrefillRef(f"{cfg.host}:{cfg.port}", cfg.instance, tuple(cfg.roce_ips)),
        )
        while True:
            candidates = [peer for peer in self.candidates() if peer not in moved.failed]
            if not candidates:
                yield error_event("no_decode", "no decode instance is available to this prefill")
                return
            for peer in candidates:
                request = self.http.build_request("POST", f"http://{peer}/v1/decode", json=body)
                try:
                    response = await self._within(pending, self.http.send(request, stream=True))
                except TimeoutError:
                    yield self._gave_up(pending)
                    return
                except httpx.HTTPError as exc:
                    log.warning("decode %s unreachable for %s: %s", peer, req.request_id, exc)
                    continue
                try:
                    if response.status_code == 429:
                        pending.ticket.progressed()  # a live decode, full: busy, not stuck
                        continue
                    if response.status_code != 200:
                        text = await self._within(pending, response.aread())
                        log.warning(
                            "decode %s refused %s: %s %s",
                            peer,
                            req.request_id,
                            response.status_code,
                            text.decode(errors="replace")[:300],
                        )
                        continue
                    pending.ticket.progressed()  # a decode took it
                    async with contextlib.aclosing(
                        self._events(req, progress, pending, response, moved)
                    ) as events:
                        async for event in events:
                            if event.get("type") == "error":  # the decode's own failure
                                moved.lose(peer, event, self.clock.now())
                                return
                            yield event
                            if event.get("type") == "done":
                                return
                    moved.lose(
                        peer,
                        error_event(
                            "decode_failed",
                            f"decode instance {peer} closed the stream before the end",
                        ),
                        self.clock.now(),
                    )
                    return
                except TimeoutError:  # named if the decode had taken it (it never pulled)
                    gave_up = self._gave_up(pending)
                    yield self._named(gave_up, peer) if response.status_code == 200 else gave_up
                    return
                except httpx.HTTPError as exc:
                    moved.lose(
                        peer,
                        error_event(
                            "decode_failed",
                            f"decode instance {peer} failed mid-stream: {type(exc).__name__}",
                        ),
                        self.clock.now(),
                    )
                    return
                finally:
                    await self._close(response)
            # Every decode refused: keep the slot and the KV, retry shortly (a finishing
            # request frees a decode slot, P/D-Serve §3.6) - within the bound.
            if self._left(pending) <= 0:
                yield self._gave_up(pending)
                return
            await self.clock.sleep(RETRY_SECONDS)

    async def _events(
        self,
        req: GenerateRequest,
        progress: Progress,
        pending: PendingKV,
        response: httpx.Response,
        moved: Relayed,
    ) -> AsyncGenerator[Event, None]:
        """The decode's events: its tokens, each the request's next (``moved.sent`` on; any
        other index, or one past ``max_tokens``, is its failure), its ``done`` as the whole
        request's."""
        lines = response.aiter_lines()
        while True:
            try:
                line = await self._within(pending, anext(lines))
            except StopAsyncIteration:
                return
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "token":
                if event.get("index") != moved.sent or moved.sent >= req.max_tokens:
                    # not where the request goes on (an engine from before resumeAt starts at
                    # 0, and makes the whole output again): a decode that failed it
                    yield error_event(
                        "decode_failed",
                        f"decode answered token {event.get('index')!r} where {moved.sent} of "
                        f"{req.max_tokens} was due",
                    )
                    return
                event["t"] = progress.elapsed()
                self._decoded(moved)
            if event.get("type") == "done":
                event = self._whole(req, progress, event, moved)
            yield event

    async def _close(self, response: httpx.Response) -> None:
        """Close the decode's stream whatever interrupts the close: a caller gone shows first as a
        write that fails, then its connection's loss cancels the handler task, often while this
        close awaits; a response left open keeps its decode generating into a connection nobody
        reads (a batch place held for the request's whole length). The close runs in a task of its
        own, held until done; a cancellation still ends the stream at once."""
        task = asyncio.get_running_loop().create_task(response.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    def _bound(self) -> float:
        return kv_wait_bound(self.config, self.faults.slow_factor)

    def _left(self, pending: PendingKV) -> float:
        """Emulated seconds left before the wait for a decode to pull the KV gives up."""
        hold = pending.ticket.hold
        idle = hold.idle(self.clock.now()) if hold is not None else 0.0
        return self._bound() - idle

    async def _within(self, pending: PendingKV, step: Awaitable[_T]) -> _T:
        """``step``, within what is left of the bound while the KV waits for its pull
        (unbounded once pulled: the slot is free, and the gateway watches a silent stream)."""
        if pending.released.is_set():
            return await step
        async with asyncio.timeout(max(self.clock.to_wall(self._left(pending)), 0.0)):
            return await step

    def _gave_up(self, pending: PendingKV) -> Event:
        self.metrics.requests.labels(stage="prefill", outcome="kv_timeout").inc()
        return error_event(
            "kv_pull_timeout",
            f"no decode took the request and pulled its KV within {self._bound():.3f}s "
            "of its last progress (the KV-pull wait bound)",
        )

    @staticmethod
    def _whole(req: GenerateRequest, progress: Progress, decoded: Event, moved: Relayed) -> Event:
        """The decode's ``done`` as the whole request's: every token relayed counted, its TTFT
        and prefill time (its re-prefills' included), the (last) decode's TPOT and KV
        transfer, its moves."""
        timings = decoded["timings"]
        return progress.done(
            req,
            moved.sent,
            [timings["tpotMean"]] if timings["tpotMean"] else [],
            timings["kvTransfer"],
            decoded["instances"]["decode"],
            moved.migrations,
        )
