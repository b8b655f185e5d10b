"""Prefill admission and prefill (P/D-Serve §3.5, §2.2.2).

A prefill **accepts or rejects**, never queues: a request is accepted only if a slot is free,
and "a prompt continuously occupies one slot in prefill if it is waiting for KVCache transfer to
a decoding". With a TTFT budget, a prompt that would miss it beside the prompts in prefill (or
make one of them miss its own) is refused at admission (early intervention), while the gateway
can still try another prefill. Prefill time comes from :mod:`enginestub.timing`; concurrent
prompts share the instance's compute (processor sharing), so TTFT grows with the batch as it
does on hardware. The baselines' admission ``queue`` keeps a local queue instead (the paper's
original version).

A request that continues after its decode was lost (:mod:`.migration`) takes a slot back for its
re-prefill (:meth:`Prefill.retake`): it waits for one, ahead of new requests (admission counts it as
taken), within a bound, since this prefill already accepted it. Those taking slots back are served
in arrival order, each as soon as one slot is free: any number of them (a decode lost with more
streams than this prefill has slots) move in turn.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from enginestub import timing
from enginestub.engine.kvcache import KvLease
from enginestub.engine.parts import Hold, Part, Releasable, Shared
from enginestub.engine.sharing import SharedResource
from matrixserve.api.engine_protocol import EngineError, GenerateRequest


class PrefillTicket(Releasable):
    """A request admitted to prefill: a slot held (its :attr:`hold`, with the prompt's KV), or
    a place in the local queue. Whoever ends the exchange calls :meth:`release` (the HTTP
    handler's ``with`` block always does); it gives back what the ticket has, once."""

    def __init__(self, prefill: Prefill, request: GenerateRequest, deadline: float | None) -> None:
        self._prefill = prefill
        self.request = request
        self.deadline = deadline  # emulated time its first token is due by
        self.queued = False  # in the local queue (admission "queue"): no slot yet
        self.hold: Hold | None = None  # its slot and the prompt's KV, while it has them
        self.slot_since: float | None = None  # when it took its slot (emulated)
        self.prefilled_at: float | None = None  # when its prefill ended

    def progressed(self) -> None:
        if self.hold is not None:
            self.hold.progressed()

    def prefilled(self, ttft: float) -> None:
        """Its prefill is done: counted (the load its health reports), and its slot's wait for a
        decode begins."""
        stats = self._prefill.metrics.load
        stats.prefilled += 1
        stats.ttft_s += ttft
        stats.prompt_tokens += self.request.prompt_tokens
        self.prefilled_at = self._prefill.clock.now()

    def release(self) -> None:
        """Leave the queue, or give back the slot and the prompt's KV; once."""
        if self.queued:
            self.queued = False
            self._prefill.queue -= 1
        if self.hold is not None:
            if not self.hold.released and self.slot_since is not None:
                now, stats = self._prefill.clock.now(), self._prefill.metrics.load
                stats.slot_s += now - self.slot_since
                if self.prefilled_at is not None:
                    stats.kv_wait_s += now - self.prefilled_at
            self.hold.release()


class Prefill(Part):
    """The instance's prefill slots, its local queue (baselines only) and its compute."""

    def __init__(self, shared: Shared, compute: SharedResource) -> None:
        super().__init__(shared)
        self.compute = compute  # 1 emulated second of work per second
        self.shape = self.config.shape
        self.held: set[Hold] = set()  # the slots in use
        self.queue = 0  # waiting in the local queue
        # accepted requests waiting to take a slot back (a re-prefill), first come first
        self._returners: collections.deque[object] = collections.deque()
        self._slot_freed = asyncio.Event()

    @property
    def returning(self) -> int:
        """Accepted requests waiting to take a slot back (admission counts them as taken)."""
        return len(self._returners)

    @property
    def slots(self) -> int:
        """Slots in use."""
        return len(self.held)

    def check_fits(self, req: GenerateRequest) -> None:
        """Raise 413 if the KV of ``req``'s context can never fit this instance's HBM."""
        if self.kv.bytes_for(req.context_tokens) > self.config.kv_capacity_bytes:
            raise EngineError(
                413, "prompt_too_long", "the prompt's KV cache does not fit this instance's HBM"
            )

    def admit(self, req: GenerateRequest) -> PrefillTicket:
        """Accept (take a slot, or a place in the local queue if asked) or raise."""
        self.check_fits(req)
        budget = req.ttft_budget
        ticket = PrefillTicket(
            self,
            req,
            self.clock.now() + budget.emulated_seconds if budget is not None else None,
        )
        if (req.admission or self.config.admission) == "queue":  # the baseline: a local queue
            ticket.queued = True
            self.queue += 1
            self.metrics.requests.labels(stage="prefill", outcome="queued").inc()
            return ticket
        if self.slots + self.returning >= self.config.max_batch:
            self.metrics.requests.labels(stage="prefill", outcome="rejected").inc()
            waiting = f", {self.returning} taken back" if self.returning else ""
            raise EngineError(
                429,
                "rejected",
                f"prefill busy: {self.slots}/{self.config.max_batch} slots in use{waiting}",
            )
        if (
            budget is not None
            and ticket.deadline is not None
            and not self.compute.admits(self.work(req), ticket.deadline)
        ):
            # Early intervention (P/D-Serve §2.2.2) at admission: a prompt that cannot get its
            # first token within its budget beside the prompts in prefill (processor sharing,
            # nothing else arriving), or that would make one of them miss its own, is refused
            # now, while the gateway can still try another prefill, instead of failing the
            # check after prefill.
            self.metrics.requests.labels(stage="prefill", outcome="rejected_deadline").inc()
            raise EngineError(
                429,
                "rejected",
                f"prefill busy: beside the {self.compute.active} prompt(s) in prefill the first "
                f"token would miss its {budget.emulated_seconds:.3f}s budget, or make one of "
                "them miss its own",
            )
        lease = self.kv.lease(req.context_tokens)
        if lease is None:
            self.metrics.requests.labels(stage="prefill", outcome="rejected").inc()
            raise EngineError(
                429, "rejected", "prefill busy: no HBM left for another prompt's KV cache"
            )
        self._take_slot(ticket, lease)
        self.metrics.requests.labels(stage="prefill", outcome="accepted").inc()
        return ticket

    def _take_slot(self, ticket: PrefillTicket, lease: KvLease) -> None:
        ticket.hold = Hold(self.clock, lease, self._free)
        ticket.slot_since = self.clock.now()
        self.held.add(ticket.hold)

    def _free(self, hold: Hold) -> None:
        self.held.discard(hold)
        self._slot_freed.set()

    async def wait_for_slot(self, ticket: PrefillTicket) -> None:
        """Queue mode: FIFO-ish wait until a slot (those being taken back counted as taken) and
        the prompt's KV fit."""
        lease = await self._free_slot(
            ticket.request.context_tokens,
            lambda: self.slots + self.returning < self.config.max_batch,
        )
        ticket.queued = False
        self.queue -= 1
        self._take_slot(ticket, lease)

    async def retake(self, req: GenerateRequest, bound: float) -> PrefillTicket:
        """A slot and the KV of ``req``'s context for a request this prefill accepted before and
        re-prefills (its decode was lost): ahead of new requests, in turn with the others
        taking one back (each takes the first slot free when its turn comes), waited for at
        most ``bound`` wall seconds (TimeoutError past it). Raises 413 at once if that context
        can never fit. The caller releases the ticket."""
        self.check_fits(req)
        turn = object()
        self._returners.append(turn)
        try:
            async with asyncio.timeout(bound):
                lease = await self._free_slot(
                    req.context_tokens,
                    lambda: self._returners[0] is turn and self.slots < self.config.max_batch,
                )
        finally:
            self._returners.remove(turn)
            # the next in line (or a new request's wait) looks again, whether this one took a
            # slot, gave up or was cancelled
            self._slot_freed.set()
        ticket = PrefillTicket(self, req, None)
        self._take_slot(ticket, lease)
        return ticket

    async def _free_slot(self, tokens: int, free: Callable[[], bool]) -> KvLease:
        """Wait until ``free()`` (a slot is this waiter's) and the KV of ``tokens`` fits; that
        KV's lease."""
        while True:
            if free():
                lease = self.kv.lease(tokens)
                if lease is not None:
                    return lease
            self._slot_freed.clear()
            await self._slot_freed.wait()

    def work(self, req: GenerateRequest) -> float:
        """The prompt's prefill alone on this instance (emulated seconds of its compute): its
        context, the output its caller already has included (a stream that continues)."""
        return (
            timing.prefill_seconds(self.config.model, self.shape, req.context_tokens)
            * self.faults.slow_factor
        )

    async def run(self, ticket: PrefillTicket) -> float:
        """Prefill the prompt; returns its compute time (emulated s). Its slot is working (not
        idle) meanwhile: the shared compute advances every prompt in it."""
        hold = ticket.hold
        assert hold is not None, "prefill without a slot"
        hold.working = True
        try:
            seconds = await self.compute.consume(
                self.work(ticket.request), deadline=ticket.deadline
            )
            # A hung serving loop completes no prefill; a completed one is the loop's beat.
            await self.faults.not_hung.wait()
            self.heartbeat.beat()
            return seconds
        finally:
            hold.working = False
            hold.progressed()
