"""``python -m matrixserve.devcluster setup|up|down|status|env``.

Exit codes: 0 ok; 1 a step failed (the message says which, where its log is, what to do);
3 ``env``/``status`` found no running cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matrixserve.devcluster import tools
from matrixserve.devcluster.cluster import DevCluster, export_lines
from matrixserve.devcluster.errors import DevClusterError
from matrixserve.devcluster.paths import default_state_dir

NOT_RUNNING = 3


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 48:
        raise argparse.ArgumentTypeError(f"{value} is out of range 1..48")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m matrixserve.devcluster",
        description=(
            f"A real local Kubernetes control plane (v{tools.KUBERNETES_VERSION}; "
            f"{tools.KUBERNETES_CHOICE}={tools.LEGACY_KUBERNETES_VERSION.rsplit('.', 1)[0]} for "
            f"v{tools.LEGACY_KUBERNETES_VERSION}) and ZooKeeper on 127.0.0.1."
        ),
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where pids, logs, data and the kubeconfig live "
        "(default: $MATRIXSERVE_STATE_DIR or ~/.local/state/matrixserve/devcluster)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("setup", help="install packages and build/cache Kubernetes; start nothing")
    up = sub.add_parser("up", help="start the cluster (idempotent) and print what runs")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    up.add_argument("--superpods", type=_positive, default=1, help="emulated SuperPods (default 1)")
    up.add_argument(
        "--servers",
        type=_positive,
        default=4,
        help="emulated 8-NPU servers per SuperPod (default 4)",
    )
    sub.add_parser("down", help="stop exactly the processes 'up' started")
    sub.add_parser("demo", help="up, then the operator and a sample PDGroup served end to end")
    status = sub.add_parser("status", help="show components, pids and addresses")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("env", help="print shell exports (KUBECONFIG, MATRIXSERVE_ZK, ...)")
    sub.add_parser(
        "images", help="build the operator/gateway and engine-stub images (docker, else podman)"
    )
    return parser


def print_status(cluster: DevCluster) -> bool:
    report = cluster.status()
    print(f"state dir:  {report['stateDir']}")
    print(f"running:    {'yes' if report['running'] else 'no'}")
    print(f"API server: {report['server']}")
    print(f"ZooKeeper:  {report['zookeeper']}")
    print(f"kubeconfig: {report['kubeconfig']}")
    print(f"nodes:      {report['nodeEmulator'] or '-'} (node emulator control API)")
    print(f"{'COMPONENT':<26}{'PID':>8}  STATE")
    for component in report["components"]:  # type: ignore[attr-defined]
        state = "running" if component["alive"] else "stopped"
        print(f"{component['name']:<26}{component['pid'] or '-':>8}  {state}")
    return bool(report["running"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster = DevCluster(args.state_dir or default_state_dir())
    try:
        if args.command == "setup":
            tools.setup(cluster.setup_log)
            tools.say(
                f"ready: Kubernetes binaries in {tools.kubernetes_bin_dir()}, "
                f"helm at {tools.helm_path()}"
            )
        elif args.command == "up":
            info = cluster.up(timeout=args.timeout, superpods=args.superpods, servers=args.servers)
            print_status(cluster)
            print(
                '\nTo use it:  eval "$(python -m matrixserve.devcluster env)"'
                f"  (KUBECONFIG={info.kubeconfig})"
            )
        elif args.command == "demo":
            from matrixserve.devcluster import demo

            info = cluster.up()
            print_status(cluster)
            return demo.run(info)
        elif args.command == "images":
            from matrixserve.devcluster import images

            for tag in images.build(cluster.state_dir / "images.log"):
                print(f"built and checked: {tag}")
        elif args.command == "down":
            stopped = cluster.down()
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        elif args.command == "status":
            if args.json:
                report = cluster.status()
                print(json.dumps(report, indent=2))
                return 0 if report["running"] else NOT_RUNNING
            return 0 if print_status(cluster) else NOT_RUNNING
        elif args.command == "env":
            running = cluster.info()
            if running is None or not cluster.is_running():
                print(
                    f"devcluster: no running cluster in {cluster.state_dir}; "
                    "start one with 'make cluster-up'",
                    file=sys.stderr,
                )
                return NOT_RUNNING
            print(export_lines(running))
    except DevClusterError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("devcluster: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
