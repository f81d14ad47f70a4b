"""Request bodies of the REST API; pydantic validates them at the boundary and feeds the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

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


class SandboxCreate(Strict):
    snapshot_tag: Tag
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHILDREN_PER_REQUEST)


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


class BranchRequest(Strict):
    tag: Tag
    mode: Literal["full", "diff", "live"] = Field(
        default="diff", description="full: whole memory file; diff: only pages changed since the parent; "
                                    "live: full, with RAM copied while the guest runs (needs tmpfs memory files)")
    wait: bool = Field(default=True, description="false: answer 202 at once with status `writing`")


class CompactRequest(Strict):
    from_tag: Tag
    to_tag: Tag


class DiffRequest(Strict):
    base_tag: Tag
    tag: Tag
    cmd: str = Field(min_length=1, max_length=65536, description="shell command run in a child of base_tag")
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S)
