"""What is left of a group in ZooKeeper when it goes (pure).

The finalizer removes a deleted group's subtree. It never blocks the deletion for ever: without a
ZooKeeper session it waits a bounded time, then lets the object go (and says so); the subtree is
then removed by the sweep, which runs on every new session (start-up included) and removes the
subtree of every group that no longer exists in Kubernetes.
"""

from __future__ import annotations

from collections.abc import Iterable

from matrixserve.domain.conditions import seconds_since

# How long a deletion waits for ZooKeeper before the object is let go (the bound required of
# `kubectl delete` while ZooKeeper is down is 60 s, so this leaves room for the retries).
FINALIZER_WAIT_SECONDS = 30.0


def give_up_waiting(deletion_timestamp: str | None, now: float) -> bool:
    """Whether a deletion has waited long enough for ZooKeeper (RFC 3339 timestamp)."""
    waited = seconds_since(deletion_timestamp, now)
    return waited is not None and waited >= FINALIZER_WAIT_SECONDS


Key = tuple[str, str]  # (namespace, name)


def orphans(in_zookeeper: Iterable[Key], in_kubernetes: Iterable[Key]) -> list[Key]:
    """Subtrees whose group is gone. ZooKeeper must be listed *before* Kubernetes: a group
    created between the two listings is then in the second, never swept by mistake."""
    alive = set(in_kubernetes)
    return sorted(k for k in set(in_zookeeper) if k not in alive)
