"""forkd.guest.dispatch: wake pipes reused but never shared by two requests; events held for one write."""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from forkd.guest import channel, dispatch, protocol

pytestmark = pytest.mark.timeout(30)


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_closed_controls_pipe_serves_the_next_request() -> None:
    first = dispatch.Control()
    fds = first.wake_fd
    first.close()
    second = dispatch.Control()
    assert second.wake_fd == fds
    second.close()


def test_steering_before_the_end_does_not_wake_the_next_request() -> None:
    first = dispatch.Control()
    first.set(paused=True)
    assert readable(first.wake_fd)
    first.close()
    second = dispatch.Control()
    assert not readable(second.wake_fd) and not second.paused
    second.close()


def test_steering_after_the_end_reaches_nobody() -> None:
    first = dispatch.Control()
    first.close()
    second = dispatch.Control()
    first.set(cancel=True)  # a late cancel for the ended request
    assert not readable(second.wake_fd) and not second.cancelled
    second.set(cancel=True)
    assert readable(second.wake_fd) and second.cancelled
    second.close()


def test_spare_pipes_are_bounded() -> None:
    pool = dispatch._WakePipes(spare=1)
    kept, extra = pool.take(), pool.take()
    pool.give(*kept)
    pool.give(*extra)
    for fd in extra:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed, not kept
    assert pool.take() == kept
    os.close(kept[0])
    os.close(kept[1])


@pytest.fixture
def host() -> Iterator[tuple[channel.Channel, socket.socket]]:
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    yield channel.Channel(ours.fileno(), ours.fileno(), reconnects=False), theirs
    ours.close()
    theirs.close()


def frames_in_one_read(sock: socket.socket) -> list[dict[str, Any]]:
    return [protocol.decode_frame(line) for line in sock.recv(1 << 20).splitlines()]


def test_held_events_go_out_with_the_answer_in_one_write(host: Any) -> None:
    chan, peer = host
    req = dispatch.Request(chan, 7, "run_code", {})
    req.emit(protocol.EVENT_STDOUT, {"text": "a"}, hold=True)
    req.emit(protocol.EVENT_RESULT, {"text": "1"}, hold=True)
    assert not readable(peer.fileno())
    req.run(lambda _: {"value": "1"})
    frames = frames_in_one_read(peer)
    assert [f.get("event") for f in frames] == [protocol.EVENT_STDOUT, protocol.EVENT_RESULT, None]
    assert frames[-1] == protocol.ok(7, {"value": "1"})


def test_an_event_not_held_takes_the_held_ones_along_in_order(host: Any) -> None:
    chan, peer = host
    req = dispatch.Request(chan, 8, "run_code", {})
    req.emit(protocol.EVENT_STDOUT, {"text": "first"}, hold=True)
    req.emit(protocol.EVENT_STDOUT, {"text": "second"})
    assert [f["data"]["text"] for f in frames_in_one_read(peer)] == ["first", "second"]


def test_held_events_are_bounded(host: Any) -> None:
    chan, peer = host
    req = dispatch.Request(chan, 9, "run_code", {})
    big = "x" * protocol.READ_CHUNK_BYTES
    req.emit(protocol.EVENT_STDOUT, {"text": big}, hold=True)
    req.emit(protocol.EVENT_STDOUT, {"text": "next"}, hold=True)  # over the bound: both go out now
    data = b""
    while data.count(b"\n") < 2:
        data += peer.recv(1 << 20)
    assert [protocol.decode_frame(line)["data"]["text"] for line in data.splitlines()] == [big, "next"]


def test_an_answer_that_cannot_be_sent_still_carries_the_held_events(host: Any) -> None:
    chan, peer = host
    req = dispatch.Request(chan, 10, "eval", {})
    req.emit(protocol.EVENT_STDOUT, {"text": "kept"}, hold=True)
    req.run(lambda _: {"value": object()})
    event, answer = frames_in_one_read(peer)
    assert event["data"]["text"] == "kept"
    assert answer["error"]["code"] == protocol.ERR_INTERNAL


def test_an_event_that_cannot_be_sent_leaves_the_held_ones_for_the_answer(host: Any) -> None:
    chan, peer = host
    req = dispatch.Request(chan, 11, "run_code", {})
    req.emit(protocol.EVENT_STDOUT, {"text": "kept"}, hold=True)
    with pytest.raises(TypeError):
        req.emit(protocol.EVENT_RESULT, {"text": object()})
    req.run(lambda _: {"value": "1"})
    event, answer = frames_in_one_read(peer)
    assert event["data"]["text"] == "kept" and answer["result"] == {"value": "1"}


class _Ops:
    """One inline op and one worker op, each answering at once."""

    def handlers(self) -> dict[str, dispatch.Handler]:
        return {"now": dispatch.inline(lambda req: {"inline": True}), "later": lambda req: {"inline": False}}

    def shutdown(self) -> None:
        pass


def _answer_to(chan: channel.Channel, peer: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
    dispatch.Dispatcher([_Ops()])._dispatch(chan, protocol.encode_frame(request).rstrip(b"\n"))
    return frames_in_one_read(peer)[-1]


@pytest.mark.parametrize("op", ["now", "later"])
def test_a_traced_request_answers_its_marks_in_stage_order(host: Any, op: str) -> None:
    chan, peer = host
    answer = _answer_to(chan, peer, protocol.request(12, op, trace=True))
    assert answer["ok"] and answer["result"] == {"inline": op == "now"}
    marks = protocol.trace_marks(answer)
    assert marks is not None and [stage for stage, _ in marks] == ["read", "decoded", "started", "handled"]
    times = [at for _, at in marks]
    assert times == sorted(times) and times[-1] - times[0] < 5e9  # guest CLOCK_MONOTONIC ns


def test_an_untraced_request_answers_without_marks(host: Any) -> None:
    chan, peer = host
    assert protocol.TRACE not in _answer_to(chan, peer, protocol.request(13, "later"))
    assert protocol.TRACE not in _answer_to(chan, peer, {**protocol.request(14, "later"), "trace": "yes"})


def test_marks_from_another_process_are_checked_and_bounded() -> None:
    req = dispatch.Request(channel.Channel(-1, -1, reconnects=False), 15, "eval", {})
    req.trace = [["read", 1]]
    req.add_marks([["ctx_read", 2], ["ctx_ran", 3]])
    req.add_marks([["bad", "3"]])  # the wrong shape: none of it is taken
    req.add_marks("not a list")
    assert req.trace == [["read", 1], ["ctx_read", 2], ["ctx_ran", 3]]
    req.add_marks([["many", n] for n in range(protocol.MAX_TRACE_MARKS + 1)])  # over the bound: refused whole
    assert req.trace == [["read", 1], ["ctx_read", 2], ["ctx_ran", 3]]
    req.add_marks([["many", n] for n in range(protocol.MAX_TRACE_MARKS)])  # kept up to the bound
    for n in range(protocol.MAX_TRACE_MARKS):
        req.mark(f"m{n}")
    assert len(req.trace) == protocol.MAX_TRACE_MARKS and req.trace[-1] == ["many", protocol.MAX_TRACE_MARKS - 4]


def test_the_readers_wait_ends_at_once_when_the_host_sent_more(host: Any) -> None:
    chan, peer = host
    lines = chan.lines()
    peer.sendall(b'{"id": 1}\n{"id": 2}\n')  # two requests in one read: the second waits in the buffer
    assert next(lines) == b'{"id": 1}'
    other_r, other_w = os.pipe()
    try:
        os.write(other_w, b"x")
        assert chan.wait_readable([other_r], 5.0) == []  # the host's next request comes first
        assert next(lines) == b'{"id": 2}'
        assert chan.wait_readable([other_r], 5.0) == [other_r]
        os.read(other_r, 1)
        assert chan.wait_readable([other_r], 0.01) == []  # nothing: the timeout
        peer.sendall(b'{"id": 3}\n')
        assert chan.wait_readable([other_r], 5.0) == []  # the host wrote: unread, but the wait ends
    finally:
        os.close(other_r)
        os.close(other_w)
