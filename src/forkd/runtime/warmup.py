"""Warming a pool member: run a fork's first calls in it ahead of time, then stop it.

Under TCG every guest code path a VMM runs for the first time is translated first, and the
translations live in that QEMU process: a snapshot cannot carry them. A cold member (started with
``-incoming defer``) leaves all of that to the child's first calls — its reseed, its first eval —
so it saves the child only the VMM's start. A warm member has loaded its state, continued, answered
a reseed (throwaway entropy), a ping, an eval and a cell in a scratch context that is then deleted,
and was stopped; a fork that takes it continues it and reseeds it for real.

Nothing of the warm-up is left for the child to see or to share: the scratch context's process is
killed (the default context, its variables and execution count are never touched); the template's
Python and numpy generators are replaced outright by the real reseed, and the kernel CRNG gets the
real entropy on top of what it already had — the member's own vmgenid reseeded it at load, before
any warm-up ran (docs/architecture.md, "Pools of ready VMMs").
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, connect_when_answering
from forkd.vmm.base import SavedVm, Vmm, VmHandle

WARMUP_TIMEOUT_S = 120.0  # a member warms while forks and other members compete for the CPUs
# TCG's translation buffer of a warm member. Restore, reseed, eval and a cell translate ~28 MiB of
# guest code on the quickstart snapshot: a 16 MiB buffer was flushed 4 times during the warm-up and
# 3 more in the child's first calls, which so found nothing translated; 32 MiB held the warm-up with
# little to spare. The buffer's pages count only once written, so 64 costs what 32 does and leaves
# the child's own code room before a flush throws the warm-up away.
TRANSLATION_CACHE_MIB = 64
SCRATCH_PREFIX = "forkd-warmup-"
# What the first cells of a child typically run: array creation, arithmetic, a reduction, a
# conversion (numpy is the default snapshot's warm module), and a plain-Python cell with output.
NUMPY_EXPR = "float((numpy.arange(16.0).reshape(4, 4) @ numpy.ones(4)).sum())"
PYTHON_EXPR = "sum(len(str(i)) for i in range(64))"
CELL = "print(sorted({'b': 2, 'a': 1}.items()))"


def reseed_args(sandbox_id: str) -> dict[str, Any]:
    """A reseed request: fresh host entropy for the kernel and the interpreters, the host's clock,
    and the sandbox id as hostname."""
    return {"entropy_b64": protocol.b64encode(os.urandom(64)), "time_ns": time.time_ns(),
            "hostname": sandbox_id, "sandbox_id": sandbox_id}


async def warm(vmm: Vmm, vm: VmHandle, saved: SavedVm, sandbox_id: str,
               timeout_s: float = WARMUP_TIMEOUT_S) -> AgentClient:
    """Load ``saved`` into the prepared ``vm``, run the warm-up and stop it; the agent connection stays open.

    The caller kills the VMM if this raises.
    """
    await vmm.complete_restore(vm, saved)
    agent, _ = await connect_when_answering(vm, timeout_s, protocol.OP_RESEED, reseed_args(sandbox_id))
    try:
        await _first_calls(agent, timeout_s)
        await vmm.pause(vm)
    except BaseException:
        await agent.close()
        raise
    return agent


async def _first_calls(agent: AgentClient, timeout_s: float) -> None:
    """An eval and a cell in a scratch context (deleted again), then a ping, each as a fork would send it."""
    warm_modules = (await agent.call(protocol.OP_PING, timeout=timeout_s)).get("warm_modules") or []
    scratch = SCRATCH_PREFIX + secrets.token_hex(6)
    await agent.call(protocol.OP_CONTEXTS_CREATE, {"id": scratch}, timeout=timeout_s)
    try:
        expr = NUMPY_EXPR if "numpy" in warm_modules else PYTHON_EXPR
        await agent.call(protocol.OP_EVAL, {"expr": expr, "context": scratch}, timeout=timeout_s)
        await agent.call(protocol.OP_RUN_CODE, {"code": CELL, "context": scratch}, timeout=timeout_s)
    finally:
        await agent.call(protocol.OP_CONTEXTS_DELETE, {"id": scratch}, timeout=timeout_s)
    await agent.call(protocol.OP_PING, timeout=timeout_s)
