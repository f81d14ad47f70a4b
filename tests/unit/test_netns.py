"""A child's network objects made and removed for real (root, ip and nft: without them these fail; no VM, no traffic)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess

import pytest

from forkd.host.netns import create_child_network, leftover_networks, netns_name, release_network, replace_egress
from forkd.host.netpolicy import AddressPool, EgressPolicy, egress_policy, parse_allow_spec
from forkd.host.nftrules import ChildNetwork
from forkd.validation import new_sandbox_id

pytestmark = pytest.mark.root("ip", "nft")
POOL = AddressPool.parse("10.213.0.0/16")


def test_create_list_release_idempotently() -> None:
    sandbox_id = new_sandbox_id()
    slot = POOL.capacity - 1  # far from what a running daemon would lease first
    tap_fd = create_child_network(ChildNetwork(sandbox_id, POOL.lease(slot), POOL.network, EgressPolicy(),
                                               ipaddress.IPv4Address("192.0.2.53")))
    try:
        kinds = {x.kind for x in leftover_networks() if x.sandbox_id == sandbox_id}
        assert kinds == {"netns", "link", "nft"}
    finally:
        os.close(tap_fd)
        removed = release_network(sandbox_id)
    assert len(removed) == 3, removed
    assert [x for x in leftover_networks() if x.sandbox_id == sandbox_id] == []
    assert release_network(sandbox_id) == []


def test_release_works_from_an_event_loop() -> None:
    async def release() -> list[str]:  # the daemon reaps from its loop's thread
        return release_network(new_sandbox_id())
    assert asyncio.run(release()) == []


def test_a_running_childs_egress_is_replaced_in_its_namespace() -> None:
    """What update_network does: the namespace's table is loaded again, in one nft transaction."""
    sandbox_id = new_sandbox_id()
    net = ChildNetwork(sandbox_id, POOL.lease(POOL.capacity - 2), POOL.network, EgressPolicy(), None)
    tap_fd = create_child_network(net)

    def table() -> str:
        done = subprocess.run(["ip", "netns", "exec", netns_name(sandbox_id), "nft", "list", "table", "ip", "forkd"],
                              capture_output=True, text=True, timeout=30, check=True)
        return done.stdout

    try:
        assert 'oifname "veth0" accept' in table()
        closed = egress_policy("deny", [parse_allow_spec("198.51.100.0/24:443/tcp")], dns=False)
        replace_egress(ChildNetwork(sandbox_id, net.lease, POOL.network, closed, None))
        rules = table()
        assert 'oifname "veth0" accept' not in rules
        assert "ip daddr 198.51.100.0/24 tcp dport 443 accept" in rules
    finally:
        os.close(tap_fd)
        release_network(sandbox_id)
