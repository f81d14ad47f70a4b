"""What an operator may tune in the runtime (from the daemon's config file); defaults keep today's behaviour."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# Restores in flight per host CPU when the config sets no bound. A child being restored (VMM start,
# state load, its first guest code translated by TCG, the reseed answer) keeps a core busy; more
# at once than the cores can serve only makes every child of a big batch late, past its answer
# window (docs/benchmarks.md, "admission").
RESTORES_PER_CPU = 2


@dataclass(frozen=True)
class RuntimeOptions:
    max_sandboxes: int | None = None  # live + starting children; a child over it fails, its batch does not
    max_concurrent_forks: int | None = None  # children restored at the same time; the rest queue
    # On SIGTERM: False kills every sandbox (nothing outlives the daemon); True leaves VMMs running
    # for the next daemon to re-adopt (an upgrade or restart without losing sandboxes).
    keep_sandboxes_on_stop: bool = False
    pool_sizes: dict[str, int] = field(default_factory=dict)  # ready VMMs kept per snapshot tag (runtime/pool.py)

    def restore_slots(self) -> int:
        """Children restored at once: the configured bound, else what this host's CPUs can serve."""
        return self.max_concurrent_forks or RESTORES_PER_CPU * (os.cpu_count() or 1)
