"""``python -m enginestub``: the engine process that runs in every serving pod.

This is the process skeleton: it binds the pod's loopback IP, answers ``/healthz`` and
``/readyz``, and reports its identity (pod, node, the dies it was granted and their RoCE IPs,
which the node emulator passes in the environment as the Ascend device plugin would). The
serving engine, the resident-process protocol and fault handling grow on it (SYSTEM.md §4).

Exit code 2 with a message on bad arguments or environment.
"""

from __future__ import annotations

import argparse
import os
import sys

from aiohttp import web

BAD_CONFIG = 2


def _identity() -> dict[str, object]:
    def listed(name: str) -> list[str]:
        raw = os.environ.get(name, "")
        return [x for x in raw.split(",") if x]

    return {
        "pod": os.environ.get("POD_NAME", ""),
        "namespace": os.environ.get("POD_NAMESPACE", ""),
        "node": os.environ.get("MATRIXSERVE_NODE_NAME", ""),
        "superpod": os.environ.get("MATRIXSERVE_SUPERPOD", ""),
        "npus": listed("MATRIXSERVE_NPUS"),
        "dies": listed("MATRIXSERVE_DIES"),
        "roceIps": listed("MATRIXSERVE_ROCE_IPS"),
        "deviceStatusFile": os.environ.get("MATRIXSERVE_DEVICE_STATUS_FILE", ""),
    }


def build_app() -> web.Application:
    identity = _identity()

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def info(_: web.Request) -> web.Response:
        return web.json_response(identity)

    app = web.Application()
    app.add_routes([web.get("/healthz", ok), web.get("/readyz", ok), web.get("/v1/info", info)])
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m enginestub")
    parser.add_argument(
        "--host",
        default=os.environ.get("MATRIXSERVE_POD_IP") or "127.0.0.1",
        help="address to bind (default: the pod IP, else 127.0.0.1)",
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("ENGINE_PORT", "8000")))
    args = parser.parse_args(argv)
    if not args.host.startswith("127."):
        print(
            f"enginestub: refusing to bind {args.host}: loopback addresses (127.0.0.0/8) only",
            file=sys.stderr,
        )
        return BAD_CONFIG
    if not 0 < args.port < 65536:
        print(f"enginestub: --port {args.port} is out of range", file=sys.stderr)
        return BAD_CONFIG
    web.run_app(build_app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
