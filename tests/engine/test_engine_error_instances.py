"""A prefill names the decode in the error that ends a stream that decode took (issue 17: the
gateway passes the instances on in its error chunk, so a client tells a failure on a faulty
decode from one elsewhere): the decode's own error relayed (a die down on it mid-stream) and the
prefill's ``decode_failed`` when the decode went away mid-stream. Engines in this process on
loopback (``test_engine_exchanges``'s pair), the decode named by the decode meta's entries."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from aiohttp import web
from test_engine_exchanges import _body, _engine, _events, _pd_pair, _serving

from enginestub.engine.core import Engine
from enginestub.engine.server import build_app
from matrixserve.api import zk_layout as zl


def _meta(prefill: Engine, decode: Engine, name: str) -> None:
    """The prefill's decode meta, naming the decode ``name`` (as its resident process sets it)."""
    prefill.decode_entries = [
        zl.MapEntry(
            instance=name,
            podIP=decode.config.host,
            port=decode.config.port,
            roceIps=list(decode.config.roce_ips),
        )
    ]


async def _midway(client: httpx.AsyncClient, url: str, decode: Engine) -> asyncio.Task[Any]:
    """A long request, once the decode is streaming it."""
    task = asyncio.create_task(_events(client, f"{url}/v1/generate", _body("mid", out=4000)))
    while not decode.batch.places:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    return task


async def test_the_decodes_own_error_mid_stream_names_it() -> None:
    async with (
        _pd_pair("50", prefill_batch=1, decode_batch=4) as (prefill, p_url, decode, _),
        httpx.AsyncClient(trust_env=False, timeout=60) as client,
    ):
        _meta(prefill, decode, "g-d-1")
        task = await _midway(client, p_url, decode)
        decode.inject("die-down", {"die": decode.config.dies[0]})
        events = await task
    assert events[0]["type"] == "token"
    last = events[-1]
    assert (last["type"], last["code"]) == ("error", "device_fault")
    assert last["instances"] == {"prefill": prefill.config.instance, "decode": "g-d-1"}


async def test_a_decode_gone_mid_stream_is_named_in_decode_failed() -> None:
    decode = _engine("--role", "decode", "--time-scale", "50", "--max-batch", "4")
    prefill = _engine("--role", "prefill", "--time-scale", "50", "--max-batch", "1")
    prefill.decode_peers = [f"{decode.config.host}:{decode.config.port}"]
    _meta(prefill, decode, "g-d-0")
    await decode.start()
    # the decode served on a runner of its own, to be stopped mid-stream as a killed process is
    runner = web.AppRunner(build_app(decode), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, decode.config.host, decode.config.port).start()
    try:
        async with (
            _serving(prefill) as p_url,
            httpx.AsyncClient(trust_env=False, timeout=60) as client,
        ):
            task = await _midway(client, p_url, decode)
            await runner.cleanup()
            events = await task
    finally:
        await runner.cleanup()
    last = events[-1]
    assert (last["type"], last["code"]) == ("error", "decode_failed"), last
    assert last["instances"] == {"prefill": prefill.config.instance, "decode": "g-d-0"}
