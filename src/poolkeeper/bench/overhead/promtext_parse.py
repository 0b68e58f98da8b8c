"""Microseconds per metrics page: poolkeeper's filter reader vs prometheus_client's parser.

    .venv/bin/python -m poolkeeper.bench.overhead.promtext_parse [--rounds N]

The page (`--page`, default tests/backend/fixtures/vllm_v1.prom of a checkout) is a
realistic vLLM V1 /metrics page (196 lines, ~18 KB: gauges, LoRA info with three series, cache
config, counters, seven histograms, Python and process collectors). Rows:
- filter reader: `FamilyFilter.parse(bytes)` for the six families the vLLM mapping reads
  (bytes in, UTF-8 decode included);
- filter reader + mapping: `EngineMapping.read`, i.e. the whole per-scrape CPU cost;
- prometheus_client: `list(text_string_to_metric_families(str))`, all families (its only mode).
Prints a Markdown table of CPU time per page (best and median of N rounds, each round timing
a batch of calls).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.backend.engines import mapping_for
from poolkeeper.datastore.endpoint import EndpointMetrics

PAGE = Path("tests") / "backend" / "fixtures" / "vllm_v1.prom"  # run from the repository root


def measure(fn: Callable[[], object], rounds: int, target_s: float = 0.2) -> tuple[float, float]:
    """(best, median) CPU microseconds per call over `rounds` batches of ~target_s each.

    CPU time of this process (time.process_time), not wall time: on a shared 2-core machine
    other processes would otherwise dominate the spread.
    """
    timer = timeit.Timer(fn, timer=time.process_time)
    batch, _ = timer.autorange()
    batch = max(1, int(batch * target_s / 0.2))
    per_call = [t / batch * 1e6 for t in timer.repeat(repeat=rounds, number=batch)]
    return min(per_call), statistics.median(per_call)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds (default 7)")
    parser.add_argument(
        "--page", type=Path, default=PAGE, help=f"a vLLM /metrics page (default {PAGE})"
    )
    args = parser.parse_args(argv)
    page: Path = args.page
    if not page.is_file():
        print(f"error: no metrics page at {page}; pass --page PATH", file=sys.stderr)
        return 2
    data = page.read_bytes()
    text = data.decode()
    mapping = mapping_for("vllm")
    previous = EndpointMetrics()

    # Same answer first: the benchmark compares equals.
    ours = mapping.reader.parse(data)
    oracle = {f.name: f for f in text_string_to_metric_families(text)}
    for family, samples in ours.items():
        assert [s.value for s in samples] == [float(s.value) for s in oracle[family].samples], (
            family
        )

    rows = [
        ("filter reader (6 wanted families)", lambda: mapping.reader.parse(data)),
        ("filter reader + vLLM mapping", lambda: mapping.read(data, previous, 1.0)),
        ("prometheus_client 0.x parser", lambda: list(text_string_to_metric_families(text))),
    ]
    lines = text.count("\n")
    print(f"page: {page.name}, {lines} lines, {len(data)} bytes")
    print(f"python {platform.python_version()} on {platform.machine()} ({platform.processor()})")
    print()
    print("| parser | best CPU µs/page | median CPU µs/page |")
    print("|---|---:|---:|")
    results = {}
    for name, fn in rows:
        best, median = measure(fn, args.rounds)
        results[name] = median
        print(f"| {name} | {best:,.1f} | {median:,.1f} |")
    ratio = results[rows[2][0]] / results[rows[1][0]]
    print()
    print(f"prometheus_client / (filter reader + mapping), medians: {ratio:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
