"""What keeps one sandbox apart from the others and from the host: its network and its cgroup.

:meth:`Isolation.prepare` makes both before the VMM starts (the tap is handed to the VMM, the
VMM joins the cgroup before guest state loads); :meth:`Isolation.release` removes both given
only the sandbox id, however the sandbox ended and as often as it is called.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pyroute2 import NetlinkError

from forkd.host.cgroups import CgroupError, CgroupLayout, Limits, SandboxCgroup, release_cgroup
from forkd.host.netns import (
    NetworkError,
    create_child_network,
    host_resolver,
    release_network,
    replace_egress,
    slots_in_use_on_host,
)
from forkd.host.netpolicy import AddressPool, EgressPolicy, Lease, NetRequest
from forkd.host.nftrules import ChildNetwork
from forkd.runtime.options import RuntimeOptions
from forkd.store.registry import LeasesExhausted, Registry
from forkd.validation import ValidationError
from forkd.vmm.base import ChildSetup

log = logging.getLogger("forkd.isolation")
END_OUT_OF_MEMORY = "out_of_memory"


class IsolationError(RuntimeError):
    """A sandbox's network or cgroup could not be made; the message says why and what to do."""

    kind = "isolation_error"


@dataclass(frozen=True)
class SandboxOptions:
    """Per-sandbox choices of a fork request, already validated."""

    net: NetRequest = field(default_factory=NetRequest)
    limits: Limits = field(default_factory=Limits)


@dataclass
class Prepared:
    """What was made for one sandbox before its VMM starts."""

    sandbox_id: str
    cgroup: SandboxCgroup | None = None
    lease: Lease | None = None
    tap_fd: int | None = None

    def setup(self) -> ChildSetup:
        return ChildSetup(tap_fd=self.tap_fd, on_spawn=self.cgroup.attach if self.cgroup else None)

    def close_tap(self) -> None:
        """Drop the daemon's copy of the tap fd (the VMM holds its own), so the tap dies with the VMM."""
        if self.tap_fd is not None:
            os.close(self.tap_fd)
            self.tap_fd = None


def sandbox_meta(options: SandboxOptions, lease: Lease | None) -> dict[str, Any]:
    """How a sandbox is isolated, as recorded and listed (``GET /v1/sandboxes``, ``forkd ls``)."""
    net: dict[str, Any] = {"mode": options.net.mode}
    if options.net.mode == "nat":
        net["egress"] = options.net.egress.to_dict()
        if lease is not None:
            net["address"] = str(lease.ns_address)
    return {"net": net, "limits": options.limits.to_dict()}


class Isolation:
    def __init__(self, registry: Registry, pool: AddressPool, dns: ipaddress.IPv4Address | None,
                 cgroups: CgroupLayout | None) -> None:
        self.registry = registry
        self.pool = pool
        self.dns = dns
        self.cgroups = cgroups

    @classmethod
    def from_options(cls, registry: Registry, options: RuntimeOptions) -> Isolation:
        """The configured address pool and DNS resolver (default: the host's own resolver)."""
        pool = AddressPool.parse(options.net_pool)
        if options.dns:
            try:
                dns: ipaddress.IPv4Address | None = ipaddress.IPv4Address(options.dns)
            except ValueError:
                raise ValidationError(f"network.dns {options.dns!r} is not an IPv4 address") from None
        else:
            dns = host_resolver()
            if dns is None:
                log.warning("the host has no non-loopback IPv4 resolver in /etc/resolv.conf: nat guests get no DNS; "
                            "set network.dns (FORKD_DNS) to a resolver the host can route to")
        return cls(registry, pool, dns, CgroupLayout.detect())

    def prepare(self, sandbox_id: str, options: SandboxOptions) -> Prepared:
        """Cgroup (always, when the host has one: it also accounts memory) and, for ``nat``, the network.

        Blocking: run it in a worker thread. On failure everything made so far is released.
        """
        prepared = Prepared(sandbox_id)
        try:
            if self.cgroups is not None:
                prepared.cgroup = self.cgroups.sandbox(sandbox_id)
                prepared.cgroup.create(options.limits)
            elif options.limits.to_dict():
                raise CgroupError("this host has no usable cgroup hierarchy, so limits cannot be applied; "
                                  "fork without limits or run `forkd doctor`")
            if options.net.mode == "nat":
                slot = self.registry.lease_slot(sandbox_id, str(self.pool.network), self.pool.capacity,
                                                taken=slots_in_use_on_host(self.pool))
                prepared.lease = self.pool.lease(slot)
                prepared.tap_fd = create_child_network(ChildNetwork(
                    sandbox_id=sandbox_id, lease=prepared.lease, pool=self.pool.network,
                    policy=options.net.egress, dns=self.dns))
        except (CgroupError, NetworkError, LeasesExhausted, OSError) as exc:
            prepared.close_tap()
            self.release(sandbox_id)
            raise IsolationError(str(exc)) from None
        return prepared

    def replace_egress(self, sandbox_id: str, address: str, policy: EgressPolicy) -> None:
        """New egress rules for a running ``nat`` child whose namespace address is ``address``. Blocking."""
        slot = self.pool.slot_of(ipaddress.IPv4Address(address))
        if slot is None:
            raise IsolationError(f"{sandbox_id}'s address {address} is not in the pool {self.pool.network}")
        try:
            replace_egress(ChildNetwork(sandbox_id=sandbox_id, lease=self.pool.lease(slot), pool=self.pool.network,
                                        policy=policy, dns=self.dns))
        except NetworkError as exc:
            raise IsolationError(str(exc)) from None

    def end_reason(self, prepared: Prepared | None) -> str | None:
        """Why a VMM ended, if the host knows better than its exit status (the OOM killer)."""
        if prepared is not None and prepared.cgroup is not None and prepared.cgroup.oom_kills() > 0:
            return END_OUT_OF_MEMORY
        return None

    def usage(self, prepared: Prepared | None) -> dict[str, Any] | None:
        if prepared is None or prepared.cgroup is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return prepared.cgroup.applied()
        return None

    def release(self, sandbox_id: str, network: bool = True) -> list[str]:
        """Remove the sandbox's network, cgroup and address lease; idempotent. Returns what was removed.

        ``network=False`` skips looking for network objects of a sandbox known to have had none.
        """
        removed: list[str] = []
        failures: list[str] = []
        try:
            removed += release_network(sandbox_id) if network else []
        except (OSError, NetlinkError, NetworkError) as exc:
            failures.append(f"network: {exc}")
        else:  # the block is free only once nothing on the host uses it any more
            self.registry.release_slot(sandbox_id)
        try:
            if release_cgroup(sandbox_id, self.cgroups):
                removed.append(f"cgroup {sandbox_id}")
        except (OSError, CgroupError) as exc:
            failures.append(f"cgroup: {exc}")
        if failures:
            raise IsolationError(f"could not release all of {sandbox_id}: {'; '.join(failures)}")
        return removed
