"""Which pod opened which TCP connection, sampled from ``/proc`` (issue 16, finding 7: the
chart's NetworkPolicies are judged against the connections pods really make; see
``tests/cluster/test_network_policy.py``).

Pods on the local cluster are processes (each container its own session, led by the pid the node
emulator lists) on per-pod 127.x addresses. A process's outgoing connections do not bind its
pod's address, so a connection is told by its socket's owner: every sample asks the kernel for
its TCP sockets (sock_diag, as ``ss`` does: addresses, state, inode) and reads the socket inodes
of the pods' processes (``/proc/<pid>/fd``) -- ``ss -tnp`` without a process per sample. A pod's socket whose peer address is a
listening socket is the client side (the server side's peer is an ephemeral port, which the
kernel never hands out while a listener binds it).

Run as its own process (``python pod_sockets.py EMULATOR_URL NAMESPACE OUT``) so that sampling
every 50 ms does not wait for the test process's threads; it appends one JSON line per newly
seen ``[pod UID, peer IP, peer port]`` and per pod IP to ``OUT``, and a last line with the number
of samples when it gets SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

SAMPLE_EVERY = 0.05
PODS_EVERY = 0.5


@dataclass(frozen=True)
class Socket:
    local: tuple[str, int]
    remote: tuple[str, int]
    listening: bool
    inode: int


# sock_diag (linux/inet_diag.h): the dump ``ss`` asks the kernel for, filtered by state in the
# kernel (the table holds thousands of TIME_WAIT sockets of every test and cluster here).
NETLINK_INET_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN, TCP_TIME_WAIT = 10, 6
STATES = ((1 << 12) - 1) & ~(1 << TCP_TIME_WAIT)  # every TCP state but TIME_WAIT (no owner)


def _ip(family: int, raw: bytes) -> str:
    """An address as text; an IPv4-mapped IPv6 one (a JVM's sockets) as its IPv4 one."""
    text = socket.inet_ntop(family, raw[: 4 if family == socket.AF_INET else 16])
    return text.removeprefix("::ffff:") if "." in text else text


def read_sockets(family: int = socket.AF_INET) -> list[Socket]:
    """The TCP sockets of one family in this network namespace (TIME_WAIT ones left out)."""
    request = struct.pack("=BBBxI48x", family, socket.IPPROTO_TCP, 0, STATES)
    header = struct.pack(
        "=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
    )
    out: list[Socket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_INET_DIAG) as diag:
        diag.sendall(header + request)
        while True:
            data = diag.recv(1 << 16)
            offset = 0
            while offset < len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    raise OSError("sock_diag refused the dump")
                # inet_diag_msg: family, state, timer, retrans; id (ports, addresses); inode
                body = offset + 16
                state = data[body + 1]
                sport, dport = struct.unpack_from(">HH", data, body + 4)
                (inode,) = struct.unpack_from("=I", data, body + 68)
                local = (_ip(family, data[body + 8 : body + 24]), sport)
                remote = (_ip(family, data[body + 24 : body + 40]), dport)
                out.append(Socket(local, remote, state == TCP_LISTEN, inode))
                offset += (length + 3) & ~3


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def sessions() -> dict[int, list[int]]:
    """Every process by its session id (a container's processes share its pid as session)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                sid = int(stat[stat.rindex(")") + 2 :].split()[3])
                out.setdefault(sid, []).append(int(entry))
    return out


def client_sides(owners: dict[int, str], table: list[Socket]) -> set[tuple[str, str, int]]:
    """``(owner, peer IP, peer port)`` of each owned socket whose peer listens (on its address
    or on every address)."""
    listeners = {s.local for s in table if s.listening}

    def listens(address: tuple[str, int]) -> bool:
        return any(a in listeners for a in (address, ("0.0.0.0", address[1]), ("::", address[1])))

    return {
        (owners[s.inode], *s.remote)
        for s in table
        if s.inode in owners and not s.listening and listens(s.remote)
    }


class Sampler:
    """The pods of one namespace (their processes, from the node emulator) and their sockets."""

    def __init__(self, emulator: str, namespace: str, out: IO[str]) -> None:
        self.http = httpx.Client(base_url=emulator, timeout=5, trust_env=False)
        self.namespace = namespace
        self.out = out
        self.pids: dict[int, str] = {}  # pid -> pod UID
        self.ips: dict[str, str] = {}
        self.seen: set[tuple[str, str, int]] = set()
        self.samples = 0

    def refresh(self) -> None:
        leaders = {}
        for pod in self.http.get("/pods").json():
            if pod["namespace"] != self.namespace:
                continue
            leaders.update(dict.fromkeys(pod["pids"].values(), pod["uid"]))
            if pod.get("podIP") and self.ips.get(pod["uid"]) != pod["podIP"]:
                self.ips[pod["uid"]] = pod["podIP"]
                self._write({"ip": [pod["uid"], pod["podIP"]]})
        self.pids = {
            pid: leaders[sid] for sid, ps in sessions().items() if sid in leaders for pid in ps
        }

    def sample(self) -> None:
        owners = {inode: uid for pid, uid in self.pids.items() for inode in socket_inodes(pid)}
        if owners:
            table = read_sockets(socket.AF_INET) + read_sockets(socket.AF_INET6)
            for seen in client_sides(owners, table) - self.seen:
                self.seen.add(seen)
                self._write({"seen": list(seen)})
        self.samples += 1

    def _write(self, record: dict[str, object]) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


def main(argv: list[str]) -> int:
    emulator, namespace, path = argv
    stopped = False

    def stop(*_: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    with open(path, "a") as out:
        sampler = Sampler(emulator, namespace, out)
        refreshed = 0.0
        while not stopped:
            began = time.monotonic()
            if began - refreshed >= PODS_EVERY:
                with contextlib.suppress(httpx.HTTPError):
                    sampler.refresh()
                refreshed = began
            sampler.sample()
            time.sleep(max(0.0, began + SAMPLE_EVERY - time.monotonic()))  # a sample per period
        out.write(json.dumps({"samples": sampler.samples}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
