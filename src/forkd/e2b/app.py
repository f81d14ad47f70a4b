"""The E2B front: one ASGI app for E2B's control plane and for the traffic to its sandboxes.

E2B's SDKs send everything for a sandbox to ``E2B_SANDBOX_URL`` with the ``E2b-Sandbox-Id`` and
``E2b-Sandbox-Port`` headers (49983: envd, 49999: the code interpreter); without that variable they
use a host name ``{port}-{sandboxID}.{domain}``, which is routed the same way. Everything else is
the control plane (``E2B_API_URL``). The control plane needs ``X-API-KEY`` and sees only its
owner's objects; every sandbox route but envd's ``/health`` needs the sandbox's token, as
``X-Access-Token`` (what the SDKs send envd) or ``E2B-Traffic-Access-Token`` (what they send the
code interpreter's context routes).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from forkd.e2b.control import PRINCIPAL_STATE, control_app
from forkd.e2b.envd import Envd
from forkd.e2b.errors import ConnectError, E2BError
from forkd.e2b.interpreter import Interpreter
from forkd.e2b.keys import Credentials
from forkd.e2b.lifecycle import ROUND_S, Keeper
from forkd.e2b.metrics import METRICS_S, Metrics
from forkd.e2b.ports import Ports
from forkd.e2b.sandboxes import E2BSandboxes
from forkd.e2b.snapshots import E2BSnapshots
from forkd.e2b.storage import Storage
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import LiveSandbox

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
OPEN_CONTROL_PATHS = frozenset({"/health", "/openapi.json"})
TOKEN_HEADERS = (b"x-access-token", b"e2b-traffic-access-token")
_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,64})\.")


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def sandbox_target(scope: dict[str, Any]) -> tuple[str, str] | None:
    """The (sandbox id, port) a request is for, from E2B's headers or its host name; None: control plane."""
    sandbox_id, port = _header(scope, b"e2b-sandbox-id"), _header(scope, b"e2b-sandbox-port")
    if sandbox_id is not None or port is not None:
        return sandbox_id or "", port or ""
    match = _HOST.match(_header(scope, b"host") or "")
    return (match.group(2), match.group(1)) if match else None


def is_upload(scope: dict[str, Any]) -> bool:
    """envd's file upload: the one E2B body that may be large (it streams to the guest)."""
    target = sandbox_target(scope)
    return target is not None and target[1] == str(ENVD_PORT) and scope["method"] == "POST" \
        and scope["path"] == "/files"


def is_stream(scope: dict[str, Any]) -> bool:
    """A client-streaming RPC: its body is typed input that may pause as long as its user does."""
    return sandbox_target(scope) is not None and scope["path"] == "/process.Process/StreamInput"


def refusal_shape(status: int, _: str, message: str) -> dict[str, Any]:
    """A refused body (too large, too slow) in E2B's HTTP error shape."""
    return {"code": status, "message": message}


COLLECT_S = 30.0  # how often unreferenced E2B layers are looked for


class E2BFront:
    def __init__(self, runtime: Runtime, credentials: Credentials, domain: str | None = None,
                 storage: Storage | None = None) -> None:
        self.credentials = credentials
        self.storage = storage or Storage(runtime)
        self.sandboxes = E2BSandboxes(runtime, credentials, self.storage, domain)
        self.snapshots = E2BSnapshots(self.sandboxes)
        self.metrics = Metrics(self.sandboxes)
        self.control = control_app(self.sandboxes, self.snapshots, self.metrics)
        # Started by the daemon (start/stop) once its runtime runs; tests call the rounds directly.
        self.keeper = Keeper({"pause": (ROUND_S, self.sandboxes.pause_due), "collect": (COLLECT_S, self.storage.collect),
                              "metrics": (METRICS_S, self.metrics.round), "locks": (COLLECT_S, self.sandboxes.prune_locks)})
        self.envd = Envd(runtime.sessions)
        self.interpreter = Interpreter(runtime.sessions)
        self.ports = Ports(runtime.tunnels)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            return  # no lifespan here: the daemon's main app owns the runtime's life
        target = sandbox_target(scope)
        if target is None:
            principal = self.credentials.principal(_header(scope, b"x-api-key"))
            if principal is not None or scope["path"] in OPEN_CONTROL_PATHS:
                await self.control({**scope, "state": {**scope.get("state", {}), PRINCIPAL_STATE: principal}},
                                   receive, send)
                return
            response: Response = JSONResponse(
                {"code": 401, "message": "Invalid API key: send X-API-KEY (E2B_API_KEY) with a key from the daemon's "
                                         "E2B key file"}, status_code=401)
        else:
            response = await self._sandbox(Request(scope, receive), *target)
        await response(scope, receive, send)

    async def _admit(self, scope: dict[str, Any], sandbox_id: str, port: str) -> LiveSandbox:
        """The running sandbox a request may reach: E2BError 401 without its token (a public sandbox's
        own ports and envd's ``/health`` need none), 502 when it is not running or the port is not one; a
        paused auto-resuming sandbox is resumed first (by a request carrying its token)."""
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise E2BError(502, f"The sandbox {sandbox_id} is running but port {port or '(none)'} is not open: "
                                "name a port 1-65535")
        tokens = [value.decode("latin-1") for key, value in scope["headers"] if key in TOKEN_HEADERS]
        system = port in (str(ENVD_PORT), str(INTERPRETER_PORT))
        if not tokens and not (port == str(ENVD_PORT) and scope["path"] == "/health") \
                and not (not system and self.sandboxes.public(sandbox_id)):
            raise E2BError(401, f"missing X-Access-Token for sandbox {sandbox_id}: use the envdAccessToken "
                                "the API returned when the sandbox was created or connected (E2B-Traffic-Access-Token "
                                "for its ports)")
        return await self.sandboxes.running(sandbox_id, tokens)

    async def _sandbox(self, request: Request, sandbox_id: str, port: str) -> Response:
        path = request.url.path
        rpc_call = path.count("/") == 2 and "." in path.split("/")[1]
        try:
            live = await self._admit(request.scope, sandbox_id, port)
        except E2BError as exc:
            if rpc_call and exc.status == 401:
                error = ConnectError("unauthenticated", exc.message)
                return JSONResponse(error.body(), status_code=error.status)
            return JSONResponse(exc.body(), status_code=exc.status)
        if port == str(ENVD_PORT):
            return await self.envd.handle(request, live)
        if port == str(INTERPRETER_PORT):
            return await self.interpreter.handle(request, live)
        return await self.ports.http(request, live.record.id, int(port))

    async def _websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A WebSocket to a sandbox's port; refused (HTTP 403 from the server) for anything else."""
        target = sandbox_target(scope)
        try:
            if target is None or target[1] in (str(ENVD_PORT), str(INTERPRETER_PORT)):
                raise E2BError(404, "WebSockets go to a sandbox's own ports only")
            live = await self._admit(scope, *target)
        except E2BError:
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.ports.websocket(scope, receive, send, live.record.id, int(target[1]))
