"""Keep freed memory in the process instead of returning it to the operating system after every round.

glibc's ``malloc`` serves every block above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and unmaps it on ``free``; a simulator round allocates and frees tensors of tens to
hundreds of megabytes, so each round would fault in and zero that memory again.
:func:`retain_freed_memory` turns ``mmap`` off for allocations, so freed blocks stay in the heap
and are reused (BENCHMARKS.md has the measured effect).

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
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1

#: (option, value): serve every block from the heap instead of a fresh mmap, grow the heap in steps
#: of 256 MiB, and give heap memory back to the system only when 2 GiB lie free at its top.
_POLICY = ((_M_MMAP_MAX, 0), (_M_TOP_PAD, 256 * 2**20), (_M_TRIM_THRESHOLD, _INT_MAX))


@functools.cache
def retain_freed_memory() -> bool:
    """Apply the policy once per process; returns whether glibc accepted every option."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    accepted = [mallopt(option, value) == 1 for option, value in _POLICY]
    if not all(accepted):
        logger.warning("glibc rejected malloc options %s; rounds may spend time faulting in fresh memory",
                       [option for (option, _), ok in zip(_POLICY, accepted, strict=True) if not ok])
    return all(accepted)
