"""What a sandbox's network may reach: its mode, its egress policy and the address block it is given.

Pure data and arithmetic, validated here so the daemon's schema, the CLI and the rule generator
agree on one meaning. Whatever the policy, a child never reaches another child, the host itself
or the daemon: those rules are not part of a policy and cannot be turned off.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from forkd.guest import netconf
from forkd.validation import ValidationError

NET_MODES = ("none", "nat")
PROTOCOLS = ("tcp", "udp", "any")
DEFAULT_POOL = "10.213.0.0/16"
MAX_ALLOW_RULES = 64
MAX_PORTS_PER_RULE = 32
GUEST_NETWORK = ipaddress.IPv4Network(f"{netconf.GUEST_ADDRESS}/{netconf.PREFIX_LEN}", strict=False)


@dataclass(frozen=True)
class AllowRule:
    """Traffic to ``cidr`` (on ``ports``, all ports if empty) is let out under a deny policy."""

    cidr: ipaddress.IPv4Network
    ports: tuple[tuple[int, int], ...] = ()  # inclusive ranges
    protocol: str = "any"

    def to_dict(self) -> dict[str, object]:
        return {"cidr": str(self.cidr), "ports": [str(a) if a == b else f"{a}-{b}" for a, b in self.ports],
                "protocol": self.protocol}


@dataclass(frozen=True)
class EgressPolicy:
    default: str = "allow"  # "allow" or "deny"
    allow: tuple[AllowRule, ...] = ()  # let out under "deny"; under "allow", exceptions to ``deny``
    dns: bool = True  # the relayed resolver stays reachable under "deny"
    deny: tuple[ipaddress.IPv4Network, ...] = ()  # refused under "allow", unless an allow rule matches first

    def to_dict(self) -> dict[str, object]:
        return {"default": self.default, "allow": [r.to_dict() for r in self.allow], "dns": self.dns,
                **({"deny": [str(n) for n in self.deny]} if self.deny else {})}


@dataclass(frozen=True)
class NetRequest:
    mode: str = "none"
    egress: EgressPolicy = field(default_factory=EgressPolicy)


def net_request_of(net: dict[str, Any] | None) -> NetRequest:
    """The request a sandbox's recorded ``net`` (``sandbox_meta``) stands for: what a resume or a fork
    of it starts its successor with, so a sandbox keeps its network across pause and resume."""
    if not net or net.get("mode") != "nat":
        return NetRequest()
    egress = net.get("egress") or {}
    allow = [allow_rule(r["cidr"], list(r.get("ports") or []), r.get("protocol", "any")) for r in egress.get("allow", [])]
    return NetRequest(mode="nat", egress=egress_policy(egress.get("default", "allow"), allow, egress.get("dns", True),
                                                       [parse_cidr(c) for c in egress.get("deny", [])]))


def parse_cidr(text: str) -> ipaddress.IPv4Network:
    try:
        network = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as exc:
        raise ValidationError(f"{text!r} is not an IPv4 network in CIDR form (e.g. 203.0.113.0/24): {exc}") from None
    if not isinstance(network, ipaddress.IPv4Network):
        raise ValidationError(f"{text!r}: guests have IPv4 only; give an IPv4 network")
    return network


def parse_ports(items: list[int | str]) -> tuple[tuple[int, int], ...]:
    """``[443, "8000-8080"]`` into inclusive ranges, each within 1-65535."""
    if len(items) > MAX_PORTS_PER_RULE:
        raise ValidationError(f"at most {MAX_PORTS_PER_RULE} ports or ranges per rule")
    ranges = []
    for item in items:
        low, _, high = str(item).partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValidationError(f"port {item!r} is not a number or a range like 8000-8080") from None
        if not 1 <= first <= last <= 65535:
            raise ValidationError(f"port range {item!r} must lie within 1-65535, low to high")
        ranges.append((first, last))
    return tuple(ranges)


def allow_rule(cidr: str, ports: list[int | str] | None = None, protocol: str = "any") -> AllowRule:
    if protocol not in PROTOCOLS:
        raise ValidationError(f"protocol {protocol!r} must be one of {', '.join(PROTOCOLS)}")
    return AllowRule(cidr=parse_cidr(cidr), ports=parse_ports(list(ports or [])), protocol=protocol)


def parse_allow_spec(spec: str) -> AllowRule:
    """The CLI form ``CIDR[:PORT[,PORT|LOW-HIGH...]][/tcp|/udp]``, e.g. ``203.0.113.5/32:443/tcp``."""
    body, protocol = spec, "any"
    for proto in ("tcp", "udp"):
        if spec.endswith("/" + proto):
            body, protocol = spec[: -len(proto) - 1], proto
    cidr, _, ports = body.partition(":")
    return allow_rule(cidr, [p for p in ports.split(",") if p] if ports else [], protocol)


def egress_policy(default: str, allow: list[AllowRule], dns: bool = True,
                  deny: list[ipaddress.IPv4Network] | None = None) -> EgressPolicy:
    if default not in ("allow", "deny"):
        raise ValidationError(f"egress default {default!r} must be 'allow' or 'deny'")
    if deny and default == "deny":
        raise ValidationError("a deny-list only means something with default 'allow'; set default to 'allow'")
    if allow and default == "allow" and not deny:
        raise ValidationError("an allow-list only means something with default 'deny' (or exceptions to a "
                              "deny-list); set default to 'deny'")
    if len(allow) > MAX_ALLOW_RULES or len(deny or ()) > MAX_ALLOW_RULES:
        raise ValidationError(f"at most {MAX_ALLOW_RULES} allow rules and {MAX_ALLOW_RULES} deny rules")
    return EgressPolicy(default=default, allow=tuple(allow), dns=dns, deny=tuple(deny or ()))


@dataclass(frozen=True)
class Lease:
    """One child's /30 out of the pool: the host end of its veth and the namespace end."""

    slot: int
    block: ipaddress.IPv4Network

    @property
    def host_address(self) -> ipaddress.IPv4Address:
        return self.block.network_address + 1

    @property
    def ns_address(self) -> ipaddress.IPv4Address:
        return self.block.network_address + 2


@dataclass(frozen=True)
class AddressPool:
    """A private range cut into /30 blocks, one per ``nat`` child; slot numbers index the blocks."""

    network: ipaddress.IPv4Network

    @classmethod
    def parse(cls, text: str) -> AddressPool:
        network = parse_cidr(text)
        if network.prefixlen > 30:
            raise ValidationError(f"address pool {text} is smaller than one /30; use e.g. {DEFAULT_POOL}")
        if not network.is_private:
            raise ValidationError(f"address pool {text} is not a private range; use e.g. {DEFAULT_POOL}")
        if network.overlaps(GUEST_NETWORK):
            raise ValidationError(f"address pool {text} overlaps the guests' own network {GUEST_NETWORK}")
        return cls(network)

    @property
    def capacity(self) -> int:
        return self.network.num_addresses // 4

    def lease(self, slot: int) -> Lease:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} outside pool {self.network}")
        return Lease(slot, ipaddress.IPv4Network((int(self.network.network_address) + 4 * slot, 30)))

    def slot_of(self, address: ipaddress.IPv4Address) -> int | None:
        """The slot whose block holds ``address``, if it is in the pool."""
        if address not in self.network:
            return None
        return (int(address) - int(self.network.network_address)) // 4
