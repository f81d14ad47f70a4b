"""Per-child network namespaces: the namespace, its veth pair and tap, and the nft rules around them.

Topology (docs/networking.md has the picture): the guest's NIC is backed by ``tap0`` inside the
namespace ``forkd-<sandbox id>``; the namespace reaches the host over a veth pair whose host end
``fkd<id>`` has the first address of the child's /30 and whose namespace end has the second.

Namespace work runs on a thread of its own that joins the namespace (setns changes only the
calling thread) and then ends, so no thread of the daemon is ever left in a child's namespace;
processes it starts (``nft``) inherit that namespace. Everything is named after the sandbox id,
so :func:`release_network` can remove it given only the id, as often as it is called.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import logging
import os
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pyroute2 import IPRoute, NetlinkError, netns

from forkd.guest import netconf
from forkd.host.nftrules import (
    HOST_TABLE_PREFIX,
    LINK_PREFIX,
    NS_VETH,
    TAP,
    ChildNetwork,
    host_link,
    host_table,
    host_ruleset,
    namespace_ruleset,
)
from forkd.host.netpolicy import AddressPool
from forkd.validation import SANDBOX_ID_PREFIX

log = logging.getLogger("forkd.net")

NETNS_PREFIX = "forkd-"
NETNS_DIR = Path("/run/netns")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
RESOLV_CONF = Path("/etc/resolv.conf")
NFT_TIMEOUT_S = 30
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
_IFREQ_TUN = struct.Struct("16sH22x")
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


class NetworkError(RuntimeError):
    """A child's network could not be set up; the message says what to check."""


@dataclass(frozen=True)
class Leftover:
    """A forkd-named network object on the host: kind ``netns``, ``link`` or ``nft``."""

    kind: str
    name: str
    sandbox_id: str


def netns_name(sandbox_id: str) -> str:
    return NETNS_PREFIX + sandbox_id


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _on_own_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a fresh thread that ends afterwards, and return or raise what it did."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="forkd-netns")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def in_namespace(name: str, work: Callable[[], T]) -> T:
    """``work()`` with the calling thread inside the network namespace ``name``."""
    def entered() -> T:
        fd = os.open(NETNS_DIR / name, os.O_RDONLY)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"cannot enter network namespace {name}")
        finally:
            os.close(fd)
        return work()
    return _on_own_thread(entered)


def create_namespace(name: str) -> None:
    """A new, named network namespace (``/run/netns/<name>``, as ``ip netns`` makes them)."""
    def make() -> None:
        _check(_libc.unshare(CLONE_NEWNET), "cannot create a network namespace")
        netns.attach(name, "thread-self")  # bind-mounts this thread's new namespace under /run/netns
    _on_own_thread(make)


def remove_namespace(name: str) -> bool:
    if not (NETNS_DIR / name).exists():
        return False
    netns.remove(name)
    return True


def open_tap(name: str = TAP) -> int:
    """A tap device in the calling thread's namespace; it lives as long as the returned fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, _IFREQ_TUN.pack(name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def run_nft(ruleset: str) -> None:
    """Load a ruleset in the calling thread's namespace, as one transaction."""
    try:
        done = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True,
                              timeout=NFT_TIMEOUT_S)
    except FileNotFoundError:
        raise NetworkError("nft is not installed; run `bash scripts/setup` (installs nftables)") from None
    if done.returncode != 0:
        raise NetworkError(f"nft refused the rules: {done.stderr.strip()}")


def _delete_nft_table(family: str, table: str) -> bool:
    try:
        done = subprocess.run(["nft", "delete", "table", family, table], capture_output=True, text=True,
                              timeout=NFT_TIMEOUT_S)
    except FileNotFoundError:  # no nft, so no table either
        return False
    return done.returncode == 0


def ensure_ip_forward() -> None:
    """Children are routed through the host, which needs IPv4 forwarding on."""
    if IP_FORWARD.read_text().strip() != "1":
        IP_FORWARD.write_text("1\n")
        log.warning("enabled IPv4 forwarding (net.ipv4.ip_forward=1): nat sandboxes are routed through the host")


def host_resolver(resolv_conf: Path = RESOLV_CONF) -> ipaddress.IPv4Address | None:
    """The first IPv4 nameserver of the host that a namespace can reach (not a loopback one)."""
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                address = ipaddress.ip_address(words[1])
            except ValueError:
                continue
            if isinstance(address, ipaddress.IPv4Address) and not address.is_loopback:
                return address
    return None


def slots_in_use_on_host(pool: AddressPool) -> set[int]:
    """Pool slots whose addresses some host interface already has (another daemon, say)."""
    with IPRoute() as ipr:
        addresses = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=2)]
    return {slot for a in addresses if (slot := pool.slot_of(ipaddress.IPv4Address(a))) is not None}


def _configure_namespace(net: ChildNetwork) -> int:
    """Inside the child's namespace: loopback, veth end, tap, default route, forwarding, rules."""
    tap_fd = open_tap()
    try:
        with IPRoute() as ipr:
            for ifname, address in ((NS_VETH, net.lease.ns_address), (TAP, netconf.GATEWAY)):
                index = ipr.link_lookup(ifname=ifname)[0]
                ipr.addr("add", index=index, address=str(address), prefixlen=30)
                ipr.link("set", index=index, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=str(net.lease.host_address))
        IP_FORWARD.write_text("1\n")  # this thread is in the namespace, so this is the namespace's own
        run_nft(namespace_ruleset(net))
    except BaseException:
        os.close(tap_fd)
        raise
    return tap_fd


def create_child_network(net: ChildNetwork) -> int:
    """Build the namespace, veth pair, tap and rules of one child; return the tap's fd for the VMM.

    On any failure whatever was made is removed again before the error is raised.
    """
    name, link = netns_name(net.sandbox_id), host_link(net.sandbox_id)
    try:
        ensure_ip_forward()
        create_namespace(name)
        with IPRoute() as ipr:
            ipr.link("add", ifname=link, kind="veth", peer={"ifname": NS_VETH, "net_ns_fd": name})
            index = ipr.link_lookup(ifname=link)[0]
            ipr.addr("add", index=index, address=str(net.lease.host_address), prefixlen=30)
            ipr.link("set", index=index, state="up")
        run_nft(host_ruleset(net))
        return in_namespace(name, lambda: _configure_namespace(net))
    except (OSError, NetlinkError, NetworkError, subprocess.SubprocessError) as exc:
        release_network(net.sandbox_id)
        if isinstance(exc, NetworkError):
            raise
        raise NetworkError(f"cannot set up the network of {net.sandbox_id}: {exc}") from None


def replace_egress(net: ChildNetwork) -> None:
    """Load a running child's namespace rules again with ``net.policy``: one nft transaction, so its
    connections see the old rules or the new ones, never none (established ones are kept)."""
    try:
        in_namespace(netns_name(net.sandbox_id), lambda: run_nft(namespace_ruleset(net)))
    except (OSError, NetlinkError, subprocess.SubprocessError) as exc:
        raise NetworkError(f"cannot change the egress rules of {net.sandbox_id}: {exc}") from None


def release_network(sandbox_id: str) -> list[str]:
    """Remove the host rules, the veth pair and the namespace of ``sandbox_id``; idempotent.

    Returns what was actually removed (empty when nothing was left). The tap goes with the last
    holder of its fd (the VMM), the namespace end of the veth with its peer. Safe to call from
    an event loop's thread: pyroute2's blocking API runs its own loop, so this runs on its own.
    """
    return _on_own_thread(lambda: _release_network(sandbox_id))


def _release_network(sandbox_id: str) -> list[str]:
    removed = []
    if _delete_nft_table("ip", host_table(sandbox_id)):
        removed.append(f"nft table {host_table(sandbox_id)}")
    with IPRoute() as ipr:
        indexes = ipr.link_lookup(ifname=host_link(sandbox_id))
        for index in indexes:
            try:
                ipr.link("del", index=index)
                removed.append(f"link {host_link(sandbox_id)}")
            except NetlinkError as exc:
                if exc.code != 19:  # ENODEV: it went away meanwhile
                    raise
    if remove_namespace(netns_name(sandbox_id)):
        removed.append(f"netns {netns_name(sandbox_id)}")
    return removed


def _sandbox_of_link(ifname: str) -> str:
    return SANDBOX_ID_PREFIX + ifname.removeprefix(LINK_PREFIX)


def leftover_networks() -> list[Leftover]:
    """Every forkd-named namespace, host link and host nft table, live or not, for re-adoption."""
    return _on_own_thread(_leftover_networks)


def _leftover_networks() -> list[Leftover]:
    found = [Leftover("netns", n, n.removeprefix(NETNS_PREFIX)) for n in netns.listnetns()
             if n.startswith(NETNS_PREFIX)]
    with IPRoute() as ipr:
        found += [Leftover("link", n, _sandbox_of_link(n)) for link in ipr.get_links()
                  if (n := link.get_attr("IFLA_IFNAME")).startswith(LINK_PREFIX)]
    found += [Leftover("nft", t, t.removeprefix(HOST_TABLE_PREFIX).replace("_", "-")) for t in _nft_tables("ip")
              if t.startswith(HOST_TABLE_PREFIX)]
    return found


def _nft_tables(family: str) -> list[str]:
    try:
        done = subprocess.run(["nft", "list", "tables", family], capture_output=True, text=True,
                              timeout=NFT_TIMEOUT_S)
    except FileNotFoundError:
        return []
    return [line.split()[2] for line in done.stdout.splitlines() if line.startswith("table ")]

