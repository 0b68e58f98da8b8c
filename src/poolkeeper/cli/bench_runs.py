"""The runs of `poolkeeper bench` (its parser: `cli/bench.py`): each handler checks its options,
runs the benchmark from `poolkeeper.bench` and writes its results.

`bench sim`, `bench flow` (and `--grid`, `--live`), `bench workload`, `bench live`,
`bench overhead`, `bench all`; the tables made from result files are `cli/bench_tables.py`'s.
Each imports its benchmark when it runs (the `poolkeeper` command starts without them).
"""

from __future__ import annotations

import argparse
import sys

from poolkeeper.cli.bench_sections import (
    flow_control_config,
    flow_control_section,
    scheduling_section,
)
from poolkeeper.errors import ConfigError


def progress(msg: str) -> None:
    print(msg, flush=True)


def bench_sim(args: argparse.Namespace) -> int:
    from poolkeeper.bench.fleet.sweep import DEFAULT_LOADS, SweepSpec, run_sweep, targets_table
    from poolkeeper.bench.policies.routers import ALL_POLICIES, KNOWN_POLICIES
    from poolkeeper.bench.results.metrics import SLO
    from poolkeeper.bench.workload.workload_spec import ROUTING_WORKLOADS, WorkloadKind

    try:
        workloads = args.workload or tuple(str(k) for k in ROUTING_WORKLOADS)
        for w in workloads:
            WorkloadKind(w)
        policies = args.policies or ALL_POLICIES
        unknown = [p for p in policies if p not in KNOWN_POLICIES]
        if unknown:
            raise ConfigError(f"unknown policies {unknown}; known: {', '.join(KNOWN_POLICIES)}")
        if args.servers < 1 or args.duration <= 0:
            raise ConfigError("--servers must be >= 1 and --duration > 0")
        if not 0 < args.scrape_interval <= 60:
            raise ConfigError("--scrape-interval must be in (0, 60] seconds")
        flow_control = flow_control_config(args.flow_control)
    except (ValueError, ConfigError) as exc:
        print(f"poolkeeper bench sim: {exc}", file=sys.stderr)
        return 2
    sweeps = []
    for w in workloads:
        spec = SweepSpec(
            workload=w, servers=args.servers, policies=tuple(policies),
            loads=args.loads or DEFAULT_LOADS, duration=args.duration, seed=args.seed,
            slo=SLO(args.slo_ttft, args.slo_itl), scrape_interval=args.scrape_interval,
            flow_control=flow_control,
        )  # fmt: skip
        sweeps.append(
            run_sweep(
                spec,
                out_dir=args.out,
                img_dir=args.img or args.out / "img",
                jobs=args.jobs,
                progress=progress,
            )
        )
    for ours in ("poolkeeper", "poolkeeper-proposed"):
        if ours in policies and "round-robin" in policies:
            print(targets_table(sweeps, policy=ours))
    return 0


def bench_flow(args: argparse.Namespace) -> int:
    from poolkeeper.bench.fleet.flowbench import format_flow, run_flow_bench

    if args.servers < 1 or args.duration <= 0 or args.burst <= 0:
        print("poolkeeper bench flow: --servers >= 1, --duration and --burst > 0", file=sys.stderr)
        return 2
    if args.live > 0:
        return bench_flow_live(args)
    if args.grid:
        from poolkeeper.bench.fleet.fairshare_grid import GRID_HEADER, format_grid, run_grid
        from poolkeeper.bench.results.report import command_line, write_json

        print(GRID_HEADER)
        grid = run_grid(duration_s=args.duration, seed=args.seed, progress=print)
        grid["command"] = command_line()
        write_json(args.out / "flow-grid.json", grid)
        print(GRID_HEADER)
        print(format_grid(grid))
        return 0
    data = run_flow_bench(servers=args.servers, duration=args.duration, burst_s=args.burst,
                          seed=args.seed, out_dir=args.out, progress=progress)  # fmt: skip
    print(format_flow(data))
    return 0


def bench_flow_live(args: argparse.Namespace) -> int:
    from poolkeeper.bench.fleet.fairshare import issue35_case, run_case
    from poolkeeper.bench.live.fairlive import run_fair_live
    from poolkeeper.bench.results.report import command_line, machine_info, write_json

    case = issue35_case()
    try:
        live = [run_fair_live(case, seed=args.seed, progress=print) for _ in range(args.live)]
    except ConfigError as exc:
        print(f"poolkeeper bench flow: {exc}", file=sys.stderr)
        return 2
    virtual = run_case(case, "poolkeeper", args.seed)
    ratios = ", ".join(f"{r['beta_to_alpha']:.2f}" for r in live)
    print(f"beta/alpha live: {ratios}; virtual: {virtual['beta_to_alpha']:.2f}")
    write_json(args.out / "flow-live.json", {
        "kind": "bench-flow-live", "command": command_line(), "machine": machine_info(),
        "live": live, "virtual": virtual,
    })  # fmt: skip
    return 0


def bench_workload(args: argparse.Namespace) -> int:
    from poolkeeper.bench.workload.workload_files import save_jsonl
    from poolkeeper.bench.workload.workload_spec import default_spec
    from poolkeeper.bench.workload.workloads import generate

    try:
        spec = default_spec(args.workload, args.servers)
        arrivals = generate(spec, rate=args.rate, duration=args.duration, seed=args.seed)
    except (ValueError, ConfigError) as exc:
        print(f"poolkeeper bench workload: {exc}", file=sys.stderr)
        return 2
    meta = {**spec.describe(), "rate_rps": args.rate, "duration_s": args.duration,
            "seed": args.seed}  # fmt: skip
    save_jsonl(args.out, arrivals, meta)
    print(f"wrote {len(arrivals)} requests to {args.out}")
    return 0


def bench_live(args: argparse.Namespace) -> int:
    from poolkeeper.bench.live.live import LiveSpec, run_live

    try:
        if not 0 <= args.warmup < args.duration:
            raise ConfigError("--warmup must be in [0, --duration)")
        if args.max_num_seqs is not None and args.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be >= 1")
        if args.stream_interval < 1:
            raise ConfigError("--stream-interval must be >= 1")
        spec = LiveSpec(
            workload=args.workload, servers=args.servers, rate=args.rate,
            duration=args.duration, rounds=args.rounds, peers=tuple(args.peers),
            time_scale=args.time_scale, seed=args.seed, full_streams=args.full_streams,
            groups=args.groups, warmup=args.warmup, scheduling=scheduling_section(args.scheduling),
            max_num_seqs=args.max_num_seqs, stream_interval=args.stream_interval,
            flow_control=flow_control_section(args.flow_control),
        )  # fmt: skip
        run_live(spec, out_dir=args.out, progress=progress)
    except ConfigError as exc:
        print(f"poolkeeper bench live: {exc}", file=sys.stderr)
        return 2
    return 0


def bench_overhead(args: argparse.Namespace) -> int:
    from poolkeeper.bench.overhead.overhead import run_overhead

    try:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    except ValueError:
        print(f"poolkeeper bench overhead: bad --sizes {args.sizes!r}", file=sys.stderr)
        return 2
    run_overhead(sizes=sizes, decisions=args.decisions, out_dir=args.out, quick=args.quick,
                 peers=tuple(args.peers), prompt_bytes=args.prompt_bytes, floor=args.floor,
                 grpcio=args.grpcio,
                 progress=progress)  # fmt: skip
    return 0


def bench_all(args: argparse.Namespace) -> int:
    from poolkeeper.bench.allbench import run_all

    return run_all(out_dir=args.out, quick=args.quick, jobs=args.jobs, progress=progress)
