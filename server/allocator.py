"""Keep freed memory in the process, so that each learning step does not page-fault its activations in again.

glibc's malloc returns memory to the kernel when the free space at the top of a heap passes its trim threshold,
and serves large blocks with fresh ``mmap``s; a long-running learner then allocates and frees the same few
megabytes of activations every step and page-faults each of them in anew. With the thresholds below that memory
stays in the process, and the steps after the first reuse it without faulting it in (docs/performance.md, "Where
the learner's time goes"). The same setting is the environment's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_``; when either is set, it is left as the user set it.

Usage (first thing in a learner's process, before the model is built; not a doctest: it changes the process)::

    keep_freed_memory()  # True on glibc; False elsewhere, or when the environment sets the thresholds
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
