"""Built-in filters: queue and KV bands, LoRA soft affinity, v0.3 criticality gates, saturation.

Every load-based filter reads the effective load (scraped + unseen in-flight, see `load.py`)
unless its `countUnseen` parameter is false (the parity presets turn it off).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Final

from pydantic import Field

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_kv, effective_waiting, saturations
from poolkeeper.errors import RequestShed
from poolkeeper.scheduling.interfaces import CycleState, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.fullbatch import FullBatches
from poolkeeper.scheduling.plugins.prefix_affinity import PrefixHolders
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest


class LoadParams(PluginParams):
    count_unseen: bool = Field(
        default=True,
        description="Add requests/tokens sent since the last scrape to the scraped load "
        "(default true; false reproduces upstream, which only sees scraped metrics).",
    )


class LowQueueParams(LoadParams):
    threshold: float = Field(
        default=128,
        ge=0,
        description="Waiting-queue limit in requests (default 128, GIE v0.3 "
        "QUEUING_THRESHOLD_LORA).",
    )
    inclusive: bool = Field(
        default=True,
        description="Keep queue <= threshold (true, v0.5 plugin) or < threshold "
        "(false, v0.1-v0.3 tree). Default true.",
    )


class LowQueueFilter(NamedPlugin):
    """Endpoints whose waiting queue is under a threshold (the LoRA-queueing gate of v0.3)."""

    __slots__ = ("params",)

    def __init__(self, typed_name: TypedName, params: LowQueueParams) -> None:
        super().__init__(typed_name)
        self.params = params

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        t, cu = self.params.threshold, self.params.count_unseen
        if self.params.inclusive:
            return [s for s in candidates if effective_waiting(s, cu) <= t]
        return [s for s in candidates if effective_waiting(s, cu) < t]


def _band(candidates: Sequence[EndpointState], values: list[float]) -> list[EndpointState]:
    """Keep values in the lowest 1/N of [min, max] (N = number of candidates), as GIE does:
    a band rather than only the minimum, so near-equal endpoints all stay in play."""
    if not candidates:
        return []
    lo, hi = min(values), max(values)
    limit = lo + (hi - lo) / len(values)
    return [s for s, v in zip(candidates, values, strict=True) if v <= limit]


class _LeastLoadFilter(NamedPlugin):
    """Endpoints in the lowest 1/N band of a per-endpoint load; subclasses say which (`load`)."""

    __slots__ = ("count_unseen",)

    def __init__(self, typed_name: TypedName, params: LoadParams) -> None:
        super().__init__(typed_name)
        self.count_unseen = params.count_unseen

    @staticmethod
    def load(state: EndpointState, count_unseen: bool) -> float:
        raise NotImplementedError

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        load, cu = self.load, self.count_unseen
        return _band(candidates, [load(s, cu) for s in candidates])


class LeastQueueFilter(_LeastLoadFilter):
    """Endpoints in the lowest 1/N band of waiting-queue sizes."""

    __slots__ = ()
    load = staticmethod(effective_waiting)


class LeastKvCacheFilter(_LeastLoadFilter):
    """Endpoints in the lowest 1/N band of KV-cache utilisation."""

    __slots__ = ()
    load = staticmethod(effective_kv)


class LoraAffinityParams(PluginParams):
    threshold: float = Field(
        default=0.999,
        ge=0,
        le=1,
        description="Probability of choosing the endpoints that already "
        "have the adapter (active or waiting) over those with a free adapter slot (default "
        "0.999, GIE LORA_AFFINITY_THRESHOLD).",
    )


class LoraAffinityFilter(NamedPlugin):
    """LoRA soft affinity: prefer endpoints with the adapter loaded, sometimes free slots.

    Affinity = the target model is the endpoint's base model (`served_model`) or among its
    active or waiting adapters; available = fewer adapters than `max_adapters`. With both
    groups present the affinity group wins with probability `threshold` (so new adapters still
    spread); else whichever group exists.

    Deliberately unlike upstream, the base model counts as loaded (it always is): upstream
    treats a base-model request as an absent adapter, which narrows it to the endpoints with a
    free adapter slot and so herds base-model traffic onto the least adapter-busy servers.
    Where no endpoint reports a served model the upstream rule applies unchanged.
    """

    __slots__ = ("rng", "threshold")

    def __init__(
        self, typed_name: TypedName, params: LoraAffinityParams, rng: random.Random
    ) -> None:
        super().__init__(typed_name)
        self.threshold = params.threshold
        self.rng = rng

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        model = request.target_model
        affinity: list[EndpointState] = []
        available: list[EndpointState] = []
        for s in candidates:
            m = s.metrics
            if model == m.served_model or model in m.active_adapters or model in m.waiting_adapters:
                affinity.append(s)
            elif len(m.active_adapters | m.waiting_adapters) < m.max_adapters:
                available.append(s)
        if affinity and available:
            return affinity if self.rng.random() < self.threshold else available
        return affinity or available


class CriticalRequestFilter(NamedPlugin):
    """Passes every endpoint iff the request is Critical (the first node of the v0.3 tree)."""

    __slots__ = ()

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        return list(candidates) if request.criticality is Criticality.CRITICAL else []


class CapacityParams(LoadParams):
    queue_threshold: float = Field(
        default=5,
        ge=0,
        description="Waiting-queue limit in requests (default 5, GIE QUEUE_THRESHOLD_CRITICAL).",
    )
    kv_cache_threshold: float = Field(
        default=0.8,
        ge=0,
        le=1,
        description="KV-cache utilisation limit, 0..1 (default 0.8, GIE KV_CACHE_THRESHOLD).",
    )


class HasCapacityFilter(NamedPlugin):
    """Endpoints with queue <= queueThreshold and KV <= kvCacheThreshold (v0.3's gate for
    non-critical requests: `hasCapacityForSheddable`)."""

    __slots__ = ("params",)

    def __init__(self, typed_name: TypedName, params: CapacityParams) -> None:
        super().__init__(typed_name)
        self.params = params

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        p = self.params
        q, kv, cu = p.queue_threshold, p.kv_cache_threshold, p.count_unseen
        return [
            s for s in candidates if effective_waiting(s, cu) <= q and effective_kv(s, cu) <= kv
        ]


class DropRequestFilter(NamedPlugin):
    """Sheds the request with 429 (the DROP leaf of the v0.3 tree)."""

    __slots__ = ()

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        raise RequestShed(
            f"request {request.request_id} for model {request.model!r} "
            f"({request.criticality}) shed: no endpoint has capacity"
        )


class SaturationFilterParams(LoadParams):
    queue_depth_threshold: float = Field(
        default=5,
        gt=0,
        description="Queue depth at per-endpoint saturation 1.0, requests (default 5).",
    )
    kv_cache_util_threshold: float = Field(
        default=0.8, gt=0, le=1, description="KV utilisation at saturation 1.0 (default 0.8)."
    )
    headroom: float = Field(
        default=0.5,
        ge=0,
        description="Keep endpoints with saturation < 1 + headroom (default 0.5).",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="The engines' batch slots (vLLM --max-num-seqs): an endpoint's queue "
        "counts only while it runs that many requests (default none: always counts).",
    )
    learn_max_num_seqs: bool = Field(
        default=False,
        description="Without maxNumSeqs, learn each endpoint's batch from its gauges and count "
        "its queue only while that batch is full (default false).",
    )
    miss_gate: bool = Field(
        default=False,
        description="With maxNumSeqs or learnMaxNumSeqs: of the endpoints dropped for the "
        "queue on their full batch, drop only those holding the request's prefix (by "
        "prefixScorer's index) whose expected cost (the wait for a slot plus the uncached "
        "prompt's prefill at the measured speed) is above every kept endpoint's; none before "
        "the costs are measured (missgate.py). Default false.",
    )
    prefix_scorer: str = Field(
        default="",
        description="With missGate: the prefix-cache-scorer whose index says who holds the "
        "prompt (required there).",
    )


class SaturationFilter(NamedPlugin):
    """Drops stale or overloaded endpoints; fails open (keeps all) if none would remain.

    Overloaded = `max(queue / queueDepthThreshold, kv / kvCacheUtilThreshold) >= 1 + headroom`
    (a pod exactly at the limit is dropped, as upstream's utilization-detector filter does);
    with `maxNumSeqs`, the queue term counts only on an endpoint whose batch is full (running,
    plus its unseen requests that answered, at least that many): on an engine with a free slot
    a waiting request starts at the next step, so its queue is a long step's (a 2,000-token
    prefill), not a full batch's, and dropping it there re-prefills the prompt elsewhere
    (`learnMaxNumSeqs`: the batch learned per endpoint, `fullbatch.py`);
    stale = metrics older than `staleness_s`, the gateway's `spec.scraping.stalenessMs` (GIE
    #1497: stale idle-looking pods attract traffic). Failing open matters for single-pod pools
    whose scrapes lag (llm-d #2408).
    """

    __slots__ = ("batches", "limit", "params", "staleness_s")

    def __init__(
        self, typed_name: TypedName, params: SaturationFilterParams, staleness_s: float
    ) -> None:
        super().__init__(typed_name)
        self.params = params
        self.limit = 1.0 + params.headroom
        self.staleness_s = staleness_s
        learn = params.learn_max_num_seqs and params.max_num_seqs is None
        self.batches = FullBatches() if learn else None

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        p = self.params
        limit = self.limit  # `saturations` marks stale endpoints infinite: above any limit
        if p.max_num_seqs is None and self.batches is None:
            values = self.saturations(cycle, candidates)
            under = [s for s, v in zip(candidates, values, strict=True) if v < limit]
            return under if under and len(under) < len(candidates) else candidates
        return self._batch_filter(cycle, request, candidates)

    def saturations(self, cycle: CycleState, states: Sequence[EndpointState]) -> list[float]:
        """`states`' saturations by this filter's thresholds (`STALE` where stale)."""
        p = self.params
        return saturations(
            states,
            now=cycle.now,
            staleness_s=self.staleness_s,
            queue_threshold=p.queue_depth_threshold,
            kv_threshold=p.kv_cache_util_threshold,
            count_unseen=p.count_unseen,
        )

    def _batch_filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        """With a batch size the queue counts only on a full batch: an endpoint is dropped
        when stale, for its KV, or (`queued`) for its queue on a full batch. Its saturation
        decides only there, so `saturations` is worked out for the full batches alone (at
        1,000 endpoints it was two thirds of the filter's time), with the same stale rule."""
        p = self.params
        limit = self.limit
        fresh_since = cycle.now - self.staleness_s
        fresh: Sequence[EndpointState]
        done = cycle.get(_ALL_FRESH)
        # The same list, all scraped since a time no earlier than this filter's limit: a
        # stale-metrics filter before this one found them all fresh (the default's order).
        if (
            isinstance(done, tuple)
            and done[0] is candidates
            and done[1] == len(candidates)
            and done[2] >= fresh_since
        ):
            fresh = candidates
        else:
            fresh = [
                s for s in candidates if not ((u := s.metrics.updated_at) <= 0.0 or u < fresh_since)
            ]
        # Every fresh scrape is read, KV-dropped or not: it teaches the learned batch.
        slots = p.max_num_seqs
        if slots is not None:
            full = [s for s in fresh if s.metrics.running + s.unseen_answered >= slots]
        else:
            assert self.batches is not None  # (`filter` comes here with one or the other)
            full = self.batches.full(fresh)
        kept = fresh
        kv_limit = limit * p.kv_cache_util_threshold
        # `effective_kv` is at most 1: above that no endpoint goes for its KV (the default's
        # limit is 2), and the test is skipped, a call per candidate.
        if kv_limit <= 1.0:
            cu = p.count_unseen
            kept = [s for s in fresh if effective_kv(s, cu) < kv_limit]
            full = [s for s in full if effective_kv(s, cu) < kv_limit]
        queued: list[EndpointState] = []
        if full:
            values = self.saturations(cycle, full)
            queued = [s for s, v in zip(full, values, strict=True) if v >= limit]
        if queued:
            gone = {id(s) for s in queued}
            kept = [s for s in kept if id(s) not in gone]
        if not kept or len(kept) == len(candidates):
            return candidates
        return self._kept(cycle, request, candidates, kept, queued)

    def _kept(
        self,
        cycle: CycleState,
        request: LLMRequest,
        candidates: Sequence[EndpointState],
        kept: Sequence[EndpointState],
        queued: list[EndpointState],
    ) -> Sequence[EndpointState]:
        """What passes when some but not all candidates are overloaded; `queued`: those
        dropped only for the queue on their full batch (`missGate` keeps some of them:
        missgate.py)."""
        return kept

    def _full(self, state: EndpointState) -> bool:
        """Whether `state`'s batch is full (running, plus its unseen requests that answered,
        at least `maxNumSeqs` or the learned batch; False until one is learned)."""
        slots = self.params.max_num_seqs
        if slots is None and self.batches is not None:
            slots = self.batches.slots(state)
        return slots is not None and state.metrics.running + state.unseen_answered >= slots


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
_ALL_FRESH: Final = f"{__name__}.all-fresh"


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

    __slots__ = ("grace_s", "holders", "staleness_s")

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

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        fresh_since = cycle.now - self.staleness_s
        # `updated_at` 0.0 (never scraped) is below any `fresh_since` of a running clock;
        # the explicit test keeps that true for clocks that start near zero.
        kept = [s for s in candidates if (u := s.metrics.updated_at) >= fresh_since and u > 0.0]
        if len(kept) == len(candidates):
            # (the saturation filter after this one need not test them again)
            cycle.put(_ALL_FRESH, (candidates, len(candidates), fresh_since))
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
