"""P/D ratio control (pure): the §2.1 model, the Eq. (1) target, the feedback rule.

P/D-Serve (arXiv:2408.08147) §2.1 gives the model, per group of ``n_p`` prefill and ``n_d``
decode instances:

- ``T_p = TTFT_bs · r_pre`` (the TTFT at the prefill's batch size, ``r_pre`` the benefit of
  prefix-aware KV caches: 1 without a prefix cache, as the engine stub has);
- ``T_d = ξ + TPOT_bs · G`` (``ξ`` the KV transfer, ``G`` the mean tokens generated);
- ``E2E = T_p + T_d``;
- ``Φ = min{I_t, n_p·b_p/T_p, n_d·b_d/T_d} / (n_p + n_d)``: the throughput per instance, the
  numerator's smallest term the bottleneck (:class:`Capacity`, ``C_p`` and ``C_d``).

Two policies choose the split (§3.3, "Ratio Adjustment for Changes"):

- **Model** (:func:`model_target`): Eq. (1), ``n_p·b_p/T_p ≈ n_d·b_d/T_d``, from figures
  observed on the engines (never from the engine stub's timing model): the integer split of the
  total with both roles' capacities closest to balance, i.e. the largest ``min(C_p, C_d)``,
  within the bounds and on the ladder; kept unless the target's capacity is ``margin`` better
  (hysteresis), so figures that wobble around a rounding boundary do not move an instance back
  and forth.
- **Feedback** (:class:`Feedback`): "with the increase on both E2E latency and the proportion of
  TTFT, more prefill instances are needed; ... with the increase on E2E latency but decrease on
  the proportion of TTFT, more decoding instances are needed", and §4.2's "gradually increase the
  instances" — after a move, another in the same direction while it pays (a lower E2E, or, for
  a saturated group, more requests served per second: :func:`compare`), one move back if it
  made things worse, then settled. The paper gives no thresholds, window, step or cooldown:
  those are ours (``[design]``), as is treating prefill refusals as an alarm (with on-demand
  forwarding a prefill that is too weak refuses rather than queues, so the wait is at the
  gateway and the engines' TTFT does not rise: NVIDIA Dynamo's planner misses exactly this
  burst) — for prefill, or for decode when the refusing prefills' slots are mostly held by KV
  that no decode has taken yet (§3.5's back-pressure); such slots are a decode alarm even
  without refusals (§4.2: "some KVCaches wait in prefill for idle decoding"), and slots full of
  prompts a prefill alarm — and judging E2E only against its own baseline, never an SLO (an SLO
  that cannot be met must not freeze the ratio or block a scale-down, Dynamo's third bug). A
  role whose move did not pay is *refuted*: the saturation alarms (refusals, slots) no longer
  ask for it until the load changes (a rise of E2E, a new total, or the saturation gone).

Both give a **target** split; :func:`next_step` walks to it one instance at a time, in one of two
modes (§3.3: "If the overall number of instances is fixed ..., gradually release part of the
instances and add them to the other groups to form new P/D ratio. Otherwise, the adjustments may
involve new instances (for intermediate steps, and may release redundant ones after
adjustments)"): ``FixedTotal`` releases an instance of the role that has too many first, then
adds one of the other; ``Elastic`` adds first, then releases. The paper moves instances between
groups of a scenario; moving them inside one group is our ``[design]``.

Every decision carries its reason and the numbers behind it (:class:`Decision`). No clock here:
callers pass the time.

The package, in the order a window is handled:

- :mod:`.model` — the vocabulary (the roles, :class:`Bounds`, :class:`Decision`; a split is the
  API's :class:`~matrixserve.api.status.Split`, as the status stores it), §2.1's figures and
  capacities, and the Model policy's Eq. (1) target;
- :mod:`.observe` — a window's load counters turned into each policy's inputs;
- :mod:`.feedback` — the Feedback policy's rule and what it remembers;
- :mod:`.history` — what the group measured under the current load, for the walk's guards;
- :mod:`.policy` — each policy's decision on a window (:class:`Window`), given what the group
  remembers of its moves (:class:`RatioMemory`);
- :mod:`.walk` — from the serving split to the target, one change and one instance at a time.

The group's plan runs it as its ``ratio`` stage (:mod:`matrixserve.domain.pdgroup.split`).
"""

from matrixserve.api.status import Split
from matrixserve.domain.ratio.feedback import (
    SIGNIFICANT,
    Feedback,
    FeedbackParams,
    FeedbackState,
    Tally,
    compare,
    moved,
)
from matrixserve.domain.ratio.history import (
    CHANGE_SIGMAS,
    CHANGE_WINDOWS,
    MIX_CHANGE,
    RATE_CHANGE,
    History,
    Measured,
    Mix,
    mix_of,
)
from matrixserve.domain.ratio.model import (
    BATCH_SPREAD,
    DECODE,
    PREFILL,
    TRAFFIC,
    BatchPoint,
    Bounds,
    Capacity,
    Decision,
    DecodeLine,
    Figures,
    Transition,
    capacity,
    decode_line,
    fallback_split,
    model_target,
    rounded,
)
from matrixserve.domain.ratio.observe import (
    Signal,
    batch_point,
    figures_of,
    load_delta,
    load_sum,
    signal_of,
)
from matrixserve.domain.ratio.policy import (
    LEAST_REQUESTS,
    RETURN_COOLDOWNS,
    RETURN_MARGINS,
    RatioMemory,
    Window,
    decide,
    feedback_params,
    held,
)
from matrixserve.domain.ratio.walk import (
    next_step,
    parse_ladder,
    toward,
)

__all__ = [
    "BATCH_SPREAD",
    "CHANGE_SIGMAS",
    "CHANGE_WINDOWS",
    "DECODE",
    "LEAST_REQUESTS",
    "MIX_CHANGE",
    "PREFILL",
    "RATE_CHANGE",
    "RETURN_COOLDOWNS",
    "RETURN_MARGINS",
    "SIGNIFICANT",
    "TRAFFIC",
    "BatchPoint",
    "Bounds",
    "Capacity",
    "Decision",
    "DecodeLine",
    "Feedback",
    "FeedbackParams",
    "FeedbackState",
    "Figures",
    "History",
    "Measured",
    "Mix",
    "RatioMemory",
    "Signal",
    "Split",
    "Tally",
    "Transition",
    "Window",
    "batch_point",
    "capacity",
    "compare",
    "decide",
    "decode_line",
    "fallback_split",
    "feedback_params",
    "figures_of",
    "held",
    "load_delta",
    "load_sum",
    "mix_of",
    "model_target",
    "moved",
    "next_step",
    "parse_ladder",
    "rounded",
    "signal_of",
    "toward",
]
