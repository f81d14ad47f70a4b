"""What an agent reads back from a sandbox: one text per cell or command, the way a notebook or a terminal shows it.

Shared by the framework adapters so a LangChain tool and an AutoGen executor report the same run the same way.
"""

from __future__ import annotations

from forkd.sdk.models import CommandExitException, CommandResult, Execution

MAX_OUTPUT_CHARS = 20_000  # a model's context is finite: the tail is what explains a failure


def execution_text(execution: Execution) -> str:
    """A cell's printed output, then its value (``Out: ...``), then its error with the traceback."""
    parts = ["".join(execution.logs.stdout), "".join(execution.logs.stderr)]
    if execution.text is not None:
        parts.append(f"Out: {execution.text}")
    if execution.error is not None:
        parts.append(execution.error.traceback or f"{execution.error.name}: {execution.error.value}")
    return bounded("\n".join(part.rstrip("\n") for part in parts if part))


def command_text(result: CommandResult | CommandExitException) -> str:
    """A command's stdout and stderr, and its exit code when it failed."""
    parts = [result.stdout.rstrip("\n"), result.stderr.rstrip("\n")]
    if result.exit_code != 0:
        parts.append(f"(exit code {result.exit_code})")
    return bounded("\n".join(part for part in parts if part))


def bounded(text: str) -> str:
    """``text``, or its last ``MAX_OUTPUT_CHARS`` characters with a note of what was cut."""
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return f"[{len(text) - MAX_OUTPUT_CHARS} characters cut]\n" + text[-MAX_OUTPUT_CHARS:]
