"""The node emulator's command line, for the programs that start one (the dev cluster, test
fixtures, benchmarks), and the Node names that command line gives (SYSTEM.md §5).

The flags themselves are defined by :mod:`enginestub.node.__main__`; this module only writes the
``run`` command so that its callers do not each spell it out.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from enginestub.node.topology import node_name

DEFAULT_SUPERPOD_PREFIX = "sp"


def run_argv(
    state_dir: Path,
    *,
    superpods: int,
    servers: int,
    prefix: str | None = None,
    delete_nodes_on_exit: bool = True,
    ssd_models: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m enginestub.node run`` for ``superpods`` SuperPods of ``servers`` servers each,
    state in ``state_dir``, every server's local SSD holding ``ssd_models``; ``extra`` flags
    follow (e.g. ``--service-proxy``)."""
    argv = [
        sys.executable,
        "-m",
        "enginestub.node",
        "run",
        "--state-dir",
        str(state_dir),
        "--superpods",
        str(superpods),
        "--servers",
        str(servers),
    ]
    if prefix is not None:
        argv += ["--superpod-prefix", prefix]
    if delete_nodes_on_exit:
        argv.append("--delete-nodes-on-exit")
    if ssd_models:
        argv += ["--ssd-models", ",".join(ssd_models)]
    return [*argv, *extra]


def node_names(superpods: int, servers: int, prefix: str = DEFAULT_SUPERPOD_PREFIX) -> list[str]:
    """The Nodes that ``run_argv(..., superpods=, servers=, prefix=)`` registers, in order."""
    return [node_name(f"{prefix}{p}", s) for p in range(superpods) for s in range(servers)]
