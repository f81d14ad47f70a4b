"""The keyword arguments ``Sandbox.create`` and ``commands.run`` take beyond their first ones, as ``TypedDict``s.

A type checker reads them through ``Unpack`` (a misspelt ``templat=`` is an error before anything runs);
at run time ``check_keywords`` raises ``TypeError`` for a name that is not here, as Python does for any
function. E2B's connection arguments that mean nothing to forkd are here too, named, and ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from forkd.sdk.errors import InvalidArgumentException

if TYPE_CHECKING:
    from forkd.sdk.connection import ConnectionConfig

Net = Literal["none", "nat"]


class EgressRule(TypedDict, total=False):
    """One allowed destination of a ``net="nat"`` sandbox: ``cidr`` and, optionally, its ``ports`` (numbers or
    ``"8000-8100"`` ranges) and ``protocol``."""

    cidr: str
    ports: list[int | str]
    protocol: Literal["tcp", "udp", "any"]


class Egress(TypedDict, total=False):
    """A ``net="nat"`` sandbox's outbound policy, e.g. ``{"default": "deny", "allow": [{"cidr": "203.0.113.0/24",
    "ports": [443]}]}``; ``dns=False`` also cuts the relayed resolver under ``deny`` (docs/networking.md)."""

    default: Literal["allow", "deny"]
    allow: list[EgressRule]
    dns: bool


class E2BIgnored(TypedDict, total=False):
    """E2B's connection arguments that mean nothing to forkd: accepted, so E2B code runs unchanged, and ignored
    (forkd's daemon is picked by ``connection``/``url``/``token`` or ``FORKD_URL``)."""

    api_key: str | None
    domain: str | None
    debug: bool | None
    secure: bool | None
    proxy: Any
    headers: dict[str, str] | None


class ConnectOptions(E2BIgnored, total=False):
    """Which daemon to talk to (default: the environment's, see ``ConnectionConfig.from_env``)."""

    url: str | None
    token: str | None
    connection: ConnectionConfig | None
    request_timeout: float | None  # seconds per request to the daemon


class CreateOptions(ConnectOptions, total=False):
    """``Sandbox.create``'s keyword arguments after ``template``, ``timeout``, ``metadata`` and ``envs``: the
    sandbox's network (``net="nat"`` or E2B's ``allow_internet_access=True``; default none), its ``egress`` policy
    and its VMM's limits (docs/api.md, POST /v1/sandboxes), and the connection."""

    net: Net | None
    egress: Egress | None
    allow_internet_access: bool | None
    memory_limit_mib: int | None
    cpu_quota: float | None
    cpu_weight: int | None
    pids_max: int | None


class RunOptions(TypedDict, total=False):
    """``commands.run``'s keyword arguments after ``cmd`` and ``background``."""

    envs: dict[str, str] | None
    user: str | None
    cwd: str | None
    on_stdout: Callable[[str], object] | None
    on_stderr: Callable[[str], object] | None
    stdin: bool | str | None
    timeout: float | None
    request_timeout: float | None
    warm: bool


#: The fork options ``Sandbox.create`` passes to the daemon as they are (docs/api.md, POST /v1/sandboxes).
FORK_LIMITS = ("net", "egress", "memory_limit_mib", "cpu_quota", "cpu_weight", "pids_max")


def check_keywords(function: str, given: Mapping[str, object], allowed: Any) -> None:
    """``TypeError`` naming the first keyword argument the TypedDict ``allowed`` does not declare."""
    for name in given:
        if name not in allowed.__optional_keys__ | allowed.__required_keys__:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")


def network(net: Net | None, allow_internet_access: bool | None) -> Net | None:
    """The ``net`` mode to fork with: ``net`` itself, or E2B's ``allow_internet_access`` (True: ``"nat"``, False:
    ``"none"``); None leaves it to the daemon (no network). Both given and disagreeing is refused."""
    if allow_internet_access is None:
        return net
    implied: Net = "nat" if allow_internet_access else "none"
    if net is not None and net != implied:
        raise InvalidArgumentException(400, "invalid_request", f"net={net!r} contradicts allow_internet_access="
                                       f"{allow_internet_access}: give one of them")
    return implied
