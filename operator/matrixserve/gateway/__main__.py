"""``python -m matrixserve.gateway``: the OpenAI-compatible gateway. Exit 2 on bad flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web
from kazoo.client import KazooClient

from matrixserve.adapters.kube import api_client
from matrixserve.domain.forwarding import Policy
from matrixserve.gateway.app import Gateway, GatewayConfig
from matrixserve.gateway.discovery import Discovery


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="python -m matrixserve.gateway", description="MatrixServe's OpenAI-compatible gateway"
    )
    p.add_argument("--kubeconfig", default=env.get("KUBECONFIG"))
    p.add_argument("--zookeeper", default=env.get("MATRIXSERVE_ZK"))
    p.add_argument(
        "--namespace", default=None, help="serve only this namespace's PDGroups (default: all)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.ON_DEMAND.value)
    p.add_argument(
        "--time-scale",
        type=float,
        default=float(env.get("MATRIXSERVE_TIME_SCALE", "1")),
        help="the engines' emulated seconds per wall second (TTFT budgets are emulated)",
    )
    p.add_argument(
        "--default-ttft-ms", type=int, default=2000, help="TTFT budget when a group sets no SLO"
    )
    p.add_argument("--max-prompt-chars", type=int, default=200_000)
    p.add_argument("--max-tokens-limit", type=int, default=8192)
    p.add_argument(
        "--report-interval", type=float, default=0.1, help="least-loaded: queue report period"
    )
    args = p.parse_args(argv)
    if not args.zookeeper:
        p.error("--zookeeper (or $MATRIXSERVE_ZK) is required")
    if not args.host.startswith("127."):
        p.error("the gateway binds loopback addresses (127.0.0.0/8) only")
    if args.time_scale <= 0 or args.default_ttft_ms <= 0 or args.report_interval <= 0:
        p.error("--time-scale, --default-ttft-ms and --report-interval must be positive")
    return args


async def serve(args: argparse.Namespace) -> int:
    zk = KazooClient(hosts=args.zookeeper)
    await asyncio.to_thread(zk.start, 15)
    discovery = Discovery(api_client(args.kubeconfig), zk, args.namespace)
    discovery.start()
    gateway = Gateway(
        discovery,
        GatewayConfig(
            policy=Policy(args.policy),
            time_scale=args.time_scale,
            default_ttft_ms=args.default_ttft_ms,
            max_prompt_chars=args.max_prompt_chars,
            max_tokens_limit=args.max_tokens_limit,
            report_interval=args.report_interval,
        ),
    )
    await gateway.start()
    runner = web.AppRunner(gateway.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logging.getLogger("matrixserve.gateway").info(
        "gateway on %s:%d, policy %s", args.host, args.port, args.policy
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await gateway.close()
    discovery.stop()
    await asyncio.to_thread(zk.stop)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kazoo").setLevel(logging.WARNING)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
