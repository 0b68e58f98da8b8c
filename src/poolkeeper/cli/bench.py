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
from typing import TYPE_CHECKING, Any

from poolkeeper.errors import ConfigError

if TYPE_CHECKING:
    from poolkeeper.flowcontrol.config import FlowControlConfig

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
    sim.set_defaults(handler=_sim)

    wl = sub.add_parser("workload", help="write a workload to a JSONL file")
    wl.add_argument("--workload", required=True)
    wl.add_argument("--servers", type=int, default=8, help="fleet size the defaults scale to")
    wl.add_argument("--rate", type=float, required=True, help="requests per second")
    wl.add_argument("--duration", type=float, default=60.0)
    wl.add_argument("--seed", type=int, default=1)
    wl.add_argument("--out", type=Path, required=True)
    wl.set_defaults(handler=_workload)

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
    live.set_defaults(handler=_live)

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
    ov.set_defaults(handler=_overhead)

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
    flow.set_defaults(handler=_flow)

    rep = sub.add_parser("report", help="markdown tables and plots from result files")
    rep.add_argument("--in", dest="inp", type=Path, default=DEFAULT_OUT)
    rep.add_argument("--img", type=Path, default=None)
    rep.set_defaults(handler=_report)

    seeds = sub.add_parser(
        "seeds", help="mean-of-seeds tables: each poolkeeper policy against the best baseline"
    )
    seeds.add_argument("dirs", type=Path, nargs="+",
                       help="one sweep directory per seed (or one `bench flow --grid` --out "
                       "per seed: the least over seeds per cell)")  # fmt: skip
    seeds.set_defaults(handler=_seeds)

    allp = sub.add_parser("all", help="every benchmark (reduced with --quick)")
    allp.add_argument("--quick", action="store_true",
                      help="the reduced set `make bench` runs (< 10 min on 2 cores)")  # fmt: skip
    allp.add_argument("--out", type=Path, default=DEFAULT_OUT)
    allp.add_argument("--jobs", type=int, default=2)
    allp.set_defaults(handler=_all)


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _sim(args: argparse.Namespace) -> int:
    from poolkeeper.bench.fleet.sweep import DEFAULT_LOADS, SweepSpec, run_sweep, targets_table
    from poolkeeper.bench.policies.routers import ALL_POLICIES, KNOWN_POLICIES
    from poolkeeper.bench.results.metrics import SLO
    from poolkeeper.bench.workload.workloads import ROUTING_WORKLOADS, WorkloadKind

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
        flow_control = _flow_control(args.flow_control)
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
                progress=_progress,
            )
        )
    for ours in ("poolkeeper", "poolkeeper-proposed"):
        if ours in policies and "round-robin" in policies:
            print(targets_table(sweeps, policy=ours))
    return 0


def _flow_control(text: str | None) -> FlowControlConfig | None:
    """`--flow-control` as a FlowControlConfig; ConfigError naming the field on bad input."""
    if text is None:
        return None
    from pydantic import ValidationError

    from poolkeeper.api.fielderrors import from_pydantic
    from poolkeeper.flowcontrol.config import FlowControlConfig

    try:
        return FlowControlConfig.model_validate_json(text)
    except ValidationError as exc:  # the wording of every other config error
        problems = "; ".join(str(e) for e in from_pydantic(exc, prefix=("spec", "flowControl")))
        raise ConfigError(f"--flow-control: {problems}") from None


def _flow_control_section(text: str | None) -> dict[str, Any] | None:
    """`--flow-control` checked as a spec.flowControl section; the dict poolkeeper serve gets."""
    if text is None:
        return None
    import json

    _flow_control(text)  # ConfigError naming the field
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ConfigError("--flow-control: expected a JSON object")
    return doc


def _scheduling(text: str | None) -> dict[str, Any] | None:
    """`--scheduling` checked as a spec.scheduling section; the dict poolkeeper serve gets."""
    if text is None:
        return None
    import json

    from pydantic import ValidationError

    from poolkeeper.api.fielderrors import from_pydantic
    from poolkeeper.scheduling.config import SchedulingConfig

    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ConfigError("--scheduling: expected a JSON object")
        SchedulingConfig.model_validate(doc)
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            problems = "; ".join(str(e) for e in from_pydantic(exc, prefix=("spec", "scheduling")))
            raise ConfigError(f"--scheduling: {problems}") from None
        raise ConfigError(f"--scheduling: not JSON ({exc})") from None
    return doc


def _flow(args: argparse.Namespace) -> int:
    from poolkeeper.bench.fleet.flowbench import format_flow, run_flow_bench

    if args.servers < 1 or args.duration <= 0 or args.burst <= 0:
        print("poolkeeper bench flow: --servers >= 1, --duration and --burst > 0", file=sys.stderr)
        return 2
    if args.live > 0:
        return _flow_live(args)
    if args.grid:
        from poolkeeper.bench.fleet.fairshare import GRID_HEADER, format_grid, run_grid
        from poolkeeper.bench.results.report import command_line, write_json

        print(GRID_HEADER)
        grid = run_grid(duration_s=args.duration, seed=args.seed, progress=print)
        grid["command"] = command_line()
        write_json(args.out / "flow-grid.json", grid)
        print(GRID_HEADER)
        print(format_grid(grid))
        return 0
    data = run_flow_bench(servers=args.servers, duration=args.duration, burst_s=args.burst,
                          seed=args.seed, out_dir=args.out, progress=_progress)  # fmt: skip
    print(format_flow(data))
    return 0


def _flow_live(args: argparse.Namespace) -> int:
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


def _workload(args: argparse.Namespace) -> int:
    from poolkeeper.bench.workload.workloads import default_spec, generate, save_jsonl

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


def _live(args: argparse.Namespace) -> int:
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
            groups=args.groups, warmup=args.warmup, scheduling=_scheduling(args.scheduling),
            max_num_seqs=args.max_num_seqs, stream_interval=args.stream_interval,
            flow_control=_flow_control_section(args.flow_control),
        )  # fmt: skip
        run_live(spec, out_dir=args.out, progress=_progress)
    except ConfigError as exc:
        print(f"poolkeeper bench live: {exc}", file=sys.stderr)
        return 2
    return 0


def _overhead(args: argparse.Namespace) -> int:
    from poolkeeper.bench.overhead.overhead import run_overhead

    try:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    except ValueError:
        print(f"poolkeeper bench overhead: bad --sizes {args.sizes!r}", file=sys.stderr)
        return 2
    run_overhead(sizes=sizes, decisions=args.decisions, out_dir=args.out, quick=args.quick,
                 peers=tuple(args.peers), prompt_bytes=args.prompt_bytes, floor=args.floor,
                 grpcio=args.grpcio,
                 progress=_progress)  # fmt: skip
    return 0


def _report(args: argparse.Namespace) -> int:
    from poolkeeper.bench.fleet.sweep import targets_table
    from poolkeeper.bench.results.report import plot_sweep, read_json, sweep_table

    files = sorted(args.inp.glob("sim-*.json"))
    if not files:
        print(f"poolkeeper bench report: no sim-*.json in {args.inp}", file=sys.stderr)
        return 2
    sweeps = [read_json(f) for f in files]
    for f, sweep in zip(files, sweeps, strict=True):
        print(f"\n### {f.stem}\n")
        print(sweep_table(sweep))
        if args.img is not None:
            plot_sweep(sweep, args.img, f.stem)
    for ours in ("poolkeeper", "poolkeeper-proposed"):
        print(f"\n### targets: {ours}\n")
        print(targets_table([s for s in sweeps if ours in s["policies"]], policy=ours))
    return 0


def _seeds(args: argparse.Namespace) -> int:
    from poolkeeper.bench.results.report import read_json
    from poolkeeper.bench.results.seedmeans import check_sweep, seed_tables

    grids = [d / "flow-grid.json" for d in args.dirs if (d / "flow-grid.json").is_file()]
    if grids:  # `bench flow --grid` once per seed: the least over seeds per cell
        from poolkeeper.bench.fleet.fairshare import format_grid_seeds

        try:
            print(format_grid_seeds([read_json(g) for g in grids]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"poolkeeper bench seeds: not a flow grid: {exc}", file=sys.stderr)
            return 2
        return 0
    files = [f for d in args.dirs for f in sorted(d.glob("sim-*.json"))]
    if not files:
        where = ", ".join(str(d) for d in args.dirs)
        print(f"poolkeeper bench seeds: no sim-*.json in {where}", file=sys.stderr)
        return 2
    sweeps = []
    for f in files:
        try:
            sweeps.append(check_sweep(read_json(f), str(f)))
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            text = str(exc) if str(f) in str(exc) else f"{f}: {exc}"
            print(f"poolkeeper bench seeds: {text}", file=sys.stderr)
            return 2
    print(seed_tables(sweeps))
    return 0


def _all(args: argparse.Namespace) -> int:
    from poolkeeper.bench.allbench import run_all

    return run_all(out_dir=args.out, quick=args.quick, jobs=args.jobs, progress=_progress)
