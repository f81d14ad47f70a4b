"""The agent's handle on the warm template process (:mod:`template`): requests to it over a Unix
socket (file descriptors travel with them), the template restarted and re-warmed when it dies, and
the exit reports of the interpreters it forks. :mod:`interpreters` and :mod:`processes` use it.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from . import protocol
from .channel import log
from .dispatch import AgentError

#: Exit reports kept for pids nobody has asked about yet.
EXITS_KEPT = 1024

_GONE: dict[str, Any] = {"gone": True}




class FrameSocket:
    """Guest-protocol frames over a Unix stream socket, read with a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._send_lock = threading.Lock()

    def send(self, frame: dict[str, Any], fds: list[int] | None = None) -> None:
        data = protocol.encode_frame(frame)
        with self._send_lock:
            if fds:
                sent = socket.send_fds(self.sock, [data], fds)
                data = data[sent:]
            self.sock.sendall(data)

    def buffered(self) -> bool:
        return b"\n" in self._buf

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next frame; None at EOF. Raises TimeoutError when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (end := self._buf.find(b"\n")) < 0:
            if deadline is not None:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError
            chunk = self.sock.recv(protocol.READ_CHUNK_BYTES)
            if not chunk:
                return None
            self._buf += chunk
            if len(self._buf) > protocol.MAX_FRAME_BYTES + 1 and b"\n" not in self._buf:
                return None  # a broken interpreter; treat like one that died
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        return protocol.decode_frame(line)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TemplateGone(AgentError):
    def __init__(self, message: str) -> None:
        super().__init__(protocol.ERR_INTERNAL, message)


class TemplateProcess:
    """The agent's handle on the template: requests to it, and the exit reports of its forks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one request at a time; fds travel with their request
        self._state = threading.Condition()
        self._exits: collections.OrderedDict[int, tuple[int | None, int | None]] = collections.OrderedDict()
        self._replies: dict[int, tuple[queue.SimpleQueue[dict[str, Any]], Any]] = {}
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen[bytes] | None = None
        self._link: FrameSocket | None = None
        self.warm_log: list[dict[str, Any]] = []  # replayed into a replacement template
        self.warm_modules: list[str] = []
        self.restarts = -1
        self._reseed_before_warm: bytes | None = None  # see reseed_before_warm

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        with self._lock:
            self._ensure()

    def request(self, op: str, args: dict[str, Any], fds: list[int] | None = None,
                on_event: Any = None) -> dict[str, Any]:
        with self._lock:
            self._ensure()
            if op == protocol.OP_WARM and self._reseed_before_warm is not None:
                entropy, self._reseed_before_warm = self._reseed_before_warm, None
                self._request(protocol.OP_RESEED, {"entropy_b64": protocol.b64encode(entropy)}, None, None)
            return self._request(op, args, fds, on_event)

    def reseed_before_warm(self, entropy: bytes) -> None:
        """Reseed the template's own generators before it next runs code of its own (``warm``).

        Only a warm-up runs code in the template; everything else it does is fork, and every fork
        reseeds its generators from the kernel as it starts (``template._become_child``), after the
        agent's reseed has reseeded the kernel. So a restored VM's reseed need not wait for a round
        trip through the template, whose first run under TCG costs a child's reseed ~100 ms.
        """
        self._reseed_before_warm = entropy

    def fork(self, args: dict[str, Any], fds: list[int]) -> int:
        return int(self.request("fork", args, fds)["pid"])

    def wait_exit(self, pid: int, timeout: float) -> tuple[int | None, int | None] | None:
        """``(exit_code, signal)`` of a fork once the template reaped it, or None if unknown."""
        deadline = time.monotonic() + timeout
        with self._state:
            while pid not in self._exits:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._link is None:
                    return None
                self._state.wait(remaining)
            return self._exits.pop(pid)

    def forget_exit(self, pid: int) -> None:
        with self._state:
            self._exits.pop(pid, None)

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _request(self, op: str, args: dict[str, Any], fds: list[int] | None, on_event: Any) -> dict[str, Any]:
        assert self._link is not None
        req_id = next(self._ids)
        replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        with self._state:
            self._replies[req_id] = (replies, on_event)
        try:
            self._link.send(protocol.request(req_id, op, {**args, "nfds": len(fds or [])}), fds)
            frame = replies.get()
        except OSError as exc:
            raise TemplateGone(f"the warm template is unreachable: {exc}") from None
        finally:
            with self._state:
                self._replies.pop(req_id, None)
        if frame is _GONE:
            raise TemplateGone("the warm template exited; it is restarted on the next request")
        if frame.get("ok"):
            return frame.get("result") or {}
        err = dict(frame.get("error") or {})
        raise AgentError(str(err.pop("code", protocol.ERR_INTERNAL)), str(err.pop("message", "")), **err)

    def _ensure(self) -> None:
        """Start the template if it is not running, replaying the warm-up into a replacement."""
        if self._proc is not None and self._link is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = os.path.dirname(__file__)
        for _ in (__package__ or "").split("."):
            package_root = os.path.dirname(package_root)
        env = {**os.environ, "MPLBACKEND": os.environ.get("MPLBACKEND", "Agg")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        flags = ["-S"] if sys.flags.no_site else []
        try:
            self._proc = subprocess.Popen(
                [sys.executable, *flags, "-m", f"{__package__}.template", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            theirs.close()
        self._link = FrameSocket(ours)
        self.restarts += 1
        threading.Thread(target=self._read, args=(self._link, self._proc), name="template-reader",
                         daemon=True).start()
        for warm in self.warm_log:
            try:
                self._request(protocol.OP_WARM, warm, None, None)
            except AgentError as exc:
                log(f"replaying the warm-up into a new template failed: {exc}")

    def _read(self, link: FrameSocket, proc: subprocess.Popen[bytes]) -> None:
        """Route the template's frames: replies and events to their request, exits to waiters."""
        try:
            while (frame := link.read()) is not None:
                if frame.get("event") == "exit" and frame.get("id") is None:
                    data = frame.get("data") or {}
                    with self._state:
                        self._exits[int(data["pid"])] = (data.get("exit_code"), data.get("signal"))
                        while len(self._exits) > EXITS_KEPT:
                            self._exits.popitem(last=False)
                        self._state.notify_all()
                    continue
                with self._state:
                    replies, on_event = self._replies.get(frame.get("id"), (None, None))
                if replies is None:
                    continue
                if protocol.is_terminal(frame):
                    replies.put(frame)
                elif on_event is not None:
                    on_event(frame["event"], frame.get("data") or {})
        except (OSError, ValueError) as exc:
            log(f"template link failed: {exc}")
        log(f"the warm template (pid {proc.pid}) exited with status {proc.wait()}")
        link.close()
        with self._state:
            if self._link is link:
                self._link = None
                self._proc = None
            for replies, _ in self._replies.values():
                replies.put(_GONE)
            self._state.notify_all()
