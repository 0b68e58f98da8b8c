"""Headroom: may a request of a band be sent to this pool now?

Yes when some candidate endpoint's saturation (`datastore.load.saturations`, the one
definition, with the thresholds, in-flight counting and freshness of admission's
`SaturationDetector`; a band may set its own thresholds) is below the band's
`saturationLimit`. Per endpoint, not the pool
average: a request is never held while one eligible endpoint has room. Stale endpoints have no
headroom; when every endpoint is stale the detector knows nothing and `allStalePolicy`
decides (`admit`, the default: fail open, as admission does). No endpoints: yes, so the
scheduler answers 503 at once instead of the request waiting for its TTL. For a band with
`placement: headroom` (Sheddable), `within` narrows the candidates of a dispatched request to
the endpoints with headroom; other bands leave placement to the scheduler. `adapter` (the
request's target model) lets an endpoint that already runs that LoRA adapter count only what
can hold the request up there (`saturations`).
"""

from __future__ import annotations

from collections.abc import Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.flowcontrol.config import BandConfig, Placement
from poolkeeper.flowcontrol.saturation import SaturationDetector


class Headroom:
    __slots__ = ("detector",)

    def __init__(self, detector: SaturationDetector) -> None:
        self.detector = detector

    def fits(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None = None,
    ) -> bool:
        if not states:
            return True
        values = self._values(states, band, now, adapter)
        limit = band.saturation_limit
        if any(v < limit for v in values):
            return True
        return all(v == STALE for v in values) and self.detector.config.all_stale_policy == "admit"

    def room(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None = None,
    ) -> list[EndpointState] | None:
        """`fits` and `within` in one pass: the endpoints to schedule on, or None (no room)."""
        if not states:
            return list(states)
        values = self._values(states, band, now, adapter)
        limit = band.saturation_limit
        below = [s for s, v in zip(states, values, strict=True) if v < limit]
        if below:
            if band.placement is Placement.SCHEDULER or len(below) == len(states):
                return list(states)
            return below
        if all(v == STALE for v in values) and self.detector.config.all_stale_policy == "admit":
            return list(states)
        return None

    def within(
        self, states: Sequence[EndpointState], band: BandConfig, now: float
    ) -> Sequence[EndpointState]:
        """Where a dispatched request of `band` may go: every candidate for `scheduler`
        placement; for `headroom` placement the endpoints below the limit, or all of them when
        none is (fail open: the caller decided to dispatch), so the scheduler's prefix
        affinity cannot pile the band's work onto an endpoint past its limit."""
        if band.placement is Placement.SCHEDULER:
            return states
        values = self._values(states, band, now)
        below = [s for s, v in zip(states, values, strict=True) if v < band.saturation_limit]
        return below if below and len(below) < len(states) else states

    def _values(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None = None,
    ) -> list[float]:
        c = self.detector.config
        queue = band.queue_depth_threshold
        kv = band.kv_cache_util_threshold
        return saturations(
            states,
            now=now,
            staleness_s=self.detector.staleness_s,
            queue_threshold=c.queue_depth_threshold if queue is None else queue,
            kv_threshold=c.kv_cache_util_threshold if kv is None else kv,
            count_unseen=c.count_unseen,
            adapter=adapter,
        )
