"""The guest's fork server in a real child VM: crashing cells answer, contexts are forks of the warm
template, and warm python3 commands (pytest too) behave like fresh ones, through the REST API and SDK."""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Iterator

import pytest

from forkd import Sandbox
from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm

#: Far longer than any answer should take: the crash, not the timeout, must end each call.
GENEROUS_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def child(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str]) -> Iterator[Sandbox]:
    result = daemon.fork(snapshot_tag, 1, timeout_s=3600)
    assert result["errors"] == []
    sandbox = Sandbox.connect(result["sandboxes"][0]["id"], url=f"unix://{vm_env['FORKD_SOCKET']}")
    yield sandbox
    sandbox.kill()
    sandbox.close()


@pytest.mark.parametrize(
    ("code", "sig"),
    [
        ("import ctypes; ctypes.string_at(0)", signal.SIGSEGV),
        ("import os; os.abort()", signal.SIGABRT),
        ("import os; os.kill(os.getpid(), 4)", signal.SIGILL),
    ],
    ids=["segv", "abort", "sigill"],
)
def test_a_crashing_cell_answers_and_the_context_is_restored(child: Sandbox, code: str, sig: signal.Signals) -> None:
    context = f"crash-{sig.name}"
    child.run_code("import numpy; before = numpy.ones(3)", context=context)
    execution = child.run_code(code, context=context, timeout=GENEROUS_TIMEOUT_S)
    assert execution.error is not None and execution.error.name == "InterpreterCrashed"
    assert (execution.error.signal, execution.error.context) == (int(sig), "restored")
    # The next cell runs in a fresh fork of the warm template: numpy already imported, old names gone.
    after = child.run_code("import sys\n('numpy' in sys.modules, 'before' in globals())", context=context)
    assert after.error is None and after.text == "(True, False)"


def test_three_contexts_are_independent(child: Sandbox) -> None:
    for i in range(3):
        child.run_code(f"import os, random\nmine = {i}", context=f"ctx-{i}")
    seen = [child.eval("[mine, os.getpid(), random.random()]", context=f"ctx-{i}") for i in range(3)]
    assert [s[0] for s in seen] == [0, 1, 2]
    assert len({s[1] for s in seen}) == 3 and len({s[2] for s in seen}) == 3


def test_code_contexts_like_e2b(child: Sandbox) -> None:
    context = child.create_code_context(cwd="/tmp")
    assert (context.language, context.cwd) == ("python", "/tmp")
    assert child.run_code("import os; x = os.getcwd(); x", context=context).text == "'/tmp'"
    assert context.id in [c.id for c in child.list_code_contexts()]
    child.restart_code_context(context)
    assert child.run_code("x", context=context).error.name == "NameError"
    child.remove_code_context(context)
    assert context.id not in [c.id for c in child.list_code_contexts()]


def test_rich_results_reach_the_sdk(child: Sandbox) -> None:
    code = "class H:\n    def _repr_html_(self):\n        return '<i>h</i>'\ndisplay(H())\n6 * 7"
    execution = child.run_code(code, context="rich")
    shown, main = execution.results
    assert (shown.html, shown.is_main_result) == ("<i>h</i>", False)
    assert (main.text, main.json, main.is_main_result) == ("42", 42, True)


@pytest.mark.parametrize(
    ("code", "stdin"),
    [
        ("import sys\nprint(sys.stdin.read().upper())\nsys.exit(3)", "hello"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", None),
        ("import sys; print(sys.argv, 'numpy' in sys.modules)", None),
    ],
    ids=["stdin-exit", "signal", "argv"],
)
def test_warm_python_c_matches_a_fresh_one(daemon: Controller, child: Sandbox, code: str, stdin: str | None) -> None:
    argv = ["python3", "-c", code, "a"]
    fresh = daemon.exec(child.sandbox_id, argv, stdin=stdin)
    warm = daemon.exec(child.sandbox_id, argv, stdin=stdin, warm=True)
    keys = ("exit_code", "signal")
    assert [fresh[k] for k in keys] == [warm[k] for k in keys]
    if "numpy" in code:  # the documented difference: the warm-up's imports are already there
        assert (fresh["stdout"], warm["stdout"]) == ("['-c', 'a'] False\n", "['-c', 'a'] True\n")
    else:
        assert fresh["stdout"] == warm["stdout"]


def test_warm_pytest_matches_fresh_pytest(child: Sandbox) -> None:
    child.files.write("/tmp/proj/conftest.py", "import pytest\n\n@pytest.fixture\ndef arr():\n"
                      "    import numpy\n    return numpy.arange(4)\n")
    child.files.write("/tmp/proj/test_numbers.py", textwrap.dedent("""\
        import pytest

        def test_sum(arr):
            assert arr.sum() == 6

        @pytest.mark.parametrize("n", [1, 2])
        def test_positive(n):
            assert n > 0

        def test_wrong(arr):
            assert arr.max() == 7
        """))
    command = "python3 -m pytest -q -p no:cacheprovider /tmp/proj"
    outcomes = []
    for warm in (False, True):
        handle = child.commands.run(command, cwd="/tmp/proj", warm=warm, timeout=GENEROUS_TIMEOUT_S,
                                    background=True)
        try:
            outcomes.append(handle.wait())
        except Exception as exc:  # CommandExitException: pytest exits 1 when a test fails
            outcomes.append(exc)
    for outcome in outcomes:
        assert outcome.exit_code == 1
        assert "1 failed, 3 passed" in outcome.stdout and "assert 3 == 7" in outcome.stdout
