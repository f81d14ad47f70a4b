"""The MCP tool surface, through a real in-process MCP client session (no VM: tool listing and
argument checks never reach the daemon, and the daemon is really absent for the error test; a listing
is read from a whole daemon on the fake backend)."""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp_types import CallToolResult, ImageContent, TextContent, Tool

from conftest import fake_daemon_on
from forkd.mcp.errors import readable
from forkd.mcp.server import build_server
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.errors import ForkdError

REQUIRED = {
    "list_snapshots": [],
    "create_snapshot": ["tag"],
    "spawn": ["snapshot_tag"],
    "list_sandboxes": [],
    "kill": ["sandbox_id"],
    "exec": ["sandbox_id", "command"],
    "run_code": ["sandbox_id", "code"],
    "eval": ["sandbox_id", "expr"],
    "read_file": ["sandbox_id", "path"],
    "write_file": ["sandbox_id", "path", "content"],
    "branch": ["sandbox_id"],
    "wait_for_text": ["sandbox_id", "path", "text"],
    "terminal_open": ["sandbox_id"],
    "terminal_send": ["terminal_id", "text"],
    "terminal_read": ["terminal_id"],
    "terminal_resize": ["terminal_id", "rows", "cols"],
    "terminal_close": ["terminal_id"],
    "watch_start": ["sandbox_id", "path"],
    "watch_events": ["watch_id"],
    "watch_stop": ["watch_id"],
}
NOWHERE = "unix:///nonexistent/forkd.sock"


async def _tools(mode: str = "auto") -> dict[str, Tool]:
    async with AsyncController(url=NOWHERE) as controller:
        async with Client(build_server(controller), mode=mode) as client:
            return {tool.name: tool for tool in (await client.list_tools()).tools}


async def _call(name: str, arguments: dict) -> CallToolResult:
    async with AsyncController(url=NOWHERE) as controller:
        async with Client(build_server(controller)) as client:
            return await client.call_tool(name, arguments)


def _text(result: CallToolResult) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # legacy: the initialize handshake of today's clients
def test_tool_names_and_required_parameters(mode: str) -> None:
    tools = anyio.run(_tools, mode)
    assert sorted(tools) == sorted(REQUIRED)
    for name, tool in tools.items():
        assert sorted(tool.input_schema.get("required", [])) == sorted(REQUIRED[name]), name
        assert tool.description, name


def test_every_parameter_is_described_for_the_model() -> None:
    for name, tool in anyio.run(_tools).items():
        for param, schema in tool.input_schema["properties"].items():
            assert schema.get("description"), f"{name}.{param} has no description"


def test_bounds_and_choices_are_in_the_schema() -> None:
    tools = anyio.run(_tools)
    count = tools["spawn"].input_schema["properties"]["count"]
    assert (count["minimum"], count["maximum"], count["default"]) == (1, 1000, 1)
    assert tools["branch"].input_schema["properties"]["mode"]["enum"] == ["full", "diff", "live"]
    assert tools["read_file"].input_schema["properties"]["encoding"]["enum"] == ["auto", "text", "base64"]
    assert tools["list_snapshots"].annotations.read_only_hint is True
    assert tools["kill"].annotations.destructive_hint is True


def test_typed_results_have_output_schemas() -> None:
    tools = anyio.run(_tools)
    assert {"stdout", "stderr", "exit_code", "timed_out"} <= set(tools["exec"].output_schema["properties"])
    assert {"value", "error", "stdout", "stderr"} <= set(tools["run_code"].output_schema["properties"])
    assert {"found", "elapsed_s", "polls"} <= set(tools["wait_for_text"].output_schema["properties"])


def test_unreachable_daemon_is_a_readable_tool_error() -> None:
    result = anyio.run(_call, "list_sandboxes", {})
    assert result.is_error
    text = _text(result)
    assert "cannot reach the forkd daemon at " + NOWHERE in text and "forkd daemon" in text
    assert "Traceback" not in text


@pytest.mark.parametrize(("name", "arguments", "field"), [
    ("spawn", {"snapshot_tag": "py", "count": 0}, "count"),
    ("branch", {"sandbox_id": "sb-000000000000", "mode": "copy"}, "mode"),
    ("exec", {"sandbox_id": "sb-000000000000"}, "command"),
    ("write_file", {"sandbox_id": "sb-000000000000", "path": "/x", "content": "", "mode": "999"}, "mode"),
    ("wait_for_text", {"sandbox_id": "sb-000000000000", "path": "/x", "text": "m", "timeout_s": 7200}, "timeout_s"),
    ("terminal_read", {"terminal_id": "t-1", "wait_s": 61}, "wait_s"),
    ("terminal_send", {"terminal_id": "t-1", "text": "ls", "max_bytes": 1 << 30}, "max_bytes"),
    ("watch_events", {"watch_id": "w-1", "max_events": 0}, "max_events"),
])
def test_bad_arguments_are_refused_before_the_daemon(name: str, arguments: dict, field: str) -> None:
    result = anyio.run(_call, name, arguments)
    assert result.is_error
    text = _text(result)
    assert field in text and "cannot reach" not in text


def test_bad_base64_is_refused_with_the_fix() -> None:
    result = anyio.run(_call, "write_file", {"sandbox_id": "sb-000000000000", "path": "/x", "content": "%%",
                                              "encoding": "base64"})
    assert result.is_error and "encoding='text'" in _text(result)


def test_error_messages_name_the_next_step() -> None:
    assert "kill the sandbox" in readable(ForkdError(502, "agent_unavailable", "agent gone"))
    assert readable(ForkdError(404, "not_found", "no running sandbox 'sb-1'")).startswith(
        "no running sandbox 'sb-1'. Next: list what exists")
    assert "does not offer" in readable(ForkdError(404, "no_route", "no route"))
    missing_route = readable(ForkdError(404, "error", '{"detail":"Not Found"}'))
    assert "does not offer" in missing_route and "upgrade forkd" in missing_route


class _CellAnswers:
    """Stands in for the AsyncController behind build_server: answers run_code as the daemon does."""

    PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n-not-a-real-image").decode()

    async def run_code(self, sandbox_id: str, code: str, context: str, timeout_s: float | None) -> dict:
        return {"value": "<Figure>", "value_json": None, "error": None, "stdout": "drawn\n", "stderr": "",
                "truncated": False, "results": [
                    {"png": self.PNG, "text": "<Figure size 640x480 with 1 Axes>", "is_main_result": False,
                     "chart": {"type": "bar", "title": "t", "elements": []}},
                    {"html": "<table><tr><td>1</td></tr></table>", "markdown": "| 1 |", "json": {"a": 1},
                     "text": "Table", "is_main_result": True}]}


def test_run_code_returns_rich_results_as_image_and_text_content() -> None:
    async def call() -> CallToolResult:
        async with Client(build_server(_CellAnswers())) as client:  # type: ignore[arg-type]
            return await client.call_tool("run_code", {"sandbox_id": "sb-000000000000", "code": "plot()"})

    result = anyio.run(call)
    assert not result.is_error, _text(result)
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert [(i.mime_type, i.data) for i in images] == [("image/png", _CellAnswers.PNG)]
    texts = [b.text for b in result.content if isinstance(b, TextContent)]
    assert json.loads(texts[0])["stdout"] == "drawn\n"  # the structured result first, for text-only clients
    assert texts[1:] == ["<table><tr><td>1</td></tr></table>", "| 1 |", '{\n  "a": 1\n}']
    structured = result.structured_content
    assert structured["stdout"] == "drawn\n"
    assert [r["formats"] for r in structured["results"]] == [["chart", "png", "text"], ["html", "json", "markdown", "text"]]
    assert structured["results"][0]["chart"]["type"] == "bar" and structured["results"][1]["is_main_result"]


def test_list_snapshots_shows_each_snapshots_machine_type() -> None:
    home = Path(tempfile.mkdtemp(prefix="fkm-", dir="/tmp"))  # short: agent sockets live under it
    try:
        with fake_daemon_on(home) as daemon:
            daemon.create_snapshot("plain", memory_mib=256, warm_modules=[])
            daemon.create_snapshot("small", memory_mib=256, warm_modules=[], machine="microvm")

            async def call() -> CallToolResult:
                async with AsyncController(url=daemon.url) as controller:
                    async with Client(build_server(controller)) as client:
                        return await client.call_tool("list_snapshots", {})

            result = anyio.run(call)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert not result.is_error, _text(result)
    listed = json.loads(_text(result)) if result.structured_content is None else result.structured_content["result"]
    assert {s["tag"]: s["machine"] for s in listed} == {"plain": "q35", "small": "microvm"}
