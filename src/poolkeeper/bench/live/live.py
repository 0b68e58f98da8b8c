"""`bench live`: the same workload over loopback through poolkeeper and peer routers.

Every measured run starts from scratch: a fresh simulated fleet (`poolkeeper sim`, N servers
on consecutive free ports, caches empty), then the router under test, then the workload
replayed open-loop by `bench.live.loadgen`, then both are stopped. Targets:

- `poolkeeper`: `poolkeeper serve` (Envoy + EPP) with a generated config: one InferencePool
  selecting the simulators, one InferenceModel per workload model, the default scheduling
  profile, 50 ms scraping;
- `vllm-router` / `sglang-router`: the peers installed by `scripts/install-peers.sh`, in
  `cache_aware` mode with their CLI defaults (cache threshold 0.3, balance thresholds 64 / 1.5),
  command lines from reference/peers.md section 6; `vllm-router-rr`: vllm-router in
  `round_robin` mode (the best peer where prefixes do not matter);
- `envoy-rr`: the same Envoy binary with a static ROUND_ROBIN cluster (a Kubernetes Service
  stand-in).

Pairs are interleaved: in round r poolkeeper runs first when r is even and second when r is
odd, so slow drift of the shared machine (other processes, thermal) hits both sides equally;
the report gives, per peer, the ratio of poolkeeper's p90 TTFT to the peer's in each pair,
and the ratio of the medians of the p90s. A run ends when every request has its first token
(later tokens cannot change a TTFT; long answers would otherwise stretch each run by minutes),
so live runs report TTFT only unless `full_streams` is set.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from poolkeeper.bench.fleet.simrun import fleet_capacity
from poolkeeper.bench.live.live_processes import READY_TIMEOUT_S, process, repo_root, wait_http
from poolkeeper.bench.live.live_targets import (
    KNOWN_PEERS,
    POOLKEEPER,
    envoy_binary,
    models_of,
    peer_binary,
    router_command,
)
from poolkeeper.bench.live.loadgen import run_open_loop
from poolkeeper.bench.results.metrics import SLO, RequestOutcome, percentile, summarize, ttft_values
from poolkeeper.bench.results.report import command_line, machine_info, quantiles, write_json
from poolkeeper.bench.workload.scenarios import LORA_SLOTS, Scenario, adapter_names, build_scenario
from poolkeeper.bench.workload.workload_spec import Arrival, WorkloadKind, default_spec
from poolkeeper.bench.workload.workloads import generate
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports


@dataclass(frozen=True, slots=True)
class LiveSpec:
    workload: str = "shared-prefix"
    servers: int = 4
    rate: float | None = None
    duration: float = 20.0
    rounds: int = 2
    peers: tuple[str, ...] = KNOWN_PEERS
    time_scale: float = 1.0
    seed: int = 1
    full_streams: bool = False  # False: end each run once every request has its first token
    groups: int | None = None  # shared-prefix / heterogeneous: override the number of groups
    # Requests arriving in the first `warmup` seconds are sent but left out of the statistics
    # (the cold start: every shared prefix prefilled once, whatever the router).
    warmup: float = 0.0
    scheduling: dict[str, Any] | None = None  # poolkeeper's spec.scheduling (None: default)
    flow_control: dict[str, Any] | None = None  # poolkeeper's spec.flowControl (None: default)
    max_num_seqs: int | None = None  # the simulators' batch slots (None: the simulator's 256)
    # Tokens per streamed event after the first (the simulators' --stream-interval): fewer
    # events for the shared cores to carry; the first token is sent as before.
    stream_interval: int = 1
    sim_args: tuple[str, ...] = ()  # more `poolkeeper sim` flags (KV events' port offset)
    router_env: tuple[tuple[str, str], ...] = ()  # more environment for the router


def prefill_count(outcomes: Iterable[RequestOutcome]) -> int:
    """Distinct (group, server) pairs among the routed requests of a shared-prefix run: how many
    times a group's system prompt was prefilled (at least the number of groups; each pair more
    is a server prefilling a prefix another server already held). 0 without groups."""
    return len({(o.group, o.server) for o in outcomes if o.group and o.server})


def run_target(
    target: str,
    spec: LiveSpec,
    arrivals: Sequence[Any],
    *,
    root: Path,
    work: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    scenario_spec = default_spec(spec.workload, spec.servers)
    kind = scenario_spec.kind
    sim_ports = free_ports(spec.servers, consecutive=True)
    sim_cmd = [sys.executable, "-m", "poolkeeper", "sim", "--count", str(spec.servers),
               "--port", str(sim_ports[0]), "--model", "base-model",
               "--time-scale", str(spec.time_scale), "--seed", str(spec.seed)]  # fmt: skip
    if kind is WorkloadKind.MULTI_LORA:
        sim_cmd += ["--lora-adapters", ",".join(adapter_names(scenario_spec)),
                    "--max-loras", str(LORA_SLOTS)]  # fmt: skip
    if spec.max_num_seqs is not None:
        sim_cmd += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.stream_interval != 1:
        sim_cmd += ["--stream-interval", str(spec.stream_interval)]
    sim_cmd += spec.sim_args
    models = models_of(kind, adapter_names(scenario_spec))
    work.mkdir(parents=True, exist_ok=True)
    with process(sim_cmd, work / "sim.log"):
        for p in sim_ports:
            wait_http(f"http://127.0.0.1:{p}/health", lambda s: s == 200, READY_TIMEOUT_S, "sim")
        cmd, port, ready = router_command(
            target, root, work, sim_ports, models, spec.scheduling, spec.flow_control
        )
        env = {"HF_HUB_OFFLINE": "1", **dict(spec.router_env)}
        with process(cmd, work / f"{target}.log", env=env):
            wait_http(ready, lambda s: s < 500, READY_TIMEOUT_S, target)
            time.sleep(1.0)  # let scrapers / health checks see every worker once
            started = time.perf_counter()
            results = asyncio.run(
                run_open_loop(
                    f"http://127.0.0.1:{port}",
                    arrivals,
                    time_limit=spec.duration + 5,
                    stop_after_first_tokens=not spec.full_streams,
                    request_timeout=120.0,
                )
            )
            wall = time.perf_counter() - started
    everything: list[RequestOutcome] = [r.outcome for r in results]
    outcomes = [o for o in everything if o.arrival >= spec.warmup]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200 or r.error:
            key = r.error or f"HTTP {r.status}"
            errors[key] = errors.get(key, 0) + 1
    servers: dict[str, int] = {}
    for o in outcomes:
        servers[o.server or "?"] = servers.get(o.server or "?", 0) + 1
    summary = summarize(outcomes, duration=spec.duration - spec.warmup, slo=SLO())
    progress(
        f"  {target:>14}: {summary['completed']}/{summary['requests']} ok, TTFT p90 "
        f"{summary['ttft_s']['p90']:.3f} s, errors {errors or 0} ({wall:.0f} s)"
    )
    return {
        "target": target,
        "summary": summary,
        "ttft_quantiles": quantiles(ttft_values(outcomes)),
        "errors": errors,
        "requests_per_server": servers,
        "wall_s": wall,
        "load_average": list(os.getloadavg()),
        "prefills": prefill_count(everything),
        # Every request, warm-up included: [arrival s, group, server, TTFT s or None].
        "requests": [
            [round(o.arrival, 4), o.group, o.server, None if o.ttft is None else round(o.ttft, 4)]
            for o in sorted(everything, key=lambda o: o.arrival)
        ],
    }


def live_scenario(spec: LiveSpec) -> Scenario:
    """The virtual-time scenario a live run replays (`spec.groups`: fewer prefix groups)."""
    scenario = build_scenario(spec.workload, spec.servers)
    if spec.groups is not None:
        # Fewer groups keep the cold start (first prefill of every system prompt) short next
        # to a live run of tens of seconds at a slowed-down time scale.
        scenario = replace(scenario, spec=replace(scenario.spec, num_groups=spec.groups))
    return scenario


def live_arrivals(spec: LiveSpec, scenario: Scenario) -> tuple[list[Arrival], float, float]:
    """The requests of a live run (its workload at `spec.rate`, or 0.9x the fleet's capacity
    at the live time scale), the rate, and that capacity in requests/s: `run_live` and the
    scripts that drive other targets on the same requests (live_interleave, live_replicas)."""
    capacity = fleet_capacity(scenario, seed=spec.seed)
    live_capacity = float(capacity["capacity_rps"]) / spec.time_scale
    rate = spec.rate if spec.rate is not None else 0.9 * live_capacity
    arrivals = generate(scenario.spec, rate=rate, duration=spec.duration, seed=spec.seed)
    return arrivals, rate, live_capacity


def run_live(
    spec: LiveSpec, *, out_dir: Path, progress: Callable[[str], None] = lambda _m: None
) -> dict[str, Any]:
    root = repo_root()
    for peer in spec.peers:
        if peer not in KNOWN_PEERS:
            raise ConfigError(f"unknown peer {peer!r}; known: {', '.join(KNOWN_PEERS)}")
    available = [p for p in spec.peers if peer_binary(p, root) is not None]
    missing = [p for p in spec.peers if p not in available]
    if missing:
        progress(f"not installed, skipped: {', '.join(missing)} (scripts/install-peers.sh)")
    if envoy_binary() is None:
        raise ConfigError("Envoy is not installed next to this Python (.venv/bin/envoy)")
    scenario = live_scenario(spec)
    arrivals, rate, live_capacity = live_arrivals(spec, scenario)
    progress(
        f"live {spec.workload}: {spec.servers} servers (time scale {spec.time_scale:g}), "
        f"{rate:.1f} req/s x {spec.duration:g} s = {len(arrivals)} requests "
        f"(virtual-time capacity {live_capacity:.1f} req/s)"
    )
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="poolkeeper-live-") as tmp:
        for rnd in range(spec.rounds):
            for peer in available:
                order = [POOLKEEPER, peer] if rnd % 2 == 0 else [peer, POOLKEEPER]
                pair: dict[str, dict[str, Any]] = {}
                for target in order:
                    work = Path(tmp) / f"r{rnd}-{peer}-{target}"
                    run = run_target(target, spec, arrivals, root=root, work=work,
                                     progress=progress)  # fmt: skip
                    run.update({"round": rnd, "pair_peer": peer})
                    runs.append(run)
                    pair[target] = run
    result: dict[str, Any] = {
        "kind": "bench-live",
        "command": command_line(),
        "machine": machine_info(),
        "workload": scenario.spec.describe(),
        "servers": spec.servers,
        "time_scale": spec.time_scale,
        "rate_rps": rate,
        "duration_s": spec.duration,
        "rounds": spec.rounds,
        "warmup_s": spec.warmup,
        "max_num_seqs": spec.max_num_seqs,
        "stream_interval": spec.stream_interval,
        "scheduling": spec.scheduling,
        "flow_control": spec.flow_control,
        "skipped_peers": missing,
        "runs": runs,
        "ratios": ratios(runs, available),
    }
    write_json(out_dir / f"live-{spec.workload}.json", result)
    for peer, r in result["ratios"].items():
        progress(
            f"TTFT poolkeeper / {peer}: p90 pairs {r['pair_ratios']}, medians "
            f"{r['pooled_ratio']:.2f}; p99 pairs {r['pair_ratios_p99']}, medians "
            f"{r['pooled_ratio_p99']:.2f}"
        )
    return result


def ratios(runs: Sequence[dict[str, Any]], peers: Sequence[str]) -> dict[str, Any]:
    """Per peer: poolkeeper's p90 (and p99) TTFT over the peer's in each round's pair, and the
    ratio of the medians over rounds."""
    out: dict[str, Any] = {}
    for peer in peers:
        mine = [r for r in runs if r["pair_peer"] == peer]
        entry: dict[str, Any] = {}
        for q in ("p90", "p99"):
            suffix = "" if q == "p90" else "_p99"
            pair_ratios: list[float] = []
            for rnd in sorted({r["round"] for r in mine}):
                ours = [r for r in mine if r["round"] == rnd and r["target"] == POOLKEEPER]
                theirs = [r for r in mine if r["round"] == rnd and r["target"] == peer]
                if ours and theirs:
                    a = ours[0]["summary"]["ttft_s"][q]
                    b = theirs[0]["summary"]["ttft_s"][q]
                    pair_ratios.append(round(a / b, 3) if b else float("nan"))
            a = percentile(
                [r["summary"]["ttft_s"][q] for r in mine if r["target"] == POOLKEEPER], 50
            )
            b = percentile([r["summary"]["ttft_s"][q] for r in mine if r["target"] == peer], 50)
            entry.update({
                f"pair_ratios{suffix}": pair_ratios,
                f"median_{q}_poolkeeper_s": a,
                f"median_{q}_peer_s": b,
                f"pooled_ratio{suffix}": a / b if b else float("nan"),
            })  # fmt: skip
        out[peer] = entry
    return out
