"""reseed: make a VM restored from a shared snapshot distinct from its siblings.

The kernel RNG, the clock and the hostname are the agent's to set; the generators a warm
interpreter holds are reseeded by the interpreter that holds them (:func:`reseed_interpreter`):
each context at the reseed, each fork of the template as it starts, the template itself before
its next warm-up. Those are the module-level ones (``random``'s, numpy's legacy global, OpenSSL's
pool via ``ssl.RAND_add``) and every generator the warm code made (:func:`find_warm_generators`:
``random.Random`` instances, numpy ``Generator``, ``RandomState`` and bit generators), which a
restore copies verbatim into every sibling. Generators made later, in a child, seed themselves
from the reseeded kernel, as ``secrets``, ``os.urandom`` and ``uuid4`` read it directly. What
this cannot reach is in docs/security.md ("Randomness").
"""

from __future__ import annotations

import errno
import fcntl
import gc
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

#: The generators alive after the warm code ran (found once per warm-up, not on every reseed: a
#: walk of every object would cost each child's first answer a noticeable time under TCG).
_warm_generators: list[Any] = []




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


def _numpy_kinds() -> tuple[type, ...]:
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return ()
    generators = numpy.random
    return tuple(k for k in (getattr(generators, "Generator", None), getattr(generators, "RandomState", None),
                             getattr(generators, "BitGenerator", None)) if isinstance(k, type))


def find_warm_generators() -> int:
    """Remember every seeded generator alive now; called after warm code ran, before ``gc.freeze``
    (frozen objects, those of earlier warm-ups, are already remembered). How many are known."""
    kinds = (random.Random, *_numpy_kinds())
    known = {id(g) for g in _warm_generators}
    for obj in gc.get_objects():
        if isinstance(obj, kinds) and not isinstance(obj, random.SystemRandom) and id(obj) not in known:
            _warm_generators.append(obj)
    return len(_warm_generators)


def _reseed_warm_generators(entropy: bytes) -> None:
    words = random.Random(b"warm:" + entropy)  # one stream per generator, all derived from entropy
    numpy = sys.modules.get("numpy")
    for generator in _warm_generators:
        if isinstance(generator, random.Random):
            generator.seed(words.getrandbits(256))
            continue
        seed = [words.getrandbits(32) for _ in range(8)]
        legacy = getattr(numpy.random, "RandomState", None) if numpy is not None else None
        if legacy is not None and isinstance(generator, legacy):
            try:
                generator.seed(seed)  # also drops its cached Gaussian, which the bit state does not hold
                continue
            except (TypeError, ValueError):  # over another bit generator than MT19937: no legacy seeding
                generator = generator._bit_generator
        bits = getattr(generator, "bit_generator", generator)
        bits.state = type(bits)(numpy.random.SeedSequence(seed)).state  # type: ignore[union-attr]


def reseed_interpreter(entropy: bytes) -> dict[str, Any]:
    """Reseed the generators the warm interpreter holds, which a restore copies verbatim."""
    random.seed(entropy)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        words = random.Random(b"numpy:" + entropy)  # independent of the stream `random` yields
        numpy.random.seed([words.getrandbits(32) for _ in range(8)])
    _reseed_warm_generators(entropy)
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(entropy, float(len(entropy)))
    return {"python_rng": True, "numpy_rng": numpy is not None, "openssl_rng": ssl is not None,
            "warm_generators": len(_warm_generators)}

