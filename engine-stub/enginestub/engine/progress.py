"""One request's emulated times as its stream reports them (the ``t`` of each token, the
``done`` event's timings): every engine on the request's path (prefill, decode, colocated) counts
from when the request reached it."""

from __future__ import annotations

from dataclasses import dataclass

from enginestub.engine.clock import Clock
from matrixserve.api.engine_protocol import Event, GenerateRequest, Timings, done_event


@dataclass
class Progress:
    clock: Clock
    instance: str  # this engine, the ``prefill`` of its ``done`` events
    started: float  # emulated time the request reached this engine
    ttft: float = 0.0  # its first token (0 where another engine prefilled it)
    prefill: float = 0.0  # its prefill's compute time

    def elapsed(self) -> float:
        return self.clock.now() - self.started

    def done(
        self,
        req: GenerateRequest,
        tokens: int,
        tpots: list[float],
        kv: float,
        decode_instance: str | None,
        migrations: int = 0,
    ) -> Event:
        """The stream's ``done`` after ``tokens`` tokens (the request's, from its first),
        ``kv`` seconds of KV transfer, ``migrations`` moves to another decode."""
        e2e = self.elapsed()
        timings = Timings(
            ttft=self.ttft,
            prefill=self.prefill,
            kv_transfer=kv,
            tpot_mean=sum(tpots) / len(tpots) if tpots else 0.0,
            e2e=e2e,
        )
        return done_event(
            req.prompt_tokens, tokens, timings, self.instance, decode_instance or "", migrations
        )
