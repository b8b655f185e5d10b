"""The ExpertPool store's reads: a map in force it cannot read is no map (the planner writes one
again), not an error that fails every pass of the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from matrixserve.adapters.zk_experts import ExpertStore
from matrixserve.api import zk_layout as zl
from matrixserve.domain.expertpool.expertmap import ExpertMap

PATHS = zl.ExpertPoolPaths("ns", "pool")


class _Session:
    """What the store reads of a session: data by path, children from the paths below."""

    connected = True

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data
        self.created: dict[str, int] = {}
        self.zxid = 1000

    async def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return fn(*args, **kw)

    def get(self, path: str) -> bytes | None:
        return self.data.get(path)

    def get_created(self, path: str) -> tuple[bytes | None, int | None]:
        """Each path's creation numbered the first time it is read with data (a path deleted
        and made again: forget it in :attr:`created`)."""
        raw = self.data.get(path)
        if raw is None:
            self.created.pop(path, None)
            return None, None
        if path not in self.created:
            self.zxid += 1
            self.created[path] = self.zxid
        return raw, self.created[path]

    def children(self, path: str) -> list[str]:
        return sorted(
            {p[len(path) + 1 :].split("/")[0] for p in self.data if p.startswith(path + "/")}
        )


def _written(version: int) -> dict[str, bytes]:
    m = ExpertMap(version, 2, 1, ("pool-s0", "pool-s1"), (((0,), (1,)),))
    head, layers = m.payloads()
    return {
        PATHS.version(version): head.dump(),
        PATHS.layer(version, 0): layers[0].dump(),
        PATHS.map: zl.ExpertMapPointer(version=version).dump(),
    }


def _read(data: dict[str, bytes]) -> tuple[ExpertMap | None, list[int]]:
    store = ExpertStore(_Session(data))  # type: ignore[arg-type]
    return asyncio.run(store.map_in_force("ns", "pool"))


def test_the_map_in_force_is_read_whole() -> None:
    current, versions = _read(_written(3))
    assert current is not None
    assert (current.version, current.held) == (3, (((0,), (1,)),))
    assert versions == [3]


def test_an_unreadable_pointer_or_version_is_no_map_not_an_error() -> None:
    assert _read({**_written(3), PATHS.map: b"{not json"}) == (None, [3])
    assert _read({**_written(3), PATHS.layer(3, 0): b'{"layer": "x"}'}) == (None, [3])
    assert _read({**_written(3), PATHS.version(3): b'{"version": 3}'}) == (None, [3])


class _Counting(_Session):
    def __init__(self, data: dict[str, bytes]) -> None:
        super().__init__(data)
        self.gets: list[str] = []

    def get(self, path: str) -> bytes | None:
        self.gets.append(path)
        return super().get(path)

    def delete(self, path: str, recursive: bool = False) -> bool:
        gone = [p for p in self.data if p == path or p.startswith(path + "/")]
        for p in gone:
            del self.data[p]
        return bool(gone)


def test_a_version_is_read_whole_once_then_its_head_alone() -> None:
    data = _written(3)
    session = _Counting(data)
    store = ExpertStore(session)  # type: ignore[arg-type]

    def read() -> ExpertMap | None:
        session.gets.clear()
        current, _ = asyncio.run(store.map_in_force("ns", "pool"))
        return current

    first = read()
    assert first is not None
    assert PATHS.layer(3, 0) in session.gets
    assert read() == first
    assert PATHS.layer(3, 0) not in session.gets  # the head alone, the layers remembered
    # its head rewritten (the walk's next phase put in force, stamped now): the same znode,
    # the same layers; the new head read
    head, _ = replace(first, at=9.0).payloads()
    data[PATHS.version(3)] = head.dump()
    again = read()
    assert again == replace(first, at=9.0)
    assert PATHS.layer(3, 0) not in session.gets
    # the pool deleted (by anyone) and made again between two passes: another znode under the
    # same number, read whole
    for path in [p for p in data if p.startswith(PATHS.root)]:
        del data[path]
        session.created.pop(path, None)
    m = ExpertMap(3, 2, 1, ("pool-s0", "pool-s1"), (((1,), (0,)),))
    head, layers = m.payloads()
    data.update({PATHS.version(3): head.dump(), PATHS.layer(3, 0): layers[0].dump()})
    data[PATHS.map] = zl.ExpertMapPointer(version=3).dump()
    made_again = read()
    assert made_again is not None
    assert made_again.held == (((1,), (0,)),)
    assert PATHS.layer(3, 0) in session.gets
