"""``python -m matrixserve``: the MatrixServe operator (kopf).

Exit status 2 with a message on bad flags. See ``docs/operator.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
import uuid
from pathlib import Path

import kopf

from matrixserve.api.engine_settings import LoadSource
from matrixserve.api.zk_layout import Credentials
from matrixserve.coordination import add_auth_flags, auth_from
from matrixserve.domain.enginepod import EngineSettings, engine_network_policy
from matrixserve.domain.leadership import Timing
from matrixserve.domain.scaleout import Path as ScalePath
from matrixserve.handlers import kinds as registration
from matrixserve.handlers.expertpool import ExpertPools
from matrixserve.handlers.pdgroup import PDGroups
from matrixserve.handlers.runtime import OperatorConfig
from matrixserve.handlers.warmpool import WarmPools

# The kinds this operator runs (each a Controller class: handlers/controller.py); those with no
# controller yet (DPDomain) say so in their status (handlers/unserved.py).
KINDS: tuple[registration.KindClass, ...] = (PDGroups, WarmPools, ExpertPools)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _paths(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    known = {p.value for p in ScalePath}
    wrong = [n for n in names if n not in known]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(wrong) or text!r}: not a scale-out path (one of {', '.join(sorted(known))})"
        )
    return names


def _positive_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range")
    return value


def parse(argv: list[str] | None = None) -> tuple[OperatorConfig, argparse.Namespace]:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="python -m matrixserve", description="The MatrixServe operator."
    )
    p.add_argument(
        "--kubeconfig",
        default=env.get("KUBECONFIG"),
        help="default: $KUBECONFIG; without one: in-cluster, else ~/.kube/config",
    )
    p.add_argument(
        "--zookeeper",
        default=env.get("MATRIXSERVE_ZK"),
        help="host:port[/chroot] ($MATRIXSERVE_ZK)",
    )
    add_auth_flags(
        p,
        "; set, every znode under /matrixserve is made (or at start set) readable and writable "
        "by it alone (a group's once all its pods carry it), and engines get it from "
        "--engine-zookeeper-auth-secret; unset, znodes are open to every client",
    )
    p.add_argument(
        "--namespace", action="append", default=[], help="watch only these namespaces (repeatable)"
    )
    p.add_argument(
        "--engine-zookeeper",
        default=None,
        help="ZooKeeper address given to engines (default: --zookeeper)",
    )
    p.add_argument(
        "--engine-time-scale",
        default=env.get("MATRIXSERVE_TIME_SCALE", "1"),
        help="emulated seconds per wall second for engine stubs",
    )
    p.add_argument(
        "--engine-load-source",
        default=LoadSource.SHARED_FILE_SERVICE.value,
        choices=[source.value for source in LoadSource],
    )
    p.add_argument(
        "--engine-health-interval", default="20", help="emulated seconds between health reports"
    )
    p.add_argument(
        "--engine-pre-load-seconds",
        type=_non_negative,
        default=None,
        help="emulated seconds of TE-Pre-Load (Python, NPU and HCCL start-up) each engine "
        "process pays before it reports (default: the engine's calibrated 20 s; 0 for tests "
        "at time scale 1 that do not measure start-up)",
    )
    p.add_argument(
        "--scale-out-paths",
        type=_paths,
        default=(),
        help="the scale-out paths new instances may take, comma-separated, of "
        f"{', '.join(p.value for p in ScalePath)} (default: all, the fastest by estimate; one path: "
        "the scale-out benchmark's forced run)",
    )
    p.add_argument(
        "--engine-admission",
        choices=["reject", "queue"],
        default="reject",
        help="prefill admission: reject when busy (P/D-Serve) or queue (the gateway benchmark's baseline)",
    )
    p.add_argument(
        "--engine-zookeeper-auth-secret",
        default="matrixserve-engine-zookeeper-auth",
        help="the Secret (key 'auth') the operator writes with the identity into each namespace "
        "where it creates engine pods, and that they mount it from (one of that name that is "
        "not the operator's is left alone, and no engine pod created there)",
    )
    p.add_argument(
        "--engine-network-policy",
        default="",
        metavar="JSON",
        help="the engines' NetworkPolicy spec (JSON: who may reach the engine port; the chart "
        "passes its own engines' policy, rendered for any namespace), written by the operator "
        "into each namespace where it creates engine pods, before the first, and kept there; "
        "default: none written",
    )
    p.add_argument(
        "--engine-network-policy-name",
        default="matrixserve-engines",
        help="its name (the chart: its own engines' policy's, <release>-matrixserve-engines); "
        "one of that name that is not the operator's is left alone",
    )
    p.add_argument(
        "--engine-fault-injection",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="engines accept POST/DELETE /v1/faults (tests, demos); off: they answer 403",
    )
    p.add_argument("--metrics-address", default="127.0.0.1")
    p.add_argument(
        "--metrics-port", type=_positive_port, default=8080, help="0 disables the metrics server"
    )
    p.add_argument("--liveness-port", type=_positive_port, default=8081, help="0 disables /healthz")
    p.add_argument(
        "--liveness-address", default="127.0.0.1", help="where /healthz listens (a pod: its IP)"
    )
    p.add_argument(
        "--webhook",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the validating admission webhook (default on)",
    )
    p.add_argument("--webhook-address", default="127.0.0.1")
    p.add_argument("--webhook-port", type=_positive_port, default=9443)
    p.add_argument(
        "--webhook-host", default=None, help="host name in the webhook URL (default: the address)"
    )
    p.add_argument(
        "--webhook-managed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create and patch the ValidatingWebhookConfiguration (off: the Helm chart owns it)",
    )
    p.add_argument(
        "--webhook-secret",
        default=None,
        help="<namespace>/<name> of a TLS Secret (tls.crt, tls.key, ca.crt) to serve the webhook "
        "with, instead of --webhook-cert/--webhook-key/--webhook-ca files",
    )
    p.add_argument("--webhook-cert", default=env.get("MATRIXSERVE_WEBHOOK_CERT"))
    p.add_argument("--webhook-key", default=env.get("MATRIXSERVE_WEBHOOK_KEY"))
    p.add_argument("--webhook-ca", default=env.get("MATRIXSERVE_WEBHOOK_CA"))
    p.add_argument(
        "--resync-seconds", type=float, default=10.0, help="re-plan every group at least this often"
    )
    p.add_argument(
        "--zk-watches",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wake a group on ZooKeeper and pod changes (off: poll every --resync-seconds)",
    )
    p.add_argument(
        "--sweep-seconds",
        type=float,
        default=60.0,
        help="remove ZooKeeper data that belongs to nothing any more (a deleted group's "
        "subtree, a namespace's warm folder with no pool left, empty fork-source folders) on "
        "every new ZooKeeper session and at least this often",
    )
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run as one of several replicas: the one holding the Lease --leader-lease acts, "
        "the others serve the webhook and wait (default off: this operator acts alone)",
    )
    p.add_argument(
        "--leader-lease",
        default=None,
        help="<namespace>/<name> of the coordination.k8s.io Lease to elect on "
        "(default: $POD_NAMESPACE/matrixserve-operator)",
    )
    p.add_argument(
        "--leader-identity",
        default=None,
        help="this replica's name in the Lease (default: $POD_NAME, else the host name, with "
        "a random suffix: a restarted replica is a new candidate)",
    )
    p.add_argument(
        "--leader-lease-seconds", type=int, default=15, help="the Lease's duration (whole seconds)"
    )
    p.add_argument(
        "--leader-renew-seconds",
        type=float,
        default=10.0,
        help="a leader that has not renewed for this long stops acting and exits",
    )
    p.add_argument(
        "--leader-retry-seconds", type=float, default=2.0, help="how often candidates try"
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not args.zookeeper:
        p.error("--zookeeper (or $MATRIXSERVE_ZK) is required")
    try:
        if float(args.engine_time_scale) <= 0:
            raise ValueError
    except ValueError:
        p.error(f"--engine-time-scale {args.engine_time_scale!r} must be a positive number")
    auth: Credentials | None = auth_from(p, args)
    secret = args.engine_zookeeper_auth_secret
    if len(secret) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", secret):
        p.error(f"--engine-zookeeper-auth-secret {secret!r}: a Secret name (lower-case DNS name)")
    policy = args.engine_network_policy_name
    if len(policy) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", policy):
        p.error(f"--engine-network-policy-name {policy!r}: a lower-case DNS name")
    if args.engine_network_policy:
        try:
            spec = json.loads(args.engine_network_policy)
            engine_network_policy(policy, spec)
        except ValueError as exc:  # JSON's errors are ValueErrors too
            p.error(f"--engine-network-policy: {exc}")
        args.engine_network_policy = json.dumps(spec, sort_keys=True)
    for flag, value in (
        ("--resync-seconds", args.resync_seconds),
        ("--sweep-seconds", args.sweep_seconds),
    ):
        if not 0.1 <= value <= 3600:
            p.error(f"{flag} {value} must be within 0.1..3600")
    timing = Timing(
        lease=args.leader_lease_seconds,
        renew_deadline=args.leader_renew_seconds,
        retry=args.leader_retry_seconds,
    )
    lease, identity = None, ""
    if args.leader_elect:
        lease = args.leader_lease or f"{env.get('POD_NAMESPACE') or 'default'}/matrixserve-operator"
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?", lease):
            p.error(f"--leader-lease {lease!r} must be <namespace>/<name> (lower-case DNS names)")
        for problem in timing.problems():
            p.error(f"--leader-*-seconds: {problem}")
        if not timing.lease <= 3600:
            p.error(f"--leader-lease-seconds {timing.lease:g} must be at most 3600")
        identity = args.leader_identity or (
            f"{env.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        )
    if args.webhook_secret is not None and args.webhook_secret.count("/") != 1:
        p.error(f"--webhook-secret {args.webhook_secret!r} must be <namespace>/<name>")
    if args.webhook and args.webhook_secret:
        args.webhook_cert, args.webhook_key, args.webhook_ca = _webhook_files(
            p, args.kubeconfig, args.webhook_secret
        )
    if args.webhook:
        missing = [f for f in ("webhook_cert", "webhook_key", "webhook_ca") if not getattr(args, f)]
        if missing:
            p.error(
                "--webhook needs "
                + ", ".join("--" + m.replace("_", "-") for m in missing)
                + " (or --webhook-secret, or --no-webhook)"
            )
        for f in ("webhook_cert", "webhook_key", "webhook_ca"):
            if not Path(getattr(args, f)).is_file():
                p.error(f"--{f.replace('_', '-')} {getattr(args, f)}: no such file")
    config = OperatorConfig(
        kubeconfig=args.kubeconfig,
        zookeeper=args.zookeeper,
        engine=EngineSettings(
            zookeeper=args.engine_zookeeper or args.zookeeper,
            time_scale=str(args.engine_time_scale),
            load_source=LoadSource(args.engine_load_source),
            health_interval_seconds=str(args.engine_health_interval),
            admission=args.engine_admission,
            pre_load_seconds=None
            if args.engine_pre_load_seconds is None
            else f"{args.engine_pre_load_seconds:g}",
            scale_out_paths=args.scale_out_paths,
            fault_injection=args.engine_fault_injection,
            zookeeper_auth=auth,
            zookeeper_auth_secret=args.engine_zookeeper_auth_secret,
            network_policy=args.engine_network_policy,
            network_policy_name=args.engine_network_policy_name,
        ),
        metrics_address=args.metrics_address,
        metrics_port=args.metrics_port,
        webhook=args.webhook,
        webhook_address=args.webhook_address,
        webhook_port=args.webhook_port,
        webhook_host=args.webhook_host,
        webhook_cert=args.webhook_cert,
        webhook_key=args.webhook_key,
        webhook_ca=args.webhook_ca,
        webhook_managed=args.webhook_managed,
        resync_seconds=args.resync_seconds,
        zk_watches=args.zk_watches,
        sweep_seconds=args.sweep_seconds,
        namespaces=tuple(args.namespace),
        zookeeper_auth=auth,
        leader_lease=lease,
        leader_identity=identity,
        leader_timing=timing,
    )
    return config, args


def _webhook_files(
    p: argparse.ArgumentParser, kubeconfig: str | None, ref: str
) -> tuple[str, str, str]:
    """Write the webhook's TLS Secret to private files (a read-only root filesystem still has
    a writable temporary directory) and return their paths: cert, key, CA. The files (a private
    key among them) are removed when the operator exits."""
    import atexit
    import base64
    import shutil
    import tempfile

    from kubernetes import client

    from matrixserve.adapters.kube import api_client

    namespace, name = ref.split("/", 1)
    try:
        secret = client.CoreV1Api(api_client(kubeconfig)).read_namespaced_secret(name, namespace)
    except client.ApiException as exc:
        p.error(f"--webhook-secret {ref}: cannot read it ({exc.status} {exc.reason})")
    data = secret.data or {}
    missing = [k for k in ("tls.crt", "tls.key", "ca.crt") if k not in data]
    if missing:
        p.error(f"--webhook-secret {ref}: no {', '.join(missing)} in it")
    folder = Path(tempfile.mkdtemp(prefix="matrixserve-webhook-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    paths = []
    for key in ("tls.crt", "tls.key", "ca.crt"):
        path = folder / key
        path.touch(mode=0o600)
        path.write_bytes(base64.b64decode(data[key]))
        paths.append(str(path))
    return paths[0], paths[1], paths[2]


def main(argv: list[str] | None = None) -> int:
    config, args = parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kazoo").setLevel(logging.WARNING)
    registry = registration.register(KINDS, config.webhook, kopf.OperatorRegistry())
    liveness = (
        f"http://{args.liveness_address}:{args.liveness_port}/healthz"
        if args.liveness_port
        else None
    )
    memo = kopf.Memo(config=config, kinds=KINDS)
    kopf.run(
        registry=registry,
        standalone=True,  # kopf's peering off: the Lease elects (handlers/leadership.py)
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        memo=memo,
    )
    if getattr(memo, "leadership_lost", False):
        return 1  # deposed: the pod restarts it as a candidate
    return 0


if __name__ == "__main__":
    sys.exit(main())
