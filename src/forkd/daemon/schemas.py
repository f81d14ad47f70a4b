"""Request bodies and answers of the REST API; pydantic validates them at the boundary and feeds the
OpenAPI document. Every number has a minimum and a maximum; schemas only validate, routes build the
runtime's objects from them."""

from __future__ import annotations

import shlex

from typing import Annotated, Literal


from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from forkd.daemon.bodies import (CIDR_PATTERN, EGRESS_RULES, EXEC_RULES, FORK_RULES, PORT_RANGE_PATTERN, PULL_RULES,
                                 JsonIntegers, Port)
from forkd.host.netpolicy import MAX_ALLOW_RULES, MAX_PORTS_PER_RULE, allow_rule, egress_policy
from forkd.runtime.pool import MAX_POOL_SIZE
from forkd.runtime.sessions import MAX_TIMEOUT_S
from forkd.validation import TAG_PATTERN

Tag = Annotated[str, Field(pattern=TAG_PATTERN, description="[A-Za-z0-9_-]{1,64}")]
MAX_CHILDREN_PER_REQUEST = 1000
MIN_TIMEOUT_S = 1.0  # shorter ones could only answer "timed out"
MAX_SANDBOX_TIMEOUT_S = 30 * 24 * 3600
MAX_STDIN_CHARS = 8 << 20  # base64 of it must fit one 16 MiB agent frame

EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")]
# additionalProperties: the pattern is the only way a name is accepted (JSON Schema lets other keys through).
Envs = Annotated[dict[EnvName, Annotated[str, Field(max_length=1 << 16)]],
                 Field(max_length=1024, json_schema_extra={"additionalProperties": False})]
MetadataKey = Annotated[str, Field(min_length=1, max_length=128)]
Metadata = Annotated[dict[MetadataKey, Annotated[str, Field(max_length=4096)]], Field(max_length=64)]
SandboxTimeout = Annotated[float, Field(ge=MIN_TIMEOUT_S, le=MAX_SANDBOX_TIMEOUT_S,
                                        description="seconds until the daemon kills the sandbox")]
CallTimeout = Annotated[float, Field(ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S, description="seconds")]


class Strict(JsonIntegers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ImageBuild(Strict):
    name: Tag = "default"
    packages: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9+.-]{0,99}$")]] = Field(
        default_factory=list, max_length=200, description="Debian packages added to python3, python3-numpy and python3-pytest")
    mirror: str | None = Field(default=None, max_length=1000)
    source_dir: str | None = Field(default=None, max_length=4096)
    source_oci: str | None = Field(default=None, max_length=4096)
    disk_size_mib: StrictInt | None = Field(default=None, ge=256, le=1024 * 1024)
    ca_certs: list[Annotated[str, Field(max_length=64 * 1024)]] = Field(
        default_factory=list, max_length=50,
        description="PEM CA certificates added to the guest's trust store (e.g. a TLS-intercepting proxy's CA)")
    force: bool = False


class SnapshotCreate(Strict):
    tag: Tag
    image: Tag = "default"
    memory_mib: StrictInt = Field(default=1024, ge=128, le=65536)
    vcpus: StrictInt = Field(default=1, ge=1, le=64)
    warm_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,199}$")]] = Field(
        default_factory=lambda: ["numpy"], max_length=100)
    warm_code: str | None = Field(
        default=None, max_length=65536,
        description="Python run once in the warm interpreter after the imports, before the snapshot is saved: "
                    "what it leaves behind (names, caches, a tool's start-up done) every run_code context and "
                    "warm command inherits")
    warmup_cmd: str | None = Field(default=None, max_length=65536)
    machine: Literal["q35", "microvm"] | None = Field(
        default=None,
        description="the VM's machine type, kept by every child: q35 (PCI, the default), or microvm (virtio-mmio, "
                    "no PCI or firmware: less memory per child, a 10x smaller device state); unset: the daemon's "
                    "`vmm_machine`")


#: Below these a child's VMM cannot even resume (see docs/networking.md, "Resource limits").
MIN_MEMORY_LIMIT_MIB = 64
MIN_PIDS = 16


class AllowRuleBody(Strict):
    cidr: str = Field(max_length=64, pattern=CIDR_PATTERN, description="IPv4 network, e.g. 203.0.113.0/24 (no host bits)")
    ports: list[Port | Annotated[str, Field(pattern=PORT_RANGE_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_PORTS_PER_RULE, description="ports or 'low-high' ranges; empty: all")
    protocol: Literal["tcp", "udp", "any"] = "any"


class EgressBody(Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=EGRESS_RULES)
    default: Literal["allow", "deny"] = "allow"
    allow: list[AllowRuleBody] = Field(default_factory=list, max_length=MAX_ALLOW_RULES)
    dns: bool = Field(default=True, description="the relayed DNS resolver stays reachable under 'deny'")


LABEL_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"  # idempotency keys and owners
Label = Annotated[str, Field(pattern=LABEL_PATTERN, description="[A-Za-z0-9._:-]{1,128}")]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="a snapshot's layer digest (sha256 hex)")]


class SandboxCreate(Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=FORK_RULES)
    snapshot_tag: Tag | None = Field(default=None, description="the snapshot to fork (or give snapshot_digest)")
    snapshot_digest: Digest | None = Field(default=None, description="the snapshot by digest (GET /v1/node)")
    idempotency_key: Label | None = Field(default=None, description=(
        "a retried fork with this key is answered the same and forks no more children (kept 24 h, the newest "
        "10,000 keys; a fork no client waits for is given up after 60 s)"))
    owner: Label | None = Field(default=None, description="a label stored with each child, to list and kill by")
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHILDREN_PER_REQUEST)
    timeout_s: SandboxTimeout | None = None
    envs: Envs = Field(default_factory=dict, description="default environment of every command in the sandbox")
    metadata: Metadata = Field(default_factory=dict, description="labels returned with the sandbox")

    net: Literal["none", "nat"] = Field(default="none", description="none: no network; nat: own namespace, NAT out")
    egress: EgressBody | None = Field(default=None, description="only with net 'nat'; default: allow all")
    memory_limit_mib: StrictInt | None = Field(default=None, ge=MIN_MEMORY_LIMIT_MIB, le=1 << 20)
    cpu_quota: float | None = Field(default=None, ge=0.01, le=1024, description="cores, e.g. 0.5")
    cpu_weight: StrictInt | None = Field(default=None, ge=1, le=10000, description="relative share, 100 = default")
    pids_max: StrictInt | None = Field(default=None, ge=MIN_PIDS, le=1 << 22, description="threads of the VMM")
    deadline_s: float | None = Field(default=None, ge=0.1, le=MAX_TIMEOUT_S, description=(
        "wait no longer than this for the children: one not answering by then is dropped and reported"))
    stream: bool = Field(default=False, description="answer NDJSON, one line per child as it answers")

    @model_validator(mode="after")
    def one_snapshot(self) -> SandboxCreate:
        if (self.snapshot_tag is None) == (self.snapshot_digest is None):
            raise ValueError("give exactly one of 'snapshot_tag' or 'snapshot_digest'")
        if self.idempotency_key is not None and self.stream:
            raise ValueError("'idempotency_key' is for forks answered once: leave out 'stream'")
        return self

    @model_validator(mode="after")
    def egress_needs_nat(self) -> SandboxCreate:
        if self.egress is not None:
            if self.net != "nat":
                raise ValueError("an egress policy needs net 'nat' (a 'none' sandbox has no network at all)")
            # Bad CIDRs and port ranges are refused here, with the other schema errors.
            egress_policy(self.egress.default, [allow_rule(r.cidr, list(r.ports), r.protocol)
                                                for r in self.egress.allow], self.egress.dns)
        return self


class TimeoutBody(Strict):
    timeout_s: SandboxTimeout


class SignalBody(Strict):
    signal: StrictInt = Field(default=9, ge=1, le=64)


class StdinBody(Strict):
    data: str = Field(default="", max_length=MAX_STDIN_CHARS)
    eof: bool = False


class PtySize(Strict):
    rows: StrictInt = Field(default=24, ge=1, le=10_000)
    cols: StrictInt = Field(default=80, ge=1, le=10_000)


class PtyInput(Strict):
    data: str = Field(max_length=MAX_STDIN_CHARS)


class PtyRequest(PtySize):
    argv: list[str] = Field(default_factory=lambda: ["/bin/bash", "-i"], min_length=1, max_length=4096,
                            description="the program and its arguments (default: an interactive bash)")
    env: Envs = Field(default_factory=dict, description="merged over the sandbox's default envs")
    cwd: str | None = Field(default=None, max_length=4096)


class ExecRequest(Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=EXEC_RULES)
    cmd: str | None = Field(default=None, max_length=1 << 20, description="shell command (/bin/sh -c)")
    argv: list[str] | None = Field(default=None, min_length=1, max_length=4096)
    env: Envs = Field(default_factory=dict, description="merged over the sandbox's default envs")
    cwd: str | None = Field(default=None, max_length=4096)
    stdin: str | None = Field(default=None, max_length=MAX_STDIN_CHARS,
                              description="written to stdin, then closed; absent: stdin stays open for /stdin")
    timeout_s: CallTimeout | None = 60.0
    user: str | None = Field(default=None, max_length=64)
    stream: bool = Field(default=False, description="answer with NDJSON events as output arrives")
    warm: bool = Field(default=False, description="run a python3 command line as a fork of the warm template "
                       "(its imports already done); 'cmd' is split like a shell would. See docs/guest-protocol.md")

    @model_validator(mode="after")
    def one_command(self) -> ExecRequest:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell string) or 'argv' (a list)")
        if self.warm and self.cmd is not None:
            try:
                self.argv, self.cmd = shlex.split(self.cmd), None
            except ValueError as exc:
                raise ValueError(f"a warm 'cmd' must split into words like a shell's: {exc}") from None
            if not self.argv:
                raise ValueError("a warm 'cmd' must not be empty")
        return self


class EvalRequest(Strict):
    expr: str = Field(max_length=1 << 20)
    context: Tag = "default"
    timeout_s: CallTimeout = 60.0


class RunCodeRequest(Strict):
    code: str = Field(max_length=16 << 20)
    context: Tag = "default"
    timeout_s: CallTimeout | None = None
    stream: bool = Field(default=False, description="answer with NDJSON events as output arrives")


class ContextCreate(Strict):
    id: Tag | None = Field(default=None, description="default: a random id")
    language: Literal["python"] = "python"
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)


class PathBody(Strict):
    path: str = Field(min_length=1, max_length=4096)


class RenameBody(Strict):
    src: str = Field(min_length=1, max_length=4096)
    dst: str = Field(min_length=1, max_length=4096)


# packs

HostPath = Annotated[str, Field(min_length=2, max_length=4096, pattern=r"^/",
                                description="absolute path on the daemon's host")]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
PackUrl = Annotated[str, Field(min_length=1, max_length=8192, pattern=r"^(https?://|file:///|/)")]


class PackCreate(Strict):
    tag: Tag
    path: HostPath
    force: bool = Field(default=False, description="overwrite an existing file")


class PackUnpack(Strict):
    path: HostPath
    tag: Tag | None = Field(default=None, description="register the top snapshot under this tag")
    force: bool = Field(default=False, description="replace a snapshot of that tag")


class PackPull(Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=PULL_RULES)
    url: PackUrl | None = None
    index: PackUrl | None = Field(default=None, description="index file or URL; then name a pack in it")
    name: Tag | None = None
    sha256: Sha256Hex | None = Field(default=None, description="advertised SHA-256 of the pack file")
    tag: Tag | None = None
    force: bool = False

    @model_validator(mode="after")
    def one_source(self) -> PackPull:
        if (self.url is None) == (self.index is None):
            raise ValueError("give exactly one of 'url' or 'index' (with 'name')")
        if self.index is not None and (self.name is None or self.sha256 is not None):
            raise ValueError("with 'index' give 'name' (the index advertises the SHA-256)")
        return self


class PackPush(Strict):
    tag: Tag
    url: Annotated[str, Field(min_length=8, max_length=8192, pattern=r"^https?://")]


# branch and chains

class BranchRequest(Strict):
    tag: Tag
    mode: Literal["full", "diff", "live"] = Field(
        default="diff", description="full: whole memory file; diff: only pages changed since the parent; "
                                    "live: full, with memory pre-copied while the guest runs where the kernel tracks soft-dirty pages")
    wait: bool = Field(default=True, description="false: answer 202 with status `writing` right after the pause "
                                                 "(the snapshot holds the sandbox as it was then; its layers are "
                                                 "written in the background)")


class WorkspaceCreate(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,40}$", description="[A-Za-z0-9_-]{1,40}")]
    snapshot_tag: Tag


class CompactRequest(Strict):
    from_tag: Tag
    to_tag: Tag


class DiffRequest(Strict):
    base_tag: Tag
    tag: Tag
    cmd: str = Field(min_length=1, max_length=65536, description="shell command run in a child of base_tag")
    timeout_s: CallTimeout = 600.0


# Answers. They allow extra fields: a snapshot or sandbox carries backend-specific details.

class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Open):
    code: str
    message: str


class ErrorBody(Open):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    # Errors are JSON even on routes that answer NDJSON or bytes, hence the explicit content type.
    status: {"model": ErrorBody, "description": description,
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    for status, description in {
        400: "invalid request: a refused value, a body or parameters that fail the schema, or JSON that does "
             "not parse", 401: "missing or wrong bearer token (TCP only)", 404: "not found",
        409: "conflict: busy, in use, ended, mismatched or corrupt snapshot", 413: "body too large",
        "default": "any other error, with the same body", 500: "internal error",
        502: "the guest agent is unreachable", 503: "over a concurrency cap", 504: "timed out",
        507: "no disk space left for a snapshot",
    }.items()
}


class Health(Open):
    ok: bool


class MemoryUse(Open):
    pss_kib: int
    private_dirty_kib: int
    rss_kib: int


class Sandbox(Open):
    id: str
    snapshot_tag: str
    status: str
    pid: int | None
    created_at: float
    end_at: float | None = None
    owner: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    memory: MemoryUse | None = None
    seconds_to_answer: float | None = Field(default=None, description="fork request to the child's reseed answer")
    timings: dict[str, float] | None = Field(
        default=None, description="milliseconds per spawn stage, in the order they ran, and their total")


class SandboxList(Open):
    sandboxes: list[Sandbox]


class KilledList(Open):
    killed: list[str]


class ChildError(Open):
    """Why one child of a fork failed: its kind's code (the error table in docs/api.md) and what happened."""

    index: int = Field(ge=0, le=MAX_CHILDREN_PER_REQUEST - 1, description="the child's place in the request (0-based)")
    code: str = Field(description="the error's kind, e.g. busy (max_sandboxes reached), timeout (deadline_s passed), "
                                  "vmm_error, agent_unavailable")
    message: str


class ForkResult(Open):
    sandboxes: list[Sandbox]
    errors: list[ChildError] = Field(description="one per child that failed, in request order; the others started")


class PoolResize(Strict):
    size: StrictInt = Field(ge=0, le=MAX_POOL_SIZE, description="ready VMMs to keep for the snapshot (0: none)")


class Pool(Open):
    tag: str
    size: int = Field(ge=0, le=MAX_POOL_SIZE, description="ready VMMs kept for the snapshot")
    ready: int = Field(ge=0, le=MAX_POOL_SIZE, description="members ready now")
    starting: int = Field(ge=0, le=MAX_POOL_SIZE, description="members being started")
    warm: bool = Field(description="members run a fork's first calls, then wait stopped (config warm_pools)")
    memory: MemoryUse = Field(description="sum over the ready members' VMM processes")
    members: list[str]


class PoolList(Open):
    pools: list[Pool]


class Printed(Open):
    """What a command or cell printed; empty when its output was streamed as events instead."""

    stdout: str = ""
    stderr: str = ""
    truncated: bool = Field(default=False, description="output went past the daemon's per-call budget "
                                                       "(config `output`); the rest was dropped")


class CommandOutcome(Printed):
    exit_code: int
    signal: int | None = None
    timed_out: bool
    duration_s: float


class CodeError(Open):
    name: str
    value: str
    traceback: str


class CodeOutcome(Printed):
    value: str | None = None
    value_json: object = None
    error: CodeError | None = None


class FileEntry(Open):
    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float


class FileList(Open):
    entries: list[FileEntry]


class NodePull(Strict):
    digest: Digest
    source: str = Field(min_length=8, max_length=2048, pattern=r"^https?://",
                        description="the peer daemon's http(s) URL, e.g. http://10.0.0.2:7000")
    source_token: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^[\x21-\x7e]+$",
                                     description="the peer's bearer token, visible ASCII (sent only to the peer)")


class NodeUsage(Open):
    max_sandboxes: int | None = Field(description="the daemon's limit; null: none")
    live: int
    slots_free: int | None = Field(description="max_sandboxes - live (0 while draining); null: no limit")
    mem_available_bytes: int
    cpus: int
    load1: float


class NodeSnapshot(Open):
    tag: str
    digest: str
    parent_digest: str | None
    bytes: int
    status: str


class Node(Open):
    node_id: str
    backend: str
    compat: dict[str, str] = Field(description="vmm, vmm_version, machine, accel, cpu_model, agent_version")
    compat_key: str = Field(description="sha256 of compat's canonical JSON")
    draining: bool = Field(description="it takes no new forks (POST /v1/node/drain); its slots_free is 0")
    capacity: NodeUsage
    snapshots: list[NodeSnapshot]


class PullOutcome(Open):
    digest: str
    tag: str
    pulled_layers: int
    bytes: int


class NodeDrain(Strict):
    wait_s: float = Field(default=0.0, ge=0, le=3600,
                          description="answer once no sandbox is left, or after this many seconds")


class DrainOutcome(Open):
    draining: bool
    sandboxes: list[str] = Field(description="ids of the sandboxes still running")
    starting: int = Field(description="children admitted before the drain, still starting")
