"""``python -m enginestub``: the engine process that runs in every serving pod.

Reads its configuration (:mod:`enginestub.engine.config`), binds the pod's loopback IP, emulates
TE-Pre-Load (DeepServe §6.1), and either joins a P/D group through ZooKeeper (the resident
process: report, link, load, health) or, without a group, loads its model and serves at once.
A worker of an instance of several pods (rank >= 1) joins as its rank instead
(:mod:`enginestub.engine.ranks`): it holds its dies and keeps its rank report, its leader serves.
With ``--warm`` (``$ENGINE_WARM=1``) it is a pre-warmed, model-agnostic engine first
(:mod:`enginestub.engine.warm`): TE-Pre-Load, then it waits for an assignment and becomes the
engine that assignment describes, on the same address, without paying TE-Pre-Load again. Exit
code 2 with one message on a bad configuration (a bad assignment included).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from typing import TYPE_CHECKING

from aiohttp import web

from enginestub.engine.config import ConfigError, EngineConfig, parse, parse_warm
from enginestub.engine.core import Engine
from enginestub.engine.fork import LoadPlan
from enginestub.engine.server import ExpertCall, build_app
from matrixserve import httpserving

if TYPE_CHECKING:
    from enginestub.engine.attention import AttentionClient
    from enginestub.engine.experts import ExpertServer
    from enginestub.engine.ranks import RankWorker
    from enginestub.engine.resident import Resident

    Member = Resident | RankWorker | ExpertServer

BAD_CONFIG = 2
log = logging.getLogger("enginestub")


async def serve(argv: list[str] | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    warm = parse_warm(argv)
    if warm is None:
        return await run_engine(parse(argv), stop)
    from enginestub.engine.warm import assigned, wait_for_claim

    claim = await wait_for_claim(warm, stop)
    if claim is None:
        return 0
    config, plan = assigned(warm, claim, argv)
    return await run_engine(
        config, stop, plan, warm=True, started_wall=claim.started, pre_loaded=claim.pre_loaded
    )


async def run_engine(
    config: EngineConfig,
    stop: asyncio.Event,
    plan: LoadPlan | None = None,
    warm: bool = False,
    started_wall: float | None = None,
    pre_loaded: float = 0.0,
) -> int:
    """The engine on its address until ``stop``: TE-Pre-Load (none for a claimed warm pod),
    then the group protocol or, without a group, the load. 1 when the group protocol fails.
    A claimed warm pod's engine counts its readiness from ``started_wall`` (its claim) and says
    the TE-Pre-Load ``pre_loaded`` it paid in this process before it."""
    engine = Engine(config, plan=plan, warm=warm, started_wall=started_wall, pre_loaded=pre_loaded)
    await engine.start()
    resident: Member | None = None
    handshake = None
    calls: dict[str, ExpertCall] = {}
    client: AttentionClient | None = None
    if config.attention_client:  # a decode whose experts are the pool's (alone or a group's)
        from enginestub.engine.attention import AttentionClient

        client = AttentionClient(engine)
        calls["attention_step"] = client.attention_step
        await client.start()
    if config.role == "expert":
        from enginestub.engine.experts import ExpertServer

        resident = server = ExpertServer(engine)
        calls["expert_forward"] = server.forward
    elif config.group is not None and config.rank > 0:
        from enginestub.engine.ranks import RankWorker

        resident = RankWorker(engine)
    elif config.group is not None:
        from enginestub.engine.resident import Resident

        resident = leader = Resident(engine)
        handshake = leader.check_handshake
    members = [m for m in (resident, client) if m is not None]
    app = build_app(
        engine,
        handshake=handshake,
        ready=(lambda: all(m.ready for m in members)) if members else None,
        **calls,
    )
    runner = web.AppRunner(app, access_log=None)
    await httpserving.start(
        runner, config.host, config.port, config.connection_limits, engine.metrics.registry
    )
    log.info(
        "engine %s%s (%s, %s on %d dies) on %s:%d, time scale %g%s",
        config.instance,
        f" rank {config.rank} of {config.ranks}" if config.ranks > 1 else "",
        config.role,
        config.model.name,
        len(config.dies),
        config.host,
        config.port,
        config.time_scale,
        ", a claimed warm pod" if warm else "",
    )
    # The start-up heap out of the collector's reach: full collections over it are pauses of
    # tens of ms in which no stream moves, and at time scale 1 they are emulated time too.
    gc.collect()
    gc.freeze()
    bring_up = asyncio.create_task(_bring_up(engine, resident), name="bring-up")
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({stopping, bring_up}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if bring_up.done() and not stopping.done():
        # the group protocol failed (e.g. links not verified in time): exit, so the container
        # restarts and the failure shows as restarts and this log line
        log.error("the group protocol failed: %s; exiting", bring_up.exception())
        code = 1
    for task in (stopping, bring_up):
        task.cancel()
        with contextlib.suppress(BaseException):  # cancelled, or the failure already logged
            await task
    # Before the server stops: the forks it serves are answered (aborted: their targets fall
    # back at once) rather than cut or kept waiting through the server's shutdown.
    engine.shutdown("the engine is stopping")
    if resident is not None:
        await resident.stop()
    if client is not None:
        await client.stop()
    await runner.cleanup()
    await engine.close()
    return code


async def _bring_up(engine: Engine, resident: Member | None) -> None:
    """TE-Pre-Load, then the group's or the expert pool's protocol (it ends only by failing)
    or the load alone."""
    await engine.pre_load()
    if resident is None:
        await engine.load_model()
        await asyncio.Future()  # serve until stopped
        return
    await resident.start()
    assert resident.task is not None
    await resident.task


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
