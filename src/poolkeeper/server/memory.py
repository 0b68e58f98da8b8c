"""Give big freed buffers back to the OS (reliability finding 3).

glibc serves allocations above its mmap threshold with mmap, which `free` returns at once, but
it raises that threshold (up to 32 MiB) each time such a block is freed, so after one burst of
large request bodies later ones come from the heap and their memory is never given back: RSS
stays at the attack's peak. Fixing the threshold at its default (128 KiB) keeps every large
body buffer an mmap of its own. Without glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("poolkeeper.server")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 * 1024


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def trim() -> bool:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`); True if any were."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold (disables its dynamic growth); True when applied."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not applied:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; large buffers may stay resident")
    return applied
