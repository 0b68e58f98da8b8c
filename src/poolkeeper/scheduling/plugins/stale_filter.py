"""The stale-metrics filter: drops endpoints whose metrics are stale or were never scraped.

Owns `stale-metrics-filter`, its parameters, its grace for the request's prefix holders and
LoRA adapter runners, and the cycle-state mark (`ALL_FRESH`) that tells the saturation filter
after it that every candidate is fresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pydantic import Field

from poolkeeper.datastore.columns import MIN_CACHED, Column
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.prefix_affinity import PrefixHolders
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest


class StaleMetricsParams(PluginParams):
    prefix_scorer: str = Field(
        default="",
        description="Name of a prefix-cache-scorer: an endpoint holding the request's prompt "
        'by its index is kept while its metrics are at most holderGraceMs old (default "": '
        "off, every stale endpoint is dropped).",
    )
    holder_grace_ms: float = Field(
        default=1000,
        ge=0,
        description="How old a holder's metrics may be and the holder still kept (default "
        "1000 ms; only with prefixScorer).",
    )
    min_match_ratio: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="Share of the prompt an endpoint must probably cache to hold it "
        "(default 0.3, as prefix-affinity-filter).",
    )
    min_match_blocks: int = Field(
        default=32,
        ge=1,
        description="Blocks of the prefix scorer an endpoint must probably cache to hold it "
        "(default 32, as prefix-affinity-filter).",
    )


# The cycle state's key of (candidates, their count, fresh_since) where the stale-metrics filter
# found every candidate scraped since `fresh_since`: a module path, which no plugin instance's
# name (the keys plugins use) can be.
ALL_FRESH: Final = f"{__name__}.all-fresh"


# How late a scrape may be and a server running the request's LoRA adapter still kept, when
# no fresh server runs it (adapters load and unload in seconds, not scrape intervals).
ADAPTER_GRACE_S = 1.0


class StaleMetricsFilter(NamedPlugin):
    """Drops endpoints whose metrics are stale or were never scraped; fails open.

    Stale = older than `staleness_s`, the gateway's `spec.scraping.stalenessMs`. A stale
    endpoint may look idle (GIE #1497) or be gone; it is skipped while any endpoint has fresh
    metrics. If none has, all are kept: a lagging scraper must not fail the pool (llm-d #2408).
    Cheaper than `saturation-filter` (no load test).

    With `holders` (the `prefixScorer` parameter), an endpoint that holds the request's prompt
    and whose scrape is merely late (no older than `grace_s`) stays. Why: on a loaded machine
    scrapes run late together, and dropping a prefix's holder for a scrape 4 ms past the limit
    sends its request to a server that must prefill the whole shared prefix again (measured
    live: docs/notes/2026-12-06-live-routing-fourth-round.md). Its load is not blind meanwhile:
    the requests sent since its scrape are counted. Likewise, always: the servers running the
    request's LoRA adapter stay when they are all late (at most `ADAPTER_GRACE_S`).
    """

    __slots__ = ("grace_s", "holders", "scraped", "staleness_s")

    def __init__(
        self,
        typed_name: TypedName,
        staleness_s: float,
        holders: PrefixHolders | None = None,
        grace_s: float = 0.0,
    ) -> None:
        super().__init__(typed_name)
        self.staleness_s = staleness_s
        self.holders = holders
        self.grace_s = grace_s
        # Each candidate's scrape time, kept between decisions (`columns.py`): one `min` then
        # says whether all are fresh (NaN kept as -inf: never fresh, as `>=` says of NaN).
        self.scraped: Column[float] = Column(_scrape_times, _scrape_time)

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        fresh_since = cycle.now - self.staleness_s
        if len(candidates) >= MIN_CACHED:
            oldest = min(self.scraped.values(cycle, candidates))
            if oldest >= fresh_since and oldest > 0.0:  # (the test below, of every candidate)
                cycle.put(ALL_FRESH, (candidates, len(candidates), fresh_since))
                return candidates
        # `updated_at` 0.0 (never scraped) is below any `fresh_since` of a running clock;
        # the explicit test keeps that true for clocks that start near zero.
        kept = [s for s in candidates if (u := s.metrics.updated_at) >= fresh_since and u > 0.0]
        if len(kept) == len(candidates):
            # (the saturation filter after this one need not test them again)
            cycle.put(ALL_FRESH, (candidates, len(candidates), fresh_since))
            return candidates
        if not kept:
            return candidates
        adapter = request.target_model
        if adapter and not any(adapter in s.metrics.active_adapters for s in kept):
            # Every server running the request's LoRA adapter is late: keep those late by at
            # most ADAPTER_GRACE_S. Elsewhere the request waits for an adapter slot, behind a
            # whole batch where the fleet has one slot per server (an e2e timeout under load).
            late_since = cycle.now - max(self.grace_s, ADAPTER_GRACE_S)
            runners = {
                id(s)
                for s in candidates
                if adapter in s.metrics.active_adapters
                and late_since <= s.metrics.updated_at < fresh_since
            }
            if runners:
                fresh = {id(s) for s in kept}
                kept = [s for s in candidates if id(s) in fresh or id(s) in runners]
        if self.holders is not None and self.grace_s > self.staleness_s:
            late_since = cycle.now - self.grace_s
            late = [
                s
                for s in candidates
                if late_since <= (u := s.metrics.updated_at) < fresh_since and u > 0.0
            ]
            held = self.holders.of(cycle, request, late) if late else set()
            if held:
                fresh = {id(s) for s in kept}
                return [s for s in candidates if id(s) in fresh or s.endpoint.hostport in held]
        return kept


def _scrape_times(candidates: Sequence[EndpointState]) -> list[float]:
    return [u if (u := s.metrics.updated_at) == u else _NEVER for s in candidates]


def _scrape_time(s: EndpointState) -> float:
    u = s.metrics.updated_at
    return u if u == u else _NEVER


_NEVER: Final = float("-inf")
