"""Request steering (forkd.guest.dispatch.Control): wake pipes are reused, never shared by two requests."""

from __future__ import annotations

import os
import select

import pytest

from forkd.guest import dispatch

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
