"""Benchmark results on disk: one JSON file per sweep, PNG plots, markdown tables.

A sweep file holds the run's inputs (workload, fleet, loads, seed, SLO, command line, machine)
and one entry per (policy, load) with the summary of `bench.results.metrics` plus the TTFT
distribution as 101 quantiles (enough to draw a CDF without storing every request).
Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from poolkeeper.bench.policies.reference_policies import is_ours
from poolkeeper.bench.results.metrics import percentile


def git_commit() -> str:
    """HEAD of the source tree the benchmark ran from, "+dirty" if src/ had local changes."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    return {
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "processor": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command_line() -> str:
    return "poolkeeper " + " ".join(sys.argv[1:]) if sys.argv else "poolkeeper"


def quantiles(values: Sequence[float], points: int = 101) -> list[float]:
    data = sorted(values)
    return [percentile(data, 100.0 * i / (points - 1)) for i in range(points)]


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(data), indent=1) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def _dig(data: Mapping[str, Any], keys: Sequence[str]) -> float:
    value: Any = data
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return _num(value)


def _width(policy: str) -> float:
    return 2.2 if is_ours(policy) else 1.2


def _style(policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A distinct colour per policy (tab20 has enough for every policy), bold poolkeeper."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    out: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(policies):
        out[p] = {
            "color": "black" if p == "poolkeeper" else cmap((2 * i) % 20 + (2 * i) // 20),
            "linewidth": _width(p),
            "linestyle": "--" if p == "poolkeeper-proposed" else "-",
        }
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(sweep: Mapping[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Latency-vs-load (p90 TTFT, p90 ITL, goodput) per policy, and TTFT CDFs at one load."""
    plt = _pyplot()
    runs: list[Mapping[str, Any]] = list(sweep.get("runs", []))
    policies = list(dict.fromkeys(str(r["policy"]) for r in runs))
    kind = sweep.get("workload", {}).get("kind", "?")
    title = f"{kind}, {sweep.get('fleet', {}).get('servers', '?')} servers"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    style = _style(policies)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("p90 TTFT (s)", ("ttft_s", "p90"), True),
        ("p90 mean ITL (s)", ("itl_s", "p90"), True),
        ("goodput (req/s)", ("goodput_rps",), False),
    )
    for ax, (label, keys, log) in zip(axes, panels, strict=True):
        for policy in policies:
            mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["load"])
            ys = [_dig(r["summary"], keys) for r in mine]
            ax.plot([r["load"] for r in mine], ys, marker="o", label=policy, **style[policy])
        ax.set_xlabel("offered load (x fleet capacity)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Latency vs load: {title}")
    fig.tight_layout()
    path = out_dir / f"{stem}-vs-load.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)

    cdf_load = _closest_load(runs, 0.9)
    if cdf_load is not None:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for policy in policies:
            for r in runs:
                if r["policy"] == policy and r["load"] == cdf_load and r.get("ttft_quantiles"):
                    qs = [_num(v) for v in r["ttft_quantiles"]]
                    fractions = [i / (len(qs) - 1) for i in range(len(qs))]
                    ax.plot(qs, fractions, label=policy, **style[policy])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests with a first token")
        ax.set_title(f"TTFT CDF at {cdf_load:g}x capacity: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}-ttft-cdf.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _closest_load(runs: Sequence[Mapping[str, Any]], target: float) -> float | None:
    loads = sorted({float(r["load"]) for r in runs})
    return min(loads, key=lambda x: abs(x - target)) if loads else None


def _fmt(value: float, scale: float = 1.0, digits: int = 3) -> str:
    if not math.isfinite(value):
        return "-"
    v = value * scale
    if abs(v) >= 10**digits:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def sweep_table(sweep: Mapping[str, Any], loads: Sequence[float] | None = None) -> str:
    """Markdown table: one row per (load, policy)."""
    runs: list[Mapping[str, Any]] = list(sweep.get("runs", []))
    wanted = set(loads) if loads is not None else None
    lines = [
        "| load | policy | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 (ms) | E2E p90 (s) "
        "| goodput (req/s) | tok/s | prefix hit | shed | swaps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: (r["load"], r.get("order", 0))):
        if wanted is not None and r["load"] not in wanted:
            continue
        s = r["summary"]
        t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
        lines.append(
            f"| {r['load']:g} | {r['policy']} "
            f"| {_fmt(_num(t['p50']))} / {_fmt(_num(t['p90']))} / {_fmt(_num(t['p99']))} "
            f"| {_fmt(_num(i['p50']), 1000)} / {_fmt(_num(i['p90']), 1000)} "
            f"| {_fmt(_num(e['p90']))} | {_fmt(_num(s['goodput_rps']))} "
            f"| {_fmt(_num(s['throughput_tok_s']), digits=4)} "
            f"| {_num(s['prefix_hit_rate']):.0%} | {s['shed']} "
            f"| {r.get('fleet_stats', {}).get('adapter_swaps', '-')} |"
        )
    return "\n".join(lines)


def criticality_table(sweep: Mapping[str, Any], load: float) -> str:
    lines = [
        "| policy | criticality | requests | completed | shed | goodput (req/s) | TTFT p90 (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sweep.get("runs", []):
        if r["load"] != load:
            continue
        for crit, c in r["summary"].get("by_criticality", {}).items():
            lines.append(
                f"| {r['policy']} | {crit} | {c['requests']} | {c['completed']} | {c['shed']} "
                f"| {_fmt(_num(c['goodput_rps']))} | {_fmt(_num(c['ttft_p90_s']))} |"
            )
    return "\n".join(lines)


def matrix_table(sweep: Mapping[str, Any], metric: str) -> str:
    """Policies x loads for one figure: `goodput` (req/s) or `ttft_p90` (s)."""
    runs: list[Mapping[str, Any]] = list(sweep.get("runs", []))
    loads = sorted({float(r["load"]) for r in runs})
    policies = list(dict.fromkeys(str(r["policy"]) for r in runs))
    cell: dict[tuple[str, float], float] = {}
    for r in runs:
        s = r["summary"]
        value = s["goodput_rps"] if metric == "goodput" else s["ttft_s"]["p90"]
        cell[(str(r["policy"]), float(r["load"]))] = _num(value)
    head = "| policy | " + " | ".join(f"{x:g}x" for x in loads) + " |"
    lines = [head, "|---|" + "---|" * len(loads)]
    for p in policies:
        values = [cell.get((p, x), math.nan) for x in loads]
        lines.append(f"| {p} | " + " | ".join(_fmt(v) for v in values) + " |")
    return "\n".join(lines)
