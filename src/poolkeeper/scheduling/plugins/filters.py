"""Built-in filters: queue and KV bands, LoRA soft affinity, v0.3 criticality gates.

Every load-based filter reads the effective load (scraped + unseen in-flight, see `load.py`)
unless its `countUnseen` parameter is false (the parity presets turn it off); `LoadParams`, that
parameter, is shared with the saturation filter (`saturation_filter.py`) and the scorers. The
stale-metrics filter lives in `stale_filter.py`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import Field

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_kv, effective_waiting
from poolkeeper.errors import RequestShed
from poolkeeper.scheduling.interfaces import CycleState, TypedName
from poolkeeper.scheduling.plugins.base import NamedPlugin
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
