"""E2B's network options through forkd's E2B front, with E2B's unmodified Python SDK.

There is no internet here, so what a guest may reach is checked where it is decided: a refused
destination fails at once inside the guest (the child's namespace answers with a TCP reset), and
the rules loaded in the child's namespace are read back (``ip netns exec``, as root). Prints
``ok NAME`` / ``FAIL NAME: why`` per check and exits non-zero if any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from e2b import CommandExitException, Sandbox

from checks import check, failures

TEMPLATE = os.environ["E2B_TEST_TEMPLATE"]
PROBE = ("python3 -c \"import socket, sys\ntry:\n socket.create_connection(('{ip}', 80), 20)\nexcept "
         "ConnectionRefusedError:\n sys.exit(3)\nexcept OSError as e:\n print(e); sys.exit(4)\"")


def rules(sbx: Sandbox) -> str:
    done = subprocess.run(["ip", "netns", "exec", f"forkd-{sbx.sandbox_id}", "nft", "list", "table", "ip", "forkd"],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def probe(sbx: Sandbox, ip: str) -> int:
    """3: refused at once (a reject rule), 4: any other failure (no route, timeout), 0: connected."""
    try:
        return sbx.commands.run(PROBE.format(ip=ip), timeout=120).exit_code
    except CommandExitException as exc:
        return exc.exit_code


def main() -> int:
    def no_option_no_link() -> None:
        sbx = Sandbox.create(TEMPLATE, timeout=600)
        try:
            assert probe(sbx, "203.0.113.5") == 4  # no link at all: unreachable, not refused by a rule
            assert subprocess.run(["ip", "netns", "pids", f"forkd-{sbx.sandbox_id}"],
                                  capture_output=True).returncode != 0  # and no namespace
        finally:
            sbx.kill()

    def deny_list_then_update() -> None:
        sbx = Sandbox.create(TEMPLATE, timeout=600, network={"deny_out": ["203.0.113.0/24"],
                                                             "allow_out": ["203.0.113.9"]})
        try:
            table = rules(sbx)
            assert "ip daddr 203.0.113.9 accept" in table and "ip daddr 203.0.113.0/24" in table, table
            assert probe(sbx, "203.0.113.5") == 3  # denied: reset inside the namespace
            sbx.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": ["198.51.100.0/24"]})
            table = rules(sbx)
            assert 'oifname "veth0" accept' not in table and "ip daddr 198.51.100.0/24 accept" in table, table
            assert probe(sbx, "192.0.2.10") == 3
            sbx.update_network({})  # omitted fields clear: everything beyond the host again
            assert 'oifname "veth0" accept' in rules(sbx)
        finally:
            sbx.kill()

    def kept_across_pause() -> None:
        sbx = Sandbox.create(TEMPLATE, timeout=600, network={"deny_out": ["203.0.113.0/24"]})
        try:
            assert sbx.pause() is True
            resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
            assert probe(resumed, "203.0.113.5") == 3  # a nat link with its deny rule again, not none (4)
        finally:
            sbx.kill()

    def internet_off() -> None:
        sbx = Sandbox.create(TEMPLATE, timeout=600, allow_internet_access=False)
        try:
            assert probe(sbx, "192.0.2.10") == 3
            assert 'oifname "veth0" accept' not in rules(sbx)
        finally:
            sbx.kill()

    check("no_option_no_link", no_option_no_link)
    check("deny_list_then_update", deny_list_then_update)
    check("internet_off", internet_off)
    check("kept_across_pause", kept_across_pause)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
