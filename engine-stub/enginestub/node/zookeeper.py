"""The ``zookeeper`` image on the node emulator: ``python -m enginestub.node.zookeeper``.

Starts Debian's ZooKeeper (the ``zookeeper`` package's jars, a JRE) as the official image's
entrypoint would, with data in the pod's directory (the working directory the emulator gives
the container) and every port on the pod's own IP, never on all addresses:

- one server (no ``ZOO_SERVERS``, or one entry: the image's ``standaloneEnabled`` default): a
  standalone server, client port ``ZOO_PORT`` (2181) on the pod's IP;
- an ensemble (``ZOO_SERVERS``: ``server.<id>=<host>:<quorum>:<election>[;<client>] ...``, the
  image's format for 3.5+): those ``server.N`` lines, this server's own with the pod's IP as its
  address (its quorum and election ports bound there alone; ``quorumListenOnAllIPs``, which the
  chart sets for real clusters, is not honoured) and its client port on ``clientPortAddress``.
  Its id is the ``myid`` file in its data directory if there is one (the chart's init container
  writes it from the pod's ordinal; the emulator runs no init container), else ``ZOO_MY_ID``,
  else the ordinal of the pod's hostname + 1, and is written there as the image's entrypoint
  does. The peers' names (``<pod>.<headless Service>.<namespace>.svc.cluster.local``) resolve
  through the hosts file the emulator keeps (``$MATRIXSERVE_HOSTS_FILE``, :mod:`.hosts`): the
  JVM reads it with ``-Djdk.net.hosts.file`` and caches an answer for 1 s and a miss not at all,
  so a peer that starts late or comes back with another IP is found again.

``ZOO_4LW_COMMANDS_WHITELIST`` and ``ZOO_AUTOPURGE_PURGEINTERVAL`` are honoured; ``ZOO_CFG_EXTRA``
is not (it could open ports on every address). It replaces itself with the JVM, so signals and
exit codes are ZooKeeper's.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from enginestub.node.hosts import HOSTS_FILE_ENV

STANDALONE_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"
QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
# The JVM's address cache: an answer kept 1 s, a miss not kept (Debian's java.security keeps a
# miss 10 s, and its security property wins over the sun.net.inetaddr.* system properties).
ADDRESS_CACHE = "networkaddress.cache.ttl=1\nnetworkaddress.cache.negative.ttl=0\n"
_SERVER_KEY = re.compile(r"server\.([0-9]+)")
_ORDINAL = re.compile(r"-([0-9]+)$")
ROLES = ("participant", "observer")


def write_config(
    path: Path, data: Path, port: int | str, address: str, whitelist: str, extra: str = ""
) -> None:
    """A server's ``zoo.cfg``, standalone unless ``extra`` names servers (the dev cluster's
    ZooKeeper uses it too)."""
    path.write_text(
        "tickTime=2000\ninitLimit=10\nsyncLimit=5\n"
        f"dataDir={data}\n"
        f"clientPort={port}\n"
        f"clientPortAddress={address}\n"
        "admin.enableServer=false\nmaxClientCnxns=0\n"
        f"4lw.commands.whitelist={whitelist}\n" + extra
    )


def parse_servers(text: str) -> dict[int, str]:
    """``ZOO_SERVERS`` as the image's entrypoint reads it (entries separated by whitespace):
    server id -> what follows ``server.<id>=``."""
    servers: dict[int, str] = {}
    for entry in text.split():
        key, _, value = entry.partition("=")
        match = _SERVER_KEY.fullmatch(key)
        if match is None or not value:
            raise ValueError(
                f"ZOO_SERVERS: {entry!r} is not server.<id>=<host>:<quorum port>:<election port>"
                "[;<client port>]"
            )
        server_id = int(match.group(1))
        if server_id in servers:
            raise ValueError(f"ZOO_SERVERS names server.{server_id} twice")
        servers[server_id] = value
    return servers


def own_address(value: str, ip: str) -> str:
    """This server's entry as it binds it: the pod's IP for its host, its quorum and election
    ports and role kept, no client part (the client port comes from ``clientPortAddress``: a
    ``;2181`` there would listen on every address)."""
    address = value.split(";", 1)[0]
    if "|" in address:
        raise ValueError(f"{value!r}: several addresses for one server are not emulated")
    pieces = address.split(":")
    role = pieces.pop() if pieces[-1] in ROLES else ""
    if len(pieces) < 3 or not all(p.isdigit() for p in pieces[-2:]) or not pieces[0]:
        raise ValueError(f"{value!r} is not <host>:<quorum port>:<election port>[:<role>]")
    quorum, election = pieces[-2:]
    return f"{ip}:{quorum}:{election}" + (f":{role}" if role else "")


def hostname_ordinal(hostname: str) -> int | None:
    """A StatefulSet pod's ordinal, from its hostname (``<set>-<ordinal>``)."""
    match = _ORDINAL.search(hostname)
    return int(match.group(1)) if match else None


def choose_myid(stored: str | None, configured: str | None, hostname: str) -> int:
    """This server's id, in the order the chart and the image give it: a ``myid`` file already
    in the data directory, else ``ZOO_MY_ID``, else the hostname's ordinal + 1, else 1 (the
    entrypoint's default)."""
    for source, text in (("the myid file", stored), ("ZOO_MY_ID", configured)):
        if text is not None and text.strip():
            if not text.strip().isdigit() or not 1 <= int(text) <= 255:
                raise ValueError(f"{source} holds {text.strip()!r}, not a server id (1-255)")
            return int(text)
    ordinal = hostname_ordinal(hostname)
    return 1 if ordinal is None else ordinal + 1


def quorum_config(servers: Mapping[int, str], myid: int, ip: str) -> str:
    """The ensemble's part of ``zoo.cfg``: every server's line, this one's on the pod's IP."""
    if myid not in servers:
        listed = ", ".join(f"server.{n}" for n in sorted(servers))
        raise ValueError(f"this server's id is {myid}, and ZOO_SERVERS lists only {listed}")
    lines = ["quorumListenOnAllIPs=false"]
    for server_id in sorted(servers):
        value = servers[server_id]
        lines.append(f"server.{server_id}={own_address(value, ip) if server_id == myid else value}")
    return "\n".join(lines) + "\n"


def resolver_flags(hosts_file: str, security_file: Path) -> list[str]:
    """JVM flags: names from ``hosts_file`` (read again on every cache miss), the address cache
    of ``security_file`` (:data:`ADDRESS_CACHE`)."""
    return [f"-Djdk.net.hosts.file={hosts_file}", f"-Djava.security.properties={security_file}"]


def server_argv(
    java: str,
    config: Path,
    log_dir: Path,
    flags: Sequence[str] = (),
    main_class: str = STANDALONE_MAIN,
) -> list[str]:
    """The JVM command line of Debian's ZooKeeper server."""
    return [
        java,
        "-Xmx256m",
        f"-Dzookeeper.log.dir={log_dir}",
        "-Dzookeeper.root.logger=WARN,CONSOLE",
        *flags,
        "-cp",
        "/usr/share/java/*",
        main_class,
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
    extra = f"autopurge.purgeInterval={env.get('ZOO_AUTOPURGE_PURGEINTERVAL', '0')}\n"
    flags: list[str] = []
    main_class = STANDALONE_MAIN
    try:
        servers = parse_servers(env.get("ZOO_SERVERS", ""))
        if len(servers) > 1:
            myid_file = data / "myid"
            stored = myid_file.read_text() if myid_file.exists() else None
            myid = choose_myid(stored, env.get("ZOO_MY_ID"), env.get("HOSTNAME", ""))
            extra += quorum_config(servers, myid, ip)
            myid_file.write_text(f"{myid}\n")
            main_class = QUORUM_MAIN
            hosts = env.get(HOSTS_FILE_ENV)
            if hosts:
                security = here / "java.security"
                security.write_text(ADDRESS_CACHE)
                flags = resolver_flags(hosts, security)
            else:
                print(f"no ${HOSTS_FILE_ENV}: the peers' names go to the machine's resolver")
    except (ValueError, OSError) as exc:
        print(f"zookeeper: {exc}", file=sys.stderr)
        return 2
    config = here / "zoo.cfg"
    write_config(
        config,
        data,
        env.get("ZOO_PORT", "2181"),
        ip,
        env.get("ZOO_4LW_COMMANDS_WHITELIST", "ruok,srvr"),
        extra,
    )
    os.execv(java, server_argv(java, config, here, flags, main_class))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
