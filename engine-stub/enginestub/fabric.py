"""The fabric model: UB, RoCE and VPC planes, and transfers that share links fairly.

Planes (001 §3.2): **UB** is the scale-up bus inside a SuperPod (per die 196 GB/s; measured
die-to-die read 167 GB/s / 1.2 µs within a node and 164 GB/s / 1.9 µs across nodes, T1);
**RoCE** is the RDMA plane for KV transfer and scale-out (200 Gbps per die, NPUs only); **VPC**
is the datacenter network (400 Gbps per node).

A transfer crosses the sender's egress and the receiver's ingress on its plane. Concurrent
transfers share each link max-min fairly (progressive filling), so two transfers on one link
each take about twice as long, and a conflict costs time as in P/D-Serve §3.7. KV moves as K
same-index sub-transfers (device k -> device k, 004 §2.1/§3.7); their maximum is ξ (004 §2.3).

Pure: :func:`simulate` computes completion times for a set of flows with start times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from enginestub import calibration as cal


class Plane(StrEnum):
    UB = "UB"
    ROCE = "RoCE"
    VPC = "VPC"


@dataclass(frozen=True)
class Endpoint:
    """A die (for UB and RoCE) on a node, in a SuperPod."""

    superpod: str
    node: str
    die: int


def plane_allowed(plane: Plane, a: Endpoint, b: Endpoint) -> bool:
    """UB only reaches inside one SuperPod; RoCE and VPC reach anywhere."""
    return plane is not Plane.UB or a.superpod == b.superpod


def link_bandwidth(plane: Plane, same_node: bool) -> float:
    if plane is Plane.UB:
        return cal.UB_READ_BANDWIDTH_INTRA if same_node else cal.UB_READ_BANDWIDTH_INTER
    if plane is Plane.ROCE:
        return cal.ROCE_DIE_BANDWIDTH
    return cal.VPC_NODE_BANDWIDTH


def link_latency(plane: Plane, same_node: bool) -> float:
    if plane is Plane.UB:
        return cal.UB_LATENCY_INTRA if same_node else cal.UB_LATENCY_INTER
    if plane is Plane.ROCE:
        return cal.ROCE_LATENCY
    return cal.VPC_LATENCY


def link_ids(plane: Plane, src: Endpoint, dst: Endpoint) -> tuple[str, str]:
    """The two links a transfer crosses: the sender's egress and the receiver's ingress."""
    if plane is Plane.VPC:
        return (f"vpc:{src.node}:tx", f"vpc:{dst.node}:rx")
    return (f"{plane}:{src.node}/{src.die}:tx", f"{plane}:{dst.node}/{dst.die}:rx")


def transfer_seconds(nbytes: float, plane: Plane, src: Endpoint, dst: Endpoint) -> float:
    """One transfer alone on its links."""
    if not plane_allowed(plane, src, dst):
        raise ValueError(f"{plane} does not connect {src.superpod} and {dst.superpod}")
    same = src.node == dst.node
    return link_latency(plane, same) + nbytes / link_bandwidth(plane, same)


@dataclass
class Flow:
    id: str
    nbytes: float
    links: tuple[str, ...]
    start: float = 0.0
    latency: float = 0.0
    # filled by simulate()
    finish: float = field(default=0.0, init=False)


def fair_rates(flows: Sequence[Flow], capacity: dict[str, float]) -> dict[str, float]:
    """Max-min fair rates by progressive filling."""
    rates: dict[str, float] = {}
    remaining = dict(capacity)
    unfrozen = {f.id: f for f in flows}
    while unfrozen:
        share = {}
        for link, cap in remaining.items():
            users = [f for f in unfrozen.values() if link in f.links]
            if users:
                share[link] = cap / len(users)
        if not share:
            for fid in unfrozen:
                rates[fid] = float("inf")
            break
        bottleneck = min(share, key=lambda k: share[k])
        rate = share[bottleneck]
        for f in [f for f in unfrozen.values() if bottleneck in f.links]:
            rates[f.id] = rate
            for link in f.links:
                remaining[link] -= rate
            del unfrozen[f.id]
        remaining = {k: max(v, 0.0) for k, v in remaining.items()}
    return rates


def simulate(flows: Sequence[Flow], capacity: dict[str, float]) -> dict[str, float]:
    """Completion time of every flow (each starts after its latency; rates re-shared at every
    start and finish). Returns ``{flow id: finish time}``."""
    pending = sorted(flows, key=lambda f: f.start + f.latency)
    left = {f.id: float(f.nbytes) for f in flows}
    active: list[Flow] = []
    now = 0.0
    done: dict[str, float] = {}
    while pending or active:
        rates = fair_rates(active, capacity) if active else {}
        next_start = pending[0].start + pending[0].latency if pending else float("inf")
        next_finish, finisher = float("inf"), None
        for f in active:
            t = now + left[f.id] / rates[f.id] if rates[f.id] > 0 else float("inf")
            if t < next_finish:
                next_finish, finisher = t, f
        step_to = min(next_start, next_finish)
        for f in active:
            left[f.id] -= rates[f.id] * (step_to - now)
        now = step_to
        if finisher is not None and next_finish <= next_start:
            for f in [f for f in active if left[f.id] <= 1e-6 * max(f.nbytes, 1.0)]:
                done[f.id] = now
                active.remove(f)
        else:
            active.append(pending.pop(0))
    for f in flows:
        f.finish = done[f.id]
    return done


def kv_transfer_seconds(
    nbytes: float, plane: Plane, senders: Sequence[Endpoint], receivers: Sequence[Endpoint]
) -> float:
    """ξ: KV split over K same-index sub-transfers (sender die k -> receiver die k); the slowest
    one (004 §2.3 "ξ refers to the maximum one")."""
    if len(senders) != len(receivers) or not senders:
        raise ValueError("KV transfer pairs device k with device k: equal, non-zero device counts")
    per = nbytes / len(senders)
    flows = []
    capacity: dict[str, float] = {}
    for k, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        if not plane_allowed(plane, s, r):
            raise ValueError(f"{plane} does not connect {s.superpod} and {r.superpod}")
        same = s.node == r.node
        links = link_ids(plane, s, r)
        for link in links:
            capacity[link] = link_bandwidth(plane, same)
        flows.append(Flow(f"k{k}", per, links, latency=link_latency(plane, same)))
    return max(simulate(flows, capacity).values())
