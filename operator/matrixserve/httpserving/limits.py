"""The HTTP serving's deadlines and connection caps (:class:`ConnectionLimits`), fitted to the
process's open-file limit, and their flags (each defaulting to an environment variable, a bad
value an argparse error).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from dataclasses import dataclass, fields, replace

# file descriptors kept for everything but the served connections (logs, ZooKeeper, listeners)
RESERVED_FDS = 64


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # s from a request head's first byte to its end
    body_timeout: float = 60.0  # s from a request's head to its body's end
    idle_timeout: float = 75.0  # s a keep-alive connection may wait for its next request
    send_timeout: float = 60.0  # s a response's write may stall (its client reading nothing)
    max_connections: int = 8192
    max_connections_per_client: int = 4096

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "idle_timeout", "send_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value}")
        for name in ("max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value}")

    def within_open_files(self, soft_limit: int) -> ConnectionLimits:
        """The caps fitted to the process's open-file limit: every relayed stream holds its
        outgoing connection too, so at most half of what is left after :data:`RESERVED_FDS`."""
        if soft_limit < 0:  # RLIM_INFINITY
            return self
        room = max(1, (soft_limit - RESERVED_FDS) // 2)
        if self.max_connections <= room:
            return self
        return replace(
            self,
            max_connections=room,
            max_connections_per_client=min(self.max_connections_per_client, room),
        )


_FLAGS = {
    "header_timeout": "s a request's line and headers may take from their first byte",
    "body_timeout": "s a request's body may take from the end of its head (then 408)",
    "idle_timeout": "s a keep-alive connection may wait for its next request",
    "send_timeout": "s a response's write may stall, its client reading nothing (then closed)",
    "max_connections": "connections open at once (more are refused: 503 with Retry-After)",
    "max_connections_per_client": "connections open at once from one client address",
}


def _positive_seconds(text: str, env: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds ({env})")
    return value


def _positive_count(text: str, env: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer ({env})")
    return value


def add_arguments(
    parser: argparse.ArgumentParser, env_prefix: str, defaults: ConnectionLimits
) -> None:
    """``--header-timeout``, ``--body-timeout``, ``--idle-timeout``, ``--send-timeout``,
    ``--max-connections``, ``--max-connections-per-client``, each defaulting to
    ``$<env_prefix><NAME>`` or ``defaults``. Bad values (from a flag or the environment) are
    argparse errors: exit 2 with the flag named."""
    group = parser.add_argument_group("connection limits")
    for field in fields(ConnectionLimits):
        default = getattr(defaults, field.name)
        env = env_prefix + field.name.upper()
        kind = _positive_seconds if isinstance(default, float) else _positive_count
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=functools.partial(kind, env=f"the flag, or ${env}"),
            # a string default goes through ``type`` too: a bad environment value is reported
            default=os.environ.get(env, str(default)),
            help=f"{_FLAGS[field.name]} (default {default}; ${env})",
        )


def limits_from(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(**{f.name: getattr(args, f.name) for f in fields(ConnectionLimits)})
