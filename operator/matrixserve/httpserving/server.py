"""Serving an application under the connection limits: the open-file limit raised, the caps
fitted to it, and the runner's server swapped for the guarded one (:func:`start`).
"""

from __future__ import annotations

import logging
import resource
from dataclasses import fields

from aiohttp import web
from prometheus_client import CollectorRegistry

from matrixserve.httpserving.connections import ConnectionGuard, GuardedServer
from matrixserve.httpserving.limits import ConnectionLimits

log = logging.getLogger("matrixserve.httpserving")


def raised_open_files_limit() -> int:
    """The process's open-file limit, its soft limit raised to the hard one first (the soft
    one is often 1,024, which would hold a server to 480 connections); -1: unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft not in (hard, resource.RLIM_INFINITY):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit over nr_open
            log.warning("the open-file limit stays %d (raising it to %d: %s)", soft, hard, exc)
        else:
            soft = hard
    return soft


async def start(
    runner: web.AppRunner,
    host: str,
    port: int,
    limits: ConnectionLimits,
    registry: CollectorRegistry | None = None,
) -> ConnectionGuard:
    """Set ``runner`` up and serve it on ``host:port`` under ``limits`` (fitted to the open-file
    limit), whatever else the runner was made with (``handler_cancellation``, ...); the caller
    stops it with ``runner.cleanup()``. Raises ``OSError`` if the address cannot be bound."""
    open_files = raised_open_files_limit()
    fitted = limits.within_open_files(open_files)
    if fitted != limits:
        log.warning(
            "at most %d connections (%d per client): the open-file limit (%d) allows no more",
            fitted.max_connections,
            fitted.max_connections_per_client,
            open_files,
        )
    log.info(
        "serving %s:%d with %s (open-file limit %d)",
        host,
        port,
        ", ".join(f"{f.name} {getattr(fitted, f.name)}" for f in fields(fitted)),
        open_files,
    )
    await runner.setup()
    assert runner.server is not None  # set by setup()
    guard = ConnectionGuard(fitted, registry)
    # the runner's own server, made by setup() from the application, is never listened on:
    # the site listens with this one, and the runner's cleanup shuts this one down
    runner._server = GuardedServer(runner.server, guard)
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return guard
