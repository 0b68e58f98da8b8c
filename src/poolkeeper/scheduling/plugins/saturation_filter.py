"""The saturation filter: drops stale or overloaded endpoints, fails open.

Owns `saturation-filter` and its parameters, the full-batch rule included (`maxNumSeqs`, or the
batch learned per endpoint by `fullbatch.py`); `missgate.py` extends it (`missGate`). It reads
the effective load (scraped + unseen in-flight, see `load.py`) unless `countUnseen` is false.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_kv, saturations
from poolkeeper.scheduling.interfaces import CycleState, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.plugins.filters import LoadParams
from poolkeeper.scheduling.plugins.fullbatch import FullBatches
from poolkeeper.scheduling.plugins.stale_filter import ALL_FRESH
from poolkeeper.scheduling.types import LLMRequest


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
        done = cycle.get(ALL_FRESH)
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
            full = self.batches.full(fresh, cycle)
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
