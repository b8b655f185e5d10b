"""The allocation-rate simulation of ``make bench-placement`` (001 §6.1.2, Fig. 24), shared with
its unit test: a seeded stream of P/D groups created and deleted on a cluster of SuperPods, placed
by a placement function with the signature of :func:`matrixserve.domain.placement.place`.

**What the paper measures.** 001 §6.1.2 models "each AI task as a set of tightly-coupled blocks,
where each block is a contiguous group of NPUs that must be provisioned within a single
supernode", draws the requests from production traces and reports the *NPU allocation rate*:
the share of the supernodes' NPUs allocated. It does not publish the traces, the distribution
beyond its mean, the queue or the placement; only that a larger supernode fragments less. We
measure the same quantity under saturation, so that a free NPU means fragmentation and never
idleness: **the time average of allocated NPUs / all NPUs while a backlog waits**.

**The stream.** Group after group, seeded. A group is one decode instance and 1-3 prefill
instances (uniform; the prefills of a group are of one size, as one RoleSpec makes them), each
size drawn from the block-size distribution, and a lifetime (exponential, mean 1, independent of
its size: the time unit). **Block sizes**: 1-48 NPUs (up to six whole servers), with
P(n) ∝ q^(n-1), q solved for the paper's mean of 10.08: the maximum-entropy distribution on
1..48 with that mean (the paper gives only the mean, so we assume nothing else). Every size
occurs, so non-divisors of 384 and 224 (5, 9, 10, 11, 13, ...) are common. An instance of more
than 8 NPUs spans ceil(n/8) pods, one per server: by default **server-aligned**, whole servers
and the remainder on one more (10 -> 8 + 2: the block as the paper counts it, a number of NPUs,
on the fewest servers and the fewest partly used ones); ``Cluster.aligned=False`` splits it into
near-equal pods instead (10 -> 5 + 5), the shape a PDGroup instance has today
(``devicesPerInstance / podsPerInstance`` per pod), which leaves a hole on every server it
touches (:func:`one_pod_per_server_bound`).

**The load.** Demand is kept at capacity: whenever the NPUs allocated and waiting fall below
the cluster's, the next groups are created. The NPUs waiting are then at least the NPUs free,
so a free NPU means fragmentation, never idleness (arrival times play no part). After every deletion each waiting instance is tried in creation order (a group's decode,
then its prefills, each prefill preferring its decode's SuperPod), as the operator does: one
that does not fit waits, holding nothing, and the next is tried. ``in_order`` is the strict
alternative, first come first served (the head blocks the rest), which keeps the mix placed the
mix offered; passing lets the small instances past the large, so the mix placed drifts a little
smaller than the offered one (``Outcome.mean_placed_npus`` says by how much). A group's lifetime
starts when its last instance is placed; its instances hold their NPUs from their own
placement until the group is deleted.

**Baselines** (same signature, same stream): :func:`first_fit` (the first SuperPod, then the
first servers, by name, that hold the instance) and :func:`spread` (the Kubernetes scheduler's
default score, ``NodeResourcesFit`` ``LeastAllocated``: each pod to the server with the most
free NPUs, in the SuperPod with the most free NPUs that holds the instance, since the pods
are pinned to one SuperPod). Both keep the hard ``superpod`` and ignore ``prefer_superpod``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from matrixserve.api import catalog
from matrixserve.domain.placement import Placement, Request, Server, Unplaceable

PlaceFn = Callable[[Sequence[Request], Sequence[Server]], tuple[list[Placement], list[Unplaceable]]]

PAPER_MEAN_BLOCK = 10.08  # 001 §6.1.2: "at an average block size of 10.08"
MAX_BLOCK = 48  # NPUs: six whole servers
MAX_PREFILLS = 3  # per group


# --------------------------------------------------------------------------- the stream
def block_weights(mean: float = PAPER_MEAN_BLOCK, hi: int = MAX_BLOCK) -> list[float]:
    """P(n) for n = 1..hi, ∝ q^(n-1), q such that the mean is ``mean`` (bisection)."""
    if not 1 < mean < (hi + 1) / 2:
        raise ValueError(f"a mean block of {mean} is not below the uniform mean of 1..{hi}")

    def weights(q: float) -> list[float]:
        w = [q ** (n - 1) for n in range(1, hi + 1)]
        total = sum(w)
        return [x / total for x in w]

    def mean_of(q: float) -> float:
        return sum(n * p for n, p in enumerate(weights(q), start=1))

    lo, up = 1e-9, 1.0
    for _ in range(100):
        mid = (lo + up) / 2
        lo, up = (mid, up) if mean_of(mid) < mean else (lo, mid)
    return weights((lo + up) / 2)


def pods_of(
    npus: int, per_server: int = catalog.NPUS_PER_SERVER, aligned: bool = False
) -> tuple[int, ...]:
    """An instance's pods, ceil(npus/per_server) of them, larger first: near-equal NPUs, or
    (``aligned``) whole servers and the remainder."""
    if npus < 1:
        raise ValueError(f"an instance of {npus} NPUs")
    k = math.ceil(npus / per_server)
    if aligned:
        return tuple(min(per_server, npus - i * per_server) for i in range(k))
    return tuple(npus // k + (1 if i < npus % k else 0) for i in range(k))


def one_pod_per_server_bound(
    weights: Sequence[float], per_server: int = catalog.NPUS_PER_SERVER
) -> float:
    """An upper bound on the allocation of any placement of instances one pod per server, when
    the mix placed is the mix offered (``weights``: P(n) for n = 1, 2, ...).

    A pod of more than half a server shares it with no pod as large, so it leaves
    ``per_server - pod`` NPUs that only pods of under half a server can use; at best every such
    small pod goes into one of those holes. What remains of the holes is idle whatever the
    policy: allocation <= mean / (mean + holes - small), all per instance offered."""
    half = per_server // 2
    mean = holes = small = 0.0
    for n, p in enumerate(weights, start=1):
        mean += p * n
        for pod in pods_of(n, per_server):
            if pod > half:
                holes += p * (per_server - pod)
            elif pod < per_server - half:
                small += p * pod
    return mean / (mean + max(0.0, holes - small))


@dataclass(frozen=True)
class Group:
    name: str
    decode: int  # NPUs
    prefills: tuple[int, ...]  # NPUs of each prefill instance
    lifetime: float

    def instances(self) -> list[tuple[str, int, bool]]:
        """(name, NPUs, is the decode), the decode first."""
        return [(f"{self.name}-d", self.decode, True)] + [
            (f"{self.name}-p{i}", n, False) for i, n in enumerate(self.prefills)
        ]


def stream(seed: int, mean: float = PAPER_MEAN_BLOCK) -> Iterator[Group]:
    """The endless seeded stream of groups (the same seed, the same groups)."""
    rng = random.Random(seed)
    sizes = list(range(1, MAX_BLOCK + 1))
    weights = block_weights(mean)
    i = 0
    while True:
        decode, prefill = rng.choices(sizes, weights, k=2)
        count = rng.randint(1, MAX_PREFILLS)
        yield Group(f"g{i}", decode, (prefill,) * count, rng.expovariate(1.0))
        i += 1


# --------------------------------------------------------------------------- the baselines
def _place_by(
    requests: Sequence[Request],
    servers: Sequence[Server],
    superpod_key: Callable[[str, int], tuple[int, str]],
    server_key: Callable[[Server, int], tuple[int, str]],
) -> tuple[list[Placement], list[Unplaceable]]:
    """Place in order: SuperPods tried by ``superpod_key(name, free)``, the pods (largest first)
    each on the first free-enough server by ``server_key(server, free)``."""
    free = {s.name: s.free_npus for s in servers}
    by_sp: dict[str, list[Server]] = {}
    for s in servers:
        if s.superpod is not None:
            by_sp.setdefault(s.superpod, []).append(s)
    placed: list[Placement] = []
    refused: list[Unplaceable] = []
    for r in requests:
        pods = sorted(range(len(r.pods)), key=lambda i: (-r.pods[i], i))
        order = [r.superpod] if r.superpod is not None else list(by_sp)
        order.sort(key=lambda sp: superpod_key(sp, sum(free[s.name] for s in by_sp.get(sp, []))))
        for sp in order:
            left = sorted(by_sp.get(sp, []), key=lambda s: server_key(s, free[s.name]))
            got: dict[int, str] = {}
            for rank in pods:
                pick = next((s for s in left if free[s.name] >= r.pods[rank]), None)
                if pick is None:
                    break
                got[rank] = pick.name
                left.remove(pick)
            if len(got) == len(pods):
                names = tuple(got[i] for i in range(len(pods)))
                for name, npus in zip(names, r.pods, strict=True):
                    free[name] -= npus
                placed.append(Placement(r.name, sp, names))
                break
        else:
            refused.append(Unplaceable(r.name, "fits no SuperPod"))
    return placed, refused


def first_fit(
    requests: Sequence[Request], servers: Sequence[Server]
) -> tuple[list[Placement], list[Unplaceable]]:
    """The first SuperPod, then the first servers, by name, that hold the instance."""
    return _place_by(requests, servers, lambda sp, _: (0, sp), lambda s, _: (0, s.name))


def spread(
    requests: Sequence[Request], servers: Sequence[Server]
) -> tuple[list[Placement], list[Unplaceable]]:
    """LeastAllocated: the most free NPUs first, SuperPod and server (ties by name)."""
    return _place_by(requests, servers, lambda sp, f: (-f, sp), lambda s, f: (-f, s.name))


# --------------------------------------------------------------------------- the simulation
@dataclass(frozen=True)
class Cluster:
    superpods: int
    servers_per_superpod: int
    npus_per_server: int = catalog.NPUS_PER_SERVER
    aligned: bool = True  # an instance's pods: whole servers and the remainder (else equal)

    @property
    def npus(self) -> int:
        return self.superpods * self.servers_per_superpod * self.npus_per_server

    def servers(self) -> dict[str, tuple[str, int]]:
        """Server name -> (its SuperPod, its NPUs)."""
        return {
            f"sp{p:02d}-s{s:02d}": (f"sp{p:02d}", self.npus_per_server)
            for p in range(self.superpods)
            for s in range(self.servers_per_superpod)
        }


@dataclass
class Outcome:
    allocation: float  # time-average allocated NPUs / all NPUs over the measured window
    instances_placed: int  # in the window
    mean_placed_npus: float  # the mean size of the instances placed in the window
    pairs: int  # P↔D pairs placed (a prefill and its group's decode)
    pairs_same_superpod: int
    overcommits: int  # times a server was given more NPUs than it had free (must stay 0)
    split_instances: int  # instances placed across SuperPods or twice on a server (must stay 0)
    offered: list[int] = field(default_factory=list)  # sizes of the instances the stream offered


def simulate(
    place_fn: PlaceFn,
    cluster: Cluster,
    seed: int,
    warmup: float,
    horizon: float,
    in_order: bool = False,
) -> Outcome:
    """Run the stream of ``seed`` through ``place_fn`` on ``cluster`` until ``horizon`` (in
    mean lifetimes); the allocation is averaged over [warmup, horizon].

    Demand is kept at capacity: whenever the NPUs allocated and waiting fall below the
    cluster's, the next groups of the stream are created. After every deletion each waiting
    instance is tried in creation order (``place_fn`` on one request at a time, so a prefill
    sees where its decode went in the same pass); ``in_order``: the first that does not fit
    stops the pass (first come, first served, nothing passes it)."""
    return _Run(place_fn, cluster, seed, warmup, in_order).until(horizon)


class _Run:
    """One simulation's state: the free NPUs, the backlog, the groups placed and their ends."""

    def __init__(
        self, place_fn: PlaceFn, cluster: Cluster, seed: int, warmup: float, in_order: bool
    ):
        self.place_fn, self.cluster, self.warmup, self.in_order = (
            place_fn,
            cluster,
            warmup,
            in_order,
        )
        self.layout = cluster.servers()
        self.free = {name: npus for name, (_, npus) in self.layout.items()}
        # SuperPod -> free NPUs -> servers with that many: the harness's exact fit test
        self.histogram: dict[str, Counter[int]] = {}
        for sp, npus in self.layout.values():
            self.histogram.setdefault(sp, Counter())[npus] += 1
        self.groups = stream(seed)
        self.backlog: list[tuple[Group, str, int, bool]] = []  # waiting, creation order
        self.held: dict[str, list[tuple[str, int]]] = {}  # group -> its pods' (server, NPUs)
        self.unplaced: dict[str, int] = {}  # group -> its instances not placed yet
        self.decode_at: dict[str, str] = {}  # group -> its decode's SuperPod
        self.ends: list[tuple[float, str]] = []
        self.out = Outcome(0.0, 0, 0.0, 0, 0, 0, 0)
        self.placed_npus = self.waiting = self.allocated = 0
        self.now = self.area = 0.0

    def until(self, horizon: float) -> Outcome:
        while self.now < horizon:
            while self.allocated + self.waiting < self.cluster.npus:
                self.create(next(self.groups))
            left: list[tuple[Group, str, int, bool]] = []
            for item in self.backlog:
                if (self.in_order and left) or not self.try_place(*item):
                    left.append(item)
                else:
                    self.waiting -= item[2]
            self.backlog = left
            if not self.ends:
                raise RuntimeError(f"{left[0][1]} fits no empty SuperPod of {self.cluster}")
            end, gone = heapq.heappop(self.ends)
            end = min(end, horizon)
            self.area += self.allocated * max(0.0, end - max(self.now, self.warmup))
            self.now = end
            self.delete(gone)
        out = self.out
        out.allocation = self.area / (self.cluster.npus * (horizon - self.warmup))
        out.mean_placed_npus = self.placed_npus / max(out.instances_placed, 1)
        return out

    def create(self, g: Group) -> None:
        self.unplaced[g.name] = len(g.instances())
        for name, npus, is_decode in g.instances():
            self.backlog.append((g, name, npus, is_decode))
            self.out.offered.append(npus)
            self.waiting += npus

    def delete(self, group: str) -> None:
        for server, pod in self.held.pop(group):
            self.take(server, -pod)
            self.allocated -= pod
        del self.unplaced[group]
        self.decode_at.pop(group, None)

    def take(self, server: str, npus: int) -> None:
        hist = self.histogram[self.layout[server][0]]
        hist[self.free[server]] -= 1
        self.free[server] -= npus
        hist[self.free[server]] += 1

    def fits(self, pods: tuple[int, ...]) -> bool:
        """Whether some SuperPod holds ``pods`` one per server (the k-th largest pod needs k
        servers with as many free NPUs): exact, so a refusal skipped here is one every
        placement function would give; it only spares calling them."""
        ordered = sorted(pods, reverse=True)
        return any(
            all(sum(c for f, c in hist.items() if f >= pod) > k for k, pod in enumerate(ordered))
            for hist in self.histogram.values()
        )

    def try_place(self, g: Group, name: str, npus: int, is_decode: bool) -> bool:
        out = self.out
        pods = pods_of(npus, self.cluster.npus_per_server, self.cluster.aligned)
        if not self.fits(pods):
            return False
        prefer = None if is_decode else self.decode_at.get(g.name)
        snapshot = [Server(n, sp, self.free[n]) for n, (sp, _) in self.layout.items()]
        placed, _ = self.place_fn([Request(name, pods, prefer_superpod=prefer)], snapshot)
        if not placed:
            return False
        p = placed[0]
        if len(set(p.servers)) != len(p.servers) or {self.layout[s][0] for s in p.servers} != {
            p.superpod
        }:
            out.split_instances += 1
        for server, pod in zip(p.servers, pods, strict=True):
            out.overcommits += self.free[server] < pod
            self.take(server, pod)
            self.held.setdefault(g.name, []).append((server, pod))
        self.allocated += npus
        if self.now >= self.warmup:
            out.instances_placed += 1
            self.placed_npus += npus
        if is_decode:
            self.decode_at[g.name] = p.superpod
        else:
            out.pairs += 1
            out.pairs_same_superpod += p.superpod == self.decode_at.get(g.name)
        self.unplaced[g.name] -= 1
        if self.unplaced[g.name] == 0:
            heapq.heappush(self.ends, (self.now + g.lifetime, g.name))
        return True
