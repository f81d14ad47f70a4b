"""The forkd MCP tools: each is one daemon call (or a bounded loop of them) through ``AsyncController``.

The client is native asyncio, so a call never holds the event loop (nor a worker thread) while the
daemon works; other sessions and progress notifications go on meanwhile. Parameters carry
descriptions and bounds because the model reads them to decide how to call a tool.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field

from forkd import __version__
from forkd.mcp.errors import answered, tool_error
from forkd.mcp.interactive import add_interactive_tools
from forkd.mcp.results import (
    CodeResult,
    ExecResult,
    FileContent,
    FileWritten,
    SpawnResult,
    WaitResult,
    code_content,
)
from forkd.mcp.terminals import Holdings
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.errors import ForkdError


INSTRUCTIONS = """forkd runs code in disposable Linux microVMs forked from warm snapshots.
Typical flow: list_snapshots (or create_snapshot), spawn a sandbox from a snapshot tag, then exec shell
commands, run_code / eval Python (state persists per context), read_file / write_file, and kill the
sandbox when done. branch saves a running sandbox as a new snapshot to fork more copies of it.
For interactive programs (a shell, a REPL, a prompt that asks questions) open a terminal with terminal_open and
drive it with terminal_send / terminal_read; watch_start / watch_events report changes in a directory."""

SandboxId = Annotated[str, Field(description="sandbox id from spawn or list_sandboxes, e.g. sb-0123456789ab")]
Tag = Annotated[str, Field(description="snapshot tag: 1-64 characters from A-Z a-z 0-9 _ -")]
ContextName = Annotated[str, Field(description="Python context name; state (variables, imports) persists per "
                                            "context between run_code and eval calls")]
GuestPath = Annotated[str, Field(min_length=1, max_length=4096, description="absolute path inside the sandbox")]
MAX_TIMEOUT_S = 24 * 3600.0
MAX_WAIT_S = 3600.0
MAX_READ_BYTES = 64 << 20
MAX_SCAN_BYTES = 64 << 20  # how much of a file wait_for_text searches on each poll


def _tail(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[-limit:], True)


def _decode(data: bytes, encoding: str) -> tuple[str, Literal["text", "base64"]]:
    if encoding != "base64":
        try:
            return data.decode("utf-8"), "text"
        except UnicodeDecodeError:
            if encoding == "text":
                raise ToolError("the file is not valid UTF-8 text: read it with encoding='base64'") from None
    return base64.b64encode(data).decode("ascii"), "base64"


def _encode(content: str, encoding: str) -> bytes:
    if encoding == "text":
        return content.encode("utf-8")
    try:
        return base64.b64decode(content, validate=True)
    except ValueError:
        raise ToolError("content is not valid base64: send text with encoding='text'") from None


async def file_contains(controller: AsyncController, sandbox_id: str, path: str, marker: bytes, limit: int,
                        deadline: float | None = None) -> bool:
    """Whether the file's first ``limit`` bytes hold ``marker``, streamed: only one chunk and the end of
    the one before are held, so a guest file that never ends costs nothing; the scan also stops at
    ``deadline`` (``time.monotonic()``), so a huge file cannot hold the caller past its timeout."""
    keep = len(marker) - 1  # a marker split across two chunks is still found
    tail, seen = b"", 0
    chunks = controller.read_file_chunks(sandbox_id, path)
    try:
        async for chunk in chunks:
            window = tail + chunk[: limit - seen]
            if marker in window:
                return True
            seen += len(chunk)
            if seen >= limit or (deadline is not None and time.monotonic() > deadline):
                return False
            tail = window[len(window) - keep:] if keep else b""
    finally:
        await chunks.aclose()
    return False


def _check_size(path: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise ToolError(f"{path} has {size} bytes, more than max_bytes={max_bytes}: raise max_bytes or read a "
                        "part with exec (head, tail, dd)")


def _file_mode(mode: str | None) -> int | None:
    return None if mode is None else int(mode, 8)


def build_server(controller: AsyncController, holdings: Holdings | None = None) -> MCPServer:
    """An MCP server whose tools act on the daemon ``controller`` talks to; its terminals and watchers are
    kept in ``holdings`` (which the caller closes when it stops serving)."""
    server = MCPServer("forkd", version=__version__, instructions=INSTRUCTIONS)
    add_interactive_tools(server, holdings or Holdings(controller))
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    async def list_snapshots() -> list[dict[str, Any]]:
        """List the snapshots sandboxes can be spawned from (tag, image, machine type, memory, warm modules, ...)."""
        return await answered(controller.snapshots())

    @server.tool()
    async def create_snapshot(
        ctx: Context,
        tag: Tag,
        image: Annotated[str, Field(description="guest image name (built with `forkd image build`)")] = "default",
        memory_mib: Annotated[int, Field(ge=128, le=65536, description="guest RAM in MiB")] = 1024,
        vcpus: Annotated[int, Field(ge=1, le=64, description="virtual CPUs")] = 1,
        warm_modules: Annotated[list[str] | None, Field(
            description="Python modules imported before the snapshot is taken; null means the daemon's "
                        "default (numpy)")] = None,
        warm_code: Annotated[str | None, Field(
            description="Python run once in the warm interpreter after the imports; every context and warm "
                        "command starts from what it leaves behind")] = None,
        warmup_cmd: Annotated[str | None, Field(
            description="shell command run in the guest before saving; it must print {\"ready\": true} "
                        "when the guest is ready")] = None,
    ) -> dict[str, Any]:
        """Boot a parent VM, warm it up and save it as a snapshot. Takes tens of seconds to minutes;
        progress is reported as MCP progress notifications."""
        options: dict[str, Any] = {"image": image, "memory_mib": memory_mib, "vcpus": vcpus}
        if warm_modules is not None:
            options["warm_modules"] = warm_modules
        if warm_code is not None:
            options["warm_code"] = warm_code
        if warmup_cmd is not None:
            options["warmup_cmd"] = warmup_cmd
        steps = 0

        async def on_progress(line: str) -> None:
            nonlocal steps
            steps += 1
            await ctx.report_progress(steps, None, line)

        return await answered(controller.create_snapshot(tag, on_progress=on_progress, **options))

    @server.tool()
    async def spawn(
        snapshot_tag: Tag,
        count: Annotated[int, Field(ge=1, le=1000, description="how many sandboxes to fork")] = 1,
    ) -> SpawnResult:
        """Fork new sandboxes from a snapshot: each is its own VM, resumed from the snapshot's warm state
        (no boot), with its own copy-on-write memory and disk."""
        result = await answered(controller.fork(snapshot_tag, count))
        if not result["sandboxes"]:
            reasons = "; ".join(f"{e['code']}: {e['message']}" for e in result["errors"]) or "no reason given"
            raise ToolError(f"no sandbox started: {reasons}")
        return SpawnResult(**result)

    @server.tool(annotations=read_only)
    async def list_sandboxes() -> list[dict[str, Any]]:
        """List the running sandboxes (id, snapshot tag, VMM pid, start time, ...)."""
        return await answered(controller.sandboxes())

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True))
    async def kill(sandbox_id: SandboxId) -> dict[str, str]:
        """Stop a sandbox's VM and release everything it held; its changes are discarded."""
        await answered(controller.kill(sandbox_id))
        return {"killed": sandbox_id}

    @server.tool(name="exec")
    async def exec_command(
        sandbox_id: SandboxId,
        command: Annotated[str, Field(min_length=1, description=(
            "shell command, run as /bin/sh -c COMMAND. To leave a process running in the background, "
            "redirect its output and end with & (e.g. 'nohup srv > /tmp/log 2>&1 &'), otherwise the call "
            "waits for it"))],
        timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, description=(
            "seconds before the command's process group is killed"))] = 60.0,
        cwd: Annotated[str | None, Field(description="working directory (default /)")] = None,
        env: Annotated[dict[str, str] | None, Field(description="extra environment variables")] = None,
        stdin: Annotated[str | None, Field(description="text written to the command's stdin")] = None,
        max_output_chars: Annotated[int, Field(ge=100, le=10_000_000, description=(
            "keep at most this many trailing characters of stdout and of stderr"))] = 100_000,
    ) -> ExecResult:
        """Run a shell command in a sandbox and return its stdout, stderr and exit code."""
        result = await answered(controller.exec(sandbox_id, command, env=env, cwd=cwd, stdin=stdin,
                                             timeout_s=timeout_s))
        stdout, cut_out = _tail(result["stdout"], max_output_chars)
        stderr, cut_err = _tail(result["stderr"], max_output_chars)
        return ExecResult(**{**result, "stdout": stdout, "stderr": stderr,
                             "truncated": bool(result.get("truncated")) or cut_out or cut_err})

    @server.tool()
    async def run_code(
        sandbox_id: SandboxId,
        code: Annotated[str, Field(description="Python statements; the last expression's value is returned")],
        context: ContextName = "default",
        timeout_s: Annotated[float | None, Field(gt=0, le=MAX_TIMEOUT_S, description=(
            "seconds before a TimeoutError is raised in the code; null: no limit"))] = None,
    ) -> Annotated[CallToolResult, CodeResult]:
        """Run Python in a sandbox like a notebook cell: variables persist in the context between calls;
        an exception is returned in 'error', not raised. Charts (matplotlib figures, PNG results) come
        back as images, HTML/Markdown/JSON results as text."""
        result, blocks = code_content(await answered(controller.run_code(sandbox_id, code, context, timeout_s)))
        return CallToolResult(content=blocks, structured_content=result.model_dump(mode="json"))

    @server.tool(name="eval")
    async def eval_expr(
        sandbox_id: SandboxId,
        expr: Annotated[str, Field(description="one Python expression")],
        context: ContextName = "default",
    ) -> CodeResult:
        """Evaluate one Python expression in a sandbox's context and return its value and type."""
        return CodeResult(**await answered(controller.eval(sandbox_id, expr, context)))

    @server.tool(annotations=read_only)
    async def read_file(
        sandbox_id: SandboxId,
        path: GuestPath,
        encoding: Annotated[Literal["auto", "text", "base64"], Field(description=(
            "auto: UTF-8 text when the file is text, else base64"))] = "auto",
        max_bytes: Annotated[int, Field(ge=1, le=MAX_READ_BYTES, description=(
            "refuse files larger than this"))] = 1 << 20,
    ) -> FileContent:
        """Read a file from a sandbox, as text or base64 for binary data."""
        entry = await answered(controller.stat(sandbox_id, path))
        if entry["type"] == "dir":
            raise ToolError(f"{path} is a directory: list it with exec 'ls -la {path}'")
        _check_size(path, entry["size"], max_bytes)  # before reading, for regular files
        # Symlinks, devices and /proc files report another size: the read itself stops past max_bytes.
        data = await answered(controller.read_file(sandbox_id, path, max_bytes))
        content, used = _decode(data, encoding)
        return FileContent(path=path, size=len(data), encoding=used, content=content)

    @server.tool()
    async def write_file(
        sandbox_id: SandboxId,
        path: GuestPath,
        content: Annotated[str, Field(description="the file's new content")],
        encoding: Annotated[Literal["text", "base64"], Field(description=(
            "text: content is written as UTF-8; base64: content is decoded to bytes first"))] = "text",
        mode: Annotated[str | None, Field(pattern=r"^0?[0-7]{3}$", description=(
            "permission bits in octal, e.g. '755'"))] = None,
    ) -> FileWritten:
        """Create or replace a file in a sandbox (missing parent directories are created)."""
        result = await answered(controller.write_file(sandbox_id, path, _encode(content, encoding),
                                                   _file_mode(mode)))
        return FileWritten(path=result["path"], size=result["size"])

    @server.tool()
    async def branch(
        sandbox_id: SandboxId,
        tag: Annotated[str | None, Field(description=(
            "tag of the new snapshot (1-64 of A-Z a-z 0-9 _ -); null lets the daemon pick one"))] = None,
        mode: Annotated[Literal["full", "diff", "live"], Field(description=(
            "full: a standalone snapshot; diff: only the pages changed since the parent; live: full, with memory "
            "pre-copied while the sandbox keeps running where the host kernel tracks soft-dirty pages"))] = "diff",
        wait: Annotated[bool, Field(description=(
            "wait until the snapshot is written; false returns at once with status 'writing'"))] = True,
    ) -> dict[str, Any]:
        """Save a running sandbox (memory, processes, files) as a new snapshot, without stopping it; spawn
        from the new tag to get copies of the sandbox as it is now."""
        return await answered(controller.branch(sandbox_id, tag=tag, mode=mode, wait=wait))

    @server.tool(annotations=read_only)
    async def wait_for_text(
        sandbox_id: SandboxId,
        path: GuestPath,
        text: Annotated[str, Field(min_length=1, description="the marker to wait for")],
        timeout_s: Annotated[float, Field(gt=0, le=MAX_WAIT_S, description="seconds to wait at most")] = 30.0,
        interval_s: Annotated[float, Field(ge=0.05, le=60.0, description="seconds between reads")] = 0.5,
    ) -> WaitResult:
        """Poll a file in a sandbox until it contains some text (e.g. a log line a background job
        prints when done), or until the timeout; a missing file counts as not yet. Only the file's
        first 64 MiB are searched, and a poll stops reading at the timeout."""
        await answered(controller.sandbox(sandbox_id))  # a wrong id fails now, not at the timeout
        started = time.monotonic()
        deadline = started + timeout_s
        polls = 0
        marker = text.encode("utf-8")
        while True:
            polls += 1
            try:
                found = await file_contains(controller, sandbox_id, path, marker, MAX_SCAN_BYTES, deadline)
                exists = True
            except ForkdError as exc:
                if exc.status != 404:
                    raise tool_error(exc) from None
                found, exists = False, False  # no such file yet
            now = time.monotonic()
            if found or now + interval_s > deadline:
                break
            await anyio.sleep(interval_s)
        if not exists:
            await answered(controller.sandbox(sandbox_id))  # the 404s were the sandbox going away, not the file
        return WaitResult(found=found, path=path, elapsed_s=round(now - started, 3), polls=polls,
                          file_exists=exists)

    return server
