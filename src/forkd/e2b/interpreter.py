"""E2B's code interpreter (port 49999) on the guest agent's run_code and contexts.* ops.

``POST /execute`` answers one JSON object per line as the cell runs: ``stdout``/``stderr`` lines,
``result`` (rich results as the agent reports them: ``display()`` calls, matplotlib figures, the
cell's value as the main result), ``error``, ``number_of_executions``, then ``end_of_execution``.
Contexts are the agent's: each its own interpreter process with its own working directory. The
execution count is kept here, per context of each running sandbox.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd.e2b import connect
from forkd.e2b.errors import E2BError, to_http
from forkd.guest import protocol
from forkd.runtime.sandboxes import LiveSandbox

DEFAULT_CONTEXT = "default"
MAX_CODE_BYTES = 4 << 20
LANGUAGES = ("python",)
QUEUE_BYTES = 16 << 20  # output of one /execute waiting for its client (a chart's PNG may take several MiB)
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
    def __init__(self) -> None:
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
        agent = live.agent
        try:
            if parts == ["health"] and method == "GET":
                return JSONResponse("OK")
            if parts == ["execute"] and method == "POST":
                return await self.execute(request, live)
            if parts == ["contexts"] and method == "GET":
                listed = await agent.call(protocol.OP_CONTEXTS_LIST, {})
                return JSONResponse([{k: c.get(k) for k in _CONTEXT_KEYS} for c in listed.get("contexts", [])])
            if parts == ["contexts"] and method == "POST":
                body = await _json_body(request)
                args = {"language": _language(body), **({"cwd": body["cwd"]} if body.get("cwd") else {})}
                created = await agent.call(protocol.OP_CONTEXTS_CREATE, args)
                return JSONResponse({k: created.get(k) for k in _CONTEXT_KEYS})
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                await agent.call(protocol.OP_CONTEXTS_DELETE, {"id": parts[1]})
                self.counts(live).pop(parts[1], None)
                return Response(status_code=204)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                await agent.call(protocol.OP_CONTEXTS_RESTART, {"id": parts[1]})
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
        queue: asyncio.Queue[tuple[dict[str, Any], int] | None] = asyncio.Queue()  # bounded by `queued` below
        dropped, queued = 0, 0

        def on_event(name: str, data: dict[str, Any]) -> None:
            # Never blocks (that would stall the sandbox's agent connection): past QUEUE_BYTES of unread
            # output (one item always fits), output is dropped and counted, and the stream says so.
            nonlocal dropped, queued
            if name in (protocol.EVENT_STDOUT, protocol.EVENT_STDERR):
                item = {"type": name, "text": str(data.get("text", "")), "timestamp": _now()}
            elif name == protocol.EVENT_RESULT:
                item = {**data, "type": "result"}
            else:
                return
            size = sum(len(v) for v in item.values() if isinstance(v, str))
            if queued and queued + size > QUEUE_BYTES:
                dropped += 1
                return
            queued += size
            queue.put_nowait((item, size))

        async def run() -> None:
            try:
                result = await live.agent.call(protocol.OP_RUN_CODE, {"code": code, "context": context},
                                               timeout=None, on_event=on_event)
                counts = self.counts(live)
                counts[context] = counts.get(context, 0) + 1
                if dropped:
                    note = f"[forkd: {dropped} output items dropped: the client read too slowly]\n"
                    await queue.put(({"type": "stderr", "timestamp": _now(), "text": note}, 0))
                error = result.get("error")
                if error:
                    await queue.put(({"type": "error", "name": error.get("name", ""), "value": error.get("value", ""),
                                     "traceback": error.get("traceback", "")}, 0))
                await queue.put(({"type": "number_of_executions", "execution_count": counts[context]}, 0))
                await queue.put(({"type": "end_of_execution"}, 0))
            except Exception as exc:  # the agent refused or lost the cell: say so in the stream
                error = to_http(exc)
                await queue.put(({"type": "error", "name": type(exc).__name__, "value": error.message,
                                  "traceback": ""}, 0))
                await queue.put(({"type": "unexpected_end_of_execution"}, 0))
            finally:
                await queue.put(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            while (entry := await queue.get()) is not None:
                item, size = entry
                queued -= size
                yield _line(item)
        finally:
            if not task.done():
                task.cancel()


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
