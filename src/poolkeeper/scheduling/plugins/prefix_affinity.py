"""The `prefix-affinity-filter`: while the load is balanced, only the endpoints holding the prompt.

Reads the match of a `prefix-cache-scorer` (named by `prefixScorer`, so one index serves both).
An endpoint *holds* a prompt when it probably caches at least `minMatchRatio` of it and at least
`minMatchBlocks` of the scorer's blocks. When some candidates hold the prompt, the filter keeps
only those, unless the least loaded of them is out of balance with the least loaded candidate:

    held_min - all_min > balanceAbsThreshold  and  held_min > balanceRelThreshold * all_min

(load = running + waiting + requests sent since the scrape). Then, and for a prompt nobody holds,
every candidate stays and the scorers weigh affinity against load as before. List it before
the `stale-metrics-filter`, or after one whose `prefixScorer` is set (it keeps a late holder):
after a plain one, a holder whose scrape is late is already gone.

Why: the weighted sum lets load outvote affinity whenever the holder is busier by a few requests,
and during a cold start every holder is busy prefilling. A request sent elsewhere prefills the
whole shared prefix again (a 2,000-token system prompt is one long step that every request on
that server waits behind) and makes a second holder, so one busy moment costs two servers a
prefill. sglang-router's `cache_aware` makes the same choice with a hard switch (affinity unless
max - min > 64 and max > 1.5 x min in-flight requests; reference/peers.md section 3.2); here
the switch compares the holders with the least loaded endpoint, not max with min, so a busy
server that does not hold the prompt does not turn affinity off, and the thresholds are sized
to an engine's in-flight count (tens), not a router's (hundreds).

`onlyWhenStale`: narrow only when some holder's metrics are stale, else leave affinity to the
scorers. Listed before the `stale-metrics-filter`, that keeps the holders through a late
scrape. Why: on a loaded machine (live, load average 15), the re-prefills of the default came in
bursts, up to four groups moving onto one server within 0.1 s: the pattern of the stale filter
leaving only the endpoint scraped last while the holders' scrapes were late.

Trade-off: a held request's fallbacks (the picker's extra endpoints) are other holders only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import Field

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest

_LN2 = math.log(2.0)


class PrefixAffinityParams(PluginParams):
    prefix_scorer: str = Field(
        default="prefix-cache-scorer",
        description="Name of the prefix-cache-scorer instance whose index says who holds "
        "the prompt (default prefix-cache-scorer).",
    )
    min_match_ratio: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="Share of the prompt an endpoint must probably cache to hold it "
        "(default 0.3, sglang-router's cache threshold).",
    )
    min_match_blocks: int = Field(
        default=32,
        ge=1,
        description="Blocks of the prefix scorer an endpoint must probably cache to hold the "
        "prompt (default 32: 512 tokens at 64-character blocks), so that short prompts never "
        "narrow the choice.",
    )
    balance_abs_threshold: float = Field(
        default=16,
        ge=0,
        description="Affinity yields only when the least loaded holder has more than this many "
        "requests more than the least loaded candidate (default 16) ...",
    )
    balance_rel_threshold: float = Field(
        default=1.5,
        ge=1.0,
        description="... and more than this many times as many (default 1.5).",
    )
    only_when_stale: bool = Field(
        default=False,
        description="Narrow only when some holder's metrics are older than "
        "spec.scraping.stalenessMs (default false). Listed before stale-metrics-filter, this "
        "keeps a prefix's holders through a late scrape and otherwise leaves affinity to the "
        "scorers.",
    )
    cold_balance: bool = Field(
        default=False,
        description="A prompt of at least minMatchBlocks blocks that no endpoint holds even "
        "minMatchBlocks of (a new shared prefix) goes to the candidates this filter has placed "
        "the fewest new prefixes on, unless they are out of balance (default false).",
    )
    cold_slack: float = Field(
        default=0.5,
        ge=0,
        description="With coldBalance, keep the candidates with at most this many placements "
        "more than the least placed (default 0.5: only the least placed; 1.0 lets the load "
        "scorers choose between the least and the least + 1).",
    )
    cold_half_life_s: float = Field(
        default=60.0,
        gt=0,
        description="Half-life of the per-endpoint count of new prefixes placed (default 60 s), "
        "so that placements long evicted stop counting.",
    )


@dataclass(frozen=True, slots=True)
class PrefixHolders:
    """Who *holds* a prompt: the endpoints a prefix index credits with at least `min_ratio` of
    it and at least `min_blocks` of the index's blocks (the one rule of this filter and of the
    `stale-metrics-filter`'s holder grace)."""

    prefix: PrefixCacheScorer
    min_ratio: float = 0.3
    min_blocks: int = 32

    def of(
        self, cycle: CycleState, request: LLMRequest, candidates: Iterable[EndpointState]
    ) -> set[str]:
        """The ip:port of every candidate holding the prompt (empty when none does)."""
        matched = self.prefix.matched(cycle, request)
        if not matched:
            return set()
        need = max(
            self.min_ratio * len(request.prompt), self.min_blocks * self.prefix.params.block_size
        )
        return {key for s in candidates if matched.get(key := s.endpoint.hostport, 0) >= need}


class PrefixAffinityFilter(NamedPlugin):
    """Filter narrowing the candidates to the prompt's holders while the load is balanced."""

    __slots__ = ("_cold_key", "_placed", "holders", "params", "staleness_s")

    def __init__(
        self,
        typed_name: TypedName,
        params: PrefixAffinityParams,
        prefix: PrefixCacheScorer | None,
        staleness_s: float,
    ) -> None:
        super().__init__(typed_name)
        self.params = params
        self.holders = (
            None
            if prefix is None
            else PrefixHolders(prefix, params.min_match_ratio, params.min_match_blocks)
        )
        self.staleness_s = staleness_s
        self._cold_key = f"prefix-affinity-cold/{typed_name.name}"
        # ip:port -> (decayed count of new prefixes placed there, time of that count)
        self._placed: dict[str, tuple[float, float]] = {}

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        holders = self.holders
        if holders is None or len(candidates) < 2:
            return candidates
        keys = holders.of(cycle, request, candidates)
        held = [s for s in candidates if s.endpoint.hostport in keys]
        p = self.params
        if not held and p.cold_balance and self._is_cold(cycle, request, holders):
            cycle.put(self._cold_key, True)
            return self._balanced(candidates, self._least_placed(cycle.now, candidates))
        if not held or len(held) == len(candidates):
            return candidates
        if p.only_when_stale:
            fresh_since = cycle.now - self.staleness_s
            if all(s.metrics.updated_at >= fresh_since for s in held):
                return candidates
        return self._balanced(candidates, held)

    def _balanced(
        self, candidates: Sequence[EndpointState], kept: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        """`kept`, unless its least loaded is out of balance with the least loaded candidate."""
        p = self.params
        kept_min = min(_load(s) for s in kept)
        all_min = min(_load(s) for s in candidates)
        if (
            kept_min - all_min > p.balance_abs_threshold
            and kept_min > p.balance_rel_threshold * all_min
        ):
            return candidates
        return kept

    @staticmethod
    def _is_cold(cycle: CycleState, request: LLMRequest, holders: PrefixHolders) -> bool:
        """A long prompt of which no endpoint is known to cache even `min_blocks` blocks."""
        prefix = holders.prefix
        if len(prefix.hashes(cycle, request)) < holders.min_blocks:
            return False
        matched = prefix.matched(cycle, request)
        return max(matched.values(), default=0) < holders.min_blocks * prefix.params.block_size

    def _count(self, key: str, now: float) -> float:
        count, at = self._placed.get(key, (0.0, now))
        return count * math.exp(-_LN2 * max(0.0, now - at) / self.params.cold_half_life_s)

    def _least_placed(self, now: float, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        """The candidates within `coldSlack` placements of the fewest new prefixes placed."""
        counts = [self._count(s.endpoint.hostport, now) for s in candidates]
        limit = min(counts) + self.params.cold_slack
        return [s for s, c in zip(candidates, counts, strict=True) if c <= limit]

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        """Count a new prefix's placement on the endpoint picked for it."""
        if result.targets and cycle.get(self._cold_key):
            key = result.targets[0].endpoint.hostport
            self._placed[key] = (self._count(key, cycle.now) + 1.0, cycle.now)

    def forget_endpoints(self, keep: set[str]) -> None:
        for key in [k for k in self._placed if k not in keep]:
            del self._placed[key]


def _load(s: EndpointState) -> int:
    """Requests at the endpoint: scraped running + waiting, plus those sent since the scrape."""
    m = s.metrics
    return m.running + m.waiting + s.unseen_requests
