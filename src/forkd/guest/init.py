"""PID 1 of a forkd guest: mount the pseudo filesystems, bring up loopback and eth0, keep the
agent running and reap every orphan.

Stdlib only; runs as ``python3 -m forkd_guest.init``. If PID 1 exits the kernel panics, so
every setup step logs its failure and carries on, and the supervisor loop survives anything.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from . import netconf

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8


class Mount(NamedTuple):
    source: str
    target: str
    fstype: str
    flags: int
    data: str = ""


#: In mount order: /proc first (the hostname comes from /proc/cmdline), /dev before /dev/*.
#: /tmp is tmpfs so scratch files live in this VM's own memory, never on the shared base disk.
MOUNTS = (
    Mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC),
    Mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC),
    Mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755"),
    Mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666"),
    Mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    Mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"),
    Mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
)

#: What udev would normally add to devtmpfs; shells need /dev/fd for process substitution.
DEV_SYMLINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}

HOSTNAME_PARAM = "forkd.hostname"

PYTHON = sys.executable or "/usr/bin/python3"
AGENT_ARGV = (PYTHON, "-m", "forkd_guest.agent")
AGENT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONPATH": "/opt/forkd",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}

#: Agent restart backoff: doubles while the agent keeps dying young, resets once it ran a while.
RESTART_BACKOFF_MIN_S = 0.1
RESTART_BACKOFF_MAX_S = 5.0
AGENT_STABLE_S = 30.0

# <linux/sockios.h>, <net/if.h>; struct ifreq is a 16-byte name then a 24-byte union whose
# first member, for these ioctls, is the short ifr_flags.
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFADDR = 0x8916
SIOCSIFNETMASK = 0x891C
SIOCADDRT = 0x890B
IFF_UP = 0x1
RTF_UP = 0x1
RTF_GATEWAY = 0x2
_IFREQ_FLAGS = struct.Struct("16sh22x")
#: struct ifreq with a struct sockaddr_in as the union.
_IFREQ_ADDR = struct.Struct("16s16s8x")
#: struct rtentry (x86_64): pad, dst, gateway, genmask, flags, pad, pad, pad, metric, dev, mtu, window,
#: irtt, tail padding to its 120 bytes.
_RTENTRY = struct.Struct("@L16s16s16sHhLPhPLLH6x")
_SOCKADDR_IN = struct.Struct("H2s4s8x")
RESOLV_CONF = "/etc/resolv.conf"


def log(message: str) -> None:
    try:
        print(f"forkd-init: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass  # a console that went away is no reason for PID 1 to die


def mount(spec: Mount) -> None:
    """mount(2) via libc: the guest has no util-linux guarantee and Python has no binding.

    Targets that are already mount points (the initramfs moves /dev, /proc and /sys over) are
    left alone: proc, sysfs and devtmpfs would happily stack a second mount on top.
    """
    os.makedirs(spec.target, exist_ok=True)
    if os.path.ismount(spec.target):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    data = spec.data.encode() or None
    if libc.mount(spec.source.encode(), spec.target.encode(), spec.fstype.encode(), spec.flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), spec.target)


def symlink(target: str, link: str) -> None:
    if not os.path.lexists(link):
        os.symlink(target, link)


def cmdline_value(cmdline: str, key: str) -> str | None:
    """The value of the last ``key=value`` word on a kernel command line, if any."""
    value = None
    for word in cmdline.split():
        name, sep, rest = word.partition("=")
        if sep and name == key:
            value = rest
    return value


def set_hostname_from_cmdline() -> None:
    with open("/proc/cmdline", encoding="utf-8") as f:
        hostname = cmdline_value(f.read(), HOSTNAME_PARAM)
    if hostname:
        socket.sethostname(hostname)


def bring_up_loopback() -> None:
    """Set IFF_UP on lo, so services inside the VM can talk over 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        _, flags = _IFREQ_FLAGS.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, _IFREQ_FLAGS.pack(b"lo", 0)))
        fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ_FLAGS.pack(b"lo", flags | IFF_UP))


def _sockaddr_in(address: str) -> bytes:
    return _SOCKADDR_IN.pack(socket.AF_INET, b"\0\0", socket.inet_aton(address))


def default_route(gateway: str) -> bytes:
    """A struct rtentry for ``default via gateway`` (no device: the kernel finds it from the gateway)."""
    anywhere = _sockaddr_in("0.0.0.0")
    return _RTENTRY.pack(0, anywhere, _sockaddr_in(gateway), anywhere, RTF_UP | RTF_GATEWAY, 0, 0, 0, 0, 0, 0, 0, 0)


def configure_network() -> None:
    """eth0 gets the fixed guest address and a default route; DNS goes to the gateway.

    Done once, in the parent, with ioctls (the root may have no iproute2); children inherit it.
    A VM without a NIC has no eth0 and simply has no network.
    """
    name = netconf.INTERFACE.encode()
    if not os.path.exists(f"/sys/class/net/{netconf.INTERFACE}"):
        log(f"no {netconf.INTERFACE}: this VM has no network")
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for request, address in ((SIOCSIFADDR, netconf.GUEST_ADDRESS), (SIOCSIFNETMASK, netconf.NETMASK)):
            fcntl.ioctl(sock, request, _IFREQ_ADDR.pack(name, _sockaddr_in(address)))
        _, flags = _IFREQ_FLAGS.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, _IFREQ_FLAGS.pack(name, 0)))
        fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ_FLAGS.pack(name, flags | IFF_UP))
        fcntl.ioctl(sock, SIOCADDRT, default_route(netconf.GATEWAY))
    with open(RESOLV_CONF + ".forkd", "w", encoding="ascii") as f:
        f.write(f"nameserver {netconf.NAMESERVER}\n")
    os.replace(RESOLV_CONF + ".forkd", RESOLV_CONF)


def _step(what: str, action: Callable[..., Any], *args: Any) -> None:
    try:
        action(*args)
    except Exception as exc:
        log(f"{what} failed: {exc}")


def set_up_system() -> None:
    for spec in MOUNTS:
        _step(f"mounting {spec.fstype} on {spec.target}", mount, spec)
    for link, target in DEV_SYMLINKS.items():
        _step(f"linking {link}", symlink, target, link)
    _step("setting the hostname", set_hostname_from_cmdline)
    _step("bringing up lo", bring_up_loopback)
    _step(f"configuring {netconf.INTERFACE}", configure_network)


def spawn_agent() -> int:
    return os.posix_spawn(PYTHON, list(AGENT_ARGV), AGENT_ENV)


def supervise() -> None:
    """Reap every child forever (orphans are reparented to PID 1) and restart the agent."""
    agent_pid: int | None = None
    agent_started = 0.0
    backoff = RESTART_BACKOFF_MIN_S
    while True:
        try:
            if agent_pid is None:
                agent_pid = spawn_agent()
                agent_started = time.monotonic()
                log(f"started agent, pid {agent_pid}")
            pid, status = os.wait()
            if pid != agent_pid:
                continue
            agent_pid = None
            lived = time.monotonic() - agent_started
            backoff = RESTART_BACKOFF_MIN_S if lived >= AGENT_STABLE_S else min(backoff * 2, RESTART_BACKOFF_MAX_S)
            log(f"agent {pid} exited ({os.waitstatus_to_exitcode(status)}) after {lived:.1f} s; restarting")
            time.sleep(backoff)
        except ChildProcessError:
            agent_pid = None  # nothing left to wait for, so no agent either
        except BaseException as exc:  # PID 1 must outlive even KeyboardInterrupt and bugs
            log(f"supervisor: {exc!r}")
            time.sleep(backoff)


def main() -> None:
    if os.getpid() != 1:
        sys.exit("forkd-init: refusing to run as anything but PID 1 (it mounts over /dev and /tmp)")
    set_up_system()
    supervise()


if __name__ == "__main__":
    main()
