"""What an operator may tune in the runtime (from the daemon's config); defaults keep today's behaviour.

The daemon builds these from its one config object (file + environment + flags, daemon/config.py);
nothing in runtime/ reads the environment itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from forkd.host.netpolicy import DEFAULT_POOL
from forkd.hostpaths import HostRoots
from forkd.runtime.idle import DEFAULT_IDLE_STOP_S
from forkd.runtime.spool import DEFAULT_SPOOL_BYTES, DEFAULT_SPOOL_FILES
from forkd.store.space import DEFAULT_FLOOR_BYTES
from forkd.vmm.base import Q35

DEFAULT_MAX_BRANCHES = 2
DEFAULT_MAX_CHAIN_DEPTH = 8


@dataclass(frozen=True)
class OutputLimits:
    """How much output of one exec or run_code call the daemon holds (guest output is hostile: bound it)."""

    # A non-streamed result keeps at most this many bytes of stdout plus stderr; the rest is
    # dropped (the guest stops sending it) and the result says ``truncated: true``.
    result_bytes: int = 4 << 20
    # A streamed call forwards at most this many bytes in all (None: no cap, the stream flows on).
    stream_bytes: int | None = None
    # Output queued for a stream reader before the guest is told to pause that command.
    stream_buffer_bytes: int = 1 << 20


# Restores in flight per host CPU when the config sets no bound. A child being restored (VMM start,
# state load, its first guest code translated by TCG, the reseed answer) keeps a core busy; more
# at once than the cores can serve only makes every child of a big batch late, past its answer
# window (docs/benchmarks.md, "admission").
RESTORES_PER_CPU = 2


@dataclass(frozen=True)
class RuntimeOptions:
    max_sandboxes: int | None = None  # live + starting children; a child over it fails, its batch does not
    max_concurrent_forks: int | None = None  # children restored at the same time; the rest queue
    max_concurrent_branches: int = DEFAULT_MAX_BRANCHES  # branches written at once; more answer 503
    # Ancestors a snapshot may have: a branch that would pass it is written standalone (runtime/branches.py).
    max_chain_depth: int = DEFAULT_MAX_CHAIN_DEPTH
    # On SIGTERM: False kills every sandbox (nothing outlives the daemon); True leaves VMMs running
    # for the next daemon to re-adopt (an upgrade or restart without losing sandboxes).
    keep_sandboxes_on_stop: bool = False
    net_pool: str = DEFAULT_POOL  # IPv4 network nat children's addresses come from
    dns: str | None = None  # resolver nat guests' DNS is relayed to; None: the host's own
    output: OutputLimits = field(default_factory=OutputLimits)
    # Where API clients' host paths may point (image sources, pack files); None: anywhere (in-process
    # use only; the daemon always sets them).
    host_roots: HostRoots | None = None
    transfer_hosts: tuple[str, ...] | None = None  # hosts pulls and pushes may reach; None: any http(s) host
    allow_unpinned_pulls: bool = False  # pull from a network URL with no SHA-256 pin (packs/service.py)
    # Free space forks, branches, snapshot builds, uploads, packs, unpacks and pulls leave (store/space.py).
    free_floor_bytes: int = DEFAULT_FLOOR_BYTES
    spool_bytes: int = DEFAULT_SPOOL_BYTES  # upload data all uploads together spool on disk (runtime/spool.py)
    spool_files: int = DEFAULT_SPOOL_FILES  # uploads holding a spool file at once
    pool_sizes: dict[str, int] = field(default_factory=dict)  # ready VMMs kept per snapshot tag (runtime/pool.py)
    # Pool members load their state, run a fork's first calls and wait stopped (runtime/warmup.py):
    # a pooled child then skips the translation of that guest code, at the cost of the member's
    # larger footprint (docs/operations.md). False: members wait before their state is loaded.
    warm_pools: bool = True
    # A child no request reached for this long, with nothing running in it, is stopped (its VMM uses no
    # CPU) and continued by its next request (runtime/idle.py); 0: never.
    idle_stop_s: float = DEFAULT_IDLE_STOP_S
    # An idle-stopped child's memory is paged out to swap, when the host has swap (runtime/reclaim.py).
    idle_reclaim: bool = True
    default_machine: str = Q35  # a snapshot's machine type when its request names none (vmm/base.MACHINES)

    def restore_slots(self) -> int:
        """Children restored at once: the configured bound, else what this host's CPUs can serve."""
        return self.max_concurrent_forks or RESTORES_PER_CPU * (os.cpu_count() or 1)
