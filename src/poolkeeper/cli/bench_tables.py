"""The tables of `poolkeeper bench` made from result files: `bench report`, `bench seeds`.

`bench report` prints each sweep's Markdown table (and plots with `--img`) and the targets
tables; `bench seeds` the mean-of-seeds tables of several sweeps (or the least over seeds per
cell of several `bench flow --grid` runs). Parser: `cli/bench.py`.
"""

from __future__ import annotations

import argparse
import sys


def bench_report(args: argparse.Namespace) -> int:
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


def bench_seeds(args: argparse.Namespace) -> int:
    from poolkeeper.bench.results.report import read_json
    from poolkeeper.bench.results.seedmeans import check_sweep, seed_tables

    grids = [d / "flow-grid.json" for d in args.dirs if (d / "flow-grid.json").is_file()]
    if grids:  # `bench flow --grid` once per seed: the least over seeds per cell
        from poolkeeper.bench.fleet.fairshare_grid import format_grid_seeds

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
