"""Laying diff-snapshot pages into a restored VMM's guest RAM, from the host, before its state loads.

Any VMM that maps the base memory file ``MAP_PRIVATE`` works with this: pages written through
``/proc/<pid>/mem`` become that process's private copy-on-write pages, exactly as in the source.
"""

from __future__ import annotations

import os
from pathlib import Path

from forkd.store.layers import Layer
from forkd.vmm.base import VmmError


def memory_mapping(pid: int, memory: Path, size: int) -> int:
    """Start address of the mapping of ``memory`` in process ``pid``."""
    wanted = str(memory.resolve())
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == wanted:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if end - start == size and int(fields[2], 16) == 0:
                    return start
    raise VmmError(f"guest RAM mapping of {memory} not found in process {pid}")


def write_layers(pid: int, memory: Path, size: int, layers: list[Layer]) -> int:
    """Lay each layer's pages (base first) over the guest RAM of process ``pid``; bytes written."""
    address = memory_mapping(pid, memory, size)
    written = 0
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        for layer in layers:
            src = os.open(layer.path, os.O_RDONLY)
            try:
                for guest_offset, position, length in layer.runs():
                    if guest_offset + length > size:
                        raise VmmError(f"layer {layer.path} holds a page beyond guest RAM ({guest_offset:#x})")
                    data = os.pread(src, length, position)
                    if len(data) != length or os.pwrite(mem, data, address + guest_offset) != length:
                        raise VmmError(f"could not lay {layer.path} over the RAM of process {pid}")
                    written += length
            finally:
                os.close(src)
    finally:
        os.close(mem)
    return written
