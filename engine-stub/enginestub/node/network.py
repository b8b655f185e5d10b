"""Loopback addressing for emulated nodes and pods (pure).

Every emulated node gets a /24 pod CIDR inside 127.64.0.0/10 (recorded in ``spec.podCIDR``, so
emulators sharing one API server never pick the same one); the node's own address is ``.1`` and
its pods get ``.2`` to ``.254``. Emulators of *different* clusters on one machine cannot see each
other's nodes, so each also holds an ``flock`` on a per-/24 file for as long as it runs
(:mod:`.emulator`), and skips /24s another process holds. Linux routes all of 127.0.0.0/8 to the loopback device, so a pod's
process binds its own 127.x.y.z without any interface set-up, and traffic never leaves the host.
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POD_NETWORK = ipaddress.IPv4Network("127.64.0.0/10")


class AddressExhausted(Exception):
    pass


def candidate_cidrs(
    taken: Iterable[str], network: ipaddress.IPv4Network = POD_NETWORK
) -> Iterator[str]:
    """The /24s of ``network`` that overlap none of ``taken``, in order."""
    used = [ipaddress.IPv4Network(c, strict=False) for c in taken if c]
    for subnet in network.subnets(new_prefix=24):
        if not any(subnet.overlaps(u) for u in used):
            yield str(subnet)


def choose_cidrs(
    count: int, taken: Iterable[str], network: ipaddress.IPv4Network = POD_NETWORK
) -> list[str]:
    """``count`` /24s from ``network`` that overlap none of ``taken``."""
    out = list(itertools.islice(candidate_cidrs(taken, network), count))
    if len(out) < count:
        raise AddressExhausted(f"no {count} free /24s left in {network}")
    return out


@dataclass
class NodeAddresses:
    cidr: str
    in_use: set[str] = field(default_factory=set)

    @property
    def host_ip(self) -> str:
        return str(ipaddress.IPv4Network(self.cidr).network_address + 1)

    def contains(self, ip: str) -> bool:
        try:
            return ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(self.cidr)
        except ValueError:
            return False

    def claim(self, preferred: str | None = None) -> str:
        """A free pod IP; ``preferred`` (e.g. the pod's IP before a restart) if it is free."""
        if (
            preferred
            and self.contains(preferred)
            and preferred not in self.in_use
            and preferred != self.host_ip
        ):
            self.in_use.add(preferred)
            return preferred
        hosts = list(ipaddress.IPv4Network(self.cidr).hosts())[1:]
        for ip in map(str, hosts):
            if ip not in self.in_use:
                self.in_use.add(ip)
                return ip
        raise AddressExhausted(f"no free pod address in {self.cidr}")

    def release(self, ip: str) -> None:
        self.in_use.discard(ip)


# --------------------------------------------------------------------------- Services
SERVICE_NETWORK = ipaddress.IPv4Network("127.128.0.0/10")  # ClusterIPs, one /16 per cluster
SERVICE_LOCKS = Path(tempfile.gettempdir()) / "matrixserve-service-cidrs"
POD_LOCKS = Path(tempfile.gettempdir()) / "matrixserve-pod-cidrs"


def lock_cidr(folder: Path, cidr: str) -> Any:
    """Hold a machine-wide lock on an address range (an open file in ``folder``; closing it, or
    the process ending, releases the lock); None if another process holds it."""
    folder.mkdir(mode=0o777, exist_ok=True)
    handle = (folder / cidr.replace("/", "_")).open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def lock_service_cidr(cidr: str) -> Any:
    return lock_cidr(SERVICE_LOCKS, cidr)


def free_service_cidr() -> str:
    """A service /16 nobody holds now (its cluster's node emulator holds it while it runs)."""
    for subnet in SERVICE_NETWORK.subnets(new_prefix=16):
        handle = lock_service_cidr(str(subnet))
        if handle is not None:
            handle.close()
            return str(subnet)
    raise AddressExhausted(f"every service /16 in {SERVICE_NETWORK} is in use")
