"""Credentials of the E2B front: API keys for the control plane, one access token per sandbox.

API keys look like E2B's (``e2b_`` and 40 hex digits), one per line in a key file (``#`` comments
allowed); the daemon writes a file with one fresh key when the configured one does not exist, so
a first start needs no setup. Access tokens are derived, not stored: an HMAC of the sandbox id
under a secret kept in ``FORKD_HOME``, so a token stays valid across pause/resume and daemon
restarts and a leaked token opens one sandbox only. Every comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

KEY_PATTERN = re.compile(r"^e2b_[0-9a-f]{40}$")


class KeyFileError(ValueError):
    """The key file cannot be read or holds a line that is not an API key; the message names it."""


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` mode 0600 atomically (never world-readable, never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.link(temporary, path)  # fails if another process created it meanwhile: theirs wins
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)


def load_api_keys(path: Path, create: bool = True) -> frozenset[str]:
    """The keys in ``path``; with ``create``, a missing file is first written with one new key."""
    if create and not path.exists():
        _write_private(path, f"# E2B API keys accepted by forkd's E2B front, one per line\n{new_api_key()}\n")
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise KeyFileError(f"cannot read the E2B key file {path}: {exc.strerror}") from None
    keys = set()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not KEY_PATTERN.match(line):
            raise KeyFileError(f"{path}:{number}: not an E2B API key (e2b_ and 40 lowercase hex digits); "
                               "make one with `python3 -c 'import secrets; print(\"e2b_\" + secrets.token_hex(20))'`")
        keys.add(line)
    if not keys:
        raise KeyFileError(f"the E2B key file {path} holds no key; add a line like {new_api_key()}")
    return frozenset(keys)


class Credentials:
    """Checks API keys and derives/checks per-sandbox access tokens."""

    def __init__(self, api_keys: frozenset[str], secret: bytes) -> None:
        self._keys = [key.encode() for key in api_keys]
        self._secret = secret

    @classmethod
    def load(cls, keys_file: Path, secret_file: Path, create_keys: bool = True) -> Credentials:
        """Keys from ``keys_file`` (made with one new key when missing and ``create_keys``); the token
        secret from ``secret_file``, made on first use."""
        if not secret_file.exists():
            _write_private(secret_file, secrets.token_hex(32) + "\n")
        secret = secret_file.read_text().strip().encode()
        return cls(load_api_keys(keys_file, create=create_keys), secret)

    def api_key_valid(self, given: str | None) -> bool:
        encoded = (given or "").encode()
        return any([hmac.compare_digest(encoded, key) for key in self._keys])  # every key compared

    def access_token(self, sandbox_id: str) -> str:
        return hmac.new(self._secret, sandbox_id.encode(), hashlib.sha256).hexdigest()

    def access_token_valid(self, sandbox_id: str, given: str | None) -> bool:
        return hmac.compare_digest((given or "").encode(), self.access_token(sandbox_id).encode())
