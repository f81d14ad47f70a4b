"""``forkd fork`` options for a sandbox's network and resource limits, and how ``forkd ls`` shows them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from forkd.host.netpolicy import NET_MODES, parse_allow_spec
from forkd.validation import ValidationError

F = Callable[..., Any]


def isolation_options(func: F) -> F:
    options = [
        click.option("--net", type=click.Choice(NET_MODES), default=None,
                     help="none (default): no network; nat: own namespace, NAT out of the host"),
        click.option("--egress", type=click.Choice(["allow", "deny"]), default=None,
                     help="with --net nat: let everything out (default) or only --allow"),
        click.option("--allow", "allow", multiple=True, metavar="CIDR[:PORTS][/tcp|/udp]",
                     help="with --egress deny: let this out, e.g. 203.0.113.0/24:80,443/tcp (repeatable)"),
        click.option("--no-dns", is_flag=True, help="with --egress deny: block the relayed DNS resolver too"),
        click.option("--memory-limit-mib", type=int, default=None, help="memory limit of each child's VMM"),
        click.option("--cpu-quota", type=float, default=None, help="CPU limit in cores, e.g. 0.5"),
        click.option("--cpu-weight", type=int, default=None, help="CPU share, 1-10000 (100 = default)"),
        click.option("--pids-max", type=int, default=None, help="task (thread) limit of each child's VMM"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def fork_options(net: str | None, egress: str | None, allow: tuple[str, ...], no_dns: bool,
                 **limits: Any) -> dict[str, Any]:
    """The keyword arguments of :meth:`Controller.fork` for these options."""
    body: dict[str, Any] = {"net": net, **limits}
    if egress or allow or no_dns:
        try:
            rules = [parse_allow_spec(spec).to_dict() for spec in allow]
        except ValidationError as exc:
            raise click.BadParameter(str(exc), param_hint="--allow") from None
        body["egress"] = {"default": egress or ("deny" if allow else "allow"), "allow": rules, "dns": not no_dns}
        body["net"] = net or "nat"
    return body


def describe_net(item: dict[str, Any]) -> str:
    net = item.get("net") or {}
    if net.get("mode") != "nat":
        return net.get("mode", "none")
    egress = net.get("egress", {})
    rules = len(egress.get("allow", []))
    policy = "allow" if egress.get("default") == "allow" else f"deny+{rules}"
    return f"nat {net.get('address', '')} {policy}".strip()


def describe_limits(item: dict[str, Any]) -> str:
    limits = item.get("limits") or {}
    labels = (("memory_limit_mib", "mem {} MiB"), ("cpu_quota", "cpu {}"), ("cpu_weight", "weight {}"),
              ("pids_max", "pids {}"))
    return ", ".join(label.format(limits[key]) for key, label in labels if key in limits) or "-"
