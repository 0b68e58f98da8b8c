"""One EPP replica in virtual time: its policy, its own in-flight view, and which requests it gets.

Live, every EPP replica routes with its own prefix index, in-flight counts and observed speeds,
built only from the requests it routed itself; scraped metrics (queue, KV cache) are the same
for all. `Replica` is that: a policy (`replica_policy`: a named policy, optionally with a
cold-placement filter and plugin parameters) and the in-flight view built from its own sends
and first bytes (and, with sync's `unseen` part, the peers' sends since each scrape). Request i
goes to replica
`replica_of(i, N)`. `scheduler_of` and `prefix_scorers` reach into a replica's policy for the
plugins the replay (`replica_run.py`) and the links (`replica_links.py`) set up.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from poolkeeper.bench.policies.flowpolicy import flow_policy
from poolkeeper.bench.policies.routers import RoutingPolicy, make_policy
from poolkeeper.bench.policies.schedpolicy import (
    CANDIDATE_PRESETS,
    FLOW_PRESETS,
    scheduler_policy,
    scheduling_document,
)
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.replicasync.peerunseen import PeerUnseen
from poolkeeper.scheduling.scheduler import Scheduler


class Replica:
    """One EPP replica: its own policy and its own in-flight view (its own requests, by
    target model too, and of those the ones whose first byte it has seen). The count per
    model is its own, as live (flow control's adapter-deferred requests,
    `flowcontrol/slots.py`); the fleet's states carry every replica's, which left a replica
    its own total less all replicas' deferred ones (found tracing multi-LoRA:
    docs/notes/2026-12-07-lora-replicas-cliff.md)."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        # server -> id -> (sent at, prompt tokens, target model)
        self.inflight: dict[str, dict[str, tuple[float, int, str]]] = {}
        self.answered: set[str] = set()  # of those, the ids whose first token is out
        # With sync's `unseen` part (`replica_links.SyncLink`): the peers' sends since each
        # endpoint's scrape, added to the view's unseen counts.
        self.peers: PeerUnseen | None = None

    def sent(self, server: str, request_id: str, now: float, tokens: int, model: str) -> None:
        self.inflight.setdefault(server, {})[request_id] = (now, tokens, model)

    def view(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        out = []
        answered = self.answered
        for s in states:
            mine = self.inflight.get(s.key, {})
            scraped = s.metrics.updated_at
            # A scrape stamped T is taken before any change at T or later (`sim/virtual.py`):
            # a request sent at T is one it has not seen.
            unseen = [(rid, tok) for rid, (t, tok, _) in mine.items() if t >= scraped]
            out.append(
                replace(
                    s,
                    inflight_requests=len(mine),
                    inflight_tokens=sum(tok for _, tok, _ in mine.values()),
                    inflight_models=MappingProxyType(Counter(m for _, _, m in mine.values())),
                    unseen_requests=len(unseen),
                    unseen_tokens=sum(tok for _, tok in unseen),
                    unseen_answered=sum(1 for rid, _ in unseen if rid in answered),
                )
            )
        return out if self.peers is None else self.peers.apply(out)


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


def scheduler_of(router: Replica) -> Scheduler | None:
    """The scheduler behind `router`'s policy (None for a policy without one)."""
    policy = getattr(router.policy, "inner", router.policy)  # behind flow control
    scheduler = getattr(policy, "scheduler", None)
    return scheduler if isinstance(scheduler, Scheduler) else None


def prefix_scorers(routers: Sequence[Replica], why: str) -> list[PrefixCacheScorer]:
    """Every replica's prefix-cache scorer(s); `why` names the option that needs them."""
    out: list[PrefixCacheScorer] = []
    for router in routers:
        plugins = getattr(scheduler_of(router), "plugins", {})
        out.extend(p for p in plugins.values() if isinstance(p, PrefixCacheScorer))
    if len(out) < len(routers):
        raise ValueError(f"{why} needs a policy with a prefix-cache-scorer")
    return out
