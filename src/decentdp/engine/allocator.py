"""Keep freed memory in the process instead of returning it to the operating system after every round.

glibc's ``malloc`` serves every block above its mmap threshold (at most 32 MB by default) with a
fresh ``mmap`` and unmaps it on ``free``; a simulator round allocates and frees tensors of tens to
hundreds of megabytes, so each round would fault in and zero that memory again.  Measured on the
2-core CI machine: a 50 MB gather took 58 ms with the default policy and 30 ms after
:func:`retain_freed_memory`, with half as many page faults (BENCHMARKS.md has the round-level figures).

The policy change is process-wide and only concerns glibc; elsewhere this is a no-op.  The peak
memory of a run does not change, only how soon freed memory goes back to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


@functools.cache
def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; returns whether it took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return False
    applied = all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, 2**30), (_M_TRIM_THRESHOLD, 2**40), (_M_TOP_PAD, 2**28)))
    logger.debug("glibc malloc keeps freed memory: %s", applied)
    return applied
