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


# The same copies after the EPP's runtime started in the process (no Envoy, no endpoint up):
# what `serve` runs with. The runtime used to pin the mmap threshold back to 128 KiB at start,
# undoing the settings above, so every large copy in `serve` faulted in fresh pages.
_IN_RUNTIME = """
import asyncio, resource, sys, tempfile
from pathlib import Path
from poolkeeper.controller.files import file_source
from poolkeeper.netutil import free_ports
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from tests.support.gateway_files import gateway_ports, one_server_config

async def main():
    with tempfile.TemporaryDirectory() as tmp:
        (nobody,) = free_ports(1)
        config = one_server_config(Path(tmp) / "config", gateway_ports(), nobody)
        runtime = GatewayRuntime(
            ServeOptions(source=file_source([config]), run_envoy=False, ready_wait_s=0)
        )
        await runtime.start()
        try:
            body = bytes(range(256)) * 4096
            def request():
                view, step = memoryview(body), 262144
                parts = [bytes(view[at : at + step]) for at in range(0, len(body), step)]
                return len(b"".join(parts).decode("latin-1"))
            request()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(30):
                request()
            print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        finally:
            await runtime.stop(grace_s=0)

asyncio.run(main())
"""


def test_the_runtime_keeps_the_settings() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _IN_RUNTIME], capture_output=True, text=True, check=True, env=env
    )
    assert int(out.stdout.split()[-1]) < 1_000, out.stderr[-2000:]
