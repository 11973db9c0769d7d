"""Host memory for training on CPU: keep freed blocks for the next step.

A training step allocates and frees the same tensors every step. With
glibc's defaults a block of 128 KiB or more is first served by ``mmap``
(the threshold then rises, up to 32 MiB, as large blocks are freed), and
once the free space at the top of the heap exceeds twice that threshold
it goes back to the kernel. The next step then faults the same pages in
again, one 4 KiB page at a time. On the 2-core test host a dp2 ZeRO-1 step
of the peer benchmark's model took 10-14 thousand page faults and 20-27 ms
of system time on rank 0 (of a 430-460 ms step); with the settings below,
0-200 faults and 1-4 ms.

:func:`keep_freed_host_memory` fixes the mmap threshold at glibc's
largest (32 MiB: larger blocks are still mapped and unmapped whole) and
raises the trim threshold to 1 GiB, so a training process keeps the heap
it reaches at its peak instead of returning and re-faulting it every step.
The process's resident size then stays at its peak between steps, which is
where every step takes it anyway. A user who tunes glibc through its
environment variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_``) keeps those settings: nothing is changed then.
``GIANTMODEL_KEEP_HOST_MEMORY=0`` leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_CEILING_BYTES = 32 * 2 ** 20   # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_TRIM_THRESHOLD = 2 ** 30
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
OPT_OUT = "GIANTMODEL_KEEP_HOST_MEMORY"
_applied = False


def keep_freed_host_memory() -> bool:
    """Apply the settings above once per process; True when they are in
    effect (glibc on Linux, no user setting in the environment, no opt-out)."""
    global _applied
    if _applied:
        return True
    if (not sys.platform.startswith("linux") or any(k in os.environ for k in _USER_KNOBS)
            or os.environ.get(OPT_OUT, "1") == "0"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):   # not glibc (musl, or no libc.so.6)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # both together: setting either one alone turns off glibc's dynamic
    # threshold and leaves the mmap threshold at 128 KiB
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_CEILING_BYTES)
                    and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _applied
