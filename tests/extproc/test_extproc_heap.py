"""Large request bodies reuse the EPP's pages instead of faulting in fresh ones (extproc/heap.py).

Each check runs in a fresh interpreter: the allocator settings are per process and cannot be
undone. What is counted is minor page faults (`ru_minflt`) while a 1 MiB body is copied the
way the ext_proc path copies it (protobuf pieces, join, decode), 30 times over.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt",
)

_BODIES = """
import resource, sys
from poolkeeper.extproc.heap import keep_freed_pages
took = keep_freed_pages() if sys.argv[1] == "tuned" else None
body = bytes(range(256)) * 4096  # 1 MiB
def request():
    parts = [bytes(memoryview(body)[at : at + 262144]) for at in range(0, len(body), 262144)]
    whole = b"".join(parts)
    return len(whole.decode("latin-1"))
request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    request()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _BODIES, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env},
    ).stdout.split()
    return out[0], int(out[1])


def test_large_bodies_stop_faulting_in_fresh_pages() -> None:
    took, tuned = _faults("tuned")
    assert took == "True"
    # 30 requests of ~4 MiB of copies each: ~30,000 faults of 4 KiB pages if every copy
    # lands on fresh pages; a few dozen once freed pages are kept.
    assert tuned < 1_000


def test_an_operators_own_thresholds_are_left_alone() -> None:
    took, _ = _faults("tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert took == "False"
