"""A virtual-time sweep: every policy at every load on one scenario, in parallel processes.

Writes `<out>/sim-<workload>-<servers>.json` (inputs, capacity, one entry per point) and the
plots `<img>/sim-<workload>-<servers>-vs-load.png` and `...-ttft-cdf.png`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poolkeeper.bench.fleet.simrun import SCRAPE_INTERVAL_S, fleet_capacity, run_point
from poolkeeper.bench.policies.reference_policies import is_baseline
from poolkeeper.bench.results.metrics import SLO
from poolkeeper.bench.results.report import command_line, machine_info, plot_sweep, write_json
from poolkeeper.bench.workload.scenarios import build_scenario
from poolkeeper.flowcontrol.config import FlowControlConfig

DEFAULT_LOADS: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9, 1.1, 1.3)


@dataclass(frozen=True, slots=True)
class SweepSpec:
    workload: str
    servers: int
    policies: tuple[str, ...]
    loads: tuple[float, ...] = DEFAULT_LOADS
    duration: float = 60.0
    seed: int = 1
    slo: SLO = field(default_factory=SLO)
    scrape_interval: float = SCRAPE_INTERVAL_S
    flow_control: FlowControlConfig | None = None  # spec.flowControl of the poolkeeper policies


def _point(spec: SweepSpec, policy: str, load: float, capacity: float) -> dict[str, Any]:
    scenario = build_scenario(spec.workload, spec.servers)
    return run_point(
        scenario, policy, load=load, capacity_rps=capacity, duration=spec.duration,
        seed=spec.seed, slo=spec.slo, scrape_interval=spec.scrape_interval,
        flow_control=spec.flow_control,
    )  # fmt: skip


def run_sweep(
    spec: SweepSpec,
    *,
    out_dir: Path,
    img_dir: Path | None,
    jobs: int = 1,
    progress: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    scenario = build_scenario(spec.workload, spec.servers)
    started = time.perf_counter()
    capacity = fleet_capacity(scenario, seed=spec.seed)
    cap = float(capacity["capacity_rps"])
    progress(f"{spec.workload}: {spec.servers} servers, capacity {cap:.1f} req/s")
    order = {p: i for i, p in enumerate(spec.policies)}
    points = [(p, load) for load in spec.loads for p in spec.policies]
    runs: list[dict[str, Any]] = []
    if jobs <= 1:
        for policy, load in points:
            runs.append(_point(spec, policy, load, cap))
            progress(_line(runs[-1]))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures: list[Future[dict[str, Any]]] = [
                pool.submit(_point, spec, policy, load, cap) for policy, load in points
            ]
            for fut in futures:
                runs.append(fut.result())
                progress(_line(runs[-1]))
    for r in runs:
        r["order"] = order[r["policy"]]
    sweep: dict[str, Any] = {
        "kind": "bench-sim",
        "command": command_line(),
        "machine": machine_info(),
        "workload": scenario.spec.describe(),
        "fleet": scenario.describe(),
        "capacity": capacity,
        "loads": list(spec.loads),
        "policies": list(spec.policies),
        "duration_s": spec.duration,
        "seed": spec.seed,
        "slo": {"ttft_s": spec.slo.ttft_s, "itl_s": spec.slo.itl_s, "text": spec.slo.describe()},
        "scrape_interval_s": spec.scrape_interval,
        **(
            {"flow_control": spec.flow_control.model_dump(mode="json", by_alias=True)}
            if spec.flow_control is not None
            else {}
        ),
        "wall_s": 0.0,
        "runs": runs,
    }
    sweep["wall_s"] = time.perf_counter() - started
    stem = f"sim-{spec.workload}-{spec.servers}"
    write_json(out_dir / f"{stem}.json", sweep)
    if img_dir is not None:
        sweep["plots"] = [str(p) for p in plot_sweep(sweep, img_dir, stem)]
        write_json(out_dir / f"{stem}.json", sweep)
    return sweep


def _line(run: dict[str, Any]) -> str:
    s = run["summary"]
    return (
        f"  {run['policy']:>14} @ {run['load']:.2f}x: TTFT p90 {s['ttft_s']['p90']:.3f} s, "
        f"goodput {s['goodput_rps']:.1f} req/s, shed {s['shed']}, "
        f"hit {s['prefix_hit_rate']:.0%} ({run['wall_s']:.1f} s)"
    )


def _p90(runs: Sequence[dict[str, Any]], policy: str, load: float) -> float:
    for r in runs:
        if r["policy"] == policy and r["load"] == load:
            value = r["summary"]["ttft_s"]["p90"]
            return float(value) if value is not None else float("nan")
    return float("nan")


def targets_table(sweeps: Sequence[dict[str, Any]], *, policy: str = "poolkeeper") -> str:
    """The acceptance targets at 0.9x and for goodput at every load, per workload."""
    lines = [
        f"| workload | p90 TTFT {policy} (s) | round-robin (s) | ratio (target <= 0.5) "
        "| best baseline (s) | ratio (target <= 0.85) | goodput >= best baseline at every load |",
        "|---|---|---|---|---|---|---|",
    ]
    for sweep in sweeps:
        runs = sweep["runs"]
        at = min({r["load"] for r in runs}, key=lambda x: abs(x - 0.9))

        def p90(name: str, runs: list[dict[str, Any]] = runs, load: float = at) -> float:
            return _p90(runs, name, load)

        ours, rr = p90(policy), p90("round-robin")
        others = [p for p in sweep["policies"] if is_baseline(p)]
        best = min(others, key=p90)
        good_ok: list[str] = []
        for load in sorted({r["load"] for r in runs}):
            g = {r["policy"]: r["summary"]["goodput_rps"] for r in runs if r["load"] == load}
            top = max(v for k, v in g.items() if is_baseline(k))
            if g.get(policy, 0.0) < top - 1e-9:
                good_ok.append(f"{load:g}x: {g.get(policy, 0.0):.1f} < {top:.1f}")
        lines.append(
            f"| {sweep['workload']['kind']} | {ours:.3f} | {rr:.3f} | {ours / rr:.2f} "
            f"| {p90(best):.3f} ({best}) | {ours / p90(best):.2f} "
            f"| {'yes' if not good_ok else 'no: ' + '; '.join(good_ok)} |"
        )
    return "\n".join(lines)
