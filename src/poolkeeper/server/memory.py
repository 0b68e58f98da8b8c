"""Give a burst's freed heap back to the OS (reliability finding 3).

The EPP keeps large request bodies on glibc's heap and its freed pages mapped for the next
body (`extproc/heap.py`: a 1 MiB prompt otherwise faults in ~2,300 fresh pages). After a burst
of big bodies (`server/housekeeping.py`'s `trim_after_bursts`) `trim` returns every free page of
the heap, not only its top, so RSS goes back near idle. (Pinning the mmap threshold at 128 KiB
instead, as this module once did, made every large buffer an mmap of its own, faulted in page
by page on each request.) Without glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


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
