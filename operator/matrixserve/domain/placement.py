"""Where an instance's pods go: SuperPod-aware packing, P↔D pairing and the KV plane (pure).

**Why.** An instance's ranks talk all-to-all every MoE layer (EP dispatch and combine, TP), so
CloudMatrix-Infer keeps every rank of an instance on the UB plane: one SuperPod (001 §3.2, §4.2.1;
§6.1.2 calls such a unit a *tightly-coupled block* that "must be provisioned within a single
supernode"). Blocks of mixed sizes fragment a SuperPod: its free NPUs add up to a block yet no
set of its servers holds one, and 001 §6.1.2 (Fig. 24) measures what that costs: at a mean block
of 10.08 NPUs a 384-NPU SuperPod keeps over 94% of its NPUs allocated, a 224-NPU one under 91%.
The placement function decides how much of that loss the operator adds on top of the SuperPod's
size. Prefill and decode are paired too: the paper moves KV over the RDMA plane (RoCE, 001
§4.3.3, notes §2.6), which reaches across SuperPods; the engine can also move it over UB
(the plane that joins every NPU of a SuperPod, 001 §3.2), which reaches only inside one, and its
``kvpull`` falls back to RoCE across SuperPods. So a prefill placed in its decode's SuperPod
keeps UB open for its KV; :func:`kv_plane` says which plane a pair uses.

**The policy** (:func:`place`), requests in order, each placement taken out of the free NPUs
the next one sees:

- an instance's pods (one per server; the leader first) all go to one SuperPod; a server without
  the SuperPod label is never used (the placement names its SuperPod, and a pod there could
  join no gang);
- ``superpod`` is a hard requirement; ``prefer_superpod`` (where the instance's peers are: a
  prefill's decode) is taken whenever the instance fits there;
- otherwise **best fit**: the SuperPod with the fewest free NPUs that holds the instance, and in
  it, largest pod first, the server with the fewest free NPUs that holds the pod. Best fit keeps
  whole servers and whole SuperPods free for the large instances (a 48-NPU instance needs six
  empty servers in one SuperPod) instead of nibbling every server, which is what spreading (the
  Kubernetes scheduler's default ``LeastAllocated`` score) does. Within a SuperPod the server
  choice is exact: a pod fits every server a larger pod fits, so "largest first, smallest server
  that holds it" finds an assignment whenever one exists;
- ties by name, so the same snapshot gives the same placement.

**The bound it does not promise.** Best fit is a heuristic for an NP-hard packing: it does not
reach the optimum, nor the paper's allocation rate on every workload; ``make bench-placement``
measures it on a stream of the paper's mean block size beside first fit and spreading. It never
moves a placed pod (no defragmentation) and never reorders the requests (an instance that does
not fit now is :class:`Unplaceable` with the free NPUs of every SuperPod; the caller decides
whether the ones after it may pass).

:func:`fits_any_superpod` answers admission's question: does the instance fit some SuperPod even
when that SuperPod is empty (one larger than any SuperPod is refused, not queued).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Server:
    """A server's free NPUs now, and the SuperPod it belongs to (``None``: no SuperPod label)."""

    name: str
    superpod: str | None
    free_npus: int


@dataclass(frozen=True)
class Request:
    """An instance to place: the NPUs of each of its pods in rank order (the leader first)."""

    name: str
    pods: tuple[int, ...]
    superpod: str | None = None  # required (None: any)
    prefer_superpod: str | None = None  # where its peers are: tried first when it fits


@dataclass(frozen=True)
class Placement:
    name: str
    superpod: str
    servers: tuple[str, ...]  # one server per pod, rank order


@dataclass(frozen=True)
class Unplaceable:
    name: str
    reason: str


class KvPlane(StrEnum):
    """The plane a prefill's KV travels to its decode on: the engine's ``--kv-plane`` values."""

    UB = "UB"
    ROCE = "RoCE"


def kv_plane(prefill_superpod: str | None, decode_superpod: str | None) -> KvPlane:
    """UB when both ends are known to share a SuperPod (UB reaches no further), else RoCE."""
    if prefill_superpod is not None and prefill_superpod == decode_superpod:
        return KvPlane.UB
    return KvPlane.ROCE


def free_by_superpod(servers: Sequence[Server]) -> dict[str, int]:
    """Free NPUs of each labelled SuperPod, by name (servers without the label not counted)."""
    out: dict[str, int] = {}
    for s in sorted(servers, key=lambda s: (s.superpod or "", s.name)):
        if s.superpod is not None:
            out[s.superpod] = out.get(s.superpod, 0) + s.free_npus
    return out


def fits_any_superpod(pods: Sequence[int], capacity: Mapping[str, tuple[int, int]]) -> bool:
    """Whether an instance of ``pods`` fits some SuperPod when it is empty.

    ``capacity``: SuperPod -> (servers, NPUs per server); a SuperPod's servers are alike
    (CloudMatrix384: 48 servers of 8 NPUs, 001 §3.3). One pod per server, so an instance fits an
    empty SuperPod when it has no more pods than servers and no pod larger than a server."""
    _check_pods("the instance", pods)
    return any(len(pods) <= n and max(pods) <= per for n, per in capacity.values())


def place(
    requests: Sequence[Request], servers: Sequence[Server]
) -> tuple[list[Placement], list[Unplaceable]]:
    """Place ``requests`` in order, each seeing the free NPUs the ones before it left.
    Deterministic: ties go by name."""
    _check_servers(servers)
    _check_requests(requests)
    free = {s.name: s.free_npus for s in servers}
    by_superpod: dict[str, list[str]] = {}
    for s in sorted(servers, key=lambda s: s.name):
        if s.superpod is not None:
            by_superpod.setdefault(s.superpod, []).append(s.name)
    placed: list[Placement] = []
    refused: list[Unplaceable] = []
    for r in requests:
        chosen = _choose(r, by_superpod, free)
        if chosen is None:
            refused.append(Unplaceable(r.name, _reason(r, by_superpod, free)))
            continue
        superpod, names = chosen
        for name, npus in zip(names, r.pods, strict=True):
            free[name] -= npus
        placed.append(Placement(r.name, superpod, names))
    return placed, refused


def _choose(
    r: Request, by_superpod: Mapping[str, list[str]], free: Mapping[str, int]
) -> tuple[str, tuple[str, ...]] | None:
    """The SuperPod and the servers (rank order) ``r`` goes to, or None if it fits nowhere."""
    candidates = [r.superpod] if r.superpod is not None else sorted(by_superpod)
    fits = {sp: a for sp in candidates if (a := _assign(r.pods, by_superpod.get(sp, []), free))}
    if not fits:
        return None
    if r.prefer_superpod in fits:
        return r.prefer_superpod, fits[r.prefer_superpod]
    best = min(fits, key=lambda sp: (sum(free[n] for n in by_superpod[sp]), sp))
    return best, fits[best]


def _assign(
    pods: Sequence[int], names: Iterable[str], free: Mapping[str, int]
) -> tuple[str, ...] | None:
    """Best fit of ``pods`` on distinct servers of ``names``, largest pod first; rank order."""
    left = sorted(names, key=lambda n: (free[n], n))
    out: dict[int, str] = {}
    for rank in sorted(range(len(pods)), key=lambda i: (-pods[i], i)):
        pick = next((n for n in left if free[n] >= pods[rank]), None)
        if pick is None:
            return None
        out[rank] = pick
        left.remove(pick)
    return tuple(out[i] for i in range(len(pods)))


def _reason(r: Request, by_superpod: Mapping[str, list[str]], free: Mapping[str, int]) -> str:
    n = len(r.pods)
    servers = "1 server" if n == 1 else f"{n} servers"
    if len(set(r.pods)) == 1:
        npus = f"{r.pods[0]} free NPUs" + (" each" if n > 1 else "")
    else:
        npus = "at least " + ", ".join(str(p) for p in r.pods) + " free NPUs"
    where = f"in SuperPod {r.superpod}" if r.superpod is not None else "in one SuperPod"
    if r.superpod is not None and r.superpod not in by_superpod:
        where += " (no server carries it)"
    if not by_superpod:
        return f"needs {servers} with {npus} {where}; no server carries a SuperPod label"
    per = ", ".join(
        f"{sp} {sum(free[x] for x in names)} (largest server {max(free[x] for x in names)})"
        for sp, names in sorted(by_superpod.items())
    )
    return f"needs {servers} with {npus} {where}; free NPUs per SuperPod: {per}"


def _check_pods(what: str, pods: Sequence[int]) -> None:
    if not pods:
        raise ValueError(f"{what} has no pods")
    if any(p < 1 for p in pods):
        raise ValueError(f"{what} asks for a pod of {min(pods)} NPUs (each pod needs at least 1)")


def _check_requests(requests: Sequence[Request]) -> None:
    _check_once((r.name for r in requests), "instance {} asked to be placed twice")
    for r in requests:
        _check_pods(f"instance {r.name}", r.pods)


def _check_servers(servers: Sequence[Server]) -> None:
    _check_once((s.name for s in servers), "server {} listed twice")
    for s in servers:
        if s.free_npus < 0:
            raise ValueError(f"server {s.name} has {s.free_npus} free NPUs (at least 0)")


def _check_once(names: Iterable[str], message: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(message.format(name))
        seen.add(name)
