"""Moving packs over the network: streamed downloads checked against an advertised digest, and uploads.

A download never trusts the server's word: it stops as soon as it holds more bytes than were
advertised, and the whole file's SHA-256 must equal the advertised one before anything unpacks
it. Presigned URLs carry credentials in their query string, so only the scheme, host and path of
a URL are ever shown.

Network URLs are http(s) only, to the hosts of the daemon's allow-list when it has one
(``[transfers] allow_hosts``). A host name is resolved once per request, every address it resolves
to must be public (not loopback, link-local such as cloud metadata, private, shared or reserved)
unless the allow-list names the host itself (not by a ``*`` pattern), and the request connects to
that address (its ``Host`` header and TLS name stay the URL's): a second lookup, which a rebinding
DNS server could answer differently, is never made. A redirect is followed only to the same scheme
and an allowed host, and each hop is checked like the first URL; an upload follows none. No body
is read whole before its size is checked, and a remote's answer is never put in an error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import ipaddress
import os
import socket
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urljoin, urlsplit, urlunsplit

import httpx

from forkd.packs.archive import CHUNK, Progress
from forkd.packs.meter import Meter
from forkd.packs.format import MAX_FILE_BYTES, PackError

HTTP_TIMEOUT = httpx.Timeout(60.0, read=300.0)
NETWORK_SCHEMES = ("http", "https")
MAX_REDIRECTS = 5
# A download whose size nobody advertised stops here (a pinned digest would only fail after it all).
MAX_UNSIZED_BYTES = 64 << 30


@dataclass(frozen=True)
class UrlPolicy:
    """Which network URLs the daemon fetches from or uploads to."""

    allow_hosts: tuple[str, ...] | None = None  # host names or ``*.example.com`` patterns; None: any host
    # Peers are forkd nodes of one cluster, on its own (often private) network: a peer pull reaches
    # only forkd's node API there, and its answers are parsed, never shown.
    private_ok: bool = False

    def check(self, url: str) -> str:
        """``url`` if it is http(s) to an allowed host, else :class:`PackError` saying what is accepted."""
        parts = _split(url)
        if parts.scheme not in NETWORK_SCHEMES or not parts.hostname:
            raise PackError(f"{shown(url)!r} is not an http(s) URL: the daemon fetches and uploads over http(s) only")
        host = parts.hostname.lower()
        if self.allow_hosts is not None and not any(fnmatch.fnmatchcase(host, p.lower()) for p in self.allow_hosts):
            raise PackError(f"host {host!r} is not in the daemon's transfer allow-list ({', '.join(self.allow_hosts)}); "
                            "add it to `[transfers] allow_hosts` in the daemon's config to use it")
        return url

    def names(self, host: str) -> bool:
        """The allow-list names ``host`` itself (a pattern does not count): it may be a private address."""
        return self.allow_hosts is not None and host.lower() in (h.lower() for h in self.allow_hosts)

    async def address(self, url: str) -> str:
        """The address a request to ``url`` connects to: its host resolved once, every answer public
        unless the host is named in the allow-list (or this policy is a peer's)."""
        parts = _split(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            answers = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise PackError(f"cannot resolve the host of {shown(url)}: {exc}") from None
        addresses = [ipaddress.ip_address(str(answer[4][0]).split("%")[0]) for answer in answers]
        if not addresses:
            raise PackError(f"the host of {shown(url)} resolves to no address")
        if not (self.private_ok or self.names(host)):
            for address in addresses:
                if not _public(address):
                    raise PackError(
                        f"{host!r} resolves to {address}, a {_kind(address)} address: the daemon reaches only "
                        "public addresses unless `[transfers] allow_hosts` in its config names the host itself "
                        f"(add {host!r} there to pull from or push to it)")
        return str(addresses[0])


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def _kind(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for kind in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return "non-public"


def _pinned(client: httpx.AsyncClient, method: str, url: str, address: str,
            headers: dict[str, str] | None = None, **options: object) -> httpx.Request:
    """A request for ``url`` sent to ``address``: the URL's host goes in the Host header and, over
    https, in the TLS server name the certificate is checked against."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + host + (f":{parts.port}" if parts.port is not None else "")
    original = parts.netloc.rpartition("@")[2]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return client.build_request(method, urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")),
                                headers={**(headers or {}), "Host": original}, extensions=extensions,
                                **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def fetch(url: str, policy: UrlPolicy, headers: dict[str, str] | None = None) -> AsyncIterator[httpx.Response]:
    """GET ``url`` as a stream, following redirects only where ``policy`` and the first URL's scheme allow.

    ``headers`` (a peer's bearer token) go only to the first URL's origin, never along a redirect elsewhere.
    """
    first = urlsplit(policy.check(url))
    scheme, origin = first.scheme, first.netloc
    # No proxy from the environment: the request must go to the address just checked.
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            same_origin = urlsplit(url).netloc == origin
            address = await policy.address(url)
            response = await client.send(_pinned(client, "GET", url, address, headers if same_origin else None),
                                         stream=True)
            try:
                if not response.is_redirect:
                    yield response
                    return
                target = urljoin(url, response.headers.get("location", ""))
            finally:
                await response.aclose()
            if urlsplit(target).scheme != scheme:
                raise PackError(f"{shown(url)} redirects to another scheme ({shown(target)!r}); refused")
            url = policy.check(target)
        raise PackError(f"{shown(url)} redirects more than {MAX_REDIRECTS} times; refused")


async def read_limited(response: httpx.Response, limit: int, what: str) -> bytes:
    """The body of ``response``, refused as soon as it is known to exceed ``limit`` bytes."""
    announced = response.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise PackError(f"{what} is larger than {limit} bytes")
    body = bytearray()
    async for chunk in response.aiter_bytes(CHUNK):
        body += chunk
        if len(body) > limit:
            raise PackError(f"{what} is larger than {limit} bytes")
    return bytes(body)


def _split(url: str) -> SplitResult:
    """``url``'s parts, refused here when the HTTP client could not send it (control characters, a host name
    that is not IDNA), so a bad URL from a request is a 400 and never an exception deep in a transfer."""
    try:
        httpx.URL(url)
        return urlsplit(url)
    except (ValueError, httpx.InvalidURL) as exc:  # an unbalanced IPv6 bracket, a control character, say
        raise PackError(f"{shown(url)!r} is not a valid URL: {exc}") from None


def shown(url: str) -> str:
    """``url`` without its query string and credentials (a presigned URL's signature stays private)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an invalid URL)"
    if not parts.scheme:
        return url
    host = parts.hostname or ""
    with contextlib.suppress(ValueError):  # a port out of range is left out
        host = f"[{host}]" if ":" in host else host
        host += f":{parts.port}" if parts.port is not None else ""
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def local_path(url: str) -> Path | None:
    """The file a ``file://`` URL or an absolute path names; ``None`` for a network URL."""
    parts = _split(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise PackError(f"file URL {url!r} names another host; use file:///absolute/path")
        return Path(unquote(parts.path))
    if parts.scheme in ("http", "https"):
        return None
    if url.startswith("/"):
        return Path(url)
    raise PackError(f"cannot fetch {shown(url)!r}: use an http(s):// or file:// URL or an absolute path")


def check_regular_file(path: Path) -> None:
    """Refuse anything but an existing regular file at an absolute path (a FIFO or device could block)."""
    if not path.is_absolute():
        raise PackError(f"pack {path} must be an absolute path on the daemon's host")
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise PackError(f"{path} is not a regular file")
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise PackError(f"cannot read pack {path}: {getattr(exc, 'strerror', None) or exc}") from None


def check_advertised(path: Path, sha256: str | None, size: int | None, progress: Progress) -> str:
    """Hash a local file and compare it with what was advertised; returns its SHA-256."""
    check_regular_file(path)
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        raise PackError(f"{path} holds {actual_size} bytes, {size} were advertised")
    meter = Meter(progress, "checked", actual_size)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            meter.advance(len(chunk))
    return _compare(digest.hexdigest(), sha256, shown(str(path)))


async def download(url: str, destination: Path, sha256: str | None, size: int | None, progress: Progress,
                   policy: UrlPolicy = UrlPolicy(), written: Callable[[int], None] = lambda _n: None) -> str:
    """Stream ``url`` into ``destination``; refuses more bytes than advertised or another digest.
    ``written`` is told each chunk's size as it lands (a free-space watch may raise to stop it)."""
    limit = size if size is not None else min(MAX_FILE_BYTES, MAX_UNSIZED_BYTES)
    digest = hashlib.sha256()
    received = 0
    try:
        async with fetch(url, policy) as response:
            if response.status_code != 200:
                raise PackError(f"downloading {shown(url)} failed: HTTP {response.status_code}")
            announced = response.headers.get("content-length")
            meter = Meter(progress, "downloaded", size or int(announced or 0))
            with open(destination, "xb") as out:
                async for chunk in response.aiter_bytes(CHUNK):
                    received += len(chunk)
                    if received > limit:
                        raise PackError(f"{shown(url)} sent more than the {limit} bytes advertised; refused"
                                        if size is not None else
                                        f"{shown(url)} sent more than {limit} bytes and no size was advertised; "
                                        "refused (pull it through an index entry, which gives its size)")
                    digest.update(chunk)
                    out.write(chunk)
                    written(len(chunk))
                    meter.advance(len(chunk))
                out.flush()
                os.fsync(out.fileno())
    except httpx.HTTPError as exc:
        raise PackError(f"downloading {shown(url)} failed: {type(exc).__name__}: {exc}") from None
    if size is not None and received != size:
        raise PackError(f"{shown(url)} sent {received} bytes, {size} were advertised: the download is truncated")
    progress(meter.line())
    return _compare(digest.hexdigest(), sha256, shown(url))


async def upload(path: Path, url: str, progress: Progress, policy: UrlPolicy = UrlPolicy()) -> int:
    """PUT ``path`` to ``url`` (e.g. a presigned object-store URL) as one streamed body of known length."""
    policy.check(url)
    address = await policy.address(url)
    size = path.stat().st_size
    meter = Meter(progress, "uploaded", size)

    async def body() -> AsyncIterator[bytes]:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                meter.advance(len(chunk))
                yield chunk

    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, follow_redirects=False, trust_env=False) as client:
            request = _pinned(client, "PUT", url, address, {"Content-Length": str(size)}, content=body())
            response = await client.send(request, stream=True)
            try:
                if not response.is_success:  # a redirect too: the body cannot be sent twice
                    # The status only: the answer's body is the remote's and may be anything (a metadata
                    # service's credentials, say), so it is neither read nor shown.
                    raise PackError(f"uploading to {shown(url)} failed: HTTP {response.status_code}; check the URL "
                                    "(a presigned URL may have expired)")
            finally:
                await response.aclose()
    except httpx.HTTPError as exc:
        raise PackError(f"uploading to {shown(url)} failed: {type(exc).__name__}: {exc}") from None
    progress(meter.line())
    return size


def _compare(actual: str, advertised: str | None, what: str) -> str:
    if advertised is not None and actual != advertised.lower():
        raise PackError(f"{what} has SHA-256 {actual}, but {advertised} was advertised: refused, nothing unpacked")
    return actual
