"""The EPP process's memory settings: the C allocator for large request bodies (glibc only), and
the cycle collector after start-up.

A 1 MiB prompt reaches the EPP as a few ext_proc messages of ~256 KiB and leaves as 17
streamed body replies; on the way it is copied a dozen times (protobuf fields, the joined
body, the decoded text, the replies), each copy a fresh allocation of 0.25-1 MiB. glibc serves
allocations that large with mmap by default and gives the pages back on free, so every copy
lands on new pages and the kernel zeroes and maps each on first touch. On the shared 2-vCPU
VM these benchmarks run on, one request cost ~600 minor page faults, and 4 body messages of
256 KiB read and joined took 5.2-5.7 ms instead of 0.4-0.5 (docs/notes/
2026-12-06-lean-transport-third-round.md). glibc's own remedy, raising the mmap threshold
after each free, did not hold here: freed pages at the heap's top went back to the kernel
(the trim threshold) and the next body faulted them in again.

`keep_freed_pages` fixes both thresholds: blocks up to `LARGE` come from the heap, and up to
`LARGE` of freed memory at its top stays mapped for the next request. The EPP's runtime applies
it at start (`server/runtime.py`; until issue 36's big-bodies round the runtime then pinned the
mmap threshold back to 128 KiB, so `serve` faulted ~2,300 pages per 1 MiB prompt). The cost is
memory: freed bodies stay mapped for reuse instead of going back at once; once a burst of big
bodies is over the runtime trims the heap (`server/memory.py`), so RSS returns near idle
(`tests/reliability/test_rel_memory.py`: bursts of rejected 17 MB bodies). An operator's own
`MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` wins (nothing is set then).

`freeze_startup_objects` is the same kind of setting for Python's cycle collector: once the
gateway is ready, what start-up built (modules, configuration, the scheduler; ~96,000 objects)
is moved out of the collector's generations, so a full collection no longer walks it. Measured
in `serve` at 10 requests/s (load 8-10, issue 36's fourth round): one full pass of 249 ms in
two minutes without, none with; younger passes unchanged. Raising the youngest generation's
threshold (700 to 20,000) was worse: one young pass of 36 ms. The thresholds stay Python's.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys

log = logging.getLogger("poolkeeper.extproc")

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's own ceiling for its moving mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
LARGE = 32 << 20
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_pages(limit: int = LARGE) -> bool:
    """Serve blocks up to `limit` bytes from the heap and keep up to `limit` freed bytes
    mapped; True if glibc took both settings (False elsewhere, or when the environment sets
    either threshold)."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _ENV):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    took = bool(mallopt(_M_MMAP_THRESHOLD, limit) == 1 and mallopt(_M_TRIM_THRESHOLD, limit) == 1)
    if not took:
        log.warning("glibc refused the allocator thresholds for large request bodies")
    return took


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from later cycle collections (they are
    still freed when their references go)."""
    gc.collect()
    gc.freeze()
