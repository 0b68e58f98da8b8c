"""The `cold-placement-filter`: a new long prefix goes to one endpoint every EPP replica agrees on.

Reads the match of a `prefix-cache-scorer` (named by `prefixScorer`: its approximate index and,
with `kvEvents`, its exact one) and its consistent-hash ring (`scheduling/hashring.py`). A
prompt is *cold* when it has at least `minBlocks` of the scorer's blocks and no candidate is
known to cache that many of them. For a cold prompt the filter keeps exactly one candidate:
the first clockwise from the hash of those leading blocks on the ring of endpoints, among the
candidates *in the load band* (not out of balance with the least loaded:

    load - least > loadBandAbs  and  load > loadBandRel * least

puts an endpoint out). Any other prompt passes untouched, so warm prompts are left to the
scorers (with `keepPlaced`, below, to the candidates holding them).

Why a hard pick and not a score (the scorer's `coldAffinity`): with several replicas, each
places a new prefix before any engine has reported it (engines report blocks when they
schedule a request). A score push is weighed against load scorers whose inputs differ per
replica (each one's own in-flight requests and observed speeds, scrapes read at different
instants), so some replicas follow it and some do not, and the group's next requests land on a
second server that prefills the prefix again (live, 4 replicas: 0.7-2.1 such splits per cold
start). Here the only inputs are the ring (the same in every replica that knows the same
endpoints), the prompt, the scraped load (the same up to the scrape instant) through a wide band,
and optionally the engines' reports: replicas agree unless an endpoint sits at the band's edge.
Load still overrides: an endpoint out of the band never gets the new prefix.

With `keepPlaced` a long prompt some candidate is known to hold goes only to the candidates
holding it (read as the cold test reads it), so no replica's own load view moves a placed group.

The options (`countUnseen`, `balance` and `pendingHeads`, `backlogScorer` and
`scrapedWaiting`, `ownPlacements`, `keepPlaced`) and why each is there:
`cold_placement_params.py`.

Trade-off: a cold request has no fallback endpoint (the picker sees one candidate). List it
first, before a `stale-metrics-filter`: after it, an owner whose scrape is late is gone in
some replicas and not in others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.interfaces import CycleState, PostCycle, TypedName
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.cold_placement_params import ColdPlacementParams
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.tokens import CHARS_PER_TOKEN


def with_waiting(
    backlog: Mapping[str, int], candidates: Sequence[EndpointState], floor: int
) -> dict[str, int]:
    """`backlog` (endpoint -> this EPP's prefill backlog in tokens) for `candidates`, each
    endpoint whose last scrape shows a waiting request raised to at least `floor`: the
    engine's queue counts every replica's requests, this EPP's backlog only its own. Only a
    scrape that succeeded counts: a failed one keeps its last values (`reachable` is false),
    and an endpoint gone dead would otherwise stay busy while its sends fail. The queue is the
    whole server's, deferred LoRA requests included (a limit of the signal)."""
    out = {}
    for s in candidates:
        k = s.endpoint.hostport
        own = backlog.get(k, 0)
        m = s.metrics
        out[k] = max(own, floor) if m.waiting > 0 and m.reachable else own
    return out


def under_backlog(band: set[str], backlog: Mapping[str, int], tokens: int) -> set[str]:
    """The band's endpoints whose prefill backlog is under `tokens`; the whole band if none
    is (then the backlog cannot choose, and the ring does as without it)."""
    under = {k for k in band if backlog.get(k, 0) < tokens}
    return under or band


class ColdPlacementFilter(NamedPlugin):
    """Filter keeping, for a cold long prompt, only its ring owner within the load band."""

    __slots__ = ("backlog", "params", "prefix")

    def __init__(
        self,
        typed_name: TypedName,
        params: ColdPlacementParams,
        prefix: PrefixCacheScorer,
        backlog: PrefillBacklogScorer | None = None,
    ) -> None:
        super().__init__(typed_name)
        self.params = params
        self.prefix = prefix
        self.backlog = backlog

    def post_cycles_read(self) -> Sequence[tuple[str, PostCycle]]:
        # The backlog fills in the scorer's PostCycle, which runs only in its profiles.
        return [("backlogScorer", self.backlog)] if self.backlog is not None else []

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        if len(candidates) < 2:
            return candidates
        found = self.placement(cycle, request, candidates)
        if found is None:
            return candidates
        key, holders = found
        if holders:
            # `keepPlaced`: the candidates holding it (none of them left: placed as cold).
            kept = [s for s in candidates if s.endpoint.hostport in holders]
            if kept:
                return kept
        owner = self.owner(key, candidates, cycle.now)
        return [s for s in candidates if s.endpoint.hostport == owner]

    def placement(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> tuple[int, set[str]] | None:
        """For a long prompt (`minBlocks` blocks or more): its ring key (the chained hash of
        those blocks) and the candidates known to hold them (empty: cold). None: short, or
        held somewhere while `keepPlaced` is off, so the filter passes it untouched."""
        prefix, blocks = self.prefix, self.params.min_blocks
        hashes = prefix.hashes(cycle, request)
        if len(hashes) < blocks:
            return None
        need = blocks * prefix.params.block_size
        if self.params.own_placements or prefix.exact is None:
            held = prefix.matched(cycle, request)
        else:
            held = self._reported(cycle.now, request, hashes[:blocks], need, candidates)
        holders = {k for k, chars in held.items() if chars >= need}
        if holders and not self.params.keep_placed:
            return None
        return hashes[blocks - 1], holders

    def _reported(
        self,
        now: float,
        request: LLMRequest,
        hashes: list[int],
        upto: int,
        candidates: Sequence[EndpointState],
    ) -> dict[str, int]:
        """How much of the prompt's first `upto` characters each candidate holds, by its
        engine's reports where its feed is fresh, else by the approximate index."""
        prefix, exact = self.prefix, self.prefix.exact
        assert exact is not None
        size = prefix.params.block_size
        approx = prefix.index.match(hashes)
        chunk = exact.block_size * CHARS_PER_TOKEN
        reported = exact.match(
            engine_block_hashes(request.target_model, request.prompt[:upto], exact.block_size)
        )
        held = {}
        for s in candidates:
            k = s.endpoint.hostport
            held[k] = reported.get(k, 0) * chunk if exact.fresh(k, now) else approx.get(k, 0) * size
        return held

    def owner(self, key: int, candidates: Sequence[EndpointState], now: float) -> str:
        """ip:port of the first candidate clockwise from `key` within the load band (and,
        with `balance`, under its share of chain heads; the first in the band if none is)."""
        p = self.params
        keys = [s.endpoint.hostport for s in candidates]
        loads = [self._load(s) for s in candidates]
        least = min(loads)
        band = {
            k
            for k, load in zip(keys, loads, strict=True)
            if not (load - least > p.load_band_abs and load > p.load_band_rel * least)
        }
        if self.backlog is not None:
            band = under_backlog(band, self.backlogs(candidates), p.backlog_tokens)
        ring = self.prefix.hashring
        fits = self._fits(band, now)
        if fits is not None:
            owner = ring.owner(key, keys, fits)
            if owner in band and fits(owner):
                return owner
        return ring.owner(key, keys, band.__contains__)

    def backlogs(self, candidates: Sequence[EndpointState]) -> Mapping[str, int]:
        """The backlog scorer's prefill backlog per endpoint (streamed requests only), with
        `scrapedWaiting` raised where the scrape shows a queue (`with_waiting`)."""
        assert self.backlog is not None
        snap = self.backlog.backlog.seen_snapshot()
        if not self.params.scraped_waiting:
            return snap
        return with_waiting(snap, candidates, self.params.backlog_tokens)

    def _fits(self, band: set[str], now: float) -> Callable[[str], bool] | None:
        """`balance`'s test over the band (None: off or no exact index)."""
        exact = self.prefix.exact
        if not self.params.balance or exact is None:
            return None
        pending = self.params.pending_heads
        heads = {k: exact.heads(k, now, pending=pending) for k in band}
        bound = math.ceil(self.params.balance * (sum(heads.values()) + 1) / len(band))
        return lambda k: k in band and heads[k] < bound

    def _load(self, s: EndpointState) -> int:
        m = s.metrics
        load = m.running + m.waiting
        return load + s.unseen_requests if self.params.count_unseen else load
