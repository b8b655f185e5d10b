"""Prefill admission and prefill (P/D-Serve §3.5, §2.2.2).

A prefill **accepts or rejects**, never queues: a request is accepted only if a slot is free,
and "a prompt continuously occupies one slot in prefill if it is waiting for KVCache transfer to
a decoding". With a TTFT budget, a prompt that would miss it beside the prompts in prefill (or
make one of them miss its own) is refused at admission (early intervention), while the gateway
can still try another prefill. Prefill time comes from :mod:`enginestub.timing`; concurrent
prompts share the instance's compute (processor sharing), so TTFT grows with the batch as it
does on hardware. The baselines' admission ``queue`` keeps a local queue instead (the paper's
original version).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from enginestub import timing
from enginestub.engine.parts import Part, Shared
from enginestub.engine.sharing import SharedResource
from matrixserve.api.engine_protocol import EngineError, GenerateRequest


@dataclass
class PrefillTicket:
    """A request admitted to prefill: a slot held, or a place in the local queue."""

    request: GenerateRequest
    queued: bool = False  # in the local queue (admission "queue"): no slot yet
    deadline: float | None = None  # emulated time its first token is due by


class Prefill(Part):
    """The instance's prefill slots, its local queue (baselines only) and its compute."""

    def __init__(self, shared: Shared, compute: SharedResource) -> None:
        super().__init__(shared)
        self.compute = compute  # 1 emulated second of work per second
        self.shape = self.config.shape
        self.slots = 0  # in use
        self.queue = 0  # waiting in the local queue
        self._slot_freed = asyncio.Event()

    def admit(self, req: GenerateRequest) -> PrefillTicket:
        """Accept (take a slot, or a place in the local queue if asked) or raise."""
        if self.kv.bytes_for(req.prompt_tokens) > self.config.kv_capacity_bytes:
            raise EngineError(
                413, "prompt_too_long", "the prompt's KV cache does not fit this instance's HBM"
            )
        budget = req.ttft_budget
        ticket = PrefillTicket(req)
        if budget is not None:
            ticket.deadline = self.clock.now() + budget.emulated_seconds
        if (req.admission or self.config.admission) == "queue":  # the baseline: a local queue
            ticket.queued = True
            self.queue += 1
            self.metrics.requests.labels(stage="prefill", outcome="queued").inc()
            return ticket
        if self.slots >= self.config.max_batch:
            self.metrics.requests.labels(stage="prefill", outcome="rejected").inc()
            raise EngineError(
                429,
                "rejected",
                f"prefill busy: {self.slots}/{self.config.max_batch} slots in use",
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
        if not self.kv.reserve(req.prompt_tokens):
            self.metrics.requests.labels(stage="prefill", outcome="rejected").inc()
            raise EngineError(
                429, "rejected", "prefill busy: no HBM left for another prompt's KV cache"
            )
        self.slots += 1
        self.metrics.requests.labels(stage="prefill", outcome="accepted").inc()
        self.metrics.prefill_slots.set(self.slots)
        return ticket

    def free_slot(self, req: GenerateRequest) -> None:
        self.slots -= 1
        self.kv.release(req.prompt_tokens)
        self.metrics.prefill_slots.set(self.slots)
        self._slot_freed.set()

    async def wait_for_slot(self, ticket: PrefillTicket) -> None:
        """Queue mode: FIFO-ish wait until a slot and the prompt's KV fit."""
        try:
            while self.slots >= self.config.max_batch or not self.kv.reserve(
                ticket.request.prompt_tokens
            ):
                self._slot_freed.clear()
                await self._slot_freed.wait()
        finally:
            self.queue -= 1
        self.slots += 1
        ticket.queued = False
        self.metrics.prefill_slots.set(self.slots)

    def work(self, req: GenerateRequest) -> float:
        """The prompt's prefill alone on this instance (emulated seconds of its compute)."""
        return (
            timing.prefill_seconds(self.config.model, self.shape, req.prompt_tokens)
            * self.faults.slow_factor
        )

    async def run(self, ticket: PrefillTicket) -> float:
        """Prefill the prompt; returns its compute time (emulated s)."""
        return await self.compute.consume(self.work(ticket.request), deadline=ticket.deadline)
