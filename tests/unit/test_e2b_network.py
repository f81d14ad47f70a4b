"""E2B's network options mapped onto forkd's network modes and egress policy, and update_network on
the control plane (the real front and runtime over the FakeVmm)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from test_e2b_tenants import A, _client, _front, _key
from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.e2b.errors import E2BError
from forkd.e2b.network import egress, net_request
from forkd.vmm.fake import FakeVmm


def test_no_option_means_no_link_and_any_option_a_nat_link() -> None:
    assert net_request(None, None, None).mode == "none"
    opened = net_request(True, None, None)
    assert opened.mode == "nat" and opened.egress.default == "allow" and opened.egress.deny == ()
    assert net_request(None, [], None).mode == "nat"


def test_internet_off_or_everything_denied_lets_out_only_the_allow_list() -> None:
    for policy in (egress(False, ["203.0.113.5"], None), egress(None, ["203.0.113.5"], ["0.0.0.0/0"])):
        assert policy.default == "deny" and not policy.dns
        assert [str(r.cidr) for r in policy.allow] == ["203.0.113.5/32"]


def test_a_deny_list_keeps_the_rest_open_and_allowed_entries_win() -> None:
    policy = egress(True, ["198.51.100.7"], ["198.51.100.0/24", "192.0.2.1"])
    assert policy.default == "allow"
    assert policy.deny == (ipaddress.IPv4Network("198.51.100.0/24"), ipaddress.IPv4Network("192.0.2.1/32"))
    assert [str(r.cidr) for r in policy.allow] == ["198.51.100.7/32"]
    assert egress(True, ["198.51.100.7"], None).allow == ()  # nothing to be an exception to


@pytest.mark.parametrize("entry", ["example.com", "*.example.com", "localhost"])
def test_domains_are_refused_as_not_enforceable(entry: str) -> None:
    with pytest.raises(E2BError, match="domain name") as caught:
        egress(True, [entry], None)
    assert caught.value.status == 400


@pytest.mark.parametrize("entry", ["10.0.0.1/8", "2001:db8::/32", "300.1.1.1", ""])
def test_malformed_entries_are_refused(entry: str) -> None:
    with pytest.raises(E2BError) as caught:
        egress(None, None, [entry])
    assert caught.value.status == 400


def test_update_network_needs_a_link_and_a_domain_is_refused_on_create(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm())
        try:
            async with _client(_front(runtime)) as client:
                made = (await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})).json()
                answer = await client.put(f"/sandboxes/{made['sandboxID']}/network", headers=_key(A),
                                          json={"denyOut": ["0.0.0.0/0"]})
                assert answer.status_code == 409 and "allow_internet_access" in answer.json()["message"]
                refused = await client.post("/sandboxes", headers=_key(A), json={
                    "templateID": "base", "network": {"allowOut": ["example.com"]}})
                assert refused.status_code == 400 and "domain" in refused.json()["message"]
                missing = await client.put("/sandboxes/sb-000000000000/network", headers=_key(A), json={})
                assert missing.status_code == 404
        finally:
            await runtime.stop()

    run(scenario)
