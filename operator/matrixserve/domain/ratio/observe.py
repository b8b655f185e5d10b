"""A window's observation (pure): what the engines' cumulative load counters (``zl.Load``)
served between two health reports, summed per role, turned into the inputs of each policy —
§2.1's :class:`~matrixserve.domain.ratio.model.Figures` for Model, a :class:`Signal` for
Feedback. Differences of one process's counters only: a counter that went back is another
process's, and the window says nothing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from matrixserve.api import zk_layout as zl
from matrixserve.domain.ratio.model import BatchPoint, Figures, decode_line


@dataclass(frozen=True)
class Signal:
    """One window's feedback inputs, as the engines saw them (a wait at the gateway is not in
    them): E2E and T_p, the fraction of prefill offers refused, and the rest below."""

    e2e: float
    t_p: float
    rejected: float = 0.0  # refused offers / all offers to the prefills, 0..1
    # of the prefills' slot time, the share spent holding a finished prompt's KV until a decode
    # took it (P/D-Serve §3.5: "a prompt continuously occupies one slot in prefill if it is
    # waiting for KVCache transfer to a decoding"): refusals with most slots waiting are the
    # decodes' back-pressure, not the prefills' weakness
    kv_wait: float = 0.0
    # the share of the prefills' slot capacity held over the window: a gateway that counts the
    # slots it holds offers nothing to a full prefill, so a prefill short of slots shows here,
    # not in refusals (the requests wait at the gateway)
    slots_held: float = 0.0
    # requests finished over the window's ``seconds`` (0 seconds: not known)
    finished: int = 0
    seconds: float = 0.0

    @property
    def served(self) -> float:
        """Requests finished per second (0: not known)."""
        return self.finished / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefill_share(self) -> float:
        """T_p / E2E, the "proportion of TTFT"."""
        return self.t_p / self.e2e if self.e2e > 0 else 0.0


# ------------------------------------------------------------------------ the observation
# The engines' health reports carry what each has served since its process started
# (zk_layout.Load); a window is the difference of two reports of one process, summed over a
# role's instances. Emulated seconds throughout.
def load_delta(old: zl.Load, new: zl.Load) -> zl.Load | None:
    """What was served between two reports; None if a counter went back (another process)."""
    diff = {}
    for f in zl.Load.model_fields:
        a, b = getattr(old, f), getattr(new, f)
        if b < a:
            return None
        diff[f] = b - a
    return zl.Load.model_validate(diff)


def load_sum(loads: Iterable[zl.Load]) -> zl.Load:
    total: dict[str, float] = dict.fromkeys(zl.Load.model_fields, 0)
    for load in loads:
        for f in total:
            total[f] += getattr(load, f)
    return zl.Load.model_validate(total)


def figures_of(
    prefill: zl.Load,
    decode: zl.Load,
    decode_batch: int,
    least: int = 1,
    kv_share: float | None = None,
    others: Iterable[BatchPoint] = (),
) -> Figures | None:
    """§2.1's inputs from a window's sums, or None with fewer than ``least`` requests through
    either role. ``TTFT_bs`` is the prefills' mean TTFT; their capacity is what they served per
    busy second (prompts share a prefill's compute, so that is its throughput at any batch) and
    ``b_p`` the batch that gives it at that TTFT; ``ξ`` and ``G`` the decodes' means and ``b_d``
    their configured batch. ``TPOT_bs`` is the TPOT at ``b_d``, predicted from the TPOT measured
    at the batch the decodes ran (:func:`decode_line`; ``others``: what other splits of the same
    load measured; ``kv_share``: the model's KV bytes per token over its weight bytes, for the
    roofline's shape): an underloaded decode's TPOT is below its full batch's, and taken as it
    is, it makes the decodes' capacity read high at a split that leaves them half idle — and
    right at one that fills them."""
    if prefill.prefilled < least or decode.decoded < least or decode.tokens < 1:
        return None
    if prefill.busy_s <= 0 or prefill.ttft_s <= 0 or decode.tpot_s <= 0:
        return None
    ttft = prefill.ttft_s / prefill.prefilled
    c_p = prefill.prefilled / prefill.busy_s
    g = max(decode.output_tokens / decode.decoded, 1.0)
    tpot = decode.tpot_s / decode.tokens
    line = None
    batch = decode.batch_sum / decode.iterations if decode.iterations else 0.0
    if batch > 0:
        # a decode's request holds its prompt's KV and, on average, half its answer's
        context = prefill.prompt_tokens / prefill.prefilled + g / 2
        shape = 1.0 / (kv_share * context) if kv_share and context > 0 else None
        line = decode_line(BatchPoint(batch, tpot), others, float(decode_batch), shape)
    return Figures(
        ttft_bs=ttft,
        b_p=c_p * ttft,
        tpot_bs=line.tpot(decode_batch) if line is not None else tpot,
        b_d=float(decode_batch),
        xi=decode.kv_s / decode.kv_pulls if decode.kv_pulls else 0.0,
        g=g,
        line=line,
        batch_seen=batch,
    )


def signal_of(
    prefill: zl.Load,
    decode: zl.Load,
    least: int = 1,
    slot_capacity_s: float = 0.0,
    window_s: float = 0.0,
) -> Signal | None:
    """The feedback rule's inputs from a window's sums, or None with too few requests: T_p the
    prefills' mean TTFT; E2E that plus the mean wait of a prefilled prompt's KV for a decode
    plus the decodes' mean time per request (KV pull to the last token); the refused share of
    the offers, the slots' share waiting for a decode, the share of the prefills' slot capacity
    held (``slot_capacity_s``: the window's emulated seconds times the prefills' slots; 0: not
    known), and the requests the decodes finished over the window's emulated seconds
    (``window_s``; 0: not known)."""
    if prefill.prefilled < least or decode.decoded < least:
        return None
    t_p = prefill.ttft_s / prefill.prefilled
    # a slot is given back once the decode has pulled the KV, and the decode's time starts
    # before its pull: the pull (ξ) is in both, counted once
    xi = decode.kv_s / decode.kv_pulls if decode.kv_pulls else 0.0
    wait = max(prefill.kv_wait_s / prefill.prefilled - xi, 0.0)
    return Signal(
        e2e=t_p + wait + decode.decode_s / decode.decoded,
        t_p=t_p,
        rejected=prefill.refused / prefill.offered if prefill.offered else 0.0,
        kv_wait=prefill.kv_wait_s / prefill.slot_s if prefill.slot_s > 0 else 0.0,
        slots_held=min(prefill.slot_s / slot_capacity_s, 1.0) if slot_capacity_s > 0 else 0.0,
        finished=decode.decoded if window_s > 0 else 0,
        seconds=max(window_s, 0.0),
    )


def batch_point(decode: zl.Load) -> BatchPoint | None:
    """The decodes' mean batch and TPOT over a window (None: an engine that does not count)."""
    if not decode.iterations or not decode.tokens:
        return None
    return BatchPoint(decode.batch_sum / decode.iterations, decode.tpot_s / decode.tokens)
