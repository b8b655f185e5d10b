"""Kinds whose controllers are not built yet: DPDomain.

Their CRDs are installed (the API is published ahead of its controllers), so an object of one is
accepted and stored. Each such object says that nothing runs for it in its status — ``Ready=False``, reason ``NoController`` — at its creation, at the
operator's start and on every new generation; a Warning Event once per generation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from matrixserve.api import kinds
from matrixserve.domain import conditions as cond
from matrixserve.domain.effects import Event
from matrixserve.handlers.leadership import lead_or_gone
from matrixserve.handlers.reconciler import now_rfc3339, post
from matrixserve.handlers.runtime import Runtime

UNSERVED = (kinds.DPDOMAIN,)
REASON = "NoController"


def message(kind: kinds.Kind) -> str:
    return (
        f"no controller runs {kind.kind} objects in this version of MatrixServe yet: the object "
        "is stored and nothing is created for it (the MoE kinds come in later issues)"
    )


async def say(
    runtime: Runtime, kind: kinds.Kind, type: str, body: Mapping[str, Any], logger: logging.Logger
) -> None:
    """On an event of an object of an unserved kind: say so, once per generation."""
    meta = body.get("metadata") or {}
    if type == "DELETED" or meta.get("deletionTimestamp"):
        return
    # The leader says it (a standby's handler waits: it says it if it comes to lead, unless
    # the object is gone by then).
    leadership = runtime.leadership

    async def exists() -> bool:
        return await runtime.kube.get(kind, meta["namespace"], meta["name"]) is not None

    if not await lead_or_gone(leadership, exists):
        return
    if leadership is not None and leadership.elected:  # waited: decide on the object now
        fresh = await runtime.kube.get(kind, meta["namespace"], meta["name"])
        if fresh is None:
            return
        body, meta = fresh, fresh.get("metadata") or {}
    generation = int(meta.get("generation") or 0)
    status = body.get("status") or {}
    previous = status.get("conditions") or []
    ready: dict[str, Any] = next((c for c in previous if c.get("type") == "Ready"), {})
    if (
        status.get("observedGeneration") == generation
        and ready.get("reason") == REASON
        and ready.get("message") == message(kind)
    ):
        return  # said for this generation (our own patch comes back as an event)
    if leadership is not None:
        leadership.check()
    wanted = [cond.Condition("Ready", False, REASON, message(kind))]
    conditions = [
        *(c for c in previous if c.get("type") != "Ready"),
        *cond.merge(previous, wanted, now_rfc3339(), generation),
    ]
    await runtime.kube.patch_status(
        kind,
        meta["namespace"],
        meta["name"],
        {"conditions": conditions, "observedGeneration": generation},
    )
    post(body, Event(REASON, message(kind), warning=True))
    logger.warning("%s %s/%s: %s", kind.kind, meta["namespace"], meta["name"], message(kind))
