"""The OpenAPI document of the REST API, as the daemon serves it at ``/openapi.json``.

``python -m forkd.daemon.openapi > docs/openapi.json`` refreshes the copy kept in the repository;
a unit test fails when the two differ, so the published contract cannot drift from the code.
"""

from __future__ import annotations

import json
from typing import Any

from forkd.daemon.app import create_app


def document() -> dict[str, Any]:
    """The schema of the daemon's app, rendered without a runtime (no state directory, no VMM)."""
    return create_app().openapi()


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
