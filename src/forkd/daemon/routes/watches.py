"""Directory watchers inside a sandbox (inotify in the guest): create one, read its events, remove it.

The guest keeps a watcher's events until they are read (bounded there: an overflow is reported, not
buffered), so a client polls ``events`` with ``wait_s`` for a long poll; E2B's ``watch_dir`` is the
same machinery (``runtime/sessions.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import Field

from forkd.daemon.deps import SandboxId, SessionsDep
from forkd.daemon.schemas import Open, Strict

router = APIRouter()
MAX_WAIT_S = 10.0  # the agent's own bound on one watch.read
WatchId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class WatchBody(Strict):
    path: str = Field(min_length=1, max_length=4096, description="a directory in the sandbox")
    recursive: bool = Field(default=False, description="also watch its subdirectories, present and future")


class WatchCreated(Open):
    id: str


class WatchEvent(Open):
    type: str = Field(description="create, write, remove, rename or chmod; overflow when the guest's queue "
                                  "filled up and events were lost")
    name: str = Field(default="", description="the entry's path relative to the watched directory")
    path: str = Field(default="", description="the entry's absolute path")


class WatchEvents(Open):
    events: list[WatchEvent]


@router.post("/v1/sandboxes/{sandbox_id}/watches", response_model=WatchCreated, status_code=201)
async def create_watch(sandbox_id: SandboxId, body: WatchBody, sessions: SessionsDep) -> dict[str, Any]:
    return {"id": await sessions.watch(sandbox_id, body.path, body.recursive)}


@router.get("/v1/sandboxes/{sandbox_id}/watches/{watch_id}/events", response_model=WatchEvents)
async def watch_events(sandbox_id: SandboxId, watch_id: WatchId, sessions: SessionsDep,
                       wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0.0) -> dict[str, Any]:
    """The events since the last read; with ``wait_s``, waits up to that long for a first one."""
    return {"events": await sessions.watch_events(sandbox_id, watch_id, wait_s)}


@router.delete("/v1/sandboxes/{sandbox_id}/watches/{watch_id}")
async def remove_watch(sandbox_id: SandboxId, watch_id: WatchId, sessions: SessionsDep) -> dict[str, Any]:
    await sessions.unwatch(sandbox_id, watch_id)
    return {"removed": True}
