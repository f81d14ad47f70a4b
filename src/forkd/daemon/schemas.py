"""Request bodies of the REST API; pydantic validates them at the boundary and feeds the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from forkd.host.cgroups import Limits
from forkd.host.netpolicy import MAX_ALLOW_RULES, MAX_PORTS_PER_RULE, NetRequest, allow_rule, egress_policy
from forkd.runtime.isolation import SandboxOptions
from forkd.validation import TAG_PATTERN

Tag = Annotated[str, Field(pattern=TAG_PATTERN, description="[A-Za-z0-9_-]{1,64}")]
MAX_CHILDREN_PER_REQUEST = 1000
MAX_TIMEOUT_S = 24 * 3600


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageBuild(Strict):
    name: Tag = "default"
    packages: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9+.-]{0,99}$")]] = Field(
        default_factory=list, max_length=200, description="Debian packages added to python3 and python3-numpy")
    mirror: str | None = Field(default=None, max_length=1000)
    source_dir: str | None = Field(default=None, max_length=4096)
    source_oci: str | None = Field(default=None, max_length=4096)
    disk_size_mib: StrictInt | None = Field(default=None, ge=256, le=1024 * 1024)
    force: bool = False


class SnapshotCreate(Strict):
    tag: Tag
    image: Tag = "default"
    memory_mib: StrictInt = Field(default=1024, ge=128, le=65536)
    vcpus: StrictInt = Field(default=1, ge=1, le=64)
    warm_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,199}$")]] = Field(
        default_factory=lambda: ["numpy"], max_length=100)
    warmup_cmd: str | None = Field(default=None, max_length=65536)


#: Below these a child's VMM cannot even resume (see docs/networking.md, "Resource limits").
MIN_MEMORY_LIMIT_MIB = 64
MIN_PIDS = 16


class AllowRuleBody(Strict):
    cidr: str = Field(max_length=64, description="IPv4 network, e.g. 203.0.113.0/24")
    ports: list[StrictInt | Annotated[str, Field(pattern=r"^[0-9]{1,5}(-[0-9]{1,5})?$")]] = Field(
        default_factory=list, max_length=MAX_PORTS_PER_RULE, description="ports or 'low-high' ranges; empty: all")
    protocol: Literal["tcp", "udp", "any"] = "any"


class EgressBody(Strict):
    default: Literal["allow", "deny"] = "allow"
    allow: list[AllowRuleBody] = Field(default_factory=list, max_length=MAX_ALLOW_RULES)
    dns: bool = Field(default=True, description="the relayed DNS resolver stays reachable under 'deny'")


class SandboxCreate(Strict):
    snapshot_tag: Tag
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHILDREN_PER_REQUEST)
    net: Literal["none", "nat"] = Field(default="none", description="none: no network; nat: own namespace, NAT out")
    egress: EgressBody | None = Field(default=None, description="only with net 'nat'; default: allow all")
    memory_limit_mib: StrictInt | None = Field(default=None, ge=MIN_MEMORY_LIMIT_MIB, le=1 << 20)
    cpu_quota: float | None = Field(default=None, ge=0.01, le=1024, description="cores, e.g. 0.5")
    cpu_weight: StrictInt | None = Field(default=None, ge=1, le=10000, description="relative share, 100 = default")
    pids_max: StrictInt | None = Field(default=None, ge=MIN_PIDS, le=1 << 22, description="threads of the VMM")

    @model_validator(mode="after")
    def egress_needs_nat(self) -> SandboxCreate:
        if self.egress is not None and self.net != "nat":
            raise ValueError("an egress policy needs net 'nat' (a 'none' sandbox has no network at all)")
        self.options()  # refuses bad CIDRs and port ranges here, as a 422
        return self

    def options(self) -> SandboxOptions:
        egress = self.egress or EgressBody()
        policy = egress_policy(egress.default, [allow_rule(r.cidr, list(r.ports), r.protocol) for r in egress.allow],
                               egress.dns)
        return SandboxOptions(net=NetRequest(mode=self.net, egress=policy),
                              limits=Limits(memory_limit_mib=self.memory_limit_mib, cpu_quota=self.cpu_quota,
                                            cpu_weight=self.cpu_weight, pids_max=self.pids_max))


class ExecRequest(Strict):
    cmd: str | None = Field(default=None, max_length=1 << 20, description="shell command (/bin/sh -c)")
    argv: list[str] | None = Field(default=None, min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(default=None, max_length=4096)
    stdin: str | None = Field(default=None, max_length=64 << 20)
    timeout_s: float | None = Field(default=60.0, gt=0, le=MAX_TIMEOUT_S)
    user: str | None = Field(default=None, max_length=64)
    stream: bool = Field(default=False, description="answer with NDJSON events as output arrives")

    @model_validator(mode="after")
    def one_command(self) -> ExecRequest:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell string) or 'argv' (a list)")
        return self


class EvalRequest(Strict):
    expr: str = Field(max_length=1 << 20)
    context: Tag = "default"
    timeout_s: float = Field(default=60.0, gt=0, le=MAX_TIMEOUT_S)


class RunCodeRequest(Strict):
    code: str = Field(max_length=16 << 20)
    context: Tag = "default"
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    stream: bool = False


class PathBody(Strict):
    path: str = Field(min_length=1, max_length=4096)


class RenameBody(Strict):
    src: str = Field(min_length=1, max_length=4096)
    dst: str = Field(min_length=1, max_length=4096)
