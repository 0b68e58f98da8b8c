"""Virtual-time benchmark runs: the simulator's fleet driver with real routing code, no sockets.

One run = one scenario (workload + fleet), one policy, one offered load. The workload is
generated at `load x capacity` requests/s for `duration` virtual seconds and replayed through
`sim.virtual.VirtualFleet`; the policy sees the fleet as a scraper would (metrics refreshed
every 50 ms, the GIE default refresh interval) plus router-side in-flight counts. Requests run
to completion: nothing is cut off at the end of the arrival window.

Fleet capacity (what "1.0x load" means): for each distinct server configuration, one server
alone is offered the workload as defined for a one-server fleet for 30 s, at rates doubling
from 2 req/s until it is clearly saturated (it completes < 60% of the offered rate); its
capacity is the completion rate over the last two thirds of that saturated window (the first
third is warm-up: empty queue, cold cache). The fleet's capacity is the
sum over its servers. For shared-prefix chat this is the capacity under perfect prefix
affinity (each server sees its share of the groups); for multi-LoRA it is one server serving
the whole 32-adapter mix, so adapter-aware routing can do better than 1.0x.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from poolkeeper.bench.policies.flowpolicy import FlowPolicy
from poolkeeper.bench.policies.routers import QueueingPolicy, RoutingPolicy, make_policy
from poolkeeper.bench.results.metrics import SLO, RequestOutcome, summarize, ttft_values
from poolkeeper.bench.results.report import quantiles
from poolkeeper.bench.workload.scenarios import Scenario, build_scenario, server_configs
from poolkeeper.bench.workload.workload_spec import Arrival, WorkloadSpec
from poolkeeper.bench.workload.workloads import generate
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import NoReadyEndpoint, RequestShed
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import HOLD, Send, VirtualFleet
from poolkeeper.sim.virtual_results import Arrival as SimArrival, FleetResult, RequestResult
from poolkeeper.tokens import count_tokens

SCRAPE_INTERVAL_S = 0.05


def _sim_arrivals(arrivals: Sequence[Arrival]) -> Iterator[SimArrival]:
    """Sim arrivals built lazily, so prompt texts exist only while their request is routed."""
    for a in arrivals:
        yield SimArrival(
            time=a.time,
            request_id=a.request_id,
            model=a.target_model,
            prompt=a.prompt_text(),
            max_tokens=a.output_tokens,
            payload=a,
        )


def _outcome(r: RequestResult, a: Arrival, waited: float = 0.0) -> RequestOutcome:
    ok = r.status == "ok"
    return RequestOutcome(
        request_id=r.request_id,
        criticality=a.criticality,
        arrival=r.arrival,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.completion_tokens if ok else a.output_tokens,
        server=r.server_name or None,
        first_token=r.first_token if ok else None,
        finish=r.finish if ok and r.completion_tokens else None,
        cached_tokens=r.cached_tokens,
        shed=r.status == "rejected",
        expired=r.status == "rejected" and r.error == "expired",
        router_queue_s=waited,
        group=a.group,
        model=a.model,
    )


def llm_request_of(sim: SimArrival, prompt_tokens: int | None = None) -> LLMRequest:
    """The scheduler's request for a simulated arrival (its workload `Arrival` the payload),
    streamed; `prompt_tokens` when the caller counted them already."""
    a: Arrival = sim.payload  # type: ignore[assignment]
    return LLMRequest(
        request_id=a.request_id,
        model=a.model,
        target_model=a.target_model,
        criticality=a.criticality,
        prompt=sim.prompt,
        prompt_tokens=count_tokens(sim.prompt) if prompt_tokens is None else prompt_tokens,
        max_tokens=a.output_tokens,
        stream=True,
    )


def route_step(
    policy: RoutingPolicy,
    request: LLMRequest,
    states: Sequence[EndpointState],
    now: float,
    index_of: dict[str, int],
) -> int | None:
    """One arrival's routing in a virtual fleet: the chosen server's index, HOLD when a
    queueing policy (flow control) keeps the request for later, None when it is shed or no
    endpoint is ready."""
    try:
        if isinstance(policy, QueueingPolicy):
            held = policy.offer(request, states, now)
            if held is None:
                return HOLD
            chosen = held
        else:
            chosen = policy.pick(request, states, now)
    except (RequestShed, NoReadyEndpoint):
        return None
    return index_of[chosen.key]


def replay(
    configs: Sequence[EngineConfig],
    arrivals: Sequence[Arrival],
    policy: RoutingPolicy,
    *,
    seed: int,
    scrape_interval: float = SCRAPE_INTERVAL_S,
) -> FleetResult:
    # A scheduler that learns from first tokens has `serve` ask Envoy for each stream's first
    # byte as it passes, so its in-flight tracker knows which unseen requests answered.
    answers_seen = bool(getattr(policy, "observes_first_tokens", False))
    fleet = VirtualFleet(
        list(configs), seed=seed, scrape_interval=scrape_interval, answers_seen=answers_seen
    )
    bind = getattr(policy, "bind", None)
    if bind is not None:  # a reference policy that reads the engines (reference_policies.py)
        bind(fleet)
    index_of = {e.hostport: i for i, e in enumerate(fleet.endpoints)}
    queueing = policy if isinstance(policy, QueueingPolicy) else None

    def route(sim: SimArrival, states: Sequence[EndpointState], now: float) -> int | None:
        return route_step(policy, llm_request_of(sim), states, now, index_of)

    def finished(result: RequestResult) -> None:
        policy.on_finish(result.request_id, result.server_name, result.finish or 0.0)

    def first_token(result: RequestResult) -> None:
        policy.on_first_token(result.request_id, result.first_token or 0.0)

    def release(states: Sequence[EndpointState], now: float, send: Send) -> None:
        assert queueing is not None

        def to_fleet(rid: str, chosen: EndpointState | None, error: str | None) -> None:
            send(rid, None if chosen is None else index_of[chosen.key], error)

        queueing.release(states, now, to_fleet)

    return fleet.run(
        _sim_arrivals(arrivals), route, on_finish=finished, on_first_token=first_token,
        release=release if queueing is not None else None,
        release_on_first_token=bool(getattr(policy, "wakes_on_first_token", False)),
    )  # fmt: skip


class _OneServer:
    """The trivial router of a capacity probe."""

    name = "one-server"

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        return endpoints[0]

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        return None

    def on_first_token(self, request_id: str, now: float) -> None:
        return None


def server_capacity(
    spec: WorkloadSpec, config: EngineConfig, *, seed: int, window: float = 30.0
) -> dict[str, float]:
    """Saturation throughput (req/s) of one server on `spec` (see the module docstring)."""
    rate = 2.0
    while True:
        arrivals = generate(spec, rate=rate, duration=window, seed=seed)
        result = replay([config], arrivals, _OneServer(), seed=seed)
        lo, hi = window / 3, window
        done = sum(
            1 for r in result.requests if r.status == "ok" and r.finish is not None
            and lo <= r.finish < hi
        )  # fmt: skip
        throughput = done / (hi - lo)
        if throughput < 0.6 * rate or rate > 5000:
            return {"capacity_rps": throughput, "probe_rate_rps": rate}
        rate *= 2


def fleet_capacity(scenario: Scenario, *, seed: int) -> dict[str, Any]:
    # The probe server gets its share of the prefix groups (the default specs scale groups with
    # the fleet, so this equals the one-server default) and the whole adapter mix.
    spec = scenario.spec
    probe_spec = replace(spec, num_groups=max(1, spec.num_groups // len(scenario.servers)))
    one = server_configs(probe_spec, 1)[0]
    per_kind: dict[float, dict[str, float]] = {}
    total = 0.0
    for config in scenario.servers:
        key = config.time_scale
        if key not in per_kind:
            per_kind[key] = server_capacity(probe_spec, _probe_config(one, config), seed=seed)
        total += per_kind[key]["capacity_rps"]
    return {
        "capacity_rps": total,
        "per_server": {f"time_scale={k:g}": v for k, v in per_kind.items()},
        "method": "sum of single-server saturation throughput (bench.simrun docstring)",
    }


def _probe_config(one: EngineConfig, fleet_config: EngineConfig) -> EngineConfig:
    # The probe server has the fleet server's speed and the one-server workload's adapters.
    return replace(one, time_scale=fleet_config.time_scale)


def run_point(
    scenario: Scenario,
    policy_name: str,
    *,
    load: float,
    capacity_rps: float,
    duration: float,
    seed: int,
    slo: SLO,
    scrape_interval: float = SCRAPE_INTERVAL_S,
    flow_control: FlowControlConfig | None = None,
) -> dict[str, Any]:
    """One (policy, load) point: replay, summarize, and a 101-point TTFT distribution.
    `scrape_interval`: how stale the routers' view of the servers' metrics may be (capacity is
    a property of the servers and is measured at the default)."""
    rate = load * capacity_rps
    arrivals = generate(scenario.spec, rate=rate, duration=duration, seed=seed)
    # Every policy gets the same random stream, so tie-breaks differ only by what they decide.
    policy = make_policy(policy_name, random.Random(f"{seed}:policy"), scenario, flow_control)
    started = time.perf_counter()
    result = replay(scenario.servers, arrivals, policy, seed=seed, scrape_interval=scrape_interval)
    wall = time.perf_counter() - started
    by_id = {a.request_id: a for a in arrivals}
    waited: dict[str, float] = getattr(policy, "waited", {})
    outcomes = [
        _outcome(r, by_id[r.request_id], waited.get(r.request_id, 0.0)) for r in result.requests
    ]
    summary = summarize(outcomes, duration=duration, slo=slo)
    counters = [s.counters for s in result.servers]
    routed = [s.routed for s in result.servers]
    return {
        "policy": policy_name,
        "load": load,
        "rate_rps": rate,
        "summary": summary,
        "ttft_quantiles": quantiles(ttft_values(outcomes)),
        "fleet_stats": {
            "adapter_swaps": sum(getattr(c, "lora_loads", 0) for c in counters),
            "preemptions": sum(getattr(c, "preemptions", 0) for c in counters),
            "routed_min": min(routed),
            "routed_max": max(routed),
            "end_time_s": result.end_time,
        },
        "wall_s": wall,
        **({"flow_control": policy.summary()} if isinstance(policy, FlowPolicy) else {}),
    }


def scenario_for(kind: str, servers: int) -> Scenario:
    return build_scenario(kind, servers)
