"""What the gateway does when the entrance serving a choice is lost, pure.

A decode lost behind it is the prefill's to mend (enginestub.engine.migration: the prefill sees
it, holds the request and maybe its KV); a lost entrance breaks the one stream the gateway has,
and only the gateway can offer the request again. Before the first token that is on-demand
forwarding again within the TTFT budget (P/D-Serve §3.5); after it, the new entrance is told where
the client is (``resumeAt``) and re-prefills the prompt with the tokens already sent. A stream
whose entrance was lost (:func:`entrance_lost`) is offered to another entrance, at most
:data:`MAX_REOFFERS` times, from where its client is (:func:`reoffer_stage`).
"""

from __future__ import annotations

from enum import StrEnum

from matrixserve.api.engine_protocol import Event

MAX_REOFFERS = 2  # offers of one choice to another entrance after its own was lost
# an entrance's stream ended by one of these, naming no decode: the entrance itself is gone
# (killed: the stream cut; faulty, hung or logically removed: its own error)
ENTRANCE_LOST_CODES = frozenset(
    {"upstream_failed", "stream_interrupted", "instance_removed", "device_fault", "engine_hung"}
)


class ReofferStage(StrEnum):
    """Where a choice was when its entrance was lost (the ``stage`` label of
    ``matrixserve_gateway_migrations_total``)."""

    BEFORE_FIRST_TOKEN = "before_first_token"
    MID_STREAM = "mid_stream"


class ReofferOutcome(StrEnum):
    """How the offer ended (the ``outcome`` label)."""

    MOVED = "moved"  # another entrance took it; its stream goes on
    NO_CAPACITY = "no_capacity"  # none took it within the budget
    BOUND = "bound"  # offered MAX_REOFFERS times already
    REFUSED = "refused"  # an entrance refused it (400/413), or did not resume where it was


def entrance_lost(event: Event) -> bool:
    """Whether a stream's last event says its entrance (the prefill and its relay) was lost,
    not a decode behind it: a decode's failure comes named (the prefill could not move it:
    another entrance of the group would meet the same decodes)."""
    if event.get("type") != "error" or event.get("code") not in ENTRANCE_LOST_CODES:
        return False
    said = event.get("instances")
    return not (isinstance(said, dict) and said.get("decode"))


def reoffer_stage(event: Event, tokens: int, max_tokens: int) -> ReofferStage | None:
    """Where a choice whose stream ended with ``event`` after ``tokens`` of its ``max_tokens``
    tokens is re-offered from; None when it is not (its end stands: not an entrance's loss, or
    nothing was left to serve)."""
    if not entrance_lost(event) or tokens >= max_tokens:
        return None
    return ReofferStage.BEFORE_FIRST_TOKEN if tokens == 0 else ReofferStage.MID_STREAM
