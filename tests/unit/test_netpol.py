"""The NetworkPolicy evaluator (``tests/netpol.py``) against Kubernetes' documented semantics
(issue 16, finding 7): isolation per direction, additive policies, the peer kinds and their
AND/OR forms, ports by number, name and range, protocol, policyTypes defaulting, selectors."""

from __future__ import annotations

from typing import Any

import pytest

from netpol import Cluster, Endpoint, Pod, ip_in_block, policy_types, selector_matches

NAMESPACES = {
    "app": {"team": "app", "kubernetes.io/metadata.name": "app"},
    "ops": {"team": "ops", "kubernetes.io/metadata.name": "ops"},
    "other": {"kubernetes.io/metadata.name": "other"},
}
DB = Pod("app", "db", {"role": "db"}, "10.0.0.10", {"sql": (5432, "TCP"), "dns": (53, "UDP")})
WEB = Pod("app", "web", {"role": "web"}, "10.0.0.11", {"http": (8080, "TCP")})
OPS_WEB = Pod("ops", "web", {"role": "web"}, "10.0.1.11")
OPS_TOOL = Pod("ops", "tool", {"role": "tool"}, "10.0.1.12")
OTHER_WEB = Pod("other", "web", {"role": "web"}, "10.0.2.11")
OUTSIDE = Endpoint("192.0.2.7")


def policy(name: str, spec: dict[str, Any], namespace: str = "app") -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def ingress_to_db(*rules: dict[str, Any]) -> dict[str, Any]:
    return policy("db", {"podSelector": {"matchLabels": {"role": "db"}}, "ingress": list(rules)})


def allows(
    policies: list[dict[str, Any]],
    source: Pod | Endpoint,
    dest: Pod,
    port: int,
    protocol: str = "TCP",
) -> bool:
    src = source if isinstance(source, Endpoint) else Endpoint.of(source)
    return bool(Cluster(policies, NAMESPACES).allows(src, Endpoint.of(dest), port, protocol))


def test_no_policy_leaves_every_pod_open() -> None:
    assert allows([], OTHER_WEB, DB, 5432)
    assert allows([], OUTSIDE, DB, 1)


def test_a_default_deny_isolates_only_its_direction_and_namespace() -> None:
    deny = [policy("deny", {"podSelector": {}, "policyTypes": ["Ingress"]})]
    assert not allows(deny, WEB, DB, 5432)  # ingress to db: isolated, no rule
    assert not allows(deny, OUTSIDE, DB, 5432)
    assert allows(deny, DB, OPS_WEB, 80)  # egress from db is not isolated; ops has no policy


def test_a_pod_selector_peer_means_pods_of_the_policys_own_namespace() -> None:
    rule = {"from": [{"podSelector": {"matchLabels": {"role": "web"}}}]}
    assert allows([ingress_to_db(rule)], WEB, DB, 5432)
    assert not allows([ingress_to_db(rule)], OPS_WEB, DB, 5432)  # same labels, other namespace
    assert not allows([ingress_to_db(rule)], OUTSIDE, DB, 5432)  # not a pod


def test_a_namespace_selector_peer_means_every_pod_of_those_namespaces() -> None:
    rule = {"from": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]}
    assert allows([ingress_to_db(rule)], OPS_TOOL, DB, 5432)
    assert allows([ingress_to_db(rule)], OPS_WEB, DB, 5432)
    assert not allows([ingress_to_db(rule)], WEB, DB, 5432)  # its own namespace is not "ops"
    assert not allows([ingress_to_db(rule)], OTHER_WEB, DB, 5432)


def test_both_selectors_in_one_peer_are_an_and_in_two_peers_an_or() -> None:
    ops = {"namespaceSelector": {"matchLabels": {"team": "ops"}}}
    web = {"podSelector": {"matchLabels": {"role": "web"}}}
    both = ingress_to_db({"from": [ops | web]})
    assert allows([both], OPS_WEB, DB, 5432)
    assert not allows([both], OPS_TOOL, DB, 5432)  # in ops but not web
    assert not allows([both], WEB, DB, 5432)  # web but not in ops
    either = ingress_to_db({"from": [ops, web]})
    assert allows([either], OPS_TOOL, DB, 5432)
    assert allows([either], WEB, DB, 5432)  # web of the policy's namespace
    assert not allows([either], OTHER_WEB, DB, 5432)  # web, but of another namespace


def test_an_empty_namespace_selector_with_a_pod_selector_means_those_pods_anywhere() -> None:
    anywhere = ingress_to_db({"from": [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"role": "web"}}}]})  # fmt: skip
    assert allows([anywhere], OTHER_WEB, DB, 5432)
    assert allows([anywhere], WEB, DB, 5432)
    assert not allows([anywhere], OPS_TOOL, DB, 5432)


def test_an_ip_block_matches_addresses_inside_the_cidr_and_outside_its_exceptions() -> None:
    block = ingress_to_db(
        {"from": [{"ipBlock": {"cidr": "192.0.2.0/24", "except": ["192.0.2.0/29"]}}]}
    )
    assert allows([block], Endpoint("192.0.2.100"), DB, 5432)
    assert not allows([block], OUTSIDE, DB, 5432)  # 192.0.2.7 is in the exception
    assert not allows([block], Endpoint("198.51.100.1"), DB, 5432)
    assert ip_in_block("10.0.0.11", {"cidr": "10.0.0.0/8"})
    assert not ip_in_block("not an ip", {"cidr": "0.0.0.0/0"})


def test_rules_without_from_or_ports_match_everything_and_no_rule_matches_nothing() -> None:
    assert allows([ingress_to_db({})], OUTSIDE, DB, 1)
    assert allows([ingress_to_db({"ports": [{"port": 5432}]})], OTHER_WEB, DB, 5432)
    assert not allows([ingress_to_db({"ports": [{"port": 5432}]})], OTHER_WEB, DB, 5433)
    assert not allows([ingress_to_db()], WEB, DB, 5432)


@pytest.mark.parametrize(
    ("entry", "port", "protocol", "expected"),
    [
        ({"port": 5432}, 5432, "TCP", True),
        ({"port": 5432}, 5432, "UDP", False),  # protocol defaults to TCP
        ({"port": 5432, "protocol": "UDP"}, 5432, "UDP", True),
        ({"port": "5432"}, 5432, "TCP", True),  # a number in a string is a number
        ({"port": "sql"}, 5432, "TCP", True),  # named: the destination's container port
        ({"port": "sql"}, 5433, "TCP", False),
        ({"port": "dns"}, 53, "TCP", False),  # the named port is UDP
        ({"port": "dns", "protocol": "UDP"}, 53, "UDP", True),
        ({"port": "http"}, 8080, "TCP", False),  # web's port name, not db's
        ({"port": 5000, "endPort": 6000}, 5432, "TCP", True),
        ({"port": 5000, "endPort": 6000}, 6001, "TCP", False),
        ({"protocol": "TCP"}, 1, "TCP", True),  # no port: every port of the protocol
        ({"protocol": "UDP"}, 1, "TCP", False),
    ],
)
def test_ports_by_number_name_range_and_protocol(
    entry: dict[str, Any], port: int, protocol: str, expected: bool
) -> None:
    assert allows([ingress_to_db({"ports": [entry]})], WEB, DB, port, protocol) is expected


def test_policies_add_up_and_one_in_another_namespace_selects_nothing_here() -> None:
    from_web = ingress_to_db({"from": [{"podSelector": {"matchLabels": {"role": "web"}}}]})
    from_ops = policy(
        "db-ops",
        {
            "podSelector": {"matchLabels": {"role": "db"}},
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]}],
        },
    )
    assert allows([from_web, from_ops], WEB, DB, 5432)
    assert allows([from_web, from_ops], OPS_TOOL, DB, 5432)
    assert not allows([from_web, from_ops], OTHER_WEB, DB, 5432)
    elsewhere = policy("deny", {"podSelector": {}, "policyTypes": ["Ingress"]}, namespace="ops")
    assert allows([elsewhere], OTHER_WEB, DB, 5432)
    assert not allows([elsewhere], WEB, OPS_TOOL, 80)


def test_egress_is_isolated_by_egress_rules_and_names_ports_on_the_destination() -> None:
    to_db = policy(
        "web-out",
        {
            "podSelector": {"matchLabels": {"role": "web"}},
            "egress": [
                {"to": [{"podSelector": {"matchLabels": {"role": "db"}}}],
                 "ports": [{"port": "sql"}]},
            ],
        },
    )  # fmt: skip
    assert policy_types(to_db) == ["Ingress", "Egress"]  # defaulted: it has egress rules
    assert allows([to_db], WEB, DB, 5432)
    assert not allows([to_db], WEB, DB, 5433)
    assert not allows([to_db], WEB, OPS_TOOL, 5432)  # not db
    assert not allows([to_db], WEB, WEB, 8080)
    outside = Cluster([to_db], NAMESPACES).allows(Endpoint.of(WEB), OUTSIDE, 5432)
    assert not outside  # an address outside has no named ports and no labels
    assert "isolated for Egress" in outside.reason
    # ... and the policy isolates web for ingress too (policyTypes defaulted to both)
    assert not allows([to_db], DB, WEB, 8080)


def test_a_connection_needs_the_sources_egress_and_the_destinations_ingress() -> None:
    egress_only = policy(
        "web-out", {"podSelector": {"matchLabels": {"role": "web"}}, "policyTypes": ["Egress"],
                    "egress": [{"ports": [{"port": 5432}]}]},
    )  # fmt: skip
    deny_db = ingress_to_db()
    verdict = Cluster([egress_only, deny_db], NAMESPACES).allows(
        Endpoint.of(WEB), Endpoint.of(DB), 5432
    )
    assert not verdict
    assert "app/db is isolated for Ingress" in verdict.reason
    assert allows([egress_only], WEB, DB, 5432)
    assert not allows([egress_only], WEB, DB, 80)
    assert allows([egress_only], DB, WEB, 8080)  # Egress only: web's ingress stays open


def test_a_policy_without_a_namespace_lives_in_the_default_one() -> None:
    deny = {"kind": "NetworkPolicy", "metadata": {"name": "deny"}, "spec": {"podSelector": {}}}
    assert not Cluster([deny], NAMESPACES, default_namespace="app").allows(
        Endpoint.of(WEB), Endpoint.of(DB), 5432
    )
    assert Cluster([deny], NAMESPACES, default_namespace="ops").allows(
        Endpoint.of(WEB), Endpoint.of(DB), 5432
    )


@pytest.mark.parametrize(
    ("expression", "labels", "expected"),
    [
        ({"key": "tier", "operator": "In", "values": ["a", "b"]}, {"tier": "a"}, True),
        ({"key": "tier", "operator": "In", "values": ["a"]}, {}, False),
        ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {"tier": "b"}, True),
        ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {}, True),  # absent: not in
        ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {"tier": "a"}, False),
        ({"key": "tier", "operator": "Exists"}, {"tier": ""}, True),
        ({"key": "tier", "operator": "Exists"}, {}, False),
        ({"key": "tier", "operator": "DoesNotExist"}, {}, True),
        ({"key": "tier", "operator": "DoesNotExist"}, {"tier": "a"}, False),
    ],
)
def test_label_selector_expressions(
    expression: dict[str, Any], labels: dict[str, str], expected: bool
) -> None:
    assert selector_matches({"matchExpressions": [expression]}, labels) is expected


def test_selectors_combine_labels_and_expressions_and_refuse_unknown_operators() -> None:
    selector = {
        "matchLabels": {"app": "x"},
        "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}],
    }
    assert selector_matches(selector, {"app": "x", "tier": "a"})
    assert not selector_matches(selector, {"app": "y", "tier": "a"})
    assert not selector_matches(selector, {"app": "x", "tier": "b"})
    assert selector_matches({}, {"anything": "at all"})
    with pytest.raises(ValueError, match="unknown label selector operator"):
        selector_matches({"matchExpressions": [{"key": "k", "operator": "Gt"}]}, {})


def test_a_peer_with_nothing_to_match_is_refused() -> None:
    with pytest.raises(ValueError, match="a peer needs"):
        allows([ingress_to_db({"from": [{}]})], WEB, DB, 5432)
