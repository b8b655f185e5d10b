"""Decode: admission, and the continuous-batching loop (P/D-Serve §3.6).

A decode accepts a request from a prefill if its batch and HBM allow, and the TPOT SLO if the
group sets one (CloudMatrix-Infer §5.2: the batch is chosen to meet it; a request is refused
when the modelled step of the batch with it would exceed the SLO, never when the batch is empty)
(429 otherwise; a place counts from admission, its KV pull included), pulls the KV (:mod:`.kvpull`), and the request
joins the running batch at the next iteration; it leaves the batch when its stream is closed
(its last token, or its caller gone). One step emits a token for every running request; the step
time is the model's TPOT for the current batch and mean context, scheduled on absolute deadlines so
event-loop overhead does not accumulate into the reported timings. A colocated instance runs the
same batch after its own prefill.

What a step costs is the batch's :class:`StepModel`: the colocated model's TPOT
(:class:`ColocatedStep`, the default), or an attention client's iteration with its experts served
elsewhere (:mod:`.attention`), which may make more than one token per request (MTP's accepted
tokens, counted per request so each makes its share) and may fail the batch (an expert without a
copy).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from enginestub import timing
from enginestub.engine.parts import Hold, Part, Shared
from enginestub.engine.progress import Progress
from matrixserve.api.engine_protocol import (
    EngineError,
    Event,
    GenerateRequest,
    error_event,
    synthetic_token,
    token_event,
)

# What the loop hands a request's stream: a token (its index, text and TPOT), the error event
# that ends it early, or None after its last token.
_Token = tuple[int, str, float]


@dataclass(eq=False)
class Sequence:
    """One request in the decode batch; it leaves when its :attr:`hold` is released (its last
    token, a device fault, or its caller gone). Its tokens are the request's from index
    :attr:`first` on (the prefill made those before; a stream that moved here made more)."""

    request_id: str
    kv_tokens: int
    remaining: int
    hold: Hold  # its place in the batch and its KV (prompt and output)
    seed: int = 0  # the request's token seed (engine_protocol.token_seed)
    first: int = 1  # the index in the request's output of the first token it makes here
    events: asyncio.Queue[_Token | Event | None] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    last_token_at: float = 0.0
    accepted: float = 0.0  # tokens its steps have accepted (whole ones are emitted)

    @property
    def ended(self) -> bool:
        return self.hold.released

    def take(self, accepted: float) -> int:
        """The whole tokens a step that accepts ``accepted`` per request makes for it."""
        before = int(self.accepted)
        self.accepted += accepted
        return min(int(self.accepted) - before, self.remaining)


class StepModel(Protocol):
    def per_token(self, requests: int, kv_tokens: int) -> float:
        """Emulated seconds per output token of a batch of ``requests`` (for admission)."""
        ...

    async def step(self, batch: list[Sequence]) -> tuple[float, float]:
        """Make one step of ``batch``: its emulated seconds and the tokens it accepts per
        request; raises :class:`EngineError` when it cannot be made (the batch fails)."""
        ...


class ColocatedStep:
    """The colocated model: the TPOT of the batch at its mean context, one token a step
    (MTP's acceptance is in the TPOT, 001 §4.2.4)."""

    def __init__(self, batch: DecodeBatch) -> None:
        self.batch = batch

    def per_token(self, requests: int, kv_tokens: int) -> float:
        config, shape = self.batch.config, self.batch.shape
        return timing.tpot(config.model, shape, requests / shape.npus, kv_tokens)

    async def step(self, batch: list[Sequence]) -> tuple[float, float]:
        kv_mean = sum(s.kv_tokens for s in batch) / len(batch)
        return self.per_token(len(batch), int(kv_mean)), 1.0


class DecodeBatch(Part):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self.shape = self.config.shape
        self.cost: StepModel = ColocatedStep(self)
        self.places: set[Hold] = set()  # admitted: pulling their KV, joining or running
        self.running: list[Sequence] = []
        self.joining: list[Sequence] = []  # join the batch at its next step
        self._wake = asyncio.Event()

    def admit(self, tokens: int, *, limit: bool = True) -> Hold:
        """A place in the batch (counted from admission, its KV pull included, so a decode never
        takes more than its batch) and HBM for ``tokens`` (prompt and output), or raise.
        ``limit=False``: a colocated instance's request, whose prefill slot was the limit."""
        if limit and len(self.places) >= self.config.max_batch:
            self.metrics.requests.labels(stage="decode", outcome="rejected").inc()
            raise EngineError(429, "rejected", f"decode batch full: {self.config.max_batch}")
        if limit and self.places and (step := self.step_with(tokens)) is not None:
            self.metrics.requests.labels(stage="decode", outcome="rejected").inc()
            raise EngineError(
                429,
                "rejected",
                f"decode TPOT SLO: a batch of {len(self.places) + 1} would step in "
                f"{step:.1f} ms > {self.config.tpot_slo_ms:g} ms",
            )
        lease = self.kv.lease(tokens)
        if lease is None:
            self.metrics.requests.labels(stage="decode", outcome="rejected").inc()
            raise EngineError(
                429, "rejected", "decode HBM full: no room for this request's KV cache"
            )
        hold = Hold(self.clock, lease, self.places.discard)
        self.places.add(hold)
        self.metrics.requests.labels(stage="decode", outcome="accepted").inc()
        return hold

    def step_with(self, tokens: int) -> float | None:
        """The modelled step (emulated ms) of the batch with one more request of ``tokens``
        (prompt and output: its context at its end, so the SLO holds to the last token), if
        it would exceed the TPOT SLO; None if it would not, or there is no SLO. Requests
        admitted but not running yet count at the new one's size (their KV is being pulled)."""
        slo = self.config.tpot_slo_ms
        if slo is None:
            return None
        running = [s.kv_tokens + s.remaining for s in (*self.running, *self.joining) if not s.ended]
        others = max(len(self.places) - len(running), 0)
        n = len(running) + others + 1
        mean = (sum(running) + tokens * (others + 1)) / n
        step = self.cost.per_token(n, int(mean)) * 1000
        return step if step > slo else None

    def join(self, seq: Sequence) -> None:
        seq.hold.progressed()
        self.joining.append(seq)
        self._wake.set()

    def leave(self, seq: Sequence) -> None:
        """The sequence is out of the batch, its place and KV given back (if not already)."""
        seq.hold.release()
        with contextlib.suppress(ValueError):
            self.running.remove(seq)
        with contextlib.suppress(ValueError):
            self.joining.remove(seq)

    def fail_all(self, why: str, code: str = "device_fault") -> None:
        """A device fault (or another ``code``): every request in the batch ends with an
        error."""
        for seq in [*self.running, *self.joining]:
            seq.events.put_nowait(error_event(code, why))
            seq.events.put_nowait(None)
            seq.hold.release()
            self.metrics.requests.labels(stage="decode", outcome="failed").inc()
        self.running.clear()
        self.joining.clear()

    async def stream(
        self,
        seq: Sequence,
        req: GenerateRequest,
        progress: Progress,
        kv: float,
        instance: str,
        offset: int,
    ) -> AsyncGenerator[Event, None]:
        """The sequence joins the batch; its tokens as they come (numbered in the request's
        output), then its ``done`` (the request's tokens so far). ``offset``: tokens this
        instance made before it joined (its prefill's first, when it prefilled it). Closing the
        stream takes the sequence out of the batch."""
        tpots: list[float] = []
        self.join(seq)
        try:
            while (item := await seq.events.get()) is not None:
                if not isinstance(item, tuple):
                    yield item  # the error that ends it
                    return
                index, text, tpot = item
                tpots.append(tpot)
                yield token_event(index, text, progress.elapsed())
            stats = self.metrics.load
            stats.decoded += 1
            stats.output_tokens += seq.emitted + offset
            stats.decode_s += progress.elapsed()
            yield progress.done(req, seq.first + seq.emitted, tpots, kv, instance)
        finally:  # its end, or its caller gone: out of the batch at once
            self.leave(seq)

    async def loop(self) -> None:
        """Continuous batching: one token per running request per step (absolute deadlines)."""
        deadline = self.clock.now()
        while True:
            if not self.running and not self.joining:
                self._wake.clear()
                await self._wake.wait()
                deadline = self.clock.now()
            await self.faults.not_hung.wait()
            if self.joining:
                self.running.extend(self.joining)
                self.joining.clear()
            batch = [s for s in self.running if not s.ended]
            self.running = batch
            if not batch:
                continue
            try:
                step, accepted = await self.cost.step(batch)
            except EngineError as exc:  # the step cannot be made: the batch fails with it
                self.fail_all(exc.message, exc.code)
                self.heartbeat.beat()
                continue
            step *= self.faults.slow_factor
            if self.config.step_scheduling == "relative":
                await self.clock.sleep(step)  # baseline: the loop's own overhead adds to every step
            else:
                deadline = max(deadline + step, self.clock.now() - step)  # never burst to catch up
                await self.clock.sleep_until(deadline)
            now = self.clock.now()
            stats = self.metrics.load
            stats.iterations += 1
            stats.batch_sum += len(batch)
            for seq in batch:
                if seq.ended:
                    continue
                made = seq.take(accepted)
                if not made:
                    continue
                gap = (now - seq.last_token_at if seq.emitted else step) / made
                seq.last_token_at = now
                for _ in range(made):
                    seq.kv_tokens += 1
                    seq.remaining -= 1
                    index = seq.first + seq.emitted
                    seq.events.put_nowait((index, synthetic_token(seq.seed, index), gap))
                    seq.emitted += 1
                    self.metrics.tpot.observe(gap)
                    stats.tokens += 1
                    stats.tpot_s += gap
                seq.hold.progressed()
                if seq.remaining <= 0:
                    seq.events.put_nowait(None)
                    seq.hold.release()
            self.running = [s for s in self.running if not s.ended]
            self.heartbeat.beat()  # an iteration of the serving loop (the hang tier)
