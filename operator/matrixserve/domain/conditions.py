"""Status conditions the Kubernetes way: ``lastTransitionTime`` moves only when a condition's
status flips; every condition carries the generation it was computed for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge(
    previous: Sequence[Mapping[str, Any]], wanted: Sequence[Condition], now: str, generation: int
) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in wanted:
        status = "True" if cond.status else "False"
        old = before.get(cond.type)
        since = now
        if old is not None and old.get("status") == status and old.get("lastTransitionTime"):
            since = str(old["lastTransitionTime"])
        out.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since,
                "observedGeneration": generation,
            }
        )
    return out


def is_true(status: Mapping[str, Any] | None, kind: str) -> bool:
    """Whether the object's status has condition ``kind`` with status "True"."""
    return any(
        c.get("type") == kind and c.get("status") == "True"
        for c in (status or {}).get("conditions") or []
    )


def find(status: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any]:
    """The object's condition ``kind`` as stored (empty if it has none)."""
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == kind), {})


def seconds_since(timestamp: str | None, now: float) -> float | None:
    """Seconds from an RFC 3339 timestamp (as conditions and deletions carry) to ``now``."""
    if not timestamp:
        return None
    return now - datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
