"""Host tool failures become ToolErrors that quote the tool's output and say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.image.commands import run, stream
from forkd.image.errors import ToolError


def test_run_returns_stdout() -> None:
    assert run(["sh", "-c", "echo hello"], hint="unused") == "hello\n"


def test_failure_quotes_stderr_and_the_hint() -> None:
    with pytest.raises(ToolError) as info:
        run(["sh", "-c", "echo working; echo 'E: it broke' >&2; exit 3"], hint="try turning it off and on")
    message = str(info.value)
    assert message.startswith("sh failed (exit 3): try turning it off and on")
    assert "| E: it broke" in message


def test_missing_tool_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolError, match=r"mkfs.ext4 is not installed: install it with `apt-get install e2fsprogs`"):
        run(["mkfs.ext4"], hint="unused")


def test_stream_passes_lines_and_keeps_the_tail_for_errors() -> None:
    lines: list[str] = []
    stream(["sh", "-c", "echo one; echo two >&2"], hint="unused", on_line=lines.append)
    assert lines == ["one", "two"]
    with pytest.raises(ToolError, match=r"(?s)exit 1.*\| last words"):
        stream(["sh", "-c", "echo last words; exit 1"], hint="see above", on_line=lines.append)
