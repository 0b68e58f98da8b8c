"""Prefix affinity with N EPP replicas: each replica sees 1/N of the requests (virtual time).

In Kubernetes the EPP runs active-active: the Gateway's Envoy spreads ext_proc streams over the
replicas, and every replica routes with its own prefix index, in-flight counts and observed
speeds, built only from the requests it routed itself. Scraped metrics (queue, KV cache) are the
same for all. So with N replicas, a replica has seen about 1/N of a prefix group's earlier
requests: its index still points at the server that holds the prefix, as long as the group's
requests keep arriving at it often enough.

`run(replicas, ...)` replays one workload (`workload`, `bench sim`'s names, default shared-prefix)
through the virtual fleet (`sim/virtual.py`) with `replicas` independent copies of the policy
(`policy`, default `poolkeeper`: the default scheduling preset behind flow control with its
defaults, the `holdNewPrefixes` hold included, as `poolkeeper serve` runs it; `bench sim`'s names,
e.g. `poolkeeper-classic` for the old default without the hold, `poolkeeper-shed` for admission's
shedding without flow control), request i going to replica hash(request id) mod N. Each replica sees
only its own requests: its in-flight and unseen counts, the first tokens of its own requests (as
Envoy reports them to the EPP that routed them), and its own held and queued requests. A replica's
pump runs as a live EPP's does: at every scrape tick, and when one of its own requests ends (or,
while its hold is on, has its first byte); another replica's requests do not wake it. One replica
routes exactly as `simrun.replay` with the same policy (a test checks it). Reported: prefix-cache
hit rate (what the model servers actually reused), TTFT, goodput, requests held by the hold, and
affinity: the share of each prefix group's requests that landed on that group's most used server.

With `exact=True` every replica's prefix scorer also keeps the exact index of KV-cache events
(`scheduling/exact_prefix.py`), fed straight from each simulated engine's KV cache (the same
events the live simulator publishes over ZMQ, without sockets; `ExactFeed`), stamped with the
time of the latest routing decision.

`cold_placement`: the replicas run the policy's profile with a `cold-placement-filter`
(`scheduling/plugins/cold_placement.py`, `cold_placement` its parameters) listed first
(`with_cold_placement`). `plugin_params`: parameters merged into the profile's plugins of that
type. The KV events' delay (`event_delay_s`) and cross-replica sync (`sync_delay_s`,
`sync_folds`): `replica_links.py`. The command line: `replicas.py`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from poolkeeper.bench.fleet.replica_links import EventDelay, ExactFeed, SyncLink, exact_indexes
from poolkeeper.bench.fleet.replica_router import (
    Replica,
    is_scrape_tick,
    prefix_scorers,
    replica_of,
    replica_policy,
)
from poolkeeper.bench.fleet.simrun import (
    SCRAPE_INTERVAL_S,
    _outcome,
    _sim_arrivals,
    fleet_capacity,
    llm_request_of,
    route_step,
)
from poolkeeper.bench.policies.routers import QueueingPolicy, RoutingPolicy
from poolkeeper.bench.results.metrics import SLO, summarize
from poolkeeper.bench.workload.scenarios import build_scenario
from poolkeeper.bench.workload.workload_spec import Arrival
from poolkeeper.bench.workload.workloads import generate
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.sim.virtual import HOLD, Send, VirtualFleet
from poolkeeper.sim.virtual_results import Arrival as SimArrival, RequestResult
from poolkeeper.tokens import count_tokens


def run(
    replicas: int,
    *,
    servers: int = 8,
    load: float = 0.7,
    duration: float = 120.0,
    seed: int = 1,
    capacity_rps: float | None = None,
    exact: bool = False,
    policy: str = "poolkeeper",
    cold_affinity: float = 0.0,
    cold_peers: bool = False,
    prefix_params: dict[str, Any] | None = None,
    groups: int | None = None,
    cold_placement: dict[str, Any] | None = None,
    event_delay_s: float = 0.0,
    plugin_params: dict[str, dict[str, Any]] | None = None,
    sync_delay_s: float | None = None,
    sync_folds: dict[str, bool] | None = None,
    sync_claim_s: float = 0.0,
    flow_control: FlowControlConfig | None = None,
    workload: str = "shared-prefix",
) -> dict[str, Any]:
    """One replay with `replicas` independent schedulers; returns the summary figures.
    `load` is a fraction of the fleet's capacity (probed unless `capacity_rps` is given);
    `exact`: the replicas' prefix scorers also read the engines' KV events;
    `cold_affinity`: their `coldAffinity` (the policy's own when 0); `cold_peers`: with
    `coldAffinityPeersOnly` (only once the KV events show another replica's traffic);
    `prefix_params`: more of their parameters (camelCase, as in a config);
    `cold_placement`: the parameters of a `cold-placement-filter` the replicas run (the module
    docstring); `event_delay_s`: how long the engines' KV events take to reach the replicas
    (0: at once, as before); `sync_delay_s`: cross-replica sync with that delay (None: none);
    `sync_folds`: `bind_scheduler`'s options (`index`, `drain`, `heads`), `wake`, and
    `unseen` and `unseen-lora` (off unless True: `replica_links.SyncLink`); `sync_claim_s`:
    its `claimGraceMs` in seconds (0: off);
    `flow_control`: the replicas' `spec.flowControl` (None: the defaults); `workload`: the
    scenario, as `bench sim` names it (with more than one criticality in it, the row adds each
    one's p90 TTFT)."""
    scenario = build_scenario(workload, servers)
    if groups is not None:
        scenario = replace(scenario, spec=replace(scenario.spec, num_groups=groups))
    if capacity_rps is None:
        capacity_rps = float(fleet_capacity(scenario, seed=seed)["capacity_rps"])
    arrivals = generate(scenario.spec, rate=load * capacity_rps, duration=duration, seed=seed)
    group_of = {a.request_id: a.group for a in arrivals}

    def make(k: int) -> RoutingPolicy:
        rng = random.Random(f"{seed}:replica{k}")
        return replica_policy(
            policy, rng, cold_placement, prefix_params, plugin_params, flow_control
        )

    routers = [Replica(make(k)) for k in range(replicas)]
    queueing = any(isinstance(r.policy, QueueingPolicy) for r in routers)
    wakes = any(getattr(r.policy, "wakes_on_first_token", False) for r in routers)
    # Routers that learn from first tokens get them as they happen (`simrun.replay`'s rule).
    answers_seen = bool(getattr(routers[0].policy, "observes_first_tokens", False))
    fleet = VirtualFleet(
        list(scenario.servers), seed=seed, scrape_interval=SCRAPE_INTERVAL_S,
        answers_seen=answers_seen,
    )  # fmt: skip
    index_of = {e.hostport: i for i, e in enumerate(fleet.endpoints)}
    keys = [e.hostport for e in fleet.endpoints]
    if cold_peers and not (exact and cold_affinity):
        raise ValueError("cold_peers needs exact=True and cold_affinity > 0")
    if cold_affinity:
        update: dict[str, Any] = {"cold_affinity": cold_affinity}
        if cold_peers:
            update.update(kv_events=True, kv_events_subscribe=False, cold_affinity_peers_only=True)
        for plugin in prefix_scorers(routers, "cold_affinity"):
            plugin.params = plugin.params.model_copy(update=update)
    if prefix_params:
        for plugin in prefix_scorers(routers, "prefix_params"):
            doc = {**plugin.params.model_dump(by_alias=True), **prefix_params}
            plugin.params = type(plugin.params).model_validate(doc)
    clock = [0.0]
    delay = EventDelay(event_delay_s)
    if exact:
        indexes = exact_indexes(routers, fleet.engines[0].config.block_size)
        for engine, endpoint in zip(fleet.engines, fleet.endpoints, strict=True):
            engine.kv.sink = ExactFeed(endpoint.hostport, indexes, clock, engine, delay)
    link = None
    if sync_delay_s is not None:
        folds = dict(sync_folds or {})
        wakes = folds.pop("wake", True)
        link = SyncLink(routers, sync_delay_s, folds, claim_s=sync_claim_s)
        link.wakes = wakes
    owner: dict[str, tuple[int, str]] = {}
    tokens_of: dict[str, int] = {}
    model_of = {a.request_id: a.target_model for a in arrivals}
    # When each replica's own request last ended (or answered, while its hold is on): its pump
    # runs at the fleet's release at that instant. (The fleet releases only while something
    # is held, so an older mark must not wake it later.)
    own_event_at: dict[int, float] = {}

    def placed(k: int, request_id: str, server: int, now: float) -> None:
        routers[k].sent(keys[server], request_id, now, tokens_of[request_id], model_of[request_id])
        owner[request_id] = (k, keys[server])
        if link is not None:
            link.flush(now)

    def route(sim: SimArrival, states: Sequence[EndpointState], now: float) -> int | None:
        a: Arrival = sim.payload  # type: ignore[assignment]
        clock[0] = now
        delay.deliver(now)
        if link is not None:
            link.deliver(now)
        k = replica_of(a.request_id, replicas)
        router = routers[k]
        tokens = tokens_of[a.request_id] = count_tokens(sim.prompt)
        request = llm_request_of(sim, tokens)
        chosen = route_step(router.policy, request, router.view(states), now, index_of)
        if chosen is not None and chosen != HOLD:
            placed(k, a.request_id, chosen, now)
        return chosen

    def release(states: Sequence[EndpointState], now: float, send: Send) -> None:
        clock[0] = now
        delay.deliver(now)
        if link is not None:
            link.deliver(now)
        tick = is_scrape_tick(now, SCRAPE_INTERVAL_S)
        woken = {k for k, at in own_event_at.items() if at == now}
        if link is not None:
            woken.update(link.woken)
            link.woken.clear()
        for k, router in enumerate(routers):
            if isinstance(router.policy, QueueingPolicy) and (tick or k in woken):
                release_one(k, router.policy, states, now, send)

    def release_one(
        k: int, policy: QueueingPolicy, states: Sequence[EndpointState], now: float, send: Send
    ) -> None:
        """Replica k's held and queued requests, placed on its own view, which is rebuilt
        after each send (the fleet's states update in place; the view is a copy)."""
        view = routers[k].view(states)

        def to_fleet(rid: str, chosen: EndpointState | None, error: str | None) -> None:
            if chosen is None:
                send(rid, None, error)
                return
            server = index_of[chosen.key]
            placed(k, rid, server, now)
            send(rid, server, None)
            view[:] = routers[k].view(states)

        policy.release(view, now, to_fleet)

    def first_token(result: RequestResult) -> None:
        k, _ = owner.get(result.request_id, (-1, ""))
        if k >= 0:
            if link is not None:  # peers' batches due by now first: each replica's time runs on
                link.deliver(result.first_token or 0.0)
            if answers_seen:  # only a router that asks Envoy for first bytes knows of them
                routers[k].answered.add(result.request_id)
            routers[k].policy.on_first_token(result.request_id, result.first_token or 0.0)
            if link is not None:
                link.flush(result.first_token or 0.0)
            if wakes:
                own_event_at[k] = result.first_token or 0.0

    def finished(result: RequestResult) -> None:
        k, key = owner.pop(result.request_id, (-1, ""))
        if k < 0:
            return
        if link is not None:
            link.deliver(result.finish or 0.0)
        routers[k].inflight.get(key, {}).pop(result.request_id, None)
        routers[k].answered.discard(result.request_id)
        routers[k].policy.on_finish(result.request_id, result.server_name, result.finish or 0.0)
        if link is not None:
            link.flush(result.finish or 0.0)
        own_event_at[k] = result.finish or 0.0

    result = fleet.run(
        _sim_arrivals(arrivals), route, on_finish=finished, on_first_token=first_token,
        release=release if queueing else None,
        release_on_first_token=wakes,  # as simrun.replay: the EPP wakes on first bytes
    )  # fmt: skip
    held = sum(getattr(getattr(r.policy, "hold", None), "total", 0) for r in routers)
    by_id = {a.request_id: a for a in arrivals}
    outcomes = [_outcome(r, by_id[r.request_id]) for r in result.requests]
    summary = summarize(outcomes, duration=duration, slo=SLO())
    per_group: dict[Any, Counter[str]] = {}
    for r in result.requests:
        if r.server_name:
            per_group.setdefault(group_of[r.request_id], Counter())[r.server_name] += 1
    served = sum(sum(c.values()) for c in per_group.values())
    top = sum(c.most_common(1)[0][1] for c in per_group.values())
    # Placement balance: how many groups have each server as their most used one.
    homes = Counter(c.most_common(1)[0][0] for c in per_group.values())
    # Each criticality's p90 where there is more than one (mixed-criticality: the Critical and
    # Standard p90 are hidden in the mix).
    by_criticality = {
        crit: round(figures["ttft_p90_s"], 4) for crit, figures in summary["by_criticality"].items()
    }
    return {
        **({"workload": workload} if workload != "shared-prefix" else {}),
        "replicas": replicas,
        "index": "exact" if exact else "approx",
        "cold_affinity": cold_affinity,
        "cold_peers": cold_peers,
        **({"prefix_params": prefix_params} if prefix_params else {}),
        **({"groups": groups} if groups is not None else {}),
        **({"cold_placement": cold_placement} if cold_placement is not None else {}),
        **({"event_delay_s": event_delay_s} if event_delay_s else {}),
        **({"plugin_params": plugin_params} if plugin_params else {}),
        **({"sync_delay_ms": round(sync_delay_s * 1000, 3)} if sync_delay_s is not None else {}),
        **({"sync_folds": sync_folds} if sync_folds else {}),
        "servers": servers,
        "load": load,
        "requests": len(arrivals),
        "prefix_hit_rate": round(summary["prefix_hit_rate"], 4),
        "affinity": round(top / served, 4) if served else 0.0,
        "groups_per_server": sorted((homes.get(e.name, 0) for e in fleet.endpoints), reverse=True),
        "ttft_p50_s": round(summary["ttft_s"]["p50"], 4),
        "ttft_p90_s": round(summary["ttft_s"]["p90"], 4),
        "ttft_p99_s": round(summary["ttft_s"]["p99"], 4),
        "goodput_rps": round(summary["goodput_rps"], 3),
        **({"ttft_p90_by_criticality": by_criticality} if len(by_criticality) > 1 else {}),
        "held": held,
    }
