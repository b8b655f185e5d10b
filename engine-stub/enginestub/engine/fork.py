"""NPU-fork (DeepServe §6.2, Figs. 8, 10, 11), both sides, and the load plan it belongs to.

"When NPU-fork is triggered, the master notifies a running FlowServe TE to connect to a
pre-warmed TE, with model weights transferred using the DistFlow module." Here the operator
never speaks HTTP to an engine: it names the source in the claimed warm pod's assignment
(:class:`matrixserve.api.zk_layout.ForkRef`), and the **target** asks the source, ``POST
/v1/fork`` with ``{"key", "target", "pod", "podUid", "plane", "dies", "node", "superpod"}``.

- **Source** (:class:`ForkServer`): serves only a target the operator sent to it: the
  assignment of the target's pod (``warm/<ns>/assignments/<pod>``, read in ZooKeeper by the
  source's own session, ``ns`` the source's group's namespace) must be of that pod's UID and
  name this source (its group and instance) as its fork, else 403 ``fork_not_assigned``. Then
  409 ``fork_mismatch`` to a key that is not its own (the model, its compiled artefacts'
  identity, :func:`fork_key`) or another die count, 409 ``plane_unreachable`` to UB from another
  SuperPod, 503 ``not_ready`` unless it is loaded and serving (not faulty, not removed, not
  closing), 409 ``fork_in_progress`` to a pod that already has a fork under way, 503
  ``fork_busy`` past :data:`~enginestub.calibration.FORK_FANOUT` targets at once; otherwise it broadcasts
  its weights and compiled artefacts and answers 200 ``{"seconds", "bytes", "plane",
  "position", "source"}`` when the emulated transfer ends (503 ``fork_aborted`` if it stops
  serving or shuts down first). It keeps serving meanwhile: the NPU's "dedicated AICPUs for data
  transfer" leave its compute alone, only its links are shared.
- **Timing** (:func:`enginestub.timing.fork_seconds`): each die sends what it holds (its
  weights and its compiled artefacts) over its own link; the targets of one source and plane
  share one pipelined chain broadcast (HCCL's ``broadcast``), whose rate is the chain's fair share
  of each source die's egress link beside the source's own KV transfers on that plane
  (:func:`enginestub.fabric.fair_rates`), re-shared whenever either changes; a target that joins a
  running chain joins its tail and takes the data from where the chain is, cycling (the source's
  links carry one copy however many targets), and the target at position j waits ``(j - 1)``
  hops more for the pipeline to fill. The KV pulls out of a source count the chain as one more
  flow on its plane (``forkFlows`` in the pull's metadata), so they slow down as the shared link
  says.
- **Target** (:class:`LoadPlan`, :func:`fetch`): its own key first (a different one is refused
  without asking), then the source; any failure (refused, reset, the source dead mid-transfer,
  409, 503, an answer it cannot read or too large, no answer within the fallback's own load
  time) falls back to the plan's ``fallback``, paid in full after the time lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

import enginestub
from enginestub import calibration as cal
from enginestub import timing
from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig
from enginestub.engine.metrics import EngineMetrics
from enginestub.fabric import Flow, Plane, fair_rates, link_bandwidth, link_latency
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import EngineError

log = logging.getLogger("enginestub.fork")
WINDOWS_KEPT = 256  # the forks served whose wall times /v1/info says
FORK_PATH = "/v1/fork"
FORK_PLANES = (Plane.UB, Plane.ROCE)
# The request's names (the target instance, its pod) are Kubernetes/ZooKeeper names; the other
# strings are bounded too, and the key (a content address) is never echoed back.
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_POD_UID = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_NAME = 253
MAX_DIES = 65536
# What a target reads of a source's answer (a few hundred bytes of JSON): a source that sends
# more is not one it can trust, and it never holds more than this in memory.
MAX_ANSWER_BYTES = 64 * 1024
# A fork gate: the pod and UID of the target asking; raises the refusal (403, 503).
Gate = Callable[[str, str], Awaitable[None]]


def artifacts(config: EngineConfig) -> str:
    """The identity of this instance's compiled artefacts: model (with MTP: its graphs carry the
    speculative head; an attention client's: no experts, its MoE layers are its pool's),
    parallelism, dies, engine."""
    model = f"{config.model.name}+mtp" if config.mtp else config.model.name
    if config.attention_client:  # its weights are not a whole instance's: no fork either way
        model += "+attention"
    return zl.artifact_id(model, config.tp, config.ep, config.instance_dies, enginestub.__version__)


def fork_key(config: EngineConfig) -> str:
    """This instance's content address: only a source and a target with the same key can fork
    (the model, and its compiled artefacts' identity)."""
    return zl.fork_source_key(config.model.name, artifacts(config))


@dataclass(frozen=True)
class LoadPlan:
    """Where an engine's weights come from: a fork first when one is named, ``fallback`` if it
    fails; else ``source`` (a claimed warm pod's assignment, or the configuration's source)."""

    source: timing.LoadSource
    fork: zl.ForkRef | None = None
    fallback: timing.LoadSource = timing.LoadSource.SHARED_FILE_SERVICE


async def no_group(_pod: str, _uid: str) -> None:
    """The gate of an engine in no group: no assignment can name it, so it forks nobody."""
    raise EngineError(
        403, "fork_not_assigned", "this instance is in no group: no assignment names it"
    )


# ------------------------------------------------------------------------- the source's side
@dataclass(frozen=True)
class ForkRequest:
    """A target's ``POST /v1/fork``, checked."""

    key: str
    target: str  # the instance it becomes
    pod: str  # the warm pod it runs in (its assignment's name)
    pod_uid: str
    plane: Plane
    dies: int
    node: str
    superpod: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ForkRequest:
        """The request, or 400 ``invalid_request`` naming the field at fault."""
        for name in ("key", "node", "superpod"):
            value = body.get(name)
            if not isinstance(value, str) or not value or len(value) > MAX_NAME:
                raise _invalid(name, f"{name} must be a string of 1 to {MAX_NAME} characters")
        for name in ("target", "pod"):
            value = body.get(name)
            if not (
                isinstance(value, str) and len(value) <= MAX_NAME and _DNS_NAME.fullmatch(value)
            ):
                raise _invalid(name, f"{name} must be a lower-case DNS name (at most {MAX_NAME})")
        uid = body.get("podUid")
        if not (isinstance(uid, str) and _POD_UID.fullmatch(uid)):
            raise _invalid("podUid", "podUid must be the target pod's UID")
        plane = body.get("plane")
        if plane not in {str(p) for p in FORK_PLANES}:
            raise _invalid("plane", 'plane must be "UB" or "RoCE"')
        dies = body.get("dies")
        if not (isinstance(dies, int) and not isinstance(dies, bool) and 0 < dies <= MAX_DIES):
            raise _invalid("dies", f"dies must be an integer from 1 to {MAX_DIES}")
        return cls(
            body["key"],
            body["target"],
            body["pod"],
            uid,
            Plane(plane),
            dies,
            body["node"],
            body["superpod"],
        )


def _invalid(param: str, message: str) -> EngineError:
    return EngineError(400, "invalid_request", message, param)


@dataclass(eq=False)
class _Target:
    pod: str
    name: str
    position: int
    remaining: float  # bytes per die still to receive
    since: float  # emulated time ``remaining`` was last brought up to date
    rate: float = 0.0  # bytes per second per die it receives since then
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    aborted: str | None = None  # why the source gave it up


@dataclass(eq=False)
class _Chain:
    """One pipelined broadcast out of this source on one plane."""

    plane: Plane
    receiving: list[_Target] = field(default_factory=list)  # still taking the source's bytes
    members: list[_Target] = field(default_factory=list)  # receiving, or its pipeline filling
    positions: int = 0  # the last position given; a position is never given twice in a chain
    task: asyncio.Task[None] | None = None


class ForkServer:
    """The source's side of NPU-fork: the chains under way, their fan-out, their share of the
    source's links."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Clock,
        metrics: EngineMetrics,
        kv_flows: Callable[[], int],
        not_serving: Callable[[], str | None],
        slow_factor: Callable[[], float],
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.key = fork_key(config)
        self.bytes_per_die = timing.fork_bytes_per_die(config.model, config.shape)
        self.gate: Gate = no_group  # the resident process sets the group's
        self._kv_flows = kv_flows  # the KV pulls out of this instance now (on its KV plane)
        self._not_serving = not_serving  # why it cannot fork now, or None
        self._slow = slow_factor
        self._chains = {plane: _Chain(plane) for plane in FORK_PLANES}
        self._changed = asyncio.Event()
        self._closing: str | None = None
        # The wall times (epoch s) of the last forks served, from the request to the answer:
        # when this source's own requests shared its links with a fork (bench-scale-out
        # measures its TTFT and TPOT over them), in /v1/info as ``forkWindows``
        self.windows: deque[tuple[float, float]] = deque(maxlen=WINDOWS_KEPT)

    @property
    def active(self) -> int:
        """Targets being forked now, over every plane: receiving, or waiting for the pipeline
        to bring them the last slice."""
        return sum(len(chain.members) for chain in self._chains.values())

    def flows(self, plane: Plane) -> int:
        """Broadcast flows out of this instance's dies on ``plane`` (0 or 1: one chain)."""
        return 1 if self._chains[plane].receiving else 0

    def poke(self) -> None:
        """Something the chains' rates depend on changed (KV flows, the engine's state)."""
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def rate(self, plane: Plane) -> float:
        """Bytes per second per die the chain on ``plane`` gets now: its max-min fair share of
        each source die's egress link beside the KV pulls on that plane."""
        kv = self._kv_flows() if plane is self.config.kv_plane else 0
        link = f"{plane}:tx"
        flows = [Flow("fork", 1.0, (link,))] + [Flow(f"kv{i}", 1.0, (link,)) for i in range(kv)]
        share = fair_rates(flows, {link: link_bandwidth(plane, same_node=False)})["fork"]
        return share / self._slow()

    def _why_not(self) -> str | None:
        return self._closing or self._not_serving()

    async def check(self, body: dict[str, Any]) -> ForkRequest:
        """The request, or its refusal (400, 403, 409, 503). The gate reads ZooKeeper; what
        follows it is checked with nothing awaited before the target joins its chain."""
        request = ForkRequest.parse(body)
        await self.gate(request.pod, request.pod_uid)
        if request.key != self.key:
            raise EngineError(
                409,
                "fork_mismatch",
                "the key is not this source's: another model, parallelism, die count, MTP "
                "setting or engine build",
                "key",
            )
        dies = len(self.config.dies)
        if request.dies != dies:
            raise EngineError(
                409, "fork_mismatch", f"{request.dies} dies against this source's {dies}", "dies"
            )
        if request.plane is Plane.UB and request.superpod != self.config.superpod:
            raise EngineError(
                409,
                "plane_unreachable",
                f"UB reaches only inside SuperPod {self.config.superpod}",
                "plane",
            )
        why = self._why_not()
        if why is not None:
            raise EngineError(503, "not_ready", f"this instance cannot fork now: {why}")
        if any(t.pod == request.pod for c in self._chains.values() for t in c.members):
            raise EngineError(
                409, "fork_in_progress", f"a fork to pod {request.pod} is under way", "pod"
            )
        if self.active >= cal.FORK_FANOUT:
            raise EngineError(
                503,
                "fork_busy",
                f"this source broadcasts to {self.active} targets (at most {cal.FORK_FANOUT})",
            )
        return request

    async def serve(self, body: dict[str, Any]) -> dict[str, Any]:
        """One target's fork: refused at once, or answered when its emulated transfer ends."""
        try:
            request = await self.check(body)
        except EngineError as exc:
            self.metrics.forks.labels(outcome=exc.code).inc()
            raise
        plane, started, began_wall = request.plane, self.clock.now(), time.time()
        chain = self._chains[plane]
        chain.positions += 1
        entry = _Target(request.pod, request.target, chain.positions, self.bytes_per_die, started)
        chain.receiving.append(entry)
        chain.members.append(entry)
        try:
            if chain.task is None or chain.task.done():
                chain.task = asyncio.create_task(self._run(chain), name=f"fork-{plane}")
            self.poke()  # a running chain takes the newcomer in now
            await asyncio.shield(entry.done)
            # The pipeline's fill: the first slice reaches position j after j - 1 more hops.
            fill = link_latency(plane, same_node=False) + (entry.position - 1) * (
                timing.fork_hop_seconds(plane)
            )
            await self._fill(entry, fill * self._slow())
        except EngineError:
            self.metrics.forks.labels(outcome="fork_aborted").inc()
            raise
        finally:
            for members in (chain.receiving, chain.members):
                if entry in members:  # done, aborted, or the caller went away
                    members.remove(entry)
            if not chain.members:
                chain.positions = 0  # the next target starts a new chain
            self.poke()
        nbytes = self.bytes_per_die * len(self.config.dies)
        self.metrics.forks.labels(outcome="served").inc()
        self.metrics.fork_bytes.labels(plane=str(plane)).inc(nbytes)
        seconds = self.clock.now() - started
        self.windows.append((round(began_wall, 4), round(time.time(), 4)))
        log.info(
            "forked %s to %s (pod %s) over %s in %.3f emulated s (position %d)",
            self.config.model.name,
            request.target,
            request.pod,
            plane,
            seconds,
            entry.position,
        )
        return {
            "seconds": seconds,
            "bytes": nbytes,
            "plane": str(plane),
            "position": entry.position,
            "source": self.config.instance,
        }

    async def _fill(self, entry: _Target, seconds: float) -> None:
        """Wait ``seconds`` (emulated) for the pipeline to fill, unless the source gives the
        target up meanwhile (it stops serving, it shuts down)."""
        deadline = self.clock.now() + seconds
        while True:
            why = entry.aborted or self._why_not()
            if why is not None:
                raise _aborted(why)
            left = deadline - self.clock.now()
            if left <= 0:
                return
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.clock.to_wall(left)):
                    await changed.wait()

    async def _run(self, chain: _Chain) -> None:
        """The chain's broadcast; an unexpected failure aborts the chain (its targets fall back)
        rather than leaving them waiting."""
        try:
            await self._broadcast(chain)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("the fork broadcast over %s failed", chain.plane)
            self._abort(chain, f"the broadcast failed ({type(exc).__name__})")

    async def _broadcast(self, chain: _Chain) -> None:
        """Move the chain's bytes at its current rate until every target has them, re-shared
        at every change (a KV pull starting or ending, the engine's state)."""
        while chain.receiving:
            why = self._why_not()
            if why is not None:
                self._abort(chain, why)
                return
            rate = self.rate(chain.plane)
            now = self.clock.now()
            for t in chain.receiving:
                t.remaining -= (now - t.since) * t.rate
                t.since, t.rate = now, rate
            for t in [t for t in chain.receiving if t.remaining <= 1e-9 * self.bytes_per_die]:
                chain.receiving.remove(t)  # it has every byte: its pipeline fills (still a member)
                if not t.done.done():
                    t.done.set_result(None)
            if not chain.receiving:
                return
            changed = self._changed
            wait = min(t.remaining for t in chain.receiving) / rate
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.clock.to_wall(wait)):
                    await changed.wait()

    def _abort(self, chain: _Chain, why: str) -> None:
        """Every target of ``chain``, receiving or filling, is answered 503 ``fork_aborted``."""
        for t in chain.members:
            t.aborted = t.aborted or why
            if not t.done.done():
                t.done.set_exception(_aborted(why))
        chain.receiving.clear()
        self.poke()  # the fillers wake up to see it

    def shutdown(self, why: str) -> None:
        """The source is going away (closing, stopping): every chain is aborted (each target
        waiting is answered 503 ``fork_aborted`` and falls back) and new targets are refused."""
        if self._closing is None:
            self._closing = why
        for chain in self._chains.values():
            if chain.members:
                log.warning("aborting %d fork(s) over %s: %s", len(chain.members), chain.plane, why)
            self._abort(chain, why)

    async def close(self) -> None:
        self.shutdown("the engine is closing")
        for chain in self._chains.values():
            if chain.task is not None:
                chain.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await chain.task


def _aborted(why: str) -> EngineError:
    return EngineError(503, "fork_aborted", f"the source stopped serving: {why}")


# ------------------------------------------------------------------------- the target's side
class ForkFailed(Exception):
    """The fork did not deliver: the target loads from its fallback."""


async def fetch(
    http: httpx.AsyncClient,
    config: EngineConfig,
    ref: zl.ForkRef,
    wall_bound: float,
) -> dict[str, Any]:
    """Ask ``ref``'s source for its weights and compiled artefacts; its answer (``seconds`` a
    finite number >= 0), or ForkFailed whatever went wrong. ``wall_bound``: how long to wait
    for it (then the fork is no faster than the fallback)."""
    own = fork_key(config)
    if ref.key != own:
        raise ForkFailed(f"fork_mismatch: the source's key {ref.key} is not ours ({own})")
    if ref.plane not in (str(p) for p in FORK_PLANES):
        raise ForkFailed(f"plane {ref.plane!r} is not UB or RoCE")
    body = {
        "key": own,
        "target": config.instance,
        "pod": config.pod,
        "podUid": config.pod_uid,
        "plane": ref.plane,
        "dies": len(config.dies),
        "node": config.node,
        "superpod": config.superpod,
    }
    try:
        url = httpx.URL(scheme="http", host=ref.pod_ip, port=ref.port, path=FORK_PATH)
        async with (
            asyncio.timeout(wall_bound),
            http.stream("POST", url, json=body, timeout=httpx.Timeout(5.0, read=None)) as response,
        ):
            raw = await _read_at_most(response, MAX_ANSWER_BYTES)
            status = response.status_code
    except TimeoutError:
        raise ForkFailed(f"no answer from {ref.instance} within {wall_bound:.1f} wall s") from None
    except ForkFailed:
        raise
    except Exception as exc:  # any failure of the exchange is the fork's, never the target's
        raise ForkFailed(
            f"{ref.instance} at {ref.pod_ip}:{ref.port}: {type(exc).__name__}"
        ) from None
    if status != 200:
        try:
            error = json.loads(raw)["error"]
            why = f"{error['code']}: {error['message']}"
        except (ValueError, KeyError, TypeError):
            why = raw[:200].decode("utf-8", "replace")
        raise ForkFailed(f"{ref.instance} answered {status} {why}")
    try:
        answer = json.loads(raw)
        seconds = float(answer["seconds"])
    except (ValueError, KeyError, TypeError, OverflowError):
        raise ForkFailed(f"{ref.instance}'s answer is not understood") from None
    if not (isinstance(answer, dict) and math.isfinite(seconds) and seconds >= 0):
        raise ForkFailed(f"{ref.instance}'s answer is not understood")
    answer["seconds"] = seconds
    return dict(answer)


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    """The response's body, or ForkFailed once it passes ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise ForkFailed(f"the source's answer is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
