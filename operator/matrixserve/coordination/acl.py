"""Our ACL given to znodes made before the credential was configured (an upgrade).

A tree is walked level by level, many znodes' ACLs and children asked at once (kazoo's
asynchronous calls), so a large tree costs a few round trips per thousand znodes, not three each
(:func:`restrict_tree`); a znode another identity owns is left as it is and named in the result.
:meth:`Session.restrict <matrixserve.coordination.session.Session.restrict>` walks from the
session's client, :meth:`Session.close <matrixserve.coordination.session.Session.close>` walks a
group's subtree until a walk changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import NoAuthError, NoNodeError
from kazoo.security import ACL

RESTRICT_BATCH = 256  # znodes asked about at once when ACLs are set on an existing tree
# A closing walk is repeated until it changes nothing: a znode made open in the subtree just as
# it was being closed (its creator saw the root still open) is caught by the next walk.
CLOSE_WALKS = 3


@dataclass(frozen=True)
class Restricted:
    """What :meth:`Session.restrict` found: znodes seen, given our ACL, and refused to us (owned
    by another identity; the first few named)."""

    seen: int = 0
    changed: int = 0
    refused: int = 0
    examples: tuple[str, ...] = ()


def restrict_tree(
    client: Any,
    wanted: list[ACL],
    top: str,
    batch: int,
    skip: Callable[[str], bool] | None,
    fence: Callable[[], None],
) -> Restricted:
    """Give ``top`` and every znode under it the ACL ``wanted`` where it has another, except
    the subtrees whose root ``skip`` names, ``batch`` znodes at a time; ``fence`` is called
    before each batch of ACLs is set (raises to refuse it). Connection losses raise."""
    seen = changed = 0
    refused: list[str] = []
    level = [top] if client.exists(top) is not None else []
    while level:
        if skip is not None:
            level = [path for path in level if not skip(path)]
        deeper: list[str] = []
        for start in range(0, len(level), batch):
            chunk = level[start : start + batch]
            acls = [(path, client.get_acls_async(path)) for path in chunk]
            kids = [(path, client.get_children_async(path)) for path in chunk]
            setting = []
            fence()  # each batch of ACLs set
            for path, pending in acls:
                current = answer(pending, path, refused)
                if current is None:
                    continue
                seen += 1
                if not same_acl(current[0], wanted):
                    setting.append((path, client.set_acls_async(path, wanted)))
            changed += sum(answer(p, path, refused) is not None for path, p in setting)
            for path, pending in kids:
                children = answer(pending, path, [])
                deeper += [f"{path.rstrip('/')}/{child}" for child in children or ()]
        level = deeper
    return Restricted(seen, changed, len(refused), tuple(refused[:5]))


def answer(pending: Any, path: str, refused: list[str]) -> Any:
    """An asynchronous call's result; None when the znode went meanwhile or is not ours to
    touch (then its path is noted in ``refused``)."""
    try:
        return pending.get()
    except NoNodeError:
        return None
    except NoAuthError:
        refused.append(path)
        return None


def is_open(acls: Iterable[ACL]) -> bool:
    """Whether anyone may do something there (a ``world`` entry: ZooKeeper's default ACL)."""
    return any(a.id.scheme == "world" for a in acls)


def same_acl(current: Iterable[ACL], wanted: Iterable[ACL]) -> bool:
    return {(a.perms, a.id.scheme, a.id.id) for a in current} == {
        (a.perms, a.id.scheme, a.id.id) for a in wanted
    }
