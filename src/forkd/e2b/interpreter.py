"""E2B's code interpreter (port 49999) on the guest agent's run_code and its named contexts.

``POST /execute`` answers one JSON object per line as the cell runs: ``stdout``/``stderr`` lines,
``result`` (the cell's value), ``error``, ``number_of_executions``, then ``end_of_execution``.
Contexts are the agent's named namespaces; this module keeps their ids, language and cwd per
sandbox, with the ``default`` context always present.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd.e2b import connect
from forkd.e2b.errors import E2BError, to_http
from forkd.guest import protocol
from forkd.runtime.sandboxes import LiveSandbox

DEFAULT_CONTEXT = "default"
MAX_CODE_BYTES = 4 << 20
MAX_CONTEXTS = 256
LANGUAGES = ("python",)
_QUEUE_ITEMS = 4096


@dataclass
class _Context:
    id: str
    language: str = "python"
    cwd: str = "/"
    executions: int = 0

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


@dataclass
class _Contexts:
    live: LiveSandbox
    contexts: dict[str, _Context] = field(default_factory=lambda: {DEFAULT_CONTEXT: _Context(DEFAULT_CONTEXT)})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item) + "\n").encode()


class Interpreter:
    def __init__(self) -> None:
        self._sandboxes: dict[str, _Contexts] = {}

    def contexts(self, live: LiveSandbox) -> dict[str, _Context]:
        """This sandbox's contexts; those of sandboxes that ended are dropped on the way."""
        for sandbox_id, known in list(self._sandboxes.items()):
            if known.live.watcher is not None and known.live.watcher.done():
                del self._sandboxes[sandbox_id]
        known = self._sandboxes.get(live.record.id)
        if known is None or known.live is not live:
            known = self._sandboxes[live.record.id] = _Contexts(live)
        return known.contexts

    async def handle(self, request: Request, live: LiveSandbox) -> Response:
        path, method = request.url.path, request.method
        parts = [p for p in path.split("/") if p]
        try:
            if parts == ["health"] and method == "GET":
                return JSONResponse("OK")
            if parts == ["execute"] and method == "POST":
                return await self.execute(request, live)
            if parts == ["contexts"] and method == "GET":
                return JSONResponse([c.describe() for c in self.contexts(live).values()])
            if parts == ["contexts"] and method == "POST":
                return JSONResponse(self.create_context(live, await _json_body(request)).describe())
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                self._context(live, parts[1])
                if parts[1] == DEFAULT_CONTEXT:
                    raise E2BError(400, "the default context cannot be removed")
                del self.contexts(live)[parts[1]]
                return Response(status_code=204)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                self._context(live, parts[1])
                raise E2BError(501, "restarting a context needs a guest agent with context restarts")
        except Exception as exc:
            error = to_http(exc)
            return JSONResponse(error.body(), status_code=error.status)
        return JSONResponse({"code": 404, "message": f"the code interpreter has no route {method} {path}"},
                            status_code=404)

    def _context(self, live: LiveSandbox, context_id: str) -> _Context:
        context = self.contexts(live).get(context_id)
        if context is None:
            raise E2BError(404, f"context {context_id} not found; list them with list_code_contexts()")
        return context

    def create_context(self, live: LiveSandbox, body: dict[str, Any]) -> _Context:
        language = body.get("language") or "python"
        if language not in LANGUAGES:
            raise E2BError(400, f"language {language!r} is not available; forkd runs {', '.join(LANGUAGES)}")
        cwd = body.get("cwd") or "/"
        if not isinstance(cwd, str) or cwd != "/":
            raise E2BError(400, "contexts share the interpreter's working directory (/); use os.chdir in the "
                                "code or absolute paths")
        contexts = self.contexts(live)
        if len(contexts) >= MAX_CONTEXTS:
            raise E2BError(400, f"a sandbox has at most {MAX_CONTEXTS} contexts; remove some first")
        context = _Context(id=secrets.token_hex(8), language=language, cwd=cwd)
        contexts[context.id] = context
        return context

    async def execute(self, request: Request, live: LiveSandbox) -> Response:
        body = await _json_body(request)
        code = body.get("code")
        if not isinstance(code, str):
            raise E2BError(400, "code must be a string")
        if body.get("context_id") and body.get("language"):
            raise E2BError(400, "give context_id or language, not both")
        if body.get("env_vars"):
            raise E2BError(400, "per-execution env_vars are not supported: contexts share one process environment; "
                                "set envs when creating the sandbox")
        language = body.get("language") or "python"
        if language not in LANGUAGES:
            raise E2BError(400, f"language {language!r} is not available; forkd runs {', '.join(LANGUAGES)}")
        context = self._context(live, body.get("context_id") or DEFAULT_CONTEXT)
        return StreamingResponse(self._run(live, context, code), media_type="application/x-ndjson")

    async def _run(self, live: LiveSandbox, context: _Context, code: str) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(_QUEUE_ITEMS)

        def on_event(name: str, data: dict[str, Any]) -> None:
            if name in (protocol.EVENT_STDOUT, protocol.EVENT_STDERR) and not queue.full():
                queue.put_nowait({"type": name, "text": str(data.get("text", "")), "timestamp": _now()})

        async def run() -> None:
            try:
                result = await live.agent.call(protocol.OP_RUN_CODE, {"code": code, "context": context.id},
                                               timeout=None, on_event=on_event)
                context.executions += 1
                for item in _result_lines(result):
                    await queue.put(item)
                await queue.put({"type": "number_of_executions", "execution_count": context.executions})
                await queue.put({"type": "end_of_execution"})
            except Exception as exc:
                error = to_http(exc)
                await queue.put({"type": "error", "name": "ForkdError", "value": error.message, "traceback": ""})
                await queue.put({"type": "unexpected_end_of_execution"})
            finally:
                await queue.put(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            while (item := await queue.get()) is not None:
                yield _line(item)
        finally:
            if not task.done():
                task.cancel()


def _result_lines(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The cell's value as E2B's main result, then its error if it raised."""
    lines: list[dict[str, Any]] = []
    if result.get("value") is not None:
        lines.append({"type": "result", "text": result["value"], "is_main_result": True})
    error = result.get("error")
    if error:
        lines.append({"type": "error", "name": error.get("name", ""), "value": error.get("value", ""),
                      "traceback": error.get("traceback", "")})
    return lines


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
