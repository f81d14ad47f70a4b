"""``forkd.Controller``: the REST client every front end (CLI, SDK, MCP) uses to reach the daemon.

``FORKD_URL`` picks the daemon: ``unix:///path/to/forkd.sock`` (default: the local daemon's socket)
or ``http(s)://host:port``; ``FORKD_TOKEN`` is sent as a bearer token when set.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import ssl
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import httpx

from forkd.config import paths_from_env
from forkd.errors import KINDS, kind_of
from forkd.sdk.errors import DaemonUnreachable, ForkdError, error_for

__all__ = ["Controller", "DaemonUnreachable", "EventStream", "ForkdError"]

LONG_TIMEOUT_S = 3600.0


def client_options(url: str | None, token: str | None, timeout: float) -> tuple[str, dict[str, Any]]:
    """Where the daemon is and how to talk to it (for ``httpx.Client`` or ``httpx.AsyncClient``).

    ``FORKD_CA_CERT`` names a CA bundle that signed the daemon's TLS certificate.
    """
    url = url or os.environ.get("FORKD_URL") or f"unix://{paths_from_env().socket}"
    token = token or os.environ.get("FORKD_TOKEN")
    options: dict[str, Any] = {"headers": {"Authorization": f"Bearer {token}"} if token else {}, "timeout": timeout}
    if url.startswith("unix://"):
        options.update(base_url="http://forkd", transport=httpx.HTTPTransport(uds=url[len("unix://"):]))
    elif url.startswith(("http://", "https://")):
        options["base_url"] = url
        if os.environ.get("FORKD_CA_CERT"):
            options["verify"] = ssl.create_default_context(cafile=os.environ["FORKD_CA_CERT"])
    else:
        raise ValueError(f"FORKD_URL must start with unix://, http:// or https://, not {url!r}")
    return url, options


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        err = response.json().get("error", {})
        code, message = err.get("code", "error"), err.get("message", response.text)
    except (ValueError, AttributeError):
        code, message = "error", response.text
    raise error_for(response.status_code, code, message)


class EventStream:
    """An NDJSON answer being read: iterate its events; ``result`` is set once the last line came.

    Kept open across calls so a background command's events can be read long after it started.
    """

    def __init__(self, context: Any, url: str) -> None:
        self._context = context
        self._url = url
        try:
            self._response: httpx.Response = context.__enter__()
            if not self._response.is_success:
                self._response.read()
                _raise_for(self._response)
        except httpx.TransportError as exc:
            self.close()
            raise DaemonUnreachable(url, str(exc) or type(exc).__name__) from None
        except BaseException:
            self.close()
            raise
        self._lines = self._response.iter_lines()
        self.result: Any = None
        self.done = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for text in self._lines:
                if not text.strip():
                    continue
                line = json.loads(text)
                if "result" in line or "error" in line:
                    self.done = True
                    self.close()
                    if "error" in line:
                        err = line["error"]
                        code = str(err.get("code", "error"))
                        raise error_for(kind_of(code).status, code, err.get("message", ""))
                    self.result = line["result"]
                    return
                yield line
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self._url, str(exc) or type(exc).__name__) from None
        finally:
            if not self.done:
                self.close()
        if not self.done:
            raise ForkdError(500, "truncated", f"the daemon closed the stream without a result; "
                                               f"{KINDS['truncated'].next_step}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._context.__exit__(None, None, None)


_FORK_OPTIONS = ("timeout_s", "envs", "metadata", "net", "egress", "memory_limit_mib", "cpu_quota", "cpu_weight",
                 "pids_max", "deadline_s")


def _fork_body(tag: str, n: int, options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - {*_FORK_OPTIONS, "self", "tag", "n"}
    if unknown:
        raise TypeError(f"unknown fork options: {', '.join(sorted(unknown))}")
    return {"snapshot_tag": tag, "n": n, **{k: options[k] for k in _FORK_OPTIONS if options.get(k) is not None}}


class Controller:
    """Synchronous client for the forkd REST API."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 120.0) -> None:
        self.url, options = client_options(url, token, timeout)
        self._http = httpx.Client(**options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
        _raise_for(response)
        return response.json()

    def open_stream(self, method: str, path: str, **kwargs: Any) -> EventStream:
        """Send a request answered with NDJSON and return the open stream of its events."""
        return EventStream(self._http.stream(method, path, timeout=LONG_TIMEOUT_S, **kwargs), self.url)

    def stream(self, method: str, path: str, on_line: Callable[[dict[str, Any]], None] | None = None,
               **kwargs: Any) -> Any:
        """Send a request answered with NDJSON; pass every line to ``on_line``, return the ``result``."""
        events = self.open_stream(method, path, **kwargs)
        for line in events:
            if on_line is not None:
                on_line(line)
        return events.result

    # daemon

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/healthz")

    def version(self) -> dict[str, Any]:
        return self.request("GET", "/v1/version")

    def doctor(self) -> list[dict[str, str]]:
        return self.request("GET", "/v1/doctor")["checks"]

    # images

    def images(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/images")["images"]

    def build_image(self, on_progress: Callable[[str], None] | None = None, **spec: Any) -> dict[str, Any]:
        return self.stream("POST", "/v1/images", _progress(on_progress), json=spec)

    def remove_image(self, name: str) -> None:
        self.request("DELETE", f"/v1/images/{name}")

    # snapshots

    def snapshots(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/snapshots")["snapshots"]

    def snapshot(self, tag: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/snapshots/{tag}")

    def create_snapshot(self, tag: str, on_progress: Callable[[str], None] | None = None,
                        **options: Any) -> dict[str, Any]:
        return self.stream("POST", "/v1/snapshots", _progress(on_progress), json={"tag": tag, **options})

    def remove_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> list[str]:
        """Returns the tags removed (``cascade`` removes the snapshots branched from ``tag`` too)."""
        params = {"cascade": cascade, "force": force}
        return self.request("DELETE", f"/v1/snapshots/{tag}", params=params)["removed_tags"]

    # sandboxes

    def fork(self, tag: str, n: int = 1, *, timeout_s: float | None = None, envs: dict[str, str] | None = None,
             metadata: dict[str, str] | None = None, net: str | None = None, egress: dict[str, Any] | None = None,
             memory_limit_mib: int | None = None, cpu_quota: float | None = None, cpu_weight: int | None = None,
             pids_max: int | None = None, deadline_s: float | None = None) -> dict[str, Any]:
        """``{"sandboxes": [...], "errors": [...]}``: a failed child does not fail the others.

        ``timeout_s``: the daemon kills each child that long after it answered (renew with ``set_timeout``);
        ``envs``: default environment of every command; ``metadata``: labels kept with the sandbox.
        ``net`` is ``"none"`` (default) or ``"nat"``; ``egress`` e.g. ``{"default": "deny", "allow":
        [{"cidr": "203.0.113.0/24", "ports": [443]}]}``; the limits apply to each child's VMM.
        ``deadline_s``: wait no longer for the children; one not answering by then is dropped, reported in errors.
        """
        body = _fork_body(tag, n, locals())
        return self.request("POST", "/v1/sandboxes", json=body, timeout=LONG_TIMEOUT_S)

    def fork_iter(self, tag: str, n: int = 1, **options: Any) -> Iterator[dict[str, Any]]:
        """Fork like :meth:`fork`, yielding each child as it answers or fails, in that order:
        ``{"index": i, "sandbox": {...}, "timings": {...}}`` or ``{"index": i, "error": "...", ...}``."""
        body = {**_fork_body(tag, n, options), "stream": True}
        for line in self.open_stream("POST", "/v1/sandboxes", json=body):
            if "child" in line:
                yield line["child"]

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> float:
        """Kill the sandbox ``timeout_s`` from now; returns the deadline (Unix time)."""
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/timeout", json={"timeout_s": timeout_s})["end_at"]

    # pools of ready VMMs

    def pools(self) -> list[dict[str, Any]]:
        """Every snapshot's pool: size, ready members and their memory."""
        return self.request("GET", "/v1/pools")["pools"]

    def set_pool_size(self, tag: str, size: int) -> dict[str, Any]:
        """Keep ``size`` ready VMMs of ``tag`` (0: none); filled in the background."""
        return self.request("PUT", f"/v1/pools/{tag}", json={"size": size})

    def sandboxes(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/sandboxes")["sandboxes"]

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/sandboxes/{sandbox_id}")

    def kill(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/v1/sandboxes/{sandbox_id}")

    def ping(self, sandbox_id: str) -> dict[str, Any]:
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/ping")

    def exec(self, sandbox_id: str, cmd: str | list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: str | None = None, timeout_s: float | None = 60.0,
             user: str | None = None, on_event: Callable[[dict[str, Any]], None] | None = None,
             warm: bool = False) -> dict[str, Any]:
        """Run a command; with ``on_event`` output is streamed as it arrives and the result has no stdout/stderr.

        ``warm=True`` runs a ``python3 ...`` command line as a fork of the snapshot's warm interpreter.
        """
        body = _exec_body(cmd, env, cwd, stdin, timeout_s, user, warm)
        path = f"/v1/sandboxes/{sandbox_id}/exec"
        if on_event is None:
            return self.request("POST", path, json=body, timeout=_call_timeout(timeout_s))
        return self.stream("POST", path, on_event, json={**body, "stream": True})

    def start_exec(self, sandbox_id: str, cmd: str | list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: str | None = None, timeout_s: float | None = 60.0,
                   user: str | None = None, warm: bool = False) -> EventStream:
        """Start a command and return its open event stream (``started`` with the pid comes first).

        ``stdin=None`` keeps the command's stdin open for ``send_stdin``.
        """
        return self.open_stream("POST", f"/v1/sandboxes/{sandbox_id}/exec",
                                json={**_exec_body(cmd, env, cwd, stdin, timeout_s, user, warm), "stream": True})

    def processes(self, sandbox_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/v1/sandboxes/{sandbox_id}/processes")["processes"]

    def signal_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        self.request("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/signal", json={"signal": signal})

    def send_stdin(self, sandbox_id: str, pid: int, data: str, eof: bool = False) -> None:
        self.request("POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin", json={"data": data, "eof": eof})

    def eval(self, sandbox_id: str, expr: str, context: str = "default") -> dict[str, Any]:
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/eval", json={"expr": expr, "context": context})

    def run_code(self, sandbox_id: str, code: str, context: str = "default", timeout_s: float | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run a cell; with ``on_event`` its output is streamed and the result has no stdout/stderr."""
        body: dict[str, Any] = {"code": code, "context": context}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        path = f"/v1/sandboxes/{sandbox_id}/run_code"
        if on_event is None:
            return self.request("POST", path, json=body, timeout=_call_timeout(timeout_s))
        return self.stream("POST", path, on_event, json={**body, "stream": True})

    def create_context(self, sandbox_id: str, *, context_id: str | None = None, cwd: str | None = None,
                       language: str = "python") -> dict[str, Any]:
        body = {"id": context_id, "cwd": cwd, "language": language}
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/contexts",
                            json={k: v for k, v in body.items() if v is not None})

    def contexts(self, sandbox_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/v1/sandboxes/{sandbox_id}/contexts")["contexts"]

    def restart_context(self, sandbox_id: str, context_id: str) -> dict[str, Any]:
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/contexts/{context_id}/restart")

    def remove_context(self, sandbox_id: str, context_id: str) -> None:
        self.request("DELETE", f"/v1/sandboxes/{sandbox_id}/contexts/{context_id}")

    # files

    def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        """The whole file; with ``max_bytes``, refused (413 ``too_large``) as soon as it holds more.

        A guest decides what a path holds (a symlink to /dev/zero never ends), so a caller that
        cannot hold any size passes ``max_bytes``; the download stops there.
        """
        data = bytearray()
        chunks = self.read_file_chunks(sandbox_id, path)
        try:
            for chunk in chunks:
                data += chunk
                if max_bytes is not None and len(data) > max_bytes:
                    raise ForkdError(413, "too_large", f"{path} holds more than {max_bytes} bytes; read it in "
                                     "parts (e.g. exec 'head -c N') or raise the limit")
        finally:
            chunks.close()  # stops the download where it is
        return bytes(data)

    def read_file_chunks(self, sandbox_id: str, path: str) -> Generator[bytes, None, None]:
        """The file's bytes as they arrive (a large file is never held whole)."""
        try:
            with self._http.stream("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path},
                                   timeout=LONG_TIMEOUT_S) as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None

    def write_file(self, sandbox_id: str, path: str, data: bytes | Iterator[bytes],
                   mode: int | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"path": path}
        if mode is not None:
            params["mode"] = mode
        return self.request("PUT", f"/v1/sandboxes/{sandbox_id}/files", params=params, content=data,
                            timeout=LONG_TIMEOUT_S)

    def list_files(self, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/v1/sandboxes/{sandbox_id}/files/list", params={"path": path})["entries"]

    def stat(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/sandboxes/{sandbox_id}/files/stat", params={"path": path})

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        self.request("DELETE", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path, "recursive": recursive})

    def make_dir(self, sandbox_id: str, path: str) -> None:
        self.request("POST", f"/v1/sandboxes/{sandbox_id}/files/mkdir", json={"path": path})

    def rename(self, sandbox_id: str, src: str, dst: str) -> None:
        self.request("POST", f"/v1/sandboxes/{sandbox_id}/files/rename", json={"src": src, "dst": dst})

    # packs

    def pack(self, tag: str, path: str, force: bool = False,
             on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Write snapshot ``tag`` and its ancestors to ``path`` (a path on the daemon's host)."""
        return self.stream("POST", "/v1/packs", _progress(on_progress), json={"tag": tag, "path": path, "force": force})

    def unpack(self, path: str, tag: str | None = None, force: bool = False,
               on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"path": path, "force": force}
        if tag is not None:
            body["tag"] = tag
        return self.stream("POST", "/v1/packs/unpack", _progress(on_progress), json=body)

    def pull(self, url: str | None = None, *, index: str | None = None, name: str | None = None,
             sha256: str | None = None, tag: str | None = None, force: bool = False,
             on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Download a pack (from ``url``, or pack ``name`` of ``index``), verify it and unpack it."""
        body = {key: value for key, value in (("url", url), ("index", index), ("name", name), ("sha256", sha256),
                                              ("tag", tag)) if value is not None}
        return self.stream("POST", "/v1/packs/pull", _progress(on_progress), json={**body, "force": force})

    def push(self, tag: str, url: str, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Pack ``tag`` and upload it with one HTTP PUT to ``url`` (e.g. a presigned object-store URL)."""
        return self.stream("POST", "/v1/packs/push", _progress(on_progress), json={"tag": tag, "url": url})

    # branch

    def branch(self, sandbox_id: str, tag: str | None = None, mode: str = "diff", wait: bool = True) -> dict[str, Any]:
        """Save a running sandbox as snapshot ``tag`` (it keeps running); ``wait=False`` returns it ``writing``.

        Without a tag one is made from the sandbox id.
        """
        tag = tag or f"{sandbox_id}-{secrets.token_hex(4)}"
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/branch",
                            json={"tag": tag, "mode": mode, "wait": wait}, timeout=LONG_TIMEOUT_S)

    def wait_snapshot(self, tag: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> dict[str, Any]:
        """Poll until snapshot ``tag`` is no longer ``writing``; returns it (``ready`` or ``failed``)."""
        deadline = time.monotonic() + timeout_s
        while (info := self.snapshot(tag))["status"] == "writing":
            if time.monotonic() > deadline:
                raise ForkdError(504, "timeout", f"snapshot {tag!r} still writing after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return info

    def compact(self, from_tag: str, to_tag: str) -> dict[str, Any]:
        """Flatten ``from_tag``'s chain into the standalone snapshot ``to_tag``."""
        return self.request("POST", "/v1/snapshots/compact", json={"from_tag": from_tag, "to_tag": to_tag},
                            timeout=LONG_TIMEOUT_S)

    def snapshot_diff(self, base_tag: str, tag: str, cmd: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Run ``cmd`` in a child of ``base_tag`` and save what it changed as the diff snapshot ``tag``."""
        return self.request("POST", "/v1/snapshots/diff",
                            json={"base_tag": base_tag, "tag": tag, "cmd": cmd, "timeout_s": timeout_s},
                            timeout=_call_timeout(timeout_s))

    # workspaces

    def create_workspace(self, name: str, snapshot_tag: str) -> dict[str, Any]:
        return self.request("POST", "/v1/workspaces", json={"name": name, "snapshot_tag": snapshot_tag},
                            timeout=LONG_TIMEOUT_S)

    def workspaces(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/workspaces")["workspaces"]

    def workspace(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/workspaces/{name}")

    def suspend_workspace(self, name: str) -> dict[str, Any]:
        """Save the workspace as its next diff layer and stop its sandbox (its memory is freed)."""
        return self.request("POST", f"/v1/workspaces/{name}/suspend", timeout=LONG_TIMEOUT_S)

    def resume_workspace(self, name: str) -> dict[str, Any]:
        return self.request("POST", f"/v1/workspaces/{name}/resume", timeout=LONG_TIMEOUT_S)

    def remove_workspace(self, name: str) -> list[str]:
        return self.request("DELETE", f"/v1/workspaces/{name}", timeout=LONG_TIMEOUT_S)["removed_tags"]


def _progress(on_progress: Callable[[str], None] | None) -> Callable[[dict[str, Any]], None] | None:
    if on_progress is None:
        return None
    return lambda line: on_progress(str(line.get("progress", line)))


def _exec_body(cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, stdin: str | None,
               timeout_s: float | None, user: str | None, warm: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    body.update({"env": env or {}, "timeout_s": timeout_s})
    if warm:
        body["warm"] = True
    optional = {"cwd": cwd, "stdin": stdin, "user": user}
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


def _call_timeout(timeout_s: float | None) -> float:
    return LONG_TIMEOUT_S if timeout_s is None else timeout_s + 60.0
