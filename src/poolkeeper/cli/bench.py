"""`poolkeeper bench`: routing-quality and overhead benchmarks.

    poolkeeper bench sim --workload shared-prefix --servers 8 --out bench-results
    poolkeeper bench workload --workload multi-lora --rate 20 --duration 60 --out w.jsonl
    poolkeeper bench live --peers vllm-router,sglang-router --out bench-results
    poolkeeper bench overhead --out bench-results
    poolkeeper bench flow --servers 8 --duration 30   # flow control: fairness, flood, burst
    poolkeeper bench report --in bench-results
    poolkeeper bench seeds bench-results/s1 bench-results/s2 bench-results/s3   # mean of seeds
    poolkeeper bench all --quick          # what `make bench` runs (< 10 min on 2 cores)

docs/benchmarks.md explains each benchmark, its definitions and its results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from poolkeeper.cli.bench_runs import (
    bench_all,
    bench_flow,
    bench_live,
    bench_overhead,
    bench_sim,
    bench_workload,
)
from poolkeeper.cli.bench_tables import bench_report, bench_seeds

DEFAULT_OUT = Path("bench-results")


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("expected positive numbers")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="routing-quality and overhead benchmarks", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")

    def usage(_args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(handler=usage)

    sim = sub.add_parser("sim", help="virtual-time fleet sweeps (no sockets)")
    sim.add_argument("--workload", type=_names, default=None,
                     help="comma-separated workloads (default: the five routing ones)")  # fmt: skip
    sim.add_argument("--policies", type=_names, default=None,
                     help="comma-separated policies (default: all but the ref-* "
                          "reference policies, which run only when named)")  # fmt: skip
    sim.add_argument("--loads", type=_floats, default=None,
                     help="offered loads as multiples of fleet capacity (0.3,...,1.3)")  # fmt: skip
    sim.add_argument("--servers", type=int, default=8, help="fleet size (default 8)")
    sim.add_argument("--flow-control", default=None, metavar="JSON",
                     help="spec.flowControl for the poolkeeper policies, as JSON, e.g. "
                          "'{\"bands\": {\"standard\": {\"saturationLimit\": 1.5}}}' "
                          "(default: the shipped defaults)")  # fmt: skip
    sim.add_argument("--duration", type=float, default=60.0,
                     help="arrival window in virtual seconds (default 60)")  # fmt: skip
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    sim.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    sim.add_argument("--img", type=Path, default=None,
                     help="plots directory (default <out>/img)")  # fmt: skip
    sim.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT (s)")
    sim.add_argument("--slo-itl", type=float, default=0.1, help="goodput SLO: mean ITL (s)")
    sim.add_argument("--scrape-interval", type=float, default=0.05,
                     help="seconds between metric scrapes the routers see (default 0.05, "
                     "GIE's refresh interval)")  # fmt: skip
    sim.set_defaults(handler=bench_sim)

    wl = sub.add_parser("workload", help="write a workload to a JSONL file")
    wl.add_argument("--workload", required=True)
    wl.add_argument("--servers", type=int, default=8, help="fleet size the defaults scale to")
    wl.add_argument("--rate", type=float, required=True, help="requests per second")
    wl.add_argument("--duration", type=float, default=60.0)
    wl.add_argument("--seed", type=int, default=1)
    wl.add_argument("--out", type=Path, required=True)
    wl.set_defaults(handler=bench_workload)

    live = sub.add_parser("live", help="loopback runs through poolkeeper serve and peers")
    live.add_argument("--workload", default="shared-prefix")
    live.add_argument("--servers", type=int, default=4)
    live.add_argument("--rate", type=float, default=None,
                      help="requests/s (default: 0.9x the fleet's estimated capacity)")  # fmt: skip
    live.add_argument("--duration", type=float, default=20.0)
    live.add_argument("--rounds", type=int, default=2, help="interleaved pairs per peer")
    live.add_argument("--peers", type=_names, default=("vllm-router", "sglang-router", "envoy-rr"))
    live.add_argument("--time-scale", type=float, default=1.0,
                      help="simulator time scale (default 1.0)")  # fmt: skip
    live.add_argument("--seed", type=int, default=1)
    live.add_argument(
        "--groups",
        type=int,
        default=None,
        help="shared-prefix groups (default: the workload's, 32 per server)",
    )
    live.add_argument(
        "--full-streams",
        action="store_true",
        help="wait for every answer to finish (default: stop at the last first token)",
    )
    live.add_argument("--warmup", type=float, default=0.0, metavar="S",
                      help="leave requests arriving in the first S seconds out of the "
                           "statistics (the cold start; default 0)")  # fmt: skip
    live.add_argument("--scheduling", default=None, metavar="JSON",
                      help="poolkeeper's spec.scheduling as JSON, e.g. '{\"preset\": "
                           "\"prefill-backlog\"}' (default: the default profile)")  # fmt: skip
    live.add_argument("--flow-control", default=None, metavar="JSON",
                      help="poolkeeper's spec.flowControl as JSON (default: the shipped "
                           "defaults)")  # fmt: skip
    live.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the simulators' batch slots (default: the simulator's 256)",
    )
    live.add_argument("--stream-interval", type=int, default=1,
                      help="the simulators' tokens per streamed event after the first "
                           "(default 1; more: less CPU, same TTFT)")  # fmt: skip
    live.add_argument("--out", type=Path, default=DEFAULT_OUT)
    live.set_defaults(handler=bench_live)

    ov = sub.add_parser("overhead", help="EPP decision time vs fleet size; gateway overhead")
    ov.add_argument("--sizes", default="10,100,1000")
    ov.add_argument("--decisions", type=int, default=2000)
    ov.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ov.add_argument("--quick", action="store_true")
    ov.add_argument(
        "--peers",
        type=_names,
        default=(),
        help="also through these routers, side by side (vllm-router,sglang-router; "
        "installed by scripts/install-peers.sh)",
    )
    ov.add_argument(
        "--prompt-bytes", default="", help="prompt sizes to compare, e.g. 1024,65536,262144,1048576"
    )
    ov.add_argument(
        "--floor",
        action="store_true",
        help="also through Envoy alone and Envoy + a do-nothing Python ext_proc processor "
        "(on grpc.aio and on the lean transport): the floor under poolkeeper's added latency",
    )
    ov.add_argument(
        "--grpcio",
        "--lean",  # the old spelling, from when the plain poolkeeper ran grpcio
        dest="grpcio",
        action="store_true",
        help="also through a second poolkeeper whose ext_proc port runs grpcio "
        "(listeners.extProcTransport: grpcio), interleaved with the first (lean, the default)",
    )
    ov.set_defaults(handler=bench_overhead)

    flow = sub.add_parser("flow", help="flow control: fairness, Critical under a flood, burst")
    flow.add_argument("--servers", type=int, default=8, help="fleet size (default 8)")
    flow.add_argument("--duration", type=float, default=30.0,
                      help="arrival window in virtual seconds (default 30)")  # fmt: skip
    flow.add_argument("--burst", type=float, default=60.0,
                      help="length of the 10x burst in virtual seconds (default 60)")  # fmt: skip
    flow.add_argument("--seed", type=int, default=1)
    flow.add_argument("--out", type=Path, default=DEFAULT_OUT)
    flow.add_argument("--grid", action="store_true",
                      help="instead: fair sharing on fleets of 2 and 8 servers x 2, 8, 64 and "
                      "256 batch slots, closed and open loops, equal and weighted tokens, and "
                      "the issue 35 case (writes <out>/flow-grid.json; --duration per case, "
                      "default 30: try 6; token-weighted cases run 5 times as long)")  # fmt: skip
    flow.add_argument("--live", type=int, default=0, metavar="N",
                      help="instead: the issue 35 case (2 servers x 2 batch slots, alpha 30 "
                      "closed-loop clients, beta 3) N times live through poolkeeper serve "
                      "and real Envoy, then once in virtual time (writes "
                      "<out>/flow-live.json)")  # fmt: skip
    flow.set_defaults(handler=bench_flow)

    rep = sub.add_parser("report", help="markdown tables and plots from result files")
    rep.add_argument("--in", dest="inp", type=Path, default=DEFAULT_OUT)
    rep.add_argument("--img", type=Path, default=None)
    rep.set_defaults(handler=bench_report)

    seeds = sub.add_parser(
        "seeds", help="mean-of-seeds tables: each poolkeeper policy against the best baseline"
    )
    seeds.add_argument("dirs", type=Path, nargs="+",
                       help="one sweep directory per seed (or one `bench flow --grid` --out "
                       "per seed: the least over seeds per cell)")  # fmt: skip
    seeds.set_defaults(handler=bench_seeds)

    allp = sub.add_parser("all", help="every benchmark (reduced with --quick)")
    allp.add_argument("--quick", action="store_true",
                      help="the reduced set `make bench` runs (< 10 min on 2 cores)")  # fmt: skip
    allp.add_argument("--out", type=Path, default=DEFAULT_OUT)
    allp.add_argument("--jobs", type=int, default=2)
    allp.set_defaults(handler=bench_all)
