"""The one owner of a ZooKeeper session, shared by every MatrixServe process that talks to
ZooKeeper: the operator's stores, the engine's resident process (P/D-Serve §3.2-3.4) and the
gateway's entrance discovery. The session policy is written here once.

Patroni's ZooKeeper DCS is the model:

- **State**: ``CONNECTING`` until the first connection, then ``CONNECTED``, ``SUSPENDED``
  (the connection dropped; the session may still be alive and our ephemerals with it: pause
  destructive work) or ``LOST`` (the session expired: our ephemerals and watches are gone;
  whoever owns ephemerals writes them again once ``CONNECTED`` follows). Listeners are called
  on kazoo's thread and must not block.
- **Connecting**: :meth:`Session.connect` retries until it connects (ZooKeeper may come up after
  us), leaving no half-started client behind a failed try; :meth:`Session.start_background`
  lets kazoo reconnect for ever without waiting (a process that can serve without ZooKeeper).
- **Writes are idempotent**: :meth:`Session.put` is set-or-create (optionally versioned: a
  compare-and-set that raises :class:`kazoo.exceptions.BadVersionError` when someone else wrote
  in between), deletes of absent znodes succeed, and :meth:`Session.apply` runs a list of
  :mod:`matrixserve.api.zk_layout` operations in order.
- **Retries with a deadline**: :meth:`Session.retry` re-runs a call through connection losses
  until it succeeds or the deadline passes (kazoo's ``KazooRetry``).
- **Watches**: children and data watches, which kazoo re-arms on reconnection within a session;
  a children watch on a znode that does not exist yet waits for it (kazoo's would stop
  silently).
- **A server that lost its data** (reinstalled, or rescheduled on an empty volume) refuses a
  client that has seen a later zxid, so that client stays SUSPENDED for ever: a session
  SUSPENDED for longer than the session timeout (not sooner: a lagging ensemble member must not
  cost live sessions) is given up: listeners hear LOST, a fresh client connects, and every watch
  still wanted is armed again on it. Whoever owns ephemerals writes them again on CONNECTED, as
  after any lost session.
- **Access**: given :class:`~matrixserve.api.zk_layout.Credentials`, every
  client (a renewed one too) authenticates with that digest identity and creates every znode
  with an ACL granting it, and only it, everything (no world access); :meth:`Session.restrict`
  gives the same ACL to znodes created before (an upgrade). A group's subtree still open (its
  engines started before the credential existed and still write there) keeps what is made in
  it open too, until the operator closes it (:meth:`Session.close`). Without credentials,
  znodes are open to every client, as ZooKeeper's default. Every process takes the identity
  the same way (:func:`add_auth_flags`): from a file (a mounted Secret) or, for the dev
  cluster and tests, from the environment.

kazoo is imported in this package and in the adapters built on it, never in
``matrixserve.domain``. The package's modules: :mod:`.session` (the session, its state,
calls and watches), :mod:`.acl` (our ACL given to a tree made before the credential) and
:mod:`.credentials` (the identity every process takes the same way). The names every user
needs are re-exported here (``from matrixserve.coordination import Session``).
"""

from __future__ import annotations

from kazoo.exceptions import NotEmptyError

from matrixserve.coordination.acl import CLOSE_WALKS, RESTRICT_BATCH, Restricted
from matrixserve.coordination.credentials import (
    AUTH_ENV,
    AUTH_FILE_ENV,
    access,
    add_auth_flags,
    auth_from,
)
from matrixserve.coordination.session import (
    ERRORS,
    STOP_WAIT,
    CallTimeout,
    Session,
    SessionState,
    ZooKeeperError,
)

__all__ = [
    "AUTH_ENV",
    "AUTH_FILE_ENV",
    "CLOSE_WALKS",
    "ERRORS",
    "RESTRICT_BATCH",
    "STOP_WAIT",
    "CallTimeout",
    "NotEmptyError",
    "Restricted",
    "Session",
    "SessionState",
    "ZooKeeperError",
    "access",
    "add_auth_flags",
    "auth_from",
]
