"""The TypeScript SDK (sdk/typescript) against the real daemon and guests: its node tests (dist/test/vm) fork,
stream exec output, run code, move files, BRANCH diff and live without waiting, set a pool, suspend and resume a
workspace, and call over TCP with the token, on the shared daemon and warm snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import node_tests

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm


def test_typescript_sdk_against_a_real_daemon(typescript_sdk: Path, daemon: Controller, snapshot_tag: str,
                                              vm_env: dict[str, str]) -> None:
    env = {key: value for key, value in vm_env.items() if key != "FORKD_URL"}
    env.update(FORKD_URL=f"unix://{vm_env['FORKD_SOCKET']}", FORKD_TEST_SNAPSHOT=snapshot_tag,
               FORKD_TEST_TCP_URL=f"http://{vm_env['FORKD_LISTEN']}")
    node_tests(typescript_sdk, "vm", env, timeout_s=3600)
