"""Doctor checks for what per-sandbox networks and cgroups need, each with the fix when it fails."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from forkd.host.cgroups import CgroupLayout
from forkd.host.netns import IP_FORWARD, NETNS_DIR, host_resolver, leftover_networks


def isolation_checks(check: Callable[..., Any]) -> list[Any]:
    """``check(name, status, detail, fix)`` builds one result (the doctor's ``Check``)."""
    results = []
    tun = os.path.exists("/dev/net/tun")
    results.append(check("tun", "ok" if tun else "fail", "/dev/net/tun" if tun else "no /dev/net/tun",
                         "" if tun else "load the tun module (modprobe tun): --net nat needs taps"))
    netns_ok = os.path.exists("/proc/self/ns/net") and os.geteuid() == 0
    results.append(check("netns", "ok" if netns_ok else "fail",
                         f"network namespaces under {NETNS_DIR}" if netns_ok else "cannot create network namespaces",
                         "" if netns_ok else "run the daemon as root on a kernel with CONFIG_NET_NS"))
    forward = IP_FORWARD.read_text().strip() == "1" if IP_FORWARD.exists() else False
    results.append(check("ip_forward", "ok" if forward else "warn",
                         "net.ipv4.ip_forward=1" if forward else "net.ipv4.ip_forward=0",
                         "" if forward else "forkd turns it on (and logs it) when the first --net nat sandbox starts; "
                         "set it yourself with `sysctl -w net.ipv4.ip_forward=1`"))
    dns = host_resolver()
    results.append(check("guest dns", "ok" if dns else "warn",
                         f"nat guests' DNS is relayed to {dns}" if dns else "no non-loopback resolver in /etc/resolv.conf",
                         "" if dns else "set FORKD_DNS to a resolver the host routes to; a loopback resolver "
                         "(e.g. 127.0.0.53) cannot be reached from a namespace"))
    layout = CgroupLayout.detect()
    missing = layout.missing() if layout else ["memory", "cpu", "pids"]
    results.append(check("cgroups", "ok" if not missing else "warn",
                         layout.describe() if layout else "no cgroup hierarchy",
                         "" if not missing else f"mount the {', '.join(missing)} cgroup controller(s): "
                         "limits that need them are refused"))
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
