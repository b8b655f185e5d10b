"""Which replica of the operator acts: leader election on a Lease.

Why a ``coordination.k8s.io`` Lease and not kopf's peering: kopf's peering pauses every operator
when two of the same priority meet and resumes a lower one only after the other's record goes
stale (a minute by default); it neither fences a deposed leader nor bounds a takeover. A Lease is
what client-go and controller-runtime elect on, readable with ``kubectl get lease``, and needs
nothing beyond the API server (not ZooKeeper, whose loss is a separate fault). The decisions are
:mod:`matrixserve.domain.leadership`'s; the Lease's reads and writes :mod:`matrixserve.adapters.lease`'s.

Every replica runs kopf whole: the admission webhook (served by each), the watches and a daemon
per object (so a standby's caches are warm). What acts waits for :meth:`Leadership.wait` and is
fenced by :meth:`Leadership.check` before each write — the reconcilers' passes and effects, status
writes, the kinds' sweeps, the finalizer's clean-up, the unserved kinds' status — so a standby
writes nothing, and a leader that could not renew within the renew deadline writes nothing
more and exits (its pod restarts it as a candidate). What a deposed leader left half done is
finished by the next from what it observes: creates are idempotent by name, deletes and claims
are conditional on UID and resourceVersion, and a recovery's or a ratio move's progress is in
the object's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from matrixserve.adapters.kube import KubeAdapter
from matrixserve.adapters.lease import LeaseAdapter
from matrixserve.api import kinds
from matrixserve.domain import leadership as le
from matrixserve.domain.leadership import NotLeading, Step, Timing

log = logging.getLogger("matrixserve.leadership")


class Leadership:
    """This replica's leadership. Without a Lease (``lease`` None: one operator, no election)
    it always leads."""

    def __init__(
        self,
        identity: str,
        lease: LeaseAdapter | None,
        timing: Timing,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.identity = identity
        self.lease = lease
        self.timing = timing
        self.clock = clock
        self.observed: le.Observed | None = None
        self.last_renewed: float | None = None
        self.leading = asyncio.Event()
        self.lost = False
        self.on_gained: list[Callable[[], None]] = []
        self.on_lost: list[Callable[[], None]] = []
        self._posting: asyncio.Task[None] | None = None
        self.gauge = Gauge(
            "matrixserve_operator_leader",
            "1 while this replica is the leader (acts), 0 while a standby (serves the webhook)",
            registry=registry,
        )
        self.acquired = Counter(
            "matrixserve_operator_leadership_acquired",
            "Times this replica became the leader",
            registry=registry,
        )
        if lease is None:
            self.leading.set()
            self.gauge.set(1)

    @property
    def elected(self) -> bool:
        return self.lease is not None

    def may_act(self) -> bool:
        if self.lease is None:
            return True
        return not self.lost and le.may_act(self.last_renewed, self.timing, self.clock())

    def check(self) -> None:
        """Before every write: raises :class:`NotLeading` unless this replica may act now."""
        if not self.may_act():
            raise NotLeading(f"{self.identity} is not the leader")

    async def wait(self, timeout: float | None = None) -> bool:
        """Until this replica may act (True), or ``timeout`` seconds pass (False)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self.may_act():
            left = 1.0 if deadline is None else min(1.0, deadline - loop.time())
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.leading.wait()
                    if not self.may_act():  # set, but its renewal is late: do not spin
                        await asyncio.sleep(min(left, self.timing.retry / 4))
        return True

    # ------------------------------------------------------------------ the election
    async def run(self) -> None:
        """Elect and renew every ``retry`` seconds. A try that does not answer within the
        retry period is abandoned (the Lease's calls have their own threads and timeouts: a
        slow ZooKeeper or a burst of pod creations never delays a renewal), and a watchdog
        ends the leadership the moment a renewal is overdue, answered or not."""
        assert self.lease is not None
        watchdog = asyncio.get_running_loop().create_task(self._watch())
        try:
            while not self.lost:
                started = self.clock()
                try:
                    async with asyncio.timeout(max(self.timing.retry, 1.0)):
                        renewed = await self._try()
                    if renewed:
                        self.last_renewed = started
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the API server away or slow: fenced by the deadline
                    log.warning("leader election: %s", exc or type(exc).__name__)
                if self.lost:
                    return
                if self.leading.is_set() and not self.may_act():
                    self._lose("no renewal within the renew deadline")
                    return
                if not self.leading.is_set() and self.may_act():
                    self._gain()
                await asyncio.sleep(self.timing.retry)
        finally:
            watchdog.cancel()

    async def _watch(self) -> None:
        while not self.lost:
            await asyncio.sleep(self.timing.retry / 4)
            if self.leading.is_set() and not self.may_act() and not self.lost:
                self._lose("no renewal within the renew deadline")

    async def _try(self) -> bool:
        assert self.lease is not None
        record = await self.lease.read()
        # observed when the answer came (client-go's observedTime): a read sent before the
        # leader's renewal and answered after it must not date the renewal earlier
        now = self.clock()
        self.observed = le.observe(self.observed, record, now)
        if (
            self.leading.is_set()
            and record is not None
            and record.holder
            and record.holder != self.identity
        ):  # taken from us (deleted and made again, or edited): stop at once, not at the deadline
            self._lose(f"the Lease names {record.holder}")
            return False
        step = le.decide(self.observed, self.identity, self.timing, now)
        seconds = int(self.timing.lease)
        if step is Step.CREATE:
            return await self.lease.create(self.identity, seconds)
        if step is Step.WAIT or record is None:
            return False
        transitions = le.transitions_after(record, self.identity)
        return await self.lease.write(
            record, self.identity, seconds, transitions, acquired=step is Step.TAKE
        )

    def _gain(self) -> None:
        log.info(
            "%s became the leader (lease %s/%s)",
            self.identity,
            self.lease.namespace if self.lease else "",
            self.lease.name if self.lease else "",
        )
        self.leading.set()
        self.gauge.set(1)
        self.acquired.inc()
        self._post("became the leader")
        for callback in self.on_gained:
            try:
                callback()
            except Exception:  # the election goes on whatever a listener does
                log.exception("a leadership listener failed")

    def _lose(self, why: str) -> None:
        if self.lost:
            return
        self.lost = True
        self.leading.clear()
        self.gauge.set(0)
        log.error("%s lost the leadership (%s): it acts no more and exits", self.identity, why)
        for callback in self.on_lost:
            try:
                callback()
            except Exception:
                log.exception("a leadership listener failed")

    def _post(self, what: str) -> None:
        """An Event on the Lease (``kubectl describe lease``), as controller-runtime posts."""
        if self.lease is not None:
            task = asyncio.get_running_loop().create_task(
                self.lease.event("LeaderElection", f"{self.identity} {what}")
            )
            self._posting = task  # held until done (a task only the loop refers to may vanish)

    async def release(self) -> None:
        """On a clean stop (the election task already ended): the Lease given up (holder
        emptied, one second left), so a standby takes over within its retry period rather than
        a whole lease. A renewal landing first (409) is read again and released once more."""
        if self.lease is None or not self.leading.is_set() or not self.may_act():
            return
        self.leading.clear()
        self.gauge.set(0)
        self.lost = True  # nothing acts from now on
        for _ in range(3):
            try:
                record = await self.lease.read()
                if record is None or record.holder != self.identity:
                    return
                if await self.lease.write(record, "", 1, record.transitions, acquired=False):
                    log.info("%s released the leadership", self.identity)
                    return
            except Exception as exc:
                log.warning("could not release the Lease: %s", exc)
                return
        log.warning("could not release the Lease (it kept changing): the others wait it out")


async def lead_or_gone(
    leadership: Leadership | None, pending: Callable[[], Awaitable[bool]], every: float = 2.0
) -> bool:
    """For a kopf handler that writes (a finalizer's clean-up, a status said on an event): wait
    until this replica leads (True) or ``pending()`` says the work is no longer there (False:
    the object is gone, or the leader finished with it), so a standby's handler neither writes
    nor lingers. A failed look counts as still pending (asked again)."""
    if leadership is None:
        return True
    while not await leadership.wait(timeout=every):
        try:
            if not await pending():
                return False
        except Exception as exc:
            log.debug("still pending? %s", exc)
    return True


def finalizer_pending(
    kube: KubeAdapter, kind: kinds.Kind, namespace: str, name: str
) -> Callable[[], Awaitable[bool]]:
    """For :func:`lead_or_gone` in a finalizer's handler: the object is there with our
    finalizer on it (the leader has not finished with it)."""

    async def pending() -> bool:
        body = await kube.get(kind, namespace, name)
        return body is not None and kinds.FINALIZER in (body["metadata"].get("finalizers") or ())

    return pending
