"""The agent-framework adapters against a real daemon on the fake VMM backend, each through its framework's own
call path: LangChain's ``tool.invoke`` (with a model's tool call too) and AutoGen's ``execute_code_blocks``; no
model is needed. The fake backend's agent answers every cell with no output (and starts no command), so here the
wiring, the sandboxes' lifecycle and the failure paths are checked with Python cells;
tests/vm/test_integrations_vm.py runs the same adapters on real guests and checks what the code printed. Also
``Sandbox.create`` on a daemon at its ``max_sandboxes``: asked again with backoff, then ``RateLimitException``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from autogen_core import CancellationToken
from autogen_core.code_executor import CodeBlock, CodeResult
from langchain_core.messages import ToolMessage
from langchain_core.tools import ToolException

from conftest import fake_daemon_on, run_bounded, short_tmp_dir
from forkd.integrations.autogen import ForkdCodeExecutor
from forkd.integrations.langchain import ForkdPythonTool, ForkdShellTool
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller
from forkd.sdk.errors import RateLimitException
from forkd.sdk.sandbox_sync import Sandbox

TAG = "agents"
MAX_SANDBOXES = 2


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    with short_tmp_dir("fki-") as directory:
        yield directory


@pytest.fixture(scope="module")
def daemon(home: Path) -> Iterator[Controller]:
    with fake_daemon_on(home, f"[limits]\nmax_sandboxes = {MAX_SANDBOXES}\n") as controller:
        controller.create_snapshot(TAG, memory_mib=256, warm_modules=[])
        yield controller


@pytest.fixture
def connection(home: Path, daemon: Controller) -> ConnectionConfig:
    return ConnectionConfig(url=f"unix://{home}/forkd.sock")


def test_langchain_tools_answer_through_invoke_and_a_models_tool_call(daemon: Controller,
                                                                       connection: ConnectionConfig) -> None:
    with Sandbox.create(TAG, connection=connection) as sandbox:
        python = ForkdPythonTool(sandbox=sandbox)
        assert python.invoke({"code": "x = 1"}) == ""  # the fake agent's cell prints nothing and has no value
        answer = python.invoke({"type": "tool_call", "id": "call-1", "name": "forkd_python", "args": {"code": "x"}})
        assert isinstance(answer, ToolMessage)  # what a model's tool call gets back (LangGraph's ToolNode does this)
        assert answer.tool_call_id == "call-1" and answer.status == "success"
        assert python.tool_call_schema.model_json_schema()["properties"]["code"]["type"] == "string"
        assert sandbox.kill()
        ended = ForkdShellTool(sandbox=sandbox, handle_tool_error=True)  # the model reads why
        assert ended.invoke({"command": "true"}).startswith("the sandbox could not run the command")
        with pytest.raises(ToolException, match="could not run the code"):
            python.invoke({"code": "1"})
    assert sandbox.sandbox_id not in {s["id"] for s in daemon.sandboxes()}


def test_autogen_executor_forks_on_start_restarts_fresh_and_kills_on_stop(daemon: Controller,
                                                                          connection: ConnectionConfig) -> None:
    async def scenario() -> tuple[list[CodeResult], list[str]]:
        token = CancellationToken()
        results, sandboxes = [], []
        async with ForkdCodeExecutor(TAG, connection=connection) as executor:
            assert executor.sandbox is not None
            sandboxes.append(executor.sandbox.sandbox_id)
            results.append(await executor.execute_code_blocks(
                [CodeBlock("x = 6", "python"), CodeBlock("y = 7", "py")], token))
            results.append(await executor.execute_code_blocks([CodeBlock("SELECT 1", "sql")], token))
            await executor.restart()
            assert executor.sandbox is not None
            sandboxes.append(executor.sandbox.sandbox_id)
            results.append(await executor.execute_code_blocks([CodeBlock("x", "python")], token))
        return results, sandboxes

    results, sandboxes = run_bounded(scenario, 120)
    assert results[0] == CodeResult(exit_code=0, output="\n")  # two blocks, no output from the fake agent
    assert results[1].exit_code == 1 and "not 'sql'" in results[1].output
    assert results[2] == CodeResult(exit_code=0, output="")
    assert sandboxes[0] != sandboxes[1]  # restart forked a new sandbox
    assert not set(sandboxes) & {s["id"] for s in daemon.sandboxes()}  # stop() killed what start() forked


def test_create_on_a_full_daemon_backs_off_then_raises_rate_limit(daemon: Controller,
                                                                  connection: ConnectionConfig) -> None:
    held = [Sandbox.create(TAG, connection=connection) for _ in range(MAX_SANDBOXES)]
    try:
        with pytest.raises(RateLimitException, match="max_sandboxes"):
            Sandbox.create(TAG, connection=connection)
    finally:
        for sandbox in held:
            sandbox.kill()
            sandbox.close()
    with Sandbox.create(TAG, connection=connection) as again:  # a slot is free again
        assert again.is_running()
