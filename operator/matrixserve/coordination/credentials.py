"""MatrixServe's ZooKeeper identity, taken the same way by every process: from a file (a mounted
Secret) or, for the dev cluster and tests, from the environment (:func:`add_auth_flags`,
:func:`auth_from`), and the kazoo client's arguments that authenticate with it and give every
znode it creates an ACL granting it, and only it, everything (:func:`access`). Without an
identity, znodes are open to every client, as ZooKeeper's default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kazoo.security import make_digest_acl

from matrixserve.api import zk_layout as zl

AUTH_ENV = "MATRIXSERVE_ZK_AUTH"  # the identity, user:password (the dev cluster and tests)
AUTH_FILE_ENV = "MATRIXSERVE_ZK_AUTH_FILE"  # a file holding it (a mounted Secret)


def _parsed(text: str, where: str = "") -> zl.Credentials:
    try:
        return zl.Credentials.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{where}{exc}") from None


def _credentials(text: str) -> zl.Credentials | None:
    return _parsed(text) if text else None


def _credentials_file(path: str) -> zl.Credentials | None:
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    return _parsed(text, f"{path}: ")  # an empty file too: a Secret without its value


def add_auth_flags(parser: argparse.ArgumentParser, more: str = "") -> None:
    """``--zookeeper-auth-file`` (default ``$MATRIXSERVE_ZK_AUTH_FILE``: a mounted Secret's
    file) and ``--zookeeper-auth`` (default ``$MATRIXSERVE_ZK_AUTH``: the dev cluster and tests),
    taken the same way by every process: parsed into
    :class:`~matrixserve.api.zk_layout.Credentials`, empty for none, an unreadable file or a
    malformed identity refused (exit 2) with the reason. :func:`auth_from` gives the one in
    effect."""
    flags = [
        (
            "--zookeeper-auth-file",
            _credentials_file,
            AUTH_FILE_ENV,
            "PATH",
            f"a file holding MatrixServe's ZooKeeper digest identity, user:password "
            f"(${AUTH_FILE_ENV}; in a pod: a Secret mounted as a volume){more}",
        ),
        (
            "--zookeeper-auth",
            _credentials,
            AUTH_ENV,
            "USER:PASSWORD",
            f"the identity itself (${AUTH_ENV}: prefer it to the flag, which shows in the "
            "process list; in a pod prefer the file)",
        ),
    ]
    for flag, parse, variable, metavar, help_text in flags:
        parser.add_argument(
            flag, type=parse, default=os.environ.get(variable), metavar=metavar, help=help_text
        )


def auth_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> zl.Credentials | None:
    """The identity :func:`add_auth_flags` parsed; both given is refused (exit 2): two sources
    that may disagree would make this process a different identity than the others."""
    inline: zl.Credentials | None = args.zookeeper_auth
    from_file: zl.Credentials | None = args.zookeeper_auth_file
    if inline is not None and from_file is not None:
        parser.error(
            f"--zookeeper-auth (${AUTH_ENV}) and --zookeeper-auth-file (${AUTH_FILE_ENV}) are "
            "both given: give the ZooKeeper identity once"
        )
    return inline or from_file


def access(auth: zl.Credentials | None) -> dict[str, Any]:
    """A kazoo client's keyword arguments for ``auth``: authenticate with the digest identity and
    create every znode with an ACL that grants it everything and nobody else anything."""
    if auth is None:
        return {}
    return {
        "auth_data": [("digest", auth.text())],
        "default_acl": [make_digest_acl(auth.user, auth.password, all=True)],
    }
