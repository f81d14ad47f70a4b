"""Running the daemon: uvicorn serving the API on a Unix socket only its owner can open."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import os
import socket
from pathlib import Path

import uvicorn

from forkd.daemon.app import create_app
from forkd.daemon.config import DaemonConfig
from forkd.runtime.runtime import Runtime
from forkd.vmm.qemu import QemuVmm



class DaemonAlreadyRunning(RuntimeError):
    pass


def bind_private_socket(path: Path) -> socket.socket:
    """Bind ``path`` with mode 0600 from the start (no window where others could connect)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a daemon that died
        else:
            raise DaemonAlreadyRunning(f"a forkd daemon already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


async def serve(config: DaemonConfig) -> None:
    paths = config.paths
    sock = bind_private_socket(paths.socket)
    runtime = Runtime(paths, QemuVmm(accelerator=config.accelerator), config.runtime_options)
    config = uvicorn.Config(create_app(runtime), log_level="warning", timeout_graceful_shutdown=5,
                            h11_max_incomplete_event_size=1 << 20)
    server = uvicorn.Server(config)
    try:
        await server.serve(sockets=[sock])
    finally:
        with contextlib.suppress(FileNotFoundError):
            paths.socket.unlink()


def configure_logging(config: DaemonConfig) -> None:
    """stderr by default (the journal under systemd); a size-rotated file when ``log_file`` is set."""
    handler: logging.Handler = logging.StreamHandler()
    if config.log_file is not None:
        config.log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(config.log_file, maxBytes=config.log_max_bytes,
                                                       backupCount=config.log_backups)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[handler])


def run(config: DaemonConfig) -> None:
    configure_logging(config)
    asyncio.run(serve(config))
    if config.sandboxes.keep_on_stop:
        # VMMs left for the next daemon must outlive this process: leave without running
        # finalizers, since asyncio's subprocess transports kill a child still running when collected.
        logging.shutdown()
        os._exit(0)
