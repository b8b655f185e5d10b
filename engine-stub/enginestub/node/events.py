"""The emulated kubelet's Events: what ``kubectl describe`` shows for a pod or a node (SYSTEM.md
§5), in the kubelet's own words (``Started``, ``BackOff``, ``Killing``, ``Failed``,
``NodeNotReady``), with source component ``kubelet`` and the node as host.

Events are best effort, as the kubelet's are: one that the API server refuses is logged and
dropped, not retried, so it never holds up the pod or node change it describes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from kubernetes import client

from enginestub.node.state import PodRecord
from matrixserve.api import rfc3339

log = logging.getLogger("enginestub.node")


class Events:
    """Posts Events about our pods and nodes through the core API."""

    def __init__(self, core: client.CoreV1Api) -> None:
        self.core = core

    async def pod(self, record: PodRecord, reason: str, message: str, kind: str) -> None:
        involved = {
            "kind": "Pod",
            "namespace": record.namespace,
            "name": record.name,
            "uid": record.uid,
            "apiVersion": "v1",
        }
        await self._post(record.namespace, involved, reason, message, kind, record.node)

    async def node(self, node: str, reason: str, message: str, kind: str) -> None:
        involved = {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"}
        await self._post("default", involved, reason, message, kind, node)

    async def _post(
        self,
        namespace: str,
        involved: Mapping[str, str],
        reason: str,
        message: str,
        kind: str,
        node: str,
    ) -> None:
        now = rfc3339.format_seconds(time.time())
        body = {
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": dict(involved),
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": node},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": "matrixserve-node-emulator",
            "reportingInstance": node,
        }
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, namespace, body)
        except client.ApiException as exc:
            log.debug("event %s for %s not recorded: %s", reason, involved.get("name"), exc.reason)
