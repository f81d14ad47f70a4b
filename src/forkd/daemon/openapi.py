"""The OpenAPI document of the REST API, as the daemon serves it at ``/openapi.json``.

``python -m forkd.daemon.openapi > docs/openapi.json`` refreshes the copy kept in the repository;
a unit test fails when the two differ, so the published contract cannot drift from the code.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.daemon.app import create_app
from forkd.runtime.runtime import Runtime
from forkd.vmm.backends import BackendOptions, create_vmm


def document() -> dict[str, Any]:
    """The schema of a daemon app (its runtime is only constructed, never started)."""
    with tempfile.TemporaryDirectory(prefix="forkd-openapi-") as scratch:
        root = Path(scratch)
        runtime = Runtime(Paths(home=root / "home", cache=root / "cache", socket=root / "sock"),
                          create_vmm(options=BackendOptions(accelerator="tcg")))
        try:
            return create_app(runtime).openapi()
        finally:
            runtime.registry.close()


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
