"""What is left of a namespace's warm pods in ZooKeeper when they all go (pure).

``/matrixserve/v1/warm/<ns>`` holds the warm engines' reports (ephemeral), the assignments of
claimed pods and the host-DRAM plans the namespace's pools wrote (DeepServe §6.1). A namespace
deleted with everything in it, or whose last WarmPool went, leaves the plans and folders behind:
the sweep removes the namespace's folder once nothing it serves exists, no WarmPool and no pod of
a pool (a warm one reports there; a claimed one's assignment may still be read).
"""

from __future__ import annotations

from collections.abc import Iterable


def orphans(
    in_zookeeper: Iterable[str], with_pools: Iterable[str], with_pool_pods: Iterable[str]
) -> list[str]:
    """Namespaces whose warm folder belongs to nothing. ZooKeeper must be listed *before*
    Kubernetes: a pool created between the two listings is then in the second, never swept."""
    alive = set(with_pools) | set(with_pool_pods)
    return sorted(ns for ns in set(in_zookeeper) if ns not in alive)
