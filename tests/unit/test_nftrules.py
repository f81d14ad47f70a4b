"""The nft rulesets of a nat child: what they say, and that nft itself accepts them."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest

from forkd.host.netpolicy import AddressPool, EgressPolicy, egress_policy, parse_allow_spec
from forkd.host.nftrules import ChildNetwork, host_link, host_ruleset, host_table, namespace_ruleset

POOL = AddressPool.parse("10.213.0.0/16")
DNS = ipaddress.IPv4Address("192.0.2.53")


def _net(policy: EgressPolicy, dns: ipaddress.IPv4Address | None = DNS) -> ChildNetwork:
    return ChildNetwork("sb-abcdefghijkl", POOL.lease(5), POOL.network, policy, dns)


def test_names_fit_the_kernel_limits() -> None:
    assert host_link("sb-abcdefghijkl") == "fkdabcdefghijkl" and len(host_link("sb-abcdefghijkl")) == 15
    assert host_table("sb-abcdefghijkl") == "forkd_sb_abcdefghijkl"


def test_allow_policy_lets_everything_out_but_the_pool() -> None:
    rules = namespace_ruleset(_net(EgressPolicy()))
    assert 'oifname "veth0" snat to 10.213.0.22' in rules
    assert "dnat to 192.0.2.53" in rules
    forward = rules[rules.index("chain forward"):]
    assert forward.index("ip daddr 10.213.0.0/16 drop") < forward.index('oifname "veth0" accept')


def test_deny_policy_lists_only_what_is_allowed() -> None:
    policy = egress_policy("deny", [parse_allow_spec("198.51.100.0/24:443,8000-8100/tcp"),
                                    parse_allow_spec("203.0.113.7/32")], dns=False)
    rules = namespace_ruleset(_net(policy))
    assert 'ip daddr 198.51.100.0/24 tcp dport { 443, 8000-8100 } accept' in rules
    assert 'ip daddr 203.0.113.7/32 accept' in rules
    assert 'oifname "veth0" accept' not in rules
    assert "192.0.2.53 udp dport 53 accept" not in rules  # dns=False: the resolver is not let through
    assert "udp dport 53 accept" in namespace_ruleset(_net(egress_policy("deny", [])))


def test_no_resolver_means_no_dns_rules() -> None:
    assert "dport 53" not in namespace_ruleset(_net(EgressPolicy(), dns=None))


def test_host_rules_keep_children_apart_and_off_the_host() -> None:
    rules = host_ruleset(_net(EgressPolicy()))
    assert 'iifname "fkdabcdefghijkl" oifname "fkd*" drop' in rules
    assert 'iifname "fkd*" oifname "fkdabcdefghijkl" drop' in rules
    assert 'iifname "fkdabcdefghijkl" reject with icmp type admin-prohibited' in rules
    assert 'iifname "fkdabcdefghijkl" oifname != "fkd*" masquerade' in rules


def test_host_services_published_by_dnat_and_link_local_are_refused_in_forward() -> None:
    host = host_ruleset(_net(EgressPolicy()))
    forward = host[host.index("chain forward"):host.index("chain postrouting")]
    assert 'iifname "fkdabcdefghijkl" ct status dnat reject with icmp type admin-prohibited' in forward
    assert 'iifname "fkdabcdefghijkl" ip daddr 169.254.0.0/16 meta l4proto tcp reject with tcp reset' in forward
    # In the namespace, before the policy: an allow-everything policy or an allow rule cannot open it.
    policy = egress_policy("deny", [parse_allow_spec("169.254.169.254/32:80/tcp")])
    for namespace in (namespace_ruleset(_net(EgressPolicy())), namespace_ruleset(_net(policy))):
        ns_forward = namespace[namespace.index("chain forward"):]
        blocked = ns_forward.index('ip daddr 169.254.0.0/16 reject with icmp type admin-prohibited')
        opened = ns_forward.index(" accept", ns_forward.index("established,related accept") + 30)
        assert blocked < opened


@pytest.mark.root("nft")  # nft -c needs root
def test_nft_accepts_the_rulesets() -> None:
    policy = egress_policy("deny", [parse_allow_spec("198.51.100.0/24:443/tcp"), parse_allow_spec("10.9.0.0/16:53")])
    for ruleset in (namespace_ruleset(_net(policy)), host_ruleset(_net(EgressPolicy()))):
        done = subprocess.run(["nft", "-c", "-f", "-"], input=ruleset, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr


def test_a_deny_list_under_allow_keeps_allowed_exceptions_first() -> None:
    """E2B's denyOut with allowOut: allowed entries win, the rest of the world stays open."""
    policy = egress_policy("allow", [parse_allow_spec("198.51.100.7/32")], deny=[ipaddress.IPv4Network("198.51.100.0/24")])
    forward = namespace_ruleset(_net(policy))
    forward = forward[forward.index("chain forward"):]
    allowed = forward.index("ip daddr 198.51.100.7/32 accept")
    denied = forward.index("ip daddr 198.51.100.0/24 meta l4proto tcp reject with tcp reset")
    assert allowed < denied < forward.index('oifname "veth0" accept')
    assert policy.to_dict()["deny"] == ["198.51.100.0/24"]


@pytest.mark.root("nft")
def test_nft_accepts_a_deny_list() -> None:
    policy = egress_policy("allow", [parse_allow_spec("198.51.100.7/32")], deny=[ipaddress.IPv4Network("198.51.100.0/24")])
    done = subprocess.run(["nft", "-c", "-f", "-"], input=namespace_ruleset(_net(policy)), capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
