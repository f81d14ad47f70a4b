"""Egress policy validation and the address pool's arithmetic."""

from __future__ import annotations

import ipaddress

import pytest

from forkd.daemon.routes.sandboxes import isolation_of
from forkd.daemon.schemas import SandboxCreate
from forkd.host.netpolicy import (
    AddressPool,
    NetRequest,
    allow_rule,
    egress_policy,
    net_request_of,
    parse_allow_spec,
    parse_cidr,
)
from forkd.runtime.isolation import SandboxOptions, sandbox_meta
from forkd.validation import ValidationError


def test_allow_spec_forms() -> None:
    rule = parse_allow_spec("203.0.113.0/24:80,8000-8080/tcp")
    assert (str(rule.cidr), rule.ports, rule.protocol) == ("203.0.113.0/24", ((80, 80), (8000, 8080)), "tcp")
    assert parse_allow_spec("10.1.2.3/32").ports == () and parse_allow_spec("10.1.2.3/32").protocol == "any"
    assert parse_allow_spec("10.0.0.0/8:53/udp").to_dict() == {"cidr": "10.0.0.0/8", "ports": ["53"],
                                                              "protocol": "udp"}


@pytest.mark.parametrize("cidr", ["10.0.0.1/8", "::1/128", "banana", "300.0.0.0/8", "10.0.0.0/33"])
def test_bad_networks_are_refused(cidr: str) -> None:
    with pytest.raises(ValidationError):
        allow_rule(cidr)


@pytest.mark.parametrize("ports", [[0], [65536], ["90-80"], ["x"], list(range(1, 40))])
def test_bad_ports_are_refused(ports: list) -> None:
    with pytest.raises(ValidationError):
        allow_rule("10.0.0.0/8", ports)


def test_policy_rules() -> None:
    with pytest.raises(ValidationError, match="deny"):
        egress_policy("allow", [allow_rule("10.0.0.0/8")])
    with pytest.raises(ValidationError):
        egress_policy("maybe", [])
    assert egress_policy("deny", []).allow == ()


def test_fork_body_validation() -> None:
    body = SandboxCreate(snapshot_tag="t", net="nat", egress={"default": "deny", "allow": [
        {"cidr": "192.0.2.0/24", "ports": [443, "8000-8001"], "protocol": "tcp"}]}, memory_limit_mib=256)
    options = isolation_of(body)
    assert options.net.mode == "nat" and options.net.egress.allow[0].ports == ((443, 443), (8000, 8001))
    assert options.limits.to_dict() == {"memory_limit_mib": 256}
    for bad in ({"net": "none", "egress": {"default": "deny"}},
                {"net": "nat", "egress": {"default": "deny", "allow": [{"cidr": "192.0.2.1/24"}]}},
                {"net": "nat", "egress": {"default": "deny", "allow": [{"cidr": "192.0.2.0/24", "ports": ["1-2-3"]}]}},
                {"net": "bridge"}, {"pids_max": 1}, {"cpu_quota": 0.0}):
        with pytest.raises(ValueError):
            SandboxCreate(snapshot_tag="t", **bad)


def test_pool_blocks() -> None:
    pool = AddressPool.parse("10.213.0.0/16")
    assert pool.capacity == 16384
    lease = pool.lease(3)
    assert (str(lease.block), str(lease.host_address), str(lease.ns_address)) == (
        "10.213.0.12/30", "10.213.0.13", "10.213.0.14")
    assert pool.slot_of(ipaddress.IPv4Address("10.213.0.14")) == 3
    assert pool.slot_of(ipaddress.IPv4Address("10.214.0.1")) is None
    with pytest.raises(ValueError):
        pool.lease(pool.capacity)


@pytest.mark.parametrize("text", ["8.8.8.0/24", "10.0.0.0/31", "172.29.0.0/16"])
def test_pool_must_be_private_big_enough_and_apart_from_guests(text: str) -> None:
    with pytest.raises(ValidationError):
        AddressPool.parse(text)


def test_a_recorded_network_is_requested_again_as_it_was() -> None:
    """A resumed or forked sandbox starts with the network its predecessor had, rules included."""
    policy = egress_policy("allow", [allow_rule("198.51.100.7/32", [443], "tcp")],
                           deny=[parse_cidr("198.51.100.0/24")])
    for request in (NetRequest(), NetRequest("nat"), NetRequest("nat", policy),
                    NetRequest("nat", egress_policy("deny", [allow_rule("192.0.2.0/24")], dns=False))):
        recorded = sandbox_meta(SandboxOptions(net=request), None)["net"]
        assert net_request_of(recorded) == request
    assert net_request_of(None) == NetRequest()
