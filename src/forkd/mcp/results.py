"""What the tools answer: typed so the MCP tool list carries an output schema a model can rely on."""

from __future__ import annotations

from typing import Any, Literal

import pydantic_core
from mcp_types import ContentBlock, ImageContent, TextContent
from pydantic import BaseModel, Field


class ChildError(BaseModel):
    index: int = Field(description="the child's place in the request (0-based)")
    code: str = Field(description="the error's kind, e.g. busy (the daemon's max_sandboxes), vmm_error, timeout")
    message: str


class SpawnResult(BaseModel):
    sandboxes: list[dict[str, Any]] = Field(description="the new sandboxes; use their 'id' in other tools")
    errors: list[ChildError] = Field(description="children that failed to start (the others still run)")


class ExecResult(BaseModel):
    stdout: str
    stderr: str
    exit_code: int = Field(description="128 + signal if a signal killed the command")
    signal: int | None = None
    timed_out: bool = Field(description="the timeout hit and the command's process group was killed")
    duration_s: float
    truncated: bool = Field(False, description="stdout or stderr was cut to its last max_output_chars characters, "
                                               "or the command printed past the daemon's output budget")


class PythonError(BaseModel):
    name: str = Field(description="the exception's class, e.g. ZeroDivisionError")
    value: str = Field(description="str() of the exception")
    traceback: str


class RichResult(BaseModel):
    formats: list[str] = Field(description="the formats this result came in (png, html, markdown, json, ...); "
                                           "images and the html/markdown/json text follow as content blocks")
    text: str | None = Field(None, description="the plain-text form, e.g. repr() of the object")
    chart: dict[str, Any] | None = Field(None, description="data extracted from a matplotlib chart (E2B's shape)")
    is_main_result: bool = Field(False, description="the cell's last value, not a display() call")


class CodeResult(BaseModel):
    value: str | None = Field(description="repr() of the last expression; null if none or None")
    value_json: Any = Field(None, description="the value itself when it is JSON-serialisable, else null")
    type: str | None = Field(None, description="eval only: the value's class")
    error: PythonError | None = Field(None, description="the exception the code raised, if any")
    stdout: str = ""
    stderr: str = ""
    results: list[RichResult] = Field(default_factory=list, description=(
        "run_code only: rich results (display() calls, matplotlib figures, the value's _repr_*_ forms)"))


class FileContent(BaseModel):
    path: str
    size: int = Field(description="bytes")
    encoding: Literal["text", "base64"] = Field(description="how 'content' holds the bytes")
    content: str


class FileWritten(BaseModel):
    path: str
    size: int = Field(description="bytes written")


class WaitResult(BaseModel):
    found: bool = Field(description="the text appeared in the file before the timeout")
    path: str
    elapsed_s: float
    polls: int = Field(description="how many times the file was read")
    file_exists: bool = Field(description="the file existed at the last poll")


class TerminalOutput(BaseModel):
    terminal_id: str = Field(description="name it in terminal_send, terminal_read, terminal_resize, terminal_close")
    pid: int = Field(description="the terminal's program in the guest")
    output: str = Field(description="what the program wrote since the last read, as UTF-8 text (escape sequences "
                                    "removed and CR LF as LF unless raw)")
    more: bool = Field(description="more output is already waiting: read it with terminal_read")
    exited: bool = Field(description="the program ended (and every byte it wrote was read)")
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = Field(None, description="why the terminal's stream broke, if it did")


class WatchStarted(BaseModel):
    watch_id: str = Field(description="name it in watch_events and watch_stop")
    sandbox_id: str
    path: str
    recursive: bool


class WatchEvents(BaseModel):
    watch_id: str
    events: list[dict[str, Any]] = Field(description="{type: create|write|remove|rename|chmod|overflow, name: path "
                                                     "relative to the watched directory, path: absolute path}; "
                                                     "overflow: the guest's queue filled and events were lost")
    more: bool = Field(description="more events are already waiting: call watch_events again")


#: Rich result formats returned as image blocks (base64 data) and as text blocks, in this order.
IMAGE_FORMATS = {"png": "image/png", "jpeg": "image/jpeg"}
TEXT_FORMATS = ("html", "markdown", "svg", "latex", "json")


def code_content(answer: dict[str, Any]) -> tuple[CodeResult, list[ContentBlock]]:
    """A run_code answer as the tool's structured result and its content blocks.

    The first block is the structured result as JSON text (what a client without structured output
    reads); each rich result then adds its images as image blocks and its html/markdown/json forms
    as text blocks, so a model sees a chart instead of ``<Figure size 640x480 with 1 Axes>``.
    """
    rich = [r for r in answer.get("results") or [] if isinstance(r, dict)]
    result = CodeResult(**{k: v for k, v in answer.items() if k != "results"}, results=[
        RichResult(formats=sorted(k for k in r if k not in {"is_main_result", "extra"}), text=r.get("text"),
                   chart=r.get("chart") if isinstance(r.get("chart"), dict) else None,
                   is_main_result=bool(r.get("is_main_result"))) for r in rich])
    blocks: list[ContentBlock] = [TextContent(text=result.model_dump_json(indent=2))]
    for r in rich:
        blocks += [ImageContent(data=r[key], mime_type=mime) for key, mime in IMAGE_FORMATS.items()
                   if isinstance(r.get(key), str)]
        for key in TEXT_FORMATS:
            value = r.get(key)
            if isinstance(value, str):
                blocks.append(TextContent(text=value))
            elif value is not None:
                blocks.append(TextContent(text=pydantic_core.to_json(value, indent=2).decode()))
    return result, blocks
