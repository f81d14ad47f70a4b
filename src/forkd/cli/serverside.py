"""Commands that run on the daemon's host need ``forkd[daemon]``; without it they end saying so (exit 1).

``pip install forkd`` is the light client (the SDK, and the CLI against a daemon anywhere); ``forkd daemon``,
``forkd quickstart`` and ``forkd doctor``'s local host checks import the server side inside ``server_side``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click

from forkd.extras import MissingExtra, requiring


@contextlib.contextmanager
def server_side(what: str) -> Iterator[None]:
    """Imports inside need ``forkd[daemon]``; a missing one ends the command naming the extra to install."""
    try:
        with requiring("daemon", what):
            yield
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None
