"""The nftables rulesets of one ``nat`` child: one inside its namespace, one on the host.

Generated as nft's own syntax and loaded atomically with ``nft -f`` (a ruleset file is one
transaction: all of it applies or none). The namespace table NATs the guest to the namespace's
address and enforces the egress policy; the host table masquerades the child out of the host
and holds the rules no policy can lift: nothing from a child reaches the host itself (its own
addresses, or a service the host publishes by DNAT to an address behind it), another child, any
address of the pool, or a link-local address (169.254.0.0/16: cloud metadata services).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from forkd.guest import netconf
from forkd.host.netpolicy import AllowRule, EgressPolicy, Lease
from forkd.validation import SANDBOX_ID_PREFIX

TAP = "tap0"
NS_VETH = "veth0"
LINK_PREFIX = "fkd"  # host-side veth: fkd + the SANDBOX_ID_CHARS (12) of the sandbox id = 15, the kernel's limit
NS_TABLE = "forkd"
HOST_TABLE_PREFIX = "forkd_"
LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")  # cloud metadata (169.254.169.254) and link-local hosts


def host_link(sandbox_id: str) -> str:
    return LINK_PREFIX + sandbox_id.removeprefix(SANDBOX_ID_PREFIX)


def host_table(sandbox_id: str) -> str:
    return HOST_TABLE_PREFIX + sandbox_id.replace("-", "_")


@dataclass(frozen=True)
class ChildNetwork:
    sandbox_id: str
    lease: Lease
    pool: ipaddress.IPv4Network
    policy: EgressPolicy
    dns: ipaddress.IPv4Address | None  # the resolver the gateway relays to; None: no DNS


def _ports(rule: AllowRule) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in rule.ports)


def _allow(rule: AllowRule, out: str) -> list[str]:
    match = f'{out} ip daddr {rule.cidr}'
    if not rule.ports:
        protocol = "" if rule.protocol == "any" else f" meta l4proto {rule.protocol}"
        return [f"{match}{protocol} accept"]
    protocols = ("tcp", "udp") if rule.protocol == "any" else (rule.protocol,)
    return [f"{match} {proto} dport {{ {_ports(rule)} }} accept" for proto in protocols]


_REJECT = ("meta l4proto tcp reject with tcp reset", "reject with icmp type admin-prohibited")


def namespace_ruleset(net: ChildNetwork) -> str:
    """NAT and the egress policy, in the child's namespace (the guest cannot touch it: it is in a VM)."""
    out = f'iifname "{TAP}" oifname "{NS_VETH}"'
    # Before any allow rule: no policy opens the pool or link-local (rejected, so it fails at once).
    dnat = []
    forward = [f"{out} ip daddr {net.pool} drop", *(f"{out} ip daddr {LINK_LOCAL} {r}" for r in _REJECT)]
    if net.dns is not None:
        for proto in ("udp", "tcp"):
            dnat.append(f'iifname "{TAP}" ip daddr {netconf.GATEWAY} {proto} dport 53 dnat to {net.dns}')
            if net.policy.dns or net.policy.default == "allow":
                forward.append(f"{out} ip daddr {net.dns} {proto} dport 53 accept")
    for rule in net.policy.allow:  # under "allow" they are exceptions to the deny-list, so they come first
        forward.extend(_allow(rule, out))
    if net.policy.default == "allow":
        forward.extend(f"{out} ip daddr {cidr} {r}" for cidr in net.policy.deny for r in _REJECT)
        forward.append(f"{out} accept")
    rejects = [f'iifname "{TAP}" {r}' for r in _REJECT]
    return _ruleset("ip", NS_TABLE, {
        "prerouting": ("type nat hook prerouting priority dstnat; policy accept;", dnat),
        "postrouting": ("type nat hook postrouting priority srcnat; policy accept;",
                        [f'oifname "{NS_VETH}" snat to {net.lease.ns_address}']),
        "input": ("type filter hook input priority filter; policy drop;",
                  ['iifname "lo" accept', "ct state established,related accept", *rejects]),
        "forward": ("type filter hook forward priority filter; policy drop;",
                    ["ct state established,related accept", *forward, *rejects]),
    })


def host_ruleset(net: ChildNetwork) -> str:
    """Masquerade the child out of the host; keep it away from the host and from other children.

    A host service is not only what listens on the host's addresses (``input``): a port the host
    publishes by DNAT (a container's, say) arrives here already rewritten to some address behind
    the host and is *forwarded*, so ``forward`` refuses any of the child's connections the host's
    own prerouting DNATed (``ct status dnat``), and link-local destinations.
    """
    link = host_link(net.sandbox_id)
    mine, any_child = f'iifname "{link}"', f'"{LINK_PREFIX}*"'
    return _ruleset("ip", host_table(net.sandbox_id), {
        "input": ("type filter hook input priority filter - 10; policy accept;",
                  [f"{mine} {r}" for r in _REJECT]),
        "forward": ("type filter hook forward priority filter - 10; policy accept;", [
            f"{mine} oifname {any_child} drop",
            f'iifname {any_child} oifname "{link}" drop',
            f"{mine} ip daddr {net.pool} drop",
            *(f"{mine} ct status dnat {r}" for r in _REJECT),
            *(f"{mine} ip daddr {LINK_LOCAL} {r}" for r in _REJECT),
        ]),
        "postrouting": ("type nat hook postrouting priority srcnat; policy accept;",
                        [f"{mine} oifname != {any_child} masquerade"]),
    })


def _ruleset(family: str, table: str, chains: dict[str, tuple[str, list[str]]]) -> str:
    """A table that replaces any earlier one of the same name, in one transaction."""
    lines = [f"table {family} {table} {{}}", f"delete table {family} {table}", f"table {family} {table} {{"]
    for name, (hook, rules) in chains.items():
        lines += [f"    chain {name} {{", f"        {hook}", *(f"        {rule}" for rule in rules), "    }"]
    lines.append("}")
    return "\n".join(lines) + "\n"
