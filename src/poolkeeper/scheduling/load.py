"""Effective load of an endpoint: scraped metrics plus what this router sent since the scrape.

Scraped gauges lag: a burst of decisions between two scrapes would all see the same idle pod and
herd onto it. The in-flight tracker counts, per endpoint, the requests (and their tokens) sent
after the endpoint's metrics were taken (`unseen_*`); the helpers here add them in, so every
load-based filter and scorer treats a just-sent request as already queued.
"""

from __future__ import annotations

from poolkeeper.datastore.endpoint import EndpointState


def effective_waiting(state: EndpointState, count_unseen: bool = True) -> int:
    """Waiting queue as scraped, plus requests sent since the scrape (they queue first)."""
    if count_unseen:
        return state.metrics.waiting + state.unseen_requests
    return state.metrics.waiting


def effective_running(state: EndpointState, count_unseen: bool = True) -> int:
    if count_unseen:
        return state.metrics.running + state.unseen_requests
    return state.metrics.running


def effective_kv(state: EndpointState, count_unseen: bool = True) -> float:
    """KV-cache utilisation (0..1), plus the unseen tokens' share when the capacity is known.

    Capacity is `num_gpu_blocks * block_size` tokens (from vLLM's cache_config_info); without
    it the scraped value is returned unchanged. The result is capped at 1.0.
    """
    m = state.metrics
    kv = m.kv_cache_usage
    if count_unseen and state.unseen_tokens and m.num_gpu_blocks and m.block_size:
        kv += state.unseen_tokens / (m.num_gpu_blocks * m.block_size)
    if kv <= 0.0:
        return 0.0
    if kv < 1.0:
        return kv
    return 1.0  # full, or NaN from a broken exporter: unknown counts as full


def endpoint_saturation(
    state: EndpointState,
    *,
    now: float,
    queue_threshold: float,
    kv_threshold: float,
    staleness_s: float,
    count_unseen: bool = True,
) -> float:
    """Per-endpoint saturation `max(queue / queueThreshold, kv / kvThreshold)`; stale = 1.0.

    1.0 means "at the threshold"; the value is unbounded above. Shared by the admission
    detector and the saturation filter so both agree on what "saturated" means.
    """
    if state.age(now) > staleness_s:
        return 1.0
    q = effective_waiting(state, count_unseen) / queue_threshold if queue_threshold > 0 else 0.0
    kv = effective_kv(state, count_unseen) / kv_threshold if kv_threshold > 0 else 0.0
    return q if q > kv else kv
