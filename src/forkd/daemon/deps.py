"""What routes receive from the app: the runtime it serves, and the running-sandbox id checked at the boundary.

Every dependency is ``async def``, though none awaits: FastAPI runs a plain ``def`` dependency in its
thread pool, two thread hand-overs per dependency per request (measured: ~1 ms of a ping's 1.2 ms in the
daemon on a loaded 2-core host, bench/roundtrip.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as PathParam

from forkd.runtime.runtime import Runtime
from forkd.runtime.sessions import Sessions
from forkd.validation import check_sandbox_id


async def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def _sessions(request: Request) -> Sessions:
    return request.app.state.runtime.sessions


async def _sandbox_id(sandbox_id: str) -> str:
    return check_sandbox_id(sandbox_id)


RuntimeDep = Annotated[Runtime, Depends(_runtime)]
SessionsDep = Annotated[Sessions, Depends(_sessions)]
SandboxId = Annotated[str, Depends(_sandbox_id)]
Pid = Annotated[int, PathParam(ge=1, le=1 << 22, description="a pid from exec's `started` event")]
