"""Interleave several live targets (peers and poolkeeper variants) on the same requests.

`poolkeeper bench live` pairs poolkeeper with one peer at a time; this runs N targets per round
(listed order in even rounds, reversed in odd ones) through `bench.live.live.run_target`, each
on a fresh fleet and router, and writes every run (with its requests, prefills and the load
average before and after) to OUT/runs.json. A target is a peer name (`sglang-router`,
`vllm-router-rr`, ...) or `LABEL=JSON`, poolkeeper with that `spec.scheduling` (`LABEL=` for
the default), or with `{"scheduling": ..., "flowControl": ...}` (either key may be left out)
for a `spec.flowControl` too (`holdNewPrefixes`). Example
(docs/notes/2026-12-06-live-routing-fourth-round.md):

    .venv/bin/python scripts/live_interleave.py --out bench-results/q4/prefix --rounds 3 \\
        --spec '{"groups": 16, "time_scale": 10, "duration": 30, "stream_interval": 8}' \\
        default= 'grace={"preset": "prefix-affinity"}' sglang-router
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from poolkeeper.bench.live.live import LiveSpec, live_arrivals, live_scenario, run_target
from poolkeeper.bench.live.live_processes import repo_root


def _poolkeeper_spec(spec: LiveSpec, doc: dict[str, Any] | None) -> LiveSpec:
    """`spec` with a target's settings: a `spec.scheduling` document, or one naming
    `scheduling` and / or `flowControl`."""
    if doc is not None and doc and set(doc) <= {"scheduling", "flowControl"}:
        return replace(spec, scheduling=doc.get("scheduling"), flow_control=doc.get("flowControl"))
    return replace(spec, scheduling=doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", default="{}", help="LiveSpec fields as JSON")
    ap.add_argument("targets", nargs="+")
    args = ap.parse_args()
    # A plain `kill` must still stop the fleet and routers (their `finally` blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = LiveSpec(**{"peers": (), **json.loads(args.spec)})
    scenario = live_scenario(spec)
    arrivals, rate, _capacity = live_arrivals(spec, scenario)
    print(f"{len(arrivals)} requests at {rate:.2f} req/s", flush=True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="live-interleave-") as tmp:
        for rnd in range(args.rounds):
            order = args.targets if rnd % 2 == 0 else args.targets[::-1]
            for target in order:
                label, sep, doc = target.partition("=")
                name, run_spec = label, spec
                if sep:
                    name = "poolkeeper"
                    run_spec = _poolkeeper_spec(spec, json.loads(doc) if doc else None)
                before = list(os.getloadavg())
                run = run_target(name, run_spec, arrivals, root=repo_root(),
                                 work=Path(tmp) / f"r{rnd}-{label}", progress=print)  # fmt: skip
                run.update({"round": rnd, "label": label, "load_before": before})
                print(f"    {label}: prefills {run['prefills']}, load {before[0]:.1f} -> "
                      f"{run['load_average'][0]:.1f}", flush=True)  # fmt: skip
                runs.append(run)
                doc_out = {
                    "command": shlex.join(["python", *sys.argv]),
                    "spec": repr(spec),
                    # what makes the regime reproducible: prompt and answer lengths, groups
                    "workload": scenario.spec.describe(),
                    "rate": rate,
                    "requests": len(arrivals),
                    "targets": args.targets,
                    "runs": runs,
                }
                (out / "runs.json").write_text(json.dumps(doc_out))
    for target in args.targets:
        label = target.partition("=")[0]
        mine = [r for r in runs if r["label"] == label]
        p90 = [r["summary"]["ttft_s"]["p90"] for r in mine]
        p99 = [r["summary"]["ttft_s"]["p99"] for r in mine]
        prefills = [r["prefills"] for r in mine]
        print(
            f"{label:>16}: median p90 {statistics.median(p90):.2f} s "
            f"({min(p90):.2f}-{max(p90):.2f}), p99 {statistics.median(p99):.2f} s "
            f"({min(p99):.2f}-{max(p99):.2f}), prefills {prefills}"
        )


if __name__ == "__main__":
    main()
