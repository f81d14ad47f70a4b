"""forkd across hosts on Ray (``pip install forkd[ray]``): see docs/scale-out.md.

The core never imports this package; it needs Ray, and says how to get it when Ray is missing.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("forkd.cluster needs Ray: install the extra with `pip install 'forkd[ray]'`") from exc

from forkd.cluster.cluster import Cluster
from forkd.cluster.fanout import MapStats, Outcome
from forkd.cluster.placement import Directory, NodeState, PlacementError

__all__ = ["Cluster", "Directory", "MapStats", "NodeState", "Outcome", "PlacementError"]
