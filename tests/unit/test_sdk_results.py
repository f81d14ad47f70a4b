"""The SDK's reading of run_code answers: E2B's Result formats and errors, old answers too."""

from __future__ import annotations

from forkd.sdk.models import Logs
from forkd.sdk.sandbox.main import _execution


def test_rich_results_become_e2b_results() -> None:
    outcome = {
        "value": "Fig", "value_json": None, "error": None,
        "results": [{"png": "iVBO", "text": "<Figure>", "is_main_result": False},
                    {"html": "<b>x</b>", "json": {"a": 1}, "text": "X()", "extra": {"k": 1}, "is_main_result": True,
                     "unknown_future_key": 1}],
    }
    execution = _execution(outcome, Logs())
    shown, main = execution.results
    assert (shown.png, shown.is_main_result, shown.formats()) == ("iVBO", False, ["text", "png"])
    assert (main.html, main.json, main.extra, main.is_main_result) == ("<b>x</b>", {"a": 1}, {"k": 1}, True)
    assert execution.text == "X()"


def test_the_main_result_carries_the_json_value() -> None:
    outcome = {"value": "42", "value_json": 42, "error": None, "results": [{"text": "42", "is_main_result": True}]}
    assert _execution(outcome, Logs()).results[0].json == 42


def test_an_answer_without_results_keeps_the_value() -> None:
    execution = _execution({"value": "42", "value_json": 42, "error": None}, Logs())
    assert [(r.text, r.json, r.is_main_result) for r in execution.results] == [("42", 42, True)]


def test_interpreter_crash_error_keeps_its_signal_and_context_state() -> None:
    error = {"name": "InterpreterCrashed", "value": "killed by signal 11 (SIGSEGV)", "traceback": "",
             "signal": 11, "signal_name": "SIGSEGV", "exit_code": None, "context": "restored"}
    execution = _execution({"value": None, "value_json": None, "error": error, "results": []}, Logs())
    assert execution.error is not None
    assert (execution.error.name, execution.error.signal, execution.error.context) == (
        "InterpreterCrashed", 11, "restored")
