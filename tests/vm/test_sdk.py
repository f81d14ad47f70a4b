"""The E2B-shaped SDK (``forkd.Sandbox``, ``forkd.AsyncSandbox``) against the real daemon and real guests."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd import AsyncSandbox, CommandExitException, NotFoundException, Sandbox, TimeoutException
from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sdk_env(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str]) -> Iterator[None]:
    """Point the SDK at the test daemon and its snapshot, as a user would with FORKD_URL/FORKD_TEMPLATE."""
    saved = {key: os.environ.get(key) for key in ("FORKD_URL", "FORKD_TEMPLATE")}
    os.environ["FORKD_URL"] = f"unix://{vm_env['FORKD_SOCKET']}"
    os.environ["FORKD_TEMPLATE"] = snapshot_tag
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def sbx(sdk_env: None) -> Iterator[Sandbox]:
    with Sandbox.create(envs={"GREETING": "hi"}, metadata={"owner": "tests"}, timeout=3600) as sandbox:
        yield sandbox


def test_commands_envs_metadata_and_exit(sbx: Sandbox) -> None:
    assert sbx.commands.run("echo $GREETING $EXTRA", envs={"EXTRA": "there"}).stdout == "hi there\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("cat", stdin="piped").stdout == "piped"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo oops >&2; exit 7")
    assert (failed.value.exit_code, failed.value.stderr) == (7, "oops\n")
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    info = sbx.get_info()
    assert (info.sandbox_id, info.metadata, info.state) == (sbx.sandbox_id, {"owner": "tests"}, "running")
    assert info.end_at is not None and info.end_at > info.started_at
    assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list()]


def test_stdout_callbacks_arrive_while_the_command_runs(sbx: Sandbox) -> None:
    """The command only ends once the callback has seen its first line and answered through the files API."""
    helper = Sandbox.connect(sbx.sandbox_id)
    seen: list[str] = []

    def on_stdout(text: str) -> None:
        seen.append(text)
        if "waiting" in text:
            helper.files.write("/tmp/go", "")

    try:
        result = sbx.commands.run("rm -f /tmp/go; echo waiting; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo go",
                                  on_stdout=on_stdout, timeout=60)
    finally:
        helper.close()
    assert result.stdout == "waiting\ngo\n"
    assert "".join(seen) == result.stdout


def test_background_handle_stdin_list_and_kill(sbx: Sandbox) -> None:
    reader = sbx.commands.run("read line; echo got $line", background=True, stdin=True)
    reader.send_stdin("ping\n")
    assert reader.wait().stdout == "got ping\n"

    sleeper = sbx.commands.run("sleep 600", background=True)
    assert any(p.pid == sleeper.pid and p.running for p in sbx.commands.list())
    assert sleeper.kill() is True
    with pytest.raises(CommandExitException) as killed:
        sleeper.wait()
    assert killed.value.exit_code == 128 + 9
    assert sbx.commands.kill(sleeper.pid) is False


def test_files_binary_and_50_mib_round_trip(sbx: Sandbox, tmp_path: Path) -> None:
    every_byte = bytes(range(256)) * 17
    sbx.files.write("/root/bin.dat", every_byte)
    assert bytes(sbx.files.read("/root/bin.dat", format="bytes")) == every_byte

    big = os.urandom(50 << 20)
    source = tmp_path / "big.bin"
    source.write_bytes(big)
    with source.open("rb") as handle:  # a file object is streamed, not read whole
        sbx.files.write("/root/big.bin", handle)
    assert sbx.files.get_info("/root/big.bin").size == len(big)
    digest = hashlib.sha256()
    for chunk in sbx.files.read("/root/big.bin", format="stream"):
        digest.update(chunk)
    assert digest.hexdigest() == hashlib.sha256(big).hexdigest()
    sbx.files.remove("/root/big.bin")


def test_files_management(sbx: Sandbox) -> None:
    assert sbx.files.make_dir("/root/proj/src") is True
    assert sbx.files.make_dir("/root/proj/src") is False
    sbx.files.write_files([{"path": "/root/proj/src/a.py", "data": "a = 1\n"},
                           {"path": "/root/proj/b.txt", "data": b"b"}])
    assert sorted(e.name for e in sbx.files.list("/root/proj")) == ["b.txt", "src"]
    assert sorted(e.path for e in sbx.files.list("/root/proj", depth=2)) == [
        "/root/proj/b.txt", "/root/proj/src", "/root/proj/src/a.py"]
    moved = sbx.files.rename("/root/proj/b.txt", "/root/proj/c.txt")
    assert (moved.name, moved.size, moved.type.value) == ("c.txt", 1, "file")
    assert sbx.files.exists("/root/proj/c.txt") and not sbx.files.exists("/root/proj/b.txt")
    sbx.files.remove("/root/proj")
    assert not sbx.files.exists("/root/proj")
    with pytest.raises(NotFoundException):
        sbx.files.read("/root/proj/c.txt")


def test_run_code_keeps_state_and_streams(sbx: Sandbox) -> None:
    lines = []
    first = sbx.run_code("import numpy as np\ntotal = int(np.arange(10).sum())\nprint('computed')\ntotal",
                         on_stdout=lambda message: lines.append(message.line))
    assert first.text == "45" and first.results[0].json == 45
    assert first.logs.stdout == ["computed\n"] and lines == ["computed\n"]
    assert sbx.run_code("total * 2").text == "90"
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert sbx.eval("total + 1") == 46
    assert sbx.run_code("total", context="other").error.name == "NameError"


def test_timeout_is_enforced_and_renewable(sdk_env: None) -> None:
    short = Sandbox(timeout=600)  # E2B v1 spelling of Sandbox.create
    try:
        assert short.get_info().end_at is not None
        short.set_timeout(2)  # replaces the 600 s deadline: it dies within seconds, not minutes
        deadline = time.monotonic() + 60
        while short.is_running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not short.is_running(), "the daemon did not kill the sandbox after its timeout"
        assert Sandbox.kill(short.sandbox_id) is False
    finally:
        short.close()


def test_fork_children_carry_the_parent_state(sbx: Sandbox) -> None:
    sbx.run_code("forked_marker = 41")
    children = sbx.fork(2)
    try:
        assert len({child.sandbox_id for child in children}) == 2
        assert [child.eval("forked_marker + 1") for child in children] == [42, 42]
    finally:
        for child in children:
            child.kill()
            child.close()


def test_async_sandbox(sdk_env: None) -> None:
    async def scenario() -> None:
        chunks: list[str] = []

        async def on_stdout(text: str) -> None:
            chunks.append(text)

        async with await AsyncSandbox.create() as sandbox:
            result = await sandbox.commands.run("echo one; echo two", on_stdout=on_stdout)
            assert result.stdout == "one\ntwo\n" and "".join(chunks) == result.stdout
            handle = await sandbox.commands.run("sleep 600", background=True)
            assert await handle.kill()
            await sandbox.files.write("/tmp/x.bin", b"\x00\xff")
            assert await sandbox.files.read("/tmp/x.bin", format="bytes") == bytearray(b"\x00\xff")
            await sandbox.run_code("counter = 1")
            assert (await sandbox.run_code("counter + 1")).text == "2"
            assert await sandbox.eval("counter") == 1
            results = await asyncio.gather(*(sandbox.commands.run(f"echo {i}") for i in range(3)))
            assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
            async with (await sandbox.fork(1))[0] as child:
                assert await child.eval("counter") == 1 and child.sandbox_id != sandbox.sandbox_id
                chunks_read = [chunk async for chunk in await child.files.read("/tmp/x.bin", format="stream")]
                assert b"".join(chunks_read) == b"\x00\xff"
            sandbox_id = sandbox.sandbox_id
        assert sandbox_id not in [s.sandbox_id for s in await AsyncSandbox.list()]

    asyncio.run(scenario())
