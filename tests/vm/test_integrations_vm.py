"""The agent-framework adapters on real guests, through each framework's own call path (no model needed): a
LangChain tool's ``invoke`` and AutoGen's ``execute_code_blocks`` run real Python cells and shell commands, and
the agent reads back what they printed, their values, tracebacks and exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
from autogen_core import CancellationToken
from autogen_core.code_executor import CodeBlock, CodeResult
from langchain_core.messages import ToolMessage

from conftest import run_bounded
from forkd.integrations.autogen import ForkdCodeExecutor
from forkd.integrations.langchain import ForkdPythonTool, ForkdShellTool
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller
from forkd.sdk.sandbox_sync import Sandbox

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def connection(daemon: Controller, vm_env: dict[str, str]) -> ConnectionConfig:
    return ConnectionConfig(url=f"unix://{Path(vm_env['FORKD_SOCKET'])}")


def test_langchain_tools_run_real_code_and_commands(connection: ConnectionConfig, snapshot_tag: str) -> None:
    with Sandbox.create(snapshot_tag, connection=connection) as sandbox:
        python, shell = ForkdPythonTool(sandbox=sandbox), ForkdShellTool(sandbox=sandbox)
        assert python.invoke({"code": "import numpy as np\nx = 20\nprint('hi')\nint(np.int64(x) + 1)"}) == "hi\nOut: 21"
        assert python.invoke({"code": "x * 2"}) == "Out: 40"  # one persistent context
        assert "ZeroDivisionError" in python.invoke({"code": "1 / 0"})  # the model sees its own traceback
        assert shell.invoke({"command": "echo out; echo err >&2; exit 3"}) == "out\nerr\n(exit code 3)"
        answer = python.invoke({"type": "tool_call", "id": "call-1", "name": "forkd_python", "args": {"code": "x"}})
        assert isinstance(answer, ToolMessage) and (answer.tool_call_id, answer.content) == ("call-1", "Out: 20")


def test_autogen_executor_runs_python_and_shell_blocks(connection: ConnectionConfig, snapshot_tag: str) -> None:
    async def scenario() -> list[CodeResult]:
        token = CancellationToken()
        async with ForkdCodeExecutor(snapshot_tag, connection=connection) as executor:
            results = [await executor.execute_code_blocks(
                [CodeBlock("x = 6\nprint(x * 7)", "python"), CodeBlock("echo $((1 + 1))", "bash")], token)]
            results.append(await executor.execute_code_blocks([CodeBlock("x", "python")], token))
            results.append(await executor.execute_code_blocks(
                [CodeBlock("echo no >&2; exit 4", "sh"), CodeBlock("echo never", "sh")], token))
            await executor.restart()
            results.append(await executor.execute_code_blocks([CodeBlock("x", "python")], token))
        return results

    results = run_bounded(scenario, 300)
    assert results[0] == CodeResult(exit_code=0, output="42\n2")
    assert results[1] == CodeResult(exit_code=0, output="Out: 6")  # state kept between calls
    assert results[2] == CodeResult(exit_code=4, output="no\n(exit code 4)")  # stopped at the first failure
    assert results[3].exit_code == 1 and "NameError" in results[3].output  # restart: a fresh fork, x is gone
