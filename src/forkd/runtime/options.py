"""What an operator may tune in the runtime (from the daemon's config file); defaults keep today's behaviour."""

from __future__ import annotations

from dataclasses import dataclass

from forkd.hostpaths import HostRoots


@dataclass(frozen=True)
class RuntimeOptions:
    max_sandboxes: int | None = None  # live + starting children; a child over it fails, its batch does not
    max_concurrent_forks: int | None = None  # children restored at the same time; the rest queue
    # On SIGTERM: False kills every sandbox (nothing outlives the daemon); True leaves VMMs running
    # for the next daemon to re-adopt (an upgrade or restart without losing sandboxes).
    keep_sandboxes_on_stop: bool = False
    # Where API clients' host paths may point (image sources, pack files); None: anywhere (in-process
    # use only; the daemon always sets them).
    host_roots: HostRoots | None = None
    transfer_hosts: tuple[str, ...] | None = None  # hosts pulls and pushes may reach; None: any http(s) host
