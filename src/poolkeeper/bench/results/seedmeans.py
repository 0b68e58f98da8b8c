"""Acceptance tables over several seeds: each poolkeeper policy against the best baseline.

    poolkeeper bench seeds bench-results/s1 bench-results/s2 bench-results/s3

Reads the `sim-<workload>-<servers>.json` sweeps of each directory (one seed each), averages
p90 TTFT and goodput over the seeds per (workload, servers, load, policy), and prints one
markdown table per workload and fleet size:

- best baseline = the lowest mean p90 (resp. highest mean goodput) among the peer routers'
  policies (neither `poolkeeper*` nor a `ref-*` reference policy), at that load; the poolkeeper
  and reference policies get a column each;
- floor = the lowest mean p90 at the lowest load of any policy but the reference ones; a load
  where the best baseline is within 10 % of it is marked `floor` (every router sits at the
  idle pool's latency there, and the ratio target does not apply);
- ratio = ours / best baseline, marked `*` above 0.85 where the target applies; a goodput
  marked `(<)` is more than 0.5 % below the best baseline's;
- shed = mean requests refused or timed out in the router per run.

Only points present for every seed are averaged; the seed count is in each table's title.

A workload whose runs mix criticalities (mixed-criticality) also gets one table per criticality
that a router must not trade away, Critical and Standard (`<workload> [Critical]`): the same
columns over that criticality's requests alone (its p90 TTFT, goodput and refusals; the floor
is that criticality's lowest p90 at the lowest load). Sheddable waits in the router by design
and has no table of its own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poolkeeper.bench.policies.reference_policies import is_baseline, is_reference

P90_TARGET = 0.85
GOODPUT_SLACK = 0.005
FLOOR_MARGIN = 1.10
# Criticalities with a table of their own where a workload mixes them.
REPORTED_CRITICALITIES = ("Critical", "Standard")


@dataclass(frozen=True, slots=True)
class Mean:
    p90: float
    goodput: float
    shed: float


def check_sweep(sweep: Any, source: str) -> Mapping[str, Any]:
    """`sweep` if it has every field the tables read; else ValueError naming file and field."""

    def need(value: Any, path: str, kind: type | tuple[type, ...]) -> Any:
        if not isinstance(value, kind) or isinstance(value, bool):
            what = getattr(kind, "__name__", "number")
            raise ValueError(f"{source}: {path}: missing or not a {what}")
        return value

    checked: Mapping[str, Any] = need(sweep, "(top level)", dict)
    need(need(sweep.get("workload"), "workload", dict).get("kind"), "workload.kind", str)
    need(need(sweep.get("fleet"), "fleet", dict).get("servers"), "fleet.servers", int)
    need(sweep.get("seed"), "seed", int)
    for i, run in enumerate(need(sweep.get("runs"), "runs", list)):
        at = f"runs[{i}]"
        need(run, at, dict)
        need(run.get("policy"), f"{at}.policy", str)
        need(run.get("load"), f"{at}.load", (int, float))
        summary = need(run.get("summary"), f"{at}.summary", dict)
        ttft = need(summary.get("ttft_s"), f"{at}.summary.ttft_s", dict)
        if ttft.get("p90") is not None:
            need(ttft.get("p90"), f"{at}.summary.ttft_s.p90", (int, float))
        need(summary.get("goodput_rps"), f"{at}.summary.goodput_rps", (int, float))
        need(summary.get("shed"), f"{at}.summary.shed", (int, float))
    return checked


def mean_points(
    sweeps: Iterable[Mapping[str, Any]],
) -> tuple[dict[tuple[str, int], dict[float, dict[str, Mean]]], dict[tuple[str, int], int]]:
    """{(workload, servers): {load: {policy: Mean}}} over the seeds, and the seeds per group."""
    values: dict[tuple[str, int, float, str], dict[int, tuple[float, float, float]]]
    values = defaultdict(dict)
    seeds: dict[tuple[str, int], set[int]] = defaultdict(set)
    for sweep in sweeps:
        key = (str(sweep["workload"]["kind"]), int(sweep["fleet"]["servers"]))
        seed = int(sweep["seed"])
        seeds[key].add(seed)
        for run in sweep["runs"]:
            s = run["summary"]
            p90 = s["ttft_s"]["p90"]
            load, policy = float(run["load"]), str(run["policy"])
            values[(*key, load, policy)][seed] = (
                float("nan") if p90 is None else float(p90),
                float(s["goodput_rps"]),
                float(s["shed"]),
            )
            by_crit = s.get("by_criticality")
            if not isinstance(by_crit, dict) or len(by_crit) < 2:
                continue
            for crit in REPORTED_CRITICALITIES:
                c = by_crit.get(crit)
                if not isinstance(c, dict):
                    continue
                crit_key = (f"{key[0]} [{crit}]", key[1])
                seeds[crit_key].add(seed)
                p90c = c.get("ttft_p90_s")
                values[(*crit_key, load, policy)][seed] = (
                    float("nan") if p90c is None else float(p90c),
                    float(c.get("goodput_rps", 0.0)),
                    float(c.get("shed", 0.0)),
                )
    out: dict[tuple[str, int], dict[float, dict[str, Mean]]] = defaultdict(dict)
    for (workload, servers, load, policy), by_seed in values.items():
        want = seeds[(workload, servers)]
        if set(by_seed) != want:
            continue  # a point missing for some seed is not averaged
        n = len(by_seed)
        p90s, goods, sheds = zip(*by_seed.values(), strict=True)
        out[(workload, servers)].setdefault(load, {})[policy] = Mean(
            sum(p90s) / n, sum(goods) / n, sum(sheds) / n
        )
    return dict(out), {k: len(v) for k, v in seeds.items()}


def _table(points: Mapping[float, Mapping[str, Mean]], ours: Sequence[str]) -> list[str]:
    loads = sorted(points)
    lowest = points[loads[0]]
    floor = min(  # what routers reach on the idle pool: the reference policies are not routers
        (m.p90 for p, m in lowest.items() if not is_reference(p) and not math.isnan(m.p90)),
        default=0.0,
    )
    head = "| load | best baseline p90 (s) |"
    rule = "|---|---|"
    for name in ours:
        head += f" {name} p90 | ratio |"
        rule += "---|---|"
    head += " best baseline goodput |" + "".join(f" {name} |" for name in ours) + " shed |"
    rule += "---|" + "---|" * len(ours) + "---|"
    lines = [f"(floor = lowest mean p90 at {loads[0]:g}x: {floor:.3f} s)", "", head, rule]
    for load in loads:
        row = points[load]
        base = {p: m for p, m in row.items() if is_baseline(p)}
        present = [name for name in ours if name in row]
        if not base or not present:
            continue
        best_p = min(base, key=lambda p: base[p].p90)
        best_g = max(base, key=lambda p: base[p].goodput)
        at_floor = base[best_p].p90 <= FLOOR_MARGIN * floor
        cells = f"| {load:g} | {base[best_p].p90:.3f} ({best_p}){' floor' if at_floor else ''} |"
        for name in ours:
            if name not in row:
                cells += " - | - |"
                continue
            ratio = row[name].p90 / base[best_p].p90
            miss = "*" if ratio > P90_TARGET and not at_floor else ""
            cells += f" {row[name].p90:.3f} | {ratio:.2f}{miss} |"
        cells += f" {base[best_g].goodput:.1f} ({best_g}) |"
        for name in ours:
            if name not in row:
                cells += " - |"
                continue
            low = row[name].goodput < base[best_g].goodput * (1 - GOODPUT_SLACK)
            cells += f" {row[name].goodput:.1f}{' (<)' if low else ''} |"
        cells += " " + " / ".join(f"{row[n].shed:.0f}" for n in present) + " |"
        lines.append(cells)
    return lines


def seed_tables(sweeps: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: one table per (workload, servers); see the module docstring."""
    points, seeds = mean_points(sweeps)
    parts: list[str] = []
    for workload, servers in sorted(points):
        by_load = points[(workload, servers)]
        ours = sorted({p for row in by_load.values() for p in row if not is_baseline(p)})
        if not ours:
            continue
        parts.append(f"#### {workload}, {servers} servers ({seeds[(workload, servers)]} seeds)")
        parts.append("")
        parts.extend(_table(by_load, ours))
        parts.append("")
    return "\n".join(parts) if parts else "no sweep with a poolkeeper policy"
