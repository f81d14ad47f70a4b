"""One router module per resource; ``ROUTERS`` is what the app includes, in documentation order."""

from __future__ import annotations

from forkd.daemon.routes import (
    branch,
    commands,
    contexts,
    files,
    images,
    node,
    packs,
    pools,
    sandboxes,
    snapshots,
    system,
    watches,
    workspaces,
)

ROUTERS = (system.router, images.router, snapshots.router, packs.router, sandboxes.router, commands.router,
           contexts.router, files.router, watches.router, branch.router, workspaces.router, pools.router,
           node.router)
