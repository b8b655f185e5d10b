"""The leader-election Lease (``coordination.k8s.io/v1``): read, create, take or renew, release.

Every write but the create carries the resourceVersion of the record it was decided on, so of
two replicas deciding on the same record one wins and the other gets a 409 (no write). What to
write is decided in :mod:`matrixserve.domain.leadership`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kubernetes import client

from matrixserve.api import rfc3339
from matrixserve.domain.leadership import Record

log = logging.getLogger("matrixserve.leadership")
T = TypeVar("T")


class LeaseAdapter:
    def __init__(
        self, api: client.ApiClient, namespace: str, name: str, timeout: float = 5.0
    ) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name
        self.uid: str | None = None  # the Lease's, for Events on it
        # Threads of its own (not the loop's default pool, which the Kubernetes and ZooKeeper
        # calls of every pass share) and a timeout on every call: nothing else delays a renewal.
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lease")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        call = functools.partial(fn, *args, _request_timeout=self.timeout)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def read(self) -> Record | None:
        try:
            lease = await self._call(
                self.coordination.read_namespaced_lease, self.name, self.namespace
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        self.uid = lease.metadata.uid
        spec = lease.spec
        return Record(
            holder=spec.holder_identity or "",
            lease_seconds=int(spec.lease_duration_seconds or 0),
            transitions=int(spec.lease_transitions or 0),
            resource_version=str(lease.metadata.resource_version),
            acquire_time=rfc3339.format(spec.acquire_time.timestamp()) if spec.acquire_time else "",
        )

    def _spec(
        self, holder: str, seconds: int, transitions: int, acquired: bool, now: float
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": holder,
            "leaseDurationSeconds": seconds,
            "leaseTransitions": transitions,
            "renewTime": rfc3339.format(now),
        }
        if acquired:
            spec["acquireTime"] = rfc3339.format(now)
        return spec

    async def create(self, holder: str, seconds: int) -> bool:
        """True if ours now; False if another candidate's create won."""
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": self._spec(holder, seconds, 0, True, time.time()),
        }
        try:
            await self._call(self.coordination.create_namespaced_lease, self.namespace, body)
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def write(
        self, record: Record, holder: str, seconds: int, transitions: int, acquired: bool
    ) -> bool:
        """Replace the record, if it is still the one read (409 otherwise: False): a replace
        carries the whole spec (acquireTime kept when only renewing)."""
        spec = self._spec(holder, seconds, transitions, acquired, time.time())
        if not acquired and record.acquire_time:
            spec["acquireTime"] = record.acquire_time
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": record.resource_version,
            },
            "spec": spec,
        }
        try:
            await self._call(
                self.coordination.replace_namespaced_lease, self.name, self.namespace, body
            )
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    async def event(self, reason: str, message: str) -> None:
        """A Normal Event on the Lease; a failure is logged, never raised."""
        now = rfc3339.format(time.time())
        body = {
            "metadata": {
                "name": f"{self.name}.{uuid.uuid4().hex[:16]}",
                "namespace": self.namespace,
            },
            "involvedObject": {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid or "",
            },
            "reason": reason,
            "message": message,
            "type": "Normal",
            "source": {"component": "matrixserve-operator"},
            "firstTimestamp": now[:19] + "Z",
            "lastTimestamp": now[:19] + "Z",
            "count": 1,
        }
        try:
            await self._call(self.core.create_namespaced_event, self.namespace, body)
        except Exception as exc:
            log.warning("could not post the %s Event on the Lease: %s", reason, exc)
