"""`bench all`: every benchmark in one command; `--quick` is the reduced set of `make bench`.

Quick set (sized for < 10 minutes on 2 cores): virtual-time sweeps of all five workloads on 4
servers, 15 s arrival windows, loads 0.5 / 0.9 / 1.3, every policy; the overhead benchmark
with fewer decisions; one live pair (poolkeeper vs vllm-router, 2 servers, 4 s) if the peer
is installed. The full set: 8 servers, 30 s windows, loads 0.3 ... 1.3, the full overhead
benchmark, and live pairs against every installed peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from poolkeeper.bench.fleet.sweep import DEFAULT_LOADS, SweepSpec, run_sweep, targets_table
from poolkeeper.bench.live.live import LiveSpec, run_live
from poolkeeper.bench.live.live_processes import repo_root
from poolkeeper.bench.live.live_targets import peer_binary
from poolkeeper.bench.overhead.overhead import run_overhead
from poolkeeper.bench.policies.routers import ALL_POLICIES
from poolkeeper.bench.workload.workload_spec import ROUTING_WORKLOADS
from poolkeeper.errors import ConfigError


def run_all(
    *, out_dir: Path, quick: bool, jobs: int, progress: Callable[[str], None] = print
) -> int:
    started = time.perf_counter()
    servers, duration = (4, 15.0) if quick else (8, 30.0)
    loads = (0.5, 0.9, 1.3) if quick else DEFAULT_LOADS
    sweeps = []
    for kind in ROUTING_WORKLOADS:
        spec = SweepSpec(workload=str(kind), servers=servers, policies=ALL_POLICIES,
                         loads=loads, duration=duration)  # fmt: skip
        sweeps.append(run_sweep(spec, out_dir=out_dir, img_dir=out_dir / "img", jobs=jobs,
                                progress=progress))  # fmt: skip
    progress(targets_table(sweeps))
    run_overhead(sizes=(10, 100, 1000), decisions=500 if quick else 3000, out_dir=out_dir,
                 quick=quick, progress=progress)  # fmt: skip
    root = repo_root()
    wanted: tuple[str, ...] = (
        ("vllm-router",) if quick else ("vllm-router", "sglang-router", "envoy-rr")
    )
    peers = tuple(p for p in wanted if peer_binary(p, root) is not None)
    if not peers:
        progress("live: no peer installed (scripts/install-peers.sh); skipped")
    else:
        live = (
            LiveSpec(servers=2, duration=4.0, rounds=1, peers=peers, time_scale=4.0, groups=4)
            if quick
            else LiveSpec(
                servers=4, duration=30.0, rounds=2, peers=peers, time_scale=10.0, groups=16
            )
        )
        try:
            run_live(live, out_dir=out_dir, progress=progress)
        except ConfigError as exc:
            progress(f"live: {exc}")
    progress(f"bench all: {time.perf_counter() - started:.0f} s; results in {out_dir}")
    return 0
