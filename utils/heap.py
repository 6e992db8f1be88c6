"""The process heap for long CPU training jobs (docs/results.md, "Fit time: a held heap")."""

from __future__ import annotations

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's mallopt parameters (malloc.h)
TOP_PAD = 256 << 20
"""Bytes glibc adds to each growth of the heap (fewer, larger growths)."""
TRIM_THRESHOLD = 1 << 40
"""Free bytes at the heap's top before glibc gives them back: never, in practice."""


def hold_heap() -> bool:
    """Keep freed memory in this process's heap instead of handing it back to the OS (glibc ``mallopt``: no ``mmap``
    for large blocks, no trimming, a 256 MiB top pad). A training step allocates and frees tensors of tens to hundreds
    of MB; by default glibc maps each one afresh with ``mmap`` and unmaps it when freed, so every step faults all of
    its pages in again (the wide forecaster recipe: 15 million page faults and 30% of its CPU time in the kernel over
    12 steps). Held, the pages are reused. The cost: the resident set stays near its peak until the process ends.
    For jobs whose process ends with the job (``expertcast fit``); not for the offloading runtime, which measures
    and bounds its resident set. Returns False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok = mallopt(M_TOP_PAD, TOP_PAD) == 1 and ok
    # mallopt takes an int: the largest trim threshold it accepts is 2**31 - 1 bytes, itself far above a step's frees
    return mallopt(M_TRIM_THRESHOLD, min(TRIM_THRESHOLD, 2**31 - 1)) == 1 and ok
