"""The step-phase scorer live: `poolkeeper serve` (Envoy + EPP) over simulated servers that
publish vLLM-format KV events, against the default and round-robin (bench only; issue #38,
docs/notes/2026-12-08-step-clock-live.md).

Variants, interleaved (the order rotates each round), the same requests each time:

- `A`: the default profile with the prefix scorer's `kvEvents` on (exact index);
- `B`: A + `step-phase-scorer` at weight 4 (`default-stepclock-w4`), fed live by the prefix
  scorer's KV subscriber (`scheduling/steplive.py`); its clocks' state is written at the
  EPP's stop (`server/wiring.py` `STEPCLOCK_LOG_ENV`) and kept per run;
- `C`: B with `requireFit: false` (the learnt clock scores from the first batch on, trusted
  or not: what the live clock's phase is worth where the counts do not agree);
- `D`: B with `staleS` 1 us (no clock is ever fresh: every score neutral, all of B's work
  done): the control for what B's work costs the EPP on a loaded machine;
- `P`: the default profile as shipped (approximate index, no KV subscription; the sims still
  publish): what A's exact events cost or buy;
- `R`: the EPP path with the `random` preset (one random endpoint, nothing scored): what the
  path costs apart from placement;
- `N`: R with flow control off (`flowControl.enabled: false`): what flow control adds to the path;
- `rr`: Envoy with a static ROUND_ROBIN cluster (`bench live`'s `envoy-rr`).

Each run starts a fresh fleet (`bench/live/live.py` `run_target`, with the sims' KV-event
port offset) and replays the workload open loop at `--loads` x the fleet's capacity for
`--duration` s; `uptime` before each run. Writes OUT/runs.json (every run) and prints, per
load, each round's p90 TTFT and the ratios B/A and B/rr, and in how many rounds B is lower.
127.0.0.1 only; bounded by `--rounds`, `--duration` and the loads. Example:

    .venv/bin/python scripts/live_stepclock.py --out bench-results/steplive --servers 2 \\
        --loads 0.5,0.8 --duration 30 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from poolkeeper.bench.live.live import LiveSpec, live_arrivals, live_scenario, run_target
from poolkeeper.bench.live.live_processes import repo_root
from poolkeeper.bench.live.live_targets import POOLKEEPER
from poolkeeper.scheduling.candidate_presets import candidate_document
from poolkeeper.scheduling.presets import preset_document
from poolkeeper.server.wiring import STEPCLOCK_LOG_ENV

KV_OFFSET = 1000  # each sim publishes on its HTTP port + this (scripts/live_replicas.py's)
VARIANTS = ("A", "B", "C", "D", "P", "R", "N", "rr")


def scheduling(variant: str) -> dict[str, Any]:
    if variant in ("P", "R", "N"):
        return preset_document("default" if variant == "P" else "random")
    doc = (
        preset_document("default") if variant == "A" else candidate_document("default-stepclock-w4")
    )
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin.setdefault("parameters", {}).update(
                {"kvEvents": True, "kvEventsPortOffset": KV_OFFSET}
            )
    return doc


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def one(variant: str, spec: LiveSpec, arrivals: list[Any], work: Path) -> dict[str, Any]:
    dump = work / "stepclock.json"
    if variant == "rr":
        target, run_spec = "envoy-rr", spec
    else:
        target = POOLKEEPER
        env = ((STEPCLOCK_LOG_ENV, str(dump)),) if variant not in ("A", "P", "R", "N") else ()
        flow = {"enabled": False} if variant == "N" else spec.flow_control
        run_spec = replace(spec, scheduling=scheduling(variant), router_env=env, flow_control=flow)
    before = uptime()
    run = run_target(target, run_spec, arrivals, root=repo_root(), work=work, progress=print)
    run.pop("requests", None)
    run.update({"variant": variant, "uptime_before": before, "uptime_after": uptime()})
    if dump.exists():
        run["stepclock"] = json.loads(dump.read_text())
    return run


def report(runs: list[dict[str, Any]]) -> None:
    """Per load and round: each variant's p90 TTFT, B/A, B/rr and the others over A."""
    for load in sorted({r["load"] for r in runs}):
        at = [r for r in runs if r["load"] == load]
        present = [v for v in VARIANTS if any(r["variant"] == v for r in at)]
        ratios = [(v, "A") for v in present if v not in ("A", "rr")] + [("B", "rr"), ("A", "rr")]
        ratios = [(x, y) for x, y in ratios if x in present and y in present]
        print(f"\nload {load}: p90 TTFT ms per round ({' / '.join(present)}), load avg at start")
        lower = dict.fromkeys(ratios, 0)
        n = 0
        for rnd in sorted({r["round"] for r in at}):
            p90 = {
                r["variant"]: 1000 * r["summary"]["ttft_s"]["p90"] for r in at if r["round"] == rnd
            }
            if set(p90) != set(present):
                continue
            n += 1
            parts = []
            for x, y in ratios:
                ratio = p90[x] / p90[y]
                lower[(x, y)] += ratio < 1.0
                parts.append(f"{x}/{y} {ratio:.3f}")
            up = [r["uptime_before"].split("load average:")[-1].strip().split(",")[0]
                  for r in at if r["round"] == rnd]  # fmt: skip
            values = " / ".join(f"{p90[v]:.1f}" for v in present)
            print(f"  r{rnd}: {values}  {'  '.join(parts)}  (load {', '.join(up)})")
        print("  lower in: " + ", ".join(f"{x}/{y} {k}/{n}" for (x, y), k in lower.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workload", default="heavy-tail")
    parser.add_argument("--loads", default="0.5,0.8")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="A,B,C,rr", help="a subset of A,B,C,D,P,R,N,rr")
    parser.add_argument("--analyze", type=Path, help="print the report of an earlier runs.json")
    args = parser.parse_args()
    if args.analyze is not None:
        report(json.loads(args.analyze.read_text()))
        return 0
    loads = [float(x) for x in args.loads.split(",")]
    variants = tuple(args.variants.split(","))
    if not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: a subset of {','.join(VARIANTS)}")
    if not (1 <= args.servers <= 8 and 0 < args.duration <= 120 and 1 <= args.rounds <= 10):
        raise SystemExit("--servers 1..8, --duration in (0, 120], --rounds 1..10")
    if not all(0 < x <= 1.5 for x in loads):
        raise SystemExit("--loads in (0, 1.5]")
    base = LiveSpec(workload=args.workload, servers=args.servers, duration=args.duration,
                    peers=(), sim_args=("--kv-events-port-offset", str(KV_OFFSET)))  # fmt: skip
    scenario = live_scenario(base)
    _, _, capacity = live_arrivals(base, scenario)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="steplive-") as tmp:
        for rnd in range(args.rounds):
            for load in loads:
                spec = replace(base, rate=load * capacity)
                arrivals, rate, _ = live_arrivals(spec, scenario)
                k = rnd % len(variants)
                order = variants[k:] + variants[:k]
                print(f"round {rnd} load {load}: {rate:.1f} req/s, {len(arrivals)} requests")
                for variant in order:
                    work = Path(tmp) / f"r{rnd}-l{load}-{variant}"
                    run = one(variant, spec, arrivals, work)
                    run.update({"round": rnd, "load": load, "rate_rps": rate})
                    runs.append(run)
                    (args.out / "runs.json").write_text(json.dumps(runs, indent=1))
    report(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
