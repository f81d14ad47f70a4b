"""Which optional parts of forkd are installed: ``pip install forkd`` is the client only (SDK and CLI);
``forkd[daemon]`` adds the server side, ``forkd[mcp]`` the MCP server.

A command that needs a part this install lacks says which extra to install instead of failing with a
bare ``ModuleNotFoundError``. Stdlib only: every room may use it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

#: Top-level modules of each extra's packages (import names, not distribution names).
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "daemon": frozenset({"fastapi", "starlette", "uvicorn", "qemu", "prometheus_client", "zstandard", "pyroute2",
                         "python_multipart", "wsproto"}),
    "mcp": frozenset({"mcp", "mcp_types", "uvicorn"}),
}


class MissingExtra(ImportError):
    """Something here needs an extra this install lacks; the message says what to install."""

    def __init__(self, extra: str, what: str, module: str) -> None:
        super().__init__(f"{what} needs the server side of forkd, which this install lacks ({module} is missing): "
                         f"pip install 'forkd[{extra}]'")
        self.extra = extra


def installed(extra: str) -> bool:
    """Whether every module of ``extra`` can be imported here (without importing any)."""
    return all(importlib.util.find_spec(module) is not None for module in EXTRA_MODULES[extra])


def extra_of(module: str | None) -> str | None:
    """The extra that provides ``module`` (a dotted name), or None if no extra does."""
    top = (module or "").split(".")[0]
    return next((extra for extra, modules in EXTRA_MODULES.items() if top in modules), None)


@contextlib.contextmanager
def requiring(extra: str, what: str) -> Iterator[None]:
    """Imports inside raise ``MissingExtra`` (naming ``forkd[extra]``) when a module of an extra is missing."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if extra_of(exc.name) is None:
            raise
        raise MissingExtra(extra_of(exc.name) or extra, what, str(exc.name)) from None
