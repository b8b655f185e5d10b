"""A P/D group under a saturating closed load, as the engine stub would serve it (issue 29): the
plant the ratio policies are driven against in the unit tests, without engine processes.

The costs are the stub's own timing model (:mod:`enginestub.timing`: the prefill's compute, the
decode step's roofline at the batch it runs and the requests' mean context, the KV over RoCE);
the queueing is a fluid bottleneck model of what the bench's closed load does: enough clients
that the weaker role runs at ``UTILISATION`` — a prefill-short group has its prefills' slots full
of prompts and its decodes underloaded (a smaller batch, a lower TPOT), a decode-short group its
decodes at their full batch and the prefills' slots holding KV until a decode takes it. What the
engines would report over a window (``zl.Load``, summed per role and shared among its
instances) carries Poisson noise on the counts and a jitter on the times, from a seed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from enginestub import fabric, timing
from fakes import serving_group
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import LLAMA3_8B, ModelShape
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.status import RatioStatus
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.pdgroup import GroupView
from matrixserve.domain.pdgroup.actions import ReportRatioChange
from matrixserve.domain.pdgroup.split import ratio_pass
from matrixserve.domain.ratio import Split

UTILISATION = 0.97  # the bottleneck role's busy share under the closed load


@dataclass(frozen=True)
class Served:
    """A split's steady state: requests per emulated second, and what each role sees."""

    rate: float
    ttft: float  # the prefills' mean TTFT (engine-side)
    kv_wait: float  # a prompt's KV waiting in its slot for a decode, beyond ξ
    batch: float  # the decodes' mean batch
    tpot: float  # ... and their TPOT at it
    busy: float  # a prefill's busy share


@dataclass
class Plant:
    prompt: int  # tokens per prompt
    output: int  # tokens generated per request
    decode_batch: int
    prefill_slots: int = 8
    devices: int = 2  # NPUs per instance (2 dies each)
    model: ModelShape = LLAMA3_8B
    noise: float = 0.02
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        dies = 2 * self.devices
        self.shape = timing.InstanceShape(dies=dies, tp=dies)
        self.prefill_s = timing.prefill_seconds(self.model, self.shape, self.prompt)
        kv = timing.kv_bytes(self.model, self.prompt)
        roce = fabric.Plane.ROCE
        self.xi = kv / dies / fabric.link_bandwidth(roce, False) + fabric.link_latency(roce, False)
        self.context = self.prompt + self.output // 2

    def tpot(self, batch: float) -> float:
        return timing.tpot(self.model, self.shape, batch / self.shape.npus, self.context)

    def decode_time(self, batch: float) -> float:
        return self.xi + self.output * self.tpot(batch)

    def capacities(self, split: Split) -> tuple[float, float]:
        """Requests per second the prefills and the decodes can serve."""
        b = self.decode_batch
        return split.prefill / self.prefill_s, split.decode * b / self.decode_time(b)

    def serve(self, split: Split) -> Served:
        c_p, c_d = self.capacities(split)
        rate = UTILISATION * min(c_p, c_d)
        per_decode = rate / split.decode
        # the batch a decode runs for that rate (b = rate · T_d(b), Little's law), by bisection
        lo, hi = 0.0, float(self.decode_batch)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mid < per_decode * self.decode_time(mid) else (lo, mid)
        batch = max(hi, 1.0)
        busy = rate * self.prefill_s / split.prefill
        per_prefill = rate / split.prefill
        slot_time = self.prefill_slots / per_prefill  # the slots are full (Little's law)
        if c_p <= c_d:
            # prefill-short: the slots full of prompts sharing the compute
            ttft, wait = slot_time - self.xi, 0.0
        else:
            # decode-short: prompts prefill fast and their KV waits in the slots
            ttft = self.prefill_s / max(1.0 - busy, 0.05)
            wait = max(slot_time - ttft - self.xi, 0.0)
        return Served(rate, ttft, wait, batch, self.tpot(batch), busy)

    def best(self, splits: list[Split]) -> Split:
        return max(splits, key=lambda s: self.serve(s).rate)

    def phi(self, split: Split) -> float:
        return self.serve(split).rate / split.total

    # ------------------------------------------------------------------ the engines' counters
    def _count(self, mean: float) -> int:
        return max(0, round(self.rng.gauss(mean, math.sqrt(mean)))) if mean > 0 else 0

    def _jitter(self) -> float:
        return 1.0 + self.rng.uniform(-self.noise, self.noise)

    def window(self, split: Split, seconds: float) -> tuple[zl.Load, zl.Load]:
        """What the prefills and the decodes (each role summed) serve over ``seconds``."""
        s = self.serve(split)
        n = self._count(s.rate * seconds)
        ttft, tpot = s.ttft * self._jitter(), s.tpot * self._jitter()
        steps = split.decode * seconds / tpot
        prefill = zl.Load(
            offered=n,
            prefilled=n,
            ttftSeconds=n * ttft,
            promptTokens=n * self.prompt,
            busySeconds=n * self.prefill_s * self._jitter(),
            slotSeconds=n * (ttft + s.kv_wait + self.xi),
            kvWaitSeconds=n * (s.kv_wait + self.xi),
        )
        decode = zl.Load(
            decoded=n,
            outputTokens=n * self.output,
            tokens=n * self.output,
            tpotSeconds=n * self.output * tpot,
            kvPulls=n,
            kvSeconds=n * self.xi,
            decodeSeconds=n * (self.xi + self.output * tpot),
            iterations=round(steps),
            batchSum=steps * s.batch,
        )
        return prefill, decode


# ------------------------------------------------------------------------ the group's plan
Windows = Callable[[Split, float], tuple[zl.Load, zl.Load]]
ENGINE = EngineSettings(zookeeper="127.0.0.1:2181")  # time scale 1: wall seconds are emulated
READY = {"conditions": [{"type": "Ready", "status": "True"}]}


def _share(load: zl.Load, n: int) -> zl.Load:
    """One of ``n`` instances' part of a role's sum."""
    raw = load.model_dump()
    return zl.Load.model_validate(
        {k: (round(v / n) if isinstance(v, int) else v / n) for k, v in raw.items()}
    )


@dataclass
class Driven:
    """A PDGroup's ratio pass (:func:`ratio_pass`) driven pass after pass: the serving split
    follows the pass's counts at once (each new instance a new process, its counters from 0)."""

    spec: PDGroupSpec
    serving: Split
    windows: Windows
    now: float = 1_000_000.0
    status: RatioStatus | None = None
    counters: dict[str, zl.Load] = field(default_factory=dict)
    incarnations: dict[str, int] = field(default_factory=dict)
    changes: list[tuple[float, Split]] = field(default_factory=list)  # (time, new target)
    notices: list[ReportRatioChange] = field(default_factory=list)
    born: int = 0

    def members(self) -> dict[str, zl.Role]:
        p, d = self.serving.prefill, self.serving.decode
        return {f"g-p-{i}": zl.Role.PREFILL for i in range(p)} | {
            f"g-d-{i}": zl.Role.DECODE for i in range(d)
        }

    def _sync(self) -> dict[str, zl.Role]:
        """The members now: a new one a new process (counters from 0), a gone one forgotten."""
        members = self.members()
        for name in members:
            if name not in self.counters:
                self.born += 1
                self.counters[name], self.incarnations[name] = zl.Load(), self.born
        for name in set(self.counters) - set(members):
            del self.counters[name]
        return members

    def view(self) -> GroupView:
        members = self._sync()
        view: GroupView = serving_group(
            self.spec,
            members,
            self.counters,
            {n: f"i{self.incarnations[n]}" for n in members},
            now=self.now,
            previous={**READY, "ratio": self.status} if self.status else READY,
            engine=ENGINE,
        )
        return view

    def step(self, seconds: float) -> None:
        """``seconds`` of serving, then one pass."""
        prefill, decode = self.windows(self.serving, seconds)
        members = self._sync()
        for role, total in ((zl.Role.PREFILL, prefill), (zl.Role.DECODE, decode)):
            names = [n for n, r in members.items() if r is role]
            part = _share(total, len(names))
            for n in names:
                old = self.counters[n]
                self.counters[n] = zl.Load.model_validate(
                    {k: getattr(old, k) + getattr(part, k) for k in zl.Load.model_fields}
                )
        self.now += seconds
        out = ratio_pass(self.view())
        target = Split.parse(out.status["target"])
        if self.status and self.status.get("target") != out.status["target"]:
            self.changes.append((self.now, target))
        self.status = out.status
        self.notices += [n for n in out.notices if isinstance(n, ReportRatioChange)]
        self.serving = Split(out.counts.prefill, out.counts.decode)

    def run(self, seconds: float, every: float = 4.0) -> None:
        for _ in range(round(seconds / every)):
            self.step(every)

    def moves(self, start: Split) -> list[Split]:
        """The targets in turn, from ``start``."""
        return [start, *(t for _, t in self.changes)]


def reversals(moves: list[Split]) -> int:
    """Moves against the one before (A -> B -> A counts one)."""
    directions = [b.prefill > a.prefill for a, b in itertools.pairwise(moves)]
    return sum(1 for a, b in itertools.pairwise(directions) if a != b)


def flaps(moves: list[Split]) -> bool:
    """A -> B -> A -> B anywhere."""
    return any(
        moves[i] == moves[i + 2] and moves[i + 1] == moves[i + 3] for i in range(len(moves) - 3)
    )
