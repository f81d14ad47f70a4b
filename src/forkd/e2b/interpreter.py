"""E2B's code interpreter (port 49999), an adapter over the runtime's sessions (cells and contexts).

``POST /execute`` answers one JSON object per line as the cell runs: ``stdout``/``stderr`` lines,
``result`` (rich results as the agent reports them: ``display()`` calls, matplotlib figures, the
cell's value as the main result), ``error``, ``number_of_executions``, then ``end_of_execution``.
The cell is a session :class:`~forkd.runtime.execution.Execution`, so it has the REST API's
bounds: output a slow client has not read pauses the cell in the guest (flow control), and a
client that leaves (its timeout, a disconnect) interrupts the cell, which frees its context for
the next one. Contexts are the agent's: each its own interpreter process with its own working
directory. The execution count is kept here, per context of each running sandbox.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd.e2b import connect
from forkd.e2b.errors import E2BError, to_http
from forkd.runtime.results import CellSpec, Notice, Output
from forkd.runtime.sandboxes import LiveSandbox
from forkd.runtime.sessions import Sessions

DEFAULT_CONTEXT = "default"
MAX_CODE_BYTES = 4 << 20
LANGUAGES = ("python",)
RESULT_EVENT = "result"
_CONTEXT_KEYS = ("id", "language", "cwd")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item) + "\n").encode()


def _language(body: dict[str, Any]) -> str:
    language = body.get("language") or "python"
    if language not in LANGUAGES:
        raise E2BError(400, f"language {language!r} is not available; forkd runs {', '.join(LANGUAGES)}")
    return language


class Interpreter:
    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self._counts: dict[str, tuple[LiveSandbox, dict[str, int]]] = {}

    def counts(self, live: LiveSandbox) -> dict[str, int]:
        """Executions per context of this sandbox; counts of sandboxes that ended are dropped on the way."""
        for sandbox_id, (other, _) in list(self._counts.items()):
            if other.watcher is not None and other.watcher.done():
                del self._counts[sandbox_id]
        known = self._counts.get(live.record.id)
        if known is None or known[0] is not live:
            known = self._counts[live.record.id] = (live, {})
        return known[1]

    async def handle(self, request: Request, live: LiveSandbox) -> Response:
        path, method = request.url.path, request.method
        parts = [p for p in path.split("/") if p]
        sandbox_id = live.record.id
        try:
            if parts == ["health"] and method == "GET":
                return JSONResponse("OK")
            if parts == ["execute"] and method == "POST":
                return await self.execute(request, live)
            if parts == ["contexts"] and method == "GET":
                listed = await self.sessions.contexts(sandbox_id)
                return JSONResponse([{k: c.get(k) for k in _CONTEXT_KEYS} for c in listed.get("contexts", [])])
            if parts == ["contexts"] and method == "POST":
                body = await _json_body(request)
                created = await self.sessions.create_context(sandbox_id, cwd=body.get("cwd") or None,
                                                             language=_language(body))
                return JSONResponse({k: created.get(k) for k in _CONTEXT_KEYS})
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                await self.sessions.remove_context(sandbox_id, parts[1])
                self.counts(live).pop(parts[1], None)
                return Response(status_code=204)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                await self.sessions.restart_context(sandbox_id, parts[1])
                self.counts(live).pop(parts[1], None)
                return Response(status_code=204)
        except Exception as exc:
            error = to_http(exc)
            return JSONResponse(error.body(), status_code=error.status)
        return JSONResponse({"code": 404, "message": f"the code interpreter has no route {method} {path}"},
                            status_code=404)

    async def execute(self, request: Request, live: LiveSandbox) -> Response:
        body = await _json_body(request)
        code = body.get("code")
        if not isinstance(code, str):
            raise E2BError(400, "code must be a string")
        if body.get("context_id") and body.get("language"):
            raise E2BError(400, "give context_id or language, not both")
        if body.get("env_vars"):
            raise E2BError(400, "per-execution env_vars are not supported; set envs when creating the sandbox")
        _language(body)
        context = body.get("context_id") or DEFAULT_CONTEXT
        if not isinstance(context, str):
            raise E2BError(400, "context_id must be a string")
        return StreamingResponse(self._run(live, context, code), media_type="application/x-ndjson")

    async def _run(self, live: LiveSandbox, context: str, code: str) -> AsyncIterator[bytes]:
        """The cell's lines as E2B's ``/execute`` sends them. Starlette closes this generator when the
        client leaves; the ``finally`` then interrupts the cell in the guest."""
        execution = None
        try:
            execution = await self.sessions.start_cell(live.record.id, CellSpec(code=code, context=context))
            async for event in execution:
                if isinstance(event, Output):
                    yield _line({"type": event.stream, "text": event.text, "timestamp": _now()})
                elif isinstance(event, Notice) and event.name == RESULT_EVENT:
                    yield _line({**event.data, "type": "result"})
            for tail in execution.flush():
                yield _line({"type": tail.stream, "text": tail.text, "timestamp": _now()})
            result = await execution.raw_result()
        except Exception as exc:  # the agent refused or lost the cell: say so in the stream
            yield _line({"type": "error", "name": type(exc).__name__, "value": to_http(exc).message, "traceback": ""})
            yield _line({"type": "unexpected_end_of_execution"})
            return
        finally:
            if execution is not None:
                execution.cancel()  # a no-op once the cell answered
        counts = self.counts(live)
        counts[context] = counts.get(context, 0) + 1
        if execution.truncated:
            yield _line({"type": "stderr", "timestamp": _now(),
                         "text": "[forkd: output past this call's budget was dropped]\n"})
        error = result.get("error")
        if error:
            yield _line({"type": "error", "name": error.get("name", ""), "value": error.get("value", ""),
                         "traceback": error.get("traceback", "")})
        yield _line({"type": "number_of_executions", "execution_count": counts[context]})
        yield _line({"type": "end_of_execution"})


async def _json_body(request: Request) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > MAX_CODE_BYTES:
            raise E2BError(413, f"the request body is over {MAX_CODE_BYTES} bytes")
    try:
        return connect.decode_message(bytes(body))
    except Exception as exc:
        raise E2BError(400, f"the body must be a JSON object: {exc}") from None
