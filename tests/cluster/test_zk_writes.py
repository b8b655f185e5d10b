"""The session's writes on the real ZooKeeper, counted in requests sent to the server (kazoo's
``_call``, which every request goes through): a ``Put`` marked ``new`` (an expert map
version's layer znodes, written once) is one request when its parent exists and still
overwrites a znode that exists (a retried write); an unmarked one is set first, one request for
a znode that exists (a version's head, once its layers made its znode)."""

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
        sent: list[str] = []
        client = session.client
        real = client._call

        def counted(request: Any, async_object: Any) -> Any:
            sent.append(type(request).__name__)
            return real(request, async_object)

        client._call = counted
        root = "/matrixserve-writes-test"

        async def apply(*ops: zl.ZnodeOp) -> list[str]:
            sent.clear()
            await session.run(session.apply, list(ops))
            return list(sent)

        # the first layer makes the version's znode (and the root) with it
        first = await apply(zl.Put(f"{root}/v1/0", b"layer 0", new=True))
        assert first[0] == "Create"
        assert "SetData" not in first
        # the next layers: one request each
        assert await apply(zl.Put(f"{root}/v1/1", b"layer 1", new=True)) == ["Create"]
        # the head, set where the layers made it: one request
        assert await apply(zl.Put(f"{root}/v1", b"head")) == ["SetData"]
        # a retried write of a layer there already: overwritten, not an error
        assert await apply(zl.Put(f"{root}/v1/1", b"again", new=True)) == ["Create", "SetData"]
        for path, data in ((f"{root}/v1/0", b"layer 0"), (f"{root}/v1/1", b"again")):
            assert await session.run(session.get, path) == data
        assert await session.run(session.get, f"{root}/v1") == b"head"
        # the zxid that made a znode stays while its data is set, and is new when made again
        _, made = await session.run(session.get_created, f"{root}/v1")
        await apply(zl.Put(f"{root}/v1", b"head, stamped again"))
        assert await session.run(session.get_created, f"{root}/v1") == (
            b"head, stamped again",
            made,
        )
        await session.run(session.delete, root, recursive=True)
        assert await session.run(session.get_created, f"{root}/v1") == (None, None)
        await apply(zl.Put(f"{root}/v1/0", b"layer 0", new=True), zl.Put(f"{root}/v1", b"h"))
        _, again = await session.run(session.get_created, f"{root}/v1")
        assert again is not None
        assert made is not None
        assert again > made
        await session.run(session.delete, root, recursive=True)
    finally:
        await asyncio.wait_for(session.stop(), 10)
