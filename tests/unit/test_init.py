"""The guest's PID 1: the parts that can run safely on a host."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forkd.guest import init


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        ("console=ttyS0 forkd.hostname=sb-42 quiet\n", "sb-42"),
        ("forkd.hostname=a forkd.hostname=b", "b"),
        ("forkd.hostnames=x forkd.hostname", None),
        ("", None),
    ],
)
def test_cmdline_value(cmdline: str, expected: str | None) -> None:
    assert init.cmdline_value(cmdline, init.HOSTNAME_PARAM) == expected


def test_refuses_to_run_unless_pid_1() -> None:
    proc = subprocess.run([sys.executable, "-m", "forkd.guest.init"], capture_output=True, timeout=20)
    assert proc.returncode != 0 and b"PID 1" in proc.stderr


def test_ifreq_layout_matches_struct_ifreq() -> None:
    assert init._IFREQ_FLAGS.size == 40  # sizeof(struct ifreq) on Linux


def test_mounts_parents_come_first() -> None:
    targets = [m.target for m in init.MOUNTS]
    for i, target in enumerate(targets):
        assert all(not target.startswith(later + "/") for later in targets[i + 1 :])


def test_network_structs_match_the_kernel_layout() -> None:
    assert init._IFREQ_ADDR.size == 40  # struct ifreq
    assert init._RTENTRY.size == 120  # struct rtentry on x86_64
    assert init._sockaddr_in("172.29.255.1") == b"\x02\x00\x00\x00\xac\x1d\xff\x01" + b"\0" * 8


def test_default_route_entry() -> None:
    entry = init.default_route("172.29.255.1")
    assert len(entry) == 120 and entry[24:40] == init._sockaddr_in("172.29.255.1")
    assert int.from_bytes(entry[56:58], "little") == init.RTF_UP | init.RTF_GATEWAY
