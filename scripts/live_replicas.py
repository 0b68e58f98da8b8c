"""Live EPP replicas: N `poolkeeper serve --no-envoy` behind one Envoy, approximate vs exact.

The shipped Kubernetes shape (docs/kubernetes.md): one gateway (Envoy) whose ext_proc cluster
holds every EPP replica; Envoy opens one ext_proc stream per request and balances the streams
round-robin over the replicas, so each replica routes about 1/N of the requests and its
approximate prefix index knows only those. Here: a simulated fleet publishing vLLM-format
KV-cache events (`poolkeeper sim --kv-events-port-offset`), N EPPs with the same config (own
ports), and one Envoy from `poolkeeper envoy-config` with the other replicas' ext_proc ports
added to its `epp` cluster. Index `approx`: the default profile; `exact`: the default with the
prefix scorer's `kvEvents` on (each replica subscribes to every server's events);
`exact-cold` / `exact-peers`: + cold affinity, always / once another replica is seen;
`exact-bal`: + bounded-load cold affinity (`scheduling()`). `N/M:index` runs M EPPs with only
N behind Envoy: the idle ones scrape and take CPU as extra replicas do, a control on a machine
with few cores. Variants run
interleaved (listed order in even rounds, reversed in odd), the same requests each time; every
run goes to OUT/runs.json with its requests, prefills, load average and the CPU seconds of the
fleet and of each EPP during the load. Example
(docs/notes/2026-12-06-exact-prefix-replicas-second-round.md):

    .venv/bin/python scripts/live_replicas.py --out bench-results/replicas --rounds 2 \\
        1:approx 1/4:approx 2:exact-peers 4:exact-peers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from poolkeeper.bench.live.live import (
    READY_TIMEOUT_S,
    LiveSpec,
    _models,
    envoy_binary,
    live_arrivals,
    live_scenario,
    poolkeeper_config,
    prefill_count,
    process,
    wait_http,
)
from poolkeeper.bench.live.loadgen import run_open_loop
from poolkeeper.bench.results.metrics import SLO, summarize
from poolkeeper.bench.workload.scenarios import adapter_names
from poolkeeper.bench.workload.workloads import default_spec
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.presets import preset_document

KV_OFFSET = 1000
NAMES = ("http", "extproc", "metrics", "health", "admin")


INDEXES = ("approx", "exact", "exact-cold", "exact-peers", "exact-bal")


def scheduling(index: str) -> dict[str, Any] | None:
    """`approx`: the default; `exact`: + KV events; `exact-cold`: + cold affinity 0.2 (a new
    long prefix scored toward its owner on a hash ring of the endpoints, the same for every
    replica; docs/scheduling.md); `exact-peers`: cold affinity only once the events show
    another replica's traffic (`coldAffinityPeersOnly`); `exact-bal`: `exact-cold` with
    `coldAffinityBalance: 1` (the first endpoint on the ring holding fewer than its share of
    the prefixes)."""
    if index == "approx":
        return None
    if index not in INDEXES:
        raise SystemExit(f"unknown index {index!r} ({', '.join(INDEXES)})")
    doc = preset_document("default")
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin["parameters"].update({"kvEvents": True, "kvEventsPortOffset": KV_OFFSET})
            if index in ("exact-cold", "exact-peers", "exact-bal"):
                plugin["parameters"]["coldAffinity"] = 0.2
            if index == "exact-bal":
                plugin["parameters"]["coldAffinityBalance"] = 1.0
            if index == "exact-peers":
                plugin["parameters"]["coldAffinityPeersOnly"] = True
    return doc


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bootstrap(cfg: Path, extra_extproc: list[int], out: Path) -> None:
    text = subprocess.run(
        [sys.executable, "-m", "poolkeeper", "envoy-config", "-f", str(cfg)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    doc = json.loads(text)
    (epp,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "epp"]
    lb = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for port in extra_extproc:
        lb.append(
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": port}}}}
        )  # fmt: skip
    out.write_text(json.dumps(doc))


def parse_variant(variant: str) -> tuple[int, int, str]:
    """`N:index` (N replicas behind Envoy) or `N/M:index` (M EPPs running, only the first N
    behind Envoy: the others idle, scraping, as a control for the CPU extra replicas take)."""
    counts, _, index = variant.partition(":")
    active, _, running = counts.partition("/")
    running = running or active
    if not (active.isdigit() and running.isdigit()) or not 1 <= int(active) <= int(running):
        raise SystemExit(f"bad variant {variant!r}: N[/M]:{'|'.join(INDEXES)}, 1 <= N <= M")
    if index not in INDEXES:
        raise SystemExit(f"bad variant {variant!r}: index one of {', '.join(INDEXES)}")
    return int(active), int(running), index


def run_variant(spec: LiveSpec, arrivals: list[Any], variant: str, work: Path) -> dict[str, Any]:
    replicas, running, index = parse_variant(variant)
    kind = default_spec(spec.workload, spec.servers).kind
    models = _models(kind, adapter_names(default_spec(spec.workload, spec.servers)))
    sim_ports = free_ports(spec.servers, consecutive=True)
    sim_cmd = [sys.executable, "-m", "poolkeeper", "sim", "--count", str(spec.servers),
               "--port", str(sim_ports[0]), "--model", "base-model",
               "--time-scale", str(spec.time_scale), "--seed", str(spec.seed),
               "--kv-events-port-offset", str(KV_OFFSET),
               "--stream-interval", str(spec.stream_interval)]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        sim = stack.enter_context(process(sim_cmd, work / "sim.log"))
        for p in sim_ports:
            wait_http(f"http://127.0.0.1:{p}/health", lambda s: s == 200, READY_TIMEOUT_S, "sim")
        ports = [dict(zip(NAMES, free_ports(len(NAMES)), strict=True)) for _ in range(running)]
        cfgs = []
        epps = []
        for i, pp in enumerate(ports):
            cfg = poolkeeper_config(work / f"epp{i}", sim_ports, pp, models, scheduling(index))
            cfgs.append(cfg)
            cmd = [sys.executable, "-m", "poolkeeper", "serve", "--no-envoy", "-f", str(cfg),
                   "--workdir", str(work / f"serve{i}"), "--log-level", "warning"]  # fmt: skip
            epps.append(stack.enter_context(process(cmd, work / f"epp{i}.log")))
        for pp in ports:
            wait_http(f"http://127.0.0.1:{pp['metrics']}/readyz", lambda s: s == 200,
                      READY_TIMEOUT_S, "epp")  # fmt: skip
        boot = work / "envoy.json"
        bootstrap(cfgs[0], [pp["extproc"] for pp in ports[1:replicas]], boot)
        envoy = envoy_binary()
        assert envoy is not None
        cmd = [envoy, "-c", str(boot), "--concurrency", "1", "--log-level", "warn",
               "--disable-hot-restart"]  # fmt: skip
        stack.enter_context(process(cmd, work / "envoy.log"))
        http = ports[0]["http"]
        wait_http(f"http://127.0.0.1:{http}/v1/models", lambda s: s < 500, READY_TIMEOUT_S, "envoy")
        time.sleep(1.0)
        before = list(os.getloadavg())
        cpu0 = [cpu_seconds(p.pid) for p in (sim, *epps)]
        results = asyncio.run(
            run_open_loop(f"http://127.0.0.1:{http}", arrivals, time_limit=spec.duration + 5,
                          stop_after_first_tokens=True, request_timeout=120.0)
        )  # fmt: skip
        cpu = [round(cpu_seconds(p.pid) - c, 2) for p, c in zip((sim, *epps), cpu0, strict=True)]
    outcomes = [r.outcome for r in results]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200 or r.error:
            key = r.error or f"HTTP {r.status}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "replicas": replicas,
        "epps_running": running,
        "index": index,
        "summary": summarize(outcomes, duration=spec.duration, slo=SLO()),
        "errors": errors,
        "prefills": prefill_count(outcomes),
        "load_before": before,
        "load_average": list(os.getloadavg()),
        # CPU seconds during the load: the simulated fleet, then each EPP replica.
        "cpu_s": {"sim": cpu[0], "epps": cpu[1:]},
        "requests": [
            [round(o.arrival, 4), o.group, o.server, None if o.ttft is None else round(o.ttft, 4)]
            for o in sorted(outcomes, key=lambda o: o.arrival)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default='{"groups": 16, "time_scale": 10, "duration": 30, '
                    '"stream_interval": 8}', help="LiveSpec fields as JSON")  # fmt: skip
    ap.add_argument(
        "variants", nargs="+", help=f"N[/M]:{'|'.join(INDEXES)}, e.g. 2:exact, 1/4:approx"
    )
    args = ap.parse_args()
    # A plain `kill` must still stop the fleet and routers (their `finally` blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for variant in args.variants:
        parse_variant(variant)
    spec = LiveSpec(**{"peers": (), **json.loads(args.spec)})
    arrivals, rate, _capacity = live_arrivals(spec, live_scenario(spec))
    print(f"{len(arrivals)} requests at {rate:.2f} req/s", flush=True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="live-replicas-") as tmp:
        for rnd in range(args.rounds):
            for variant in args.variants if rnd % 2 == 0 else args.variants[::-1]:
                name = variant.replace("/", "of").replace(":", "-")
                run = run_variant(spec, arrivals, variant, Path(tmp) / f"r{rnd}-{name}")
                run.update({"round": rnd, "label": variant})
                t = run["summary"]["ttft_s"]
                load = f"{run['load_before'][0]:.1f} -> {run['load_average'][0]:.1f}"
                print(f"  {variant}: p90 {t['p90']:.3f} s, p99 {t['p99']:.3f} s, prefills "
                      f"{run['prefills']}, errors {run['errors'] or 0}, load {load}, "
                      f"cpu {run['cpu_s']}", flush=True)  # fmt: skip
                runs.append(run)
                (out / "runs.json").write_text(json.dumps({"rate": rate, "runs": runs}))
    for variant in args.variants:
        mine = [r for r in runs if r["label"] == variant]
        p90 = [r["summary"]["ttft_s"]["p90"] for r in mine]
        p99 = [r["summary"]["ttft_s"]["p99"] for r in mine]
        prefills = [r["prefills"] for r in mine]
        print(f"{variant:>10}: median p90 {statistics.median(p90):.2f} s, p99 "
              f"{statistics.median(p99):.2f} s, prefills {prefills}")  # fmt: skip


if __name__ == "__main__":
    main()
