"""files.*: read, write, list, stat, remove, mkdir and rename paths in the guest."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import Any

from . import protocol
from .channel import write_all
from .dispatch import AgentError, Handler, Request, inline


_FILE_TYPES = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"))


def _entry(path: str, st: os.stat_result) -> dict[str, Any]:
    return {
        "name": os.path.basename(path) or path,
        "path": path,
        "type": next((name for is_type, name in _FILE_TYPES if is_type(st.st_mode)), "other"),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }


def files_read(req: Request) -> dict[str, Any]:
    path = req.path("path")
    offset = req.arg("offset", int, 0, minimum=0)
    want = min(req.arg("length", int, protocol.FILE_CHUNK_BYTES, minimum=0), protocol.FILE_CHUNK_BYTES)
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below anyway.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(st.st_mode):
            # /dev/zero, /dev/urandom, a FIFO: endless or blocking, so never "read to the end".
            raise AgentError(protocol.ERR_BAD_REQUEST, f"files.read: {path!r} is not a regular file (a device, "
                             "FIFO or socket); read a bounded amount with exec instead (e.g. head -c N)")
        data = os.pread(fd, want, offset)
    finally:
        os.close(fd)
    # A short read means EOF; /proc-style files report size 0, so only trust size for regular files.
    eof = len(data) < want or (stat.S_ISREG(st.st_mode) and offset + len(data) >= st.st_size)
    return {"data_b64": protocol.b64encode(data), "size": st.st_size, "eof": eof}


def files_write(req: Request) -> dict[str, Any]:
    path = req.path("path")
    data = req.data("data_b64")
    offset = req.arg("offset", int, 0, minimum=0)
    append = req.arg("append", bool, False)
    truncate = req.arg("truncate", bool, True) and offset == 0 and not append
    mode = req.arg("mode", int, None, minimum=0)
    parents = req.arg("parents", bool, True)
    if append and offset:
        raise req.bad("'offset' and 'append' exclude each other")
    if parents:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else 0) | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o666 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # the open() mode only applies to new files, and minus umask
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        write_all(fd, data)
        return {"size": os.fstat(fd).st_size}
    finally:
        os.close(fd)


def files_list(req: Request) -> dict[str, Any]:
    with os.scandir(req.path("path")) as entries:
        listing = [_entry(entry.path, entry.stat(follow_symlinks=False)) for entry in entries]
    return {"entries": sorted(listing, key=lambda e: e["name"])}


@inline
def files_stat(req: Request) -> dict[str, Any]:
    path = req.path("path")
    return _entry(path, os.stat(path) if req.arg("follow", bool, False) else os.lstat(path))


def files_remove(req: Request) -> dict[str, Any]:
    path = req.path("path")
    recursive = req.arg("recursive", bool, False)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
    elif recursive:
        shutil.rmtree(path)
    else:
        os.rmdir(path)
    return {}


def files_mkdir(req: Request) -> dict[str, Any]:
    path = req.path("path")
    exist_ok = req.arg("exist_ok", bool, True)
    if req.arg("parents", bool, True):
        os.makedirs(path, exist_ok=exist_ok)
    elif not (exist_ok and os.path.isdir(path)):
        os.mkdir(path)
    return {}


def files_rename(req: Request) -> dict[str, Any]:
    os.rename(req.path("src"), req.path("dst"))
    return {}



class FileOps:
    """The files.* op family (stateless)."""

    def handlers(self) -> dict[str, Handler]:
        return {
            protocol.OP_FILES_READ: files_read,
            protocol.OP_FILES_WRITE: files_write,
            protocol.OP_FILES_LIST: files_list,
            protocol.OP_FILES_STAT: files_stat,
            protocol.OP_FILES_REMOVE: files_remove,
            protocol.OP_FILES_MKDIR: files_mkdir,
            protocol.OP_FILES_RENAME: files_rename,
        }

    def shutdown(self) -> None:
        pass
