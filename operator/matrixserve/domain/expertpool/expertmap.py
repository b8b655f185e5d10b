"""The expert map (pure): which server holds which experts in each MoE layer, how the next
version is made from the one in force, and what a version covers.

EaaS (§3.1, §3.4, §4.4): clients route an expert's tokens to the servers of an
expert-to-server map the monitor publishes; experts are *pre-duplicated*, so a server's failure
leaves a copy of each of its experts elsewhere, and the client re-sends there at once. Here:

- :func:`place_layer` fills one layer: every expert on ``minReplicasPerExpert`` distinct
  servers, each time on the least-used server that does not hold it yet (balanced slot use; a
  swap makes room when the only free slots are beside a copy), then the redundant budget's extra
  copies spread evenly (fewest copies first, rotated per layer) until EPLB (xDeepServe §4.5)
  chooses them by load. What servers already hold stays (a new version moves nothing it does
  not have to: a moved slot is a load);
- every change of the map (a new pool, a replacement, a scale, an EPLB rebalance) is walked
  through the same phases, by :mod:`.rebalance`;
- :func:`coverage` counts the experts short of ``minReplicasPerExpert`` (under-replicated) or
  of any live copy (uncovered), in any layer.

The map's payloads are :mod:`matrixserve.api.zk_layout`'s (a version, one znode per layer).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from matrixserve.api import zk_layout as zl

Layer = tuple[tuple[int, ...], ...]  # server index -> the experts it holds (sorted)


@dataclass(frozen=True)
class ExpertMap:
    """One version of a pool's map (``version`` 0: not written yet)."""

    version: int
    experts: int
    slots: int  # per server per layer
    servers: tuple[str, ...]
    held: tuple[Layer, ...]  # per MoE layer
    disabled: tuple[Layer, ...] = ()  # per layer, or () when every slot is enabled
    prefetch: tuple[Layer, ...] = ()  # per layer, what each server stages; () when nothing
    phase: zl.ExpertMapPhase = zl.ExpertMapPhase.STEADY
    reason: str = ""
    at: float = 0.0
    # per server (table order), the version since which its rows are these (0: not known),
    # and the ``at`` of this map history's first version: :func:`stamped` sets both as a
    # version is written
    rows_at: tuple[int, ...] = ()
    origin: float = 0.0

    @property
    def layers(self) -> int:
        return len(self.held)

    @property
    def steady(self) -> bool:
        return self.phase is zl.ExpertMapPhase.STEADY

    def loading(self) -> list[str]:
        """The servers with disabled slots (loading them)."""
        return [
            s
            for i, s in enumerate(self.servers)
            if any(layer[i] for layer in self.disabled if i < len(layer))
        ]

    def _off(self) -> tuple[Layer, ...]:
        return self.disabled if any(any(s) for s in self.disabled) else ()

    def _staged(self) -> tuple[Layer, ...]:
        return self.prefetch if any(any(s) for s in self.prefetch) else ()

    def without(self, gone: Collection[str], version: int, reason: str, at: float) -> ExpertMap:
        """This map with the servers in ``gone`` out of its table (their slots with them)."""
        keep = [i for i, s in enumerate(self.servers) if s not in gone]

        def pick(layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
            return tuple(tuple(layer[i] for i in keep) for layer in layers)

        return replace(
            self,
            version=version,
            servers=tuple(self.servers[i] for i in keep),
            held=pick(self.held),
            disabled=pick(self.disabled) if self._off() else (),
            prefetch=pick(self.prefetch) if self._staged() else (),
            reason=reason,
            at=at,
            rows_at=tuple(self.rows_at[i] for i in keep) if self.rows_at else (),
        )

    def enabled(self, version: int, reason: str, at: float) -> ExpertMap:
        """This map with every slot enabled and nothing staged: ``Steady`` (its rows changed:
        not stamped)."""
        return replace(
            self,
            version=version,
            disabled=(),
            prefetch=(),
            phase=zl.ExpertMapPhase.STEADY,
            reason=reason,
            at=at,
            rows_at=(),
        )

    # ------------------------------------------------------------------ payloads
    def payloads(self) -> tuple[zl.ExpertMapVersion, list[zl.ExpertMapLayer]]:
        head = zl.ExpertMapVersion(
            version=self.version,
            layers=self.layers,
            experts=self.experts,
            slots=self.slots,
            servers=list(self.servers),
            phase=self.phase,
            reason=self.reason,
            at=self.at,
            rowsAt={s: v for s, v in zip(self.servers, self.rows_at, strict=False) if v},
            origin=self.origin,
        )
        off, staged = self._off(), self._staged()
        layers = [
            zl.ExpertMapLayer(
                layer=n,
                slots=[list(s) for s in held],
                disabled=[list(s) for s in off[n]] if off else [],
                prefetch=[list(s) for s in staged[n]] if staged else [],
            )
            for n, held in enumerate(self.held)
        ]
        return head, layers

    @classmethod
    def of(cls, head: zl.ExpertMapVersion, layers: Sequence[zl.ExpertMapLayer]) -> ExpertMap:
        """A version read back; ValueError if its layers do not match its table."""
        by_number = {layer.layer: layer for layer in layers}
        if sorted(by_number) != list(range(head.layers)):
            raise ValueError(
                f"map v{head.version}: layers {sorted(by_number)} read, {head.layers} expected"
            )
        n = len(head.servers)
        held: list[Layer] = []
        off: list[Layer] = []
        staged: list[Layer] = []

        def padded(lists: Sequence[Sequence[int]]) -> Layer:
            rows = [*lists, *([] for _ in range(n - len(lists)))]
            return tuple(tuple(sorted(s)) for s in rows[:n])

        for number in range(head.layers):
            layer = by_number[number]
            if len(layer.slots) != n:
                raise ValueError(
                    f"map v{head.version} layer {number}: {len(layer.slots)} servers' slots, "
                    f"{n} servers in the table"
                )
            held.append(padded(layer.slots))
            off.append(padded(layer.disabled))
            staged.append(padded(layer.prefetch))
        return cls(
            head.version,
            head.experts,
            head.slots,
            tuple(head.servers),
            tuple(held),
            tuple(off) if any(any(s) for s in off) else (),
            tuple(staged) if any(any(s) for s in staged) else (),
            head.phase,
            head.reason,
            head.at,
            tuple(head.rows_at.get(s, 0) for s in head.servers) if head.rows_at else (),
            head.origin,
        )

    def rows(self, index: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Server ``index``'s rows: per layer, what it holds, has disabled and stages."""

        def row(layers: tuple[Layer, ...], n: int) -> tuple[int, ...]:
            return layers[n][index] if layers and index < len(layers[n]) else ()

        return tuple(
            (row(self.held, n), row(self.disabled, n), row(self.prefetch, n))
            for n in range(self.layers)
        )


def stamped(before: ExpertMap | None, walk: Sequence[ExpertMap]) -> tuple[ExpertMap, ...]:
    """The ``walk`` written after ``before`` (the version in force) with each version's
    :attr:`ExpertMap.rows_at`: a server's rows unchanged from the version before keep that
    version's stamp, any other row (a new server's, a changed one) is stamped with its own
    version. So a server whose stamp did not move reads the head alone (see
    :class:`~matrixserve.api.zk_layout.ExpertMapVersion`). The walk keeps ``before``'s history
    (its ``origin``); with none before (a new pool, its map lost), one starts at the walk."""
    out = []
    origin = before.origin if before is not None and before.origin else 0.0
    if not origin:
        before = None  # stamps of no known history are none
        origin = walk[0].at if walk else 0.0
    for m in walk:
        index = {s: j for j, s in enumerate(before.servers)} if before is not None else {}
        since = []
        for i, server in enumerate(m.servers):
            j = index.get(server)
            same = (
                before is not None
                and j is not None
                and j < len(before.rows_at)
                and before.rows(j) == m.rows(i)
            )
            kept = before.rows_at[j] if same and before and j is not None else 0
            since.append(kept or m.version)  # 0: not known, so new
        before = replace(m, rows_at=tuple(since), origin=origin)
        out.append(before)
    return tuple(out)


# --------------------------------------------------------------------------- one layer
class Unplaceable(ValueError):
    """The slots cannot hold what a layer needs (validation keeps a spec from asking it)."""


def place_layer(
    held: Sequence[Sequence[int]],
    experts: int,
    slots: int,
    min_replicas: int,
    budget: int,
    rotate: int = 0,
) -> Layer:
    """A layer's slots from what each server ``held`` (an empty list: a new server): kept
    where still valid, redundancy beyond ``budget`` trimmed, every expert brought to
    ``min_replicas`` copies on distinct servers, then up to ``budget`` extra copies spread
    evenly (``rotate`` shifts which experts are duplicated first, so layers differ).
    :class:`Unplaceable` if the slots cannot hold it."""
    out = [list(dict.fromkeys(e for e in h if 0 <= e < experts))[:slots] for h in held]
    copies = [0] * experts
    for h in out:
        for e in h:
            copies[e] += 1
    extra = sum(max(0, c - min_replicas) for c in copies)
    while extra > budget:  # a lowered budget: the most duplicated expert, on the fullest server
        e = max(range(experts), key=lambda x: (copies[x], -x))
        s = max((i for i, h in enumerate(out) if e in h), key=lambda i: (len(out[i]), i))
        out[s].remove(e)
        copies[e] -= 1
        extra -= 1

    def order(x: int) -> tuple[int, int]:
        return copies[x], (x - rotate) % experts

    for want in range(1, min_replicas + 1):
        for e in sorted(range(experts), key=order):
            if copies[e] < want:
                _add(out, e, slots)
                copies[e] += 1
    while extra < budget:
        candidates = [e for e in sorted(range(experts), key=order) if copies[e] < len(out)]
        if not candidates or not any(len(h) < slots for h in out):
            break
        _add(out, candidates[0], slots)
        copies[candidates[0]] += 1
        extra += 1
    return tuple(tuple(sorted(h)) for h in out)


def _add(out: list[list[int]], expert: int, slots: int) -> None:
    """``expert`` on the least-used server that does not hold it; if every server with a free
    slot holds it, a swap: an expert of a full server that lacks it moves to the free slot."""
    free = [i for i, h in enumerate(out) if len(h) < slots and expert not in h]
    if free:
        out[min(free, key=lambda i: (len(out[i]), i))].append(expert)
        return
    for room in (i for i, h in enumerate(out) if len(h) < slots):
        for h in out:
            if expert in h:
                continue
            movable = next((f for f in h if f not in out[room]), None)
            if movable is not None:
                h.remove(movable)
                out[room].append(movable)
                h.append(expert)
                return
    raise Unplaceable(f"no server can take another copy of expert {expert}")


# --------------------------------------------------------------------------- versions
def wanted(
    current: ExpertMap | None,
    servers: Sequence[str],
    experts: int,
    layers: int,
    slots: int,
    min_replicas: int,
    budget: int,
) -> ExpertMap:
    """The map over ``servers`` (in that order) keeping what they hold in ``current``; servers
    new to it take copies from the fullest ones that gain nothing (so a new server is not left
    idle, and no server both loads and gives up a slot in one step)."""
    index = {s: i for i, s in enumerate(current.servers)} if current else {}
    held = []
    for n in range(layers):
        before = current.held[n] if current is not None and n < current.layers else ()
        start = [list(before[index[s]]) if s in index and before else [] for s in servers]
        layer = place_layer(start, experts, slots, min_replicas, budget, rotate=n * budget)
        newcomers = [i for i, s in enumerate(servers) if s not in index]
        held.append(_spread(start, layer, newcomers) if newcomers and current else layer)
    return ExpertMap(0, experts, slots, tuple(servers), tuple(held))


def _spread(start: Sequence[Sequence[int]], layer: Layer, newcomers: Sequence[int]) -> Layer:
    """Copies moved to the ``newcomers`` from the fullest servers that gained nothing, until no
    newcomer has two fewer than such a server."""
    out = [list(h) for h in layer]
    givers = [i for i, h in enumerate(out) if set(h) <= set(start[i]) and i not in newcomers]
    while givers:
        taker = min(newcomers, key=lambda i: (len(out[i]), i))
        giver = max(givers, key=lambda i: (len(out[i]), -i))
        if len(out[giver]) - len(out[taker]) < 2:
            break
        moving = next((e for e in out[giver] if e not in out[taker]), None)
        if moving is None:
            givers.remove(giver)
            continue
        out[giver].remove(moving)
        out[taker].append(moving)
    return tuple(tuple(sorted(h)) for h in out)


# --------------------------------------------------------------------------- coverage
@dataclass(frozen=True)
class Coverage:
    under_replicated: int  # experts short of minReplicasPerExpert live copies in some layer
    uncovered: int  # experts with no live enabled copy in some layer
    min_copies: int  # the fewest live copies of any expert in any layer


def coverage(
    m: ExpertMap | None, live: Collection[str], experts: int, layers: int, min_replicas: int
) -> Coverage:
    """What the map's enabled slots on ``live`` servers cover."""
    if m is None:
        return Coverage(experts, experts, 0)
    under: set[int] = set()
    lost: set[int] = set()
    fewest = min_replicas if layers else 0
    for n in range(layers):
        count = [0] * experts
        if n < m.layers:
            for i, s in enumerate(m.servers):
                if s not in live:
                    continue
                off = set(m.disabled[n][i]) if m.disabled else set()
                for e in m.held[n][i]:
                    if e not in off and 0 <= e < experts:
                        count[e] += 1
        for e, c in enumerate(count):
            if c < min_replicas:
                under.add(e)
            if c == 0:
                lost.add(e)
        fewest = min(fewest, min(count, default=0))
    return Coverage(len(under), len(lost), fewest)
