"""Where the daemon is and how to talk to it: the one place the SDK reads ``FORKD_URL``, ``FORKD_TOKEN``
and ``FORKD_CA_CERT``, so the sync and the async clients (and the daemon autostart) cannot disagree.

``FORKD_URL`` is ``unix:///path/to/forkd.sock`` (default: the local daemon's socket) or
``http(s)://host:port``; ``FORKD_TOKEN`` is sent as a bearer token; ``FORKD_CA_CERT`` names the CA
bundle that signed a TLS daemon's certificate.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

from forkd.config import ConfigFileError, paths_from_env
from forkd.sdk.errors import InvalidArgumentException

DEFAULT_REQUEST_TIMEOUT_S = 120.0
UNIX_BASE_URL = "http://forkd"  # httpx needs a host; the socket path picks the daemon


def _local_socket() -> str:
    """This host's daemon's socket, as the daemon's config file and environment place it (forkd/config.py)."""
    try:
        return str(paths_from_env().socket)
    except ConfigFileError as exc:
        raise InvalidArgumentException(400, "invalid_request", str(exc)) from None


@dataclass(frozen=True)
class ConnectionConfig:
    """One daemon connection: ``url``, bearer ``token``, ``ca_cert`` bundle, per-request timeout."""

    url: str
    token: str | None = None
    ca_cert: str | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.url.startswith(("unix://", "http://", "https://")):
            raise InvalidArgumentException(400, "invalid_request", f"FORKD_URL must start with unix://, http:// "
                                                                   f"or https://, not {self.url!r}")
        if self.request_timeout <= 0:
            raise InvalidArgumentException(400, "invalid_request",
                                           f"request_timeout must be positive, not {self.request_timeout!r}")

    @classmethod
    def from_env(cls, url: str | None = None, token: str | None = None,
                 request_timeout: float | None = None) -> ConnectionConfig:
        """The environment's daemon; arguments that are not None win over it."""
        return cls(url=url or os.environ.get("FORKD_URL") or f"unix://{_local_socket()}",
                   token=token or os.environ.get("FORKD_TOKEN") or None,
                   ca_cert=os.environ.get("FORKD_CA_CERT") or None,
                   request_timeout=request_timeout or DEFAULT_REQUEST_TIMEOUT_S)

    @classmethod
    def resolve(cls, connection: ConnectionConfig | None = None, url: str | None = None,
                token: str | None = None) -> ConnectionConfig:
        """``connection`` (or the environment's) with the ``url=``/``token=`` keyword arguments applied."""
        if connection is None:
            return cls.from_env(url, token)
        return dataclasses.replace(connection, url=connection.url if url is None else url,
                                   token=connection.token if token is None else token)

    @property
    def socket(self) -> str | None:
        """The Unix socket path, or None for a TCP daemon."""
        return self.url[len("unix://"):] if self.url.startswith("unix://") else None

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"headers": {"Authorization": f"Bearer {self.token}"} if self.token else {},
                                   "timeout": self.request_timeout,
                                   "base_url": UNIX_BASE_URL if self.socket else self.url}
        if self.ca_cert and self.url.startswith("https://"):
            options["verify"] = ssl.create_default_context(cafile=self.ca_cert)
        return options

    def client(self) -> httpx.Client:
        """A sync HTTP client for this daemon (the ``Controller`` sends through it)."""
        transport = httpx.HTTPTransport(uds=self.socket) if self.socket else None
        return httpx.Client(transport=transport, **self._options())

    def async_client(self) -> httpx.AsyncClient:
        """An asyncio HTTP client for this daemon (the ``AsyncController`` sends through it)."""
        transport = httpx.AsyncHTTPTransport(uds=self.socket) if self.socket else None
        return httpx.AsyncClient(transport=transport, **self._options())
