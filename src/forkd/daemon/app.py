"""The REST API: a thin FastAPI layer over the runtime; every client (CLI, SDK, curl) comes through here.

Long operations (image build, snapshot create) and streamed commands answer with NDJSON: one JSON
object per line, ``{"progress": ...}`` or ``{"event": ...}`` lines first, then one ``{"result": ...}``
or ``{"error": ...}`` line. Errors elsewhere are ``{"error": {"code", "message"}}`` with a fitting
HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from forkd import __version__
from forkd.daemon import schemas
from forkd.daemon.body_limit import BodyTooLarge
from forkd.daemon.routes_branch import router as branch_router
from forkd.daemon.routes_workspaces import router as workspaces_router
from forkd.guest import protocol
from forkd.host.doctor import run_checks
from forkd.image.builder import ImageError, ImageNotFound, ImageSpec
from forkd.image.spec import BASE_PACKAGES
from forkd.packs.format import PackError
from forkd.runtime.agent_client import AgentError, AgentUnavailable
from forkd.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from forkd.runtime.metrics import Metrics
from forkd.runtime.branches import BranchBusy
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import ForkOptions, LiveSandbox, SandboxNotFound
from forkd.runtime.snapshots import (
    SnapshotConflict,
    SnapshotCorrupt,
    SnapshotDiskFull,
    SnapshotError,
    SnapshotRequest,
)
from forkd.store.usage import directory_usage
from forkd.validation import ValidationError, check_sandbox_id
from forkd.vmm.base import SnapshotMismatch, VmmError

NDJSON = "application/x-ndjson"
_NDJSON_DOC = {"schema": {"type": "string", "description": "one JSON object per line: progress or event lines, "
                                                          "then one {\"result\": ...} or {\"error\": ...} line"}}
# How the routes that answer NDJSON (always, or when asked with "stream": true) are documented.
NDJSON_ANSWER: dict[int | str, dict[str, Any]] = {200: {"content": {NDJSON: _NDJSON_DOC}, "description": "NDJSON"}}


def _json_or_ndjson(model: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}},
                              NDJSON: _NDJSON_DOC},
                  "description": "JSON, or NDJSON events with \"stream\": true"}}


MAYBE_NDJSON_ANSWER = _json_or_ndjson("CommandOutcome")
MAYBE_RUN_CODE_ANSWER = _json_or_ndjson("CodeOutcome")
BYTES_ANSWER: dict[int | str, dict[str, Any]] = {200: {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    "description": "the file's bytes"}}


class RequestMetrics:
    """ASGI middleware counting every answer by route template, method and status (errors included)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def status_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, status_send)
        finally:  # the router put the matched route into this scope
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.count_request(route, scope["method"], status)


class NDJSONResponse(StreamingResponse):
    media_type = NDJSON
Pid = Annotated[int, PathParam(ge=1, le=1 << 22, description="a pid from exec's `started` event")]
log = logging.getLogger("forkd.daemon")

# Most specific first: the first matching class decides the status.
_STATUS: list[tuple[type[BaseException], int, str]] = [
    (ValidationError, 400, "invalid_request"),
    (SandboxNotFound, 404, "not_found"),
    (SnapshotConflict, 409, "conflict"),
    (SnapshotMismatch, 409, "snapshot_mismatch"),
    (SnapshotCorrupt, 409, "snapshot_corrupt"),
    (SnapshotDiskFull, 507, "disk_full"),
    (BranchBusy, 503, "busy"),
    (AgentUnavailable, 502, "agent_unavailable"),
    (SnapshotError, 400, "snapshot_error"),
    (PackError, 400, "pack_refused"),
    (ImageNotFound, 404, "not_found"),
    (ImageError, 400, "image_error"),
    (VmmError, 500, "vmm_error"),
]
HANDLED_ERRORS = (ValidationError, LookupError, SnapshotError, ImageError, VmmError, AgentError, OSError, PackError)
_AGENT_STATUS = {protocol.ERR_NOT_FOUND: 404, protocol.ERR_TIMEOUT: 504, protocol.ERR_BAD_REQUEST: 400,
                 protocol.ERR_OS: 400}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and JSON body for an exception raised by the runtime."""
    if isinstance(exc, AgentError) and not isinstance(exc, AgentUnavailable):
        return _AGENT_STATUS.get(exc.code, 500), {"error": {"code": exc.code, "message": exc.message, **exc.details}}
    for cls, status, code in _STATUS:
        if isinstance(exc, cls):
            return status, {"error": {"code": code, "message": str(exc)}}
    if isinstance(exc, LookupError):
        return 404, {"error": {"code": "not_found", "message": str(exc)}}
    return 500, {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}


def ndjson_stream(work: Callable[[Callable[[dict[str, Any]], None]], Awaitable[Any]]) -> NDJSONResponse:
    """Run ``work(emit)`` and stream what it emits, then its result or error, one JSON line each.

    ``emit`` may be called from worker threads. The work goes on if the client disconnects, so a
    half-built snapshot is still finished or cleaned up by the runtime, never abandoned midway.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def emit(item: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    async def run() -> None:
        try:
            result = await work(emit)
            queue.put_nowait({"result": result})
        except Exception as exc:  # reported to the client as the last line
            queue.put_nowait(error_body(exc)[1])
        finally:
            queue.put_nowait(None)

    task = loop.create_task(run())

    async def lines() -> AsyncIterator[bytes]:
        _ = task  # keep a reference: the task must outlive a disconnected client
        while (item := await queue.get()) is not None:
            yield (json.dumps(item) + "\n").encode()

    return NDJSONResponse(lines())


OUTPUT_EVENTS = (protocol.EVENT_STDOUT, protocol.EVENT_STDERR)


def output_text(data: dict[str, Any]) -> str:
    """exec streams bytes (``data_b64``), run_code streams text (``text``); clients get text."""
    if "data_b64" in data:
        return protocol.b64decode(data["data_b64"]).decode("utf-8", errors="replace")
    return str(data.get("text", ""))


async def output_answer(live: LiveSandbox, op: str, args: dict[str, Any], timeout_s: float | None,
                        stream: bool) -> dict[str, Any] | StreamingResponse:
    """Run an op that prints: stream its events as NDJSON, or gather them into stdout/stderr."""
    call_timeout = (timeout_s or schemas.MAX_TIMEOUT_S) + 30
    if stream:
        async def work(emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
            def on_event(name: str, data: dict[str, Any]) -> None:
                emit({"event": name, "data": output_text(data)} if name in OUTPUT_EVENTS else {"event": name, **data})
            return await live.agent.call(op, args, timeout=call_timeout, on_event=on_event)
        return ndjson_stream(work)
    output: dict[str, list[str]] = {name: [] for name in OUTPUT_EVENTS}

    def collect(name: str, data: dict[str, Any]) -> None:
        if name in output:
            output[name].append(output_text(data))

    result = await live.agent.call(op, args, timeout=call_timeout, on_event=collect)
    return {**result, "stdout": "".join(output[protocol.EVENT_STDOUT]), "stderr": "".join(output[protocol.EVENT_STDERR])}


def create_app(runtime: Runtime) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Shutdown runs here, not after uvicorn returns: uvicorn re-raises SIGTERM once it has
        # served, which would end the process before any later cleanup.
        recovered = await runtime.start()
        if recovered.adopted:
            log.info("re-adopted %d sandboxes: %s", len(recovered.adopted), ", ".join(recovered.adopted))
        if recovered.reaped or recovered.removed_builds:
            log.warning("reaped %d sandboxes a previous daemon left (%s) and %d half-built snapshots",
                        len(recovered.reaped), ", ".join(recovered.reaped), len(recovered.removed_builds))
        yield
        await runtime.stop()

    app = FastAPI(title="forkd", version=__version__, lifespan=lifespan, responses=schemas.ERROR_RESPONSES,
                  description="Fork warm microVMs copy-on-write; every forkd client speaks this API.")
    app.state.runtime = runtime
    app.include_router(branch_router)
    app.include_router(workspaces_router)

    app.add_middleware(RequestMetrics, metrics=runtime.metrics)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, __: BodyTooLarge) -> JSONResponse:
        return JSONResponse({"error": {"code": "body_too_large", "message": "request body over this route's limit"}},
                            status_code=413)

    async def runtime_error(_: Request, exc: Exception) -> JSONResponse:
        status, body = error_body(exc)
        return JSONResponse(body, status_code=status)

    # Registered per class (not for Exception, which Starlette re-raises after answering).
    for error_class in HANDLED_ERRORS:
        app.add_exception_handler(error_class, runtime_error)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"code": "invalid_request", "message": problems}}, status_code=422)

    def sandbox(sandbox_id: str):
        return runtime.sandboxes.get(check_sandbox_id(sandbox_id))

    async def agent_call(sandbox_id: str, op: str, args: dict[str, Any], timeout: float | None = 60.0,
                         on_event=None) -> dict[str, Any]:
        return await sandbox(sandbox_id).agent.call(op, args, timeout=timeout, on_event=on_event)

    @app.get("/healthz", response_model=schemas.Health)
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus exposition: sandboxes by state, snapshots, spawn/branch/agent latencies, errors by route."""
        return PlainTextResponse(runtime.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/version")
    async def version() -> dict[str, Any]:
        caps = runtime.vmm.capabilities()
        return {"forkd": __version__, "vmm": caps.kind, "vmm_version": caps.version,
                "accelerator": caps.accelerator, "accelerator_reason": caps.accelerator_reason,
                "capabilities": {"shared_memory_snapshots": caps.shared_memory_snapshots, "vmgenid": caps.vmgenid,
                                 "background_snapshot": caps.background_snapshot}}

    @app.get("/v1/doctor")
    async def doctor() -> dict[str, Any]:
        return {"checks": [c.to_dict() for c in await asyncio.to_thread(run_checks, runtime.paths)]}

    # images

    @app.get("/v1/images")
    async def images() -> dict[str, Any]:
        return {"images": [i.to_dict() for i in runtime.images()]}

    @app.post("/v1/images", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
    async def build_image(body: schemas.ImageBuild) -> StreamingResponse:
        spec = ImageSpec(
            name=body.name,
            packages=tuple(dict.fromkeys((*BASE_PACKAGES, *body.packages))),
            mirror=body.mirror,
            source_dir=Path(body.source_dir) if body.source_dir else None,
            source_oci=Path(body.source_oci) if body.source_oci else None,
            disk_size_mib=body.disk_size_mib,
        )
        spec = runtime.confine_image_sources(spec)  # refused before the stream starts

        async def work(emit):
            image = await runtime.build_image(spec, lambda line: emit({"progress": line}), force=body.force)
            return image.to_dict()

        return ndjson_stream(work)

    @app.delete("/v1/images/{name}")
    async def remove_image(name: str) -> dict[str, Any]:
        runtime.remove_image(name)
        return {"removed": name}

    # snapshots

    @app.get("/v1/snapshots", response_model=schemas.SnapshotList)
    async def snapshots() -> dict[str, Any]:
        return {"snapshots": [{**s.to_dict(), "disk": directory_usage(s.path)} for s in runtime.registry.list_snapshots()]}

    @app.post("/v1/snapshots", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
    async def create_snapshot(body: schemas.SnapshotCreate) -> StreamingResponse:
        request = SnapshotRequest(tag=body.tag, image=body.image, memory_mib=body.memory_mib, vcpus=body.vcpus,
                                  warm_modules=tuple(body.warm_modules), warmup_cmd=body.warmup_cmd)

        runtime.snapshots.reserve(body.tag)  # a taken tag is a 409 before any streaming starts

        async def work(emit):
            record = await runtime.create_snapshot(request, lambda line: emit({"progress": line}), reserved=True)
            return record.to_dict()

        return ndjson_stream(work)

    @app.delete("/v1/snapshots/{tag}")
    async def remove_snapshot(tag: str, cascade: bool = False, force: bool = False) -> dict[str, Any]:
        return {"removed": tag, "removed_tags": runtime.remove_snapshot(tag, cascade=cascade, force=force)}

    from forkd.daemon.routes_packs import packs_router  # here: it imports this module's helpers
    app.include_router(packs_router(runtime))

    # sandboxes

    @app.post("/v1/sandboxes", status_code=201, response_model=schemas.ForkResult)
    async def fork(body: schemas.SandboxCreate) -> dict[str, Any]:
        options = ForkOptions(timeout_s=body.timeout_s, envs=body.envs, metadata=body.metadata, isolation=body.options())
        outcomes = await runtime.sandboxes.fork(body.snapshot_tag, body.n, options)
        return {
            "sandboxes": [o.sandbox for o in outcomes if o.sandbox is not None],
            "errors": [o.error for o in outcomes if o.error is not None],
        }

    @app.get("/v1/sandboxes", response_model=schemas.SandboxList)
    async def list_sandboxes() -> dict[str, Any]:
        return {"sandboxes": [runtime.sandboxes.describe(s) for s in runtime.sandboxes.live()]}

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=schemas.Sandbox)
    async def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        return runtime.sandboxes.lookup(check_sandbox_id(sandbox_id))

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def kill_sandbox(sandbox_id: str) -> dict[str, Any]:
        await runtime.sandboxes.kill(check_sandbox_id(sandbox_id))
        return {"killed": sandbox_id}

    @app.post("/v1/sandboxes/{sandbox_id}/timeout")
    async def set_timeout(sandbox_id: str, body: schemas.TimeoutBody) -> dict[str, Any]:
        return {"id": sandbox_id, "end_at": runtime.sandboxes.set_timeout(check_sandbox_id(sandbox_id), body.timeout_s)}

    @app.post("/v1/sandboxes/{sandbox_id}/ping")
    async def ping(sandbox_id: str) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_PING, {}, timeout=10)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=None, responses=MAYBE_NDJSON_ANSWER)
    async def exec_command(sandbox_id: str, body: schemas.ExecRequest) -> dict[str, Any] | StreamingResponse:
        live = sandbox(sandbox_id)
        args: dict[str, Any] = {"env": {**live.record.meta.get("envs", {}), **body.env}}
        if body.cmd is not None:
            args["shell"] = body.cmd
        else:
            args["argv"] = body.argv
        for key in ("cwd", "timeout_s", "user"):
            if getattr(body, key) is not None:
                args[key] = getattr(body, key)
        if body.warm:
            args["warm"] = True
        if body.stdin is not None:
            args["stdin_b64"] = protocol.b64encode(body.stdin.encode())
        return await output_answer(live, protocol.OP_EXEC, args, body.timeout_s, body.stream)

    @app.get("/v1/sandboxes/{sandbox_id}/processes")
    async def list_processes(sandbox_id: str) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_PROC_LIST, {})

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/signal")
    async def signal_process(sandbox_id: str, pid: Pid, body: schemas.SignalBody) -> dict[str, Any]:
        await agent_call(sandbox_id, protocol.OP_PROC_KILL, {"pid": pid, "signal": body.signal})
        return {"pid": pid, "signal": body.signal}

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin")
    async def write_stdin(sandbox_id: str, pid: Pid, body: schemas.StdinBody) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_PROC_STDIN,
                                {"pid": pid, "data_b64": protocol.b64encode(body.data.encode()), "eof": body.eof})

    @app.post("/v1/sandboxes/{sandbox_id}/eval", response_model=schemas.CodeOutcome)
    async def eval_expr(sandbox_id: str, body: schemas.EvalRequest) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_EVAL, {"expr": body.expr, "context": body.context},
                                timeout=body.timeout_s)

    @app.post("/v1/sandboxes/{sandbox_id}/run_code", response_model=None, responses=MAYBE_RUN_CODE_ANSWER)
    async def run_code(sandbox_id: str, body: schemas.RunCodeRequest) -> dict[str, Any] | StreamingResponse:
        args: dict[str, Any] = {"code": body.code, "context": body.context}
        if body.timeout_s is not None:
            args["timeout_s"] = body.timeout_s
        return await output_answer(sandbox(sandbox_id), protocol.OP_RUN_CODE, args, body.timeout_s, body.stream)

    # files: raw bytes in and out, chunked to the agent

    @app.get("/v1/sandboxes/{sandbox_id}/files", response_class=StreamingResponse, responses=BYTES_ANSWER)
    async def read_file(sandbox_id: str, path: str = Query(min_length=1, max_length=4096)) -> StreamingResponse:
        live = sandbox(sandbox_id)
        first = await live.agent.call(protocol.OP_FILES_READ, {"path": path, "offset": 0})

        async def chunks() -> AsyncIterator[bytes]:
            chunk, offset = first, 0
            while True:
                data = protocol.b64decode(chunk["data_b64"])
                offset += len(data)
                yield data
                if chunk.get("eof") or not data:
                    return
                chunk = await live.agent.call(protocol.OP_FILES_READ, {"path": path, "offset": offset})

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"X-File-Size": str(first.get("size", ""))})

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def write_file(sandbox_id: str, request: Request, path: str = Query(min_length=1, max_length=4096),
                         mode: int | None = Query(default=None, ge=0, le=0o7777)) -> dict[str, Any]:
        live = sandbox(sandbox_id)
        buffer = bytearray()
        written = 0

        async def send(piece: bytes) -> None:
            nonlocal written
            args: dict[str, Any] = {"path": path, "data_b64": protocol.b64encode(piece), "offset": written,
                                    "truncate": written == 0}
            if mode is not None:
                args["mode"] = mode
            await live.agent.call(protocol.OP_FILES_WRITE, args)
            written += len(piece)

        async for part in request.stream():
            buffer.extend(part)
            while len(buffer) >= protocol.FILE_CHUNK_BYTES:
                await send(bytes(buffer[:protocol.FILE_CHUNK_BYTES]))
                del buffer[:protocol.FILE_CHUNK_BYTES]
        if buffer or written == 0:
            await send(bytes(buffer))
        return {"path": path, "size": written}

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=schemas.FileList)
    async def list_files(sandbox_id: str, path: str = Query(min_length=1, max_length=4096)) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_FILES_LIST, {"path": path})

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=schemas.FileEntry)
    async def stat_file(sandbox_id: str, path: str = Query(min_length=1, max_length=4096)) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_FILES_STAT, {"path": path})

    @app.delete("/v1/sandboxes/{sandbox_id}/files")
    async def remove_file(sandbox_id: str, path: str = Query(min_length=1, max_length=4096),
                          recursive: bool = False) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_FILES_REMOVE, {"path": path, "recursive": recursive})

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir")
    async def make_dir(sandbox_id: str, body: schemas.PathBody) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_FILES_MKDIR, {"path": body.path, "parents": True})

    @app.post("/v1/sandboxes/{sandbox_id}/files/rename")
    async def rename_file(sandbox_id: str, body: schemas.RenameBody) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_FILES_RENAME, {"src": body.src, "dst": body.dst})

    return app
