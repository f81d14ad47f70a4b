"""Drive forkd with E2B's unmodified Python SDKs (``e2b``, ``e2b-code-interpreter``).

Pointed at forkd only through the environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, and
E2B_TEST_TEMPLATE (the forkd snapshot to start sandboxes from), E2B_TEST_CHART_TEMPLATE (one whose
image has matplotlib, for the ``charts`` check). Prints ``ok NAME`` per check that
passed, ``FAIL NAME: why`` per check that did not, and exits non-zero if any failed. Check names
given as arguments run only those (the sandbox is still created, and killed only by ``kill``).
"""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from e2b import (
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b_code_interpreter import Sandbox as CodeSandbox
from e2b_code_interpreter.charts import ChartType

from checks import check, failures

TEMPLATE = os.environ["E2B_TEST_TEMPLATE"]
CHART_CELL = (Path(__file__).resolve().parent.parent / "chart_cell.py").read_text()
MATPLOTLIB_CELL = (Path(__file__).resolve().parent.parent / "matplotlib_cell.py").read_text()
BIG = 20 << 20


def expect_raises(kind: type[BaseException], body: Callable[[], object]) -> BaseException:
    try:
        body()
    except kind as exc:
        return exc
    raise AssertionError(f"expected {kind.__name__}")


def listed_ids(**query: object) -> list[str]:
    paginator = Sandbox.list(query=SandboxQuery(**query) if query else None)
    ids: list[str] = []
    while paginator.has_next:
        ids += [info.sandbox_id for info in paginator.next_items()]
    return ids


def main() -> int:
    sbx = Sandbox.create(template=TEMPLATE, timeout=900, metadata={"suite": "e2b-python"}, envs={"GREETING": "hi"})
    print(f"sandbox {sbx.sandbox_id}", flush=True)

    def commands() -> None:
        assert sbx.commands.run("echo $GREETING $EXTRA", envs={"EXTRA": "there"}).stdout == "hi there\n"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"

    def stdout_streams_before_the_end() -> None:
        seen: list[str] = []

        def on_stdout(text: str) -> None:
            seen.append(text)
            if "ready" in text:  # the command only ends once this callback has run
                sbx.files.write("/tmp/go", "1")

        result = sbx.commands.run("rm -f /tmp/go; echo ready; while [ ! -f /tmp/go ]; do sleep 0.1; done; echo done",
                                  on_stdout=on_stdout, timeout=120)
        assert seen[0].startswith("ready"), seen
        assert result.stdout == "ready\ndone\n", result.stdout

    def background_command_killed() -> None:
        handle = sbx.commands.run("sleep 600", background=True)
        assert handle.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(handle.pid)
        error = expect_raises(CommandExitException, handle.wait)
        assert error.exit_code != 0  # type: ignore[attr-defined]
        assert handle.pid not in [p.pid for p in sbx.commands.list()]

    def stdin() -> None:
        handle = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "piped\n")
        sbx.commands.close_stdin(handle.pid)
        assert handle.wait().stdout == "piped\n"

    def non_zero_exit() -> None:
        error = expect_raises(CommandExitException, lambda: sbx.commands.run("echo oops >&2; exit 3"))
        assert error.exit_code == 3 and error.stderr == "oops\n"  # type: ignore[attr-defined]

    def files() -> None:
        data = os.urandom(BIG)
        slow = 900  # seconds: 20 MiB through an emulated (TCG) guest on a busy host
        sbx.files.write("/tmp/big.bin", data, request_timeout=slow)
        assert sbx.files.read("/tmp/big.bin", format="bytes", request_timeout=slow) == data
        assert sbx.commands.run("stat -c %s /tmp/big.bin").stdout.strip() == str(BIG)
        sbx.files.write("/tmp/dir/a.txt", "hello")
        assert [e.name for e in sbx.files.list("/tmp/dir")] == ["a.txt"]
        assert sbx.files.exists("/tmp/dir/a.txt")
        sbx.files.rename("/tmp/dir/a.txt", "/tmp/dir/b.txt")
        assert not sbx.files.exists("/tmp/dir/a.txt")
        assert sbx.files.read("/tmp/dir/b.txt") == "hello"
        sbx.files.remove("/tmp/dir/b.txt")
        assert not sbx.files.exists("/tmp/dir/b.txt")
        assert sbx.files.make_dir("/tmp/dir/sub") is True
        assert sbx.files.make_dir("/tmp/dir/sub") is False
        expect_raises(NotFoundException, lambda: sbx.files.read("/tmp/missing"))

    def watch() -> None:
        sbx.files.make_dir("/tmp/watched")
        handle = sbx.files.watch_dir("/tmp/watched", recursive=True)
        try:
            sbx.files.write("/tmp/watched/new.txt", "x")
            deadline, seen = time.monotonic() + 60, []
            while not any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in seen):
                assert time.monotonic() < deadline, seen
                seen += handle.get_new_events()
                time.sleep(0.2)
        finally:
            handle.stop()

    def pty() -> None:
        output: list[bytes] = []
        handle = sbx.pty.create(PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(handle.pid, b"stty size > /tmp/pty-size; read line; stty size; exit 5\n")
        deadline = time.monotonic() + 60
        # The first stty has answered (the shell creates the file before stty writes to it) before the resize.
        while not (sbx.files.exists("/tmp/pty-size") and sbx.files.read("/tmp/pty-size").strip()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        sbx.pty.resize(handle.pid, PtySize(rows=12, cols=40))
        sbx.pty.send_stdin(handle.pid, b"go\n")
        error = expect_raises(CommandExitException, lambda: handle.wait(on_pty=output.append))
        assert error.exit_code == 5, error  # type: ignore[attr-defined]
        assert sbx.files.read("/tmp/pty-size").strip() == "30 100"
        assert "12 40" in b"".join(output).decode(), output

    def second_client() -> None:
        sbx.files.write("/tmp/shared", "from the first client")
        other = Sandbox.connect(sbx.sandbox_id)
        assert other.files.read("/tmp/shared") == "from the first client"
        assert other.commands.run("echo $GREETING").stdout == "hi\n"

    def set_timeout() -> None:
        sbx.set_timeout(1200)
        info = sbx.get_info()
        left = (info.end_at - info.started_at).total_seconds() - (time.time() - info.started_at.timestamp())
        assert 1100 < left <= 1200, left
        assert info.metadata == {"suite": "e2b-python"} and info.state == SandboxState.RUNNING

    def listing() -> None:
        assert sbx.sandbox_id in listed_ids(metadata={"suite": "e2b-python"})
        assert sbx.sandbox_id not in listed_ids(metadata={"suite": "other"})

    def wrong_api_key() -> None:
        expect_raises(AuthenticationException,
                      lambda: Sandbox.list(api_key="e2b_" + "0" * 40).next_items())

    def unknown_sandbox() -> None:
        expect_raises(NotFoundException, lambda: Sandbox.connect("sb-doesnotexist"))
        expect_raises(NotFoundException, lambda: Sandbox.get_info("sb-doesnotexist"))

    def client_timeouts() -> None:
        """A client that gives up stops its work in the guest: the cell is interrupted (the next one
        answers instead of waiting for the abandoned sleep), the command ends at its timeout."""
        code = CodeSandbox.create(template=TEMPLATE, timeout=600)
        try:
            code.run_code("kept = 1")
            expect_raises(TimeoutException, lambda: code.run_code("import time; time.sleep(3600)", timeout=3))
            after = code.run_code("kept + 1", timeout=300)  # before: waited for the hour-long sleep
            assert after.text == "2" and after.error is None, after
            expect_raises(Exception, lambda: code.commands.run("sleep 3600 && echo never", timeout=3))
            for _ in range(120):  # bounds a hang only: the command ends 3 s after it started
                if not any("sleep 3600" in " ".join(p.args) for p in code.commands.list()):
                    break
                time.sleep(1)
            else:
                raise AssertionError("the command outlived its timeout")
        finally:
            code.kill()

    def run_code() -> None:
        code = CodeSandbox.create(template=TEMPLATE, timeout=600)
        try:
            code.run_code("x = 41")
            execution = code.run_code("print('side'); x + 1")
            assert execution.text == "42", execution
            assert execution.logs.stdout == ["side\n"], execution.logs
            failed = code.run_code("1 / 0")
            assert failed.error is not None and failed.error.name == "ZeroDivisionError", failed
            context = code.create_code_context()
            assert code.run_code("x = 1; x", context=context).text == "1"
            assert code.run_code("x").text == "41"  # the default context kept its own x
            assert context.id in [c.id for c in code.list_code_contexts()]
            code.remove_code_context(context)
            code.restart_code_context("default")
            assert code.run_code("'x' in globals()").text == "False"
            chart = code.run_code(CHART_CELL)
            assert chart.error is None, chart.error
            (result,) = chart.results
            assert base64.b64decode(result.png).startswith(b"\x89PNG"), result
        finally:
            code.kill()

    def charts() -> None:
        code = CodeSandbox.create(template=os.environ["E2B_TEST_CHART_TEMPLATE"], timeout=600)
        try:
            execution = code.run_code(MATPLOTLIB_CELL, timeout=600)
            assert execution.error is None, execution.error
            line, scatter, bar, pie = (result.chart for result in execution.results)
            assert all(base64.b64decode(r.png).startswith(b"\x89PNG") for r in execution.results)
            assert (line.type, line.title, line.x_unit) == (ChartType.LINE, "Line", "d"), line.to_dict()
            assert [(e.label, e.points) for e in line.elements] == [("growth", [(1, 2), (2, 4), (3, 8)])]
            assert scatter.type == ChartType.SCATTER and scatter.elements[0].points == [(1, 3), (2, 4)]
            assert bar.type == ChartType.BAR, bar.to_dict()
            assert [(e.label, e.group, e.value) for e in bar.elements] == [("apples", "stock", 3), ("pears", "stock", 5)]
            assert pie.type == ChartType.PIE
            assert [(e.label, round(e.angle)) for e in pie.elements] == [("left", 90), ("right", 270)]
        finally:
            code.kill()

    def fork() -> None:
        sbx.commands.run("echo before-fork > /tmp/state")
        children = sbx.fork(count=2, timeout=300)
        assert len(children) == 2 and all(isinstance(c, Sandbox) for c in children), children
        try:
            for child in children:
                assert child.sandbox_id != sbx.sandbox_id
                assert child.files.read("/tmp/state") == "before-fork\n"
                child.files.write("/tmp/state", child.sandbox_id)
            assert sbx.files.read("/tmp/state") == "before-fork\n"
        finally:
            for child in children:
                child.kill()

    def pause_resume() -> None:
        sbx.commands.run("echo kept-in-memory > /tmp/paused")
        assert sbx.pause() is True
        assert sbx.sandbox_id in listed_ids(state=[SandboxState.PAUSED])
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert resumed.files.read("/tmp/paused") == "kept-in-memory\n"
        assert resumed.get_info().state == SandboxState.RUNNING

    def kill() -> None:
        assert sbx.kill() is True
        assert sbx.sandbox_id not in listed_ids()

    for name, body in [("commands", commands), ("stdout_streams_before_the_end", stdout_streams_before_the_end),
                       ("background_command_killed", background_command_killed), ("stdin", stdin),
                       ("non_zero_exit", non_zero_exit), ("files", files), ("watch", watch), ("pty", pty), ("second_client", second_client),
                       ("set_timeout", set_timeout), ("list", listing), ("wrong_api_key", wrong_api_key),
                       ("unknown_sandbox", unknown_sandbox), ("client_timeouts", client_timeouts), ("run_code", run_code), ("charts", charts), ("fork", fork),
                       ("pause_resume", pause_resume), ("kill", kill)]:
        if len(sys.argv) == 1 or name in sys.argv[1:]:  # names on the command line: only those checks
            check(name, body)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
