"""A VMM's jail, after Firecracker's jailer: its own uid and gid, pid and mount namespaces, rlimits.

Each VMM process is started on one dedicated thread that, for that start only, moves itself into
a new mount namespace and makes the next process it creates pid 1 of a new pid namespace
(``unshare(CLONE_NEWNS | CLONE_NEWPID)``), prepares the mounts there, starts the process and
returns to the daemon's namespaces (``setns``). So the process the daemon starts *is* the VMM (an
exec chain, no helper in between): its pid is the VMM's host pid, which the daemon waits on, kills,
reads ``/proc/PID`` of and puts in a cgroup; and it is pid 1 of a namespace nothing else lives in.

In its mount namespace (private propagation, so nothing leaks back) it gets a root of its own, after
the jailer's chroot: a small tmpfs, entered with ``pivot_root`` (the host's tree then detached), that
holds only

- the system, read-only: ``/usr`` (programs, libraries, QEMU's firmware), the top-level library and
  program directories (links on a merged ``/usr``) and the loader cache: what ``strace -f -e
  trace=file`` of a jailed start shows the exec chain open;
- a few devices (``/dev/null``, ``zero``, ``random``, ``urandom``);
- ``/proc``, a procfs of its own with ``hidepid=invisible``: once unprivileged it sees no other process;
- its run directory, read-write, and the :class:`HostFile` s its program is declared to open by name
  (for QEMU, ``QemuMachine.host_files``), each at its own absolute path so no argument changes.

So it sees no other sandbox, snapshot, ``/etc`` or daemon state, and pins no network namespace the
host keeps under ``/run/netns``. A root that cannot be built fails the start naming the file; it was
built only in the new namespace, which dies with it.

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
import platform
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from forkd.vmm.base import VmmError
from forkd.vmm.vmm_uids import CLAIMS, DEFAULT_UID_RANGE, UidAllocator, UidRange, host_conflicts

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}[platform.machine()]
TOOLS = ("prlimit", "setpriv")  # util-linux
#: Top-level directories of programs and libraries: links to /usr on a merged /usr (made as links).
_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The programs of the exec chain (prlimit, setpriv, QEMU), their libraries and QEMU's firmware, read-only:
#: what ``strace -f -e trace=file`` of a jailed start shows them open (docs/security.md).
SYSTEM = ("/usr", *_TOP, "/etc/ld.so.cache")
#: Devices QEMU opens (the machine declares /dev/kvm when it uses it); the guest's NIC is a passed tap fd.
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
#: The VMM's root: directories and empty files to bind onto (no data), made read-only before it starts.
#: Two inodes a disk layer in its own snapshot directory: a chain of ~2,000 fits.
_ROOT_OPTIONS = "mode=0755,size=64k,nr_inodes=4096"
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


@dataclass(frozen=True)
class HostFile:
    """A host file a jailed program opens by name: bound into its root at the same path (so no argument
    changes), read-only unless ``writable``."""

    path: Path
    writable: bool = False


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

    def warm_up(self) -> None:
        """The jail's one-time work, off the caller's event loop: the host check (a problem is kept and
        raised by the first :meth:`spawn`, as before) and who holds which VMM uid already."""
        try:
            self.check()
        except JailUnavailable:
            return  # no VMM starts here: the first spawn refuses, naming what is missing
        self.uids.learn()

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
                    log: IO[bytes], pass_fds: tuple[int, ...] = (), files: Sequence[HostFile] = ()) -> JailedProcess:
        """Start ``argv_for(uid)`` in its jail, seeing of the host only ``run_dir``, ``files`` and the system;
        the program must set that uid (and gid) itself, with the capabilities ``keep_caps`` (e.g. ``setuid``),
        before it takes any untrusted input."""
        self.check()
        uid = self.uids.allocate()
        limits = self.settings
        command = ["prlimit", f"--nofile={limits.max_open_files}:{limits.max_open_files}",
                   f"--fsize={limits.max_file_size_mib << 20}:{limits.max_file_size_mib << 20}", "--",
                   "setpriv", "--no-new-privs", "--bounding-set=-all" + "".join(f",+{c}" for c in keep_caps),
                   "--inh-caps=-all", "--ambient-caps=-all", "--", *argv_for(uid)]
        started = asyncio.get_running_loop().run_in_executor(
            self._thread, self._start, command, run_dir, log, pass_fds, files)
        try:
            popen = await asyncio.shield(started)  # a cancelled caller does not stop the start on its thread
        except asyncio.CancelledError:
            started.add_done_callback(lambda done: self._discard(done, uid))
            raise
        except BaseException:
            self.uids.release(uid)
            raise
        self.uids.bind(uid, popen.pid)
        return JailedProcess(popen, lambda: self.uids.release(uid))

    def _discard(self, started: asyncio.Future[subprocess.Popen[bytes]], uid: int) -> None:
        """The caller gave up while its VMM was being started (a fork cancelled, the daemon stopping): the
        process, if it started, is killed (nobody else knows it), and its uid is free again only once it
        has exited, so no two live VMMs ever share one."""
        if started.cancelled() or started.exception() is not None:
            self.uids.release(uid)
            return
        popen = started.result()
        self.uids.bind(uid, popen.pid)
        JailedProcess(popen, lambda: self.uids.release(uid)).kill()  # its pidfd reader reaps it

    def _start(self, command: list[str], run_dir: Path, log: IO[bytes], pass_fds: tuple[int, ...],
               files: Sequence[HostFile]) -> subprocess.Popen[bytes]:
        try:
            self._enter(run_dir, files)
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                                    pass_fds=pass_fds, start_new_session=True)
        except OSError as exc:
            raise VmmError(f"cannot start a confined VMM in {run_dir}: {exc}") from None
        finally:
            self._leave()

    def _enter(self, run_dir: Path | None, files: Sequence[HostFile] = ()) -> None:
        """On the jail's thread: into a new mount namespace whose root holds only ``run_dir``, ``files``
        and what a program needs to run, and a new pid namespace for the next process started."""
        if self._home is None:
            mnt = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            self._home = (mnt, os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        if run_dir is not None:
            _pivot_into(_plan(run_dir, files), run_dir.parent)

    def _leave(self) -> None:
        """Back into the daemon's namespaces (and so its root); a thread that cannot go back must never
        start a VMM again."""
        assert self._home is not None
        mnt, pid = self._home
        try:
            _check(_libc.setns(pid, CLONE_NEWPID), "setns(pid)")
            _check(_libc.setns(mnt, CLONE_NEWNS), "setns(mnt)")
        except OSError as exc:
            self._problems = [f"the VMM start thread could not return to the daemon's namespaces ({exc}); "
                              "restart the daemon"]
            raise


def _plan(run_dir: Path, files: Sequence[HostFile]) -> list[HostFile]:
    """What a VMM's root holds besides its ``/proc`` and the links of a merged ``/usr``: the system
    (read-only), the devices that exist, its run directory (read-write) and ``files`` outside it."""
    plan = [HostFile(Path(path)) for path in SYSTEM if os.path.lexists(path) and not os.path.islink(path)]
    plan += [HostFile(Path(path), writable=True) for path in DEVICES if os.path.exists(path)]
    plan.append(HostFile(run_dir, writable=True))
    for file in files:  # one bound already holds it (the run directory, /usr): it is seen as that one allows
        if not file.path.is_absolute():
            raise OSError(errno.EINVAL, f"{file.path} cannot be bound into the VMM's root: not an absolute path")
        if not any(file.path.is_relative_to(holder.path) for holder in plan):
            plan.append(file)
    return plan


def _pivot_into(plan: Sequence[HostFile], mount_point: Path) -> None:
    """Make a tmpfs on ``mount_point`` (any directory: every source is opened first) holding ``plan``,
    each bound at its own path, read-only unless writable; pivot into it and detach the host's tree."""
    opened: list[tuple[HostFile, int]] = []
    try:
        for file in plan:
            try:
                opened.append((file, os.open(file.path, os.O_PATH | os.O_CLOEXEC)))
            except OSError as exc:
                raise OSError(exc.errno, f"{file.path} cannot be bound into the VMM's root: {exc.strerror}") from None
        links = {name: os.readlink(name) for name in _TOP if os.path.islink(name)}
        root = str(mount_point)
        _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, _ROOT_OPTIONS)
        for file, fd in opened:
            _bind(fd, file, root)
        for name, target in links.items():
            os.symlink(target, root + name)
        os.mkdir(root + "/proc", 0o555)
        try:
            _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
        except OSError:  # kernels before 5.8 know only the number
            _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    finally:
        for _, fd in opened:
            os.close(fd)
    os.chdir(root)
    _check(_libc.syscall(_SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _umount(".")  # the host's tree, stacked on the new root by pivot_root
    os.chdir("/")


def _bind(fd: int, file: HostFile, root: str) -> None:
    """``file`` (opened as ``fd``) bound at its own path under ``root``; a device keeps its node working."""
    mode = os.fstat(fd).st_mode
    target = root + os.path.normpath(file.path)
    flags = MS_NOSUID | (0 if str(file.path) in SYSTEM else MS_NOEXEC) | (0 if stat.S_ISCHR(mode) else MS_NODEV)
    try:  # the mount point: the root's inode bound (ENOSPC) ends a start here too
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if stat.S_ISDIR(mode):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444))
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | flags | (0 if file.writable else MS_RDONLY))
    except OSError as exc:
        raise OSError(exc.errno, f"{file.path} cannot be bound into the VMM's root: {exc.strerror}") from None


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
