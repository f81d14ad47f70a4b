"""The daemon's node API (docs/scale-out.md, ``GET /v1/node``, peer pulls, forks by digest) as the cluster uses it.

Each call goes through the SDK's ``Controller`` (its connection, token, errors); this module only names
the paths and bodies of the node routes, so the rest of the cluster never spells a URL.
"""

from __future__ import annotations

from typing import Any

from forkd.sdk.controller import Controller, ForkdError

PULL_TIMEOUT_S = 3600.0  # a chain of GiB over a slow link; the daemon bounds the transfer itself


def node(controller: Controller) -> dict[str, Any]:
    """The node's identity, compatibility key, capacity and the snapshots it holds."""
    return controller.request("GET", "/v1/node")  # type: ignore[no-any-return]


def pull(controller: Controller, digest: str, source: str, source_token: str | None) -> dict[str, Any]:
    """Make the node pull the chain ending at ``digest`` from peer ``source`` (idempotent)."""
    return controller.request("POST", "/v1/node/pull", json={"digest": digest, "source": source,  # type: ignore[no-any-return]
                                                             "source_token": source_token},
                              timeout=PULL_TIMEOUT_S)


def fork(controller: Controller, digest: str, n: int, *, idempotency_key: str, owner: str,
         timeout_s: float | None) -> list[str]:
    """Fork ``n`` children of ``digest``; a retry with the same key answers the same children.
    Raises when none started; fewer than ``n`` is the caller's to count."""
    body: dict[str, Any] = {"snapshot_digest": digest, "n": n, "idempotency_key": idempotency_key, "owner": owner}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    answer = controller.request("POST", "/v1/sandboxes", json=body, timeout=PULL_TIMEOUT_S)
    children = [str(child["id"]) for child in answer.get("sandboxes", [])]
    if not children:
        raise ForkdError(500, "fork_failed", "; ".join(map(str, answer.get("errors", [])))
                         or f"the daemon at {controller.url} started no sandbox of {digest[:12]}")
    return children


def owned(controller: Controller, owner: str) -> list[dict[str, Any]]:
    """The children of ``owner`` on this node."""
    answer = controller.request("GET", "/v1/sandboxes", params={"owner": owner})
    return list(answer.get("sandboxes", []))


def kill_owner(controller: Controller, owner: str) -> list[str]:
    """Kill every child of ``owner`` on this node (the reaper for a driver that went away)."""
    return list(controller.request("DELETE", "/v1/sandboxes", params={"owner": owner}).get("killed", []))
