"""Planning an ExpertPool (pure; EaaS §3.1, §3.4, §4.4, §5.3, §5.4).

The pool's servers are pods; the map of which server holds which experts lives in ZooKeeper as
immutable versions behind a pointer (:mod:`.expertmap`). Each pass, in this order, at most one
new map version (the loop passes again at once after a change):

1. **failover** (§3.4): a server of the map in force whose report is gone (its session ended:
   the monitor's offline event), whose pod is gone, or whose engine restarted (another
   incarnation: its slots are lost) or whose engine exited (its pod's container restarted:
   the kubelet says so first) is dropped at once in a new version. Clients have dropped it
   already and re-sent to a replica; the version only makes it official, and a change in flight
   is cut short safely (:func:`.rebalance.preempt`). An exited engine's
   pod restarts it in place unless recovery prices a replacement cheaper (a warm pod's claim
   against the kubelet's back-off and a cold start: :func:`.warm.replacements`). Recorded in
   ``lastFailover``, with the seconds until coverage is restored;
2. **pods**: a pod that ended is deleted; missing servers are obtained, each by the fastest
   path (a cold pod, or a warm pod claimed: :mod:`.warm`; all at once for a new pool, then one
   at a time: a server is added to the map when it serves); a claimed pod that does not
   become a server is released; pods beyond the count that are in no map are deleted at once
   (they serve nothing);
3. **drains finished**: a server taken out of the map by a scale-down is deleted once its report
   says ``Draining`` with nothing in flight, or is gone, or :data:`DRAIN_BOUND_SECONDS` passed;
4. **the map**, every change walked through the same phases (:mod:`.rebalance`: Prefetch,
   Disable, Load, Enable, Steady, those that do something; written ahead, each server's rows
   stamped (:func:`.expertmap.stamped`), the pointer moved on once every server applied the
   version in force): the first map, over the servers once all the spec's are serving;
   otherwise the servers that serve and are in no map added (a replacement, a scale-up) and
   every expert brought back to ``minReplicasPerExpert`` copies on distinct servers (waiting
   for a replacement coming rather than crowding the survivors); or, with more servers in the
   map than the spec's, one drained: it keeps its slots enabled until its experts' new copies
   are (coverage never drops; fine-grained scaling, §1, §2.4: one server at a time); or, at a
   token sample every ``rebalance.intervalSeconds``, EPLB (xDeepServe §4.5) replicating the
   hot experts;
5. **autoscaler** (:mod:`.autoscale`): once settled, one step of ``servers.replicas`` towards
   the servers' token rate over the target, written to the object itself;
6. **status**: the map's version and servers, coverage, the conditions ``Available`` (every
   expert has a live copy in every layer), ``FullyReplicated`` (every one has
   ``minReplicasPerExpert``), ``Rebalancing`` (a phase in force, or a drain) and
   ``Degraded`` (a failover not restored yet, or experts short of copies in a steady map).

An expert's last copy goes only by failure: a spec below the coverage bound is refused
(:mod:`.validation`) and never planned.

The pointer carries the spec's ``failoverTimeoutMilliseconds`` to the clients (§3.4: how long
one waits for a server before re-sending to a replica): every pointer written has it, and a
pointer in force with another value is rewritten alone, naming the same version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.status import (
    ExpertCoverageStatus,
    ExpertFailoverStatus,
    ExpertPoolStatus,
    ExpertScaleStatus,
)
from matrixserve.domain import warmclaim
from matrixserve.domain.conditions import Condition
from matrixserve.domain.effects import Event, ObjectPatch, PodCreation, PodDeletion, ZnodeChange
from matrixserve.domain.expertpool import autoscale, obtain, rebalance, validation, warm
from matrixserve.domain.expertpool import expertmap as em
from matrixserve.domain.expertpool.pods import (
    ANNOTATION_OBTAINED,
    free_names,
    pod_manifest,
    selector,
)
from matrixserve.domain.expertpool.view import ENDED, PoolView

AVAILABLE = "Available"
FULLY_REPLICATED = "FullyReplicated"
REBALANCING = "Rebalancing"
DEGRADED = "Degraded"
READY = "Ready"
DRAIN_BOUND_SECONDS = 60.0  # [design] a drained server still reporting work after this goes
SETTLING_RECHECK_SECONDS = 1.0  # reports' state changes rewrite a znode no watch follows


# --------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class CreateServerPod(PodCreation):
    name: str
    why: str
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    path: str = ""  # how it is obtained (a scaleout.Path) and the estimate, wall s to serving
    estimate_seconds: float | None = None

    def describe(self) -> Event:
        return Event("CreatedServer", f"Created expert server pod {self.name}: {self.why}")


@dataclass(frozen=True)
class DeleteServerPod(PodDeletion):
    name: str
    uid: str
    reason: str
    resource_version: str | None = None
    force: bool = False

    def describe(self) -> Event:
        return Event("DeletedServer", f"Deleted expert server pod {self.name}: {self.reason}")


@dataclass(frozen=True)
class WriteMapVersion(ZnodeChange[zl.ExpertPoolPaths]):
    """Write version ``map`` whole (its layers, then its table) and the rest of its walk,
    ``ahead``, put ``map`` in force (the pointer), then delete the versions in ``prune``.
    ``stored``: ``map``'s layers are stored already (the walk's next phase, written ahead):
    its head alone is rewritten (stamped now). Idempotent: a version rewritten with the same
    bytes is the same version."""

    map: em.ExpertMap
    prune: tuple[int, ...] = ()
    event: str = "ExpertMapVersion"
    warning: bool = False
    ahead: tuple[em.ExpertMap, ...] = ()
    detail: str = ""
    failover_ms: int | None = None  # the spec's, carried by the pointer to the clients
    stored: bool = False

    def znodes(self, paths: zl.ExpertPoolPaths) -> list[zl.ZnodeOp]:
        ops: list[zl.ZnodeOp] = []
        for m in (*self.ahead, self.map):
            head, layers = m.payloads()
            if not (self.stored and m is self.map):
                ops += [
                    zl.Put(paths.layer(m.version, layer.layer), layer.dump(), new=True)
                    for layer in layers
                ]
            # set first: the layers' znodes made it (empty: not there yet to a reader)
            ops.append(zl.Put(paths.version(m.version), head.dump()))
        return [
            *ops,
            zl.Put(paths.map, pointer_bytes(self.map.version, self.map.at, self.failover_ms)),
            *(zl.Delete(paths.version(old), recursive=True) for old in self.prune),
        ]

    def describe(self) -> Event:
        m = self.map
        walk = (
            f"; then {', '.join(f'v{a.version} {a.phase}' for a in self.ahead)}"
            if self.ahead
            else ""
        )
        return Event(
            self.event,
            f"Expert map v{m.version} ({m.phase}, {len(m.servers)} servers): {m.reason}{walk}"
            + (f"; {self.detail}" if self.detail else ""),
            warning=self.warning,
        )


@dataclass(frozen=True)
class ScaleServers(ObjectPatch):
    """The autoscaler's step: ``spec.servers.replicas`` of the pool itself, while it is at the
    resourceVersion seen (a change meanwhile wins; the next pass decides again)."""

    kind: kinds.Kind
    name: str
    patch: Mapping[str, Any]
    resource_version: str | None
    why: str = ""

    def describe(self) -> Event:
        to = self.patch["spec"]["servers"]["replicas"]
        return Event("Autoscaled", f"Servers set to {to}: {self.why}")


def pointer_bytes(version: int, at: float, failover_ms: int | None) -> bytes:
    return zl.ExpertMapPointer(version=version, at=at, failoverMs=failover_ms).dump()


@dataclass(frozen=True)
class WritePointer(ZnodeChange[zl.ExpertPoolPaths]):
    """The pointer rewritten alone, naming the same version, with the spec's failover timeout
    (the spec changed, or the pointer was written before it carried one): clients follow it
    from their next message on (EaaS §3.4), no map version needed. Idempotent."""

    version: int
    at: float
    failover_ms: int
    was: int | None = None

    def znodes(self, paths: zl.ExpertPoolPaths) -> list[zl.ZnodeOp]:
        return [zl.Put(paths.map, pointer_bytes(self.version, self.at, self.failover_ms))]

    def describe(self) -> Event:
        was = f"{self.was} ms" if self.was is not None else "the clients' own"
        return Event(
            "FailoverTimeout",
            f"Failover timeout {self.failover_ms} ms (was {was}) put in the map pointer "
            f"(v{self.version}) for the clients",
        )


Action = (
    CreateServerPod
    | DeleteServerPod
    | WriteMapVersion
    | WritePointer
    | ScaleServers
    | warm.ClaimWarmServer
    | warm.AssignWarmServer
    | warm.ForgetAssignment
)
Obtained = CreateServerPod | warm.ClaimWarmServer  # a new server: a cold pod or a warm one


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    status: ExpertPoolStatus
    conditions: list[Condition]
    recheck_after: float | None = None

    def stored_status(self) -> dict[str, Any]:
        return self.status.model_copy(update={"conditions": None}).dump()


# --------------------------------------------------------------------------- the plan
def plan(view: PoolView) -> Plan:
    if not view.connected:
        return unreachable(view)
    spec = view.spec
    live = view.live()
    version = view.next_version()
    failover = view.previous.last_failover
    draining = [s for s in view.previous.draining if s in view.pods]
    actions: list[Action] = []

    after, walk, failed = failover_stage(view, live, version)
    replaced, recovery = warm.replacements(
        view, [s for s in failed if view.exited(s) and not view.restarted(s)]
    )
    if failed:
        failover = ExpertFailoverStatus(
            servers=failed,
            at=view.now,
            version=version,
            recovery=recovery.as_status() if recovery else None,
        )
    in_map = set(after.servers) if after else set()
    pod_actions, candidates, pending = pod_stage(view, in_map, draining, replaced)
    actions += pod_actions
    actions += warm.assignments(view)
    created = [a for a in pod_actions if isinstance(a, Obtained)]
    if failover is not None and failover.restored_version is None and created:
        failover = failover.model_copy(
            update={
                "replacement": created[0].name,
                "replacement_path": created[0].path,
                "replacement_estimate_seconds": created[0].estimate_seconds,
            }
        )
    drained, draining = drain_stage(view, after, draining)
    actions += drained
    if not walk:
        walk, draining = map_stage(view, after, candidates, pending, draining, version)
    cov = em.coverage(
        after, live, spec.model.experts, spec.model.layers, spec.min_replicas_per_expert
    )
    decision = None
    event: tuple[str, bool, str] = (
        ("ServerFailed", True, "") if failed else ("ExpertMapVersion", False, "")
    )
    if not walk and after is not None and after.steady and not draining and not pending:
        decision = rebalance.decide(view, after, version) if not cov.under_replicated else None
        if decision is not None and decision.record is not None:
            walk = decision.walk
            r = decision.record
            event = (
                "Rebalance",
                False,
                f"imbalance {r.imbalance_before:.2f} -> {r.imbalance_after:.2f}, simulated MoE "
                f"time {r.moe_time_before:.0f} -> {r.moe_time_after:.0f} tokens per iteration",
            )
    if walk:
        walk = em.stamped(view.current, walk)
        first, ahead = walk[0], walk[1:]
        ms = spec.failover_timeout_milliseconds
        # a version number stored already is the walk's next phase, written ahead (numbers
        # are never reused: :meth:`PoolView.next_version` is past every stored one)
        stored = first.version in view.versions
        actions.append(
            WriteMapVersion(
                first, prune(view, first), event[0], event[1], ahead, event[2], ms, stored
            )
        )
        after = first
        cov = em.coverage(
            after, live, spec.model.experts, spec.model.layers, spec.min_replicas_per_expert
        )
    elif (rewrite := pointer_stage(view)) is not None:
        actions.append(rewrite)
    if (
        failover is not None
        and failover.restored_version is None
        and after is not None
        and after.steady
        and cov.under_replicated == 0
    ):
        failover = failover.model_copy(
            update={
                "restored_version": after.version,
                "restored_at": view.now,
                "restored_seconds": round(view.now - failover.at, 3),
            }
        )
    settled = after is not None and after.steady and not draining and not pending
    status = pool_status(view, after, live, cov, failover, draining)
    status = rebalance.status(status, after, decision, view.now)
    scale = autoscale_stage(view, status, settled)
    if scale is not None:
        actions.append(scale)
    busy = (
        not settled or bool(walk) or any(isinstance(a, Obtained | DeleteServerPod) for a in actions)
    )
    # the token samples (the autoscaler's and EPLB's window) are taken on passes this far apart
    recheck = min(
        SETTLING_RECHECK_SECONDS if busy else autoscale.SAMPLE_SECONDS, autoscale.SAMPLE_SECONDS
    )
    why = decision.problem if decision is not None else ""
    return Plan(actions, status, conditions(view, after, cov, failover, draining, why), recheck)


def failover_stage(
    view: PoolView, live: set[str], version: int
) -> tuple[em.ExpertMap | None, tuple[em.ExpertMap, ...], list[str]]:
    """The map after dropping the servers of the one in force that are gone (or restarted):
    (the map, the new version if any, the servers dropped)."""
    current = view.current
    if current is None:
        return None, (), []
    failed = []
    for server in current.servers:
        report = view.report(server) if server in live else None
        if report is None or view.restarted(server) or view.exited(server):
            failed.append(server)
    if not failed:
        return current, (), []
    why = "failover: " + ", ".join(
        f"{s} {'restarted' if view.restarted(s) else 'exited' if view.exited(s) else 'gone'}"
        for s in failed
    )
    dropped = rebalance.preempt(current, failed, version, why, view.now)
    return dropped, (dropped,), failed


def pointer_stage(view: PoolView) -> WritePointer | None:
    """The pointer in force rewritten when the failover timeout it carries is not the spec's."""
    now, want = view.pointer, view.spec.failover_timeout_milliseconds
    if now is None or view.current is None or now.version != view.current.version:
        return None
    if now.failover_ms == want:
        return None
    return WritePointer(now.version, now.at, want, now.failover_ms)


def pod_stage(
    view: PoolView, in_map: set[str], draining: list[str], replaced: Sequence[str] = ()
) -> tuple[list[Action], list[str], list[str]]:
    """Pods that ended deleted, missing ones obtained (cold, or a warm pod claimed), extra ones
    (in no map) deleted; a failed server recovery replaces rather than restarts in place, and a
    claimed pod that did not become a server, deleted; and the spare servers: (actions, serving
    ones not in the map, ones not serving yet)."""
    actions: list[Action] = []
    alive = {}
    instead = "its engine exited: replaced rather than restarted in place (recovery's choice)"
    released = warm.releases(view) | dict.fromkeys(replaced, instead)
    for name, pod in sorted(view.pods.items()):
        if pod.deleting:
            continue
        if name in released:
            actions.append(DeleteServerPod(name, pod.uid, released[name]))
            if name not in replaced:
                actions.append(warm.ForgetAssignment(view.namespace, name))
            continue
        if pod.phase in ENDED:
            actions.append(DeleteServerPod(name, pod.uid, f"it ended ({pod.phase})"))
            continue
        alive[name] = pod
    spare = [n for n in alive if n not in in_map and n not in draining]
    candidates = [n for n in spare if candidate(view, n)]
    pending = [n for n in spare if n not in candidates]
    desired = view.spec.servers.replicas
    missing = desired - len(in_map - set(draining)) - len(spare)
    if missing > 0 and (view.current is None or not pending):
        count = missing if view.current is None else 1
        taken = set(view.pods) | set(view.taken)
        why = "a new pool" if view.current is None else f"{desired} servers wanted"
        names = free_names(view.name, taken, count)
        # a server without a choice has no path allowed (--scale-out-paths): it waits
        for choice in obtain.paths(view.spec, view.engine, names, warm.candidates(view)):
            if choice.warm_pod is not None:
                claim = warm.claim(view, choice, why)
                actions.append(claim)
                pending.append(claim.name)
                continue
            name = choice.instance
            how = warmclaim.record(choice, name, obtain.ROLE, view.now)
            manifest = pod_manifest(
                view.namespace,
                view.name,
                view.uid,
                name,
                view.spec,
                view.engine,
                {ANNOTATION_OBTAINED: how.dump()},
            )
            priced = f"{why}; {how.path}, est. {how.estimate_seconds:.1f} s to serve"
            actions.append(CreateServerPod(name, priced, manifest, how.path, how.estimate_seconds))
            pending.append(name)
    elif missing < 0:
        extra = sorted(pending, reverse=True) + sorted(candidates, reverse=True)
        for name in extra[:-missing]:
            pod = alive[name]
            actions.append(DeleteServerPod(name, pod.uid, f"{desired} servers wanted"))
            if name in pending:
                pending.remove(name)
            else:
                candidates.remove(name)
    return actions, candidates, pending


def candidate(view: PoolView, server: str) -> bool:
    """A server in no map (and not being drained) that may join one: it reports, and not as the
    engine it was failed over for (one that exited: its report outlives it until its session
    ends). Whatever its state: a new server says ``Loading`` until a table names it, one failed
    over after a restart says ``Draining`` (it was in a table), and either loads what the next
    version gives it."""
    report = view.report(server)
    return report is not None and view.previous.members.get(server) != report.incarnation


def drain_stage(
    view: PoolView, after: em.ExpertMap | None, draining: list[str]
) -> tuple[list[Action], list[str]]:
    """The drained servers deleted once done; those still draining."""
    actions: list[Action] = []
    left = []
    for server in draining:
        pod = view.pods.get(server)
        if pod is None:
            continue  # gone: drained
        left.append(server)
        if (after is not None and server in after.servers) or pod.deleting:
            continue
        report = view.report(server)
        overdue = after is not None and view.now - after.at >= DRAIN_BOUND_SECONDS
        if (
            report is None
            or overdue
            or (report.state is zl.ExpertServerState.DRAINING and report.in_flight == 0)
        ):
            done = "drained" if not overdue else f"still busy {DRAIN_BOUND_SECONDS:.0f} s after"
            actions.append(DeleteServerPod(server, pod.uid, f"{done}, out of the map"))
    return actions, left


def map_stage(
    view: PoolView,
    after: em.ExpertMap | None,
    candidates: list[str],
    pending: list[str],
    draining: list[str],
    version: int,
) -> tuple[tuple[em.ExpertMap, ...], list[str]]:
    """At most one new walk or step of one (see the module's docstring, step 4); the servers
    draining."""
    spec = view.spec
    desired = spec.servers.replicas

    def towards(servers: list[str], why: str) -> tuple[em.ExpertMap, ...]:
        target = em.wanted(
            after,
            servers,
            spec.model.experts,
            spec.model.layers,
            spec.servers.slots_per_server,
            spec.min_replicas_per_expert,
            spec.redundant_expert_budget,
        )
        try:
            return rebalance.change(after, target, version, why, view.now)
        except ValueError:  # an expert would lose its last enabled copy: a replacement first
            return ()

    if after is None:
        if len(candidates) < desired:
            return (), draining
        return towards(sorted(candidates)[:desired], "initial"), draining
    if not after.steady:
        step = rebalance.advance(view, after, version)
        return ((step,) if step is not None else ()), draining
    draining = [s for s in draining if s not in after.servers]  # a drain a failover cut short
    if draining:
        return (), draining
    room = desired - len(after.servers)
    add = sorted(candidates)[: max(0, room)]
    cov = em.coverage(
        after, view.live(), spec.model.experts, spec.model.layers, spec.min_replicas_per_expert
    )
    respec = view.previous.observed_generation != view.generation
    if add or (cov.under_replicated and not pending) or (respec and room >= 0):
        why = f"added {_names(add)}" if add else "copies restored"
        try:
            return towards([*after.servers, *add], why), draining
        except em.Unplaceable:
            return (), draining  # the survivors cannot hold them: a replacement is coming
    if room < 0:
        victim = max(after.servers, key=_ordinal)
        keep = [s for s in after.servers if s != victim]
        why = f"scale down to {desired}: draining {victim}"
        walk = towards(keep, why)
        return walk, [victim] if walk else draining
    return (), draining


def autoscale_stage(view: PoolView, status: ExpertPoolStatus, settled: bool) -> ScaleServers | None:
    spec = view.spec
    sample = status.token_sample
    if not settled or sample is None or sample.at != view.now:
        return None
    last = view.previous.last_scale.at if view.previous.last_scale else None
    bound = validation.coverage_bound(spec)
    want = autoscale.servers_wanted(spec, bound, sample, last, view.now)
    if want is None:
        return None
    return ScaleServers(
        kinds.EXPERTPOOL,
        view.name,
        {"spec": {"servers": {"replicas": want}}},
        view.resource_version or None,
        f"{sample.tokens_per_second or 0:.0f} tokens/s against "
        f"{spec.autoscaling.target_tokens_per_server_per_second} per server "
        f"(bounds {autoscale.bounds(spec, bound)})",
    )


# --------------------------------------------------------------------------- status
def pool_status(
    view: PoolView,
    after: em.ExpertMap | None,
    live: set[str],
    cov: em.Coverage,
    failover: ExpertFailoverStatus | None,
    draining: list[str],
) -> ExpertPoolStatus:
    spec, previous = view.spec, view.previous
    servers = list(after.servers) if after else []
    members = {
        s: (r.incarnation if (r := view.report(s)) else previous.members.get(s, ""))
        for s in servers
    }
    # a server failed over for an engine that exited keeps its entry while that engine's report
    # lingers (its session ends later): that report is no server to take back
    members |= {
        s: incarnation
        for s, incarnation in previous.members.items()
        if s not in members and (r := view.report(s)) is not None and r.incarnation == incarnation
    }
    restarts = {s: pod.restarts for s in servers if (pod := view.pods.get(s)) is not None}
    last_scale = previous.last_scale
    desired = spec.servers.replicas
    if previous.wanted_servers is not None and previous.wanted_servers != desired:
        by = "autoscaler" if spec.autoscaling.enabled else "spec"
        last_scale = ExpertScaleStatus.model_validate(
            {"from": previous.wanted_servers, "to": desired, "by": by, "at": view.now}
        )
    reports = {s: r for s in live if (r := view.report(s)) is not None}
    sample = autoscale.sample(previous.token_sample, reports, view.now)
    if sample.at == view.now:  # a new sample: the count it asks for, into the window
        goal = autoscale.goal(spec, validation.coverage_bound(spec), sample.tokens_per_second)
        if goal is not None:
            sample = autoscale.recorded(sample, goal)
        elif not spec.autoscaling.enabled:  # off: what it asked before is no longer a window
            sample = sample.model_copy(update={"goals": []})
    return ExpertPoolStatus(
        observedGeneration=view.generation,
        selector=selector(view.name),
        readyServers=len(set(servers) & live),
        servers=servers,
        mapVersion=after.version if after else 0,
        mapPhase=str(after.phase) if after else None,
        coverage=ExpertCoverageStatus(
            underReplicated=cov.under_replicated, uncovered=cov.uncovered
        ),
        coverageBound=validation.coverage_bound(spec),
        hotExperts=list(previous.hot_experts),
        draining=draining,
        members=members,
        memberRestarts=restarts,
        wantedServers=desired,
        lastRebalance=previous.last_rebalance,
        rebalanceCheckedAt=previous.rebalance_checked_at,
        lastFailover=failover,
        lastScale=last_scale,
        tokenSample=sample,
    )


def conditions(
    view: PoolView,
    after: em.ExpertMap | None,
    cov: em.Coverage,
    failover: ExpertFailoverStatus | None,
    draining: list[str],
    eplb_problem: str = "",
) -> list[Condition]:
    spec = view.spec
    experts, copies = spec.model.experts, spec.min_replicas_per_expert
    if after is None:
        serving = sum(1 for s in view.pods if candidate(view, s))
        why = f"no map yet: {serving} of {spec.servers.replicas} servers serving"
        available = Condition(AVAILABLE, False, "NoMap", why)
        full = Condition(FULLY_REPLICATED, False, "NoMap", why)
    else:
        available = (
            Condition(
                AVAILABLE,
                True,
                "Covered",
                f"every expert of {spec.model.layers} layers has a live copy (map "
                f"v{after.version}, {len(after.servers)} servers)",
            )
            if cov.uncovered == 0
            else Condition(
                AVAILABLE,
                False,
                "Uncovered",
                f"{cov.uncovered} of {experts} experts have no live copy in some layer: their "
                "tokens cannot be served until they are loaded",
            )
        )
        full = (
            Condition(
                FULLY_REPLICATED,
                True,
                "Replicated",
                f"every expert has at least {copies} copies on distinct live servers",
            )
            if cov.under_replicated == 0
            else Condition(
                FULLY_REPLICATED,
                False,
                "UnderReplicated",
                f"{cov.under_replicated} of {experts} experts have fewer than {copies} live "
                f"copies in some layer (fewest: {cov.min_copies})",
            )
        )
    if after is not None and not after.steady:
        loading = f"; {_names(after.loading())} loading new slots" if after.loading() else ""
        rebalancing = Condition(
            REBALANCING,
            True,
            str(after.phase),
            f"map v{after.version} in phase {after.phase}: {after.reason}{loading}",
        )
    elif draining:
        rebalancing = Condition(
            REBALANCING, True, "Draining", f"{_names(draining)} out of the map, finishing"
        )
    elif eplb_problem:
        rebalancing = Condition(
            REBALANCING, False, "WindowUnreadable", f"EPLB skipped a window: {eplb_problem}"
        )
    else:
        rebalancing = Condition(REBALANCING, False, "Steady", "no change of the map under way")
    # a walk's copies loading (a new pool's first map) are no failure: short only once steady
    open_failover = failover is not None and failover.restored_version is None
    if open_failover and failover is not None:
        degraded = Condition(
            DEGRADED,
            True,
            "FailedOver",
            f"{_names(failover.servers)} failed at map v{failover.version}; "
            f"{cov.under_replicated} experts short of {copies} copies until a replacement "
            "serves",
        )
    elif after is not None and after.steady and cov.under_replicated:
        degraded = Condition(
            DEGRADED,
            True,
            "UnderReplicated",
            f"{cov.under_replicated} experts short of {copies} copies in map v{after.version}",
        )
    else:
        degraded = Condition(DEGRADED, False, "Healthy", "no failure waiting to be restored")
    ready = Condition(READY, available.status, available.reason, available.message)
    return [available, full, rebalancing, degraded, ready]


def unreachable(view: PoolView) -> Plan:
    """ZooKeeper out of reach: nothing planned; the last status and conditions kept."""
    kept = [
        Condition(c.type, c.status == "True", c.reason or "", c.message or "")
        for c in view.previous.conditions or []
    ]
    why = "ZooKeeper is unreachable: the servers' reports and the map cannot be read"
    if not any(c.type == AVAILABLE for c in kept):
        kept.append(Condition(AVAILABLE, False, "ZooKeeperUnreachable", why))
    return Plan([], view.previous, kept)


# --------------------------------------------------------------------------- helpers
def prune(view: PoolView, new: em.ExpertMap) -> tuple[int, ...]:
    """Versions to delete once ``new`` is in force: all before it but the one before it (the
    rest of its walk, stored after it, stays; a walk a failover cut short goes)."""
    keep = {new.version, view.current.version if view.current else 0}
    return tuple(v for v in sorted(view.versions) if v not in keep and v < new.version)


def _ordinal(server: str) -> tuple[int, str]:
    """A server's index in its name (``pool-s12`` -> 12), for choosing the last one."""
    tail = server.rsplit("-s", 1)[-1]
    return (int(tail) if tail.isdigit() else -1, server)


def _names(servers: list[str]) -> str:
    if not servers:
        return "no server"
    return ", ".join(servers[:5]) + (f" and {len(servers) - 5} more" if len(servers) > 5 else "")
