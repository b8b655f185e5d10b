"""A stream that survives its decode: when the decode serving a request dies, is logically removed,
faults or hangs mid-stream, the request moves to another decode of the group and its stream goes on,
its caller seeing one stream with no token twice and none missing.

**Where it lives: in the prefill that relays the decode's stream** (:mod:`.to_decode`), not in
the gateway. P/D-Serve's stream runs decode -> prefill -> gateway (§3.5), and the prefill is the
one part that has everything a move needs:

- it sees the decode's stream break first (P/D-Serve §3.4: "related prefill instances (LLM
  Serving is aware of the timeout)" are the ones that act on a decode's fault);
- it holds the request: its prompt, its token seed, and how many tokens it relayed (the index
  the stream must go on at);
- it may still hold the prompt's KV: a prefill keeps the KV, and its slot, until a decode has
  pulled it (§3.5: "a prompt continuously occupies one slot in prefill if it is waiting for
  KVCache transfer"; §3.6: the decode retrieves it; xDeepServe §5.1 step 8: the prefill releases
  the blocks once the transfer completes). A decode lost before its pull ended leaves the KV
  here, and another decode pulls it (``pull``: nothing is computed again);
- it has the decode meta (§3.4: the prefill forwards to "any decoding instance in a group") and
  the compute to prefill again: once the KV was pulled, the prefill re-prefills the prompt plus
  the output tokens already sent (``reprefill``: xDeepServe §6.2 recomputes tokens rather than
  restarting; the cost is the timing model's prefill of the longer context, in emulated time),
  makes the next token as any prefill makes its first, and forwards the request to another
  decode with where to resume;
- and the gateway keeps its one upstream connection: nothing changes for it or its client.

The gateway's part is the entrance's own loss (:mod:`matrixserve.gateway.forwarder`): before the
first token it offers the request to another entrance within its TTFT budget (P/D-Serve §3.5),
after it with ``resumeAt``. P/D-Serve itself ends such streams with a default text ("not
consider request migration in this paper due to maintained streaming", §3.4); moving them is
ours, on its recovery's terms: the faulty decode is never tried again for that request.

**The bound**: a request moves at most :data:`MAX_MIGRATIONS` times, each time to a decode that
has not failed it; a re-prefill waits at most the KV-pull wait bound for a slot (ahead of new
requests: :meth:`enginestub.engine.prefill.Prefill.retake`). When it cannot move (the bound, no
other decode open to this prefill, no slot in time, a context that never fits this prefill's
HBM, this prefill not serving, before the re-prefill or after its wait for a slot) the stream ends
with the lost decode's error, named as before, its message saying why it did not move.

What a move takes is given back on every path: the KV held for the lost decode when the request
is re-prefilled, the slot of a re-prefill (a ``PendingKV`` whose drop releases it, in the relay's
``finally``), the connection to each decode (closed as the relay leaves it); a caller gone
mid-move cancels the wait, the re-prefill or the new decode's stream like any other.

:class:`Relayed` (one relayed request's progress and its moves) and :meth:`Relayed.plan` are
pure: no I/O, no clock (the caller passes ``now``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from matrixserve.api.engine_protocol import Event

MAX_MIGRATIONS = 2  # moves of one request to another decode, each to one that has not failed it


class Outcome(StrEnum):
    """How an attempt to move a request ended (the ``outcome`` label of
    ``matrixserve_engine_migrations_total``)."""

    PULL = "pull"  # moved: the KV was still here, another decode pulls it
    REPREFILL = "reprefill"  # moved: re-prefilled here with the output so far
    BOUND = "bound"  # not moved: it moved MAX_MIGRATIONS times already
    UNAVAILABLE = "unavailable"  # not moved: this prefill is not serving (faulty, hung, removed)
    NO_DECODE = "no_decode"  # not moved: no other decode is open to this prefill
    NO_SLOT = "no_slot"  # not moved: no slot for the re-prefill within the bound
    TOO_LONG = "too_long"  # not moved: the prompt with the output so far never fits this HBM


OUTCOMES = tuple(o.value for o in Outcome)
MOVED = frozenset({Outcome.PULL, Outcome.REPREFILL})

_WHY_NOT = {
    Outcome.BOUND: f"it moved {MAX_MIGRATIONS} times already (the bound)",
    Outcome.UNAVAILABLE: "this prefill is not serving",
    Outcome.NO_DECODE: "no other decode is open to this prefill",
    Outcome.NO_SLOT: "no prefill slot for its re-prefill within the KV-pull wait bound",
    Outcome.TOO_LONG: "the KV of its prompt and the output so far never fits this prefill's HBM",
}


@dataclass
class Relayed:
    """One request as its prefill relays it: the output tokens its caller has, where the KV held
    for it starts, the decodes it lost, its moves, and the loss being handled."""

    sent: int  # output tokens the caller has (the index of the next one)
    kv_at: int = 0  # ``sent`` when the KV held for it now was made: a decode starts there
    migrations: int = 0
    failed: set[str] = field(default_factory=set)  # decodes (host:port) that failed it
    lost: Event | None = None  # the last decode's failure (its error event), until moved
    lost_on: str = ""  # that decode
    lost_at: float | None = None  # emulated time of the loss, until the next token

    def __post_init__(self) -> None:
        self.kv_at = self.kv_at or self.sent

    def lose(self, decode: str, error: Event, now: float) -> None:
        """The decode serving it failed with ``error`` (its own error event, or the relay's for
        a stream that broke)."""
        self.failed.add(decode)
        self.lost, self.lost_on = error, decode
        if self.lost_at is None:  # a stall counts from the first loss until a token comes
            self.lost_at = now

    def plan(self, kv_held: bool, serving: bool, decodes: Iterable[str]) -> Outcome:
        """How to move it after a loss: with ``kv_held`` (the KV made for the lost decode is
        still here, none pulled), ``serving`` (this prefill can compute), ``decodes`` (those
        open to this prefill now)."""
        if self.migrations >= MAX_MIGRATIONS:
            return Outcome.BOUND
        if not serving:
            return Outcome.UNAVAILABLE
        if not any(d not in self.failed for d in decodes):
            return Outcome.NO_DECODE
        # the KV held covers the context the next decode starts from only if no decode token
        # was relayed since it was made
        return Outcome.PULL if kv_held and self.sent == self.kv_at else Outcome.REPREFILL

    def moved(self) -> None:
        self.migrations += 1
        self.lost = None

    def token(self, now: float) -> float | None:
        """A decode's token goes to the caller: ``sent`` advances; the stall it ends (emulated
        s since the loss: the stream flows again), if it ends one."""
        self.sent += 1
        stalled, self.lost_at = self.lost_at, None
        return None if stalled is None else now - stalled

    def reprefilled(self) -> None:
        """The re-prefill's token goes to the caller (the stall goes on until the next decode's
        first token: it includes the hand-over to that decode)."""
        self.sent += 1

    def refusal(self, outcome: Outcome) -> Event:
        """The stream's last event when it cannot move: the lost decode's error, saying why."""
        assert self.lost is not None, "a refusal follows a loss"
        message = self.lost.get("message")
        said = message if isinstance(message, str) else "the decode failed"
        return self.lost | {"message": f"{said}; not moved to another decode: {_WHY_NOT[outcome]}"}
