"""kopf handlers for PDGroup (P/D-Serve §3.2-3.4): the kind's set-up (:mod:`.controller`), its
decorators and ``reconcile`` (:mod:`.reconcile`) and its admission webhook (:mod:`.admission`).

- ``@kopf.daemon`` per PDGroup runs the shared per-object loop (:mod:`.reconciler`), woken by
  ZooKeeper watches on the group's subtree, pod events and spec changes.
- ``reconcile``: parse -> validate -> observe (pods, ZooKeeper) -> plan (pure,
  :mod:`matrixserve.domain.pdgroup`) -> apply -> status. An invalid spec sets
  ``Ready=False/InvalidSpec`` with an Event and touches nothing.
- ``@kopf.on.validate``: the admission webhook, the same rules as the reconciler, on create,
  update and the scale subresource; metadata-only updates and objects being deleted pass.
- ``@kopf.on.delete``: the finalizer removes the group's ZooKeeper subtree; ownerReferences take
  the pods.
"""

from matrixserve.handlers.pdgroup.admission import register_webhook
from matrixserve.handlers.pdgroup.controller import PDGroupMetrics, PDGroups, install, sweep
from matrixserve.handlers.pdgroup.reconcile import reconcile

__all__ = ["PDGroupMetrics", "PDGroups", "install", "reconcile", "register_webhook", "sweep"]
