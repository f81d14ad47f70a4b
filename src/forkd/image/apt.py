"""Debian packages for the image: which mirror to use, and fetching single .debs without installing them.

The mirror is never hard-coded: it is taken from the machine's own apt sources (one-line
``sources.list`` files and deb822 ``*.sources`` files) or given explicitly. Packages are fetched with
``apt-get download`` under a private apt state directory per suite, so the host's package lists,
caches, pins and dpkg status are neither read nor changed, and apt still verifies the archive's
signatures.
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.image.commands import run
from forkd.image.errors import MirrorNotFound, ToolError
from forkd.store.files import sha256_file

APT_ETC = Path("/etc/apt")
ARCH = "amd64"  # the guest architecture
MIRROR_SCHEMES = ("http://", "https://", "file:/")
_ONE_LINE = re.compile(r"^(deb|deb-src)\s+(?:\[([^\]]*)\]\s*)?(\S+)\s+(\S+)((?:\s+\S+)*)$")


@dataclass(frozen=True)
class AptSource:
    """One source entry as apt reads it (a one-line entry or a deb822 stanza)."""

    types: tuple[str, ...]
    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None = None
    architectures: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mirror:
    """A Debian archive root (the URI debootstrap and apt take) and the keyring that signs it."""

    uri: str
    signed_by: str | None = None


@dataclass(frozen=True)
class PackageRecord:
    """The fields of a package's archive record the builder needs."""

    name: str
    version: str
    filename: str
    size: int
    sha256: str
    depends: str = ""

    @property
    def deb_name(self) -> str:
        return posixpath.basename(self.filename)


def parse_one_line(text: str) -> list[AptSource]:
    """Entries of a one-line format file (``deb [opts] uri suite component...``)."""
    sources = []
    for raw in text.splitlines():
        match = _ONE_LINE.match(raw.split("#", 1)[0].strip())
        if match is None:
            continue
        kind, opts, uri, suite, components = match.groups()
        options = dict(o.split("=", 1) for o in (opts or "").split() if "=" in o)
        sources.append(AptSource(
            types=(kind,), uris=(uri,), suites=(suite,), components=tuple(components.split()),
            signed_by=options.get("signed-by"), architectures=tuple(filter(None, options.get("arch", "").split(","))),
        ))
    return sources


def parse_deb822(text: str) -> list[AptSource]:
    """Enabled stanzas of a deb822 ``.sources`` file."""
    return [
        AptSource(
            types=tuple(f.get("types", "").split()), uris=tuple(f.get("uris", "").split()),
            suites=tuple(f.get("suites", "").split()), components=tuple(f.get("components", "").split()),
            signed_by=f.get("signed-by"), architectures=tuple(f.get("architectures", "").split()),
        )
        for f in deb822_stanzas(text)
        if f.get("enabled", "yes").lower() != "no"
    ]


def deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    """Stanzas of deb822 text as ``{lower-case field: value}``; continuation lines join with newlines."""
    fields: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield fields
            fields, key = {}, ""
        elif line[0] in " \t" and key:
            fields[key] += "\n" + line.strip()
        else:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            fields[key] = value.strip()
    if fields:
        yield fields


def read_sources(etc_apt: Path = APT_ETC) -> list[AptSource]:
    """All entries of ``sources.list``, ``sources.list.d/*.list`` and ``sources.list.d/*.sources``, in apt's order."""
    parts = etc_apt / "sources.list.d"
    one_line = [etc_apt / "sources.list", *sorted(parts.glob("*.list"))]
    sources = [s for path in one_line if path.is_file() for s in parse_one_line(path.read_text())]
    return sources + [s for path in sorted(parts.glob("*.sources")) for s in parse_deb822(path.read_text())]


def choose_mirror(sources: list[AptSource], suite: str, component: str = "main") -> Mirror:
    """The binary source serving ``suite``/``component``, preferring ones that look like the Debian archive.

    Third-party repositories sometimes reuse the suite name ``bookworm`` with a ``main`` component;
    the Debian archive conventionally lives at ``.../debian`` and is signed by the archive keyring.
    """
    candidates = [
        Mirror(uri.rstrip("/"), source.signed_by)
        for source in sources
        if "deb" in source.types and suite in source.suites and component in source.components
        and (not source.architectures or ARCH in source.architectures)
        for uri in source.uris
        if uri.startswith(MIRROR_SCHEMES)
    ]
    if not candidates:
        raise MirrorNotFound(
            f"no apt source serves Debian {suite} with component {component}: pass --mirror URL "
            f"or add a Debian source to /etc/apt/sources.list"
        )
    return min(candidates, key=lambda m: not _looks_like_debian_archive(m))


def find_mirror(suite: str, etc_apt: Path = APT_ETC) -> Mirror:
    """The mirror for ``suite`` according to the machine's apt configuration."""
    return choose_mirror(read_sources(etc_apt), suite)


def _looks_like_debian_archive(mirror: Mirror) -> bool:
    return mirror.uri.endswith("/debian") or "debian-archive-keyring" in (mirror.signed_by or "")


class AptRepo:
    """``apt-get``/``apt-cache`` confined to ``state_dir`` and to one suite of one mirror.

    One suite per state directory keeps ``apt-cache show`` unambiguous: every package has exactly
    the version that suite offers, with no pinning involved.
    """

    def __init__(self, state_dir: Path, mirror: Mirror, suite: str) -> None:
        self.state_dir = state_dir
        self.mirror = mirror
        self.suite = suite

    def update(self) -> None:
        """Fetch (or revalidate) the suite's package index."""
        for sub in ("state/lists/partial", "cache/archives/partial", "sources.list.d", "preferences.d"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.state_dir / "status").touch()
        (self.state_dir / "sources.list.d" / "forkd.sources").write_text(self._sources_stanza())
        run([*self._apt("apt-get"), "update"],
            hint=f"cannot read the {self.suite} index from {self.mirror.uri}: check the mirror and the network")

    def record(self, package: str) -> PackageRecord:
        """The archive record of ``package`` in this suite."""
        out = run([*self._apt("apt-cache"), "show", "--no-all-versions", package],
                  hint=f"is there a package {package!r} in {self.suite} on {self.mirror.uri}? check the name")
        fields = next(deb822_stanzas(out))
        return PackageRecord(
            name=fields["package"], version=fields["version"], filename=fields["filename"],
            size=int(fields["size"]), sha256=fields["sha256"], depends=fields.get("depends", ""),
        )

    def download(self, record: PackageRecord, dest_dir: Path) -> Path:
        """``dest_dir/<file>.deb`` for ``record``, reusing a previous download whose size and SHA-256 match."""
        final = dest_dir / record.deb_name
        if final.is_file() and _matches(final, record):
            return final
        dest_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".download.") as tmp:
            run([*self._apt("apt-get"), "download", f"{record.name}={record.version}"], cwd=Path(tmp),
                hint=f"cannot download {record.name} {record.version} from {self.mirror.uri}")
            fetched = next(Path(tmp).glob("*.deb"))
            if not _matches(fetched, record):
                raise ToolError(f"{fetched.name} from {self.mirror.uri} does not match the archive index: "
                                f"retry; if it persists, try another mirror with --mirror")
            os.replace(fetched, final)
        return final

    def _sources_stanza(self) -> str:
        lines = ["Types: deb", f"URIs: {self.mirror.uri}", f"Suites: {self.suite}", "Components: main"]
        if self.mirror.signed_by:
            first, *rest = self.mirror.signed_by.split("\n")
            lines += [f"Signed-By: {first}", *(f" {line}" for line in rest)]
        return "\n".join(lines) + "\n"

    def _apt(self, tool: str) -> list[str]:
        d = self.state_dir
        options = {
            "Dir::State": d / "state",
            "Dir::State::status": d / "status",
            "Dir::Cache": d / "cache",
            "Dir::Etc::SourceList": d / "sources.list",
            "Dir::Etc::SourceParts": d / "sources.list.d",
            "Dir::Etc::Preferences": d / "preferences",
            "Dir::Etc::PreferencesParts": d / "preferences.d",
            "APT::Architecture": ARCH,
            "APT::Architectures": ARCH,
            "Acquire::Languages": "none",
            "APT::Sandbox::User": "root",  # the private dirs are not writable by _apt
        }
        return [tool, "-q", *(arg for k, v in options.items() for arg in ("-o", f"{k}={v}"))]


def resolve_kernel(repo: AptRepo, package: str) -> PackageRecord:
    """The versioned ``linux-image-*`` package behind ``package`` (a meta-package), or ``package`` itself."""
    record = repo.record(package)
    target = _kernel_image_dependency(record.depends)
    return record if target is None else repo.record(target)


def _kernel_image_dependency(depends: str) -> str | None:
    for alternatives in depends.split(","):
        name = alternatives.split("|")[0].split("(")[0].strip()
        if name.startswith("linux-image-"):
            return name
    return None


def _matches(path: Path, record: PackageRecord) -> bool:
    return path.stat().st_size == record.size and sha256_file(path) == record.sha256


def extract_deb(deb: Path, dest: Path) -> None:
    """Unpack the files of ``deb`` under ``dest`` (no maintainer scripts run)."""
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", deb, dest], hint=f"if {deb} is damaged, delete it so that it is downloaded again")
