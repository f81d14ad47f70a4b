"""Mistakes `mypy --strict` must report (tests/unit/test_sdk_typing.py expects exactly these errors, by line)."""

from __future__ import annotations

from forkd import Sandbox

sbx = Sandbox.create(templat="py")  # error: unexpected keyword argument
handle = sbx.commands.run("sleep 1", background=True)
print(handle.stdout)  # error: a handle has no stdout until wait()
sbx.commands.run("true", timeout="60")  # error: timeout is a number
text: bytes = sbx.files.read("/etc/hostname")  # error: text mode answers str
