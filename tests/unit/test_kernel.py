"""A context's interpreter (forkd.guest.kernel) run in this process: deadlines, interrupts, frames.

The agent sends SIGINT at a cell's deadline and for a cancel; the context tells them apart by the
deadline it was given. These tests deliver the SIGINT themselves, from inside the cell.
"""

from __future__ import annotations

import linecache
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from forkd.guest import kernel, protocol

pytestmark = pytest.mark.timeout(30)

MANY_LARGE_RESULTS = """
class Big:  # three formats of 3 MiB each: one result of 9 MiB
    _repr_html_ = lambda self: 'h' * (3 << 20)
    _repr_markdown_ = lambda self: 'm' * (3 << 20)
    _repr_latex_ = lambda self: 'l' * (3 << 20)
display(Big())
for c in 'abcd':
    display(c * (3 << 20))
'last'
"""
SELF_INTERRUPT = "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nimport time; time.sleep(10)"


@pytest.fixture
def link() -> Iterator[tuple[kernel.Connection, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield kernel.Connection(ours), theirs
    ours.close()
    theirs.close()


@pytest.fixture
def context() -> Iterator[kernel.Kernel]:
    """A kernel with its SIGINT handler, as a context runs it; this process's handler comes back after."""
    previous = signal.getsignal(signal.SIGINT)
    k = kernel.Kernel({"display": kernel.display}, "test")
    k._interrupts = kernel.Interrupts()  # what serve() installs
    yield k
    signal.signal(signal.SIGINT, previous)


def run(k: kernel.Kernel, conn: kernel.Connection, op: str, **args: Any) -> tuple[kernel._Run, dict[str, Any]]:
    cell = kernel._Run(conn, 1, None)
    return cell, k.run(cell, op, args)


def test_sigint_before_the_deadline_is_a_cancel(context: kernel.Kernel, link: Any) -> None:
    _, result = run(context, link[0], protocol.OP_RUN_CODE, code=SELF_INTERRUPT,
                    timeout_s=60, deadline=time.monotonic() + 60)
    assert result["error"]["name"] == "KeyboardInterrupt"


def test_sigint_past_the_deadline_is_a_timeout(context: kernel.Kernel, link: Any) -> None:
    deadline = time.monotonic() + 0.05
    code = f"import time\nwhile time.monotonic() < {deadline!r}: pass\n" + SELF_INTERRUPT
    _, result = run(context, link[0], protocol.OP_RUN_CODE, code=code, timeout_s=0.05, deadline=deadline)
    assert result["error"]["name"] == "TimeoutError" and "0.05 s timeout" in result["error"]["value"]


def test_a_cell_whose_deadline_passed_before_it_started_does_not_run(context: kernel.Kernel, link: Any) -> None:
    _, result = run(context, link[0], protocol.OP_EVAL, expr="__import__('os').environ.setdefault('RAN', '1')",
                    timeout_s=0.01, deadline=time.monotonic() - 1)
    assert result["error"]["name"] == "TimeoutError" and result["value"] is None
    assert run(context, link[0], protocol.OP_EVAL, expr="1 + 1")[1]["value"] == "2"  # next cells run


def test_sigint_between_cells_is_ignored(context: kernel.Kernel, link: Any) -> None:
    signal.raise_signal(signal.SIGINT)  # would raise KeyboardInterrupt here if it were not ignored
    assert run(context, link[0], protocol.OP_EVAL, expr="2")[1]["value"] == "2"


def test_the_main_result_is_held_for_the_answer_and_sent_with_it_in_one_write(
        context: kernel.Kernel, link: Any) -> None:
    conn, peer = link
    cell, result = run(context, conn, protocol.OP_RUN_CODE, code="display('shown')\n6 * 7")
    peer.settimeout(5)
    assert protocol.decode_frame(peer.recv(65536))["data"]["text"] == "'shown'"  # display() goes out at once
    assert [frame["data"]["text"] for frame in cell.held] == ["42"]
    conn.send(*cell.held, protocol.ok(1, result))
    data = b""
    while data.count(b"\n") < 2:
        data += peer.recv(65536)
    event, answer = map(protocol.decode_frame, data.splitlines())
    assert event["event"] == protocol.EVENT_RESULT and event["data"]["is_main_result"] is True
    assert answer["result"]["results"][-1] == event["data"]


def test_a_context_keeps_the_sources_of_its_latest_cells_only(link: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell's source goes to linecache for its tracebacks; a context that ran many keeps the latest."""
    monkeypatch.setattr(kernel, "CELL_SOURCES_KEPT", 3)
    k = kernel.Kernel({}, "bounded")
    for value in range(4):
        run(k, link[0], protocol.OP_EVAL, expr=str(value))
    _, failed = run(k, link[0], protocol.OP_RUN_CODE, code="x = 1\n1 / 0")
    assert [name in linecache.cache for name in ("<cell-1>", "<cell-2>", "<cell-3>", "<cell-4>", "<cell-5>")] == \
        [False, False, True, True, True]
    assert "1 / 0" in failed["error"]["traceback"]  # the latest cell's lines are still shown


def test_a_context_bounds_the_characters_of_the_sources_it_keeps(link: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "CELL_SOURCES_MAX_CHARS", 10)
    k = kernel.Kernel({}, "bounded")
    for _ in range(3):
        run(k, link[0], protocol.OP_EVAL, expr="1 + 2 + 3")  # 9 characters each
    assert [name in linecache.cache for name in ("<cell-1>", "<cell-2>", "<cell-3>")] == [False, False, True]



def test_results_past_a_frame_answer_with_markers_instead_of_failing_the_cell(
        context: kernel.Kernel, link: Any) -> None:
    """Before: the answer carrying every result passed 16 MiB and the cell failed `cannot send result`."""
    conn, peer = link
    received = bytearray()
    reader = threading.Thread(target=lambda: [received.extend(c) for c in iter(lambda: peer.recv(1 << 20), b"")],
                              daemon=True)  # sends block on a full socket buffer
    reader.start()
    cell, result = run(context, conn, protocol.OP_RUN_CODE, code=MANY_LARGE_RESULTS)
    conn.send(*cell.held, protocol.ok(1, result))
    conn._sock.shutdown(socket.SHUT_WR)
    reader.join(timeout=20)
    *events, answer = [protocol.decode_frame(line) for line in bytes(received).splitlines()]
    assert answer.get("ok") is True, str(answer)[:300]
    shown = [f["data"]["text"] for f in events]  # every result was streamed, the too large one as its marker
    assert shown[0].startswith("[result not sent: its html/latex/markdown/text take 9.0 MiB, over the 8 MiB")
    assert [text[1] for text in shown[1:5]] == list("abcd") and shown[5] == "'last'"
    kept = [r["text"] for r in answer["result"]["results"]]
    assert kept[:4] == shown[:4] and kept[5] == "'last'"
    assert kept[4].startswith("[result not kept in the cell's answer: its results passed 12 MiB")
    assert answer["result"]["truncated"] is True
    assert len(protocol.encode_frame(answer)) < protocol.MAX_FRAME_BYTES
