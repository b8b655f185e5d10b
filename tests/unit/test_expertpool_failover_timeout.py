"""The pool's failover timeout reaches its clients through the map pointer (EaaS §3.4): every
pointer the planner writes carries ``spec.failoverTimeoutMilliseconds``; a pointer in force
with another value (the spec changed, or a pointer written before it carried one) is rewritten
alone, naming the same version; an equal one is left. The store reads the pointer with the map.

The planner is driven through its small world (:class:`unit.test_expertpool.World`), which keeps
the pointer's znode as the plans' effects write it."""

from __future__ import annotations

import asyncio

import pytest

from matrixserve.adapters.zk_experts import ExpertStore
from matrixserve.api import zk_layout as zl
from matrixserve.domain.expertpool.plan import WriteMapVersion, WritePointer
from unit.test_expertpool import PATHS, World, spec
from unit.test_zk_experts import _Session, _written

pytestmark = pytest.mark.unit


def pointer(w: World) -> zl.ExpertMapPointer:
    assert w.pointer is not None
    return zl.ExpertMapPointer.parse(w.pointer)


def respec(w: World, failover_ms: int) -> None:
    w.spec = w.spec.model_copy(update={"failover_timeout_milliseconds": failover_ms})
    w.generation += 1


def test_every_pointer_written_carries_the_specs_failover_timeout() -> None:
    w = World(spec(failoverTimeoutMilliseconds=250))
    written: list[WriteMapVersion] = []
    for _ in range(30):
        p = w.step()
        written += [a for a in p.actions if isinstance(a, WriteMapVersion)]
        if not p.actions:
            break
    assert len(written) >= 2  # the first map's walk: more than one pointer written
    pointers = [
        zl.ExpertMapPointer.parse(op.data)
        for a in written
        for op in a.znodes(PATHS)
        if isinstance(op, zl.Put) and op.path == PATHS.map
    ]
    assert [(x.version, x.failover_ms) for x in pointers] == [(a.map.version, 250) for a in written]
    assert w.current is not None
    assert pointer(w) == zl.ExpertMapPointer(
        version=w.current.version, at=w.current.at, failoverMs=250
    )


def test_a_changed_spec_rewrites_the_pointer_alone_then_nothing() -> None:
    w = World(spec())
    w.settle()
    assert w.current is not None
    before, version = pointer(w), w.current.version
    assert before.failover_ms == 1000  # the spec's default
    respec(w, 40)
    p = w.step()
    assert p.actions == [WritePointer(version, before.at, 40, 1000)]
    (put,) = p.actions[0].znodes(PATHS)
    assert put == zl.Put(PATHS.map, before.model_copy(update={"failover_ms": 40}).dump())
    assert pointer(w).version == version  # the same version: no map change for a setting
    event = p.actions[0].describe()
    assert event is not None
    assert event.message == (
        f"Failover timeout 40 ms (was 1000 ms) put in the map pointer (v{version}) for the clients"
    )
    assert w.step().actions == []  # equal now: idempotent, nothing more
    assert w.current.version == version


def test_a_pointer_that_carries_none_is_rewritten_with_the_specs() -> None:
    w = World(spec(failoverTimeoutMilliseconds=700))
    w.settle()
    assert w.current is not None
    w.pointer = zl.ExpertMapPointer(version=w.current.version, at=w.current.at).dump()
    (rewrite,) = w.step().actions
    assert isinstance(rewrite, WritePointer)
    assert (rewrite.failover_ms, rewrite.was) == (700, None)
    assert "(was the clients' own)" in rewrite.describe().message
    assert pointer(w).failover_ms == 700


def test_a_pointer_naming_another_version_than_the_one_read_is_not_rewritten() -> None:
    """The planner read the map by another pointer (moved between, or naming one unreadable):
    rewriting it with the map it read would move the pointer back."""
    w = World(spec())
    w.settle()
    assert w.current is not None
    w.pointer = zl.ExpertMapPointer(version=w.current.version + 1, failoverMs=5).dump()
    assert not any(isinstance(a, WritePointer) for a in w.step().actions)


def test_the_store_reads_the_pointer_with_the_map() -> None:
    data = _written(3)
    store = ExpertStore(_Session(data))
    current, versions, pointer = asyncio.run(store.in_force("ns", "pool"))
    assert current is not None
    assert versions == [3]
    assert pointer == zl.ExpertMapPointer(version=3)  # written before it carried one: None
    data[PATHS.map] = zl.ExpertMapPointer(version=3, at=1.5, failoverMs=250).dump()
    assert asyncio.run(store.in_force("ns", "pool"))[2] == zl.ExpertMapPointer(
        version=3, at=1.5, failoverMs=250
    )
    data[PATHS.map] = b"{not json"
    assert asyncio.run(store.in_force("ns", "pool")) == (None, [3], None)
