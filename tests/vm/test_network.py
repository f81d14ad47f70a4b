"""Per-child networks on real guests: NAT out to an "outside" namespace this test makes, egress
policy, isolation from other children and from the host, and cleanup after kill.

Traffic goes only to namespaces created here and to the host's own addresses.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.host.cgroups import leftover_cgroups
from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm

OUTSIDE_HOST = "192.168.250.1"  # the host's end of the outside link
OUTSIDE = "192.168.250.2"  # also FORKD_DNS of the test daemon (tests/conftest.py)
OPEN_PORT, OTHER_PORT = 8080, 8081
# Connect, read a line; prints ok/refused/timeout/unreachable so the test sees how it failed.
PROBE = """
import errno, socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=4) as s:
        print("ok", s.recv(200).decode().strip())
except socket.timeout:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("unreachable" if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH) else f"error {e.errno}")
"""
# Answers every connection on the given ports with "hello <peer address>".
SERVER = """
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16)
    while True:
        c, peer = s.accept()
        c.sendall(f"hello {peer[0]}\\n".encode()); c.close()
def dns():  # a stand-in resolver: answers each datagram on port 53 with who sent it
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 53))
    while True:
        data, peer = s.recvfrom(512)
        s.sendto(f"answer {peer[0]}".encode(), peer)
for port in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(port),)).start()
threading.Thread(target=dns).start()
print("listening", flush=True)
"""


DNS_PROBE = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(4)
s.sendto(b"query", (open("/etc/resolv.conf").read().split()[-1], 53))
try:
    print(s.recv(512).decode())
except socket.timeout:
    print("timeout")
"""


def dns_probe(daemon: Controller, sandbox_id: str) -> str:
    return daemon.exec(sandbox_id, ["python3", "-c", DNS_PROBE], timeout_s=30)["stdout"].strip()


def probe(daemon: Controller, sandbox_id: str, host: str, port: int) -> str:
    result = daemon.exec(sandbox_id, ["python3", "-c", PROBE, host, str(port)], timeout_s=30)
    return result["stdout"].strip()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _server_in(netns: str, *ports: int, dns: bool = False) -> subprocess.Popen[str]:
    script = SERVER if dns else SERVER.replace("threading.Thread(target=dns).start()", "")
    server = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", sys.executable, "-c", script,
                               *map(str, ports)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    return server


@pytest.fixture(scope="module")
def outside() -> Iterator[str]:
    """A namespace standing in for the internet, routed from the host over its own veth pair."""
    name, link = f"fdtest-out-{os.getpid()}", f"fdto{os.getpid() % 100000}"
    _ip("netns", "add", name)
    server = None
    try:
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("addr", "add", f"{OUTSIDE_HOST}/24", "dev", link)
        _ip("link", "set", link, "up")
        _ip("-n", name, "addr", "add", f"{OUTSIDE}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "route", "add", "default", "via", OUTSIDE_HOST)
        server = _server_in(name, OPEN_PORT, OTHER_PORT, dns=True)
        yield name
    finally:
        if server is not None:
            server.kill()
            server.wait()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", link)
        _ip("netns", "del", name)


@pytest.fixture
def fork_one(daemon: Controller, snapshot_tag: str) -> Iterator:
    made: list[str] = []

    def fork(**options: object) -> dict:
        result = daemon.fork(snapshot_tag, 1, **options)
        assert result["errors"] == [], result["errors"]
        made.append(result["sandboxes"][0]["id"])
        return result["sandboxes"][0]

    yield fork
    for sandbox_id in made:
        with contextlib.suppress(Exception):
            daemon.kill(sandbox_id)


def test_nat_child_reaches_the_outside_masqueraded(daemon: Controller, outside: str, fork_one) -> None:
    child = fork_one(net="nat")
    assert child["net"]["mode"] == "nat" and ipaddress.ip_address(child["net"]["address"])
    addr = daemon.exec(child["id"], "cat /sys/class/net/eth0/address; cat /etc/resolv.conf")["stdout"]
    assert "52:54:00:fd:00:02" in addr and "nameserver 172.29.255.1" in addr
    # NAT twice: to the namespace's address, then out of the host as the host's address on that link.
    assert probe(daemon, child["id"], OUTSIDE, OPEN_PORT) == f"ok hello {OUTSIDE_HOST}"
    assert dns_probe(daemon, child["id"]) == f"answer {OUTSIDE_HOST}"  # the gateway relays DNS to FORKD_DNS


def test_children_reach_neither_each_other_nor_the_host(daemon: Controller, outside: str, fork_one) -> None:
    a, b = fork_one(net="nat"), fork_one(net="nat")
    assert a["net"]["address"] != b["net"]["address"], "each child has its own /30"
    # A listener in B's namespace, on B's address, that answers there: A failing to reach it means A is blocked
    # (by the host's forward rules and by B's namespace, which takes no connections from outside).
    b_netns = f"forkd-{b['id']}"
    b_server = _server_in(b_netns, 9000)
    host_listener = socket.create_server(("0.0.0.0", 0))
    host_port = host_listener.getsockname()[1]
    try:
        control = subprocess.run(["nsenter", f"--net=/run/netns/{b_netns}", sys.executable, "-c", PROBE,
                                  b["net"]["address"], "9000"], capture_output=True, text=True, timeout=30)
        assert control.stdout.startswith("ok hello"), control
        assert not probe(daemon, a["id"], b["net"]["address"], 9000).startswith("ok")
        host_end = str(ipaddress.ip_address(a["net"]["address"]) - 1)
        for host_address in (host_end, OUTSIDE_HOST):  # the host's own addresses
            assert not probe(daemon, a["id"], host_address, host_port).startswith("ok"), host_address
    finally:
        host_listener.close()
        b_server.kill()
        b_server.wait()


def _nft(ruleset: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=ruleset, check=True, capture_output=True, text=True, timeout=30)


def _host_probe(host: str, port: int) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, host, str(port)], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_nat_child_reaches_no_host_service_published_by_dnat_nor_link_local(daemon: Controller, outside: str,
                                                                             fork_one) -> None:
    """A port the host publishes by DNAT (as container runtimes do) is a host service; 169.254.169.254 is
    where clouds serve credentials. Both are set up here on the test's own addresses and namespaces."""
    published, metadata = 9090, "169.254.169.254"
    table = f"fdtest_publish_{os.getpid()}"
    dnat = f"ip daddr {OUTSIDE_HOST} tcp dport {published} dnat to {OUTSIDE}:{OTHER_PORT}"
    _nft(f"table ip {table} {{\n"
         f"  chain prerouting {{ type nat hook prerouting priority dstnat; {dnat}; }}\n"
         f"  chain output {{ type nat hook output priority -100; {dnat}; }}\n}}\n")
    _ip("-n", outside, "addr", "add", f"{metadata}/32", "dev", "eth0")
    _ip("route", "add", f"{metadata}/32", "via", OUTSIDE)
    try:
        child = fork_one(net="nat")
        # Controls: the host itself reaches both, so they are really served.
        assert _host_probe(OUTSIDE_HOST, published) == f"ok hello {OUTSIDE_HOST}"
        assert _host_probe(metadata, OPEN_PORT).startswith("ok hello")
        assert probe(daemon, child["id"], OUTSIDE, OPEN_PORT).startswith("ok")  # the child has a network
        assert probe(daemon, child["id"], OUTSIDE_HOST, published) == "refused"
        assert probe(daemon, child["id"], metadata, OPEN_PORT) == "refused"
        # An allow rule naming the metadata address does not open it.
        allowed = fork_one(net="nat", egress={"default": "deny", "allow": [{"cidr": f"{metadata}/32"}]})
        assert probe(daemon, allowed["id"], metadata, OPEN_PORT) == "refused"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("route", "del", f"{metadata}/32")
        subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True, timeout=30)


def test_deny_policy_admits_only_the_allow_list(daemon: Controller, outside: str, fork_one) -> None:
    child = fork_one(net="nat", egress={"default": "deny",
                                        "allow": [{"cidr": f"{OUTSIDE}/32", "ports": [OPEN_PORT], "protocol": "tcp"}]})
    assert probe(daemon, child["id"], OUTSIDE, OPEN_PORT).startswith("ok")
    assert probe(daemon, child["id"], OUTSIDE, OTHER_PORT) == "refused"  # rejected in its namespace
    assert dns_probe(daemon, child["id"]) == f"answer {OUTSIDE_HOST}"  # dns: true by default
    closed = fork_one(net="nat", egress={"default": "deny", "dns": False})
    assert dns_probe(daemon, closed["id"]) == "timeout"


def test_none_child_has_no_network(daemon: Controller, outside: str, fork_one) -> None:
    child = fork_one()
    assert child["net"] == {"mode": "none"}
    assert daemon.exec(child["id"], "cat /sys/class/net/eth0/carrier")["stdout"].strip() == "0"
    assert not probe(daemon, child["id"], OUTSIDE, OPEN_PORT).startswith("ok")
    assert not Path(f"/run/netns/forkd-{child['id']}").exists()


def _host_objects() -> dict[str, set[str]]:
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return {"netns": set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set(),
            "links": set(os.listdir("/sys/class/net")),
            "nft": set(tables.split("\n")) - {""},
            "cgroups": set(leftover_cgroups())}


def test_everything_is_removed_after_kill(daemon: Controller, snapshot_tag: str) -> None:
    before = _host_objects()
    result = daemon.fork(snapshot_tag, 2, net="nat", memory_limit_mib=512)
    assert result["errors"] == []
    ids = [s["id"] for s in result["sandboxes"]]
    during = _host_objects()
    for sandbox_id in ids:
        assert f"forkd-{sandbox_id}" in during["netns"] and sandbox_id in during["cgroups"]
        assert f"fkd{sandbox_id[3:]}" in during["links"]
    for sandbox_id in ids:
        daemon.kill(sandbox_id)

    def left() -> dict[str, set[str]]:
        """What these two left, and any nft table added since (the daemon's other sandboxes may come and go)."""
        names = {f"forkd-{i}" for i in ids} | {f"fkd{i[3:]}" for i in ids} | set(ids)
        now = _host_objects()
        found = {kind: {o for o in objects if any(name in o for name in names)} for kind, objects in now.items()}
        found["nft"] |= now["nft"] - before["nft"]
        return {kind: objects for kind, objects in found.items() if objects}

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == {}
