"""E2B's network options (``allow_internet_access``, ``network.allowOut``/``denyOut``, ``update_network``)
on forkd's per-child network namespaces and egress policy (docs/networking.md).

Without any of them a sandbox gets forkd's default, ``net=none``: no link at all (both SDKs send
nothing unless the user sets an option, so the default is the same for Python and JavaScript).
Any of them gives it a ``nat`` link, whose rules can then change live:

- ``allow_internet_access=True``: everything beyond the host (the host, other sandboxes, link-local
  addresses stay closed whatever the options say);
- ``allow_internet_access=False``, or ``0.0.0.0/0`` in ``denyOut``: nothing but ``allowOut``, no DNS;
- ``denyOut`` CIDRs: those refused, the rest allowed; ``allowOut`` entries win over ``denyOut``, as on E2B.

Entries are IPv4 CIDRs or addresses. Domain names are refused: the rules match addresses, and a
name's addresses are whatever a resolver the guest can reach says, so a domain rule could not be
enforced honestly.
"""

from __future__ import annotations

import ipaddress
import re

from forkd.e2b.errors import E2BError
from forkd.host.netpolicy import AllowRule, EgressPolicy, NetRequest, allow_rule, egress_policy, parse_cidr
from forkd.validation import ValidationError

EVERYWHERE = ipaddress.IPv4Network("0.0.0.0/0")
_DOMAIN = re.compile(r"^(\*\.)?([A-Za-z0-9-]+\.)*[A-Za-z][A-Za-z0-9-]*$")  # ends in a label with a letter


def _network(entry: str, field: str) -> ipaddress.IPv4Network:
    """An allowOut/denyOut entry: an IPv4 CIDR, or an address (its /32)."""
    text = entry.strip()
    if _DOMAIN.match(text):
        raise E2BError(400, f"{field} entry {entry!r} is a domain name: forkd enforces egress by address only "
                            "(a domain's addresses are whatever the guest's resolver says); give IPv4 CIDRs")
    try:
        return parse_cidr(text if "/" in text else f"{text}/32")
    except ValidationError as exc:
        raise E2BError(400, f"{field} entry {entry!r}: {exc}") from None


def egress(allow_internet_access: bool | None, allow_out: list[str] | None,
           deny_out: list[str] | None) -> EgressPolicy:
    """The egress policy E2B's options stand for."""
    allow: list[AllowRule] = [allow_rule(str(_network(e, "allowOut"))) for e in allow_out or []]
    deny = [_network(e, "denyOut") for e in deny_out or []]
    try:
        if allow_internet_access is False or EVERYWHERE in deny:
            return egress_policy("deny", allow, dns=False)
        return egress_policy("allow", allow if deny else [], deny=[n for n in deny if n != EVERYWHERE])
    except ValidationError as exc:
        raise E2BError(400, str(exc)) from None


def net_request(allow_internet_access: bool | None, allow_out: list[str] | None,
                deny_out: list[str] | None) -> NetRequest:
    """A new sandbox's network: none unless an option asks for one."""
    if allow_internet_access is None and allow_out is None and deny_out is None:
        return NetRequest()
    return NetRequest(mode="nat", egress=egress(allow_internet_access, allow_out, deny_out))
