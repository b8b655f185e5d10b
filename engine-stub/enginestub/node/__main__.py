"""``python -m enginestub.node run|fault|status``: the node emulator and its fault CLI.

Examples::

    python -m enginestub.node run --superpods 1 --servers 4 --state-dir /tmp/emu
    python -m enginestub.node fault die-down --node sp0-server-00 --die 3 --state-dir /tmp/emu
    python -m enginestub.node fault die-down --node sp0-server-00 --die 3 --heal --state-dir /tmp/emu

Exit codes: 0 ok, 1 runtime failure, 2 bad arguments or configuration (with a message).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
import yaml
from pydantic import ValidationError

from enginestub.node.command import DEFAULT_SUPERPOD_PREFIX
from enginestub.node.topology import SuperPodSpec, TopologySpec, build, server_for_existing_node

BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m enginestub.node", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the emulator in the foreground")
    run.add_argument(
        "--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG"
    )
    run.add_argument(
        "--state-dir", type=Path, required=True, help="device files, pod dirs, emulator.json"
    )
    run.add_argument(
        "--topology", type=Path, help="YAML/JSON TopologySpec (overrides the flags below)"
    )
    run.add_argument("--superpods", type=int, default=1, help="number of SuperPods (default 1)")
    run.add_argument("--servers", type=int, default=2, help="servers per SuperPod (default 2)")
    run.add_argument("--npus-per-server", type=int, default=8)
    run.add_argument(
        "--superpod-prefix",
        default=DEFAULT_SUPERPOD_PREFIX,
        help="SuperPod names: <prefix>0, <prefix>1, ...",
    )
    run.add_argument(
        "--mode",
        choices=["full", "advertise"],
        default="full",
        help="full: kubelet+device plugin+faults; advertise (kind): device plugin+faults",
    )
    run.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="advertise mode: the node this instance serves (default $NODE_NAME)",
    )
    run.add_argument(
        "--image-map",
        type=Path,
        help="YAML {image repository: [entrypoint argv]} merged over the defaults",
    )
    run.add_argument("--lease-interval", type=float, default=10.0)
    run.add_argument("--status-interval", type=float, default=60.0)
    run.add_argument(
        "--backoff-base", type=float, default=10.0, help="restart back-off start, seconds"
    )
    run.add_argument("--backoff-max", type=float, default=300.0)
    run.add_argument(
        "--control-port", type=int, default=0, help="control API port on 127.0.0.1 (0: any)"
    )
    run.add_argument("--delete-nodes-on-exit", action="store_true")
    run.add_argument(
        "--no-zygote",
        action="store_true",
        help="start every engine-stub container as a fresh interpreter (no warm fork server)",
    )
    run.add_argument(
        "--service-proxy",
        action="store_true",
        help="route Services: listen on each ClusterIP:port (the cluster's service range must be "
        "loopback, 127.128.0.0/10) and forward to ready pods; inject <NAME>_SERVICE_HOST/PORT",
    )
    run.add_argument(
        "--service-cidr",
        default=None,
        help="the cluster's service range (with --service-proxy): held with a machine-wide lock",
    )
    run.add_argument(
        "--ssd-models",
        type=_models,
        default=(),
        metavar="MODEL[,MODEL]",
        help="the models every server's local SSD holds: given to every pod as "
        "$MATRIXSERVE_SSD_MODELS (a warm engine reports them; the operator may load from SSD)",
    )
    run.add_argument("--log-level", default="INFO")

    fault = sub.add_parser("fault", help="inject (or --heal) a fault through a running emulator")
    fault.add_argument(
        "kind", choices=["die-down", "npu-down", "link-down", "hbm-error", "node-down", "hang"]
    )
    fault.add_argument("--node")
    fault.add_argument("--die", type=int)
    fault.add_argument("--npu", type=int)
    fault.add_argument("--peer-node")
    fault.add_argument("--peer-die", type=int)
    fault.add_argument("--peer-roce-ip")
    fault.add_argument("--namespace")
    fault.add_argument("--pod")
    fault.add_argument("--heal", action="store_true")
    _control_args(fault)

    status = sub.add_parser("status", help="nodes and pods of a running emulator (JSON)")
    _control_args(status)
    return parser


def _models(text: str) -> tuple[str, ...]:
    """``MODEL[,MODEL]``: model names (a preset's, or a group spec's), none empty, no spaces."""
    models = tuple(m.strip() for m in text.split(","))
    if not all(models) or any(any(c.isspace() for c in m) for m in models):
        raise argparse.ArgumentTypeError(f"{text!r}: model names separated by commas expected")
    return tuple(dict.fromkeys(models))


def _control_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--state-dir", type=Path, help="find the emulator via <state-dir>/emulator.json"
    )
    group.add_argument("--control", help="control API URL, e.g. http://127.0.0.1:7070")


def _control_url(args: argparse.Namespace) -> str:
    if args.control:
        return str(args.control)
    path = args.state_dir / "emulator.json"
    if not path.exists():
        raise SystemExit(f"no running emulator: {path} does not exist")
    return str(json.loads(path.read_text())["control"])


def _topology(args: argparse.Namespace) -> TopologySpec:
    if args.topology:
        data = yaml.safe_load(args.topology.read_text())
        return TopologySpec.model_validate(data)
    return TopologySpec(
        superpods=[
            SuperPodSpec(
                name=f"{args.superpod_prefix}{i}",
                servers=args.servers,
                npus_per_server=args.npus_per_server,
            )
            for i in range(args.superpods)
        ]
    )


def _image_map(path: Path | None) -> dict[str, list[str]]:
    from enginestub.node.emulator import DEFAULT_IMAGE_MAP

    merged = dict(DEFAULT_IMAGE_MAP)
    if path is not None:
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
            for k, v in data.items()
        ):
            raise ValueError(f"{path}: expected a mapping of image repository to a list of strings")
        merged.update(data)
    return merged


async def _run(args: argparse.Namespace) -> int:
    from kubernetes import client, config

    from enginestub.node.emulator import Emulator, EmulatorConfig

    api = config.new_client_from_config(config_file=args.kubeconfig)
    if args.mode == "advertise":
        if not args.node_name:
            raise ValueError("advertise mode needs --node-name (or $NODE_NAME)")
        node = client.CoreV1Api(api).read_node(args.node_name)
        servers = [
            server_for_existing_node(
                args.node_name, node.metadata.labels or {}, args.npus_per_server
            )
        ]
    else:
        servers = build(_topology(args))
    service_lock = None
    if args.service_proxy and args.service_cidr:
        from enginestub.node.network import lock_service_cidr

        service_lock = lock_service_cidr(args.service_cidr)
        if service_lock is None:
            raise SystemExit(
                f"--service-cidr {args.service_cidr} is held by another cluster's node emulator"
            )
    server_url = urlparse(api.configuration.host)
    emulator = Emulator(
        EmulatorConfig(
            servers=servers,
            state_dir=args.state_dir,
            mode=args.mode,
            image_map=_image_map(args.image_map),
            lease_interval=args.lease_interval,
            status_interval=args.status_interval,
            backoff_base=args.backoff_base,
            backoff_max=args.backoff_max,
            control_port=args.control_port,
            apiserver_host=server_url.hostname,
            apiserver_port=server_url.port,
            apiserver_ca=api.configuration.ssl_ca_cert,
            service_proxy=args.service_proxy,
            delete_nodes_on_exit=args.delete_nodes_on_exit,
            zygote=not args.no_zygote,
            ssd_models=args.ssd_models,
        ),
        api,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, emulator.request_stop)
    try:
        await emulator.run()
    finally:
        api.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe is noise
        _use_pidfd_child_watcher()
        try:
            return asyncio.run(_run(args))
        except (ValidationError, ValueError, yaml.YAMLError, FileNotFoundError) as exc:
            print(f"node emulator: bad configuration: {exc}", file=sys.stderr)
            return BAD_CONFIG
    url = _control_url(args)
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as http:
        if args.command == "status":
            nodes = http.get("/nodes").json()
            pods = http.get("/pods").json()
            print(json.dumps({"nodes": nodes, "pods": pods}, indent=2))
            return 0
        body = {
            k: v
            for k, v in {
                "kind": args.kind,
                "node": args.node,
                "die": args.die,
                "npu": args.npu,
                "peerNode": args.peer_node,
                "peerDie": args.peer_die,
                "peerRoceIp": args.peer_roce_ip,
                "namespace": args.namespace,
                "pod": args.pod,
            }.items()
            if v is not None
        }
        response = http.request("DELETE" if args.heal else "POST", "/faults", json=body)
        print(json.dumps(response.json()))
        return 0 if response.is_success else BAD_CONFIG


def _use_pidfd_child_watcher() -> None:
    # Python 3.11's default child watcher starts one thread per child process; pidfds scale to
    # hundreds of pods without that.
    with contextlib.suppress(AttributeError, NotImplementedError, OSError):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            watcher = asyncio.PidfdChildWatcher()
            asyncio.set_child_watcher(watcher)


if __name__ == "__main__":
    sys.exit(main())
