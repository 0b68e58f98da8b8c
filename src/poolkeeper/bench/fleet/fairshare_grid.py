"""`bench flow --grid`'s cases and tables: the issue 35 case and batch slots x servers x
equal/weighted tokens, closed loop and its open-loop twin, every policy of `fairshare.POLICIES`
on each (`run_grid`); one line per case (`format_grid`), and the grid over several seeds
(`format_grid_seeds`, `bench seeds`). One case's run and measurements live in `fairshare`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from poolkeeper.bench.fleet.fairshare import POLICIES, FairCase, issue35_case, run_case

GRID_SLOTS: tuple[int, ...] = (2, 8, 64, 256)
GRID_SERVERS: tuple[int, ...] = (2, 8)


WEIGHTED_LONGER = 5  # a token-weighted cell runs this many times the grid's duration


def grid_cases(duration_s: float) -> list[FairCase]:
    """Batch slots x servers x equal/weighted tokens, closed loop: beta has 0.6 clients per
    slot of the fleet plus one (more than its half: backlogged), alpha twice as many (so the
    Standard band's 2000 waiting requests hold the queue of 8 x 256 slots); each is also run
    as its open-loop twin (`open_case`). A weighted cell runs `WEIGHTED_LONGER` times as long:
    beta's 300-token answers take about a second each, so a 6 s run (a 4 s window after the
    warm-up third) measured mostly the ramp (8 x 8 open weighted: goodput 0.91 of the best
    non-fair policy at 6 s, 1.08 at 30 s)."""
    cases = []
    for servers in GRID_SERVERS:
        for slots in GRID_SLOTS:
            for tokens in ("equal", "weighted"):
                beta = math.ceil(0.6 * servers * slots) + 1
                length = duration_s * (WEIGHTED_LONGER if tokens == "weighted" else 1)
                cases.append(FairCase(servers=servers, slots=slots, tokens=tokens,
                                      alpha_clients=2 * beta, beta_clients=beta,
                                      duration_s=length, time_scale=1.0))  # fmt: skip
    return cases


def open_case(closed: FairCase, requests_per_s: float) -> FairCase:
    """The open-loop twin of a closed-loop case: alpha offers 2x, beta 0.8x the request rate
    the fleet served in the closed loop (both above their half: backlogged). `run_grid` takes
    that rate from the run without flow control, so the twin is the same case whatever the
    fair policy's settings (taken from the fair policy's own run, a change of its VTC charge
    changed the open case it was then compared on)."""
    return FairCase(
        servers=closed.servers, slots=closed.slots, loop="open", tokens=closed.tokens,
        alpha_rate=2.0 * requests_per_s, beta_rate=0.8 * requests_per_s,
        output_tokens=closed.output_tokens, duration_s=closed.duration_s,
        time_scale=closed.time_scale,
    )  # fmt: skip


def run_grid(
    *, duration_s: float, seed: int, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """The issue 35 case and the grid, every policy on each (the measurements of the module
    docstring); rows in the order of `format_grid`."""
    rows = []
    cases: list[FairCase] = [issue35_case()]
    for closed in grid_cases(duration_s):
        cases.append(closed)
    for case in cases:
        row: dict[str, Any] = {"case": case.label(), "spec": asdict(case)}
        for name in POLICIES:
            row[name] = run_case(case, name, seed)
        rows.append(row)
        progress(format_grid({"rows": [row]}))
        if case.loop == "closed" and case != issue35_case():
            done = sum(row["poolkeeper-shed"]["completed"].values())
            twin = open_case(case, done / case.duration_s)
            orow: dict[str, Any] = {"case": twin.label(), "spec": asdict(twin)}
            for name in POLICIES:
                orow[name] = run_case(twin, name, seed)
            rows.append(orow)
            progress(format_grid({"rows": [orow]}))
    return {"kind": "bench-flow-grid", "seed": seed, "duration_s": duration_s, "rows": rows}


def format_grid(data: dict[str, Any]) -> str:
    """One line per case: poolkeeper's beta/alpha, Jain's index, goodput and output tokens per
    second against the best non-fair policy's, batch slots busy (poolkeeper's, and the most
    of the others'), Standard refusals and the Critical probe; Jain's index of the others."""
    lines = []
    others = [n for n in POLICIES if n != "poolkeeper"]
    for row in data["rows"]:
        p = row["poolkeeper"]
        best = max(row[n]["goodput_tok_s"] for n in others)
        best_out = max(row[n].get("output_tok_s", 0.0) for n in others)
        out = p.get("output_tok_s", 0.0) / best_out if best_out else math.nan
        busy = max(row[n].get("slots_busy", 0.0) for n in others)
        probe = p["probe"]
        ttft = probe.get("ttft_s")
        lines.append(
            f"| {row['case']} | {p['beta_to_alpha']:.2f} | {p['jain']:.3f} | "
            f"{p['goodput_tok_s'] / best:.3f} | {out:.3f} | "
            f"{p.get('slots_busy', math.nan):.3f} ({busy:.3f}) | {p['standard_refused']} | "
            f"{probe['status']} {'' if ttft is None else f'{ttft * 1000:.0f} ms'} | "
            f"{row['poolkeeper-pre35']['jain']:.3f} | {row['poolkeeper-shed']['jain']:.3f} |"
        )
    return "\n".join(lines)


GRID_HEADER = (
    "| fleet, loop, tokens | beta/alpha | Jain | goodput / best non-fair | output tokens / best "
    "| slots busy (non-fair) | Standard refused | Critical probe | Jain pre-35 | Jain shed |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _against_best(row: dict[str, Any], key: str) -> float:
    """poolkeeper's `key` against the most any non-fair policy got in the same run."""
    best = max(row[n].get(key, 0.0) for n in POLICIES if n != "poolkeeper")
    return float(row["poolkeeper"].get(key, 0.0)) / best if best else math.nan


def format_grid_seeds(grids: Sequence[dict[str, Any]]) -> str:
    """The grid over several seeds (`bench seeds DIR...`, one `flow-grid.json` per seed): per
    cell the range of beta/alpha, the least Jain's index, goodput and output tokens against
    the best non-fair policy of the same seed, and batch slots busy (poolkeeper's, and the
    least of the non-fair policies' best); the most Standard refusals; the probes served."""
    issue = asdict(issue35_case())
    cells: dict[str, list[dict[str, Any]]] = {}
    for grid in grids:  # keyed by position: the issue 35 case has a grid cell's label
        for i, row in enumerate(grid["rows"]):
            label = row["case"] + (" (issue 35 case)" if row.get("spec") == issue else "")
            cells.setdefault(f"{i}:{label}", []).append(row)
    others = [n for n in POLICIES if n != "poolkeeper"]
    lines = [
        f"Seeds {', '.join(str(g.get('seed', '?')) for g in grids)}; per cell the least over "
        "seeds (beta/alpha: least-most; Standard refused: the most)",
        "| fleet, loop, tokens | beta/alpha | Jain | goodput / best non-fair | output / best "
        "| slots busy (non-fair) | Standard refused | Critical probe served |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, rows in cells.items():
        case = key.split(":", 1)[1]
        fair = [row["poolkeeper"] for row in rows]
        ratio = [p["beta_to_alpha"] for p in fair]
        busy = min(p.get("slots_busy", math.nan) for p in fair)
        base = min(max(r[n].get("slots_busy", math.nan) for n in others) for r in rows)
        lines.append(
            f"| {case} | {min(ratio):.2f}-{max(ratio):.2f} | {min(p['jain'] for p in fair):.3f} "
            f"| {min(_against_best(r, 'goodput_tok_s') for r in rows):.3f} "
            f"| {min(_against_best(r, 'output_tok_s') for r in rows):.3f} "
            f"| {busy:.3f} ({base:.3f}) | {max(p['standard_refused'] for p in fair)} "
            f"| {sum(p['probe']['status'] == 'ok' for p in fair)} of {len(rows)} |"
        )
    every = [(grid.get("seed", "?"), row) for grid in grids for row in grid["rows"]]
    seed_j, row_j = min(every, key=lambda sr: float(sr[1]["poolkeeper"]["jain"]))
    seed_g, row_g = min(every, key=lambda sr: _against_best(sr[1], "goodput_tok_s"))
    lines.append(
        f"Least Jain {row_j['poolkeeper']['jain']:.3f} ({row_j['case']}, seed {seed_j}); least "
        f"goodput / best {_against_best(row_g, 'goodput_tok_s'):.3f} ({row_g['case']}, "
        f"seed {seed_g})"
    )
    return "\n".join(lines)
