"""Prefix affinity with N EPP replicas: each replica sees 1/N of the requests (virtual time).

In Kubernetes the EPP runs active-active: the Gateway's Envoy spreads ext_proc streams over the
replicas, and every replica routes with its own prefix index, in-flight counts and observed
speeds, built only from the requests it routed itself. Scraped metrics (queue, KV cache) are the
same for all. So with N replicas, a replica has seen about 1/N of a prefix group's earlier
requests: its index still points at the server that holds the prefix, as long as the group's
requests keep arriving at it often enough.

`run(replicas, ...)` replays one shared-prefix workload through the virtual fleet
(`sim/virtual.py`) with `replicas` independent copies of the policy (`policy`, default
`poolkeeper`: the default scheduling preset behind flow control with its defaults, the
`holdNewPrefixes` hold included, as `poolkeeper serve` runs it; `bench sim`'s names, e.g.
`poolkeeper-classic` for the old default without the hold, `poolkeeper-shed` for admission's
shedding without flow control), request i going to replica hash(request id) mod N. Each
replica sees only its own requests: its in-flight and unseen counts, the first tokens of its
own requests (as Envoy reports them to the EPP that routed them), and its own held and queued
requests. A replica's pump runs as a live EPP's does: at every scrape tick, and when one of its
own requests ends (or, while its hold is on, has its first byte); another replica's requests
do not wake it. One replica routes
exactly as `simrun.replay` with the same policy (a test checks it). Reported: prefix-cache hit
rate (what the model servers actually reused), TTFT, goodput, requests held by the hold, and
affinity: the share of each prefix group's requests that landed on that group's most used
server.

With `exact=True` every replica's prefix scorer also keeps the exact index of KV-cache events
(`scheduling/exact_prefix.py`), fed here straight from each simulated engine's KV cache (the
same events the live simulator publishes over ZMQ, without sockets), stamped with the time of
the latest routing decision.

    python -m poolkeeper.bench.fleet.replicas [--servers 8] [--load 0.7] [--duration 120] \
        [--replicas 1 2 4] [--index approx exact] [--policy poolkeeper] \
        [--cold-affinity 0.2 [--cold-peers]] [--plugin-params JSON] [--sync-delay-ms 1]
    python -m poolkeeper.bench.fleet.replicas ... --cold-placement '{"balance": 1}'
    python -m poolkeeper.bench.fleet.replicas --memory [--endpoints 1000] [--blocks 1000] \
        [--chain 128]
    python -m poolkeeper.bench.fleet.replicas --memory --subscribers [--endpoints 1000]

`cold_placement` (`--cold-placement PARAMS`): the replicas run the policy's profile with a
`cold-placement-filter` (`scheduling/plugins/cold_placement.py`, PARAMS its parameters) listed
first (`with_cold_placement`). `plugin_params` (`--plugin-params '{"TYPE": {...}}'`): parameters
merged into the profile's plugins of that type.

`event_delay_s` (`--event-delay S`): the engines' events reach the replicas S seconds after the
engine stored the blocks (live they cross a socket and a busy event loop), so a new prefix's
second request can reach another replica before the report.

`sync_delay_s` (`--sync-delay-ms D`; absent: no sync): cross-replica sync
(`scheduling/replicasync/`): every replica's scheduler is bound to a `ReplicaSync` hub
(`bind_scheduler`), and the batch each one's `take()` returns after each of its decisions,
first bytes and ends reaches every other replica D ms later (virtual time; applied at the first
routing decision or release at or after that, stamped with the due time; 0: at once, before
the next decision). A batch with a peer's first byte or end wakes the receiving replica's pump
at the next release (its hold reads a backlog that just shrank). `sync_folds` (`--sync-without
index drain heads wake`) turns parts of the fold (and the wake) off, to measure what each adds.

`--memory` measures (tracemalloc) the exact index holding `--blocks` engine-reported blocks on
each of `--endpoints` endpoints (each block on one endpoint, the common case), and the
approximate index with the same entries: bytes per (endpoint, block) entry and per 1,000
endpoints at that many blocks each. `--subscribers` measures what the index's feed costs live:
the resident memory (VmRSS) a `KVEventSubscriber` adds by following `--endpoints` engines (one
ZMQ SUB socket and task each), against publishers in a child process that each send one batch
(checked: every subscription receives it).
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from poolkeeper.bench.fleet.simrun import (
    SCRAPE_INTERVAL_S,
    _outcome,
    _sim_arrivals,
    fleet_capacity,
    route_step,
)
from poolkeeper.bench.policies.flowpolicy import flow_policy
from poolkeeper.bench.policies.routers import QueueingPolicy, RoutingPolicy, make_policy
from poolkeeper.bench.policies.schedpolicy import (
    CANDIDATE_PRESETS,
    FLOW_PRESETS,
    scheduler_policy,
    scheduling_document,
)
from poolkeeper.bench.results.metrics import SLO, summarize
from poolkeeper.bench.workload.scenarios import build_scenario
from poolkeeper.bench.workload.workloads import Arrival, generate
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.replicasync.events import Batch
from poolkeeper.scheduling.replicasync.fold import bind_scheduler
from poolkeeper.scheduling.replicasync.hub import ReplicaSync, clears
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.virtual import HOLD, Arrival as SimArrival, RequestResult, Send, VirtualFleet
from poolkeeper.tokens import count_tokens


class _Replica:
    """One EPP replica: its own policy and its own in-flight view (its own requests, and of
    those the ones whose first byte it has seen)."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self.inflight: dict[str, dict[str, tuple[float, int]]] = {}  # server -> id -> (t, tok)
        self.answered: set[str] = set()  # of those, the ids whose first token is out

    def sent(self, server: str, request_id: str, now: float, tokens: int) -> None:
        self.inflight.setdefault(server, {})[request_id] = (now, tokens)

    def view(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        out = []
        answered = self.answered
        for s in states:
            mine = self.inflight.get(s.key, {})
            scraped = s.metrics.updated_at
            # A scrape stamped T is taken before any change at T or later (`sim/virtual.py`):
            # a request sent at T is one it has not seen.
            unseen = [(rid, tok) for rid, (t, tok) in mine.items() if t >= scraped]
            out.append(
                replace(
                    s,
                    inflight_requests=len(mine),
                    inflight_tokens=sum(tok for _, tok in mine.values()),
                    unseen_requests=len(unseen),
                    unseen_tokens=sum(tok for _, tok in unseen),
                    unseen_answered=sum(1 for rid, _ in unseen if rid in answered),
                )
            )
        return out


def with_cold_placement(doc: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`doc` (a scheduling document with a `prefix-cache-scorer`) with a
    `cold-placement-filter` of `params` first in its profile, before any stale filter (which
    would drop a late-scraped owner in some replicas and not in others)."""
    doc = {**doc, "plugins": [{"type": "cold-placement-filter", "parameters": params},
                              *doc["plugins"]]}  # fmt: skip
    profiles = []
    for profile in doc["schedulingProfiles"]:
        refs = [{"pluginRef": "cold-placement-filter"}, *profile["plugins"]]
        profiles.append({**profile, "plugins": refs})
    return {**doc, "schedulingProfiles": profiles}


def replica_policy(
    policy: str,
    rng: random.Random,
    cold_placement: dict[str, Any] | None = None,
    prefix_params: dict[str, Any] | None = None,
    plugin_params: dict[str, dict[str, Any]] | None = None,
    flow_control: FlowControlConfig | None = None,
) -> RoutingPolicy:
    """One replica's policy: `policy` (`bench.policies.routers`; `poolkeeper` is the EPP's
    default scheduling preset behind flow control with its defaults, `holdNewPrefixes`
    included, as `poolkeeper serve` runs it), with a `cold-placement-filter` of
    `cold_placement` first in its profile where given, `prefix_params` on its
    prefix-cache-scorer, and `plugin_params` (plugin type -> parameters) merged into those
    plugins' parameters; `flow_control`: the flow-controlled policies' `spec.flowControl`
    (None: the defaults)."""
    if cold_placement is None and not plugin_params:
        return make_policy(policy, rng, flow_control=flow_control)
    doc = scheduling_document(policy)
    extra = {"prefix-cache-scorer": prefix_params or {}, **(plugin_params or {})}
    types = {plugin["type"] for plugin in doc["plugins"]}
    if unknown := sorted(set(plugin_params or {}) - types):
        # A typo would otherwise run (and label) a control run as the variant.
        raise ValueError(f"plugin_params for {unknown}: {policy} has no such plugin ({types})")
    for plugin in doc["plugins"]:
        if plugin["type"] in extra:
            plugin["parameters"] = {**plugin.get("parameters", {}), **extra[plugin["type"]]}
    if cold_placement is not None:
        doc = with_cold_placement(doc, cold_placement)
    if policy in FLOW_PRESETS or policy in CANDIDATE_PRESETS:
        return flow_policy(policy, rng, flow_control, document=doc)
    return scheduler_policy(policy, rng, doc)


def is_scrape_tick(now: float, every: float) -> bool:
    """Whether the fleet's release at `now` is a scrape tick (the fleet polls at whole
    multiples of the scrape interval, computed as `tick * every`) rather than an engine event."""
    return round(now / every) * every == now


def replica_of(request_id: str, replicas: int) -> int:
    return zlib.crc32(request_id.encode()) % replicas


class _EventDelay:
    """KV events in flight from the engines to the replicas, `delay_s` long: each is applied
    to every replica's index at the first routing decision at least `delay_s` after the engine
    stored or evicted the blocks. Why: live, a report reaches the other replicas after the
    engine's publish, the network and the EPP's event loop (on a starved machine, tens to
    hundreds of ms), and a new prefix placed in that window looks cold to the others. (The
    sync link's batches travel the same way: `_SyncLink`.)"""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._queue: deque[tuple[float, Callable[[float], None]]] = deque()

    def push(self, at: float, apply: Callable[[float], None]) -> None:
        if self.delay_s <= 0:
            apply(at)
        else:
            self._queue.append((at + self.delay_s, apply))  # `at` never decreases

    def deliver(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            due, apply = queue.popleft()
            apply(due)


class _ExactFeed:
    """One engine's KV-cache sink: its events go to every replica's exact index. With a delay
    they leave at the engine's time (the later of the last routing decision and the engine's
    last step end: an engine stores a prompt's blocks when it plans the step that starts
    then); without, they are applied at once, stamped with the last routing decision."""

    def __init__(
        self,
        endpoint: str,
        indexes: list[ExactPrefixIndex],
        clock: list[float],
        engine: EngineModel,
        delay: _EventDelay,
    ) -> None:
        self.endpoint = endpoint
        self.indexes = indexes
        self.clock = clock
        self.engine = engine
        self.delay = delay

    def _now(self) -> float:
        if self.delay.delay_s <= 0:
            return self.clock[0]  # applied at once: as the runs without a delay always were
        return max(self.clock[0], self.engine.last_step_end)

    def stored(self, hashes: list[int], parent: int | None) -> None:
        # The index keys blocks by their own (chained) hash; no parent = a chain's first block.
        endpoint, indexes, head = self.endpoint, self.indexes, parent is None

        def apply(at: float) -> None:
            for index in indexes:
                index.stored(endpoint, hashes, at, head=head)

        self.delay.push(self._now(), apply)

    def removed(self, hashes: list[int]) -> None:
        endpoint, indexes = self.endpoint, self.indexes

        def apply(at: float) -> None:
            for index in indexes:
                index.removed(endpoint, hashes, at)

        self.delay.push(self._now(), apply)


def _scheduler_of(router: _Replica) -> Scheduler | None:
    policy = getattr(router.policy, "inner", router.policy)  # behind flow control
    scheduler = getattr(policy, "scheduler", None)
    return scheduler if isinstance(scheduler, Scheduler) else None


class _SyncLink:
    """Cross-replica sync between the replicas, `delay_s` long (the module docstring)."""

    def __init__(self, routers: Sequence[_Replica], delay_s: float, folds: dict[str, bool]) -> None:
        self.hubs: list[ReplicaSync] = []
        for k, router in enumerate(routers):
            scheduler = _scheduler_of(router)
            if scheduler is None:
                raise ValueError("sync needs a policy with a scheduler")
            hub = ReplicaSync(f"replica{k}")
            on = {part: folds.get(part, True) for part in ("index", "drain", "heads")}
            bind_scheduler(hub, scheduler, index=on["index"], drain=on["drain"], heads=on["heads"])
            self.hubs.append(hub)
        self._delay = _EventDelay(delay_s)  # batches in flight
        # Replicas that got a peer's first byte or end since the last release: their held
        # requests may fit now, so their pump runs at the next release, as on their own.
        self.woken: set[int] = set()
        self.wakes = True

    def flush(self, now: float) -> None:
        """Send what each replica published since the last flush."""
        for hub in self.hubs:
            batch = hub.take()
            if batch is not None:
                self._delay.push(now, partial(self._to_peers, batch))

    def deliver(self, now: float) -> None:
        self._delay.deliver(now)

    def _to_peers(self, batch: Batch, at: float) -> None:
        wake = self.wakes and clears(batch)
        for k, hub in enumerate(self.hubs):
            if hub.origin != batch.origin and hub.deliver(batch, at) and wake:
                self.woken.add(k)


def _prefix_scorers(routers: Sequence[_Replica], why: str) -> list[PrefixCacheScorer]:
    """Every replica's prefix-cache scorer(s); `why` names the option that needs them."""
    out: list[PrefixCacheScorer] = []
    for router in routers:
        plugins = getattr(_scheduler_of(router), "plugins", {})
        out.extend(p for p in plugins.values() if isinstance(p, PrefixCacheScorer))
    if len(out) < len(routers):
        raise ValueError(f"{why} needs a policy with a prefix-cache-scorer")
    return out


def _exact_indexes(routers: Sequence[_Replica], block_size: int) -> list[ExactPrefixIndex]:
    """Give each replica's prefix scorer(s) an exact index; returns them all."""
    out: list[ExactPrefixIndex] = []
    for plugin in _prefix_scorers(routers, "exact=True"):
        index = ExactPrefixIndex(block_size=block_size)
        plugin.enable_exact(index)
        out.append(index)
    return out


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
    flow_control: FlowControlConfig | None = None,
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
    `sync_folds`: `bind_scheduler`'s options (`index`, `drain`, `heads`) and `wake`;
    `flow_control`: the replicas' `spec.flowControl` (None: the defaults)."""
    scenario = build_scenario("shared-prefix", servers)
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

    routers = [_Replica(make(k)) for k in range(replicas)]
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
        for plugin in _prefix_scorers(routers, "cold_affinity"):
            plugin.params = plugin.params.model_copy(update=update)
    if prefix_params:
        for plugin in _prefix_scorers(routers, "prefix_params"):
            doc = {**plugin.params.model_dump(by_alias=True), **prefix_params}
            plugin.params = type(plugin.params).model_validate(doc)
    clock = [0.0]
    delay = _EventDelay(event_delay_s)
    if exact:
        indexes = _exact_indexes(routers, fleet.engines[0].config.block_size)
        for engine, endpoint in zip(fleet.engines, fleet.endpoints, strict=True):
            engine.kv.sink = _ExactFeed(endpoint.hostport, indexes, clock, engine, delay)
    link = None
    if sync_delay_s is not None:
        folds = dict(sync_folds or {})
        wakes = folds.pop("wake", True)
        link = _SyncLink(routers, sync_delay_s, folds)
        link.wakes = wakes
    owner: dict[str, tuple[int, str]] = {}
    tokens_of: dict[str, int] = {}
    # When each replica's own request last ended (or answered, while its hold is on): its pump
    # runs at the fleet's release at that instant. (The fleet releases only while something
    # is held, so an older mark must not wake it later.)
    own_event_at: dict[int, float] = {}

    def placed(k: int, request_id: str, server: int, now: float) -> None:
        routers[k].sent(keys[server], request_id, now, tokens_of[request_id])
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
        request = LLMRequest(
            request_id=a.request_id,
            model=a.model,
            target_model=a.target_model,
            criticality=a.criticality,
            prompt=sim.prompt,
            prompt_tokens=tokens,
            max_tokens=a.output_tokens,
            stream=True,
        )
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
    return {
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
        "held": held,
    }


def memory(endpoints: int, blocks: int, chain: int = 128) -> dict[str, Any]:
    """Traced bytes of the exact and the approximate index at `blocks` per endpoint, the
    exact one reported as chains of `chain` blocks (each chain's first block a head, which
    `coldAffinityBalance` counts: 128 blocks = a 2,048-token prompt; 1 = the worst case)."""
    import tracemalloc

    from poolkeeper.scheduling.prefix import PrefixIndex

    rng = random.Random(1)
    if chain < 1:
        raise ValueError("chain must be >= 1")
    out: dict[str, Any] = {"endpoints": endpoints, "blocks_per_endpoint": blocks, "chain": chain}
    for kind in ("exact", "approx"):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        exact = ExactPrefixIndex()
        approx = PrefixIndex(blocks)
        for i in range(endpoints):
            key = f"10.0.{i // 250}.{i % 250 + 1}:8000"
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            if kind == "exact":
                for start in range(0, blocks, chain):
                    exact.stored(key, hashes[start : start + chain], 0.0, head=True)
            else:
                approx.insert(key, hashes)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        entries = endpoints * blocks
        out[f"{kind}_bytes_per_entry"] = round(used / entries, 1)
        out[f"{kind}_mib_per_1000_endpoints"] = round(used / endpoints * 1000 / 2**20, 1)
        del exact, approx
    return out


_PUBLISHERS = """
import sys, zmq
from poolkeeper.kvevents import BlockStored, KVEventBatch, encode
ctx = zmq.Context()
socks = [ctx.socket(zmq.PUB) for _ in range(int(sys.argv[1]))]
print(" ".join(str(s.bind_to_random_port("tcp://127.0.0.1")) for s in socks), flush=True)
sys.stdin.readline()
payload = encode(KVEventBatch(0.0, [BlockStored([1, 2, 3], None, [], 16, None, "GPU")], 0))
for s in socks:
    s.send_multipart([b"kv", bytes(8), payload])
print("sent", flush=True)
sys.stdin.readline()
"""


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError("no VmRSS in /proc/self/status")


def subscriber_memory(endpoints: int, settle_s: float = 2.0) -> dict[str, Any]:
    """Resident KiB a KV-event subscriber adds by following `endpoints` live publishers."""
    import asyncio
    import subprocess
    import sys

    from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber

    async def measure(ports: list[str], child: subprocess.Popen[str]) -> dict[str, Any]:
        assert child.stdin is not None
        assert child.stdout is not None
        addresses = {
            f"10.0.{i // 250}.{i % 250 + 1}:8000": f"tcp://127.0.0.1:{p}"
            for i, p in enumerate(ports)
        }
        subscriber = KVEventSubscriber(ExactPrefixIndex(), addresses.__getitem__)
        await asyncio.sleep(0.2)
        before = _rss_kib()
        subscriber.follow(addresses)
        await asyncio.sleep(settle_s)  # connected (ZMQ drops what a PUB sends before that)
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()
        await asyncio.sleep(settle_s)
        used = _rss_kib() - before
        received = subscriber.received
        await subscriber.close()
        return {
            "endpoints": endpoints,
            "batches_received": received,
            "subscriber_kib_per_endpoint": round(used / endpoints, 1),
            "subscriber_mib_per_1000_endpoints": round(used / endpoints * 1000 / 1024, 1),
        }

    with subprocess.Popen(
        [sys.executable, "-c", _PUBLISHERS, str(endpoints)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        assert child.stdout is not None
        assert child.stdin is not None
        try:
            return asyncio.run(measure(child.stdout.readline().split(), child))
        finally:
            child.stdin.close()
            child.wait(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poolkeeper.bench.fleet.replicas")
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--groups", type=int, default=None, help="prefix groups (default: the workload's)"
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--policy",
        default="poolkeeper",
        help="each replica's policy (default poolkeeper: the default preset behind flow "
        "control, as `poolkeeper serve` runs it; poolkeeper-classic: the old default)",
    )
    parser.add_argument("--index", nargs="+", choices=["approx", "exact"], default=["approx"])
    parser.add_argument(
        "--cold-affinity", type=float, default=0.0, help="the prefix scorers' coldAffinity"
    )
    parser.add_argument(
        "--cold-peers",
        action="store_true",
        help="coldAffinityPeersOnly: cold affinity once the events show another replica",
    )
    parser.add_argument(
        "--prefix-params",
        type=json.loads,
        default=None,
        help="more prefix-cache-scorer parameters as JSON, e.g. '{\"coldAffinityLoadSlack\": 2}'",
    )
    parser.add_argument(
        "--cold-placement",
        type=json.loads,
        default=None,
        help="run a cold-placement-filter with these parameters as JSON, e.g. '{\"balance\": 1}'",
    )
    parser.add_argument(
        "--event-delay",
        type=float,
        default=0.0,
        help="seconds the engines' KV events take to reach the replicas (default 0)",
    )
    parser.add_argument(
        "--plugin-params",
        type=json.loads,
        default=None,
        help="plugin type -> parameters merged into the replicas' profile, as JSON, e.g. "
        '\'{"prefill-backlog-scorer": {"fadeFrom": 0.6}}\'',
    )
    parser.add_argument(
        "--sync-delay-ms",
        type=float,
        default=None,
        help="cross-replica sync, each replica's batches reaching the others this many ms "
        "later (default: no sync)",
    )
    parser.add_argument(
        "--sync-without",
        nargs="+",
        choices=["index", "drain", "heads", "wake"],
        default=[],
        help="with --sync-delay-ms: parts of the fold left out (peers' blocks in the "
        "approximate index, their first bytes as drain samples, their pending heads, a "
        "peer's first byte or end waking the replica's pump)",
    )
    parser.add_argument(
        "--flow-control",
        type=FlowControlConfig.model_validate_json,
        default=None,
        help="the replicas' spec.flowControl as JSON, e.g. "
        '\'{"holdNewPrefixes": {"placeUnderBacklog": false}}\' (default: the defaults)',
    )
    parser.add_argument("--memory", action="store_true", help="measure index memory only")
    parser.add_argument(
        "--subscribers", action="store_true", help="with --memory: the live feed's memory"
    )
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument(
        "--chain", type=int, default=128, help="with --memory: blocks per reported chain"
    )
    args = parser.parse_args(argv)
    if args.memory and args.subscribers:
        print(json.dumps(subscriber_memory(args.endpoints), indent=2))
        return 0
    if args.memory:
        print(json.dumps(memory(args.endpoints, args.blocks, args.chain), indent=2))
        return 0
    scenario = build_scenario("shared-prefix", args.servers)
    if args.groups is not None:
        scenario = replace(scenario, spec=replace(scenario.spec, num_groups=args.groups))
    capacity = float(fleet_capacity(scenario, seed=args.seed)["capacity_rps"])
    rows = [
        run(
            n,
            servers=args.servers,
            load=args.load,
            duration=args.duration,
            seed=args.seed,
            capacity_rps=capacity,
            exact=kind == "exact",
            cold_affinity=args.cold_affinity,
            cold_peers=args.cold_peers and kind == "exact",
            prefix_params=args.prefix_params,
            groups=args.groups,
            cold_placement=args.cold_placement,
            event_delay_s=args.event_delay,
            policy=args.policy,
            plugin_params=args.plugin_params,
            sync_delay_s=None if args.sync_delay_ms is None else args.sync_delay_ms / 1000,
            sync_folds={part: False for part in args.sync_without} or None,
            flow_control=args.flow_control,
        )
        for kind in args.index
        for n in args.replicas
    ]
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
