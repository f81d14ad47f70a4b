"""What the tools answer: typed so the MCP tool list carries an output schema a model can rely on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class SpawnResult(BaseModel):
    sandboxes: list[dict[str, Any]] = Field(description="the new sandboxes; use their 'id' in other tools")
    errors: list[dict[str, Any]] = Field(description="children that failed to start (the others still run)")


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


class CodeResult(BaseModel):
    value: str | None = Field(description="repr() of the last expression; null if none or None")
    value_json: Any = Field(None, description="the value itself when it is JSON-serialisable, else null")
    type: str | None = Field(None, description="eval only: the value's class")
    error: PythonError | None = Field(None, description="the exception the code raised, if any")
    stdout: str = ""
    stderr: str = ""


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
