"""AdmissionController: admit or shed one request by criticality and pool saturation.

The gate's policy when flow control is off (`flowControl.enabled: false`): nothing waits, a
request is admitted or shed (429) at once.

    Critical   always admitted (it queues on the model servers, never shed here)
    Standard   shed only when saturation >= standardOverloadLevel (default 8.0)
    Sheddable  shed when saturation >= sheddableSaturationLevel (default 1.0)

An empty pool is not shedding: the controller admits, and the scheduler answers 503
(NoReadyEndpoint), so clients can tell "overloaded, retry later" (429) from "nothing to serve
this" (503). Queueing instead of shedding is the dispatcher's (`dispatcher.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.columns import MIN_CACHED, Column, LocalScratch
from poolkeeper.datastore.endpoint import DEFAULT_STALENESS_S, EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.errors import RequestShed
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.saturation import SaturationDetector, SaturationReport


class Admittable(Protocol):
    """What admission reads of a request (the scheduler's `LLMRequest` is one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def criticality(self) -> Criticality: ...


class AdmissionDecision(StrEnum):
    ADMIT = "admit"
    SHED = "shed"


@dataclass(frozen=True, slots=True)
class AdmissionOutcome:
    decision: AdmissionDecision
    reason: str
    report: SaturationReport | None = None


class AdmissionController:
    """Applies the criticality rules above. Pure; `now` is injected."""

    __slots__ = ("_saturations", "_scraped", "config", "detector")

    def __init__(
        self, config: AdmissionConfig | None = None, *, staleness_s: float = DEFAULT_STALENESS_S
    ) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self.detector = SaturationDetector(self.config, staleness_s=staleness_s)
        # Kept between requests (`datastore/columns.py`): each endpoint's saturation as if
        # fresh (STALE only where never scraped) and its scrape time (NaN as -inf: stale).
        c = self.config
        qt, kvt, cu = c.queue_depth_threshold, c.kv_cache_util_threshold, c.count_unseen

        def fresh(states: Sequence[EndpointState]) -> list[float]:
            return saturations(
                states, now=0.0, staleness_s=math.inf, queue_threshold=qt, kv_threshold=kvt,
                count_unseen=cu,
            )  # fmt: skip

        self._saturations: Column[float] = Column(fresh, lambda s: fresh([s])[0])
        self._scraped: Column[float] = Column(_scrape_times, _scrape_time)

    def _assess(self, states: Sequence[EndpointState], now: float) -> SaturationReport:
        """`detector.assess` of `MIN_CACHED` states or more (the caller checks; a smaller pool
        would be answered right, only slower); from the kept values where every
        endpoint is fresh (the same floats: the plain sum of the same values in the same
        order)."""
        n = len(states)
        scratch = LocalScratch()
        oldest = min(self._scraped.values(scratch, states))
        values = self._saturations.values(scratch, states)
        fresh_since = now - self.detector.staleness_s
        if oldest > 0.0 and oldest >= fresh_since and STALE not in values:
            return SaturationReport(sum(values) / n, n, 0)
        return self.detector.assess(states, now)

    def shed_level(self, criticality: Criticality) -> float | None:
        """Saturation at which requests of this criticality are shed (None = never)."""
        if criticality is Criticality.CRITICAL:
            return None
        if criticality is Criticality.STANDARD:
            return self.config.standard_overload_level
        return self.config.sheddable_saturation_level

    def decide(
        self, request: Admittable, states: Sequence[EndpointState], *, now: float
    ) -> AdmissionOutcome:
        level = self.shed_level(request.criticality)
        if level is None:
            return AdmissionOutcome(AdmissionDecision.ADMIT, f"{request.criticality} is never shed")
        if not states:
            return AdmissionOutcome(
                AdmissionDecision.ADMIT, "no endpoints: left to the scheduler (503)"
            )
        report = (  # (below MIN_CACHED the detector's plain pass, without a call between)
            self._assess(states, now)
            if len(states) >= MIN_CACHED
            else self.detector.assess(states, now)
        )
        if report.all_stale:
            if self.config.all_stale_policy == "admit":
                return AdmissionOutcome(
                    AdmissionDecision.ADMIT,
                    f"metrics of all {report.endpoints} endpoints are stale: failing open",
                    report,
                )
            return AdmissionOutcome(
                AdmissionDecision.SHED,
                f"pool saturated: metrics of all {report.endpoints} endpoints are stale "
                f"(older than {self.detector.staleness_s * 1000:g} ms)",
                report,
            )
        if report.saturation >= level:
            return AdmissionOutcome(
                AdmissionDecision.SHED,
                f"pool saturated: saturation {report.saturation:.2f} >= {level:g} "
                f"(the shedding level for {request.criticality} requests; {report.stale} of "
                f"{report.endpoints} endpoints stale)",
                report,
            )
        return AdmissionOutcome(
            AdmissionDecision.ADMIT, f"saturation {report.saturation:.2f} < {level:g}", report
        )

    def admit(self, request: Admittable, states: Sequence[EndpointState], *, now: float) -> None:
        """Return if admitted; raise RequestShed (429) with the reason otherwise."""
        outcome = self.decide(request, states, now=now)
        if outcome.decision is AdmissionDecision.SHED:
            raise RequestShed(
                f"request {request.request_id} for model {request.model!r} "
                f"({request.criticality}) shed: {outcome.reason}"
            )


def _scrape_times(states: Sequence[EndpointState]) -> list[float]:
    return [u if (u := s.metrics.updated_at) == u else -math.inf for s in states]


def _scrape_time(s: EndpointState) -> float:
    u = s.metrics.updated_at
    return u if u == u else -math.inf
