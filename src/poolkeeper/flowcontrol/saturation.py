"""SaturationDetector: how loaded the pool is, from fresh metrics and in-flight counts.

Per endpoint: `max(queue / queueDepthThreshold, kv / kvCacheUtilThreshold)` (queue and KV
include requests sent since the last scrape), or 1.0 when its metrics are older than the
gateway's one freshness setting (`spec.scraping.stalenessMs`). Pool saturation = the average
over the pool's endpoints (GIE v1.5's utilization detector); 1.0 means "the average endpoint
is at its thresholds".

All endpoints stale is a special case: the detector then knows nothing, and by default fails
open (`allStalePolicy: admit`) instead of reporting 1.0: a single-endpoint pool whose scrapes
lag would otherwise shed or stall every request (llm-d #2408). Pools where only some endpoints
are stale still count those as 1.0 (GIE #1497: stale pods must not look idle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.datastore.endpoint import DEFAULT_STALENESS_S, EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.flowcontrol.admission import AdmissionConfig


@dataclass(frozen=True, slots=True)
class SaturationReport:
    """Pool saturation and what it is based on."""

    saturation: float  # average per-endpoint saturation; 0.0 when nothing is known (see below)
    endpoints: int
    stale: int

    @property
    def all_stale(self) -> bool:
        return self.endpoints > 0 and self.stale == self.endpoints


class SaturationDetector:
    """Computes pool saturation from endpoint snapshots. Pure; `now` is injected."""

    __slots__ = ("config", "staleness_s")

    def __init__(
        self, config: AdmissionConfig | None = None, *, staleness_s: float = DEFAULT_STALENESS_S
    ) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self.staleness_s = staleness_s

    def assess(self, states: Sequence[EndpointState], now: float) -> SaturationReport:
        """The report; with no endpoints, saturation 1.0 (nothing can take a request)."""
        if not states:
            return SaturationReport(1.0, 0, 0)
        c = self.config
        values = saturations(
            states,
            now=now,
            staleness_s=self.staleness_s,
            queue_threshold=c.queue_depth_threshold,
            kv_threshold=c.kv_cache_util_threshold,
            count_unseen=c.count_unseen,
        )
        stale = values.count(STALE)
        total = sum(v for v in values if v != STALE) + stale  # a stale endpoint counts 1.0
        return SaturationReport(total / len(values), len(values), stale)

    def saturation(self, states: Sequence[EndpointState], now: float) -> float:
        """Pool saturation as upstream defines it (stale endpoints count 1.0; empty = 1.0)."""
        return self.assess(states, now).saturation

    def is_saturated(
        self, states: Sequence[EndpointState], now: float, level: float | None = None
    ) -> bool:
        """Saturation >= `level` (default `sheddableSaturationLevel`), with the all-stale rule:
        when every endpoint is stale the answer follows `allStalePolicy` (admit = False)."""
        report = self.assess(states, now)
        if report.all_stale:
            return self.config.all_stale_policy == "shed"
        limit = self.config.sheddable_saturation_level if level is None else level
        return report.saturation >= limit
