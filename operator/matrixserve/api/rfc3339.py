"""RFC 3339 times as Kubernetes writes them, in one place: epoch seconds to text and back.

Kubernetes has two spellings, both UTC with a ``Z``: ``Time``, whole seconds
(``2026-01-01T00:00:00Z``: conditions' ``lastTransitionTime``, taints' ``timeAdded``, container
states), and ``MicroTime``, with microseconds (``2026-01-01T00:00:00.000000Z``: a Lease's
``renewTime`` and ``acquireTime``, and the times our own status records carry). Pure: the caller
passes the time (no clock here), so the engine stub and the operator format alike.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime


def format(ts: float) -> str:  # read as rfc3339.format (the builtin is not used here)
    """``ts`` (epoch seconds) as a ``MicroTime``: ``YYYY-MM-DDTHH:MM:SS.ffffffZ``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_seconds(ts: float) -> str:
    """``ts`` (epoch seconds) as a ``Time``: ``YYYY-MM-DDTHH:MM:SSZ``, the fraction dropped."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def parse(text: object) -> float | None:
    """An RFC 3339 time (either spelling, or with an offset) in epoch seconds; None if ``text``
    is not one (absent, empty, not a string, malformed)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
