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
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from forkd import __version__
from forkd.daemon import schemas
from forkd.daemon.routes_branch import router as branch_router
from forkd.guest import protocol
from forkd.host.doctor import run_checks
from forkd.image.builder import ImageError, ImageNotFound, ImageSpec
from forkd.runtime.agent_client import AgentError, AgentUnavailable
from forkd.runtime.branches import BranchBusy
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import LiveSandbox, SandboxNotFound
from forkd.runtime.snapshots import SnapshotConflict, SnapshotCorrupt, SnapshotError, SnapshotRequest
from forkd.validation import ValidationError, check_sandbox_id
from forkd.vmm.base import SnapshotMismatch, VmmError

NDJSON = "application/x-ndjson"
log = logging.getLogger("forkd.daemon")

# Most specific first: the first matching class decides the status.
_STATUS: list[tuple[type[BaseException], int, str]] = [
    (ValidationError, 400, "invalid_request"),
    (SandboxNotFound, 404, "not_found"),
    (SnapshotConflict, 409, "conflict"),
    (SnapshotMismatch, 409, "snapshot_mismatch"),
    (SnapshotCorrupt, 409, "snapshot_corrupt"),
    (BranchBusy, 503, "busy"),
    (AgentUnavailable, 502, "agent_unavailable"),
    (SnapshotError, 400, "snapshot_error"),
    (ImageNotFound, 404, "not_found"),
    (ImageError, 400, "image_error"),
    (VmmError, 500, "vmm_error"),
]
HANDLED_ERRORS = (ValidationError, LookupError, SnapshotError, ImageError, VmmError, AgentError, OSError)
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


def ndjson_stream(work: Callable[[Callable[[dict[str, Any]], None]], Awaitable[Any]]) -> StreamingResponse:
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

    return StreamingResponse(lines(), media_type=NDJSON)


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
        reaped = runtime.start()
        if reaped:
            log.warning("reaped %d sandboxes left by a previous daemon: %s", len(reaped), ", ".join(reaped))
        yield
        await runtime.stop()

    app = FastAPI(title="forkd", version=__version__, lifespan=lifespan,
                  description="Fork warm microVMs copy-on-write; every forkd client speaks this API.")
    app.state.runtime = runtime
    app.include_router(branch_router)

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

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

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

    @app.post("/v1/images")
    async def build_image(body: schemas.ImageBuild) -> StreamingResponse:
        spec = ImageSpec(
            name=body.name,
            packages=tuple(dict.fromkeys(("python3", "python3-numpy", *body.packages))),
            mirror=body.mirror,
            source_dir=Path(body.source_dir) if body.source_dir else None,
            source_oci=Path(body.source_oci) if body.source_oci else None,
            disk_size_mib=body.disk_size_mib,
        )

        async def work(emit):
            image = await runtime.build_image(spec, lambda line: emit({"progress": line}), force=body.force)
            return image.to_dict()

        return ndjson_stream(work)

    @app.delete("/v1/images/{name}")
    async def remove_image(name: str) -> dict[str, Any]:
        runtime.remove_image(name)
        return {"removed": name}

    # snapshots

    @app.get("/v1/snapshots")
    async def snapshots() -> dict[str, Any]:
        return {"snapshots": [s.to_dict() for s in runtime.registry.list_snapshots()]}

    @app.post("/v1/snapshots")
    async def create_snapshot(body: schemas.SnapshotCreate) -> StreamingResponse:
        request = SnapshotRequest(tag=body.tag, image=body.image, memory_mib=body.memory_mib, vcpus=body.vcpus,
                                  warm_modules=tuple(body.warm_modules), warmup_cmd=body.warmup_cmd)

        async def work(emit):
            record = await runtime.create_snapshot(request, lambda line: emit({"progress": line}))
            return record.to_dict()

        return ndjson_stream(work)

    @app.delete("/v1/snapshots/{tag}")
    async def remove_snapshot(tag: str, cascade: bool = False, force: bool = False) -> dict[str, Any]:
        return {"removed": tag, "removed_tags": runtime.remove_snapshot(tag, cascade=cascade, force=force)}

    # sandboxes

    @app.post("/v1/sandboxes", status_code=201)
    async def fork(body: schemas.SandboxCreate) -> dict[str, Any]:
        outcomes = await runtime.sandboxes.fork(body.snapshot_tag, body.n)
        return {
            "sandboxes": [o.sandbox for o in outcomes if o.sandbox is not None],
            "errors": [o.error for o in outcomes if o.error is not None],
        }

    @app.get("/v1/sandboxes")
    async def list_sandboxes() -> dict[str, Any]:
        return {"sandboxes": [runtime.sandboxes.describe(s) for s in runtime.sandboxes.live()]}

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        return runtime.sandboxes.describe(sandbox(sandbox_id), with_memory=True)

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def kill_sandbox(sandbox_id: str) -> dict[str, Any]:
        await runtime.sandboxes.kill(check_sandbox_id(sandbox_id))
        return {"killed": sandbox_id}

    @app.post("/v1/sandboxes/{sandbox_id}/ping")
    async def ping(sandbox_id: str) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_PING, {}, timeout=10)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=None)
    async def exec_command(sandbox_id: str, body: schemas.ExecRequest) -> dict[str, Any] | StreamingResponse:
        args: dict[str, Any] = {"env": body.env}
        if body.cmd is not None:
            args["shell"] = body.cmd
        else:
            args["argv"] = body.argv
        for key in ("cwd", "timeout_s", "user"):
            if getattr(body, key) is not None:
                args[key] = getattr(body, key)
        if body.stdin is not None:
            args["stdin_b64"] = protocol.b64encode(body.stdin.encode())
        return await output_answer(sandbox(sandbox_id), protocol.OP_EXEC, args, body.timeout_s, body.stream)

    @app.post("/v1/sandboxes/{sandbox_id}/eval")
    async def eval_expr(sandbox_id: str, body: schemas.EvalRequest) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_EVAL, {"expr": body.expr, "context": body.context},
                                timeout=body.timeout_s)

    @app.post("/v1/sandboxes/{sandbox_id}/run_code", response_model=None)
    async def run_code(sandbox_id: str, body: schemas.RunCodeRequest) -> dict[str, Any] | StreamingResponse:
        args: dict[str, Any] = {"code": body.code, "context": body.context}
        if body.timeout_s is not None:
            args["timeout_s"] = body.timeout_s
        return await output_answer(sandbox(sandbox_id), protocol.OP_RUN_CODE, args, body.timeout_s, body.stream)

    # files: raw bytes in and out, chunked to the agent

    @app.get("/v1/sandboxes/{sandbox_id}/files")
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

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str = Query(min_length=1, max_length=4096)) -> dict[str, Any]:
        return await agent_call(sandbox_id, protocol.OP_FILES_LIST, {"path": path})

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat")
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
