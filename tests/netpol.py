"""A NetworkPolicy evaluator (pure): is a connection allowed under a set of policies?

Issue 16, finding 7: the chart's NetworkPolicies keep engines and ZooKeeper away from other pods.
The local cluster enforces no network policy, so ``tests/cluster/test_network_policy.py``
records the connections the pods really make and asks this module whether each would pass
where policies are enforced. The semantics are those of ``networking.k8s.io/v1``
(kubernetes.io/docs/concepts/services-networking/network-policies/):

- a pod is *isolated for ingress* when some policy in its namespace selects it (``podSelector``)
  and lists ``Ingress`` in ``policyTypes``; an isolated pod accepts a connection only when some
  such policy has an ingress rule that allows it. Egress likewise, on the source's side. A pod no
  policy isolates is open. A connection needs both sides: the source's egress and the
  destination's ingress. Policies are additive (a union), never ordered, never a deny;
- ``policyTypes`` left out means ``Ingress``, plus ``Egress`` when the policy has egress rules
  (the API server's defaulting);
- a rule with no ``from``/``to`` matches every peer, with no ``ports`` every port; ``ingress:
  []`` (or none) with ``Ingress`` in ``policyTypes`` allows nothing;
- a peer is a ``podSelector`` (pods of the policy's namespace), a ``namespaceSelector`` (every
  pod of the matching namespaces), both in one peer (those pods of those namespaces), or an
  ``ipBlock`` (``cidr`` minus ``except``, matched against the other side's IP; Kubernetes
  leaves an ipBlock that covers pod IPs to the implementation, here it matches any address);
- a port is a number or the name of a container port of the *destination* pod (ingress: the
  selected pod; egress: the peer), with ``protocol`` (default TCP) and an optional ``endPort``;
- label selectors: ``matchLabels`` and ``matchExpressions`` (``In``, ``NotIn``, ``Exists``,
  ``DoesNotExist``; ``NotIn`` also matches a pod without the key); an empty selector matches all.

Traffic between a pod and its own node (kubelet probes) is always allowed by implementations and
is no connection between pods here; callers pass only connections whose ends are pods or
addresses outside the cluster (``pod=None``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Labels = Mapping[str, str]
Policy = Mapping[str, Any]  # a NetworkPolicy as YAML/JSON (the rendered chart, the API server)


@dataclass(frozen=True)
class Pod:
    """A pod as policies see it: where it is, its labels, its IP and named container ports."""

    namespace: str
    name: str
    # Hashed by place, name and IP (mappings do not hash); compared by every field.
    labels: Labels = field(default_factory=dict, hash=False)
    ip: str = ""
    ports: Mapping[str, tuple[int, str]] = field(
        default_factory=dict, hash=False
    )  # name -> (port, protocol)


@dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod, or an address outside the cluster's pods (``pod=None``)."""

    ip: str
    pod: Pod | None = None

    @classmethod
    def of(cls, pod: Pod) -> Endpoint:
        return cls(pod.ip, pod)


@dataclass(frozen=True)
class Verdict:
    """Whether the connection passes, and why (which side refuses it, or what allows it)."""

    allowed: bool
    reason: str

    def __bool__(self) -> bool:
        return self.allowed


class Cluster:
    """The policies in force and the namespaces' labels (a ``namespaceSelector`` matches these)."""

    def __init__(
        self,
        policies: Iterable[Policy],
        namespaces: Mapping[str, Labels] | None = None,
        default_namespace: str = "default",
    ) -> None:
        self.policies = [p for p in policies if p.get("kind", "NetworkPolicy") == "NetworkPolicy"]
        self.namespaces = dict(namespaces or {})
        # Where a policy without metadata.namespace lives (`helm install -n`, `kubectl -n`).
        self.default_namespace = default_namespace

    def namespace_labels(self, namespace: str) -> Labels:
        return self.namespaces.get(namespace, {})

    def allows(
        self, source: Endpoint, destination: Endpoint, port: int, protocol: str = "TCP"
    ) -> Verdict:
        """The verdict on ``source`` -> ``destination:port/protocol``."""
        egress = self._side(source.pod, "Egress", destination, port, protocol)
        if not egress:
            return egress
        ingress = self._side(destination.pod, "Ingress", source, port, protocol)
        if not ingress:
            return ingress
        return Verdict(True, f"egress: {egress.reason}; ingress: {ingress.reason}")

    def isolating(self, pod: Pod, direction: str) -> list[Policy]:
        """The policies that isolate ``pod`` for ``direction`` (``Ingress`` or ``Egress``)."""
        return [
            p
            for p in self.policies
            if self._home(p) == pod.namespace
            and direction in policy_types(p)
            and selector_matches(p.get("spec", {}).get("podSelector") or {}, pod.labels)
        ]

    def _side(
        self, pod: Pod | None, direction: str, peer: Endpoint, port: int, protocol: str
    ) -> Verdict:
        if pod is None:
            return Verdict(True, "not a pod")
        policies = self.isolating(pod, direction)
        if not policies:
            return Verdict(True, f"{pod.namespace}/{pod.name} not isolated for {direction}")
        # The port's name is looked up on the destination: ingress, this pod; egress, the peer.
        target = pod if direction == "Ingress" else peer.pod
        rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        for policy in policies:
            for rule in policy.get("spec", {}).get(rules_key) or []:
                peers = rule.get(peers_key)
                if _ports_match(rule.get("ports"), port, protocol, target) and (
                    not peers  # no from/to: every peer
                    or any(self._peer_matches(p, self._home(policy), peer) for p in peers)
                ):
                    return Verdict(True, f"allowed by {self._home(policy)}/{_name(policy)}")
        names = ", ".join(f"{self._home(p)}/{_name(p)}" for p in policies)
        return Verdict(
            False,
            f"{pod.namespace}/{pod.name} is isolated for {direction} by {names} "
            f"and no rule allows {peer.pod.name if peer.pod else peer.ip} on {port}/{protocol}",
        )

    def _home(self, policy: Policy) -> str:
        return str(policy.get("metadata", {}).get("namespace") or self.default_namespace)

    def _peer_matches(self, peer: Mapping[str, Any], home: str, other: Endpoint) -> bool:
        if "ipBlock" in peer:
            return ip_in_block(other.ip, peer["ipBlock"])
        if "podSelector" not in peer and "namespaceSelector" not in peer:
            raise ValueError(f"a peer needs podSelector, namespaceSelector or ipBlock: {peer}")
        if other.pod is None:
            return False  # pod and namespace selectors select pods only
        pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
        if namespaces is None:
            in_namespace = other.pod.namespace == home
        else:
            in_namespace = selector_matches(namespaces, self.namespace_labels(other.pod.namespace))
        return in_namespace and (pods is None or selector_matches(pods, other.pod.labels))


def policy_types(policy: Policy) -> list[str]:
    """``spec.policyTypes``, defaulted as the API server does."""
    spec = policy.get("spec", {})
    declared = spec.get("policyTypes")
    if declared:
        return list(declared)
    return ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"]


def selector_matches(selector: Mapping[str, Any], labels: Labels) -> bool:
    """A LabelSelector against labels; the empty selector matches everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = set(expression.get("values") or [])
        present = key in labels
        if operator == "In":
            ok = present and labels[key] in values
        elif operator == "NotIn":
            ok = not present or labels[key] not in values
        elif operator == "Exists":
            ok = present
        elif operator == "DoesNotExist":
            ok = not present
        else:
            raise ValueError(f"unknown label selector operator {operator!r}")
        if not ok:
            return False
    return True


def ip_in_block(ip: str, block: Mapping[str, Any]) -> bool:
    """``ip`` inside ``cidr`` and outside every ``except``."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if address not in ipaddress.ip_network(block["cidr"], strict=False):
        return False
    return not any(
        address in ipaddress.ip_network(e, strict=False) for e in block.get("except") or []
    )


def _ports_match(
    ports: Sequence[Mapping[str, Any]] | None, port: int, protocol: str, target: Pod | None
) -> bool:
    if not ports:
        return True
    return any(_port_matches(entry, port, protocol, target) for entry in ports)


def _port_matches(entry: Mapping[str, Any], port: int, protocol: str, target: Pod | None) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    wanted = entry.get("port")
    if wanted is None:
        return True  # every port of this protocol
    if isinstance(wanted, str) and not wanted.isdigit():
        # A named port resolves on the destination pod, for the same protocol; an address that
        # is no pod has no named ports.
        named = (target.ports if target else {}).get(wanted)
        return named is not None and named == (port, protocol)
    low = int(wanted)
    return low <= port <= int(entry.get("endPort", low))


def _name(policy: Policy) -> str:
    return str(policy.get("metadata", {}).get("name", ""))
