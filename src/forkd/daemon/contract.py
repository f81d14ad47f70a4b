"""How the API describes itself to client generators and fuzzers: operation ids named after the operation,
one tag per resource, the bearer scheme, path parameter patterns and the errors each route can answer.

FastAPI derives most of the document from the routes; this module adds what it cannot know, in one place
(routes/ stay about behaviour). ``docs/openapi.json`` is rendered from the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute

from forkd.validation import SANDBOX_ID_PATTERN, TAG_PATTERN

#: Route module → tag (one per resource; `system` for health, metrics, version and host checks).
TAGS = {"system": "system", "images": "images", "snapshots": "snapshots", "branch": "snapshots",
        "packs": "packs", "sandboxes": "sandboxes", "commands": "commands", "contexts": "code contexts",
        "files": "files", "watches": "files", "workspaces": "workspaces", "pools": "pools", "node": "node"}
TAG_DESCRIPTIONS = {
    "system": "health, Prometheus metrics, version and host checks",
    "images": "guest images (kernel, initramfs, root filesystem) built from a spec",
    "snapshots": "saved, paused VMs children are forked from: create, BRANCH a sandbox, inspect, compact, diff, "
                 "remove",
    "packs": "snapshots as files: pack, unpack, pull, push",
    "sandboxes": "forked children: fork, list, inspect, kill, timeouts",
    "commands": "commands, processes and terminals (PTYs) inside a sandbox, and Python evaluated in its warm "
                "interpreter",
    "code contexts": "named Python interpreter contexts inside a sandbox",
    "files": "files inside a sandbox, and watching its directories",
    "workspaces": "long-lived named sandboxes that suspend to a snapshot and resume",
    "pools": "ready VMMs kept per snapshot tag",
    "node": "this daemon as a cluster node: capacity, layer chains, peer pulls, drain",
}

#: Where a function's own name would not say the operation (or would be used twice).
OPERATION_IDS = {
    ("GET", "/v1/images"): "list_images", ("GET", "/v1/snapshots"): "list_snapshots",
    ("GET", "/v1/snapshots/{tag}"): "get_snapshot", ("POST", "/v1/snapshots/compact"): "compact_snapshot",
    ("POST", "/v1/snapshots/diff"): "diff_snapshot", ("POST", "/v1/sandboxes/{sandbox_id}/branch"): "branch_sandbox",
    ("POST", "/v1/sandboxes"): "fork_sandboxes", ("DELETE", "/v1/sandboxes"): "kill_owned_sandboxes",
    ("POST", "/v1/sandboxes/{sandbox_id}/ping"): "ping_sandbox",
    ("POST", "/v1/sandboxes/{sandbox_id}/eval"): "eval_expression",
    ("GET", "/v1/node"): "get_node", ("GET", "/v1/node/chains/{digest}"): "get_chain",
    ("POST", "/v1/node/pull"): "pull_from_peer", ("POST", "/v1/node/drain"): "drain_node",
    ("DELETE", "/v1/node/drain"): "undrain_node",
    ("POST", "/v1/packs"): "create_pack", ("POST", "/v1/packs/unpack"): "unpack_pack",
    ("POST", "/v1/packs/pull"): "pull_pack", ("POST", "/v1/packs/push"): "push_pack",
    ("GET", "/healthz"): "get_health", ("GET", "/metrics"): "get_metrics", ("GET", "/v1/version"): "get_version",
    ("GET", "/v1/doctor"): "get_doctor",
}

#: Path parameter → the pattern the API accepts (the routes check it themselves, with their own message).
PATH_PATTERNS = {"sandbox_id": SANDBOX_ID_PATTERN, "tag": TAG_PATTERN, "name": TAG_PATTERN}

#: Request bodies a route reads itself (streamed), which FastAPI cannot see.
RAW_BODIES = {("PUT", "/v1/sandboxes/{sandbox_id}/files"): {
    "required": True, "description": "the file's bytes, streamed (no size limit but the guest's disk)",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

BEARER = {"bearer": {"type": "http", "scheme": "bearer",
                     "description": "needed on the TCP listener (`listen`); the Unix socket is guarded by its mode"}}
UNAUTHENTICATED = {"/healthz"}

# Every route: a bug (500), a token refused on TCP (401, but /healthz), a refused value (400) where there
# are values, and `default` for the rest (a connection cap's 503, ...). Then what each kind of route adds.
_SANDBOX = {404, 409, 502, 504}  # no such sandbox; it ended; its agent is gone; a guest call timed out
_EXTRA: dict[tuple[str, str], set[int]] = {
    ("POST", "/v1/sandboxes"): {404, 409, 503, 504, 507},
    ("POST", "/v1/sandboxes/{sandbox_id}/branch"): {503, 507},
    ("POST", "/v1/snapshots"): {404, 409, 503, 507},
    ("POST", "/v1/snapshots/compact"): {404, 409, 507},
    ("POST", "/v1/snapshots/diff"): {404, 409, 503, 504, 507},
    ("DELETE", "/v1/snapshots/{tag}"): {409},
    ("POST", "/v1/images"): {409, 507},
    ("DELETE", "/v1/images/{name}"): {409},
    ("POST", "/v1/packs"): {404, 409, 507},
    ("POST", "/v1/packs/unpack"): {404, 409, 507},
    ("POST", "/v1/packs/pull"): {404, 409, 502, 507},
    ("POST", "/v1/packs/push"): {404, 502},
    ("POST", "/v1/node/pull"): {404, 409, 502, 507},
    ("POST", "/v1/workspaces"): {404, 409, 503},
    ("POST", "/v1/workspaces/{name}/resume"): {409, 503},
    ("POST", "/v1/workspaces/{name}/suspend"): {409, 503, 507},
    ("DELETE", "/v1/workspaces/{name}"): {409},
    ("PUT", "/v1/pools/{tag}"): {409},
}


def operation_errors(method: str, path: str, operation: dict[str, Any]) -> set[int]:
    """The error statuses ``method path`` can answer (besides ``default``), from its parameters and body."""
    statuses = {500} | (set() if path in UNAUTHENTICATED else {401})
    if operation.get("parameters") or "requestBody" in operation:
        statuses.add(400)
    params = {param["name"] for param in operation.get("parameters", []) if param["in"] == "path"}
    if "sandbox_id" in params:
        statuses |= _SANDBOX
    if params & {"tag", "name", "digest", "context_id"}:
        statuses.add(404)
    if "requestBody" in operation:
        statuses.add(413)
    return statuses | _EXTRA.get((method, path), set())


def finish_document(document: dict[str, Any], routers: Iterable[APIRouter]) -> dict[str, Any]:
    """FastAPI's document with what it cannot derive: operation ids, tags, security, patterns, per-route errors.

    Done on the rendered document (not the routes), since the app-wide error answers are merged into each
    route only as the document is rendered."""
    names = {(method, route.path): route.name for router in routers for route in router.routes
             if isinstance(route, APIRoute) for method in route.methods or ()}
    modules = {(method, route.path): route.endpoint.__module__.rsplit(".", 1)[-1] for router in routers
               for route in router.routes if isinstance(route, APIRoute) for method in route.methods or ()}
    document.setdefault("components", {})["securitySchemes"] = BEARER
    document["security"] = [{"bearer": []}, {}]  # a token over TCP; none on the Unix socket
    document["tags"] = [{"name": name, "description": text} for name, text in TAG_DESCRIPTIONS.items()]
    for path, operations in document["paths"].items():
        for method_lower, operation in operations.items():
            method = method_lower.upper()
            operation["operationId"] = OPERATION_IDS.get((method, path), names[(method, path)])
            operation["tags"] = [TAGS[modules[(method, path)]]]
            if path in UNAUTHENTICATED:
                operation["security"] = []
            if (method, path) in RAW_BODIES:
                operation["requestBody"] = RAW_BODIES[(method, path)]
            for parameter in operation.get("parameters", []):
                pattern = PATH_PATTERNS.get(parameter["name"])
                if parameter["in"] == "path" and pattern and "pattern" not in parameter["schema"]:
                    parameter["schema"]["pattern"] = pattern
            keep = operation_errors(method, path, operation)
            operation["responses"] = {status: answer for status, answer in operation["responses"].items()
                                      if not status.isdigit() or int(status) < 400 or int(status) in keep}
    return document
