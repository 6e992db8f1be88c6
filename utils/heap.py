"""The process heap for long CPU training jobs (docs/results.md, "Fit time: a held heap")."""

from __future__ import annotations

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's mallopt parameters (malloc.h)
TOP_PAD = 256 << 20
"""Bytes glibc adds to each growth of the heap (fewer, larger growths)."""
TRIM_THRESHOLD = 2**31 - 1
"""Free bytes at the heap's top before glibc gives them back (the largest ``mallopt`` takes: an int), far above what a
training step frees."""
held = False
"""Whether :func:`hold_heap` took effect in this process (a fit's ``run.json`` records it)."""


def hold_heap() -> bool:
    """Keep freed memory in this process's heap instead of handing it back to the OS (glibc ``mallopt``: no ``mmap``
    for large blocks, no trimming, a 256 MiB top pad). A training step allocates and frees tensors of tens to hundreds
    of MB; by default glibc maps each one afresh with ``mmap`` and unmaps it when freed, so every step faults all of
    its pages in again (the wide forecaster recipe on 500 sequences: 105 million page faults and 23% of its CPU time in the
    kernel). Held, the pages are reused. The cost: the resident set stays near its peak until the process ends.
    For jobs whose process ends with the job (``expertcast fit``); not for the offloading runtime, which measures
    and bounds its resident set. Returns False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    global held

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok = mallopt(M_TOP_PAD, TOP_PAD) == 1 and ok
    held = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return held
