"""Running slow work off the event loop, on threads of its own: the store's, and long jobs'.

Removing a multi-gigabyte snapshot, copying a disk, fsyncing a memory file or walking a tree can
take seconds. Run on the event loop it stalls every restore, agent call and deadline in the
daemon; run on asyncio's default executor it can take all of its few threads, which forks use to
open (verify) their snapshot. So it runs here, on a small pool that nothing latency-bound waits for.

Jobs that take minutes or hours (writing or extracting a pack, hashing a pulled one, building an
image, the doctor's probes) have a pool of their own (:func:`long_job`): however many are asked
for, they hold at most ``JOB_THREADS`` threads and queue for them, so they never take the threads
forks and the store's short work wait on.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="forkd-store")
JOB_THREADS = 2
_JOBS = ThreadPoolExecutor(max_workers=JOB_THREADS, thread_name_prefix="forkd-job")


async def blocking(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on the store's threads; the caller's task waits, the loop does not."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


async def long_job(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on the long jobs' threads (queued while all are busy)."""
    return await asyncio.get_running_loop().run_in_executor(_JOBS, functools.partial(fn, *args, **kwargs))


async def remove_tree(path: Path) -> None:
    """Remove a directory tree (however large) without blocking the loop; a missing tree is fine."""
    await blocking(shutil.rmtree, path, ignore_errors=True)
