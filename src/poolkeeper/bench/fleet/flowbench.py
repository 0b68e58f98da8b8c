"""`bench flow`: the flow-control acceptance measurements, on the virtual-time fleet.

Four experiments, each `poolkeeper` (flow control, default `spec.flowControl`) beside
`poolkeeper-shed` (the same scheduler with admission's shedding, no queue: poolkeeper before
flow control), same seed, same arrivals:

- fairness: the `fairness` workload (two Standard models, one offering 10x the other's request
  rate) at 2x capacity, and at 10x, where even the light model offers more than half of what
  the fleet really serves (both backlogged; "capacity" is the conservative estimate of
  `bench.fleet.simrun`). Served tokens per model per second (prompt + output tokens of requests
  finishing in the last two thirds of the arrival window) and each model's completed share of
  its requests (at 2x the light model is under its fair share: it should get all of it).
- flood: the `criticality-flood` workload (10% Critical, 90% Sheddable) at 3x capacity, and the
  same Critical requests alone (the idle pool). Critical p99 TTFT of both and their ratio,
  Critical shed, Sheddable outcomes (completed / 429 / expired) and the longest Sheddable wait.
- mixed: the `mixed-criticality` workload at 0.9x, 1.1x and 1.3x: goodput of both policies.
- burst: `mixed-criticality` at 10x for `burst` seconds: the most requests ever waiting in the
  queue (bounded by the bands' maxRequests), none left waiting at the end, none unfinished.

Writes `<out>/flow.json`; `format_flow` renders the tables of docs/benchmarks.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.fleet.simrun import fleet_capacity, replay
from poolkeeper.bench.policies.flowpolicy import FlowPolicy
from poolkeeper.bench.policies.routers import make_policy
from poolkeeper.bench.results.metrics import SLO, percentile
from poolkeeper.bench.results.report import command_line, machine_info, write_json
from poolkeeper.bench.workload.scenarios import build_scenario
from poolkeeper.bench.workload.workload_spec import FAIRNESS_MODELS, Arrival
from poolkeeper.bench.workload.workloads import generate
from poolkeeper.sim.virtual_results import FleetResult

POLICIES: tuple[str, str] = ("poolkeeper", "poolkeeper-shed")


def _replay(
    kind: str, servers: int, policy_name: str, arrivals: Sequence[Arrival], seed: int
) -> tuple[FleetResult, Any]:
    scenario = build_scenario(kind, servers)
    policy = make_policy(policy_name, random.Random(f"{seed}:policy"), scenario)
    return replay(scenario.servers, arrivals, policy, seed=seed), policy


def _token_rates(
    result: FleetResult, by_id: dict[str, Arrival], lo: float, hi: float
) -> dict[str, float]:
    served: dict[str, float] = dict.fromkeys(FAIRNESS_MODELS, 0.0)
    for r in result.requests:
        if r.status == "ok" and r.finish is not None and lo <= r.finish < hi:
            served[by_id[r.request_id].model] += r.prompt_tokens + r.completion_tokens
    return {m: v / (hi - lo) for m, v in served.items()}


def fairness(
    servers: int, capacity: float, load: float, duration: float, seed: int
) -> dict[str, Any]:
    arrivals = generate(build_scenario("fairness", servers).spec, rate=load * capacity,
                        duration=duration, seed=seed)  # fmt: skip
    by_id = {a.request_id: a for a in arrivals}
    lo, hi = duration / 3, duration
    offered = dict.fromkeys(FAIRNESS_MODELS, 0.0)
    for a in arrivals:
        if lo <= a.time < hi:
            offered[a.model] += a.prompt_tokens() + a.output_tokens
    offered = {m: v / (hi - lo) for m, v in offered.items()}
    out: dict[str, Any] = {"load": load, "offered_tok_s": offered}
    heavy, light = FAIRNESS_MODELS
    for name in POLICIES:
        result, _policy = _replay("fairness", servers, name, arrivals, seed)
        rates = _token_rates(result, by_id, lo, hi)
        out[name] = {
            "served_tok_s": rates,
            "ratio_heavy_to_light": rates[heavy] / max(rates[light], 1e-9),
            "completed_share": {
                m: sum(
                    1
                    for r in result.requests
                    if by_id[r.request_id].model == m and r.status == "ok"
                )
                / max(1, sum(1 for a in arrivals if a.model == m))
                for m in FAIRNESS_MODELS
            },
            "shed": sum(r.status == "rejected" for r in result.requests),
        }
    return out


def _crit(result: FleetResult, by_id: dict[str, Arrival], crit: Criticality) -> list[Any]:
    return [r for r in result.requests if by_id[r.request_id].criticality is crit]


def flood(servers: int, capacity: float, load: float, duration: float, seed: int) -> dict[str, Any]:
    arrivals = generate(build_scenario("criticality-flood", servers).spec, rate=load * capacity,
                        duration=duration, seed=seed)  # fmt: skip
    by_id = {a.request_id: a for a in arrivals}
    critical_only = [a for a in arrivals if a.criticality is Criticality.CRITICAL]
    idle, _ = _replay("criticality-flood", servers, "poolkeeper", critical_only, seed)
    idle_ttft = [t for r in idle.requests if (t := r.ttft) is not None]
    out: dict[str, Any] = {
        "load": load,
        "critical_requests": len(critical_only),
        "idle_critical_ttft_p99_s": percentile(idle_ttft, 99),
    }
    for name in POLICIES:
        result, policy = _replay("criticality-flood", servers, name, arrivals, seed)
        crit = _crit(result, by_id, Criticality.CRITICAL)
        shed = _crit(result, by_id, Criticality.SHEDDABLE)
        ttft = [t for r in crit if (t := r.ttft) is not None]
        waits = getattr(policy, "waited", {})
        s_ok = [r for r in shed if r.status == "ok"]
        out[name] = {
            "critical_ttft_p99_s": percentile(ttft, 99),
            "ratio_to_idle": percentile(ttft, 99) / percentile(idle_ttft, 99),
            "critical_shed": sum(r.status != "ok" for r in crit),
            "sheddable_completed": len(s_ok),
            "sheddable_429": sum(r.status == "rejected" and r.error != "expired" for r in shed),
            "sheddable_expired": sum(r.error == "expired" for r in shed),
            "sheddable_max_wait_s": max((waits.get(r.request_id, 0.0) for r in shed), default=0.0),
            "sheddable_ttft_p99_s": percentile([t for r in s_ok if (t := r.ttft) is not None], 99),
        }
    return out


def mixed(servers: int, capacity: float, loads: Sequence[float], duration: float, seed: int,
          slo: SLO) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for load in loads:
        arrivals = generate(build_scenario("mixed-criticality", servers).spec,
                            rate=load * capacity, duration=duration, seed=seed)  # fmt: skip
        row: dict[str, Any] = {"load": load}
        for name in POLICIES:
            result, _ = _replay("mixed-criticality", servers, name, arrivals, seed)
            good = sum(
                1 for r in result.requests
                if r.status == "ok" and r.ttft is not None and r.ttft <= slo.ttft_s
                and (r.itl_mean is None or r.itl_mean <= slo.itl_s)
            )  # fmt: skip
            row[name] = {"goodput_rps": good / duration,
                         "shed": sum(r.status == "rejected" for r in result.requests)}  # fmt: skip
        rows.append(row)
    return rows


def burst(servers: int, capacity: float, duration: float, seed: int) -> dict[str, Any]:
    arrivals = generate(build_scenario("mixed-criticality", servers).spec,
                        rate=10 * capacity, duration=duration, seed=seed)  # fmt: skip
    result, policy = _replay("mixed-criticality", servers, "poolkeeper", arrivals, seed)
    assert isinstance(policy, FlowPolicy)
    summary = policy.summary()
    return {
        "load": 10.0,
        "duration_s": duration,
        "requests": len(arrivals),
        "completed": sum(r.status == "ok" and r.finish is not None for r in result.requests),
        "unfinished": sum(r.status == "ok" and r.finish is None for r in result.requests),
        "max_waiting": summary["max_waiting"],
        "left_waiting": summary["left_waiting"],
        "outcomes": summary["outcomes"],
        "end_time_s": result.end_time,
    }


def run_flow_bench(
    *, servers: int, duration: float, burst_s: float, seed: int, out_dir: Path,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    started = time.perf_counter()
    caps = {
        kind: float(fleet_capacity(build_scenario(kind, servers), seed=seed)["capacity_rps"])
        for kind in ("fairness", "criticality-flood", "mixed-criticality")
    }
    progress(f"capacities (req/s): {caps}")
    data: dict[str, Any] = {"kind": "bench-flow", "command": command_line(),
                            "machine": machine_info(), "servers": servers,
                            "duration_s": duration, "seed": seed, "capacity_rps": caps}  # fmt: skip
    data["fairness"] = [fairness(servers, caps["fairness"], x, duration, seed) for x in (2.0, 10.0)]
    progress(format_flow(data))
    data["flood"] = flood(servers, caps["criticality-flood"], 3.0, duration, seed)
    progress(format_flow(data))
    data["mixed"] = mixed(servers, caps["mixed-criticality"], (0.9, 1.1, 1.3), duration, seed,
                          SLO())  # fmt: skip
    data["burst"] = burst(servers, caps["mixed-criticality"], burst_s, seed)
    data["wall_s"] = time.perf_counter() - started
    write_json(out_dir / "flow.json", data)
    return data


def format_flow(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for f in data.get("fairness", []):
        lines.append(f"fairness @ {f['load']:g}x (offered tok/s {_r(f['offered_tok_s'])}):")
        for name in POLICIES:
            p = f[name]
            lines.append(
                f"  {name:>16}: served tok/s {_r(p['served_tok_s'])}, heavy:light "
                f"{p['ratio_heavy_to_light']:.2f}, completed share "
                f"{_r(p['completed_share'], '.2f')}, refused {p['shed']}"
            )
    if "flood" in data:
        f = data["flood"]
        lines.append(f"flood @ {f['load']:g}x: idle Critical p99 TTFT "
                     f"{f['idle_critical_ttft_p99_s'] * 1000:.0f} ms")  # fmt: skip
        for name in POLICIES:
            p = f[name]
            lines.append(
                f"  {name:>16}: Critical p99 {p['critical_ttft_p99_s'] * 1000:.0f} ms "
                f"({p['ratio_to_idle']:.2f}x idle), Critical shed {p['critical_shed']}; "
                f"Sheddable ok {p['sheddable_completed']}, 429 {p['sheddable_429']}, expired "
                f"{p['sheddable_expired']}, longest wait {p['sheddable_max_wait_s']:.2f} s"
            )
    for row in data.get("mixed", []):
        lines.append(f"mixed @ {row['load']:g}x: " + ", ".join(
            f"{n} goodput {row[n]['goodput_rps']:.1f} req/s (shed {row[n]['shed']})"
            for n in POLICIES))  # fmt: skip
    if "burst" in data:
        b = data["burst"]
        lines.append(
            f"burst 10x for {b['duration_s']:g} s: {b['requests']} requests, max waiting "
            f"{b['max_waiting']}, left waiting {b['left_waiting']}, unfinished "
            f"{b['unfinished']}, outcomes {b['outcomes']}"
        )
    return "\n".join(lines)


def _r(d: dict[str, float], fmt: str = ".0f") -> str:
    return ", ".join(f"{k} {v:{fmt}}" for k, v in d.items())
