"""LangChain tools over a forkd sandbox (``pip install 'forkd[langchain]'``): an agent's Python and shell run in
a fresh microVM forked from a warm snapshot, never on the host.

    sandbox = Sandbox.create(template="quickstart")
    tools = [ForkdPythonTool(sandbox=sandbox), ForkdShellTool(sandbox=sandbox)]
    agent = create_react_agent(model, tools)            # LangGraph; or model.bind_tools(tools)

Python cells share one persistent context (variables survive between calls, as in a notebook). What the code
prints, its value and its traceback come back as the tool's answer, so the model sees its own mistakes; the
sandbox failing (ended, unreachable) raises ``ToolException`` (``handle_tool_error=True`` hands it to the model).
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool, ToolException
from pydantic import BaseModel, ConfigDict, Field

from forkd.integrations.output import command_text, execution_text
from forkd.sdk.errors import ForkdError
from forkd.sdk.models import CommandExitException
from forkd.sdk.sandbox_sync import Sandbox


class PythonInput(BaseModel):
    code: str = Field(description="Python source to run; the last expression's value is shown as `Out:`")


class ShellInput(BaseModel):
    command: str = Field(description="a shell command line, run with /bin/sh -c")


class _SandboxTool(BaseTool):
    """A tool bound to one running ``forkd.Sandbox`` (the caller creates and kills it)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    sandbox: Sandbox
    timeout: float = 60.0  # seconds per call; past it the cell or command is stopped and the tool fails


class ForkdPythonTool(_SandboxTool):
    """Run Python in the sandbox, in one persistent context."""

    name: str = "forkd_python"
    description: str = ("Run Python code in an isolated Linux sandbox (a fresh microVM). Variables persist between "
                        "calls. Returns what the code printed, the value of its last expression and any traceback.")
    args_schema: type[BaseModel] = PythonInput

    def _run(self, code: str, *_: Any, **__: Any) -> str:
        try:
            return execution_text(self.sandbox.run_code(code, timeout=self.timeout))
        except ForkdError as exc:
            raise ToolException(f"the sandbox could not run the code: {exc.message}") from exc


class ForkdShellTool(_SandboxTool):
    """Run a shell command in the sandbox."""

    name: str = "forkd_shell"
    description: str = ("Run a shell command in an isolated Linux sandbox (a fresh microVM) and return its output "
                        "and, if it failed, its exit code.")
    args_schema: type[BaseModel] = ShellInput

    def _run(self, command: str, *_: Any, **__: Any) -> str:
        try:
            return command_text(self.sandbox.commands.run(command, timeout=self.timeout))
        except CommandExitException as exc:
            return command_text(exc)
        except ForkdError as exc:
            raise ToolException(f"the sandbox could not run the command: {exc.message}") from exc
