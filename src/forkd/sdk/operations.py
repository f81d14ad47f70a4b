"""Every REST operation written once, for the sync ``Controller`` and the async ``AsyncController``.

Each method turns its arguments into a ``Call`` (``calls.py``: method, path, query, body, timeout, which field
of the answer to return) and hands it to the client's ``_send``/``_stream``/``_open_stream``: the sync client
answers with the value, the async one with an awaitable of it. So paths, bodies and answer parsing live
here and nowhere else; the clients only move bytes (``answers.py`` reads what comes back).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Any

from forkd.sdk.calls import (
    LONG_TIMEOUT_S,
    Call,
    append_bounded,
    call_timeout,
    exec_call,
    fork_call,
    request,
)
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.progress import progress
from forkd.sdk.records import (
    ContextRecord,
    EvalAnswer,
    FileEntry,
    ForkAnswer,
    Health,
    PoolRecord,
    SandboxRecord,
    SnapshotRecord,
    Version,
)
from forkd.sdk.sandbox.flavour import Flavour, Steps, operation

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

    #: Makes the HTTP client for a connection (``ConnectionConfig.client`` or ``.async_client``).
    _new_client: Callable[[ConnectionConfig], Any]

    def _send(self, call: Call[Any]) -> Any:
        raise NotImplementedError

    def _stream(self, call: Call[Any], on_line: Callable[[dict[str, Any]], Any] | None) -> Any:
        """Send ``call`` answered with NDJSON; pass every line to ``on_line``; answer the ``result``."""
        raise NotImplementedError

    def _open_stream(self, call: Call[Any]) -> Any:
        """Send ``call`` answered with NDJSON and answer the open stream of its events."""
        raise NotImplementedError

    def _send_or_stream(self, call: Call[Any], on_event: Callable[[dict[str, Any]], Any] | None) -> Any:
        return self._send(call) if on_event is None else self._stream(call.streamed(), on_event)

    # daemon

    @request
    def health(self) -> Call[Health]:
        """``{"ok": true}`` when the daemon answers (the one route that never needs a token)."""
        return Call("GET", "/healthz")

    @request
    def version(self) -> Call[Version]:
        """``{"forkd", "vmm", "vmm_version", "accelerator", ...}``: what the daemon runs on."""
        return Call("GET", "/v1/version")

    @request
    def doctor(self) -> Call[list[dict[str, str]]]:
        """``[{"name", "status", "detail", "fix"}]``: the daemon host's checks."""
        return Call("GET", "/v1/doctor", key="checks")

    # images

    @request
    def images(self) -> Call[list[dict[str, Any]]]:
        """Every built guest image: ``[{"name", "size_bytes", "created_at", ...}]``."""
        return Call("GET", "/v1/images", key="images")

    def build_image(self, on_progress: Callable[[str], Any] | None = None, **spec: Any) -> Any:
        """Build a guest image from ``spec`` (``name``, ``packages``, ``from_dir``...); ``on_progress`` gets each line."""
        return self._stream(Call("POST", "/v1/images", json=spec, timeout=LONG_TIMEOUT_S), progress(on_progress))

    @request
    def remove_image(self, name: str) -> Call[None]:
        """Remove image ``name`` (snapshots made from it keep their own copy)."""
        return Call("DELETE", f"/v1/images/{name}", void=True)

    # snapshots

    @request
    def snapshots(self) -> Call[list[SnapshotRecord]]:
        """Every snapshot: ``[{"tag", "status", "image", "created_at", "disk", ...}]``."""
        return Call("GET", "/v1/snapshots", key="snapshots")

    @request
    def snapshot(self, tag: str) -> Call[SnapshotRecord]:
        """Snapshot ``tag`` in full: status, depth, ancestors, dependents, sizes (``NotFoundException`` if none)."""
        return Call("GET", f"/v1/snapshots/{tag}")

    def create_snapshot(self, tag: str, on_progress: Callable[[str], Any] | None = None, machine: str | None = None,
                        **options: Any) -> Any:
        """Boot a VM, warm it (``warm_modules``, ``warm_code``, ``warmup_cmd``), save it as ``tag``; ``on_progress``
        gets each line. ``machine``: ``"q35"`` or ``"microvm"`` (every child of it runs on it; None: the daemon's default)."""
        body = {"tag": tag, **options, **({} if machine is None else {"machine": machine})}
        return self._stream(Call("POST", "/v1/snapshots", json=body, timeout=LONG_TIMEOUT_S), progress(on_progress))

    @request
    def remove_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> Call[list[str]]:
        """The tags removed (``cascade`` removes the snapshots branched from ``tag`` too)."""
        return Call("DELETE", f"/v1/snapshots/{tag}", params={"cascade": cascade, "force": force},
                    key="removed_tags")

    @request
    def compact(self, from_tag: str, to_tag: str) -> Call[SnapshotRecord]:
        """Flatten ``from_tag``'s chain into the standalone snapshot ``to_tag``."""
        return Call("POST", "/v1/snapshots/compact", json={"from_tag": from_tag, "to_tag": to_tag},
                    timeout=LONG_TIMEOUT_S)

    @request
    def snapshot_diff(self, base_tag: str, tag: str, cmd: str, timeout_s: float = 600.0) -> Call[SnapshotRecord]:
        """Run ``cmd`` in a child of ``base_tag`` and save what it changed as the diff snapshot ``tag``."""
        return Call("POST", "/v1/snapshots/diff", json={"base_tag": base_tag, "tag": tag, "cmd": cmd,
                                                        "timeout_s": timeout_s},
                    timeout=call_timeout(timeout_s))

    # sandboxes

    @request
    def fork(self, tag: str | None, n: int = 1, *, timeout_s: float | None = None, envs: dict[str, str] | None = None,
             metadata: dict[str, str] | None = None, net: str | None = None, egress: dict[str, Any] | None = None,
             memory_limit_mib: int | None = None, cpu_quota: float | None = None, cpu_weight: int | None = None,
             pids_max: int | None = None, deadline_s: float | None = None, snapshot_digest: str | None = None,
             idempotency_key: str | None = None, owner: str | None = None) -> Call[ForkAnswer]:
        """``{"sandboxes": [...], "errors": [...]}``: a failed child does not fail the others.

        ``timeout_s``: the daemon kills each child that long after it answered (renew with ``set_timeout``);
        ``envs``: default environment of every command; ``metadata``: labels kept with the sandbox.
        ``net`` is ``"none"`` (default) or ``"nat"``; ``egress`` e.g. ``{"default": "deny", "allow":
        [{"cidr": "203.0.113.0/24", "ports": [443]}]}``; the limits apply to each child's VMM.
        ``deadline_s``: wait no longer for the children; one not answering by then is dropped, reported in errors.
        ``snapshot_digest`` instead of ``tag`` forks the snapshot by digest; a retry with the same
        ``idempotency_key`` gets the first answer and forks nothing more; ``owner`` labels every child.
        """
        return fork_call(tag, n, locals())

    @request
    def set_timeout(self, sandbox_id: str, timeout_s: float) -> Call[float]:
        """Kill the sandbox ``timeout_s`` from now; answers the deadline (Unix time)."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/timeout", json={"timeout_s": timeout_s},
                    key="end_at")

    @request
    def sandboxes(self, owner: str | None = None) -> Call[list[SandboxRecord]]:
        """The running sandboxes (only ``owner``'s when given): ``[{"id", "snapshot_tag", "status", "created_at", "end_at", "metadata", ...}]``."""
        return Call("GET", "/v1/sandboxes", params={"owner": owner} if owner else None, key="sandboxes")

    @request
    def kill_owner(self, owner: str) -> Call[list[str]]:
        """Kill every child forked with ``owner``; answers their ids."""
        return Call("DELETE", "/v1/sandboxes", params={"owner": owner}, key="killed")

    @request
    def sandbox(self, sandbox_id: str) -> Call[SandboxRecord]:
        """Sandbox ``sandbox_id``'s record (``NotFoundException`` once it ended and left the daemon's memory)."""
        return Call("GET", f"/v1/sandboxes/{sandbox_id}")

    @request
    def kill(self, sandbox_id: str) -> Call[None]:
        """Stop the sandbox and free what it held (``NotFoundException`` if it is not running)."""
        return Call("DELETE", f"/v1/sandboxes/{sandbox_id}", void=True)

    @request
    def ping(self, sandbox_id: str) -> Call[dict[str, Any]]:
        """Ask the sandbox's guest agent to answer: ``{"agent_version", "sandbox_id"}``."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/ping")

    # pools of ready VMMs

    @request
    def pools(self) -> Call[list[PoolRecord]]:
        """Every snapshot's pool: size, ready members and their memory."""
        return Call("GET", "/v1/pools", key="pools")

    @request
    def set_pool_size(self, tag: str, size: int) -> Call[dict[str, Any]]:
        """Keep ``size`` ready VMMs of ``tag`` (0: none); filled in the background."""
        return Call("PUT", f"/v1/pools/{tag}", json={"size": size})

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
                   user: str | None = None, warm: bool = False) -> Any:
        """Start a command and answer its open event stream (``started`` with the pid comes first).

        ``stdin=None`` keeps the command's stdin open for ``send_stdin``.
        """
        return self._open_stream(exec_call(sandbox_id, cmd, env, cwd, stdin, timeout_s, user, warm).streamed())

    def start_pty(self, sandbox_id: str, argv: list[str], *, rows: int = 24, cols: int = 80,
                  env: dict[str, str] | None = None, cwd: str | None = None) -> Any:
        """Start ``argv`` on a terminal in the guest and answer its open event stream: ``started`` with the pid,
        ``pty`` events (``data_b64``: what it wrote to its terminal), then its ``{exit_code, signal}``."""
        body: dict[str, Any] = {"argv": list(argv), "rows": rows, "cols": cols, "env": env or {}}
        if cwd is not None:
            body["cwd"] = cwd
        return self._open_stream(Call("POST", f"/v1/sandboxes/{sandbox_id}/pty", json=body, timeout=LONG_TIMEOUT_S))

    @request
    def processes(self, sandbox_id: str) -> Call[list[dict[str, Any]]]:
        """The sandbox's commands, running and recently finished: ``[{"pid", "argv", "running", "exit_code", ...}]``."""
        return Call("GET", f"/v1/sandboxes/{sandbox_id}/processes", key="processes")

    @request
    def signal_process(self, sandbox_id: str, pid: int, signal: int = 9) -> Call[None]:
        """Send ``signal`` (default SIGKILL) to command ``pid``'s process group."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/signal",
                    json={"signal": signal}, void=True)

    @request
    def send_stdin(self, sandbox_id: str, pid: int, data: str, eof: bool = False) -> Call[None]:
        """Write ``data`` to command ``pid``'s stdin; ``eof=True`` closes it after."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin",
                    json={"data": data, "eof": eof}, void=True)

    @request
    def pty_input(self, sandbox_id: str, pid: int, data: str) -> Call[None]:
        """Type ``data`` at the terminal of ``start_pty``'s program (control characters included: ^D is ``\x04``)."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/pty/{pid}/input", json={"data": data}, void=True)

    @request
    def pty_resize(self, sandbox_id: str, pid: int, rows: int, cols: int) -> Call[None]:
        """The new size of ``start_pty``'s terminal (its program gets SIGWINCH)."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/pty/{pid}/resize", json={"rows": rows, "cols": cols},
                    void=True)

    @request
    def pty_signal(self, sandbox_id: str, pid: int, signal: int = 1) -> Call[None]:
        """Send ``signal`` (default SIGHUP: a hang-up) to the program on ``start_pty``'s terminal."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/pty/{pid}/signal", json={"signal": signal}, void=True)

    @request
    def watch(self, sandbox_id: str, path: str, recursive: bool = False) -> Call[str]:
        """Watch directory ``path`` in the guest (``recursive``: its subdirectories too); the watcher's id."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/watches", json={"path": path, "recursive": recursive},
                    key="id")

    @request
    def watch_events(self, sandbox_id: str, watch_id: str, wait_s: float = 0.0) -> Call[list[dict[str, Any]]]:
        """The watcher's events since the last read (``{"type", "name", "path"}``), waiting up to ``wait_s``
        (at most 10) for a first one; ``type`` ``overflow`` says the guest's queue filled and events were lost."""
        return Call("GET", f"/v1/sandboxes/{sandbox_id}/watches/{watch_id}/events", params={"wait_s": wait_s},
                    timeout=call_timeout(wait_s), key="events")

    @request
    def unwatch(self, sandbox_id: str, watch_id: str) -> Call[None]:
        """End watcher ``watch_id``."""
        return Call("DELETE", f"/v1/sandboxes/{sandbox_id}/watches/{watch_id}", void=True)

    @request
    def eval(self, sandbox_id: str, expr: str, context: str = "default") -> Call[EvalAnswer]:
        """The value of one Python expression in ``context``: ``{"value", "value_json", "error"}``."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/eval", json={"expr": expr, "context": context})

    def run_code(self, sandbox_id: str, code: str, context: str = "default", timeout_s: float | None = None,
                 on_event: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """Run a cell; with ``on_event`` its output is streamed and the result has no stdout/stderr."""
        body: dict[str, Any] = {"code": code, "context": context}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return self._send_or_stream(Call("POST", f"/v1/sandboxes/{sandbox_id}/run_code", json=body,
                                         timeout=call_timeout(timeout_s)), on_event)

    @request
    def create_context(self, sandbox_id: str, *, context_id: str | None = None, cwd: str | None = None,
                       language: str = "python") -> Call[ContextRecord]:
        """A new code context (its own interpreter, forked from the warm one): ``{"id", "language", "cwd"}``."""
        body = {"id": context_id, "cwd": cwd, "language": language}
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/contexts",
                    json={k: v for k, v in body.items() if v is not None})

    @request
    def contexts(self, sandbox_id: str) -> Call[list[ContextRecord]]:
        """The sandbox's code contexts: ``[{"id", "language", "cwd"}]``."""
        return Call("GET", f"/v1/sandboxes/{sandbox_id}/contexts", key="contexts")

    @request
    def restart_context(self, sandbox_id: str, context_id: str) -> Call[ContextRecord]:
        """Replace ``context_id``'s interpreter with a fresh fork of the warm one (its variables are gone)."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/contexts/{context_id}/restart")

    @request
    def remove_context(self, sandbox_id: str, context_id: str) -> Call[None]:
        """End code context ``context_id`` and its interpreter."""
        return Call("DELETE", f"/v1/sandboxes/{sandbox_id}/contexts/{context_id}", void=True)

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

    @request
    def write_file(self, sandbox_id: str, path: str, data: Any, mode: int | None = None) -> Call[dict[str, Any]]:
        """``data``: bytes, or an iterator (async client: also an async iterator) of byte pieces, streamed."""
        params: dict[str, Any] = {"path": path}
        if mode is not None:
            params["mode"] = mode
        return Call("PUT", f"/v1/sandboxes/{sandbox_id}/files", params=params, content=data,
                    timeout=LONG_TIMEOUT_S)

    @request
    def list_files(self, sandbox_id: str, path: str) -> Call[list[FileEntry]]:
        """The entries directly under ``path``: ``[{"name", "path", "type", "size", "mode", "mtime"}]``."""
        return Call("GET", f"/v1/sandboxes/{sandbox_id}/files/list", params={"path": path},
                    key="entries")

    @request
    def stat(self, sandbox_id: str, path: str) -> Call[FileEntry]:
        """One entry's ``{"name", "path", "type", "size", "mode", "mtime"}`` (``NotFoundException`` if missing)."""
        return Call("GET", f"/v1/sandboxes/{sandbox_id}/files/stat", params={"path": path})

    @request
    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> Call[None]:
        """Remove ``path`` (a directory only with ``recursive=True``)."""
        return Call("DELETE", f"/v1/sandboxes/{sandbox_id}/files",
                    params={"path": path, "recursive": recursive}, void=True)

    @request
    def make_dir(self, sandbox_id: str, path: str) -> Call[None]:
        """Create directory ``path`` and its parents."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/files/mkdir", json={"path": path}, void=True)

    @request
    def rename(self, sandbox_id: str, src: str, dst: str) -> Call[None]:
        """Move ``src`` to ``dst`` inside the sandbox."""
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/files/rename", json={"src": src, "dst": dst},
                    void=True)

    # packs

    def pack(self, tag: str, path: str, force: bool = False, on_progress: Callable[[str], Any] | None = None) -> Any:
        """Write snapshot ``tag`` and its ancestors to ``path`` (a path on the daemon's host)."""
        return self._stream(Call("POST", "/v1/packs", json={"tag": tag, "path": path, "force": force},
                                 timeout=LONG_TIMEOUT_S), progress(on_progress))

    def unpack(self, path: str, tag: str | None = None, force: bool = False,
               on_progress: Callable[[str], Any] | None = None) -> Any:
        """Verify the pack at ``path`` (on the daemon's host) and add its snapshots, all or nothing; ``tag`` renames its top one."""
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

    @request
    def node(self) -> Call[dict[str, Any]]:
        """Node id, compatibility key, capacity and the snapshots held, by digest."""
        return Call("GET", "/v1/node")

    @request
    def node_pull(self, digest: str, source: str, source_token: str | None = None) -> Call[dict[str, Any]]:
        """Pull the chain ending at ``digest`` from the node at ``source`` (only the layers missing here)."""
        return Call("POST", "/v1/node/pull", json={"digest": digest, "source": source,
                                                    "source_token": source_token},
                    timeout=LONG_TIMEOUT_S)

    @request
    def drain(self, wait_s: float = 0.0) -> Call[dict[str, Any]]:
        """Take no new forks (running sandboxes carry on); with ``wait_s``, answer once none is left or that
        time passed: ``{draining, sandboxes, starting}`` (what is left)."""
        return Call("POST", "/v1/node/drain", json={"wait_s": wait_s}, timeout=wait_s + 30)

    @request
    def undrain(self) -> Call[dict[str, Any]]:
        """Take forks again."""
        return Call("DELETE", "/v1/node/drain")

    # branch

    @request
    def branch(self, sandbox_id: str, tag: str | None = None, mode: str = "diff", wait: bool = True) -> Call[SnapshotRecord]:
        """Save a running sandbox as snapshot ``tag`` (it keeps running); ``wait=False`` answers it ``writing``
        right after the pause.

        Without a tag one is made from the sandbox id.
        """
        tag = tag or f"{sandbox_id}-{secrets.token_hex(4)}"
        return Call("POST", f"/v1/sandboxes/{sandbox_id}/branch",
                    json={"tag": tag, "mode": mode, "wait": wait}, timeout=LONG_TIMEOUT_S)

    # workspaces

    @request
    def create_workspace(self, name: str, snapshot_tag: str) -> Call[dict[str, Any]]:
        """A long-lived sandbox ``name`` forked from ``snapshot_tag``, suspended and resumed by name."""
        return Call("POST", "/v1/workspaces", json={"name": name, "snapshot_tag": snapshot_tag},
                    timeout=LONG_TIMEOUT_S)

    @request
    def workspaces(self) -> Call[list[dict[str, Any]]]:
        """Every workspace: ``[{"name", "state", "sandbox_id", "head_tag", ...}]``."""
        return Call("GET", "/v1/workspaces", key="workspaces")

    @request
    def workspace(self, name: str) -> Call[dict[str, Any]]:
        """Workspace ``name``'s record (``NotFoundException`` if none)."""
        return Call("GET", f"/v1/workspaces/{name}")

    @request
    def suspend_workspace(self, name: str) -> Call[dict[str, Any]]:
        """Save the workspace as its next diff layer and stop its sandbox (its memory is freed)."""
        return Call("POST", f"/v1/workspaces/{name}/suspend", timeout=LONG_TIMEOUT_S)

    @request
    def resume_workspace(self, name: str) -> Call[dict[str, Any]]:
        """Fork the workspace's last saved layer and run it again."""
        return Call("POST", f"/v1/workspaces/{name}/resume", timeout=LONG_TIMEOUT_S)

    @request
    def remove_workspace(self, name: str) -> Call[list[str]]:
        """Remove the workspace (its sandbox killed); answers the snapshot tags removed with it."""
        return Call("DELETE", f"/v1/workspaces/{name}", timeout=LONG_TIMEOUT_S, key="removed_tags")
