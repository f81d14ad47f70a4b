"""Credentials of the E2B front: API keys that name their owner, one access token per sandbox.

API keys look like E2B's (``e2b_`` and 40 hex digits), one per line in a key file (``#`` comments
allowed), each followed by its owner (a team) and optionally ``admin``::

    e2b_0123...  team-a            # sees and controls team-a's sandboxes, workspaces and forks
    e2b_4567...  ops  admin        # sees everything, REST-made objects included

A line holding only a key (the format before owners) is an admin key of the owner ``default``:
such a file was written for one operator whose key already controlled everything, so reading
it the old way keeps that deployment working; separation starts when keys name owners. The daemon
writes a file with one fresh admin key when the configured one does not exist, so a first start
needs no setup.

Access tokens are derived, not stored: an HMAC under a secret kept in ``FORKD_HOME`` of the
sandbox id and a nonce stored with the sandbox (a re-created name gets a new nonce, so a new
token). Every comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

KEY_PATTERN = re.compile(r"^e2b_[0-9a-f]{40}$")
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LEGACY_OWNER = "default"  # the owner of a key given without one (the old format): an admin key
MIN_SECRET_BYTES = 32


class CredentialsError(ValueError):
    """The key file or the token secret cannot be used; the message names the file and the fix."""


class KeyFileError(CredentialsError):
    """The key file cannot be read or holds a line that is not a key entry; the message names it."""


@dataclass(frozen=True)
class Principal:
    """Who an API key speaks for: an owner (team), and whether it may see every owner's objects."""

    owner: str
    admin: bool = False

    def sees(self, owner: str | None) -> bool:
        """Objects without an owner were made outside the E2B front (REST, CLI): admin keys only."""
        return self.admin or (owner is not None and owner == self.owner)


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


def new_secret() -> str:
    return secrets.token_hex(32)


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


def _entry(path: Path, number: int, fields: list[str]) -> tuple[str, Principal]:
    where = f"{path}:{number}"
    if not KEY_PATTERN.match(fields[0]):
        raise KeyFileError(f"{where}: not an E2B API key (e2b_ and 40 lowercase hex digits); make one with "
                           "`python3 -c 'import secrets; print(\"e2b_\" + secrets.token_hex(20))'`")
    if len(fields) == 1:
        return fields[0], Principal(LEGACY_OWNER, admin=True)
    if not OWNER_PATTERN.match(fields[1]):
        raise KeyFileError(f"{where}: the owner {fields[1]!r} must be 1-64 letters, digits, '.', '_' or '-'")
    if fields[2:] not in ([], ["admin"]):
        raise KeyFileError(f"{where}: a key line is `KEY OWNER` or `KEY OWNER admin`, not {' '.join(fields)!r}")
    return fields[0], Principal(fields[1], admin=fields[2:] == ["admin"])


def load_api_keys(path: Path, create: bool = True) -> dict[str, Principal]:
    """The keys in ``path`` with their principals; with ``create``, a missing file is first written
    with one new admin key."""
    if create and not path.exists():
        _write_private(path, "# E2B API keys accepted by forkd's E2B front: KEY OWNER [admin], one per line\n"
                             f"{new_api_key()} {LEGACY_OWNER} admin\n")
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise KeyFileError(f"cannot read the E2B key file {path}: {exc.strerror}") from None
    keys: dict[str, Principal] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        key, principal = _entry(path, number, fields)
        if keys.get(key, principal) != principal:
            raise KeyFileError(f"{path}:{number}: this key is listed before with another owner; give it one")
        keys[key] = principal
    if not keys:
        raise KeyFileError(f"the E2B key file {path} holds no key; add a line like `{new_api_key()} my-team`")
    return keys


def load_secret(path: Path) -> bytes:
    """The token secret in ``path`` (made on first use); one under 32 bytes is refused."""
    if not path.exists():
        _write_private(path, new_secret() + "\n")
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise CredentialsError(f"cannot read the E2B token secret {path}: {exc.strerror}") from None
    check_secret(secret, str(path))
    return secret


def check_secret(secret: bytes, where: str = "the E2B token secret") -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise CredentialsError(f"{where} holds {len(secret)} bytes; access tokens need a secret of at least "
                               f"{MIN_SECRET_BYTES}: delete the file to have a new one made, or write one with "
                               "`python3 -c 'import secrets; print(secrets.token_hex(32))'`")


class Credentials:
    """Finds the principal of an API key; derives and checks per-sandbox access tokens."""

    def __init__(self, api_keys: Mapping[str, Principal], secret: bytes) -> None:
        check_secret(secret)
        self._keys = [(key.encode(), principal) for key, principal in api_keys.items()]
        self._secret = secret

    @classmethod
    def load(cls, keys_file: Path, secret_file: Path, create_keys: bool = True) -> Credentials:
        """Keys from ``keys_file`` (made with one new key when missing and ``create_keys``); the token
        secret from ``secret_file``, made on first use."""
        return cls(load_api_keys(keys_file, create=create_keys), load_secret(secret_file))

    def principal(self, given: str | None) -> Principal | None:
        """The principal of API key ``given``; None for no or an unknown key."""
        encoded = (given or "").encode()
        found = None
        for key, principal in self._keys:  # every key compared, so the time says nothing about which
            if hmac.compare_digest(encoded, key):
                found = principal
        return found

    def access_token(self, sandbox_id: str, nonce: str) -> str:
        message = f"{sandbox_id}\n{nonce}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def access_token_valid(self, sandbox_id: str, nonce: str, given: str | None) -> bool:
        return hmac.compare_digest((given or "").encode(), self.access_token(sandbox_id, nonce).encode())
