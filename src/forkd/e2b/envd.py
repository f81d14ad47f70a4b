"""envd's HTTP API (port 49983 behind the sandbox headers): health, file download and upload, and the
Connect RPC services, all served on the sandbox the request names.

Files move in agent-sized chunks both ways: a download streams chunk by chunk, an upload (raw
``application/octet-stream``, optionally gzip-encoded, or ``multipart/form-data`` with one part
per file) is parsed as it arrives and written in 4 MiB pieces, so no whole file is ever held.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd.e2b import rpc
from forkd.e2b.errors import E2BError, to_http
from forkd.e2b.filesystem import FilesystemService
from forkd.e2b.process import ProcessService
from forkd.runtime.sandboxes import LiveSandbox
from forkd.runtime.sessions import WRITE_CHUNK_BYTES, Sessions

MAX_MULTIPART_FILES = 1000
log = logging.getLogger("forkd.e2b")
MAX_PATH_CHARS = 4096


def _error(exc: BaseException) -> JSONResponse:
    error = to_http(exc)
    if error.status == 500:
        log.error("envd file transfer failed", exc_info=exc)
    return JSONResponse(error.body(), status_code=error.status)


def _check_path(path: str | None, what: str = "path") -> str:
    if not path or "\0" in path or len(path) > MAX_PATH_CHARS:
        raise E2BError(400, f"{what} must be a non-empty path of at most {MAX_PATH_CHARS} characters")
    return path


def _entry(path: str) -> dict[str, Any]:
    return {"path": path, "name": posixpath.basename(path), "type": "file"}


async def _gunzip(parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        async for part in parts:
            while part:
                yield inflater.decompress(part, WRITE_CHUNK_BYTES)
                part = inflater.unconsumed_tail
        yield inflater.flush()
    except zlib.error as exc:
        raise E2BError(400, f"the gzip-encoded body is corrupt: {exc}") from None


class _PartBody:
    """One multipart file's bytes as an async iterator, fed by the parser as they arrive."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)  # back-pressure on the parser

    async def feed(self, data: bytes | None) -> None:
        await self._queue.put(data)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._items()

    async def _items(self) -> AsyncIterator[bytes]:
        while (data := await self._queue.get()) is not None:
            yield data


class Envd:
    """envd's routes; files go through the runtime's sessions, as the REST API's do."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.processes = ProcessService(sessions)
        self.methods = {**self.processes.methods(), **FilesystemService(sessions).methods()}

    async def handle(self, request: Request, live: LiveSandbox) -> Response:
        path, method = request.url.path, request.method
        if path == "/health" and method == "GET":
            return Response(status_code=204)
        if path == "/files":
            try:
                if method == "GET":
                    return await self.download(request, live)
                if method == "POST":
                    return await self.upload(request, live)
            except Exception as exc:
                return _error(exc)
            return JSONResponse({"code": 405, "message": f"{method} /files is not allowed; use GET or POST"},
                                status_code=405)
        if method == "POST" and path.count("/") == 2 and "." in path:
            return await rpc.serve(self.methods, path, rpc.Call(live, request))
        return JSONResponse({"code": 404, "message": f"envd has no route {method} {path}"}, status_code=404)

    async def download(self, request: Request, live: LiveSandbox) -> Response:
        path = _check_path(request.query_params.get("path"))
        download = await self.sessions.read_file(live.record.id, path)
        return StreamingResponse(download.chunks, media_type="application/octet-stream",
                                 headers={**({"Content-Length": str(download.size)} if download.size is not None else {}),
                                          "Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"'})

    async def upload(self, request: Request, live: LiveSandbox) -> Response:
        content_type, options = parse_options_header(request.headers.get("content-type", ""))
        if content_type == b"multipart/form-data":
            boundary = options.get(b"boundary")
            if not boundary:
                raise E2BError(400, "multipart/form-data without a boundary")
            written = await self._multipart(request, live, boundary, request.query_params.get("path"))
            return JSONResponse([_entry(p) for p in written])
        path = _check_path(request.query_params.get("path"))
        body: AsyncIterator[bytes] = request.stream()
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding == "gzip":
            body = _gunzip(body)
        elif encoding != "identity":
            raise E2BError(400, f"Content-Encoding {encoding!r} is not supported; send gzip or none")
        await self.sessions.write_file(live.record.id, path, body)
        return JSONResponse([_entry(path)])

    async def _multipart(self, request: Request, live: LiveSandbox, boundary: bytes, path: str | None) -> list[str]:
        """Write every file part to its path (the part's filename, or ``path`` for a single file)."""
        parts: list[dict[str, Any]] = []  # parsed parts: headers, then their data pieces as they arrive
        header: dict[str, bytes] = {"field": b"", "value": b""}

        def on_part_begin() -> None:
            if len(parts) >= MAX_MULTIPART_FILES:
                raise E2BError(400, f"more than {MAX_MULTIPART_FILES} files in one upload")
            parts.append({"headers": {}, "data": bytearray(), "ended": False})

        def on_header_end() -> None:
            parts[-1]["headers"][header["field"].lower()] = header["value"]
            header["field"] = header["value"] = b""

        def on_header_field(data: bytes, start: int, end: int) -> None:
            header["field"] += data[start:end]

        def on_header_value(data: bytes, start: int, end: int) -> None:
            header["value"] += data[start:end]

        def on_headers_finished() -> None:
            parts[-1]["ready"] = True

        def on_part_data(data: bytes, start: int, end: int) -> None:
            parts[-1]["data"] += data[start:end]

        def on_part_end() -> None:
            parts[-1]["ended"] = True

        parser = MultipartParser(boundary, {"on_part_begin": on_part_begin, "on_header_field": on_header_field,
                                            "on_header_value": on_header_value, "on_header_end": on_header_end,
                                            "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end})
        writers: list[tuple[str, _PartBody, asyncio.Task[int]]] = []  # path, its body, the write into the guest
        try:
            async for chunk in request.stream():
                try:
                    parser.write(chunk)
                except ValueError as exc:
                    raise E2BError(400, f"malformed multipart body: {exc}") from None
                for index, part in enumerate(parts):
                    if not part.get("ready"):
                        break
                    if index == len(writers):
                        target, body = _part_path(part["headers"], path), _PartBody()
                        task = asyncio.get_running_loop().create_task(
                            self.sessions.write_file(live.record.id, target, body))
                        writers.append((target, body, task))
                    if part["data"]:
                        await writers[index][1].feed(bytes(part["data"]))
                        part["data"].clear()
                    if part["ended"] and not part.get("closed"):
                        await writers[index][1].feed(None)
                        await writers[index][2]  # a failed write (no such directory, ...) ends the upload here
                        part["closed"] = True
            try:
                parser.finalize()
            except ValueError as exc:
                raise E2BError(400, f"malformed multipart body: {exc}") from None
            if not parts or not all(p.get("closed") for p in parts):
                raise E2BError(400, "the multipart body ended before its last part did")
        finally:
            for _, _, task in writers:
                if not task.done():
                    task.cancel()
        return [target for target, _, _ in writers]


def _part_path(headers: dict[bytes, bytes], path: str | None) -> str:
    _, options = parse_options_header(headers.get(b"content-disposition", b""))
    filename = options.get(b"filename")
    name = filename.decode("utf-8", "replace") if filename else None
    if path and (name is None or not name.startswith("/")):
        return _check_path(path)
    return _check_path(name, "each file part's filename")
