"""The ``zookeeper`` image on the node emulator: ``python -m enginestub.node.zookeeper``.

Starts Debian's ZooKeeper (the ``zookeeper`` package's jars, a JRE) as the container would: one
standalone server listening on the pod's IP, client port 2181 (``ZOO_PORT``), data in the pod's
directory (the working directory the emulator gives the container), the official image's
``ZOO_4LW_COMMANDS_WHITELIST`` and ``ZOO_AUTOPURGE_PURGEINTERVAL`` honoured. It replaces itself
with the JVM, so signals and exit codes are ZooKeeper's.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def write_config(
    path: Path, data: Path, port: int | str, address: str, whitelist: str, extra: str = ""
) -> None:
    """A standalone server's ``zoo.cfg`` (the dev cluster's ZooKeeper uses it too)."""
    path.write_text(
        "tickTime=2000\ninitLimit=10\nsyncLimit=5\n"
        f"dataDir={data}\n"
        f"clientPort={port}\n"
        f"clientPortAddress={address}\n"
        "admin.enableServer=false\nmaxClientCnxns=0\n"
        f"4lw.commands.whitelist={whitelist}\n" + extra
    )


def server_argv(java: str, config: Path, log_dir: Path) -> list[str]:
    """The JVM command line of Debian's ZooKeeper server."""
    return [
        java,
        "-Xmx256m",
        f"-Dzookeeper.log.dir={log_dir}",
        "-Dzookeeper.root.logger=WARN,CONSOLE",
        "-cp",
        "/usr/share/java/*",
        "org.apache.zookeeper.server.ZooKeeperServerMain",
        str(config),
    ]


def main() -> int:
    env = os.environ
    ip = env.get("MATRIXSERVE_POD_IP") or env.get("POD_IP") or "127.0.0.1"
    if not ip.startswith("127."):
        print(f"refusing to listen on {ip}: loopback addresses only", file=sys.stderr)
        return 2
    java = shutil.which("java")
    if java is None or not any(Path("/usr/share/java").glob("zookeeper*.jar")):
        print("needs a JRE and Debian's zookeeper package (/usr/share/java)", file=sys.stderr)
        return 2
    here = Path.cwd()
    data = here / "zookeeper-data"
    data.mkdir(exist_ok=True)
    config = here / "zoo.cfg"
    write_config(
        config,
        data,
        env.get("ZOO_PORT", "2181"),
        ip,
        env.get("ZOO_4LW_COMMANDS_WHITELIST", "ruok,srvr"),
        f"autopurge.purgeInterval={env.get('ZOO_AUTOPURGE_PURGEINTERVAL', '0')}\n",
    )
    os.execv(java, server_argv(java, config, here))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
