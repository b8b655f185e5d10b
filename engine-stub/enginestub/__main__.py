"""``python -m enginestub``: the engine process that runs in every serving pod.

Reads its configuration (:mod:`enginestub.engine.config`), binds the pod's loopback IP, and
either joins a P/D group through ZooKeeper (the resident process: report, link, load, health)
or, without a group, loads its model and serves at once. Exit code 2 with one message on a bad
configuration.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

from aiohttp import web

from enginestub.engine.config import ConfigError, parse
from enginestub.engine.core import Engine
from enginestub.engine.server import build_app
from matrixserve import httpserving

BAD_CONFIG = 2


async def serve(argv: list[str] | None = None) -> int:
    config = parse(argv)
    engine = Engine(config)
    await engine.start()
    resident = None
    if config.group is not None:
        from enginestub.engine.resident import Resident

        resident = Resident(engine)
    app = build_app(
        engine,
        handshake=resident.check_handshake if resident else None,
        ready=(lambda: resident.ready) if resident else None,
    )
    runner = web.AppRunner(app, access_log=None)
    await httpserving.start(
        runner, config.host, config.port, config.connection_limits, engine.metrics.registry
    )
    logging.getLogger("enginestub").info(
        "engine %s (%s, %s on %d dies) on %s:%d, time scale %g",
        config.instance,
        config.role,
        config.model.name,
        len(config.dies),
        config.host,
        config.port,
        config.time_scale,
    )
    # The start-up heap out of the collector's reach: full collections over it are pauses of
    # tens of ms in which no stream moves, and at time scale 1 they are emulated time too.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if resident is not None:
        await resident.start()
    else:
        asyncio.get_running_loop().create_task(engine.load_model())
    stopping = asyncio.create_task(stop.wait())
    protocol = resident.task if resident is not None else None
    await asyncio.wait(
        {stopping} if protocol is None else {stopping, protocol},
        return_when=asyncio.FIRST_COMPLETED,
    )
    code = 0
    if protocol is not None and protocol.done() and not stopping.done():
        # the group protocol failed (e.g. links not verified in time): exit, so the container
        # restarts and the failure shows as restarts and this log line
        stopping.cancel()
        logging.getLogger("enginestub").error(
            "the group protocol failed: %s; exiting", protocol.exception()
        )
        code = 1
    if resident is not None:
        await resident.stop()
    await runner.cleanup()
    await engine.close()
    return code


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kazoo").setLevel(logging.WARNING)
    try:
        return asyncio.run(serve(argv))
    except ConfigError as exc:
        print(f"enginestub: invalid configuration: {exc}", file=sys.stderr)
        return BAD_CONFIG
    except OSError as exc:
        print(f"enginestub: cannot serve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
