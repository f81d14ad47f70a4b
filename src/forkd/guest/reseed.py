"""reseed: make a VM restored from a shared snapshot distinct from its siblings.

The kernel RNG, the clock and the hostname are the agent's to set; the generators a warm
interpreter holds are reseeded by the interpreter that holds them (:func:`reseed_interpreter`):
each context at the reseed, each fork of the template as it starts, the template itself before
its next warm-up.
"""

from __future__ import annotations

import errno
import fcntl
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

#: ioctls on /dev/random from <linux/random.h>.
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207

#: Errors meaning "this host or user may not do that" rather than "that went wrong".
_UNPRIVILEGED_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.ENOTTY, errno.ENOSYS})




def mix_kernel_entropy(entropy: bytes) -> None:
    """Credit entropy to the kernel pool and force a CRNG reseed (both need CAP_SYS_ADMIN).

    Without this, VMs restored from one snapshot share the CRNG state getrandom() draws from.
    """
    pool_info = bytearray(struct.pack("ii", 8 * len(entropy), len(entropy)) + entropy)
    with open("/dev/random", "wb", buffering=0) as rng:
        fcntl.ioctl(rng, RNDADDENTROPY, pool_info)
        fcntl.ioctl(rng, RNDRESEEDCRNG)


def attempt(step: str, skipped: list[str], action: Callable[..., Any], *args: Any) -> bool:
    """Run a privileged reseed step; lacking the privilege (host tests) skips it instead."""
    try:
        action(*args)
    except OSError as exc:
        if exc.errno not in _UNPRIVILEGED_ERRNOS:
            raise
        skipped.append(step)
        return False
    return True


def reseed_interpreter(entropy: bytes) -> dict[str, bool]:
    """Reseed the generators the warm interpreter holds, which a restore copies verbatim."""
    random.seed(entropy)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        words = random.Random(b"numpy:" + entropy)  # independent of the stream `random` yields
        numpy.random.seed([words.getrandbits(32) for _ in range(8)])
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(entropy, float(len(entropy)))
    return {"python_rng": True, "numpy_rng": numpy is not None, "openssl_rng": ssl is not None}

