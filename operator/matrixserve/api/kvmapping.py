"""Which prefill die each decode die pulls a request's KV cache from: the sub-links of a P-D pair.

Two rules, one function (:func:`source_dies`):

- **Same size** (as many dies on both sides): device k <-> device k (P/D-Serve §2.1, §3.7), as
  the groups have always linked, whatever each side's TP. It is also what CloudMatrix-Infer's
  mapping gives when the prefill is one TP group (ratio = dies / decode tp = decode dp, so every
  group holds one decode DP rank and ``prefill rank = dp rank x decode tp + tp rank = k``).
- **Different sizes**: CloudMatrix-Infer §4.3.3's deterministic group connection mapping (notes
  001 §2.6), for a decode rank of DP rank ``dp`` and TP rank ``tp`` (its die index
  ``j = dp x decode_tp + tp``, the order of the decode's RoCE IPs)::

      ratio      = prefill_tp / decode_tp
      group_size = decode_dp / ratio
      group_id   = dp // group_size
      source     = group_id x decode_tp + tp        (a prefill TP rank: its die index)

  so every prefill rank serves ``decode_dp x decode_tp / prefill_tp`` decode ranks, and no one
  link carries every decode rank's pull ("that single network link would become a severe
  bottleneck"). With MLA every rank of a TP group holds the whole KV, so any rank can be the
  source; the mapping only spreads the pulls.

Preconditions of the different-size rule (:func:`broken`; the paper states none: notes 001 §2.6
derives the first two): ``prefill_tp % decode_tp == 0`` (else ratio is no integer, or below 1
and the ranks fall outside the prefill), ``decode_dp % ratio == 0`` (else the groups are
uneven and some prefill ranks get no pull), and the prefill is one TP group
(``prefill_tp == prefill dies``): the mapping names prefill TP ranks only, so the dies of any
further prefill DP group would hold KV with no sub-link to move it (§4.3.1's prefill spreads
attention heads over all of its dies, one TP group).

Sub-links per P-D pair: one per decode die in both cases (same size: K = both sides' dies). The
operator counts the expected links by it (``RoceMap.expected_links``, the group's status) and
the engines link and probe by it (``zk_layout.verify_sub_links``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Side:
    """One instance as the mapping sees it: its dies (RoCE IPs, in rank order) and its TP."""

    dies: int
    tp: int

    def __post_init__(self) -> None:
        if self.dies < 1 or self.tp < 1:
            raise ValueError(f"dies {self.dies} and tp {self.tp} must be at least 1")
        if self.dies % self.tp:
            raise ValueError(f"tp {self.tp} does not divide the instance's {self.dies} dies")

    @classmethod
    def of(cls, dies: int, tp: int | None) -> Side:
        """``tp`` not given: the instance's dies (the engine's default, ``--tp``)."""
        return cls(dies, tp or dies)

    @property
    def dp(self) -> int:
        return self.dies // self.tp


class Precondition(StrEnum):
    """What the different-size rule needs (see the module's docstring)."""

    PREFILL_ONE_TP_GROUP = "prefill_tp == prefill dies"
    TP_DIVIDES = "prefill_tp % decode_tp == 0"
    DP_DIVIDES = "decode_dp % ratio == 0"


def same_size(prefill: Side, decode: Side) -> bool:
    return prefill.dies == decode.dies


def broken(prefill: Side, decode: Side) -> list[Precondition]:
    """The preconditions ``prefill`` and ``decode`` break; empty when they pair (always for the
    same size). ``decode_dp % ratio`` is judged only where ratio is an integer."""
    if same_size(prefill, decode):
        return []
    found = []
    if prefill.tp != prefill.dies:
        found.append(Precondition.PREFILL_ONE_TP_GROUP)
    if prefill.tp % decode.tp:
        found.append(Precondition.TP_DIVIDES)
    elif decode.dp % (prefill.tp // decode.tp):
        found.append(Precondition.DP_DIVIDES)
    return found


def source_dies(prefill: Side, decode: Side) -> list[int]:
    """For each decode die ``j`` (rank order), the prefill die it pulls KV from: its sub-link.
    Raises ValueError naming the preconditions broken."""
    problems = broken(prefill, decode)
    if problems:
        raise ValueError(
            f"a prefill of {prefill.dies} dies (tp {prefill.tp}) and a decode of {decode.dies} "
            f"dies (tp {decode.tp}, dp {decode.dp}) do not pair: CloudMatrix-Infer §4.3.3's "
            f"mapping needs {', '.join(problems)}"
        )
    if same_size(prefill, decode):
        return list(range(decode.dies))
    ratio = prefill.tp // decode.tp
    group_size = decode.dp // ratio
    return [
        (dp // group_size) * decode.tp + tp for dp in range(decode.dp) for tp in range(decode.tp)
    ]


def sub_links_per_pair(prefill: Side, decode: Side) -> int:
    """Sub-links of one P-D pair: one per decode die (either rule). Raises as
    :func:`source_dies` does."""
    return len(source_dies(prefill, decode))


def connections(prefill: Side, decode: Side) -> list[int]:
    """How many decode dies pull from each prefill die (index = prefill die)."""
    counts = Counter(source_dies(prefill, decode))
    return [counts[i] for i in range(prefill.dies)]
