"""``forkd.Controller``: the REST client every front end (CLI, SDK, MCP) uses to reach the daemon.

``FORKD_URL`` picks the daemon: ``unix:///path/to/forkd.sock`` (default: the local daemon's socket)
or ``http(s)://host:port``; ``FORKD_TOKEN`` is sent as a bearer token when set.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from forkd.config import paths_from_env

LONG_TIMEOUT_S = 3600.0


class ForkdError(RuntimeError):
    """The daemon refused or failed a request; ``status`` and ``code`` say how."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class DaemonUnreachable(ForkdError):
    def __init__(self, where: str, reason: str) -> None:
        super().__init__(0, "unreachable", f"cannot reach the forkd daemon at {where}: {reason}")


def _client_for(url: str | None, token: str | None, timeout: float) -> tuple[httpx.Client, str]:
    url = url or os.environ.get("FORKD_URL") or f"unix://{paths_from_env().socket}"
    token = token or os.environ.get("FORKD_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if url.startswith("unix://"):
        socket_path = url[len("unix://"):]
        transport = httpx.HTTPTransport(uds=socket_path)
        return httpx.Client(transport=transport, base_url="http://forkd", headers=headers, timeout=timeout), url
    return httpx.Client(base_url=url, headers=headers, timeout=timeout), url


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        err = response.json().get("error", {})
        code, message = err.get("code", "error"), err.get("message", response.text)
    except (ValueError, AttributeError):
        code, message = "error", response.text
    raise ForkdError(response.status_code, code, message)


class Controller:
    """Synchronous client for the forkd REST API."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 120.0) -> None:
        self._http, self.url = _client_for(url, token, timeout)

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

    def stream(self, method: str, path: str, on_line: Callable[[dict[str, Any]], None] | None = None,
               **kwargs: Any) -> Any:
        """Send a request answered with NDJSON; pass every line to ``on_line``, return the ``result``."""
        try:
            with self._http.stream(method, path, timeout=LONG_TIMEOUT_S, **kwargs) as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                for line in self._lines(response.iter_lines()):
                    if "result" in line:
                        return line["result"]
                    if "error" in line:
                        err = line["error"]
                        raise ForkdError(500, err.get("code", "error"), err.get("message", ""))
                    if on_line is not None:
                        on_line(line)
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
        raise ForkdError(500, "truncated", "the daemon closed the stream without a result")

    @staticmethod
    def _lines(raw: Iterator[str]) -> Iterator[dict[str, Any]]:
        for text in raw:
            if text.strip():
                yield json.loads(text)

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

    def fork(self, tag: str, n: int = 1) -> dict[str, Any]:
        """``{"sandboxes": [...], "errors": [...]}``: a failed child does not fail the others."""
        return self.request("POST", "/v1/sandboxes", json={"snapshot_tag": tag, "n": n}, timeout=LONG_TIMEOUT_S)

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
             on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run a command; with ``on_event`` output is streamed as it arrives and the result has no stdout/stderr."""
        body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
        body.update({"env": env or {}, "timeout_s": timeout_s})
        if cwd is not None:
            body["cwd"] = cwd
        if stdin is not None:
            body["stdin"] = stdin
        path = f"/v1/sandboxes/{sandbox_id}/exec"
        if on_event is None:
            return self.request("POST", path, json=body, timeout=_call_timeout(timeout_s))
        return self.stream("POST", path, on_event, json={**body, "stream": True})

    def eval(self, sandbox_id: str, expr: str, context: str = "default") -> dict[str, Any]:
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/eval", json={"expr": expr, "context": context})

    def run_code(self, sandbox_id: str, code: str, context: str = "default",
                 timeout_s: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"code": code, "context": context}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return self.request("POST", f"/v1/sandboxes/{sandbox_id}/run_code", json=body,
                            timeout=_call_timeout(timeout_s))

    # files

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        try:
            response = self._http.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": path},
                                      timeout=LONG_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc)) from None
        _raise_for(response)
        return response.content

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int | None = None) -> dict[str, Any]:
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

    # branch

    def branch(self, sandbox_id: str, tag: str, mode: str = "diff", wait: bool = True) -> dict[str, Any]:
        """Save a running sandbox as snapshot ``tag`` (it keeps running); ``wait=False`` returns it ``writing``."""
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


def _progress(on_progress: Callable[[str], None] | None) -> Callable[[dict[str, Any]], None] | None:
    if on_progress is None:
        return None
    return lambda line: on_progress(str(line.get("progress", line)))


def _call_timeout(timeout_s: float | None) -> float:
    return LONG_TIMEOUT_S if timeout_s is None else timeout_s + 60.0
