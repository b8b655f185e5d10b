"""The session's writes on the real ZooKeeper: a ``Put`` marked ``new`` (an expert map
version's znodes, written once) creates the znode and its parents in one round trip and still
overwrites one that exists (a retried write); an unmarked one sets first, as before."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from matrixserve.api import zk_layout as zl
from matrixserve.coordination import Session


async def test_a_new_put_creates_first_and_overwrites_an_existing_znode(
    start_zookeeper: Callable[[], Any],
) -> None:
    server = start_zookeeper()
    session = Session(server.address, timeout=10.0)
    await session.connect(attempt_timeout=5.0, pause=0.2)
    try:
        calls: list[str] = []
        client = session.client
        for name in ("create", "set"):
            real = getattr(client, name)

            def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                calls.append(_name)
                return _real(*args, **kw)

            setattr(client, name, counted)
        root = "/matrixserve-writes-test"
        await session.run(session.apply, [zl.Put(f"{root}/v1/0", b"layer", new=True)])
        assert calls == ["create"]  # one round trip (its parents made with it)
        assert await session.run(session.get, f"{root}/v1/0") == b"layer"
        calls.clear()
        await session.run(session.apply, [zl.Put(f"{root}/v1/0", b"again", new=True)])
        assert calls == ["create", "set"]  # there already: overwritten, not an error
        assert await session.run(session.get, f"{root}/v1/0") == b"again"
        calls.clear()
        await session.run(session.apply, [zl.Put(f"{root}/v1", b"head")])
        assert calls == ["set"]  # unmarked: set first (the parent exists)
        assert await session.run(session.get, f"{root}/v1") == b"head"
        await session.run(session.delete, root, recursive=True)
    finally:
        await asyncio.wait_for(session.stop(), 10)
