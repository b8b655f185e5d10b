"""How a prefill moves a request whose decode was lost (issue 31 item 2), pure
(``enginestub.engine.migration.Relayed``): the KV still held and nothing decoded since it was
made is pulled by another decode, else the request is re-prefilled; never to a decode that failed
it; at most ``MAX_MIGRATIONS`` moves; the stall it costs counts from the first loss to the next
decode's first token; a request that cannot move ends with the lost decode's error, saying why."""

from __future__ import annotations

import pytest

from enginestub.engine.migration import MAX_MIGRATIONS, MOVED, OUTCOMES, Outcome, Relayed
from matrixserve.api.engine_protocol import error_event

A, B, C = "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"


def _lost(sent: int = 5, on: str = A, at: float = 1.0) -> Relayed:
    moved = Relayed(sent=1)
    while moved.sent < sent:
        moved.token(0.0)
    moved.lose(on, error_event("decode_failed", "it went"), at)
    return moved


@pytest.mark.parametrize(
    ("kv_held", "decoded_since", "outcome"),
    [
        (True, False, Outcome.PULL),  # lost before (or during) its pull: the KV is still here
        (False, False, Outcome.REPREFILL),  # pulled, lost before its first token
        (False, True, Outcome.REPREFILL),  # pulled and decoding
        (True, True, Outcome.REPREFILL),  # KV held, but tokens came since: it covers too little
    ],
)
def test_the_kv_still_held_is_pulled_by_the_next_decode_only_if_it_covers_the_context(
    kv_held: bool, decoded_since: bool, outcome: Outcome
) -> None:
    moved = Relayed(sent=1)  # the prefill's first token went: its KV covers the prompt
    if decoded_since:
        moved.token(0.5)
    moved.lose(A, error_event("decode_failed", "it went"), 1.0)
    assert moved.plan(kv_held, True, [A, B]) is outcome


def test_a_request_never_goes_back_to_a_decode_that_failed_it_and_moves_a_bounded_number_of_times() -> (
    None
):
    moved = _lost(on=A)
    assert moved.plan(False, True, [A]) is Outcome.NO_DECODE
    assert moved.plan(False, True, [A, B]) is Outcome.REPREFILL
    for n in range(MAX_MIGRATIONS):
        moved.moved()
        moved.lose((B, C)[n % 2], error_event("device_fault", "die down"), 2.0 + n)
    assert moved.migrations == MAX_MIGRATIONS
    assert moved.plan(False, True, [A, B, C, "127.0.0.1:9"]) is Outcome.BOUND
    assert moved.failed == {A, B, C}


def test_a_prefill_that_cannot_compute_moves_nothing() -> None:
    assert _lost().plan(True, False, [A, B]) is Outcome.UNAVAILABLE


def test_the_stall_counts_from_the_first_loss_to_the_next_decodes_first_token() -> None:
    moved = _lost(sent=5, at=10.0)
    moved.moved()
    moved.lose(B, error_event("decode_failed", "again"), 10.5)  # the next decode lost too
    assert moved.sent == 5
    moved.reprefilled()  # the re-prefill's token: the next decode is not streaming yet
    assert moved.sent == 6
    assert moved.token(10.8) == pytest.approx(0.8)  # the next decode's first
    assert moved.sent == 7
    assert moved.token(10.9) is None  # no stall to end


def test_a_request_that_cannot_move_ends_with_its_decodes_error_saying_why() -> None:
    moved = _lost()
    ending = moved.refusal(Outcome.NO_DECODE)
    assert (ending["type"], ending["code"]) == ("error", "decode_failed")
    assert ending["message"] == (
        "it went; not moved to another decode: no other decode is open to this prefill"
    )
    assert set(OUTCOMES) == {o.value for o in Outcome}
    assert {Outcome.PULL, Outcome.REPREFILL} == MOVED
