"""Every REST operation written once, for the sync ``Controller`` and the async ``AsyncController``.

Each method turns its arguments into a ``Call`` (method, path, query, body, timeout, which field of the
answer to return) and hands it to the client's ``_send``/``_stream``/``_open_stream``: the sync client
answers with the value, the async one with an awaitable of it. So paths, bodies and answer parsing live
here and nowhere else; the clients only move bytes. NDJSON line decoding and error answers are here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from forkd.errors import KINDS, kind_of
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import DaemonUnreachable, ForkdError, error_for
from forkd.sdk.progress import progress
from forkd.sdk.sandbox.flavour import Flavour, Steps, operation

LONG_TIMEOUT_S = 3600.0
FORK_OPTIONS = ("timeout_s", "envs", "metadata", "net", "egress", "memory_limit_mib", "cpu_quota", "cpu_weight",
                "pids_max", "deadline_s", "snapshot_digest", "idempotency_key", "owner")


@dataclass(frozen=True)
class Call:
    """One request and how to read its answer (``key``: the answer's field to return; ``void``: return None)."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: Any = None
    timeout: float | None = None  # None: the connection's request timeout
    key: str | None = None
    void: bool = False

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``httpx.Client.request``/``stream`` (and the async ones)."""
        found = {"params": self.params, "json": self.json, "content": self.content, "timeout": self.timeout}
        return {name: value for name, value in found.items() if value is not None}

    def streamed(self) -> Call:
        """The same request asking for NDJSON (``"stream": true``), with a long timeout."""
        return Call(self.method, self.path, self.params, {**(self.json or {}), "stream": True}, self.content,
                    LONG_TIMEOUT_S, self.key, self.void)

    def parse(self, answer: Any) -> Any:
        if self.void:
            return None
        return answer if self.key is None else answer[self.key]


def raise_for(response: httpx.Response) -> None:
    """Raise the SDK exception for an error answer (its body must have been read)."""
    if response.is_success:
        return
    try:
        err = response.json().get("error", {})
        code, message = err.get("code", "error"), err.get("message", response.text)
    except (ValueError, AttributeError):
        err, code, message = {}, "error", response.text
    raise error_for(response.status_code, code, message, _details(err))


def _details(err: dict[str, Any]) -> dict[str, Any]:
    """An error body's fields beyond code and message (the guest's ``errno``, a retry hint)."""
    return {key: value for key, value in err.items() if key not in ("code", "message")}


def decode_line(text: str) -> tuple[str, Any]:
    """One NDJSON line: ``("event", line)``, ``("result", value)`` or ``("skip", None)``; raises an error line."""
    if not text.strip():
        return "skip", None
    line = json.loads(text)
    if "error" in line:
        err = line["error"]
        code = str(err.get("code", "error"))
        raise error_for(kind_of(code).status, code, err.get("message", ""), _details(err))
    if "result" in line:
        return "result", line["result"]
    return "event", line


class StreamState:
    """What an NDJSON answer has said so far: ``result`` once its last line came (then ``done``)."""

    def __init__(self) -> None:
        self.result: Any = None
        self.done = False

    def take(self, text: str) -> dict[str, Any] | None:
        """The event on this line; None for a blank line or the result line."""
        kind, value = decode_line(text)
        if kind == "result":
            self.done, self.result = True, value
        return value if kind == "event" else None


def truncated() -> ForkdError:
    return ForkdError(500, "truncated", f"the daemon closed the stream without a result; "
                                        f"{KINDS['truncated'].next_step}")


def fork_call(tag: str | None, n: int, options: dict[str, Any]) -> Call:
    unknown = set(options) - {*FORK_OPTIONS, "self", "tag", "n"}
    if unknown:
        raise TypeError(f"unknown fork options: {', '.join(sorted(unknown))}")
    body = {"n": n, **{k: options[k] for k in FORK_OPTIONS if options.get(k) is not None}}
    if tag is not None:
        body["snapshot_tag"] = tag
    return Call("POST", "/v1/sandboxes", json=body, timeout=LONG_TIMEOUT_S)


def exec_call(sandbox_id: str, cmd: str | list[str], env: dict[str, str] | None, cwd: str | None,
              stdin: str | None, timeout_s: float | None, user: str | None, warm: bool = False,
              pty: tuple[int, int] | None = None) -> Call:
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    body.update({"env": env or {}, "timeout_s": timeout_s})
    if warm:
        body["warm"] = True
    if pty is not None:
        body["pty"] = {"rows": pty[0], "cols": pty[1]}
    optional = {"cwd": cwd, "stdin": stdin, "user": user}
    body.update({key: value for key, value in optional.items() if value is not None})
    return Call("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, timeout=call_timeout(timeout_s))


def read_file_call(sandbox_id: str, path: str) -> Call:
    return Call("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path}, timeout=LONG_TIMEOUT_S)


def append_bounded(data: bytearray, chunk: bytes, max_bytes: int | None, path: str) -> None:
    """Add a downloaded chunk, refusing (413 ``too_large``) as soon as the file holds more than ``max_bytes``.

    A guest decides what a path holds (a symlink to /dev/zero never ends), so a caller that cannot hold
    any size passes ``max_bytes``; the download stops there.
    """
    data += chunk
    if max_bytes is not None and len(data) > max_bytes:
        raise ForkdError(413, "too_large", f"{path} holds more than {max_bytes} bytes; read it in "
                         "parts (e.g. exec 'head -c N') or raise the limit")


def call_timeout(timeout_s: float | None) -> float:
    return LONG_TIMEOUT_S if timeout_s is None else timeout_s + 60.0


@contextlib.contextmanager
def reaching(url: str) -> Iterator[None]:
    """A transport failure talking to the daemon at ``url`` raised as ``DaemonUnreachable``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise DaemonUnreachable(url, str(exc) or type(exc).__name__) from None


class Operations:
    """The REST API as methods; a subclass supplies the transport (sync: values, async: awaitables)
    and its flavour (``sandbox/flavour.py``), which runs the few operations written as steps."""

    _flavour: Flavour

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float | None = None, *,
                 connection: ConnectionConfig | None = None, http: Any = None) -> None:
        """Talk to ``connection`` (default: the environment's daemon, see ``ConnectionConfig.from_env``);
        ``url``/``token``/``timeout`` override it. ``http`` is a ready httpx client to send through instead."""
        self.connection = ConnectionConfig.resolve(connection, url, token)
        if timeout is not None:
            self.connection = dataclasses.replace(self.connection, request_timeout=timeout)
        self.url = self.connection.url
        self._http = http or self._new_client(self.connection)

    @staticmethod
    def _new_client(connection: ConnectionConfig) -> Any:
        raise NotImplementedError

    def _send(self, call: Call) -> Any:
        raise NotImplementedError

    def _stream(self, call: Call, on_line: Callable[[dict[str, Any]], Any] | None) -> Any:
        """Send ``call`` answered with NDJSON; pass every line to ``on_line``; answer the ``result``."""
        raise NotImplementedError

    def _open_stream(self, call: Call) -> Any:
        """Send ``call`` answered with NDJSON and answer the open stream of its events."""
        raise NotImplementedError

    def _send_or_stream(self, call: Call, on_event: Callable[[dict[str, Any]], Any] | None) -> Any:
        return self._send(call) if on_event is None else self._stream(call.streamed(), on_event)

    # daemon

    def health(self) -> Any:
        return self._send(Call("GET", "/healthz"))

    def version(self) -> Any:
        return self._send(Call("GET", "/v1/version"))

    def doctor(self) -> Any:
        """``[{"name", "status", "detail", "fix"}]``: the daemon host's checks."""
        return self._send(Call("GET", "/v1/doctor", key="checks"))

    # images

    def images(self) -> Any:
        return self._send(Call("GET", "/v1/images", key="images"))

    def build_image(self, on_progress: Callable[[str], Any] | None = None, **spec: Any) -> Any:
        return self._stream(Call("POST", "/v1/images", json=spec, timeout=LONG_TIMEOUT_S), progress(on_progress))

    def remove_image(self, name: str) -> Any:
        return self._send(Call("DELETE", f"/v1/images/{name}", void=True))

    # snapshots

    def snapshots(self) -> Any:
        return self._send(Call("GET", "/v1/snapshots", key="snapshots"))

    def snapshot(self, tag: str) -> Any:
        return self._send(Call("GET", f"/v1/snapshots/{tag}"))

    def create_snapshot(self, tag: str, on_progress: Callable[[str], Any] | None = None, **options: Any) -> Any:
        return self._stream(Call("POST", "/v1/snapshots", json={"tag": tag, **options}, timeout=LONG_TIMEOUT_S),
                            progress(on_progress))

    def remove_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> Any:
        """The tags removed (``cascade`` removes the snapshots branched from ``tag`` too)."""
        return self._send(Call("DELETE", f"/v1/snapshots/{tag}", params={"cascade": cascade, "force": force},
                               key="removed_tags"))

    def compact(self, from_tag: str, to_tag: str) -> Any:
        """Flatten ``from_tag``'s chain into the standalone snapshot ``to_tag``."""
        return self._send(Call("POST", "/v1/snapshots/compact", json={"from_tag": from_tag, "to_tag": to_tag},
                               timeout=LONG_TIMEOUT_S))

    def snapshot_diff(self, base_tag: str, tag: str, cmd: str, timeout_s: float = 600.0) -> Any:
        """Run ``cmd`` in a child of ``base_tag`` and save what it changed as the diff snapshot ``tag``."""
        return self._send(Call("POST", "/v1/snapshots/diff", json={"base_tag": base_tag, "tag": tag, "cmd": cmd,
                                                                   "timeout_s": timeout_s},
                               timeout=call_timeout(timeout_s)))

    # sandboxes

    def fork(self, tag: str | None, n: int = 1, *, timeout_s: float | None = None, envs: dict[str, str] | None = None,
             metadata: dict[str, str] | None = None, net: str | None = None, egress: dict[str, Any] | None = None,
             memory_limit_mib: int | None = None, cpu_quota: float | None = None, cpu_weight: int | None = None,
             pids_max: int | None = None, deadline_s: float | None = None, snapshot_digest: str | None = None,
             idempotency_key: str | None = None, owner: str | None = None) -> Any:
        """``{"sandboxes": [...], "errors": [...]}``: a failed child does not fail the others.

        ``timeout_s``: the daemon kills each child that long after it answered (renew with ``set_timeout``);
        ``envs``: default environment of every command; ``metadata``: labels kept with the sandbox.
        ``net`` is ``"none"`` (default) or ``"nat"``; ``egress`` e.g. ``{"default": "deny", "allow":
        [{"cidr": "203.0.113.0/24", "ports": [443]}]}``; the limits apply to each child's VMM.
        ``deadline_s``: wait no longer for the children; one not answering by then is dropped, reported in errors.
        ``snapshot_digest`` instead of ``tag`` forks the snapshot by digest; a retry with the same
        ``idempotency_key`` gets the first answer and forks nothing more; ``owner`` labels every child.
        """
        return self._send(fork_call(tag, n, locals()))

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> Any:
        """Kill the sandbox ``timeout_s`` from now; answers the deadline (Unix time)."""
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/timeout", json={"timeout_s": timeout_s},
                               key="end_at"))

    def sandboxes(self, owner: str | None = None) -> Any:
        return self._send(Call("GET", "/v1/sandboxes", params={"owner": owner} if owner else None, key="sandboxes"))

    def kill_owner(self, owner: str) -> Any:
        """Kill every child forked with ``owner``; answers their ids."""
        return self._send(Call("DELETE", "/v1/sandboxes", params={"owner": owner}, key="killed"))

    def sandbox(self, sandbox_id: str) -> Any:
        return self._send(Call("GET", f"/v1/sandboxes/{sandbox_id}"))

    def kill(self, sandbox_id: str) -> Any:
        return self._send(Call("DELETE", f"/v1/sandboxes/{sandbox_id}", void=True))

    def ping(self, sandbox_id: str) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/ping"))

    # pools of ready VMMs

    def pools(self) -> Any:
        """Every snapshot's pool: size, ready members and their memory."""
        return self._send(Call("GET", "/v1/pools", key="pools"))

    def set_pool_size(self, tag: str, size: int) -> Any:
        """Keep ``size`` ready VMMs of ``tag`` (0: none); filled in the background."""
        return self._send(Call("PUT", f"/v1/pools/{tag}", json={"size": size}))

    # commands and code

    def exec(self, sandbox_id: str, cmd: str | list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: str | None = None, timeout_s: float | None = 60.0,
             user: str | None = None, on_event: Callable[[dict[str, Any]], Any] | None = None,
             warm: bool = False) -> Any:
        """Run a command; with ``on_event`` output is streamed as it arrives and the result has no stdout/stderr.

        ``warm=True`` runs a ``python3 ...`` command line as a fork of the snapshot's warm interpreter.
        """
        return self._send_or_stream(exec_call(sandbox_id, cmd, env, cwd, stdin, timeout_s, user, warm), on_event)

    def start_exec(self, sandbox_id: str, cmd: str | list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: str | None = None, timeout_s: float | None = 60.0,
                   user: str | None = None, warm: bool = False, pty: tuple[int, int] | None = None) -> Any:
        """Start a command and answer its open event stream (``started`` with the pid comes first).

        ``stdin=None`` keeps the command's stdin open for ``send_stdin``. ``pty=(rows, cols)`` runs it on a
        terminal: its output comes as ``pty`` events; type into it with ``send_stdin(..., pty=True)`` and
        resize it with ``resize_terminal``.
        """
        return self._open_stream(exec_call(sandbox_id, cmd, env, cwd, stdin, timeout_s, user, warm, pty).streamed())

    def processes(self, sandbox_id: str) -> Any:
        return self._send(Call("GET", f"/v1/sandboxes/{sandbox_id}/processes", key="processes"))

    def signal_process(self, sandbox_id: str, pid: int, signal: int = 9) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/signal",
                               json={"signal": signal}, void=True))

    def send_stdin(self, sandbox_id: str, pid: int, data: str, eof: bool = False, pty: bool = False) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin",
                               json={"data": data, "eof": eof, **({"pty": True} if pty else {})}, void=True))

    def resize_terminal(self, sandbox_id: str, pid: int, rows: int, cols: int) -> Any:
        """The new size of a ``pty`` command's terminal."""
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/resize",
                               json={"rows": rows, "cols": cols}, void=True))

    def eval(self, sandbox_id: str, expr: str, context: str = "default") -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/eval", json={"expr": expr, "context": context}))

    def run_code(self, sandbox_id: str, code: str, context: str = "default", timeout_s: float | None = None,
                 on_event: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """Run a cell; with ``on_event`` its output is streamed and the result has no stdout/stderr."""
        body: dict[str, Any] = {"code": code, "context": context}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return self._send_or_stream(Call("POST", f"/v1/sandboxes/{sandbox_id}/run_code", json=body,
                                         timeout=call_timeout(timeout_s)), on_event)

    def create_context(self, sandbox_id: str, *, context_id: str | None = None, cwd: str | None = None,
                       language: str = "python") -> Any:
        body = {"id": context_id, "cwd": cwd, "language": language}
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/contexts",
                               json={k: v for k, v in body.items() if v is not None}))

    def contexts(self, sandbox_id: str) -> Any:
        return self._send(Call("GET", f"/v1/sandboxes/{sandbox_id}/contexts", key="contexts"))

    def restart_context(self, sandbox_id: str, context_id: str) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/contexts/{context_id}/restart"))

    def remove_context(self, sandbox_id: str, context_id: str) -> Any:
        return self._send(Call("DELETE", f"/v1/sandboxes/{sandbox_id}/contexts/{context_id}", void=True))

    # files

    @operation
    def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> Steps[bytes]:
        """The whole file; with ``max_bytes``, refused (413 ``too_large``) as soon as it holds more."""
        data = bytearray()
        chunks = self.read_file_chunks(sandbox_id, path)
        try:
            while (chunk := (yield self._flavour.next(chunks))) is not None:
                append_bounded(data, chunk, max_bytes, path)
        finally:
            yield self._flavour.close(chunks)  # stops the download where it is
        return bytes(data)

    def read_file_chunks(self, sandbox_id: str, path: str) -> Any:
        """The file's bytes as they arrive (a large file is never held whole): an iterator or async iterator."""
        raise NotImplementedError

    def write_file(self, sandbox_id: str, path: str, data: Any, mode: int | None = None) -> Any:
        """``data``: bytes, or an iterator (async client: also an async iterator) of byte pieces, streamed."""
        params: dict[str, Any] = {"path": path}
        if mode is not None:
            params["mode"] = mode
        return self._send(Call("PUT", f"/v1/sandboxes/{sandbox_id}/files", params=params, content=data,
                               timeout=LONG_TIMEOUT_S))

    def list_files(self, sandbox_id: str, path: str) -> Any:
        return self._send(Call("GET", f"/v1/sandboxes/{sandbox_id}/files/list", params={"path": path},
                               key="entries"))

    def stat(self, sandbox_id: str, path: str) -> Any:
        return self._send(Call("GET", f"/v1/sandboxes/{sandbox_id}/files/stat", params={"path": path}))

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> Any:
        return self._send(Call("DELETE", f"/v1/sandboxes/{sandbox_id}/files",
                               params={"path": path, "recursive": recursive}, void=True))

    def make_dir(self, sandbox_id: str, path: str) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/files/mkdir", json={"path": path}, void=True))

    def rename(self, sandbox_id: str, src: str, dst: str) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/files/rename", json={"src": src, "dst": dst},
                               void=True))

    # packs

    def pack(self, tag: str, path: str, force: bool = False, on_progress: Callable[[str], Any] | None = None) -> Any:
        """Write snapshot ``tag`` and its ancestors to ``path`` (a path on the daemon's host)."""
        return self._stream(Call("POST", "/v1/packs", json={"tag": tag, "path": path, "force": force},
                                 timeout=LONG_TIMEOUT_S), progress(on_progress))

    def unpack(self, path: str, tag: str | None = None, force: bool = False,
               on_progress: Callable[[str], Any] | None = None) -> Any:
        body: dict[str, Any] = {"path": path, "force": force}
        if tag is not None:
            body["tag"] = tag
        return self._stream(Call("POST", "/v1/packs/unpack", json=body, timeout=LONG_TIMEOUT_S),
                            progress(on_progress))

    def pull(self, url: str | None = None, *, index: str | None = None, name: str | None = None,
             sha256: str | None = None, tag: str | None = None, force: bool = False,
             on_progress: Callable[[str], Any] | None = None) -> Any:
        """Download a pack (from ``url``, or pack ``name`` of ``index``), verify it and unpack it."""
        body = {key: value for key, value in (("url", url), ("index", index), ("name", name), ("sha256", sha256),
                                              ("tag", tag)) if value is not None}
        return self._stream(Call("POST", "/v1/packs/pull", json={**body, "force": force}, timeout=LONG_TIMEOUT_S),
                            progress(on_progress))

    def push(self, tag: str, url: str, on_progress: Callable[[str], Any] | None = None) -> Any:
        """Pack ``tag`` and upload it with one HTTP PUT to ``url`` (e.g. a presigned object-store URL)."""
        return self._stream(Call("POST", "/v1/packs/push", json={"tag": tag, "url": url}, timeout=LONG_TIMEOUT_S),
                            progress(on_progress))

    # this daemon as a node of a cluster

    def node(self) -> Any:
        """Node id, compatibility key, capacity and the snapshots held, by digest."""
        return self._send(Call("GET", "/v1/node"))

    def node_pull(self, digest: str, source: str, source_token: str | None = None) -> Any:
        """Pull the chain ending at ``digest`` from the node at ``source`` (only the layers missing here)."""
        return self._send(Call("POST", "/v1/node/pull", json={"digest": digest, "source": source,
                                                               "source_token": source_token},
                               timeout=LONG_TIMEOUT_S))

    def drain(self, wait_s: float = 0.0) -> Any:
        """Take no new forks (running sandboxes carry on); with ``wait_s``, answer once none is left or that
        time passed: ``{draining, sandboxes, starting}`` (what is left)."""
        return self._send(Call("POST", "/v1/node/drain", json={"wait_s": wait_s}, timeout=wait_s + 30))

    def undrain(self) -> Any:
        """Take forks again."""
        return self._send(Call("DELETE", "/v1/node/drain"))

    # branch

    def branch(self, sandbox_id: str, tag: str | None = None, mode: str = "diff", wait: bool = True) -> Any:
        """Save a running sandbox as snapshot ``tag`` (it keeps running); ``wait=False`` answers it ``writing``.

        Without a tag one is made from the sandbox id.
        """
        tag = tag or f"{sandbox_id}-{secrets.token_hex(4)}"
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/branch",
                               json={"tag": tag, "mode": mode, "wait": wait}, timeout=LONG_TIMEOUT_S))

    # workspaces

    def create_workspace(self, name: str, snapshot_tag: str) -> Any:
        return self._send(Call("POST", "/v1/workspaces", json={"name": name, "snapshot_tag": snapshot_tag},
                               timeout=LONG_TIMEOUT_S))

    def workspaces(self) -> Any:
        return self._send(Call("GET", "/v1/workspaces", key="workspaces"))

    def workspace(self, name: str) -> Any:
        return self._send(Call("GET", f"/v1/workspaces/{name}"))

    def suspend_workspace(self, name: str) -> Any:
        """Save the workspace as its next diff layer and stop its sandbox (its memory is freed)."""
        return self._send(Call("POST", f"/v1/workspaces/{name}/suspend", timeout=LONG_TIMEOUT_S))

    def resume_workspace(self, name: str) -> Any:
        return self._send(Call("POST", f"/v1/workspaces/{name}/resume", timeout=LONG_TIMEOUT_S))

    def remove_workspace(self, name: str) -> Any:
        return self._send(Call("DELETE", f"/v1/workspaces/{name}", timeout=LONG_TIMEOUT_S, key="removed_tags"))

