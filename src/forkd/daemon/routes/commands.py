"""Commands, Python cells, terminals and the processes exec started: the REST face of ``runtime.sessions``.

exec and run_code answer JSON with the output gathered (up to the configured budget, then
``truncated: true``), or with ``"stream": true`` NDJSON events as output arrives; a terminal (``pty``)
always streams. Either way the call ends in the guest when the client disconnects (a terminal is
hung up).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from forkd.daemon import schemas
from forkd.daemon.deps import Pid, SandboxId, SessionsDep
from forkd.daemon.errors import unless_client_leaves
from forkd.daemon.ndjson import NDJSON_ANSWER, NDJSONResponse, attached, json_or_ndjson
from forkd.runtime.execution import Execution
from forkd.runtime.results import CellSpec, CommandSpec, Data, Event, Output, Started
from forkd.runtime.sessions import Sessions

router = APIRouter()


def _wire(event: Event) -> dict[str, Any]:
    """An event as an NDJSON line (the wire format clients already read)."""
    if isinstance(event, Output):
        return {"event": event.stream, "data": event.text}
    if isinstance(event, Data):
        return {"event": event.stream, "data_b64": base64.b64encode(event.data).decode()}
    if isinstance(event, Started):
        return {"event": "started", "pid": event.pid}
    return {"event": event.name, **event.data}


async def _lines(execution: Execution) -> AsyncIterator[dict[str, Any]]:
    try:
        async for event in execution:
            yield _wire(event)
        for tail in execution.flush():
            yield _wire(tail)
    finally:
        execution.cancel()  # a no-op once the call ended; ends it in the guest otherwise


def command_spec(body: schemas.ExecRequest) -> CommandSpec:
    return CommandSpec(cmd=body.cmd, argv=body.argv, env=body.env, cwd=body.cwd, timeout_s=body.timeout_s,
                       user=body.user, stdin=body.stdin.encode() if body.stdin is not None else None,
                       warm=body.warm)


async def _answer(request: Request, stream: bool, collect: Callable[[], Awaitable[Any]],
                  start: Callable[[], Awaitable[Execution]],
                  result_of: Callable[[Execution, dict[str, Any]], Any]) -> dict[str, Any] | NDJSONResponse:
    """Gathered (``collect``) unless ``stream``; then NDJSON events of the started call, then its result."""
    if not stream:
        return (await unless_client_leaves(request, collect())).to_dict()
    execution = await start()

    async def finish() -> dict[str, Any]:
        return result_of(execution, await execution.raw_result()).to_dict()

    return attached(_lines(execution), finish)


@router.post("/v1/sandboxes/{sandbox_id}/exec", response_model=None, responses=json_or_ndjson(schemas.CommandOutcome))
async def exec_command(sandbox_id: SandboxId, body: schemas.ExecRequest, sessions: SessionsDep,
                       request: Request) -> dict[str, Any] | NDJSONResponse:
    spec = command_spec(body)
    return await _answer(request, body.stream, lambda: sessions.exec(sandbox_id, spec),
                         lambda: sessions.start_exec(sandbox_id, spec), Sessions.command_result)


@router.post("/v1/sandboxes/{sandbox_id}/run_code", response_model=None,
             responses=json_or_ndjson(schemas.CodeOutcome))
async def run_code(sandbox_id: SandboxId, body: schemas.RunCodeRequest, sessions: SessionsDep,
                   request: Request) -> dict[str, Any] | NDJSONResponse:
    spec = CellSpec(code=body.code, context=body.context, timeout_s=body.timeout_s)
    return await _answer(request, body.stream, lambda: sessions.run_code(sandbox_id, spec),
                         lambda: sessions.start_cell(sandbox_id, spec), Sessions.cell_result)


@router.post("/v1/sandboxes/{sandbox_id}/eval", response_model=schemas.CodeOutcome)
async def eval_expr(sandbox_id: SandboxId, body: schemas.EvalRequest, sessions: SessionsDep,
                    request: Request) -> dict[str, Any]:
    return await unless_client_leaves(request, sessions.eval(sandbox_id, body.expr, body.context, body.timeout_s))


@router.get("/v1/sandboxes/{sandbox_id}/processes")
async def list_processes(sandbox_id: SandboxId, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.processes(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/signal")
async def signal_process(sandbox_id: SandboxId, pid: Pid, body: schemas.SignalBody,
                         sessions: SessionsDep) -> dict[str, Any]:
    await sessions.signal(sandbox_id, pid, body.signal)
    return {"pid": pid, "signal": body.signal}


@router.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin")
async def write_stdin(sandbox_id: SandboxId, pid: Pid, body: schemas.StdinBody, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.write_stdin(sandbox_id, pid, body.data.encode(), body.eof)


@router.post("/v1/sandboxes/{sandbox_id}/pty", response_model=None, responses=NDJSON_ANSWER)
async def start_pty(sandbox_id: SandboxId, body: schemas.PtyRequest, sessions: SessionsDep) -> NDJSONResponse:
    """A program on a pseudo-terminal: NDJSON ``started {pid}``, ``pty {data_b64}`` as it writes to its
    terminal, then its ``{exit_code, signal}``. Unread output pauses it; a client that leaves hangs it up."""
    spec = CommandSpec(argv=body.argv, env=body.env, cwd=body.cwd, timeout_s=None)
    execution = await sessions.start_pty(sandbox_id, spec, body.rows, body.cols)
    return attached(_lines(execution), execution.raw_result)


@router.post("/v1/sandboxes/{sandbox_id}/pty/{pid}/input")
async def pty_input(sandbox_id: SandboxId, pid: Pid, body: schemas.PtyInput, sessions: SessionsDep) -> dict[str, Any]:
    """``data`` typed at the terminal, control characters included (Ctrl+C is U+0003, Ctrl+D U+0004)."""
    data = body.data.encode()
    await sessions.pty_input(sandbox_id, pid, data)
    return {"pid": pid, "written": len(data)}


@router.post("/v1/sandboxes/{sandbox_id}/pty/{pid}/resize")
async def pty_resize(sandbox_id: SandboxId, pid: Pid, body: schemas.PtySize, sessions: SessionsDep) -> dict[str, Any]:
    await sessions.pty_resize(sandbox_id, pid, body.rows, body.cols)
    return {"pid": pid, "rows": body.rows, "cols": body.cols}


@router.post("/v1/sandboxes/{sandbox_id}/pty/{pid}/signal")
async def pty_signal(sandbox_id: SandboxId, pid: Pid, body: schemas.SignalBody, sessions: SessionsDep) -> dict[str, Any]:
    await sessions.pty_signal(sandbox_id, pid, body.signal)
    return {"pid": pid, "signal": body.signal}

