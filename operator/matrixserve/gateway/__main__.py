"""``python -m matrixserve.gateway``: the OpenAI-compatible gateway. Exit 2 on bad flags.

Stopping (a replica leaves without failing a request). On SIGTERM (or SIGINT) the
gateway first **drains** for ``--drain-seconds``: ``/healthz`` answers 503 ``draining``, so the
readiness probe fails and the Service stops sending here, while every request that still
arrives is served (its answer says ``Connection: close``). The default outlasts the chart's
readiness probe (every 2 s, 3 failures: 6 s) with a margin for the endpoints to be updated.
Then it stops accepting and gives the requests in flight ``--finish-seconds`` to end (then cuts
them), and exits 0. The chart sets the pod's ``terminationGracePeriodSeconds`` above both. A
second signal ends the drain at once (a developer's Ctrl-C twice).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys

from matrixserve import httpserving
from matrixserve.adapters.kube import api_client
from matrixserve.coordination import Session, add_auth_flags, auth_from
from matrixserve.domain.gateway.routing import Policy
from matrixserve.gateway.app import Gateway
from matrixserve.gateway.auth import keep_keys
from matrixserve.gateway.config import GatewayConfig
from matrixserve.gateway.discovery import Discovery

# Clients' own pools drop idle connections sooner (httpx and the openai client: 5 s, aiohttp: 15 s),
# so the gateway's idle limit never closes a connection a client is about to reuse.
CONNECTION_LIMITS = httpserving.ConnectionLimits(idle_timeout=75.0)
# The chart's readiness probe fails a drained replica after 2 s x 3; 2 s more for the Service's
# endpoints (and whatever load balancer watches them) to follow.
DRAIN_SECONDS = 8.0
MAX_DRAIN_SECONDS = 300.0
FINISH_SECONDS = 30.0
MAX_FINISH_SECONDS = 3600.0

log = logging.getLogger("matrixserve.gateway")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="python -m matrixserve.gateway", description="MatrixServe's OpenAI-compatible gateway"
    )
    p.add_argument("--kubeconfig", default=env.get("KUBECONFIG"))
    p.add_argument("--zookeeper", default=env.get("MATRIXSERVE_ZK"))
    add_auth_flags(p)
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
        "--report-interval",
        type=float,
        default=0.1,
        help="least-loaded: queue report period (emulated seconds, like the TTFT budgets)",
    )
    p.add_argument(
        "--api-keys-secret",
        default=None,
        help="<namespace>/<name> of a Secret whose entries are API keys; then /v1/* needs one",
    )
    p.add_argument(
        "--rate-limit", type=float, default=0.0, help="requests/s per API key (0: unlimited)"
    )
    p.add_argument("--rate-burst", type=float, default=10.0, help="burst allowed per API key")
    p.add_argument(
        "--answer-timeout",
        type=float,
        default=1.0,
        help="wall s a prefill has to accept or reject a request before the next is tried "
        "(an engine answers at admission; a hung one never does)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=DRAIN_SECONDS,
        help="on SIGTERM, s to keep serving with /healthz answering 503 before the listener "
        f"closes (0..{MAX_DRAIN_SECONDS:g}; default {DRAIN_SECONDS:g}: longer than the readiness "
        "probe takes to fail)",
    )
    p.add_argument(
        "--finish-seconds",
        type=float,
        default=FINISH_SECONDS,
        help="after the drain, s the requests in flight have to end before they are cut "
        f"(0 < s <= {MAX_FINISH_SECONDS:g}; default {FINISH_SECONDS:g})",
    )
    httpserving.add_arguments(p, "GATEWAY_", CONNECTION_LIMITS)
    args = p.parse_args(argv)
    args.zookeeper_auth = auth_from(p, args)  # the file's or the variable's
    if not args.zookeeper:
        p.error("--zookeeper (or $MATRIXSERVE_ZK) is required")
    if not args.host.startswith("127.") and args.host != env.get("POD_IP"):
        p.error(
            "the gateway binds a loopback address (127.0.0.0/8) or its own pod's IP ($POD_IP), "
            f"not {args.host}"
        )
    if (
        args.time_scale <= 0
        or args.default_ttft_ms <= 0
        or args.report_interval <= 0
        or not args.answer_timeout > 0
    ):
        p.error(
            "--time-scale, --default-ttft-ms, --report-interval and --answer-timeout must be "
            "positive"
        )
    if args.api_keys_secret is not None and args.api_keys_secret.count("/") != 1:
        p.error("--api-keys-secret must be <namespace>/<name>")
    if args.rate_limit < 0 or args.rate_burst < 1:
        p.error("--rate-limit must be >= 0 and --rate-burst >= 1")
    if not 0 <= args.drain_seconds <= MAX_DRAIN_SECONDS:
        p.error(
            f"--drain-seconds must be between 0 and {MAX_DRAIN_SECONDS:g}, "
            f"not {args.drain_seconds:g}"
        )
    if not 0 < args.finish_seconds <= MAX_FINISH_SECONDS:
        p.error(
            f"--finish-seconds must be above 0 and at most {MAX_FINISH_SECONDS:g}, "
            f"not {args.finish_seconds:g}"
        )
    return args


async def drain(gateway: Gateway, stop: asyncio.Event, seconds: float) -> None:
    """Serve on for ``seconds`` with readiness down (:meth:`Gateway.drain`); ``stop`` set
    again (a second signal) ends it sooner."""
    gateway.drain()
    stop.clear()
    log.info("draining for %g s: /healthz answers 503, requests are still served", seconds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def serve(args: argparse.Namespace) -> int:
    # Not waiting for ZooKeeper: until it is reached (and whenever it is lost) the gateway routes
    # by PDGroup status; kazoo keeps reconnecting.
    zk = Session(
        args.zookeeper,
        connection_retry={"max_tries": -1, "delay": 0.2, "max_delay": 5},
        auth=args.zookeeper_auth,
    )
    zk.start_background()
    api = api_client(args.kubeconfig)
    discovery = Discovery(api, zk, args.namespace)
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
            require_keys=args.api_keys_secret is not None,
            rate_limit=args.rate_limit,
            rate_burst=args.rate_burst,
            answer_timeout=args.answer_timeout,
        ),
    )
    await gateway.start()
    if args.api_keys_secret:
        namespace, name = args.api_keys_secret.split("/", 1)
        asyncio.get_running_loop().create_task(keep_keys(gateway.keys, api, namespace, name))
    # the requests in flight when the listener closes get --finish-seconds, then are cancelled
    runner = gateway.runner(shutdown_timeout=args.finish_seconds)
    await httpserving.start(
        runner, args.host, args.port, httpserving.limits_from(args), gateway.metrics.registry
    )
    log.info("gateway on %s:%d, policy %s", args.host, args.port, args.policy)
    # The start-up heap (Kubernetes and ZooKeeper clients, pydantic models: ~70k objects) is
    # moved out of the collector's reach: full collections otherwise traverse it every few
    # seconds under load, each a 30-55 ms pause of every stream (bench-gateway-overhead).
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(gateway, stop, args.drain_seconds)
    log.info("closing the listener; requests in flight have %g s to end", args.finish_seconds)
    await runner.cleanup()
    await gateway.close()
    discovery.stop()
    await zk.stop()
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
