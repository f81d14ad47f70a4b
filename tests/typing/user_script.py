"""A user's script, as the README writes it: `mypy --strict` must pass on it and see real types (not Any).

tests/unit/test_sdk_typing.py type-checks this directory; nothing here runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import assert_type, reveal_type

from forkd import (
    AsyncCommandHandle,
    AsyncController,
    AsyncSandbox,
    CommandHandle,
    CommandResult,
    ConnectionConfig,
    Controller,
    Execution,
    ForkdError,
    Sandbox,
    SandboxInfo,
)


def sync_use() -> None:
    with Sandbox.create(template="quickstart", timeout=300, envs={"STAGE": "dev"}, net="nat",
                        memory_limit_mib=512, api_key="ignored-by-forkd") as sbx:
        result = sbx.commands.run("uname -r")
        reveal_type(result.stdout)
        assert_type(result, CommandResult)
        assert_type(result.exit_code, int)
        handle = sbx.commands.run("sleep 600", background=True)
        assert_type(handle, CommandHandle)
        assert_type(handle.pid, int)
        assert_type(handle.wait(), CommandResult)
        assert_type(handle.kill(), bool)
        assert_type(sbx.files.read("/etc/hostname"), str)
        assert_type(sbx.files.read("/bin/sh", format="bytes"), bytearray)
        assert_type(sbx.files.read("/bin/sh", format="stream"), Iterator[bytes])
        assert_type(sbx.run_code("1 + 1"), Execution)
        assert_type(sbx.run_code("1 + 1").text, str | None)
        assert_type(sbx.fork(count=2), list[Sandbox])
        assert_type(sbx.kill(), bool)
        assert_type(sbx.is_running(), bool)
        assert_type(sbx.api, Controller)
    assert_type(Sandbox.kill("sb-000000000000"), bool)
    assert_type(Sandbox.list(), list[SandboxInfo])
    assert_type(Sandbox.connect("sb-000000000000", connection=ConnectionConfig.from_env()), Sandbox)


async def async_use() -> None:
    async with await AsyncSandbox.create(allow_internet_access=False) as sbx:
        result = await sbx.commands.run("echo hi")
        assert_type(result.stdout, str)
        handle = await sbx.commands.run("sleep 600", background=True)
        assert_type(handle, AsyncCommandHandle)
        assert_type(await handle.wait(), CommandResult)
        assert_type(await sbx.files.read("/bin/sh", format="stream"), AsyncIterator[bytes])
        assert_type(await sbx.fork(), list[AsyncSandbox])
        assert_type(sbx.api, AsyncController)
    assert_type(await AsyncSandbox.list(), list[SandboxInfo])


def errors() -> None:
    try:
        sync_use()
    except ForkdError as exc:
        assert_type(exc.code, str)
        assert_type(exc.status, int)


if __name__ == "__main__":
    asyncio.run(async_use())


def controller_use() -> None:
    with Controller() as api:
        forked = api.fork("quickstart", 2, net="nat")
        assert_type(forked["sandboxes"][0]["id"], str)
        assert_type(api.sandboxes()[0]["created_at"], float)
        assert_type(api.snapshot("quickstart")["status"], str)
        assert_type(api.health()["ok"], bool)
        assert_type(api.read_file(forked["sandboxes"][0]["id"], "/etc/hostname"), bytes)
        assert_type(api.kill(forked["sandboxes"][0]["id"]), None)


async def async_controller_use() -> None:
    async with AsyncController() as api:
        assert_type((await api.sandboxes())[0]["id"], str)
        assert_type(await api.set_timeout("sb-000000000000", 60), float)
