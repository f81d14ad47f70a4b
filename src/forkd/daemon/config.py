"""The daemon's configuration: a TOML file, overridden by environment variables, overridden by CLI flags.

Precedence, highest first: ``forkd daemon`` flags, then ``FORKD_*`` variables, then the file given
with ``--config``, then the defaults below. Unknown keys and wrong types in the file are refused
with the key named, so a typo never silently falls back to a default. This is the only place the
daemon reads ``FORKD_*`` variables; the runtime gets what it needs as ``RuntimeOptions``.

```toml
home = "/var/lib/forkd"          # state: SQLite, snapshots, sandbox run directories
cache = "/var/cache/forkd"       # rebuildable: guest images, downloads
socket = "/run/forkd/forkd.sock" # Unix socket, mode 0600
listen = "127.0.0.1:7070"        # optional TCP listener (needs token_file)
token_file = "/etc/forkd/token"  # bearer token clients must send
tls_cert = "/etc/forkd/tls.crt"  # with tls_key: serve HTTPS on `listen`
tls_key = "/etc/forkd/tls.key"
log_file = "/var/log/forkd/daemon.log"  # default: stderr (the journal under systemd)
log_max_bytes = 10485760         # rotate the log file at this size ...
log_backups = 5                  # ... keeping this many old files
log_format = "text"              # text, or json: one object a line (ts, level, logger, message)  [FORKD_LOG_FORMAT]
vmm = "qemu"                     # VMM backend: qemu, or fake (no VMs: real processes answer the guest protocol)  [FORKD_VMM]
accelerator = "auto"             # auto | kvm | tcg
tcg_tb_size_mib = 32             # TCG translation buffer per VMM: 16 saves 17 MiB a child, costs ~1.8x its CPU
vmm_huge_pages = false           # true: VMMs may use transparent huge pages (2-4 MiB more private memory a child)
vmm_machine = "q35"              # machine type of a snapshot whose request names none: q35, or microvm (docs/operations.md)
warm_pools = true                # pool members run a fork's first calls, then wait stopped (more memory each)
imports_dir = "/var/lib/forkd/imports"  # image sources API clients may name (default HOME/imports)
packs_dir = "/var/lib/forkd/packs"      # pack files API clients may write and read (default HOME/packs)

[limits]
max_sandboxes = 500              # live + starting children
max_concurrent_forks = 16        # restores running at once; more queue (default: 2 per host CPU)
max_branches = 2                 # branches written at once; more answer 503  [FORKD_MAX_BRANCHES]
max_chain_depth = 8              # ancestors a snapshot may have; a BRANCH past it is written standalone

[sandboxes]
keep_on_stop = false             # true: stopping the daemon leaves VMMs for the next one to re-adopt
idle_stop_s = 60                 # a child idle this long is stopped, continued by its next request; 0 never  [FORKD_IDLE_STOP_S]
idle_reclaim = true              # a stopped child's memory is paged out, if the host has swap (zram or disk)

[network]
pool = "10.213.0.0/16"           # private IPv4 range nat children's /30s come from  [FORKD_NET_POOL]
dns = "192.0.2.53"               # resolver nat guests' DNS is relayed to (default: the host's)  [FORKD_DNS]

[output]                         # guest output one exec/run_code call may hold in the daemon
result_bytes = 4194304           # a non-streamed answer keeps this much stdout+stderr, then `truncated`
stream_bytes = 1073741824        # a streamed call forwards this much in all (unset: no cap)
stream_buffer_bytes = 1048576    # queued for a slow stream reader before the guest is paused

[server]
max_connections = 1000           # concurrent connections + requests per listener; more answer 503
header_timeout_s = 10            # a connection must send a request's headers within this
keep_alive_s = 5                 # idle keep-alive connections are closed after this
body_timeout_s = 60              # the E2B listener answers 408 to a body that pauses this long

[audit]                          # logs/audit.jsonl under home
max_bytes = 67108864             # rotate at this size ...
backups = 3                      # ... keeping this many old files (audit.jsonl.1 ...)

[pools]                          # ready VMMs kept per snapshot tag (default none); `forkd pool` changes them
quickstart = 1

[e2b]
listen = "127.0.0.1:3000"        # serve E2B's API and sandbox traffic here (docs/e2b.md)  [FORKD_E2B_LISTEN]
keys_file = "/etc/forkd/e2b-keys"  # accepted E2B API keys; default HOME/e2b/api-keys, made on first start
owner_quota_mib = 20480            # disk per E2B owner: snapshots, forks, paused sandboxes (default: none)
domain = "sandbox.example.com"     # get_host(port) = PORT-ID.DOMAIN (needs wildcard DNS); default localhost:PORT

[transfers]
allow_hosts = ["packs.example.com", "*.s3.amazonaws.com"]  # hosts pull/push may reach; default any public one
                                 # (a loopback, private or link-local address only when its host is named here)
allow_unpinned = false           # true: pull from a URL with no SHA-256 pin (a pack is code: docs/packs.md)

[disk]
min_free_mib = 1024              # forks, branches, snapshots, uploads, packs, unpacks and pulls refuse (disk_full)
                                 # to leave less free than this on the filesystem they write to

[confinement]                    # each QEMU VMM like Firecracker's jailer (docs/security.md)
enabled = true                   # false: VMMs run as root (a host without namespaces or util-linux)
uid_range = "1900000000-1900065535"  # one uid (and gid) per VMM, from ids no user or subuid range holds
max_open_files = 2048            # RLIMIT_NOFILE of each VMM
max_file_size_mib = 262144       # RLIMIT_FSIZE of each VMM: its disk overlay stops growing here

[uploads]                        # uploads wait for their guest in a spool under home/uploads
spool_mib = 1024                 # bytes all uploads together hold on disk; more wait (back-pressure)
spool_files = 64                 # uploads holding a spool file (a descriptor) at once; more wait
```
"""

from __future__ import annotations

import os
import tomllib
from ipaddress import IPv4Address
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic.dataclasses import dataclass

from forkd.config import Paths
from forkd.hostpaths import HostRoots
from forkd.host.netpolicy import DEFAULT_POOL, AddressPool
from forkd.runtime.idle import DEFAULT_IDLE_STOP_S
from forkd.runtime.options import DEFAULT_MAX_BRANCHES, DEFAULT_MAX_CHAIN_DEPTH, OutputLimits, RuntimeOptions
from forkd.runtime.pool import MAX_POOL_SIZE
from forkd.runtime.spool import DEFAULT_SPOOL_BYTES, DEFAULT_SPOOL_FILES
from forkd.store.space import DEFAULT_FLOOR_BYTES
from forkd.validation import ValidationError as FieldError
from forkd.vmm.backends import DEFAULT_BACKEND, BackendOptions, JailSettings, check_backend

_STRICT = ConfigDict(extra="forbid")
DEFAULT_HOME = Path("/var/lib/forkd")
DEFAULT_CACHE = Path("/var/cache/forkd")
# Environment variable → top-level key. FORKD_SOCKET defaults to HOME/forkd.sock when unset everywhere.
ENV_KEYS = {"FORKD_HOME": "home", "FORKD_CACHE": "cache", "FORKD_SOCKET": "socket", "FORKD_LISTEN": "listen",
            "FORKD_TOKEN_FILE": "token_file", "FORKD_LOG_FILE": "log_file",
            "FORKD_LOG_FORMAT": "log_format", "FORKD_NET_POOL": "network.pool",
            "FORKD_DNS": "network.dns", "FORKD_MAX_BRANCHES": "limits.max_branches",
            "FORKD_E2B_LISTEN": "e2b.listen", "FORKD_VMM": "vmm", "FORKD_IDLE_STOP_S": "sandboxes.idle_stop_s"}


DEFAULT_MAX_SANDBOXES = 500


class ConfigError(ValueError):
    """The config file cannot be read or holds a bad value; the message names the file and key."""


@dataclass(frozen=True, config=_STRICT)
class Limits:
    # A real default: a daemon nobody configured still refuses the 501st child instead of forking
    # until the host runs out of memory. Restores at once default to what the CPUs serve (options.py).
    max_sandboxes: int = Field(default=DEFAULT_MAX_SANDBOXES, ge=1, le=1 << 20)
    max_concurrent_forks: int | None = Field(default=None, ge=1, le=1 << 16)
    max_branches: int = Field(default=DEFAULT_MAX_BRANCHES, ge=1, le=1024)
    max_chain_depth: int = Field(default=DEFAULT_MAX_CHAIN_DEPTH, ge=1, le=1000)


@dataclass(frozen=True, config=_STRICT)
class SandboxPolicy:
    keep_on_stop: bool = False
    idle_stop_s: float = Field(default=DEFAULT_IDLE_STOP_S, ge=0, le=1 << 30)
    idle_reclaim: bool = True


@dataclass(frozen=True, config=_STRICT)
class Network:
    pool: str = DEFAULT_POOL
    dns: IPv4Address | None = None

    def __post_init__(self) -> None:
        try:
            AddressPool.parse(self.pool)
        except FieldError as exc:
            raise ValueError(f"network.pool: {exc}") from None


@dataclass(frozen=True, config=_STRICT)
class Output:
    result_bytes: int = Field(default=OutputLimits.result_bytes, ge=4096, le=1 << 30)
    stream_bytes: int | None = Field(default=None, ge=4096, le=1 << 50)
    stream_buffer_bytes: int = Field(default=OutputLimits.stream_buffer_bytes, ge=4096, le=256 << 20)


@dataclass(frozen=True, config=_STRICT)
class Server:
    max_connections: int = Field(default=1000, ge=1, le=1 << 20)
    header_timeout_s: float = Field(default=10.0, ge=0.1, le=3600)
    keep_alive_s: float = Field(default=5.0, ge=0.1, le=3600)
    body_timeout_s: float = Field(default=60.0, ge=0.1, le=3600)  # the E2B listener: a body's longest pause


@dataclass(frozen=True, config=_STRICT)
class Audit:
    max_bytes: int = Field(default=64 << 20, ge=4096, le=1 << 40)
    backups: int = Field(default=3, ge=0, le=100)


@dataclass(frozen=True, config=_STRICT)
class E2BSettings:
    listen: str | None = Field(default=None, pattern=r"^[^\s:]+:\d{1,5}$")  # host:port; None: no E2B front
    keys_file: Path | None = None  # None: HOME/e2b/api-keys
    owner_quota_mib: int | None = Field(default=None, ge=1, le=1 << 30)  # disk per owner (snapshots, forks, pauses)
    max_pause_chain: int | None = Field(default=None, ge=0, le=1000)  # deprecated: [limits] max_chain_depth
    # what get_host(port) builds {port}-{sandboxID}.{domain} from; None: localhost:<listen port>
    domain: str | None = Field(default=None, min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.-]+(:\d{1,5})?$")


@dataclass(frozen=True, config=_STRICT)
class Transfers:
    allow_hosts: list[Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9*.-]+$")]] | None = None
    allow_unpinned: bool = False


@dataclass(frozen=True, config=_STRICT)
class Disk:
    min_free_mib: int = Field(default=DEFAULT_FLOOR_BYTES >> 20, ge=0, le=1 << 30)


@dataclass(frozen=True, config=_STRICT)
class Uploads:
    spool_mib: int = Field(default=DEFAULT_SPOOL_BYTES >> 20, ge=16, le=1 << 30)
    spool_files: int = Field(default=DEFAULT_SPOOL_FILES, ge=1, le=1 << 16)


@dataclass(frozen=True, config=_STRICT)
class Confinement:
    enabled: bool = True
    uid_range: str = JailSettings.uid_range
    max_open_files: int = Field(default=JailSettings.max_open_files, ge=64, le=1 << 20)
    max_file_size_mib: int = Field(default=JailSettings.max_file_size_mib, ge=64, le=1 << 32)

    @field_validator("uid_range")
    @classmethod
    def _valid_range(cls, text: str) -> str:
        return JailSettings(uid_range=text).uid_range  # a malformed or privileged range: a ValueError naming it

    @property
    def jail(self) -> JailSettings:
        return JailSettings(enabled=self.enabled, uid_range=self.uid_range, max_open_files=self.max_open_files,
                            max_file_size_mib=self.max_file_size_mib)


@dataclass(frozen=True, config=_STRICT)
class DaemonConfig:
    home: Path = DEFAULT_HOME
    cache: Path = DEFAULT_CACHE
    socket: Path | None = None  # None: HOME/forkd.sock
    listen: str | None = Field(default=None, pattern=r"^[^\s:]+:\d{1,5}$")  # host:port
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_file: Path | None = None
    log_max_bytes: int = Field(default=10 << 20, ge=4096)
    log_backups: int = Field(default=5, ge=0)
    log_format: Literal["text", "json"] = "text"
    vmm: str = DEFAULT_BACKEND
    accelerator: Literal["auto", "kvm", "tcg"] = "auto"
    tcg_tb_size_mib: int = Field(default=BackendOptions.tcg_tb_size_mib, ge=1, le=2048)
    vmm_huge_pages: bool = BackendOptions.vmm_huge_pages
    vmm_machine: Literal["q35", "microvm"] = "q35"
    warm_pools: bool = True
    limits: Limits = field(default_factory=Limits)
    sandboxes: SandboxPolicy = field(default_factory=SandboxPolicy)
    network: Network = field(default_factory=Network)
    output: Output = field(default_factory=Output)
    server: Server = field(default_factory=Server)
    audit: Audit = field(default_factory=Audit)
    pools: dict[str, Annotated[int, Field(ge=0, le=MAX_POOL_SIZE)]] = field(default_factory=dict)
    e2b: E2BSettings = field(default_factory=E2BSettings)
    imports_dir: Path | None = None  # None: HOME/imports
    packs_dir: Path | None = None  # None: HOME/packs
    transfers: Transfers = field(default_factory=Transfers)
    disk: Disk = field(default_factory=Disk)
    uploads: Uploads = field(default_factory=Uploads)
    confinement: Confinement = field(default_factory=Confinement)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")

    @field_validator("vmm")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        return check_backend(name)  # UnknownBackend is a ValueError: reported as `vmm: ...`

    @property
    def backend_options(self) -> BackendOptions:
        return BackendOptions(accelerator=self.accelerator, tcg_tb_size_mib=self.tcg_tb_size_mib,
                              vmm_huge_pages=self.vmm_huge_pages, confinement=self.confinement.jail)

    @property
    def paths(self) -> Paths:
        return Paths(home=self.home, cache=self.cache, socket=self.socket or self.home / "forkd.sock")

    @property
    def runtime_options(self) -> RuntimeOptions:
        return RuntimeOptions(max_sandboxes=self.limits.max_sandboxes,
                              max_concurrent_forks=self.limits.max_concurrent_forks,
                              max_concurrent_branches=self.limits.max_branches,
                              max_chain_depth=self.max_chain_depth,
                              keep_sandboxes_on_stop=self.sandboxes.keep_on_stop,
                              idle_stop_s=self.sandboxes.idle_stop_s, idle_reclaim=self.sandboxes.idle_reclaim,
                              default_machine=self.vmm_machine,
                              net_pool=self.network.pool, dns=str(self.network.dns) if self.network.dns else None,
                              output=OutputLimits(result_bytes=self.output.result_bytes,
                                                  stream_bytes=self.output.stream_bytes,
                                                  stream_buffer_bytes=self.output.stream_buffer_bytes),
                              pool_sizes=dict(self.pools), warm_pools=self.warm_pools,
                              host_roots=self.host_roots,
                              transfer_hosts=(None if self.transfers.allow_hosts is None
                                              else tuple(self.transfers.allow_hosts)),
                              allow_unpinned_pulls=self.transfers.allow_unpinned,
                              free_floor_bytes=self.disk.min_free_mib << 20,
                              spool_bytes=self.uploads.spool_mib << 20, spool_files=self.uploads.spool_files)

    @property
    def max_chain_depth(self) -> int:
        """``[limits] max_chain_depth``, lowered by the deprecated ``[e2b] max_pause_chain`` when that is set
        (its 0, once "never compact", counts for nothing: every chain is bounded now)."""
        old = self.e2b.max_pause_chain
        return min(self.limits.max_chain_depth, old) if old else self.limits.max_chain_depth

    def deprecations(self) -> list[str]:
        """Keys still read but replaced, each with what to write instead (the daemon logs them at start)."""
        if self.e2b.max_pause_chain is None:
            return []
        return [f"[e2b] max_pause_chain is deprecated: every chain (pauses, snapshots, BRANCH) is bounded by "
                f"[limits] max_chain_depth, now {self.max_chain_depth}; move the value there"]

    @property
    def host_roots(self) -> HostRoots:
        default = HostRoots.under(self.home)
        return HostRoots(imports=self.imports_dir or default.imports, packs=self.packs_dir or default.packs)


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """The file (if any), then environment, then ``overrides`` (CLI flags; ``None`` values are ignored)."""
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    env = os.environ if env is None else env
    for variable, key in ENV_KEYS.items():
        if env.get(variable):
            _set(data, key, env[variable])
            where += f" + ${variable}"
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(data, key, value)
    try:
        return DaemonConfig(**data)
    except PydanticValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"bad daemon configuration ({where}): {problems}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad daemon configuration ({where}): {exc}") from None


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``limits.max_sandboxes`` style keys reach into their table."""
    *tables, key = dotted.split(".")
    for table in tables:
        data = data.setdefault(table, {})
    data[key] = value
