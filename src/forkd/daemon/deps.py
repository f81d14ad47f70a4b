"""What routes receive from the app: the runtime it serves, and the running-sandbox id checked at the boundary."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as PathParam

from forkd.runtime.runtime import Runtime
from forkd.runtime.sessions import Sessions
from forkd.validation import check_sandbox_id


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _sessions(request: Request) -> Sessions:
    return request.app.state.runtime.sessions


def _sandbox_id(sandbox_id: str) -> str:
    return check_sandbox_id(sandbox_id)


RuntimeDep = Annotated[Runtime, Depends(_runtime)]
SessionsDep = Annotated[Sessions, Depends(_sessions)]
SandboxId = Annotated[str, Depends(_sandbox_id)]
Pid = Annotated[int, PathParam(ge=1, le=1 << 22, description="a pid from exec's `started` event")]
