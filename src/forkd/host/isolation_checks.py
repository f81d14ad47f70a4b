"""Doctor checks of the per-sandbox networks forkd makes: guest DNS and leftovers (netns, tun, nft and
ip_forward are probed in ``doctor``), each with the fix when it fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forkd.host.netns import host_resolver, leftover_networks


def isolation_checks(check: Callable[..., Any]) -> list[Any]:
    """``check(name, status, detail, fix)`` builds one result (the doctor's ``Check``)."""
    results = []
    dns = host_resolver()
    results.append(check("guest dns", "ok" if dns else "warn",
                         f"nat guests' DNS is relayed to {dns}" if dns else "no non-loopback resolver in /etc/resolv.conf",
                         "" if dns else "set network.dns (or FORKD_DNS) to a resolver the host routes to; a loopback resolver "
                         "(e.g. 127.0.0.53) cannot be reached from a namespace"))
    try:
        leftovers = leftover_networks()
    except OSError as exc:
        leftovers, error = [], str(exc)
    else:
        error = ""
    results.append(check("network leftovers", "ok" if not leftovers and not error else "warn",
                         error or (", ".join(f"{x.kind} {x.name}" for x in leftovers) or "none"),
                         "" if not leftovers else "a running daemon owns these; otherwise start the daemon "
                         "(it removes what its registry knows) or delete them"))
    return results
