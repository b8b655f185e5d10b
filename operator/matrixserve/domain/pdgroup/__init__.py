"""The PDGroup kind's pure core (P/D-Serve §3.2-3.4), as stages:

- :mod:`.view` — what the planner knows (spec, pods as instances, the ZooKeeper subtree);
- :mod:`.actions` — what it asks for, each carrying what applying it needs and its Event;
- :mod:`.membership` — gathering, dynamic RoCE construction, release, traffic;
- :mod:`.status` — status, conditions and readiness;
- :mod:`.pods` — the instance's pods (names, labels, manifest);
- :mod:`.obtain` — how missing instances come: a warm pod claimed, or a cold pod;
- :mod:`.gang` — the instances of several pods placed whole (gated, pinned, lifted together);
- :mod:`.validation` — the cross-field rules of the webhook and the reconciler;
- :mod:`.plan` — the stages composed, with the seams where the ratio policy, the scale-out
  path and recovery plug in.

This package imports only ``matrixserve.api`` and the kind-neutral parts of
``matrixserve.domain``; no other kind's package (``make lint`` checks it).
"""

from matrixserve.domain.pdgroup.gang import larger_than_any_superpod, needs_servers
from matrixserve.domain.pdgroup.plan import Plan, Seams, plan, spec_pod_names, warm_needed
from matrixserve.domain.pdgroup.view import GroupView, ZkView, may_recover
from matrixserve.domain.pdgroup.warm import claimable

__all__ = [
    "GroupView",
    "Plan",
    "Seams",
    "ZkView",
    "claimable",
    "larger_than_any_superpod",
    "may_recover",
    "needs_servers",
    "plan",
    "spec_pod_names",
    "warm_needed",
]
