"""The guest agent, run for real on the host over a Unix socket (or stdio) transport.

Every test talks the wire protocol to a live agent process; commands, code and files are real.
Reseed is only ever sent to agents that cannot change the host's clock or hostname.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import itertools
import os
import pwd
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require_root
from forkd.guest import agent as agent_module
from forkd.guest import activity, channel, interpreters, processes, protocol

pytestmark = pytest.mark.timeout(60)

GUEST_PACKAGE = Path(agent_module.__file__).parent
IS_ROOT = os.geteuid() == 0
FRAME_TIMEOUT_S = 10.0


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


class AgentClient:
    """A minimal host side: one connection, frames demultiplexed by request id."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._ids = itertools.count(1)
        self._queues: collections.defaultdict[Any, queue.Queue[tuple[float, dict[str, Any]]]] = (
            collections.defaultdict(queue.Queue)
        )
        self._queues_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_frames, daemon=True)
        self._reader.start()

    def _read_frames(self) -> None:
        with self._sock.makefile("rb") as stream:
            for line in stream:
                frame = protocol.decode_frame(line)  # every line the agent sends must be a frame
                self._queue(frame["id"]).put((time.monotonic(), frame))

    def _queue(self, req_id: Any) -> queue.Queue[tuple[float, dict[str, Any]]]:
        with self._queues_lock:
            return self._queues[req_id]

    def send_raw(self, data: bytes) -> None:
        self._sock.sendall(data)

    def start(self, op: str, args: dict[str, Any] | None = None) -> int:
        req_id = next(self._ids)
        self.send_raw(protocol.encode_frame(protocol.request(req_id, op, args)))
        return req_id

    def next_frame(self, req_id: Any, timeout: float = FRAME_TIMEOUT_S) -> tuple[float, dict[str, Any]]:
        """The next frame for req_id and when it arrived."""
        return self._queue(req_id).get(timeout=timeout)

    def collect(self, req_id: Any, timeout: float = FRAME_TIMEOUT_S) -> list[tuple[float, dict[str, Any]]]:
        """Every frame of a request up to and including its terminal frame."""
        frames = []
        while True:
            frames.append(self.next_frame(req_id, timeout))
            if protocol.is_terminal(frames[-1][1]):
                return frames

    def call(self, op: str, args: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        frames = [frame for _, frame in self.collect(self.start(op, args))]
        return frames[:-1], frames[-1]

    def result(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        _, terminal = self.call(op, args)
        assert terminal["ok"] is True, terminal
        return terminal["result"]

    def error(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        _, terminal = self.call(op, args)
        assert terminal["ok"] is False, terminal
        return terminal["error"]

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)  # close() alone waits for the reader's makefile()
        self._sock.close()


class AgentProcess:
    """An agent subprocess connected to a listening Unix socket."""

    def __init__(self, prefix: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="forkd-agent-")  # short: sun_path is 108 bytes
        path = os.path.join(self._dir, "agent.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(FRAME_TIMEOUT_S)
            self.proc = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "forkd.guest.agent", "--transport", f"unix:{path}"],
                env={**os.environ, **(env or {})},
            )
            try:
                conn, _ = listener.accept()
            except OSError:  # it never connected: it must not outlive the test either
                self.proc.kill()
                self.proc.wait()
                shutil.rmtree(self._dir, ignore_errors=True)
                raise
        self.client = AgentClient(conn)

    def stop(self) -> int:
        """Hang up; the agent must exit by itself (unix transport ends with the connection)."""
        self.client.close()
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="module")
def agent() -> Iterator[AgentClient]:
    process = AgentProcess(env={"FORKD_TEST_LEAK": "agent-env"})
    yield process.client
    assert process.stop() == 0


@pytest.fixture()
def unprivileged_agent() -> Iterator[AgentClient]:
    """An agent that may not set the clock, the hostname or the kernel RNG."""
    if IS_ROOT:
        require_root("setpriv")  # to drop root's capabilities
    drop = "-sys_time,-sys_admin"
    prefix = ["setpriv", "--bounding-set", drop, "--inh-caps", drop] if IS_ROOT else []
    process = AgentProcess(prefix)
    yield process.client
    process.stop()


@pytest.fixture()
def contained_agent() -> Iterator[AgentClient]:
    """A root agent in its own UTS namespace that may seed the kernel RNG but not set the clock."""
    require_root("unshare", "setpriv")
    prefix = ["unshare", "--uts", "setpriv", "--bounding-set", "-sys_time", "--inh-caps", "-sys_time"]
    process = AgentProcess(prefix)
    yield process.client
    process.stop()


def run_exec(agent: AgentClient, args: dict[str, Any]) -> tuple[bytes, bytes, dict[str, Any], list[dict[str, Any]]]:
    """Run exec to completion: (stdout, stderr, result, events)."""
    events, terminal = agent.call(protocol.OP_EXEC, args)
    assert terminal["ok"] is True, terminal
    streams = {protocol.EVENT_STDOUT: b"", protocol.EVENT_STDERR: b""}
    for event in events[1:]:
        streams[event["event"]] += unb64(event["data"]["data_b64"])
    return streams[protocol.EVENT_STDOUT], streams[protocol.EVENT_STDERR], terminal["result"], events


def text_of(events: list[dict[str, Any]], name: str) -> str:
    return "".join(e["data"]["text"] for e in events if e["event"] == name)


# --------------------------------------------------------------------------------------------
# Framing, dispatch and bad requests
# --------------------------------------------------------------------------------------------


def test_dispatch_table_covers_every_protocol_op() -> None:
    dispatcher = agent_module.Dispatcher(agent_module.op_families())  # starts a warm template, here
    try:
        assert set(dispatcher.handlers) == protocol.ALL_OPS
    finally:
        dispatcher.shutdown()


@pytest.mark.parametrize("op", sorted(protocol.ALL_OPS))
def test_every_op_is_served_and_rejects_nonsense_args(agent: AgentClient, op: str) -> None:
    nonsense = {"path": 1, "code": 2, "pid": "x", "modules": 3, "entropy_b64": 4, "id": [5], "expr": 6}
    _, terminal = agent.call(op, nonsense)
    if terminal["ok"]:
        assert op in (protocol.OP_PING, protocol.OP_PROC_LIST, protocol.OP_CONTEXTS_LIST, protocol.OP_ACTIVITY)
    else:
        assert terminal["error"]["code"] == protocol.ERR_BAD_REQUEST, terminal


def test_ping(agent: AgentClient) -> None:
    result = agent.result(protocol.OP_PING)
    assert result["agent_version"] == protocol.AGENT_VERSION
    assert result["protocol"] == protocol.PROTOCOL_VERSION
    assert result["hostname"] == socket.gethostname()
    assert isinstance(result["pid"], int) and result["pid"] != os.getpid()
    assert result["uptime_s"] >= 0
    assert isinstance(result["warm_modules"], list)
    assert "sandbox_id" in result


@pytest.mark.parametrize(
    ("line", "expected_id"),
    [
        (b"this is not json", None),
        (b"[1, 2, 3]", None),
        (b'{"id": "seven", "op": "ping"}', None),
        (b'{"id": true, "op": "ping"}', None),
        (b'{"id": 1.5, "op": "ping"}', None),
        (b'{"id": 9001, "args": {}}', 9001),
        (b'{"id": 9002, "op": 5}', 9002),
        (b'{"id": 9003, "op": "ping", "args": [1]}', 9003),
        (b"\xff\xfe garbage", None),
    ],
)
def test_malformed_frames_get_bad_request(agent: AgentClient, line: bytes, expected_id: int | None) -> None:
    agent.send_raw(line + b"\n")
    _, frame = agent.next_frame(expected_id)
    assert frame["ok"] is False
    assert frame["error"]["code"] == protocol.ERR_BAD_REQUEST
    assert agent.result(protocol.OP_PING)["agent_version"] == protocol.AGENT_VERSION


def test_unknown_op(agent: AgentClient) -> None:
    error = agent.error("teleport", {})
    assert error["code"] == protocol.ERR_UNKNOWN_OP
    assert "teleport" in error["message"]


def test_blank_lines_are_ignored(agent: AgentClient) -> None:
    agent.send_raw(b"\n  \n\r\n")
    assert agent.result(protocol.OP_PING)["protocol"] == protocol.PROTOCOL_VERSION


def test_oversized_frame_is_rejected_and_skipped(agent: AgentClient) -> None:
    agent.send_raw(b'{"id": 1, "op": "ping", "pad": "' + b"x" * protocol.MAX_FRAME_BYTES + b'"}\n')
    _, frame = agent.next_frame(None)
    assert frame["error"]["code"] == protocol.ERR_BAD_REQUEST
    assert "exceeds" in frame["error"]["message"]
    assert agent.result(protocol.OP_PING)["protocol"] == protocol.PROTOCOL_VERSION


def test_many_concurrent_requests_on_one_connection(agent: AgentClient) -> None:
    """Ordering, not timing: ping overtakes slow requests, and all commands start before any ends."""
    execs = [agent.start(protocol.OP_EXEC, {"argv": ["sleep", "0.5"]}) for _ in range(8)]
    cells = [
        agent.start(protocol.OP_RUN_CODE, {"code": "import time; time.sleep(0.5); 7", "context": f"conc-{i}"})
        for i in range(8)
    ]
    ping = agent.start(protocol.OP_PING)
    ping_at, ping_frame = agent.collect(ping)[-1]
    exec_frames = [agent.collect(req_id) for req_id in execs]
    cell_frames = [agent.collect(req_id) for req_id in cells]
    assert ping_frame["ok"]
    assert all(frames[-1][1]["result"]["exit_code"] == 0 for frames in exec_frames)
    assert all(frames[-1][1]["result"]["value"] == "7" for frames in cell_frames)
    first_end = min(frames[-1][0] for frames in exec_frames + cell_frames)
    assert ping_at < first_end  # not queued behind the slow requests
    last_start = max(frames[0][0] for frames in exec_frames)  # each exec's `started` event
    assert last_start < first_end  # the eight commands ran side by side


# --------------------------------------------------------------------------------------------
# exec and proc.*
# --------------------------------------------------------------------------------------------


def test_exec_argv_streams_and_exit_code(agent: AgentClient) -> None:
    stdout, stderr, result, events = run_exec(agent, {"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]})
    assert events[0]["event"] == protocol.EVENT_STARTED and isinstance(events[0]["data"]["pid"], int)
    assert (stdout, stderr) == (b"out\n", b"err\n")
    assert result["exit_code"] == 3 and result["signal"] is None and result["timed_out"] is False
    assert 0 <= result["duration_s"] < 5


def test_exec_shell(agent: AgentClient) -> None:
    stdout, _, result, _ = run_exec(agent, {"shell": "for i in 1 2 3; do printf $i; done | wc -c"})
    assert stdout.strip() == b"3" and result["exit_code"] == 0


def test_exec_output_streams_as_it_arrives(agent: AgentClient) -> None:
    frames = agent.collect(agent.start(protocol.OP_EXEC, {"shell": "echo first; sleep 0.5; echo second"}))
    outputs = [(at, unb64(f["data"]["data_b64"])) for at, f in frames if f.get("event") == protocol.EVENT_STDOUT]
    assert [data for _, data in outputs] == [b"first\n", b"second\n"]
    assert frames[-1][0] - outputs[0][0] > 0.3  # "first" arrived long before the command ended


def test_exec_signal_death(agent: AgentClient) -> None:
    _, _, result, _ = run_exec(agent, {"shell": "kill -9 $$"})
    assert result["exit_code"] == 128 + signal.SIGKILL and result["signal"] == signal.SIGKILL


def test_exec_large_output_is_chunked(agent: AgentClient) -> None:
    stdout, _, _, events = run_exec(agent, {"shell": "head -c 1000000 /dev/zero"})
    assert stdout == bytes(1_000_000)
    assert all(len(unb64(e["data"]["data_b64"])) <= processes.OUTPUT_CHUNK_BYTES for e in events[1:])


def test_exec_stdin_b64_larger_than_a_pipe(agent: AgentClient) -> None:
    data = os.urandom(300_000)
    stdout, _, result, _ = run_exec(agent, {"argv": ["cat"], "stdin_b64": b64(data)})
    assert stdout == data and result["exit_code"] == 0


def test_exec_env_is_clean_and_merged(agent: AgentClient) -> None:
    stdout, _, _, _ = run_exec(
        agent, {"shell": 'echo "$PATH|$FOO|$FORKD_TEST_LEAK|$LANG"', "env": {"FOO": "bar", "LANG": "C"}}
    )
    assert stdout.decode().strip() == f"{processes.DEFAULT_PATH}|bar||C"


def test_exec_cwd(agent: AgentClient, tmp_path: Path) -> None:
    stdout, _, _, _ = run_exec(agent, {"argv": ["pwd"], "cwd": str(tmp_path)})
    assert stdout.decode().strip() == str(tmp_path)


@pytest.mark.parametrize(
    ("args", "code", "errno"),  # `forkd exec` exits 127 / 126 by the errno (cli/execute.py)
    [
        ({"argv": ["/nonexistent/binary"]}, protocol.ERR_NOT_FOUND, {"ENOENT"}),
        ({"argv": ["true"], "cwd": "/nonexistent/dir"}, protocol.ERR_NOT_FOUND, {"ENOENT"}),
        ({"argv": ["/etc/hostname"]}, protocol.ERR_OS, {"EACCES", "ENOEXEC"}),  # by its mode bits
    ],
)
def test_exec_spawn_failures(agent: AgentClient, args: dict[str, Any], code: str, errno: set[str]) -> None:
    error = agent.error(protocol.OP_EXEC, args)
    assert error["code"] == code
    assert "Errno" in error["message"] and error["errno"] in errno
    assert repr(args.get("cwd", args["argv"][0])) in error["message"]  # what tells a missing cwd from a program


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"argv": []},
        {"argv": "ls"},
        {"argv": ["ls", 1]},
        {"argv": ["ls"], "shell": "ls"},
        {"shell": "true", "env": {"A": 1}},
        {"shell": "true", "env": ["A=1"]},
        {"shell": "true", "timeout_s": -1},
        {"shell": "true", "timeout_s": True},
        {"shell": "true", "stdin_b64": "not base64!"},
        {"shell": "true", "cwd": ""},
        {"shell": "true", "user": "no-such-user-here"},
        {"argv": ["echo", "nul\u0000byte"]},
        {"shell": "true", "env": {"A=B": "x"}},
    ],
)
def test_exec_bad_arguments(agent: AgentClient, args: dict[str, Any]) -> None:
    assert agent.error(protocol.OP_EXEC, args)["code"] == protocol.ERR_BAD_REQUEST


@pytest.mark.root()  # switching users needs root
def test_exec_as_user(agent: AgentClient) -> None:
    stdout, _, _, _ = run_exec(agent, {"shell": 'id -u; echo "$HOME $USER"', "user": "nobody"})
    uid, env = stdout.decode().splitlines()
    assert int(uid) == pwd.getpwnam("nobody").pw_uid
    assert env.endswith(" nobody")


def test_exec_timeout_kills_the_process_group(agent: AgentClient) -> None:
    _, _, result, _ = run_exec(agent, {"shell": "sleep 30 & sleep 30", "timeout_s": 0.3})
    assert result["timed_out"] is True
    assert result["exit_code"] == 128 + signal.SIGKILL and result["signal"] == signal.SIGKILL
    # The background sleep held the pipes too: only a group kill ends the request before its 30 s.
    assert result["duration_s"] < 20


def start_process(agent: AgentClient, args: dict[str, Any]) -> tuple[int, int]:
    """Start exec and return (request id, pid) once it has started."""
    req_id = agent.start(protocol.OP_EXEC, args)
    _, started = agent.next_frame(req_id)
    assert started["event"] == protocol.EVENT_STARTED
    return req_id, started["data"]["pid"]


def listed(agent: AgentClient, pid: int) -> dict[str, Any]:
    (entry,) = [p for p in agent.result(protocol.OP_PROC_LIST)["processes"] if p["pid"] == pid]
    return entry


def test_proc_kill_and_list(agent: AgentClient) -> None:
    req_id, pid = start_process(agent, {"argv": ["sleep", "30"]})
    entry = listed(agent, pid)
    assert entry["argv"] == ["sleep", "30"] and entry["running"] is True and entry["exit_code"] is None
    assert entry["started_at"] == pytest.approx(time.time(), abs=5)
    assert agent.result(protocol.OP_PROC_KILL, {"pid": pid, "signal": signal.SIGTERM}) == {}
    result = agent.collect(req_id)[-1][1]["result"]
    assert result["exit_code"] == 128 + signal.SIGTERM and result["signal"] == signal.SIGTERM
    assert result["timed_out"] is False
    assert listed(agent, pid)["running"] is False and listed(agent, pid)["exit_code"] == 143
    assert agent.error(protocol.OP_PROC_KILL, {"pid": pid})["code"] == protocol.ERR_NOT_FOUND


def test_proc_kill_defaults_to_sigkill_and_lists_shell(agent: AgentClient) -> None:
    req_id, pid = start_process(agent, {"shell": "trap '' TERM; sleep 30"})
    assert listed(agent, pid)["shell"] == "trap '' TERM; sleep 30"
    agent.result(protocol.OP_PROC_KILL, {"pid": pid})
    assert agent.collect(req_id)[-1][1]["result"]["signal"] == signal.SIGKILL


def test_proc_unknown_pid(agent: AgentClient) -> None:
    for op in (protocol.OP_PROC_KILL, protocol.OP_PROC_STDIN):
        assert agent.error(op, {"pid": 999_999_999})["code"] == protocol.ERR_NOT_FOUND


def test_proc_bad_arguments(agent: AgentClient) -> None:
    req_id, pid = start_process(agent, {"argv": ["sleep", "30"]})
    for args in ({"pid": pid, "signal": 2**70}, {"pid": pid, "signal": "TERM"}, {"pid": str(pid)}):
        assert agent.error(protocol.OP_PROC_KILL, args)["code"] == protocol.ERR_BAD_REQUEST
    assert agent.error(protocol.OP_PROC_STDIN, {"pid": pid, "eof": 1})["code"] == protocol.ERR_BAD_REQUEST
    agent.result(protocol.OP_PROC_KILL, {"pid": pid})
    assert agent.collect(req_id)[-1][1]["result"]["signal"] == signal.SIGKILL


def test_proc_stdin_feeds_a_running_process(agent: AgentClient) -> None:
    req_id, pid = start_process(agent, {"argv": ["cat"]})
    assert agent.result(protocol.OP_PROC_STDIN, {"pid": pid, "data_b64": b64("hello ")}) == {"written": 6}
    _, echoed = agent.next_frame(req_id)  # cat answers before stdin is closed
    assert unb64(echoed["data"]["data_b64"]) == b"hello "
    agent.result(protocol.OP_PROC_STDIN, {"pid": pid, "data_b64": b64("world"), "eof": True})
    frames = [f for _, f in agent.collect(req_id)]
    assert unb64(frames[0]["data"]["data_b64"]) == b"world"
    assert frames[-1]["result"]["exit_code"] == 0


def test_proc_stdin_after_eof_is_rejected(agent: AgentClient) -> None:
    req_id, pid = start_process(agent, {"argv": ["sleep", "30"]})
    agent.result(protocol.OP_PROC_STDIN, {"pid": pid, "eof": True})
    error = agent.error(protocol.OP_PROC_STDIN, {"pid": pid, "data_b64": b64("late")})
    assert error["code"] == protocol.ERR_BAD_REQUEST and "closed" in error["message"]
    agent.result(protocol.OP_PROC_KILL, {"pid": pid})
    agent.collect(req_id)


# --------------------------------------------------------------------------------------------
# run_code, eval, warm
# --------------------------------------------------------------------------------------------


def run_code(agent: AgentClient, code: str, **args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events, terminal = agent.call(protocol.OP_RUN_CODE, {"code": code, **args})
    assert terminal["ok"] is True, terminal
    return events, terminal["result"]


def test_run_code_keeps_state_and_returns_the_last_expression(agent: AgentClient) -> None:
    assert run_code(agent, "x = 40", context="state")[1] == {"value": None, "value_json": None, "error": None,
                                                             "results": []}
    events, result = run_code(agent, "y = x + 1\ny + 1", context="state")
    main = {"text": "42", "is_main_result": True}
    assert result == {"value": "42", "value_json": 42, "error": None, "results": [main]}
    assert [e["data"] for e in events if e["event"] == protocol.EVENT_RESULT] == [main]


@pytest.mark.parametrize(
    ("code", "value", "value_json"),
    [
        ("None", None, None),
        ("'hi'", "'hi'", "hi"),
        ("{'a': [1, 2.5, None]}", "{'a': [1, 2.5, None]}", {"a": [1, 2.5, None]}),
        ("{1, 2}", "{1, 2}", None),
        ("float('nan')", "nan", None),
        ("x = 1", None, None),
        ("", None, None),
    ],
)
def test_run_code_values(agent: AgentClient, code: str, value: str | None, value_json: Any) -> None:
    _, result = run_code(agent, code, context="values")
    assert (result["value"], result["value_json"], result["error"]) == (value, value_json, None)


def test_run_code_streams_output_as_it_prints(agent: AgentClient) -> None:
    code = "import sys, time\nprint('a')\ntime.sleep(1.5)\nprint('b', file=sys.stderr)\nprint('c', end='')"
    frames = agent.collect(agent.start(protocol.OP_RUN_CODE, {"code": code, "context": "stream"}))
    events = [f for _, f in frames[:-1]]
    assert [(e["event"], e["data"]["text"]) for e in events] == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c")]
    assert frames[-1][0] - frames[0][0] > 0.75


def test_run_code_output_of_concurrent_cells_stays_separate(agent: AgentClient) -> None:
    code = "import time\nfor i in range(5):\n    print('{tag}', i)\n    time.sleep(0.02)"
    ids = {tag: agent.start(protocol.OP_RUN_CODE, {"code": code.format(tag=tag), "context": tag}) for tag in "pq"}
    for tag, req_id in ids.items():
        events = [f for _, f in agent.collect(req_id)[:-1]]
        assert text_of(events, "stdout") == "".join(f"{tag} {i}\n" for i in range(5))


def test_run_code_user_exception_is_a_result(agent: AgentClient) -> None:
    _, result = run_code(agent, "def f():\n    raise ValueError('boom')\nf()", context="errors")
    error = result["error"]
    assert (error["name"], error["value"]) == ("ValueError", "boom")
    assert "raise ValueError('boom')" in error["traceback"] and "<cell-" in error["traceback"]
    assert "agent.py" not in error["traceback"]
    assert result["value"] is None


def test_result_too_large_for_a_frame_is_an_internal_error(agent: AgentClient) -> None:
    error = agent.error(protocol.OP_RUN_CODE, {"code": f"'x' * {protocol.MAX_FRAME_BYTES}", "context": "huge"})
    assert error["code"] == protocol.ERR_INTERNAL and "exceeds" in error["message"]


def test_run_code_syntax_error_and_system_exit_are_results(agent: AgentClient) -> None:
    assert run_code(agent, "def (:")[1]["error"]["name"] == "SyntaxError"
    assert run_code(agent, "import sys; sys.exit(3)")[1]["error"]["name"] == "SystemExit"
    assert agent.result(protocol.OP_PING)["protocol"] == protocol.PROTOCOL_VERSION


def test_contexts_are_isolated(agent: AgentClient) -> None:
    run_code(agent, "secret = 1", context="iso-a")
    assert run_code(agent, "secret", context="iso-b")[1]["error"]["name"] == "NameError"


def test_different_contexts_run_concurrently(agent: AgentClient) -> None:
    code = "import time\nt0 = time.monotonic()\ntime.sleep(0.5)\n[t0, time.monotonic()]"
    ids = [agent.start(protocol.OP_RUN_CODE, {"code": code, "context": f"par-{i}"}) for i in range(3)]
    spans = [agent.collect(req_id)[-1][1]["result"]["value_json"] for req_id in ids]
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # all three overlapped


def test_one_context_runs_one_cell_at_a_time(agent: AgentClient) -> None:
    run_code(agent, "spans = []", context="serial")
    code = "import time\nt0 = time.monotonic()\ntime.sleep(0.2)\nspans.append((t0, time.monotonic()))"
    ids = [agent.start(protocol.OP_RUN_CODE, {"code": code, "context": "serial"}) for _ in range(3)]
    for req_id in ids:
        agent.collect(req_id)
    spans = sorted(agent.result(protocol.OP_EVAL, {"expr": "spans", "context": "serial"})["value_json"])
    assert len(spans) == 3
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans))


def test_run_code_timeout_interrupts_python_code(agent: AgentClient) -> None:
    _, result = run_code(agent, "n = 0\nwhile True:\n    n += 1", context="spin", timeout_s=0.3)
    assert result["error"]["name"] == "TimeoutError"
    assert run_code(agent, "n > 0", context="spin")[1]["value"] == "True"  # context still usable


def test_run_code_timeout_interrupts_a_blocking_call(agent: AgentClient) -> None:
    run_code(agent, "kept = 1", context="sleepy")
    _, result = run_code(agent, "import time; time.sleep(30)", context="sleepy", timeout_s=0.3)
    assert result["error"]["name"] == "TimeoutError"
    assert run_code(agent, "kept", context="sleepy")[1]["value"] == "1"


def test_run_code_that_ignores_its_timeout_gets_a_fresh_context(agent: AgentClient) -> None:
    run_code(agent, "lost = 1", context="stuck")
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    error = agent.error(protocol.OP_RUN_CODE, {"code": code, "context": "stuck", "timeout_s": 0.2})
    assert error["code"] == protocol.ERR_TIMEOUT and "restarted" in error["message"]
    # Not busy any more: the context is a fresh fork of the template, without the old variables.
    assert run_code(agent, "lost", context="stuck", timeout_s=30)[1]["error"]["name"] == "NameError"


@pytest.mark.parametrize(
    "args",
    [{}, {"code": 1}, {"code": "1", "context": 2}, {"code": "1", "context": ""}, {"code": "1", "timeout_s": -0.5}],
)
def test_run_code_bad_arguments(agent: AgentClient, args: dict[str, Any]) -> None:
    assert agent.error(protocol.OP_RUN_CODE, args)["code"] == protocol.ERR_BAD_REQUEST


def test_eval(agent: AgentClient) -> None:
    run_code(agent, "class Point:\n    pass\np = Point()\nnums = [1, 2]", context="ev")
    assert agent.result(protocol.OP_EVAL, {"expr": "sum(nums)", "context": "ev"}) == {
        "value": "3",
        "value_json": 3,
        "error": None,
        "type": "int",
    }
    point = agent.result(protocol.OP_EVAL, {"expr": "p", "context": "ev"})
    assert point["type"] == "__main__.Point" and point["value"].startswith("<__main__.Point object")
    assert point["value_json"] is None


def _traced_stages(agent: AgentClient, op: str, args: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    req_id = next(agent._ids)
    agent.send_raw(protocol.encode_frame(protocol.request(req_id, op, args, trace=True)))
    terminal = agent.collect(req_id)[-1][1]
    marks = protocol.trace_marks(terminal)
    assert terminal["ok"] and marks is not None, terminal
    return [stage for stage, _ in marks], terminal["result"]


def _fast_path_taken(agent: AgentClient, op: str, args: dict[str, Any], answered: Callable[[dict[str, Any]], bool],
                     tries: int = 5) -> list[str]:
    """The stages of the first of ``tries`` calls answered on the reader thread (no worker "resumed")."""
    for _ in range(tries):
        stages, result = _traced_stages(agent, op, args)
        assert answered(result), result
        if "resumed" not in stages:
            return stages
    raise AssertionError(f"{op} went to a worker in all {tries} tries: {stages}")


def test_a_short_cell_is_answered_without_a_worker_and_a_long_one_with(agent: AgentClient) -> None:
    """A cell whose context exists and is idle is sent and answered on the reader thread (no "resumed":
    no worker took over); a context still to be forked, or an answer not there within the reader's
    wait, goes to a worker, and the answers are the same."""
    first, result = _traced_stages(agent, protocol.OP_EVAL, {"expr": "6 * 7", "context": "eager"})
    assert "resumed" in first and result["value"] == "42"  # the context was forked on a worker
    # The reader's wait is short (EAGER_WAIT_S): a machine busy for that long sends one cell to a worker,
    # so the fast path must be taken in one of a few tries, and the answers are the same either way.
    again = _fast_path_taken(agent, protocol.OP_EVAL, {"expr": "6 * 7", "context": "eager"},
                             lambda result: result["value"] == "42")
    assert again.index("ctx_ran") < again.index("ctx_answered") < again.index("handled")
    _fast_path_taken(agent, protocol.OP_RUN_CODE, {"code": "print('hi')\n1 + 1", "context": "eager"},
                     lambda result: result["results"][0]["text"] == "2")
    slow, result = _traced_stages(agent, protocol.OP_EVAL, {"expr": f"__import__('time').sleep({interpreters.EAGER_WAIT_S * 3}) or 5",
                                                             "context": "eager"})
    assert "resumed" in slow and result["value"] == "5"


def test_a_request_sent_while_the_reader_waits_for_a_cell_is_answered_first(agent: AgentClient) -> None:
    agent.result(protocol.OP_EVAL, {"expr": "0", "context": "eager-wait"})
    order = []
    for _ in range(3):  # the ping must reach the agent within the cell's sleep: a busy machine may miss it once
        cell = agent.start(protocol.OP_EVAL, {"expr": f"__import__('time').sleep({interpreters.EAGER_WAIT_S / 2}) or 1",
                                              "context": "eager-wait"})
        ping = agent.start(protocol.OP_PING)
        ping_at, pong = agent.next_frame(ping)
        cell_at, answer = agent.next_frame(cell)
        assert pong["ok"] and answer["result"]["value"] == "1"
        order.append(ping_at < cell_at)
        if order[-1]:
            break
    assert any(order), "the cell was answered before the ping every time"


@pytest.mark.parametrize(
    ("expr", "name"), [("1 / 0", "ZeroDivisionError"), ("x = 1", "SyntaxError"), ("nope", "NameError")]
)
def test_eval_errors_are_results(agent: AgentClient, expr: str, name: str) -> None:
    result = agent.result(protocol.OP_EVAL, {"expr": expr, "context": "ev-errors"})
    assert result["error"]["name"] == name and result["type"] is None and result["value"] is None


def test_the_warm_ups_last_value_still_arrives_as_a_result_event(agent: AgentClient) -> None:
    events, terminal = agent.call(protocol.OP_WARM, {"modules": [], "code": "6 * 7"})
    assert terminal["ok"], terminal
    assert [e["data"]["text"] for e in events if e["event"] == protocol.EVENT_RESULT] == ["42"]


def test_warm_imports_and_runs_code_in_the_default_context(agent: AgentClient) -> None:
    events, terminal = agent.call(
        protocol.OP_WARM,
        {
            "modules": ["colorsys", "decimal"],
            "code": "import colorsys\nWARM = colorsys.rgb_to_hsv(1, 0, 0)\nprint('warmed')",
        },
    )
    assert terminal["ok"], terminal
    assert terminal["result"]["imported"] == ["colorsys", "decimal"] and terminal["result"]["seconds"] >= 0
    assert text_of(events, "stdout") == "warmed\n"
    assert {"colorsys", "decimal"} <= set(agent.result(protocol.OP_PING)["warm_modules"])
    # Contexts created after the warm-up start from the template: its names and its imports...
    assert agent.result(protocol.OP_EVAL, {"expr": "WARM", "context": "warm-1"})["value_json"] == [0.0, 1.0, 1.0]
    warm = agent.result(protocol.OP_EVAL, {"expr": "'decimal' in __import__('sys').modules", "context": "warm-2"})
    assert warm["value"] == "True"
    # ...bound by name, as `import decimal` would.
    assert agent.result(protocol.OP_EVAL, {"expr": "decimal.Decimal(1) + 1", "context": "warm-3"})["value"] == "Decimal('2')"
    # A context that existed before a warm-up keeps its own state and does not see it.
    agent.result(protocol.OP_WARM, {"modules": ["fractions"]})
    assert agent.result(protocol.OP_EVAL, {"expr": "fractions", "context": "warm-1"})["error"]["name"] == "NameError"
    assert agent.result(protocol.OP_EVAL, {"expr": "str(fractions.Fraction(1, 3))", "context": "warm-4"})["value_json"] == "1/3"


def test_warm_failures(agent: AgentClient) -> None:
    error = agent.error(protocol.OP_WARM, {"modules": ["json", "no_such_module_xyz"]})
    assert error["code"] == protocol.ERR_BAD_REQUEST and error["module"] == "no_such_module_xyz"
    assert "no_such_module_xyz" in error["message"]
    error = agent.error(protocol.OP_WARM, {"modules": [], "code": "raise RuntimeError('bad template')"})
    assert error["code"] == protocol.ERR_BAD_REQUEST and error["error"]["name"] == "RuntimeError"
    assert agent.error(protocol.OP_WARM, {"modules": ["json", 5]})["code"] == protocol.ERR_BAD_REQUEST


# --------------------------------------------------------------------------------------------
# reseed
# --------------------------------------------------------------------------------------------


def reseed(agent: AgentClient, entropy: bytes, **args: Any) -> dict[str, Any]:
    return agent.result(protocol.OP_RESEED, {"entropy_b64": b64(entropy), "time_ns": time.time_ns(), **args})


def draws(agent: AgentClient) -> list[Any]:
    expr = "[random.random(), numpy.random.random()]"
    return agent.result(protocol.OP_EVAL, {"expr": expr})["value_json"]


def test_reseed_without_privileges_skips_system_steps(unprivileged_agent: AgentClient) -> None:
    result = reseed(unprivileged_agent, os.urandom(32), hostname="forked-child", sandbox_id="sb-1")
    assert result["skipped"] == ["kernel_rng", "clock", "hostname"]
    assert (result["kernel_rng"], result["clock"], result["hostname"]) == (False, False, False)
    assert result["python_rng"] is True
    ping = unprivileged_agent.result(protocol.OP_PING)
    assert ping["sandbox_id"] == "sb-1" and ping["hostname"] == socket.gethostname()


def test_reseed_python_and_numpy_rngs_follow_the_entropy(unprivileged_agent: AgentClient) -> None:
    unprivileged_agent.result(protocol.OP_WARM, {"modules": ["numpy"], "code": "import random, numpy"})
    draws(unprivileged_agent)  # the default context exists before the reseeds
    entropy = os.urandom(32)
    first = reseed(unprivileged_agent, entropy)
    assert first["python_rng"] is True and first["contexts_reseeded"] == 1
    same = draws(unprivileged_agent)
    reseed(unprivileged_agent, entropy)
    assert draws(unprivileged_agent) == same
    reseed(unprivileged_agent, os.urandom(32))
    different = draws(unprivileged_agent)
    assert different[0] != same[0] and different[1] != same[1]


def test_a_context_no_cell_ran_in_gets_its_seed_with_its_first_cell(unprivileged_agent: AgentClient) -> None:
    """The snapshot's default context is reseeded lazily: its first cell must already draw from the
    reseed's stream, never from the state it was saved with (which every sibling shares)."""
    unprivileged_agent.result(protocol.OP_WARM, {"modules": ["numpy"], "code": "import random, numpy"})

    def first_draws(entropy: bytes) -> list[Any]:
        """A fresh context (its generators seeded anew as it forked), reseeded, then its first cell."""
        unprivileged_agent.result(protocol.OP_CONTEXTS_DELETE, {"id": "default"})
        unprivileged_agent.result(protocol.OP_CONTEXTS_CREATE, {"id": "default"})  # as a snapshot holds it
        result = reseed(unprivileged_agent, entropy)
        assert (result["contexts_reseeded"], result["contexts_pending"]) == (0, 1)  # not woken by the reseed
        return draws(unprivileged_agent)

    draws(unprivileged_agent)  # the default context exists
    entropy = os.urandom(32)
    first = first_draws(entropy)
    assert first_draws(entropy) == first  # the entropy decides, not the state the context had
    assert draws(unprivileged_agent) != first  # seeded once, not before every cell
    other = first_draws(os.urandom(32))
    assert all(a != b for a, b in zip(first, other)), (first, other)
    # Once a cell ran in it (the user's threads may draw between cells), a reseed reaches it at once.
    assert reseed(unprivileged_agent, entropy)["contexts_reseeded"] == 1
    assert draws(unprivileged_agent) == first


def test_the_template_is_reseeded_before_its_next_warm_up(unprivileged_agent: AgentClient) -> None:
    """Its forks seed themselves; code run in the template itself sees the reseed's entropy."""
    unprivileged_agent.result(protocol.OP_WARM, {"modules": [], "code": "import random"})
    entropy = os.urandom(32)
    for name in ("a", "b"):
        assert reseed(unprivileged_agent, entropy)["template_rng"] == "before_next_warm"
        unprivileged_agent.result(protocol.OP_WARM, {"modules": [], "code": f"{name} = random.random()"})
    reseed(unprivileged_agent, os.urandom(32))
    unprivileged_agent.result(protocol.OP_WARM, {"modules": [], "code": "c = random.random()"})
    unprivileged_agent.result(protocol.OP_CONTEXTS_CREATE, {"id": "after"})  # forked after the warm-ups
    assert unprivileged_agent.result(protocol.OP_EVAL, {"expr": "[a == b, a == c]", "context": "after"})[
        "value_json"] == [True, False]


def test_reseed_with_privileges(contained_agent: AgentClient) -> None:
    result = reseed(contained_agent, os.urandom(64), hostname="forked-7")
    assert result["kernel_rng"] is True and result["hostname"] is True
    assert result["clock"] is False and result["skipped"] == ["clock"]
    assert contained_agent.result(protocol.OP_PING)["hostname"] == "forked-7"


@pytest.mark.parametrize(
    "args",
    [
        {"time_ns": 1},
        {"entropy_b64": "", "time_ns": 1},
        {"entropy_b64": "%%%", "time_ns": 1},
        {"entropy_b64": b64("x"), "time_ns": "soon"},
        {"entropy_b64": b64("x"), "time_ns": 1, "hostname": 7},
    ],
)
def test_reseed_bad_arguments(agent: AgentClient, args: dict[str, Any]) -> None:
    assert agent.error(protocol.OP_RESEED, args)["code"] == protocol.ERR_BAD_REQUEST


# --------------------------------------------------------------------------------------------
# files.*
# --------------------------------------------------------------------------------------------


def write(agent: AgentClient, path: Path, data: bytes, **args: Any) -> dict[str, Any]:
    return agent.result(protocol.OP_FILES_WRITE, {"path": str(path), "data_b64": b64(data), **args})


def read(agent: AgentClient, path: Path | str, **args: Any) -> tuple[bytes, dict[str, Any]]:
    result = agent.result(protocol.OP_FILES_READ, {"path": str(path), **args})
    return unb64(result["data_b64"]), result


def test_files_write_then_read(agent: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "new" / "dirs" / "file.bin"
    assert write(agent, target, b"hello world") == {"size": 11}
    data, result = read(agent, target)
    assert (data, result["size"], result["eof"]) == (b"hello world", 11, True)
    data, result = read(agent, target, offset=6, length=3)
    assert (data, result["eof"]) == (b"wor", False)
    assert read(agent, target, offset=11)[0] == b""
    assert write(agent, target, b"new") == {"size": 3}  # truncates by default


def test_files_chunked_writes(agent: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "chunked"
    write(agent, target, b"aaaa")
    assert write(agent, target, b"bbbb", append=True) == {"size": 8}
    assert write(agent, target, b"XY", offset=2) == {"size": 8}  # offset writes never truncate
    assert write(agent, target, b"cc", offset=0, truncate=False) == {"size": 8}
    assert target.read_bytes() == b"ccXYbbbb"


def test_files_write_mode_and_parents(agent: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "secret"
    write(agent, target, b"s", mode=0o600)
    assert target.stat().st_mode & 0o777 == 0o600
    error = agent.error(
        protocol.OP_FILES_WRITE, {"path": str(tmp_path / "missing" / "f"), "data_b64": "", "parents": False}
    )
    assert error["code"] == protocol.ERR_NOT_FOUND and error["errno"] == "ENOENT"


def test_files_read_is_capped_at_the_chunk_size(agent: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "big"
    target.write_bytes(os.urandom(protocol.FILE_CHUNK_BYTES + 10))
    data, result = read(agent, target, length=protocol.FILE_CHUNK_BYTES * 2)
    assert len(data) == protocol.FILE_CHUNK_BYTES and result["eof"] is False
    rest, result = read(agent, target, offset=protocol.FILE_CHUNK_BYTES)
    assert data + rest == target.read_bytes() and result["eof"] is True


def test_files_read_of_a_proc_file_reaches_eof(agent: AgentClient) -> None:
    data, result = read(agent, "/proc/self/status")
    assert b"Pid:" in data and result["eof"] is True


def test_files_list_and_stat(agent: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"12345")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "c_link").symlink_to("b.txt")
    entries = agent.result(protocol.OP_FILES_LIST, {"path": str(tmp_path)})["entries"]
    assert [(e["name"], e["type"]) for e in entries] == [("a_dir", "dir"), ("b.txt", "file"), ("c_link", "symlink")]
    file_entry = entries[1]
    assert file_entry["path"] == str(tmp_path / "b.txt") and file_entry["size"] == 5
    assert file_entry["mode"] == (tmp_path / "b.txt").stat().st_mode & 0o7777
    assert file_entry["mtime"] == pytest.approx((tmp_path / "b.txt").stat().st_mtime)
    assert agent.result(protocol.OP_FILES_STAT, {"path": str(tmp_path / "c_link")})["type"] == "symlink"
    assert agent.result(protocol.OP_FILES_STAT, {"path": "/dev/null"})["type"] == "other"


def test_files_remove(agent: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full" / "sub").mkdir(parents=True)
    for name in ("f", "empty"):
        assert agent.result(protocol.OP_FILES_REMOVE, {"path": str(tmp_path / name)}) == {}
    error = agent.error(protocol.OP_FILES_REMOVE, {"path": str(tmp_path / "full")})
    assert error["code"] == protocol.ERR_OS and error["errno"] == "ENOTEMPTY"
    agent.result(protocol.OP_FILES_REMOVE, {"path": str(tmp_path / "full"), "recursive": True})
    assert list(tmp_path.iterdir()) == []
    assert agent.error(protocol.OP_FILES_REMOVE, {"path": str(tmp_path / "f")})["code"] == protocol.ERR_NOT_FOUND


def test_files_mkdir_and_rename(agent: AgentClient, tmp_path: Path) -> None:
    nested = tmp_path / "x" / "y"
    agent.result(protocol.OP_FILES_MKDIR, {"path": str(nested)})
    agent.result(protocol.OP_FILES_MKDIR, {"path": str(nested)})  # exist_ok by default
    error = agent.error(protocol.OP_FILES_MKDIR, {"path": str(nested), "exist_ok": False})
    assert error["code"] == protocol.ERR_OS and error["errno"] == "EEXIST"
    error = agent.error(protocol.OP_FILES_MKDIR, {"path": str(tmp_path / "p" / "q"), "parents": False})
    assert error["code"] == protocol.ERR_NOT_FOUND
    agent.result(protocol.OP_FILES_RENAME, {"src": str(tmp_path / "x"), "dst": str(tmp_path / "z")})
    assert (tmp_path / "z" / "y").is_dir() and not (tmp_path / "x").exists()


def test_files_os_errors(agent: AgentClient, tmp_path: Path) -> None:
    error = agent.error(protocol.OP_FILES_READ, {"path": str(tmp_path / "missing")})
    assert error["code"] == protocol.ERR_NOT_FOUND and error["errno"] == "ENOENT"
    error = agent.error(protocol.OP_FILES_READ, {"path": str(tmp_path)})
    assert error["code"] == protocol.ERR_OS and error["errno"] == "EISDIR"
    error = agent.error(protocol.OP_FILES_LIST, {"path": "/etc/hostname"})
    assert error["code"] == protocol.ERR_OS and error["errno"] == "ENOTDIR"


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (protocol.OP_FILES_READ, {"path": 5}),
        (protocol.OP_FILES_READ, {"path": ""}),
        (protocol.OP_FILES_READ, {"path": "/etc/\u0000passwd"}),
        (protocol.OP_FILES_READ, {"path": "/etc/hostname", "offset": -1}),
        (protocol.OP_FILES_READ, {"path": "/etc/hostname", "length": "all"}),
        (protocol.OP_FILES_READ, {"path": "/etc/hostname", "offset": 2**70}),
        (protocol.OP_FILES_WRITE, {"path": "/tmp/x"}),
        (protocol.OP_FILES_WRITE, {"path": "/tmp/x", "data_b64": "*not*"}),
        (protocol.OP_FILES_WRITE, {"path": "/tmp/x", "data_b64": "", "append": True, "offset": 3}),
        (protocol.OP_FILES_WRITE, {"path": "/tmp/x", "data_b64": "", "mode": "0644"}),
        (protocol.OP_FILES_REMOVE, {"path": "/tmp/x", "recursive": "yes"}),
        (protocol.OP_FILES_RENAME, {"src": "/tmp/x"}),
    ],
)
def test_files_bad_arguments(agent: AgentClient, op: str, args: dict[str, Any]) -> None:
    assert agent.error(op, args)["code"] == protocol.ERR_BAD_REQUEST


# --------------------------------------------------------------------------------------------
# Transports and packaging
# --------------------------------------------------------------------------------------------


def test_unix_transport_ends_with_the_connection_and_kills_commands() -> None:
    process = AgentProcess()
    _, pid = start_process(process.client, {"argv": ["sleep", "30"]})
    assert process.stop() == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    pytest.fail(f"exec'd process {pid} outlived the agent")


def test_stdio_transport_in_the_guest_layout(tmp_path: Path) -> None:
    """As in the image: package ``forkd_guest``, stdlib only (-S: no site-packages)."""
    (tmp_path / "forkd_guest").symlink_to(GUEST_PACKAGE)
    requests = [
        protocol.request(1, protocol.OP_PING),
        protocol.request(2, protocol.OP_RUN_CODE, {"code": "import os; os.write(1, b'stray\\n'); print('ok')"}),
        protocol.request(3, protocol.OP_EXEC, {"shell": "echo from-sh"}),
    ]
    with subprocess.Popen(
        [sys.executable, "-S", "-m", "forkd_guest.agent", "--transport", "stdio"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    ) as proc:
        assert proc.stdin and proc.stdout and proc.stderr
        proc.stdin.write(b"".join(map(protocol.encode_frame, requests)))
        proc.stdin.flush()
        terminals = {}
        while len(terminals) < len(requests):
            frame = protocol.decode_frame(proc.stdout.readline())
            if protocol.is_terminal(frame):
                terminals[frame["id"]] = frame
        assert all(f["ok"] for f in terminals.values()), terminals
        proc.stdin.close()  # EOF on stdin ends the agent
        assert proc.wait(timeout=10) == 0
        stderr = proc.stderr.read()
    assert b"stray" in stderr  # fd 1 of the agent no longer reaches the protocol stream


def test_guest_modules_import_without_site_packages(tmp_path: Path) -> None:
    (tmp_path / "forkd_guest").symlink_to(GUEST_PACKAGE)
    subprocess.run(
        [sys.executable, "-S", "-c", "import forkd_guest.agent, forkd_guest.init, forkd_guest.template"], cwd=tmp_path, check=True, timeout=20
    )


def test_find_virtio_port(tmp_path: Path) -> None:
    for port, name in (("vport0p1", "org.qemu.guest_agent.0"), ("vport0p2", protocol.AGENT_PORT_NAME + "\n")):
        (tmp_path / port).mkdir()
        (tmp_path / port / "name").write_text(name)
    (tmp_path / "vport0p3").mkdir()  # a port without a name file is skipped
    assert channel.find_virtio_port(ports_dir=str(tmp_path)) == "/dev/vport0p2"
    with pytest.raises(FileNotFoundError):
        channel.find_virtio_port("org.other", ports_dir=str(tmp_path))


# --------------------------------------------------------------------------------------------
# Interpreter crashes and contexts (each context is a fork of the warm template)
# --------------------------------------------------------------------------------------------

CRASHES = [
    ("import ctypes; ctypes.string_at(0)", signal.SIGSEGV),
    ("import os; os.abort()", signal.SIGABRT),
    ("import os; os.kill(os.getpid(), 4)", signal.SIGILL),
]


@pytest.mark.parametrize(("code", "sig"), CRASHES, ids=[s.name for _, s in CRASHES])
def test_a_crashing_cell_answers_with_the_signal(agent: AgentClient, code: str, sig: signal.Signals) -> None:
    context = f"crash-{sig.name}"
    run_code(agent, "before = 1", context=context)
    # A generous timeout and a bounded wait far below it: the answer comes from the crash.
    req_id = agent.start(protocol.OP_RUN_CODE, {"code": code, "context": context, "timeout_s": 600})
    terminal = agent.collect(req_id, timeout=30)[-1][1]
    assert terminal["ok"], terminal
    error = terminal["result"]["error"]
    assert error["name"] == protocol.INTERPRETER_CRASHED
    assert (error["signal"], error["signal_name"], error["context"]) == (int(sig), sig.name, "restored")
    assert sig.name in error["value"]
    assert "Fatal Python error" in error["traceback"] and "<cell-" in error["traceback"]  # where it crashed
    # The next cell in the context works, in a fresh process without the old variables.
    assert run_code(agent, "before", context=context)[1]["error"]["name"] == "NameError"
    assert run_code(agent, "1 + 1", context=context)[1]["value"] == "2"


def test_a_crashing_eval_answers_too(agent: AgentClient) -> None:
    result = agent.result(protocol.OP_EVAL, {"expr": "__import__('os').abort()", "context": "crash-eval"})
    assert result["error"]["name"] == protocol.INTERPRETER_CRASHED and result["type"] is None
    assert agent.result(protocol.OP_EVAL, {"expr": "2 * 21", "context": "crash-eval"})["value"] == "42"


def test_three_contexts_are_independent_processes(agent: AgentClient) -> None:
    names = [f"indep-{i}" for i in range(3)]
    for i, name in enumerate(names):
        run_code(agent, f"import os, random\nmine = {i}", context=name)
    seen = [agent.result(protocol.OP_EVAL, {"expr": "[mine, os.getpid(), random.random()]", "context": name})
            ["value_json"] for name in names]
    assert [s[0] for s in seen] == [0, 1, 2]
    assert len({s[1] for s in seen}) == 3  # three processes
    assert len({s[2] for s in seen}) == 3  # each forked with its own random state
    run_code(agent, "import os; os.abort()", context=names[0])
    assert agent.result(protocol.OP_EVAL, {"expr": "mine", "context": names[1]})["value"] == "1"


def test_contexts_create_list_restart_delete(agent: AgentClient, tmp_path: Path) -> None:
    created = agent.result(protocol.OP_CONTEXTS_CREATE, {"cwd": str(tmp_path)})
    assert created["language"] == "python" and created["cwd"] == str(tmp_path) and len(created["id"]) == 32
    ctx = created["id"]
    assert run_code(agent, "import os; here = os.getcwd(); here", context=ctx)[1]["value_json"] == str(tmp_path)
    listed = agent.result(protocol.OP_CONTEXTS_LIST)["contexts"]
    assert ctx in [c["id"] for c in listed]
    named = agent.result(protocol.OP_CONTEXTS_CREATE, {"id": "named", "language": "python"})
    assert named["id"] == "named"
    assert agent.error(protocol.OP_CONTEXTS_CREATE, {"id": "named"})["code"] == protocol.ERR_BAD_REQUEST
    assert agent.error(protocol.OP_CONTEXTS_CREATE, {"language": "r"})["code"] == protocol.ERR_BAD_REQUEST
    restarted = agent.result(protocol.OP_CONTEXTS_RESTART, {"id": ctx})
    assert restarted["id"] == ctx and restarted["pid"] != created["pid"]
    assert run_code(agent, "here", context=ctx)[1]["error"]["name"] == "NameError"
    agent.result(protocol.OP_CONTEXTS_DELETE, {"id": ctx})
    assert ctx not in [c["id"] for c in agent.result(protocol.OP_CONTEXTS_LIST)["contexts"]]
    for op in (protocol.OP_CONTEXTS_RESTART, protocol.OP_CONTEXTS_DELETE):
        assert agent.error(op, {"id": ctx})["code"] == protocol.ERR_NOT_FOUND


# --------------------------------------------------------------------------------------------
# Warm commands: forks of the template that behave like a fresh python3
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_agent() -> Iterator[AgentClient]:
    """An agent whose template imported pytest (and json), as a snapshot's warm-up would."""
    process = AgentProcess()
    process.client.result(protocol.OP_WARM, {"modules": ["json", "pytest"]})
    yield process.client
    process.stop()


def fresh_and_warm(agent: AgentClient, args: dict[str, Any]) -> list[tuple[bytes, bytes, int, int | None]]:
    outcomes = []
    for warm in (False, True):
        stdout, stderr, result, events = run_exec(agent, {**args, "warm": warm})
        assert events[0]["event"] == protocol.EVENT_STARTED
        outcomes.append((stdout, stderr, result["exit_code"], result["signal"]))
    return outcomes


WARM_LIKE_FRESH = {
    "stdin-and-exit-code": ("import sys\nprint(sys.stdin.read().upper())\nsys.exit(3)", "hello"),
    "argv": ("import sys; print(sys.argv)", None),
    "signal-death": ("import os, signal; print('x', flush=True); os.kill(os.getpid(), signal.SIGTERM)", None),
    "system-exit-message": ("raise SystemExit('bye')", None),
    "keyboard-interrupt": ("raise KeyboardInterrupt", None),
    "atexit-and-buffering": ("import atexit, sys\natexit.register(print, 'at exit')\nsys.stdout.write('main ')", None),
    "signal-dispositions": ("import signal as s\nprint([s.getsignal(n) for n in (s.SIGINT, s.SIGPIPE, s.SIGCHLD, s.SIGTERM)])", None),
    "fresh-main": ("import __main__\nprint(sorted(k for k in vars(__main__) if not k.startswith('__')))", None),
    "non-daemon-thread": ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print('joined'))).start()", None),
}


@pytest.mark.parametrize("name", sorted(WARM_LIKE_FRESH))
def test_warm_python_c_behaves_like_a_fresh_one(warm_agent: AgentClient, name: str) -> None:
    code, stdin = WARM_LIKE_FRESH[name]
    args: dict[str, Any] = {"argv": [sys.executable, "-c", code, "a", "b"]}
    if stdin is not None:
        args["stdin_b64"] = b64(stdin)
    fresh, warm = fresh_and_warm(warm_agent, args)
    assert warm == fresh


def test_warm_python_m_and_a_script_behave_like_fresh_ones(warm_agent: AgentClient, tmp_path: Path) -> None:
    stdin = b64('{"b": 1, "a": [2]}')
    fresh, warm = fresh_and_warm(warm_agent, {"argv": [sys.executable, "-m", "json.tool", "--sort-keys"],
                                             "stdin_b64": stdin})
    assert warm == fresh and fresh[2] == 0
    script = tmp_path / "script.py"
    script.write_text("import sys, os\nprint(sys.argv, __file__, sys.path[0] == os.path.dirname(__file__))\n")
    fresh, warm = fresh_and_warm(warm_agent, {"argv": [sys.executable, str(script), "x"], "cwd": str(tmp_path)})
    assert warm == fresh and b"True" in fresh[0]
    fresh, warm = fresh_and_warm(warm_agent, {"argv": [sys.executable, "-m", "no_such_module_xyz"]})
    assert (warm[2], fresh[2]) == (1, 1) and b"No module named no_such_module_xyz" in warm[1]


def test_warm_command_is_a_fork_of_the_template(warm_agent: AgentClient) -> None:
    code = "import sys; print('pytest' in sys.modules)"
    fresh, warm = fresh_and_warm(warm_agent, {"argv": [sys.executable, "-c", code]})
    assert (fresh[0], warm[0]) == (b"False\n", b"True\n")  # the documented difference


PYTEST_PROJECT = {
    "conftest.py": "import pytest\n\n@pytest.fixture\ndef answer():\n    return 42\n",
    "test_ok.py": "import pytest\n\ndef test_fixture(answer):\n    assert answer == 42\n\n"
                  "@pytest.mark.parametrize('n', [1, 2, 3])\ndef test_param(n):\n    assert n > 0\n",
    "test_fail.py": "def test_fails():\n    print('captured output')\n    assert 1 + 1 == 3\n",
}


def test_warm_pytest_behaves_like_fresh_pytest(warm_agent: AgentClient, tmp_path: Path) -> None:
    for name, text in PYTEST_PROJECT.items():
        (tmp_path / name).write_text(text)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]
    fresh, warm = fresh_and_warm(warm_agent, {"argv": argv, "cwd": str(tmp_path), "timeout_s": 120})
    assert fresh[2] == warm[2] == 1  # tests failed
    for outcome in (fresh, warm):
        out = outcome[0].decode()
        assert "1 failed, 4 passed" in out and "assert (1 + 1) == 3" in out and "captured output" in out
    strip_time = [line.split(" in ")[0] for line in fresh[0].decode().splitlines()]
    assert strip_time == [line.split(" in ")[0] for line in warm[0].decode().splitlines()]
    only_ok = fresh_and_warm(warm_agent, {"argv": [*argv, "test_ok.py"], "cwd": str(tmp_path)})
    assert [o[2] for o in only_ok] == [0, 0]


def test_warm_command_stdin_signals_and_kill(warm_agent: AgentClient) -> None:
    req_id, pid = start_process(warm_agent, {"argv": [sys.executable, "-c", "import sys\nfor line in sys.stdin:\n"
                                                      "    print(line.strip()[::-1], flush=True)"], "warm": True})
    warm_agent.result(protocol.OP_PROC_STDIN, {"pid": pid, "data_b64": b64("abc\n")})
    _, frame = warm_agent.next_frame(req_id)
    assert unb64(frame["data"]["data_b64"]) == b"cba\n"
    assert any(p["pid"] == pid and p.get("warm") for p in warm_agent.result(protocol.OP_PROC_LIST)["processes"])
    warm_agent.result(protocol.OP_PROC_KILL, {"pid": pid, "signal": signal.SIGTERM})
    result = warm_agent.collect(req_id)[-1][1]["result"]
    assert (result["exit_code"], result["signal"]) == (128 + signal.SIGTERM, signal.SIGTERM)


@pytest.mark.parametrize(
    "args",
    [
        {"shell": "python3 -c 1"},
        {"argv": ["bash", "-c", "true"]},
        {"argv": ["python3", "-O", "-c", "1"]},
        {"argv": ["python3", "-c"]},
    ],
)
def test_warm_command_refuses_what_a_fork_cannot_honour(warm_agent: AgentClient, args: dict[str, Any]) -> None:
    error = warm_agent.error(protocol.OP_EXEC, {**args, "warm": True})
    assert error["code"] == protocol.ERR_BAD_REQUEST


def test_warm_command_missing_cwd(warm_agent: AgentClient, tmp_path: Path) -> None:
    args = {"argv": ["python3", "-c", "1"], "warm": True, "cwd": str(tmp_path / "nope")}
    assert warm_agent.error(protocol.OP_EXEC, args)["code"] == protocol.ERR_NOT_FOUND


def test_files_read_refuses_endless_files(agent: AgentClient, tmp_path: Path) -> None:
    """A symlink to /dev/zero (or a FIFO) must not turn into an endless download."""
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    for name in ("zero", "fifo"):
        error = agent.error(protocol.OP_FILES_READ, {"path": str(tmp_path / name)})
        assert error["code"] == protocol.ERR_BAD_REQUEST and "not a regular file" in error["message"]
    link = agent.result(protocol.OP_FILES_STAT, {"path": str(tmp_path / "zero")})
    target = agent.result(protocol.OP_FILES_STAT, {"path": str(tmp_path / "zero"), "follow": True})
    assert (link["type"], target["type"]) == ("symlink", "other")  # what files.read would open


@pytest.mark.parametrize("line", [b"[" * 100_000, b'{"id": 5, "op": "ping", "args": ' + b"[" * 100_000])
def test_deeply_nested_frames_are_answered(agent: AgentClient, line: bytes) -> None:
    agent.send_raw(line + b"\n")
    _, frame = agent.next_frame(None)
    assert frame["error"]["code"] == protocol.ERR_BAD_REQUEST
    assert agent.result(protocol.OP_PING)["protocol"] == protocol.PROTOCOL_VERSION


# --------------------------------------------------------------------------------------------
# Output budgets, flow control and cancel
# --------------------------------------------------------------------------------------------


def test_exec_output_limit_truncates(agent: AgentClient) -> None:
    stdout, stderr, result, _ = run_exec(agent, {"shell": "head -c 300000 /dev/zero; echo done >&2",
                                                 "output_limit": 1000})
    assert len(stdout) + len(stderr) == 1000 and result["truncated"] is True and result["exit_code"] == 0
    _, _, result, _ = run_exec(agent, {"shell": "echo small", "output_limit": 1000})
    assert result["truncated"] is False


def test_exec_flow_pause_stops_reading_and_resume_continues(agent: AgentClient, tmp_path: Path) -> None:
    marker = tmp_path / "writer-done"
    code = f"yes | head -c 2000000; touch {marker}"  # 2 MB: far more than a pipe holds
    req_id = agent.start(protocol.OP_EXEC, {"shell": code})
    agent.result(protocol.OP_FLOW_PAUSE, {"id": req_id})
    time.sleep(1.0)
    assert not marker.exists()  # blocked on a full pipe: real back-pressure
    agent.result(protocol.OP_FLOW_RESUME, {"id": req_id})
    frames = agent.collect(req_id, timeout=30)
    got = sum(len(unb64(f["data"]["data_b64"])) for _, f in frames if f.get("event") == "stdout")
    assert got == 2_000_000 and frames[-1][1]["result"]["exit_code"] == 0 and marker.exists()


def test_cancel_ends_a_command_and_a_cell(agent: AgentClient) -> None:
    req_id, _ = start_process(agent, {"argv": ["sleep", "600"]})
    agent.result(protocol.OP_CANCEL, {"id": req_id})
    result = agent.collect(req_id, timeout=30)[-1][1]["result"]
    assert result["cancelled"] is True and result["signal"] == signal.SIGINT  # gently first
    req_id, _ = start_process(agent, {"argv": ["python3", "-c", "import signal, sys, time\n"
                                       "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                       "time.sleep(600)"]})
    assert agent.next_frame(req_id, timeout=30)[1]["event"] == "stdout"  # its SIGINT handler is in place
    agent.result(protocol.OP_CANCEL, {"id": req_id})
    result = agent.collect(req_id, timeout=30)[-1][1]["result"]
    assert result["cancelled"] is True and result["signal"] == signal.SIGKILL  # it ignored SIGINT: killed
    run_code(agent, "kept = 7", context="cancel")
    req_id = agent.start(protocol.OP_RUN_CODE, {"code": "print('go', flush=True)\nimport time; time.sleep(600)",
                                                "context": "cancel"})
    assert agent.next_frame(req_id, timeout=30)[1]["event"] == "stdout"
    agent.result(protocol.OP_CANCEL, {"id": req_id})
    result = agent.collect(req_id, timeout=30)[-1][1]["result"]
    assert result["error"]["name"] == "KeyboardInterrupt"
    assert run_code(agent, "kept", context="cancel")[1]["value"] == "7"


def test_flow_ops_need_a_running_request(agent: AgentClient) -> None:
    for op in (protocol.OP_FLOW_PAUSE, protocol.OP_FLOW_RESUME, protocol.OP_CANCEL):
        assert agent.error(op, {"id": 987654})["code"] == protocol.ERR_NOT_FOUND


def test_run_code_output_limit(agent: AgentClient) -> None:
    events, result = run_code(agent, "for i in range(1000):\n    print('x' * 99)", context="limited",
                              output_limit=500)
    assert len(text_of(events, "stdout")) == 500 and result["truncated"] is True


# --------------------------------------------------------------------------------------------
# Rich results
# --------------------------------------------------------------------------------------------

RICH = '''
class Rich:
    def _repr_html_(self):
        return "<b>rich</b>"
    def _repr_markdown_(self):
        return "**rich**"
    def _repr_json_(self):
        return {"rich": True}
    def _repr_png_(self):
        return b"\\x89PNG fake"
    def _repr_latex_(self):
        raise RuntimeError("no latex today")
    def __repr__(self):
        return "Rich()"
display(Rich())
print("between")
Rich()
'''


def test_rich_results_from_display_and_the_last_value(agent: AgentClient) -> None:
    events, result = run_code(agent, RICH, context="rich")
    shown, main = result["results"]
    assert shown == {"html": "<b>rich</b>", "markdown": "**rich**", "json": {"rich": True},
                     "png": b64(b"\x89PNG fake"), "text": "Rich()", "is_main_result": False}
    assert main == {**shown, "is_main_result": True}
    assert result["value"] == "Rich()"
    kinds = [e["event"] for e in events]
    assert kinds == [protocol.EVENT_RESULT, protocol.EVENT_STDOUT, protocol.EVENT_RESULT]


def test_plt_show_in_the_cell_that_imports_pyplot_shows_each_figure(agent: AgentClient) -> None:
    pytest.importorskip("matplotlib")
    code = ("import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()\n"
            "plt.bar(['a', 'b'], [1, 2])\nplt.show()")
    _, result = run_code(agent, code, context="first-import")
    assert [r["chart"]["type"] for r in result["results"]] == ["line", "bar"]


def test_matplotlib_figures_come_back_as_png(agent: AgentClient) -> None:
    pytest.importorskip("matplotlib")
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nfig = plt.figure()\nfig"
    _, result = run_code(agent, code, context="plots")
    pngs = [r for r in result["results"] if "png" in r]
    assert len(pngs) == 2 and all(unb64(r["png"]).startswith(b"\x89PNG") for r in pngs)
    assert pngs[-1]["is_main_result"] is True
    assert pngs[0]["chart"]["type"] == "line" and pngs[0]["chart"]["elements"][0]["points"][2] == [2.0, 3.0]
    assert "chart" not in pngs[1]  # a figure without Axes holds no data


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (whoever inherited it may not reap at once)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_template_whose_agent_died_before_it_started_exits_at_once() -> None:
    """The race die_with closes: the agent was gone before the template could ask to die with it."""
    ours, theirs = socket.socketpair()
    with ours:
        try:
            template = subprocess.Popen([sys.executable, "-m", "forkd.guest.template", str(theirs.fileno()),
                                         str(os.getpid() + 1_000_000)], pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        try:
            assert template.wait(timeout=FRAME_TIMEOUT_S) == 0  # it never served, though its socket is open
        finally:
            if template.poll() is None:
                template.kill()
                template.wait()


def test_the_template_and_its_contexts_die_with_the_agent() -> None:
    """Even busy ones: a warm-up that never returns, a cell that never ends."""
    process = AgentProcess()
    pids: list[int] = []
    try:
        client = process.client
        context_pid = client.result(protocol.OP_CONTEXTS_CREATE, {"id": "busy"})["pid"]
        pids = [client.result(protocol.OP_PING)["template_pid"], context_pid]
        forever = "import time\nprint('busy', flush=True)\nwhile True: time.sleep(1)"
        cell = client.start(protocol.OP_RUN_CODE, {"code": forever, "context": "busy"})
        warm = client.start(protocol.OP_WARM, {"modules": [], "code": forever})
        for req_id in (cell, warm):  # both processes are inside their endless code
            while client.next_frame(req_id)[1].get("event") != protocol.EVENT_STDOUT:
                pass
        process.proc.kill()
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not _gone(pid)] == [], "outlived their agent"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.stop()


def test_a_dead_template_is_replaced_with_its_warm_up_replayed() -> None:
    process = AgentProcess()
    try:
        client = process.client
        client.result(protocol.OP_WARM, {"modules": ["decimal"], "code": "WARMED = 1"})
        run_code(client, "kept = 5", context="survivor")
        old = client.result(protocol.OP_PING)["template_pid"]
        os.kill(old, signal.SIGKILL)
        # A context forked before keeps running; a new one comes from a new template, warm again.
        assert run_code(client, "kept", context="survivor")[1]["value"] == "5"
        deadline = time.monotonic() + 30
        while True:  # the first request after the death may still meet the old template's socket
            _, terminal = client.call(protocol.OP_EVAL, {"expr": "[WARMED, decimal.Decimal(2)]", "context": "new"})
            if terminal["ok"] and terminal["result"]["error"] is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert terminal["result"]["value"] == "[1, Decimal('2')]", terminal
        assert client.result(protocol.OP_PING)["template_pid"] not in (None, old)
    finally:
        process.stop()
def test_watch_reports_creates_writes_renames_and_removes_recursively(agent: AgentClient, tmp_path: Path) -> None:
    watcher = agent.result(protocol.OP_WATCH_CREATE, {"path": str(tmp_path), "recursive": True})["id"]
    try:
        (tmp_path / "sub").mkdir()
        (tmp_path / "a.txt").write_text("x")
        (tmp_path / "a.txt").rename(tmp_path / "b.txt")
        (tmp_path / "b.txt").unlink()
        seen = agent.result(protocol.OP_WATCH_READ, {"id": watcher, "wait_s": 2})["events"]
        (tmp_path / "sub" / "deep.txt").write_text("y")  # a directory created after the watch began
        seen += agent.result(protocol.OP_WATCH_READ, {"id": watcher, "wait_s": 2})["events"]
        kinds = {(event["name"], event["type"]) for event in seen}
        assert {("sub", "create"), ("a.txt", "create"), ("a.txt", "write"), ("a.txt", "rename"),
                ("b.txt", "create"), ("b.txt", "remove"), ("sub/deep.txt", "create")} <= kinds, seen
        assert agent.result(protocol.OP_WATCH_READ, {"id": watcher})["events"] == []
    finally:
        assert agent.result(protocol.OP_WATCH_REMOVE, {"id": watcher}) == {}
    assert agent.error(protocol.OP_WATCH_READ, {"id": watcher})["code"] == protocol.ERR_NOT_FOUND
    assert agent.error(protocol.OP_WATCH_CREATE, {"path": str(tmp_path / "absent")})["code"] == protocol.ERR_NOT_FOUND


def test_pty_session_has_a_terminal_takes_input_and_resizes(agent: AgentClient) -> None:
    script = "stty size; read line; echo got:$line; stty size"
    req = agent.start(protocol.OP_PTY_START, {"argv": ["/bin/sh", "-c", script], "rows": 30, "cols": 100})
    _, started = agent.next_frame(req)
    pid = started["data"]["pid"]
    output = b""
    while b"30 100" not in output:
        output += unb64(agent.next_frame(req)[1]["data"]["data_b64"])
    assert agent.result(protocol.OP_PTY_RESIZE, {"pid": pid, "rows": 12, "cols": 40}) == {}
    assert agent.result(protocol.OP_PTY_INPUT, {"pid": pid, "data_b64": b64("hello\n")}) == {}
    frames = [frame for _, frame in agent.collect(req)]
    output += b"".join(unb64(f["data"]["data_b64"]) for f in frames[:-1])
    assert frames[-1]["result"] == {"exit_code": 0, "signal": None}
    assert b"got:hello" in output and b"12 40" in output, output
    assert agent.error(protocol.OP_PTY_INPUT, {"pid": pid, "data_b64": b64("x")})["code"] == protocol.ERR_NOT_FOUND


def test_pty_session_is_killed_by_signal(agent: AgentClient) -> None:
    req = agent.start(protocol.OP_PTY_START, {"argv": ["sleep", "600"]})
    pid = agent.next_frame(req)[1]["data"]["pid"]
    assert agent.result(protocol.OP_PTY_KILL, {"pid": pid, "signal": 15}) == {}
    assert agent.collect(req)[-1][1]["result"] == {"exit_code": 143, "signal": 15}


def test_generators_made_by_warm_code_are_reseeded(unprivileged_agent: AgentClient) -> None:
    """A restore copies every generator the warm code made into each sibling: after a reseed their
    draws must depend on the reseed's entropy only, not on the state they were saved with."""
    code = ("import random, numpy\nrng = random.Random()\ngen = numpy.random.default_rng()\n"
            "legacy = numpy.random.RandomState()\nbits = numpy.random.PCG64()\nsystem = random.SystemRandom()")
    warmed = unprivileged_agent.result(protocol.OP_WARM, {"modules": ["numpy"], "code": code})
    assert warmed["warm_generators"] >= 4
    expr = "[rng.random(), float(gen.random()), float(legacy.standard_normal()), int(bits.random_raw())]"
    unprivileged_agent.result(protocol.OP_EVAL, {"expr": expr})  # the default context exists before the reseeds
    entropy = os.urandom(32)
    assert reseed(unprivileged_agent, entropy)["contexts_reseeded"] == 1
    first = unprivileged_agent.result(protocol.OP_EVAL, {"expr": expr})["value_json"]
    reseed(unprivileged_agent, entropy)
    assert unprivileged_agent.result(protocol.OP_EVAL, {"expr": expr})["value_json"] == first
    reseed(unprivileged_agent, os.urandom(32))
    other = unprivileged_agent.result(protocol.OP_EVAL, {"expr": expr})["value_json"]
    assert all(a != b for a, b in zip(first, other)), (first, other)
    # A context forked from the template later reseeds itself from the kernel as it starts.
    unprivileged_agent.result(protocol.OP_CONTEXTS_CREATE, {"id": "later"})
    later = unprivileged_agent.result(protocol.OP_EVAL, {"expr": expr, "context": "later"})["value_json"]
    assert all(a != b for a, b in zip(first, later)), (first, later)


def test_activity_counts_user_processes_but_not_the_agents_own_kernel_threads_or_zombies(tmp_path: Path) -> None:
    """What keeps a guest from being stopped for being idle: every process with a command line but the agent's."""
    for pid, cmdline in ((1, b"python3\0-m\0forkd_guest.init"), (7, b""), (40, b"python3\0-m\0forkd_guest.agent"),
                         (41, b"python3\0template"), (99, b"sleep\0300"), (120, b"python3\0-m\0http.server")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
    (tmp_path / "self").mkdir()
    assert activity.user_processes({1, 40, 41}, str(tmp_path)) == [99, 120]


def test_clock_set_checks_its_argument(agent: AgentClient) -> None:
    _, terminal = agent.call(protocol.OP_CLOCK_SET, {"time_ns": -1})
    assert terminal["error"]["code"] == protocol.ERR_BAD_REQUEST


def test_pty_flow_pause_stops_reading_and_cancel_hangs_up_then_kills(agent: AgentClient, tmp_path: Path) -> None:
    """pty.start ignored flow.pause (its terminal was read however fast it wrote) and cancel (it ran on)."""
    marker = tmp_path / "writer-done"
    req = agent.start(protocol.OP_PTY_START, {"argv": ["/bin/sh", "-c", f"yes | head -c 2000000; touch {marker}; "
                                                                        "sleep 600"]})
    agent.result(protocol.OP_FLOW_PAUSE, {"id": req})
    time.sleep(1.0)
    assert not marker.exists()  # blocked on a full terminal: real back-pressure
    agent.result(protocol.OP_FLOW_RESUME, {"id": req})
    while not marker.exists():  # the output flows again until the writer is done
        with contextlib.suppress(queue.Empty):
            agent.next_frame(req, timeout=0.5)
    agent.result(protocol.OP_CANCEL, {"id": req})
    assert agent.collect(req, timeout=30)[-1][1]["result"]["signal"] == signal.SIGHUP  # hung up

    stubborn = agent.start(protocol.OP_PTY_START, {"argv": ["/bin/sh", "-c", "trap '' HUP; echo ready; sleep 600"]})
    agent.next_frame(stubborn)  # started
    assert b"ready" in unb64(agent.next_frame(stubborn)[1]["data"]["data_b64"])
    agent.result(protocol.OP_CANCEL, {"id": stubborn})
    assert agent.collect(stubborn, timeout=30)[-1][1]["result"]["signal"] == signal.SIGKILL  # then killed
