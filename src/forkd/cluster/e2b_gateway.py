"""One E2B endpoint over a forkd cluster (``forkd cluster e2b``, docs/e2b.md and docs/scale-out.md).

E2B's SDKs point ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` here. A create is placed on a node by the
cluster's directory (holders of the template's digest first, the most free slots next; replicated
first when no holder has room) and sent to that node's own E2B front; everything later for a sandbox
— control plane, envd files, Connect RPCs and their server streams, the code interpreter — is passed,
streamed both ways, to the node that runs it, whether the sandbox is named by E2B's headers or by a
``{port}-{sandboxID}.{domain}`` host name. Lists and templates are every alive node's, merged; each
node filters them by the API key's owner as it always does. The gateway holds no keys or tokens: the
nodes check them (every node must accept the same API keys). A sandbox on a node that died answers
that it was lost with that node.

Bounds, by route kind, so a node that hangs while Ray still counts it alive holds nothing for good:
every connection to a node must be made within ``CONNECT_S``. A control-plane call's answer must
come within ``CONTROL_S`` (a create restores its sandbox first); the short asks (which node has a
sandbox, its labels) within ``PROBE_S``. Sandbox traffic may be quiet for as long as it likes — a
command's stream is quiet between E2B's keepalives, a code cell may print nothing for minutes —
provided its node still answers: after ``IDLE_S`` without a byte, whether an answer's start or its
next chunk, the gateway asks the node's front for its health (once per node, however many streams
wait on it); a node that does not answer that within ``PROBE_S`` ends the request with an error in
E2B's shape: a 502 before the answer started, else an end-of-stream error in a Connect stream, an
``error`` line in a code cell's stream, a cut connection in a download. A request body the node
takes no byte of for ``WRITE_S`` ends the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd.cluster.e2b_view import ClusterView, Unplaceable
from forkd.cluster.placement import NodeState

log = logging.getLogger("forkd.cluster.e2b")
T = TypeVar("T")

ENVD_PORT = "49983"
_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,64})\.")  # E2B's sandbox host names: {port}-{id}.{domain}
_SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SANDBOX_PATH = re.compile(r"^/(?:v2/)?sandboxes/([A-Za-z0-9_-]{1,64})(?:/[a-z]+)?$")
_LISTS = ("/sandboxes", "/v2/sandboxes")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host"})
MAX_CONTROL_BODY = 1 << 20  # a control-plane request's JSON; larger bodies are refused here
MAX_FORK = 100  # children one fork may ask for (the nodes' own bound)
MAX_LIST_PAGES = 100  # pages of 1000 read from one node for a merged list
CONNECT_S = 5.0  # a node that accepts no connection in this long is unreachable
CONTROL_S = 120.0  # a control-plane call's answer (a create or a fork restores its sandboxes first)
PROBE_S = 10.0  # the short asks: a node's health, which node has a sandbox, a sandbox's labels
IDLE_S = 30.0  # sandbox traffic quiet this long: ask its node's health (the traffic itself may go on)
WRITE_S = 300.0  # a request body the node takes no byte of for this long (an upload's back-pressure allows that)


def _target(request: Request) -> tuple[str, str] | None:
    """The (sandbox id, port) sandbox traffic is for, by E2B's headers or host name; None: control plane."""
    sandbox_id, port = request.headers.get("e2b-sandbox-id"), request.headers.get("e2b-sandbox-port")
    if sandbox_id is not None or port is not None:
        return sandbox_id or "", port or ""
    match = _HOST.match(request.headers.get("host", ""))
    return (match.group(2), match.group(1)) if match else None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _headers(request: Request, target: tuple[str, str] | None = None) -> dict[str, str]:
    """The request's headers for a node; a host-name address becomes E2B's headers (the node's name
    differs). Sandbox traffic keeps its Content-Length (its body streams through as it is); the
    control plane's is counted again (a create's body is rewritten)."""
    headers = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP_BY_HOP and (target is not None or k.lower() != "content-length")}
    if target is not None:
        headers["e2b-sandbox-id"], headers["e2b-sandbox-port"] = target
    return headers


async def _bounded_body(request: Request) -> bytes | None:
    """The whole body, or None past ``MAX_CONTROL_BODY`` (read no further)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_CONTROL_BODY:
            return None
    return bytes(body)


def _has_body(request: Request) -> bool:
    return "content-length" in request.headers or "transfer-encoding" in request.headers


def _answer_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP}


class NodeSilent(httpx.TransportError):
    """A node kept a sandbox's request quiet and did not answer its health check either."""


def _stream_error(content_type: str, message: str) -> bytes | None:
    """The end of an answer already under way, in its own format: Connect's end-of-stream error, a code
    cell's ``error`` line; None where the format has no error (a download: its connection is cut)."""
    if content_type.startswith("application/connect+"):
        end = json.dumps({"error": {"code": "unavailable", "message": message}}).encode()
        return b"\x02" + len(end).to_bytes(4, "big") + end
    if content_type.startswith("application/x-ndjson"):
        lines = ({"type": "error", "name": "SandboxUnreachable", "value": message, "traceback": ""},
                 {"type": "unexpected_end_of_execution"})
        return b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return None


class Gateway:
    """The ASGI app. ``view`` is the cluster as the gateway sees it; ``client`` speaks to the nodes."""

    def __init__(self, view: ClusterView, control_s: float = CONTROL_S, idle_s: float = IDLE_S,
                 probe_s: float = PROBE_S) -> None:
        self.view = view
        # No cap on connections to the nodes: each is one client's request passed on (long-lived streams
        # included); a cap would queue health checks behind streams and read a busy node as a hung one.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(control_s, connect=CONNECT_S),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=20))
        self.idle_s, self.probe_s = idle_s, probe_s
        self._heard: dict[str, float] = {}  # Ray node id -> when its front last answered anything (monotonic)
        self._probes: dict[str, asyncio.Future[bool]] = {}  # health checks under way, one per node

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self._route(request)
        except Exception:  # answered in E2B's shape, never as a bare 500 page
            log.exception("%s %s failed", request.method, request.url.path)
            response = _error(500, "the forkd cluster's E2B gateway failed on this request; its log says why")
        await response(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.view.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await self.view.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, request: Request) -> Response:
        target = _target(request)
        if target is not None:
            return await self._sandbox_traffic(request, target)
        path, method = request.url.path, request.method
        if path == "/health":
            return JSONResponse({"ok": True, "nodes": len(self.view.fronts), "dead": self.view.dead_names()})
        if "x-api-key" not in request.headers:
            return _error(401, "Invalid API key: send X-API-KEY (E2B_API_KEY) with a key the cluster's nodes accept")
        if path in _LISTS and method == "POST":
            return await self._create(request)
        if path in _LISTS and method == "GET":
            return await self._list(request)
        if path == "/templates" and method == "GET":
            return await self._templates(request)
        if (match := _SANDBOX_PATH.match(path)) and path != "/sandboxes/metrics":  # E2B's, not a sandbox id
            return await self._control(request, match.group(1))
        # 501, never 404: both SDKs read a 404 as "sandbox not found"
        return _error(501, f"{method} {path} is not supported by this server (the forkd cluster's E2B gateway)")

    # sandbox traffic: envd and the code interpreter, streamed both ways

    async def _sandbox_traffic(self, request: Request, target: tuple[str, str]) -> Response:
        sandbox_id = target[0]
        if not _SANDBOX_ID.fullmatch(sandbox_id):
            return _error(502, f"The sandbox {sandbox_id[:64]!r} was not found: not a sandbox id")
        node = await self._locate(sandbox_id, request, control=False)
        if isinstance(node, Response):
            return node
        outgoing = self.client.build_request(request.method, f"{node.e2b_url}{request.url.path}",
                                             params=httpx.QueryParams(request.url.query),
                                             headers=_headers(request, target),
                                             content=request.stream() if _has_body(request) else None,
                                             timeout=httpx.Timeout(None, connect=CONNECT_S, write=WRITE_S))
        try:
            answer = await self._while_answering(node, self.client.send(outgoing, stream=True))
        except httpx.TransportError as exc:
            return await self._unreachable(node, sandbox_id, exc, control=False)
        return StreamingResponse(self._relay(node, sandbox_id, answer), status_code=answer.status_code,
                                 headers=_answer_headers(answer), background=BackgroundTask(answer.aclose))

    async def _relay(self, node: NodeState, sandbox_id: str, answer: httpx.Response) -> AsyncIterator[bytes]:
        """The node's answer as it comes, however quiet, while the node answers its health check."""
        chunks = answer.aiter_raw()
        while True:
            try:
                chunk = await self._while_answering(node, anext(chunks))
            except StopAsyncIteration:
                return
            except NodeSilent as exc:
                log.warning("ending a %s answer for sandbox %s: %s", answer.headers.get("content-type"), sandbox_id, exc)
                end = _stream_error(answer.headers.get("content-type", ""), str(exc))
                if end is None:
                    raise  # no error this format can carry: the client sees its answer cut short
                yield end
                return
            yield chunk

    async def _while_answering(self, node: NodeState, step: Awaitable[T]) -> T:
        """``step`` (a node's answer or its next chunk), however long it takes, unless the node goes
        quiet for ``idle_s`` and then fails its health check (``NodeSilent``: ``step`` is cancelled)."""
        task = asyncio.ensure_future(step)
        try:
            while not (await asyncio.wait({task}, timeout=self.idle_s))[0]:
                if not await self._answers(node):
                    raise NodeSilent(f"node {node.node_id} went quiet for {self.idle_s:.0f} s and did not answer "
                                     f"its health check within {self.probe_s:.0f} s; try again")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._heard[node.ray_node_id] = time.monotonic()
        return task.result()

    async def _answers(self, node: NodeState) -> bool:
        """Whether ``node``'s front answers at all (any status): heard from within ``idle_s``, else one
        health check, shared by every request waiting on that node."""
        if time.monotonic() - self._heard.get(node.ray_node_id, float("-inf")) < self.idle_s:
            return True
        probe = self._probes.get(node.ray_node_id)
        if probe is None:
            probe = self._probes[node.ray_node_id] = asyncio.ensure_future(self._health(node))
            probe.add_done_callback(lambda _: self._probes.pop(node.ray_node_id, None))
        return await asyncio.shield(probe)

    async def _health(self, node: NodeState) -> bool:
        try:
            await self.client.get(f"{node.e2b_url}/health", timeout=httpx.Timeout(self.probe_s, connect=CONNECT_S))
        except httpx.TransportError:
            return False
        self._heard[node.ray_node_id] = time.monotonic()
        return True

    # the control plane

    async def _control(self, request: Request, sandbox_id: str) -> Response:
        node = await self._locate(sandbox_id, request, control=True)
        if isinstance(node, Response):
            return node
        body = await _bounded_body(request)
        if body is None:
            return _error(413, f"a control-plane request's body is at most {MAX_CONTROL_BODY} bytes")
        try:
            if request.method == "POST" and request.url.path.endswith("/fork"):
                return await self._fork(request, sandbox_id, node, body)
            answer = await self._send(node, request, body)
        except httpx.TransportError as exc:
            return await self._unreachable(node, sandbox_id, exc, control=True)
        if request.method == "DELETE" and answer.status_code in (204, 404):
            self.view.forget(sandbox_id)
        return Response(answer.content, status_code=answer.status_code, headers=_answer_headers(answer))

    async def _fork(self, request: Request, sandbox_id: str, home: NodeState, body: bytes) -> Response:
        """E2B's fork: BRANCH and children on the parent's node, as far as its free slots go; the rest
        spill to other nodes, the branch replicated to them first. One result per child, in E2B's shape."""
        try:
            spec = json.loads(body or b"{}")
            count = int(spec.get("count", 1)) if isinstance(spec, dict) else 0
        except (ValueError, TypeError):
            spec, count = None, 0
        free = await self.view.free_slots(home)
        here = min(count, free) if count > 0 and free > 0 else count
        if not isinstance(spec, dict) or here == count or count > MAX_FORK:  # all at home, or the node refuses it
            answer = await self._send(home, request, body)
            return self._forked(answer, home, [])
        answer = await self._send(home, request, json.dumps({**spec, "count": here}).encode())
        if answer.status_code != 201:
            return self._forked(answer, home, [])
        tag = next((r["sandbox"].get("templateID") for r in answer.json() if isinstance(r.get("sandbox"), dict)), None)
        places = await self.view.spill(str(tag), home, count - here) if tag else []
        metadata = await self._metadata(home, sandbox_id, request.headers["x-api-key"])
        create = {"templateID": "", **({"timeout": spec["timeout"]} if "timeout" in spec else {}),
                  **({"metadata": metadata} if metadata else {})}

        async def start(node: NodeState, local_tag: str) -> dict[str, Any]:
            try:
                made = await self.client.post(f"{node.e2b_url}/sandboxes", json={**create, "templateID": local_tag},
                                              headers={"x-api-key": request.headers["x-api-key"]})
            except httpx.TransportError as exc:
                return {"error": {"code": 502, "message": f"node {node.node_id} did not answer: {exc}"}}
            if made.status_code != 201:
                return {"error": {"code": made.status_code, "message": made.text[:500]}}
            self.view.remember(str(made.json().get("sandboxID")), node)
            return {"sandbox": {**made.json(), "templateID": tag}}

        spilled = list(await asyncio.gather(*(start(node, local_tag) for node, local_tag in places)))
        spilled += [{"error": {"code": 503, "message": f"no node of the cluster has a free slot for this fork of "
                                                       f"{sandbox_id}"}}] * (count - here - len(places))
        return self._forked(answer, home, spilled)

    async def _metadata(self, node: NodeState, sandbox_id: str, key: str) -> dict[str, str] | None:
        """The sandbox's own labels (a fork's children on other nodes carry them too)."""
        try:
            described = await self.client.get(f"{node.e2b_url}/sandboxes/{sandbox_id}", headers={"x-api-key": key},
                                              timeout=httpx.Timeout(self.probe_s, connect=CONNECT_S))
        except httpx.TransportError:
            return None
        return described.json().get("metadata") if described.status_code == 200 else None

    def _forked(self, answer: httpx.Response, home: NodeState, spilled: list[dict[str, Any]]) -> Response:
        if answer.status_code != 201:
            return Response(answer.content, status_code=answer.status_code, headers=_answer_headers(answer))
        results = [r for r in answer.json() if isinstance(r, dict)]
        for result in results:
            if isinstance(result.get("sandbox"), dict):
                self.view.remember(str(result["sandbox"].get("sandboxID")), home)
        return JSONResponse(results + spilled, status_code=201)

    async def _send(self, node: NodeState, request: Request, body: bytes,
                    params: httpx.QueryParams | None = None) -> httpx.Response:
        return await self.client.request(request.method, f"{node.e2b_url}{request.url.path}",
                                         params=httpx.QueryParams(request.url.query) if params is None else params,
                                         headers=_headers(request), content=body)

    async def _create(self, request: Request) -> Response:
        body = await _bounded_body(request)
        if body is None:
            return _error(413, f"a create's body is at most {MAX_CONTROL_BODY} bytes")
        try:
            spec = json.loads(body or b"{}")
        except ValueError:
            return _error(400, "the body is not JSON: send E2B's NewSandbox ({\"templateID\": ...})")
        template = spec.get("templateID") if isinstance(spec, dict) else None
        if not isinstance(template, str) or not template:
            return _error(400, "templateID: a template (a forkd snapshot's tag or digest) is required")
        try:
            candidates = await self.view.place(template)
        except Unplaceable as exc:
            return _error(exc.status, exc.message)
        refusals = []
        for node, local_tag in candidates:
            try:
                answer = await self._send(node, request, json.dumps({**spec, "templateID": local_tag}).encode())
            except httpx.TransportError as exc:
                refusals.append(f"{node.node_id}: did not answer ({exc})")
                await self.view.full(node)
                continue
            if answer.status_code in (429, 503) or answer.status_code >= 500:  # full, draining, broken: next node
                refusals.append(f"{node.node_id}: {answer.status_code} {answer.text[:200]}")
                await self.view.full(node)
                continue
            if answer.status_code != 201:
                return Response(answer.content, status_code=answer.status_code, headers=_answer_headers(answer))
            created = answer.json()
            self.view.remember(str(created.get("sandboxID")), node)
            return JSONResponse({**created, "templateID": template}, status_code=201)
        return _error(503, f"no node could start a sandbox of {template!r}: {'; '.join(refusals)}")

    async def _list(self, request: Request) -> Response:
        v2 = request.url.path.startswith("/v2/")
        params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("limit", "nextToken")]
        nodes = self.view.fronts
        answers = await asyncio.gather(*(self._list_node(node, request, params, v2) for node in nodes))
        found: list[dict[str, Any]] = []
        for node, listed in zip(nodes, answers):
            if isinstance(listed, Response):
                return listed  # the nodes refused the key (401) or the query
            for sandbox in listed:
                self.view.remember(str(sandbox.get("sandboxID")), node)
                found.append(sandbox)
        if not v2:
            return JSONResponse(found)
        found.sort(key=lambda s: str(s.get("startedAt")), reverse=True)
        try:
            start, limit = int(request.query_params.get("nextToken") or 0), int(request.query_params.get("limit") or 100)
        except ValueError:
            return _error(400, "nextToken and limit are numbers")
        if not (start >= 0 and 1 <= limit <= 1000):
            return _error(400, "limit: 1-1000; nextToken: what the last page's X-Next-Token said")
        headers = {"X-Total-Running": str(sum(1 for s in found if s.get("state") == "running"))}
        if start + limit < len(found):
            headers["X-Next-Token"] = str(start + limit)
        return JSONResponse(found[start:start + limit], headers=headers)

    async def _list_node(self, node: NodeState, request: Request, params: list[tuple[str, str]],
                         v2: bool) -> list[dict[str, Any]] | Response:
        """One node's whole list (every page of a /v2 list); a node that does not answer lists nothing."""
        listed: list[dict[str, Any]] = []
        token = None
        for _ in range(MAX_LIST_PAGES):
            page = params + ([("limit", "1000")] if v2 else []) + ([("nextToken", token)] if token else [])
            try:
                answer = await self._send(node, request, b"", params=httpx.QueryParams(tuple(page)))
            except httpx.TransportError as exc:
                log.warning("node %s did not answer a list (%s); its sandboxes are left out", node.node_id, exc)
                return listed
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code, headers=_answer_headers(answer))
            listed += [s for s in answer.json() if isinstance(s, dict)]
            token = answer.headers.get("x-next-token") if v2 else None
            if not token:
                break
        return listed

    async def _templates(self, request: Request) -> Response:
        merged: dict[str, Any] = {}
        for node in self.view.fronts:
            try:
                answer = await self._send(node, request, b"")
            except httpx.TransportError:
                continue
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code, headers=_answer_headers(answer))
            for template in answer.json():
                merged.setdefault(str(template.get("templateID")), template)
        return JSONResponse(list(merged.values()))

    # where a sandbox runs

    async def _locate(self, sandbox_id: str, request: Request, control: bool) -> NodeState | Response:
        """The node running ``sandbox_id``: the one it was created on or listed by, else the alive node
        that says it has it; a dead node's answer is that the sandbox was lost with it."""
        node = self.view.route(sandbox_id)
        if node is None:
            node = await self._ask_nodes(sandbox_id, request, control)
        if node is not None and node.alive:
            return node
        if node is not None:
            return self._lost(sandbox_id, self.view.lost(node), control)
        dead = self.view.dead_names()
        why = f"no alive node has it{' (node(s) ' + ', '.join(dead) + ' died with their sandboxes)' if dead else ''}"
        return _error(404, f"sandbox {sandbox_id} was not found: {why}") if control else \
            _error(502, f"The sandbox {sandbox_id} was not found: {why}")

    async def _ask_nodes(self, sandbox_id: str, request: Request, control: bool) -> NodeState | None:
        """Ask every alive front for the sandbox: the control plane's describe with the caller's key
        (paused sandboxes too), else envd's token-free health check (running ones)."""
        probe = httpx.Timeout(self.probe_s, connect=CONNECT_S)

        async def has(node: NodeState) -> bool:
            try:
                if control:
                    answer = await self.client.get(f"{node.e2b_url}/sandboxes/{sandbox_id}", timeout=probe,
                                                   headers={"x-api-key": request.headers["x-api-key"]})
                else:
                    answer = await self.client.get(f"{node.e2b_url}/health", timeout=probe, headers={
                        "e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": ENVD_PORT})
            except httpx.TransportError:
                return False
            return answer.status_code < 300
        nodes = self.view.fronts
        found = [node for node, yes in zip(nodes, await asyncio.gather(*map(has, nodes))) if yes]
        if found:
            self.view.remember(sandbox_id, found[0])
            return found[0]
        return None

    async def _unreachable(self, node: NodeState, sandbox_id: str, exc: Exception, control: bool) -> Response:
        if await self.view.settle(node):
            return self._lost(sandbox_id, self.view.lost(node), control)
        return _error(502, f"node {node.node_id}, which runs sandbox {sandbox_id}, did not answer ({exc}); "
                           "try again")

    @staticmethod
    def _lost(sandbox_id: str, why: str, control: bool) -> JSONResponse:
        """A sandbox of a dead node: 410 on the control plane (the SDKs put their own words on a 404,
        but show this message), the proxy's 502 "was not found" for its traffic (which the SDKs raise
        as their not-running error, with this message)."""
        if control:
            return _error(410, f"sandbox {sandbox_id} is gone: {why}")
        return _error(502, f"The sandbox {sandbox_id} was not found: {why}")
