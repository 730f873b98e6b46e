"""Keep freed memory in the process, so that each learning step does not page-fault its activations in again.

glibc's malloc returns freed memory at the top of a heap to the kernel and serves large blocks with fresh ``mmap``s;
with the thresholds below they stay in the process (docs/performance.md), unless the environment sets
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``. Call ``keep_freed_memory()`` first thing in a learner.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks below this come from the heap, not their own mmap (32 MiB: glibc's largest allowed value)."""
TRIM_THRESHOLD = 256 * 1024 * 1024
"""Free space a heap keeps before any of it is returned to the kernel."""


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for a long-running learner; True if they were set."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys():
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to tune
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
