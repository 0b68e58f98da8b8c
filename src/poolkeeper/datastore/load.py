"""Effective load of an endpoint: scraped metrics plus what this router sent since the scrape.

Scraped gauges lag: a burst of decisions between two scrapes would all see the same idle pod and
herd onto it. The in-flight tracker counts, per endpoint, the requests (and their tokens) sent
after the endpoint's metrics were taken (`unseen_*`); the helpers here add them in, so every
load-based filter and scorer treats a just-sent request as already queued. `saturations` is
the one definition of endpoint saturation (admission's pool signal, the saturation filter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from poolkeeper.datastore.endpoint import EndpointState


def effective_waiting(state: EndpointState, count_unseen: bool = True) -> int:
    """Waiting queue as scraped, plus requests sent since the scrape (they queue first) that
    have not answered yet (`EndpointState.unseen_answered`: those are running)."""
    if count_unseen:
        return state.metrics.waiting + state.unseen_requests - state.unseen_answered
    return state.metrics.waiting


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


# The saturation of an endpoint whose metrics are stale or never came: it cannot be judged.
STALE: Final = math.inf


def saturations(
    states: Sequence[EndpointState],
    *,
    now: float,
    staleness_s: float,
    queue_threshold: float,
    kv_threshold: float,
    count_unseen: bool = True,
    adapter: str | None = None,
) -> list[float]:
    """Per-endpoint saturation, in order: `max(queue / queueThreshold, kv / kvThreshold)`.

    `adapter`: the LoRA adapter the request needs, when the question is "is there room for
    this request" (flow control's headroom). On an endpoint that runs it and has none of its
    requests waiting, the scraped queue is other adapters' requests, which vLLM's scheduler
    skips while their adapters find no slot (the "deferred" requests of a LoRA fleet): a
    request for the running adapter joins the batch past them, so there the queue counts only
    the requests sent since the scrape. Without it a fleet whose queues are full of deferred
    requests looked saturated for every adapter, and flow control held requests the servers
    had room for (multi-LoRA at 0.9x: 543 refused on one seed; docs/flowcontrol.md).

    Queue and KV include what was sent since the scrape (`count_unseen`; the queue leaves out
    the unseen requests that already answered, they run); an out-of-range KV
    is clamped to 0..1 (NaN counts as full). 1.0 means "at the threshold" and the value is
    unbounded above; `STALE` (infinity) marks metrics older than `staleness_s` or never
    scraped, and each caller decides what that means (admission counts it 1.0, the saturation
    filter drops it). The one definition of saturation, shared by the admission detector and
    the saturation filter; one inlined loop, because both run over the whole pool per request.
    """
    fresh_since = now - staleness_s
    out: list[float] = []
    append = out.append
    for s in states:
        m = s.metrics
        u = m.updated_at
        if u <= 0.0 or u < fresh_since:
            append(STALE)
            continue
        if (
            adapter is not None
            and adapter in m.active_adapters
            and adapter not in m.waiting_adapters
        ):
            q = (s.unseen_requests - s.unseen_answered if count_unseen else 0) / queue_threshold
        else:
            q = (
                m.waiting + s.unseen_requests - s.unseen_answered if count_unseen else m.waiting
            ) / queue_threshold
        kv = m.kv_cache_usage
        if count_unseen and s.unseen_tokens:
            kv = effective_kv(s)
        elif not 0.0 <= kv <= 1.0:
            kv = 0.0 if kv < 0.0 else 1.0  # out of range, or NaN (unknown: full)
        kv /= kv_threshold
        append(q if q > kv else kv)
    return out
