"""A VMM's jail, after Firecracker's jailer: its own uid and gid, pid and mount namespaces, rlimits.

Each VMM process is started on one dedicated thread that, for that start only, moves itself into
a new mount namespace and makes the next process it creates pid 1 of a new pid namespace
(``unshare(CLONE_NEWNS | CLONE_NEWPID)``), prepares the mounts there, starts the process and
returns to the daemon's namespaces (``setns``). So the process the daemon starts *is* the VMM (an
exec chain, no helper in between): its pid is the VMM's host pid, which the daemon waits on, kills,
reads ``/proc/PID`` of and puts in a cgroup; and it is pid 1 of a namespace nothing else lives in.

In its mount namespace (private propagation, so nothing leaks back):

- its run directory's parent (the other sandboxes' run directories, or the other snapshots for a
  parent being baked) is an empty tmpfs with only its own run directory bound back in;
- ``/proc`` is a procfs of its own with ``hidepid=invisible``: once unprivileged it sees no other
  process;
- the network namespaces the host pins under ``/run/netns`` (nsfs mounts) are detached, so a VMM
  never keeps another sandbox's network namespace alive after the daemon deleted it.

The process runs through util-linux ``prlimit`` (``RLIMIT_NOFILE``, ``RLIMIT_FSIZE``) and ``setpriv``
(``no_new_privs``, a bounding set of only the capabilities the program needs to start, nothing
inheritable or ambient), then the program, which is given its uid and gid and must drop to them
itself before it reads anything untrusted (QEMU's ``-runas``, ``qemu_machine``): setting a non-zero
uid clears every capability it had. A host that cannot do this is refused at daemon start
(:meth:`Jail.check`) unless the operator opts out in the config (``[confinement] enabled = false``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from forkd.vmm.base import VmmError
from forkd.vmm.vmm_uids import CLAIMS, DEFAULT_UID_RANGE, UidAllocator, UidRange, host_conflicts

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
TOOLS = ("prlimit", "setpriv")  # util-linux
#: What the tmpfs over a run directory's parent may hold: the one directory bound into it.
_MASK_OPTIONS = "mode=0755,size=16k,nr_inodes=16"
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
DEFAULT_MAX_OPEN_FILES = 2048  # Firecracker's jailer's default; a QEMU child holds ~100
DEFAULT_MAX_FILE_SIZE_MIB = 256 << 10  # its disk overlay is the largest file a VMM writes


@dataclass(frozen=True)
class JailSettings:
    """``[confinement]`` in the daemon's config."""

    enabled: bool = True
    uid_range: str = DEFAULT_UID_RANGE
    max_open_files: int = DEFAULT_MAX_OPEN_FILES
    max_file_size_mib: int = DEFAULT_MAX_FILE_SIZE_MIB

    @property
    def ids(self) -> UidRange:
        return UidRange.parse(self.uid_range)

    def __post_init__(self) -> None:
        self.ids  # UidRangeError (a ValueError) names what is wrong with it


class JailUnavailable(VmmError):
    """This host cannot confine VMMs; the message says what is missing and how to fix or opt out."""


def how_to_fix(problems: Sequence[str]) -> str:
    return ("VMMs cannot be confined on this host: " + "; ".join(problems) + ". Fix that, or opt out with "
            "`enabled = false` under [confinement] in the daemon config (VMMs then run as root: "
            "docs/security.md)")


class JailedProcess:
    """A VMM started in its jail: the asyncio-subprocess surface the runtime uses (``pid``, ``returncode``,
    ``wait``, ``kill``), watched through a pidfd. Its exit is collected as soon as it happens, whoever
    waits, and gives its uid back."""

    def __init__(self, popen: subprocess.Popen[bytes], on_exit: Callable[[], None]) -> None:
        self.pid = popen.pid
        self._popen = popen
        self._on_exit = on_exit
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)  # a zombie still has one: an instant exit is seen too
        loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _reap(self) -> None:
        if self._popen.poll() is None:
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self._on_exit()
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self._pidfd < 0:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


class Jail:
    """Starts VMM processes confined; one per daemon, shared by every VMM it starts."""

    def __init__(self, settings: JailSettings = JailSettings()) -> None:
        self.settings = settings
        self.ids = settings.ids
        self.uids = UidAllocator(self.ids, claims=CLAIMS)
        # Every start on this one thread: it alone changes namespaces, and always returns to the daemon's.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forkd-vmm-jail")
        self._home: tuple[int, int] | None = None  # the daemon's mount and pid namespaces, opened on the thread
        self._problems: list[str] | None = None

    def check(self) -> None:
        """Refuse (:class:`JailUnavailable`) unless this host can confine a VMM; cached after the first call."""
        if self._problems is None:
            self._problems = self._thread.submit(self._find_problems).result()
        if self._problems:
            raise JailUnavailable(how_to_fix(self._problems))

    def _find_problems(self) -> list[str]:
        problems = [f"`{tool}` is not installed (util-linux: `bash scripts/setup`)" for tool in TOOLS
                    if shutil.which(tool) is None]
        if os.geteuid() != 0:
            problems.append("the daemon is not root (it needs CAP_SYS_ADMIN for namespaces and starts each VMM "
                            "as root to drop it to its own uid)")
        conflicts = host_conflicts(self.ids)
        if conflicts:
            problems.append(f"the uid range {self.ids} is in use on this host ({', '.join(conflicts[:3])}); "
                            "set a free `uid_range` under [confinement]")
        if not problems:
            try:
                self._enter(None)
            except OSError as exc:
                problems.append(f"cannot make mount and pid namespaces ({exc})")
            finally:
                with contextlib.suppress(OSError):
                    self._leave()
        return problems

    async def spawn(self, argv_for: Callable[[int], list[str]], keep_caps: Sequence[str], run_dir: Path,
                    log: IO[bytes], pass_fds: tuple[int, ...] = ()) -> JailedProcess:
        """Start ``argv_for(uid)`` in its jail; the program must set that uid (and gid) itself, with the
        capabilities ``keep_caps`` (e.g. ``setuid``), before it takes any untrusted input."""
        self.check()
        uid = self.uids.allocate()
        limits = self.settings
        command = ["prlimit", f"--nofile={limits.max_open_files}:{limits.max_open_files}",
                   f"--fsize={limits.max_file_size_mib << 20}:{limits.max_file_size_mib << 20}", "--",
                   "setpriv", "--no-new-privs", "--bounding-set=-all" + "".join(f",+{c}" for c in keep_caps),
                   "--inh-caps=-all", "--ambient-caps=-all", "--", *argv_for(uid)]
        try:
            popen = await asyncio.get_running_loop().run_in_executor(
                self._thread, self._start, command, run_dir, log, pass_fds)
        except BaseException:
            self.uids.release(uid)
            raise
        self.uids.bind(uid, popen.pid)
        return JailedProcess(popen, lambda: self.uids.release(uid))

    def _start(self, command: list[str], run_dir: Path, log: IO[bytes],
               pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
        try:
            self._enter(run_dir)
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                                    pass_fds=pass_fds, start_new_session=True)
        except OSError as exc:
            raise VmmError(f"cannot start a confined VMM in {run_dir}: {exc}") from None
        finally:
            self._leave()

    def _enter(self, run_dir: Path | None) -> None:
        """On the jail's thread: into a new mount namespace set up for ``run_dir``, and a new pid namespace
        for the next process started."""
        if self._home is None:
            mnt = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            self._home = (mnt, os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        if run_dir is None:
            return
        for target in _namespace_pins():
            _umount(target)
        own = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # this namespace's view of it
        try:
            _mount("tmpfs", str(run_dir.parent), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, _MASK_OPTIONS)
            os.mkdir(run_dir, 0o700)
            _mount(f"/proc/self/fd/{own}", str(run_dir), None, MS_BIND)
        finally:
            os.close(own)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
        except OSError:  # kernels before 5.8 know only the number
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")

    def _leave(self) -> None:
        """Back into the daemon's namespaces; a thread that cannot go back must never start a VMM again."""
        assert self._home is not None
        mnt, pid = self._home
        try:
            _check(_libc.setns(pid, CLONE_NEWPID), "setns(pid)")
            _check(_libc.setns(mnt, CLONE_NEWNS), "setns(mnt)")
        except OSError as exc:
            self._problems = [f"the VMM start thread could not return to the daemon's namespaces ({exc}); "
                              "restart the daemon"]
            raise


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]), f"mount {target}")


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        _check(-1, f"umount {target}")


def _namespace_pins() -> list[str]:
    """What to detach in this thread's mount namespace so it pins no namespace file (``ip netns``'
    ``/run/netns/NAME``): a mount holding only namespace files (``/run/netns`` is its own mount) as a
    whole, any other namespace file on its own.

    One detach per file would cost one RCU grace period each, on the one thread that starts every VMM:
    with 100 sandboxes' namespaces pinned, a VMM start took 34 ms instead of 15 (300 ms at worst), and
    forking slowed down as children accumulated.
    """
    mounts: dict[str, tuple[str, str, str]] = {}  # mount id: (parent id, mount point, file system type)
    for line in Path("/proc/thread-self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields = before.split(" ")
        mounts[fields[0]] = (fields[1], _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[4]),
                             after.split(" ", 1)[0])
    holders: dict[str, list[str]] = {}
    for parent, point, fstype in mounts.values():
        if fstype == "nsfs":
            holders.setdefault(parent, []).append(point)
    pins = []
    for parent, points in holders.items():
        holder = mounts.get(parent)
        only_namespaces = all(fstype == "nsfs" for up, _, fstype in mounts.values() if up == parent)
        if holder is not None and holder[1] != "/" and only_namespaces:
            pins.append(holder[1])
        else:
            pins += reversed(points)
    return pins
