"""Loopback addressing for emulated nodes and pods (pure).

Every emulated node gets a /24 pod CIDR inside 127.64.0.0/10 (recorded in ``spec.podCIDR``, so
emulators sharing one API server never pick the same one); the node's own address is ``.1`` and
its pods get ``.2`` to ``.254``. Emulators of *different* clusters on one machine cannot see each
other's nodes, so each also holds an ``flock`` on a per-/24 file for as long as it runs
(:mod:`.emulator`), and skips /24s another process holds. Linux routes all of 127.0.0.0/8 to the loopback device, so a pod's
process binds its own 127.x.y.z without any interface set-up, and traffic never leaves the host.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

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
