"""Minimum-cost recovery: a fault, the group's topology, its state and the policy → the
cheapest plan under an explicit cost (pure).

P/D-Serve §3.4 (Fig. 8) recovers at "minimum cost": the faulty instance is logically removed in
ZooKeeper first (no new traffic), and exactly one new stateless container is linked in by
dynamic RoCE construction (§3.3, Fig. 7). xDeepServe §6.2 adds the ladder this planner chooses
on, least disruptive first: mask and retry, restart one instance, kill a prefill to preserve a
decode, restart the world. Every Kubernetes anchor restarts whole groups by fixed rule (LWS
``RecreateGroupOnPodRestart``, RBG, Grove); MindIE shrinks prefill to protect decode. Here each
option is priced and the cheapest feasible one is taken.

**The cost** of an option is the weighted capacity it keeps out of service, integrated over the
time it takes to restore::

    cost = restore_s * lost  +  horizon_s * lost_after

- ``restore_s``: the option's predicted time from the plan to serving again, the sum of its
  terms (pod deletion, pod start, engine ready = register + link + load + first health, the
  kubelet's restart back-off, a retry window), each from :class:`Estimates`;
- ``lost``: the weighted fraction of the group's capacity out meanwhile, over the instances out
  (the faulty ones and any the option takes down): ``(w_P·out_P/n_P + w_D·out_D/n_D) /
  (w_P + w_D)``, with the protected role weighing ``PROTECT_WEIGHT`` (decode by default,
  xDeepServe §6.2's "kill-P-to-preserve-D"): a whole-group restart loses 1;
- ``lost_after``: capacity still out once restored (a prefill given up by a shrink, or an
  instance masked for want of NPUs) for ``horizon_s`` (until capacity returns: a repair).

**Where**: NPUs count only where the new pod could go. Given the servers (:class:`Server`: free
NPUs, SuperPod, and why the scheduler would refuse each role's new pod there: not Ready, cordoned, a
taint it does not tolerate, another NPU type), a replacement's pods must each fit whole on a server
that takes its role, in the SuperPod of the instances of its role that stay when the role keeps one
(the decodes); a shrink gives up only prefills whose NPUs, where they run, would fit the decode so
(a prefill on a server tainted by another NPU's fault, cordoned, down or in another SuperPod is
never sacrificed for nothing).

**Any kind.** A member is an instance with a kind-specific tag (:data:`Tag`: a PDGroup's
role, an ExpertPool's ``"expert"`` for a server): capacity is weighed per tag, servers refuse
per tag, warm pods are counted per tag. So one planner prices a PDGroup's instance and an
ExpertPool's server alike (EaaS §4.4: a failed expert server replaced while the others serve);
only the shrink is a PDGroup's (it gives up a prefill for a decode), infeasible for other tags.

Ties go to the option restarting fewer pods. Fencing: with ZooKeeper not connected nothing is
planned (nothing destructive without coordination). A cap on concurrent replacements keeps a
server fault with several members, or a storm, from taking the group down at once: over the cap
a faulty instance is masked (no traffic) and waits its turn (the cap counts faulty instances; a
prefill a shrink gives up is not replaced, so it is not one of them). Flapping is damped by the
caller: an instance already in recovery is not planned for again. Every plan is feasible on its
snapshot: under ``spec.recovery.policy: RestartGroup`` too, a restart the group would not fit
back from is not taken (the faulty instances stay masked).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import Protect, RecoveryPolicy
from matrixserve.domain import placement
from matrixserve.domain.observed import Fault, FaultKind

# What a member is to its kind: a PDGroup's role (``zl.Role``, a ``str``), an ExpertPool's
# server (``"expert"``). The planner compares tags and nothing else, except the shrink, which
# gives up a prefill for a decode (the PDGroup's roles), and the policy's protected tag.
Tag = str

PROTECT_WEIGHT = 2.0  # the protected role's capacity counts twice (decode by default)
CRASH_LOOP_RESTARTS = 3  # restarts in place after which a pod is replaced instead
CONCURRENT_SHARE = 0.25  # at most a quarter of the instances (at least one) out at once


class ActionKind(StrEnum):
    MASK_AND_RETRY = "MaskAndRetry"  # no traffic to it; wait for the fault to clear
    RELINK = "Relink"  # verify the sub-links again (a new map version), nobody restarts
    RESTART_IN_PLACE = "RestartInPlace"  # the kubelet restarts its container; it rejoins
    REPLACE = "Replace"  # logical removal, its pod released, one new pod linked in (cold today)
    SHRINK = "Shrink"  # give up a prefill so its NPUs restore a protected decode
    RESTART_GROUP = "RestartGroup"  # every pod of the group recreated (the anchors' default)


# What each action restarts, for the tie-break and the plan's promise.
DESTRUCTIVE = frozenset(
    {ActionKind.REPLACE, ActionKind.SHRINK, ActionKind.RESTART_GROUP, ActionKind.RELINK}
)


@dataclass(frozen=True)
class Member:
    """An instance of the group as recovery sees it."""

    name: str
    tag: Tag
    npus: int  # all of its pods'
    node: str | None = None
    restarts: int = 0  # container restarts of its pods
    pods: int = 1
    superpod: str | None = None
    # The server of each of its pods, in rank order (empty: all of them on ``node``): an
    # instance of several pods spans servers, one pod each.
    pod_nodes: tuple[str | None, ...] = ()

    def on_node(self, node: str | None) -> int:
        """Its NPUs on server ``node`` (all of them when the pods' servers are not known, or
        no server is named)."""
        if not self.pod_nodes or node is None:
            return self.npus
        return sum(
            size for size, at in zip(_pod_sizes(self), self.pod_nodes, strict=False) if at == node
        )


@dataclass(frozen=True)
class Server:
    """A server as a new pod of the group would find it: the NPUs free there now, its
    SuperPod, and, per tag, why the scheduler would not place that tag's new pod there (not
    Ready, cordoned, a taint the pod does not tolerate, not of its NPU type); a tag not named
    may go there."""

    name: str
    free: int
    superpod: str | None = None
    refuses: Mapping[Tag, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    """The group's instances and the NPUs the cluster can still give (``None``: not known; the
    scheduler decides, and a replacement that stays unschedulable is planned for again).

    ``servers`` (None: not known) says where: a new pod is placed whole on one server that takes
    its tag, and the NPUs a shrink frees count only on such a server; without it the free NPUs
    are counted together. ``same_superpod``: the tags whose instances all share one SuperPod
    (a new one joins the SuperPod of those that stay)."""

    members: Mapping[str, Member]
    free_npus: int | None = None
    servers: Mapping[str, Server] | None = None
    same_superpod: frozenset[Tag] = frozenset()

    def count(self, tag: Tag) -> int:
        return sum(1 for m in self.members.values() if m.tag == tag)


@dataclass(frozen=True)
class Estimates:
    """Seconds (wall) each step takes; the caller learns them from the group where it can."""

    pod_delete: float = 1.0  # delete → the old pod gone (a SIGTERM'd engine exits at once)
    pod_start: float = 1.0  # create → scheduled, container running
    engine_ready: float = 2.0  # process start → Serving: register, link, load, first health
    # One engine's model load alone when it reads the shared file service (0: it does not):
    # engines that start together share its bucket (001 Table 2), so each of k restarted
    # together loads k times as long: k - 1 more of these
    shared_load: float = 0.0
    restart_backoff: float = 0.0  # the kubelet's back-off before restarting a container
    relink: float = 0.5  # a new map version → the sub-links verified again
    retry_window: float = 10.0  # how long a transient fault is given to clear
    horizon: float = 600.0  # how long capacity masked for want of NPUs stays out (a repair)
    # Warm pods that could replace an instance of each tag now, and the fastest warm
    # path's seconds from the claim to serving (the scale-out path choice's estimate).
    warm_pods: Mapping[Tag, int] = field(default_factory=dict)
    warm_ready: Mapping[Tag, float] = field(default_factory=dict)
    warm_total: int | None = None  # distinct warm pods for any tag (None: as warm_pods say)


@dataclass(frozen=True)
class Policy:
    policy: RecoveryPolicy = RecoveryPolicy.MINIMUM_COST
    protect: Protect = Protect.DECODE

    def weight(self, tag: Tag) -> float:
        protected = {Protect.DECODE: zl.Role.DECODE, Protect.PREFILL: zl.Role.PREFILL}.get(
            self.protect
        )
        return PROTECT_WEIGHT if tag == protected else 1.0


@dataclass(frozen=True)
class Option:
    action: ActionKind
    instances: tuple[str, ...]  # the instances it restarts or takes down (empty: none)
    terms: Mapping[str, float]  # restore time, term by term (seconds)
    lost: float  # weighted capacity fraction out while restoring
    lost_after: float  # ... and still out once restored, for the horizon
    feasible: bool
    why: str
    pods_restarted: int = 0
    sacrificed: tuple[str, ...] = ()  # a shrink's prefill given up
    horizon: float = 0.0

    @property
    def restore_s(self) -> float:
        return sum(self.terms.values())

    @property
    def cost(self) -> float:
        return self.restore_s * self.lost + self.horizon * self.lost_after

    def as_status(self) -> dict[str, object]:
        return {
            "action": str(self.action),
            "instances": list(self.instances),
            "predictedRestoreSeconds": round(self.restore_s, 3),
            "cost": round(self.cost, 3),
            "lostFraction": round(self.lost, 4),
            "feasible": self.feasible,
            "why": self.why,
            "terms": {k: round(v, 3) for k, v in self.terms.items()},
        }


@dataclass(frozen=True)
class Plan:
    fault: Fault
    chosen: Option | None  # None: nothing may be done now (fenced)
    alternatives: tuple[Option, ...] = field(default_factory=tuple)
    deferred: tuple[str, ...] = ()  # faulty instances over the concurrency cap: masked, waiting
    why: str = ""


def concurrency_cap(instances: int) -> int:
    """How many instances recovery may take out at once: a quarter of the group, at least one."""
    return max(1, math.floor(instances * CONCURRENT_SHARE))


# --------------------------------------------------------------------------- pricing
def lost_fraction(topology: Topology, policy: Policy, out: set[str]) -> float:
    """The weighted capacity fraction the instances ``out`` take away (1 = the whole group)."""
    total = 0.0
    weights = 0.0
    for tag in sorted({m.tag for m in topology.members.values()}):
        n = topology.count(tag)
        if n == 0:
            continue
        w = policy.weight(tag)
        weights += w
        gone = sum(1 for name in out if topology.members[name].tag == tag)
        total += w * gone / n
    return total / weights if weights else 0.0


def withheld(fault: Fault, topology: Topology, faulty: tuple[str, ...]) -> int:
    """NPUs a replacement of ``faulty`` must find elsewhere, beyond the free ones: all of
    theirs for a server down (until it returns) or a device fault (the faulty NPU is no longer
    allocatable and its server is tainted NoSchedule, so nothing there takes a new pod); none
    for a process, session, hang or a link fault no device reports (their NPUs come back
    where they are)."""
    device = fault.kind in (FaultKind.DIE, FaultKind.NPU, FaultKind.HBM) or (
        fault.kind is FaultKind.LINK and fault.on_device
    )
    if fault.kind is FaultKind.NODE:
        # only what its pods on that server hold: those elsewhere come back where they ran
        return sum(topology.members[n].on_node(fault.node) for n in faulty)
    if device:
        return _npus(topology, faulty)
    return 0


def _spans_servers(topology: Topology, names: tuple[str, ...]) -> bool:
    return any(topology.members[n].pod_nodes for n in names)


def _pods(topology: Topology, names: tuple[str, ...]) -> int:
    return sum(topology.members[n].pods for n in names)


def _npus(topology: Topology, names: tuple[str, ...]) -> int:
    return sum(topology.members[n].npus for n in names)


def _cold(est: Estimates, delete: bool = True, loaders: int = 1) -> dict[str, float]:
    """A new engine process per instance: ``loaders`` of them load at once (from the shared
    file service they share its bucket: ``sharedLoad``)."""
    terms = {"podDelete": est.pod_delete} if delete else {}
    terms |= {"podStart": est.pod_start, "engineReady": est.engine_ready}
    if loaders > 1 and est.shared_load > 0:
        terms["sharedLoad"] = est.shared_load * (loaders - 1)
    return terms


def options(
    fault: Fault, topology: Topology, policy: Policy, est: Estimates, now_out: set[str]
) -> list[Option]:
    """Every option for the fault, priced, each saying whether it is feasible and why.
    ``now_out``: the faulty instances this plan takes on (under the cap)."""
    faulty = tuple(sorted(now_out))
    lost_faulty = lost_fraction(topology, policy, set(faulty))
    everyone = tuple(sorted(topology.members))
    out: list[Option] = []

    transient = fault.kind in (FaultKind.STALE,)
    out.append(
        Option(
            ActionKind.MASK_AND_RETRY,
            (),
            {"retryWindow": est.retry_window},
            lost_faulty,
            0.0 if transient else lost_faulty,
            feasible=True,
            why=(
                "a refresh that was late may come"
                if transient
                else "the fault does not clear by itself: its capacity stays out until repaired"
            ),
            horizon=0.0 if transient else est.horizon,
        )
    )

    link_soft = fault.kind is FaultKind.LINK and not fault.on_device
    out.append(
        Option(
            ActionKind.RELINK,
            (),
            {"relink": est.relink},
            lost_faulty,
            0.0,
            feasible=link_soft,
            why=(
                "the sub-link's ports are up: verifying it again may restore it"
                if link_soft
                else "only for a link fault whose ports are up"
                if fault.kind is not FaultKind.LINK
                else "the device status says the port is down: relinking over it fails"
            ),
        )
    )

    restarts = max((topology.members[n].restarts for n in faulty), default=0)
    in_place = fault.kind is FaultKind.KILL and restarts < CRASH_LOOP_RESTARTS
    out.append(
        Option(
            ActionKind.RESTART_IN_PLACE,
            faulty,
            {"restartBackoff": est.restart_backoff} | _cold(est, delete=False, loaders=len(faulty)),
            lost_faulty,
            0.0,
            feasible=in_place,
            why=(
                "the kubelet restarts the exited container on its NPUs; it rejoins the map"
                if in_place
                else f"crash-looping ({restarts} restarts): replaced instead"
                if fault.kind is FaultKind.KILL
                else "only for an engine process that exited (the kubelet restarts it)"
            ),
            pods_restarted=len(fault.pods) or _pods(topology, faulty),
        )
    )

    need = _npus(topology, faulty)
    held = withheld(fault, topology, faulty)
    # The faulty pods' NPUs return to the pool once they go, except those the fault withholds.
    fits_group = topology.free_npus is None or topology.free_npus >= held
    # A server down under some of an instance's pods: the others' NPUs come back where they
    # ran, for its new pods too (the down server takes none).
    back = faulty if fault.kind is FaultKind.NODE and _spans_servers(topology, faulty) else ()
    fits = held == 0 or Room(topology, set(faulty)).fits(faulty, back)
    warm = _warm(topology, est, faulty)
    if warm is not None:  # a warm pod holds its own NPUs: no free ones needed
        out.append(
            Option(
                ActionKind.REPLACE,
                faulty,
                {"podDelete": est.pod_delete, "warmReady": warm},
                lost_faulty,
                0.0,
                feasible=True,
                why="a warm pod claimed per faulty instance (past TE-Pre-Load, its weights by "
                "the fastest warm path: a fork from a live member, DRAM, SSD) and linked in by "
                "dynamic RoCE construction; nobody else restarts",
                pods_restarted=_pods(topology, faulty),
            )
        )
    else:
        out.append(
            Option(
                ActionKind.REPLACE,
                faulty,
                _cold(est, loaders=len(faulty)),
                lost_faulty,
                0.0,
                feasible=fits,
                why=(
                    f"one new pod per faulty instance ({need} NPUs) linked in by dynamic RoCE "
                    "construction; nobody else restarts"
                    if fits
                    else f"{need} NPUs needed, {need - held} come back where the faulty pods "
                    f"ran, {topology.free_npus} free elsewhere"
                    + Room(topology, set(faulty)).shortfall(faulty)
                ),
                pods_restarted=_pods(topology, faulty),
            )
        )

    out.append(_shrink(fault, topology, policy, est, faulty, fits))

    out.append(
        Option(
            ActionKind.RESTART_GROUP,
            everyone,
            _cold(est, loaders=len(everyone)),
            1.0,
            0.0,
            feasible=fits_group,
            why=(
                "every pod recreated (LWS RecreateGroupOnPodRestart, RBG, Grove)"
                if fits_group
                else f"the fault withholds {held} NPUs and {topology.free_npus} are free: "
                "the group would not fit again"
            ),
            pods_restarted=_pods(topology, everyone),
        )
    )
    return out


def _warm(topology: Topology, est: Estimates, faulty: tuple[str, ...]) -> float | None:
    """The warm replacement's seconds from the claim to serving, if there is a warm pod for
    every faulty instance; None otherwise (a cold replacement)."""
    if not faulty:
        return None
    need: dict[Tag, int] = {}
    for name in faulty:
        tag = topology.members[name].tag
        need[tag] = need.get(tag, 0) + 1
    if any(est.warm_pods.get(r, 0) < n or r not in est.warm_ready for r, n in need.items()):
        return None
    if est.warm_total is not None and est.warm_total < len(faulty):  # one pod fits both tags
        return None
    return max(est.warm_ready[r] for r in need)


def _shrink(
    fault: Fault,
    topology: Topology,
    policy: Policy,
    est: Estimates,
    faulty: tuple[str, ...],
    fits: bool,
) -> Option:
    """Give up prefills so their NPUs restore the protected decode(s): a faulty prefill first
    (not replaced: its NPUs are gone with its server), then healthy ones from the last, as few
    as cover the decodes' NPUs, never the last prefill. Only a prefill whose NPUs the decode's
    new pod could use counts: on a server that takes a decode (Ready, not cordoned,
    no taint the decode does not tolerate, of its NPU type) in the decodes' SuperPod; giving up
    any other would cost its capacity and restore nothing."""
    decodes = tuple(n for n in faulty if topology.members[n].tag == zl.Role.DECODE)
    faulty_prefills = tuple(n for n in faulty if n not in decodes)
    healthy = sorted(
        (n for n, m in topology.members.items() if m.tag == zl.Role.PREFILL and n not in faulty),
        key=_ordinal,
    )
    need = withheld(fault, topology, decodes)
    room = Room(topology, set(faulty))
    useful = [n for n in healthy if not room.why_not(zl.Role.DECODE, n)]
    given: list[str] = []
    if need:  # from the last, one prefill always kept; then those not needed, earliest first
        for name in reversed(useful):
            if room.fits(decodes, given) or len(given) + 1 >= len(healthy):
                break
            given.append(name)
        for name in sorted(given, key=_ordinal):
            if room.fits(decodes, [g for g in given if g != name]):
                given.remove(name)
    given.sort(key=_ordinal)
    freed = _npus(topology, tuple(given))
    why = ""
    if policy.weight(zl.Role.DECODE) <= policy.weight(zl.Role.PREFILL):
        why = "decode is not the protected role"
    elif not decodes:
        why = "no decode is faulty"
    elif fits:
        why = "the NPUs to replace the decode are free: nothing needs giving up"
    elif len(healthy) < 2:
        why = "the group would keep no prefill"
    elif not room.fits(decodes, given):
        unusable = [f"{n}'s: {room.why_not(zl.Role.DECODE, n)}" for n in healthy if n not in useful]
        why = (
            f"giving up {', '.join(given) or 'no prefill'} frees {freed} NPUs; "
            f"{need - (topology.free_npus or 0)} are needed"
            + room.shortfall(decodes, given)
            + (f" (the decode cannot use {'; '.join(unusable)})" if unusable else "")
        )
    sacrificed = (*faulty_prefills, *given)
    return Option(
        ActionKind.SHRINK,
        tuple(sorted((*faulty, *given))),
        {"podDelete": est.pod_delete, **_cold(est, loaders=len(decodes))},
        lost_fraction(topology, policy, {*faulty, *given}),
        lost_fraction(topology, policy, set(sacrificed)),
        feasible=not why,
        why=why or f"gives up prefill {', '.join(sacrificed)} to restore the protected decode",
        pods_restarted=_pods(topology, decodes) + _pods(topology, sacrificed),
        sacrificed=tuple(sorted(sacrificed)),
        horizon=est.horizon,
    )


def _pod_sizes(member: Member) -> list[int]:
    """The NPUs each of the member's pods asks for: ``npus`` split over its pods, so they add
    up to all of them (an uneven split's remainder on the first pods; rounding every pod down
    would let a replacement fit in fewer NPUs than :func:`withheld` says it must find)."""
    pods = max(1, member.pods)
    each, rest = divmod(member.npus, pods)
    return [each + 1] * rest + [each] * (pods - rest)


class Room:
    """Where the new pods of a plan would go: each instance's pods (``npus / pods``
    NPUs each, :func:`_pod_sizes`) placed whole on one server that takes its tag, within the
    SuperPod of its tag's instances that stay when the tag keeps one, onto the NPUs free
    there now plus those the instances given up free where they ran (``out``: the instances
    whose pods go). Without servers (not known) every NPU is one pool: the free ones and all
    those given up.

    The placement is best-fit decreasing (the largest pod first, each onto the fullest server
    that still takes it): not an exact bin packing, so it may miss a placement on fragmented
    servers (the option is then not taken; the scheduler would have decided), never count one
    that does not exist."""

    POOL = ""  # the one server standing for all, when the servers are not known

    def __init__(self, topology: Topology, out: set[str]) -> None:
        self.topology = topology
        self.out = out
        if topology.servers is None:
            free = topology.free_npus
            self.servers: Mapping[str, Server] = {
                self.POOL: Server(self.POOL, sys.maxsize if free is None else free)
            }
        else:
            self.servers = topology.servers

    def _server(self, member: Member) -> str | None:
        return self.POOL if self.topology.servers is None else member.node

    def _home(self, tag: Tag) -> set[str]:
        """The SuperPods a new instance of ``tag`` must join: those of the instances that
        stay (empty: any, one for all of them; and without servers, where nothing is known)."""
        if tag not in self.topology.same_superpod or self.topology.servers is None:
            return set()
        return {
            m.superpod
            for n, m in self.topology.members.items()
            if m.tag == tag and n not in self.out and m.superpod is not None
        }

    def why_not(self, tag: Tag, given: str) -> str:
        """Why the NPUs ``given`` frees cannot serve a new pod of ``tag`` (empty: they can)."""
        member = self.topology.members[given]
        where = self._server(member)
        server = self.servers.get(where) if where is not None else None
        if server is None:
            return f"its server {where or '?'} is not known"
        if server.refuses.get(tag):
            return server.refuses[tag]
        home = self._home(tag)
        if home and server.superpod not in home:
            return (
                f"{server.name} is in SuperPod {server.superpod}, not in "
                f"{', '.join(sorted(home))} where the others of its role stay"
            )
        return ""

    def _capacity(self, given: Sequence[str]) -> dict[str, int]:
        capacity = {name: s.free for name, s in self.servers.items()}
        for name in given:
            member = self.topology.members[name]
            returned: list[tuple[int, str | None]] = [(member.npus, self._server(member))]
            if self.topology.servers is not None and member.pod_nodes:
                # each pod's NPUs come back on its own server
                returned = list(zip(_pod_sizes(member), member.pod_nodes, strict=False))
            for size, where in returned:
                if where in capacity and capacity[where] < sys.maxsize:
                    capacity[where] += size
        return capacity

    def _candidates(self, tag: Tag, superpod: str | None) -> list[str]:
        home = self._home(tag)
        return [
            name
            for name, s in self.servers.items()
            if not s.refuses.get(tag)
            and (not home or s.superpod in home)
            and (superpod is None or s.superpod == superpod)
        ]

    def fits(self, instances: Sequence[str], given: Sequence[str] = ()) -> bool:
        """Whether new pods for ``instances`` find room once ``given`` are given up. An
        instance of several pods is placed whole by :func:`matrixserve.domain.placement.place`
        (one server per pod, all in one SuperPod: what gang placement will do); each other
        pod best-fit."""
        pods = [
            (m.tag, size)
            for m in (self.topology.members[n] for n in instances)
            for size in _pod_sizes(m)
        ]
        members = [self.topology.members[n] for n in instances]
        whole = {
            m.name
            for m in members
            if m.pods > 1 and min(_pod_sizes(m)) >= 1 and self.topology.servers is not None
        }
        if whole:
            gangs = [(m.name, m.tag, tuple(_pod_sizes(m))) for m in members if m.name in whole]
            singles = [
                (m.tag, size) for m in members if m.name not in whole for size in _pod_sizes(m)
            ]
            return self._place_gangs(gangs, singles, self._capacity(given))
        together = sorted(
            {r for r, _ in pods if r in self.topology.same_superpod and not self._home(r)}
        )
        # A tag that keeps one SuperPod and has no instance left to join: all of its new pods
        # in one SuperPod, whichever (the first placed decides).
        superpods = sorted({s.superpod for s in self.servers.values() if s.superpod is not None})
        choices: list[list[str | None]] = [[*superpods] or [None] for _ in together]
        for picked in itertools.product(*choices):
            superpod = dict(zip(together, picked, strict=True))
            if self._place(pods, self._capacity(given), superpod):
                return True
        return False

    def _place(
        self,
        pods: list[tuple[Tag, int]],
        capacity: dict[str, int],
        superpod: Mapping[Tag, str | None],
    ) -> bool:
        for tag, size in sorted(pods, key=lambda p: -p[1]):
            fitting = [
                name for name in self._candidates(tag, superpod.get(tag)) if capacity[name] >= size
            ]
            if not fitting:
                return False
            best = min(fitting, key=lambda name: (capacity[name], name))
            capacity[best] -= size
        return True

    def _place_gangs(
        self,
        gangs: list[tuple[str, Tag, tuple[int, ...]]],
        singles: list[tuple[Tag, int]],
        capacity: dict[str, int],
    ) -> bool:
        """The multi-pod instances first (largest first), each whole in one SuperPod (its
        tag's, when the tag keeps one), then the single pods on what is left."""
        for name, tag, sizes in sorted(gangs, key=lambda g: (-sum(g[2]), g[0])):
            allowed = set(self._candidates(tag, None))
            home = self._home(tag)
            servers = [
                placement.Server(n, s.superpod, capacity[n] if n in allowed else 0)
                for n, s in sorted(self.servers.items())
            ]
            request = placement.Request(name, sizes, superpod=min(home) if home else None)
            placed, _ = placement.place([request], servers)
            if not placed:
                return False
            for server, size in zip(placed[0].servers, sizes, strict=True):
                capacity[server] -= size
        return self._place(singles, capacity, {})

    def usable(self, instances: Sequence[str], given: Sequence[str] = ()) -> int:
        """The NPUs free (with ``given`` given up) where a new pod of the instances' tags may
        go."""
        tags = {self.topology.members[n].tag for n in instances}
        capacity = self._capacity(given)
        names = {name for tag in tags for name in self._candidates(tag, None)}
        return sum(capacity[name] for name in names if capacity[name] < sys.maxsize)

    def shortfall(self, instances: Sequence[str], given: Sequence[str] = ()) -> str:
        """What a plan that does not fit finds where its new pods may go (empty without
        servers: the count says it)."""
        if self.topology.servers is None:
            return ""
        sizes = sorted({size for n in instances for size in _pod_sizes(self.topology.members[n])})
        return (
            f"; {self.usable(instances, given)} free where the new pods may go, not enough "
            f"for pods of {' and '.join(map(str, sizes))} NPUs each"
        )


def _ordinal(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (-1, name)


# --------------------------------------------------------------------------- choosing
def choose(
    fault: Fault,
    topology: Topology,
    policy: Policy,
    est: Estimates,
    *,
    connected: bool,
    in_recovery: int = 0,
) -> Plan:
    """The plan for one fault. ``in_recovery``: instances other recoveries hold out now."""
    if not connected:
        return Plan(fault, None, why="ZooKeeper is not connected: nothing destructive is planned")
    members = [n for n in fault.instances if n in topology.members]
    room = max(0, concurrency_cap(len(topology.members)) - in_recovery)
    taken = set(sorted(members, key=lambda n: _priority(topology, policy, n))[:room])
    deferred = tuple(sorted(set(members) - taken))
    if not taken:
        return Plan(
            fault,
            None,
            deferred=deferred,
            why=f"{in_recovery} instance(s) already in recovery (the cap is "
            f"{concurrency_cap(len(topology.members))}): masked, waiting their turn",
        )
    considered = options(fault, topology, policy, est, taken)
    if policy.policy is RecoveryPolicy.RESTART_GROUP:
        # The anchors' rule, but never a restart the group would not fit back from: then the
        # faulty instances stay masked (nothing destructive that cannot complete).
        want = ActionKind.RESTART_GROUP
        if not next(o for o in considered if o.action is want).feasible:
            want = ActionKind.MASK_AND_RETRY
        pick = next(o for o in considered if o.action is want)
    else:
        feasible = [o for o in considered if o.feasible]
        pick = min(feasible, key=lambda o: (round(o.cost, 6), o.pods_restarted, o.restore_s))
    alternatives = tuple(o for o in considered if o is not pick)
    return Plan(fault, pick, alternatives, deferred)


def _priority(topology: Topology, policy: Policy, name: str) -> tuple[float, str]:
    """Which faulty instance is taken first under the cap: the protected tag's."""
    return (-policy.weight(topology.members[name].tag), name)


def with_restore(option: Option, **terms: float) -> Option:
    """The option with some restore terms replaced (a caller that measured them)."""
    return replace(option, terms=dict(option.terms) | terms)
