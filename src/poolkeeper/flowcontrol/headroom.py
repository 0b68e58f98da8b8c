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

With the band's `dispatch: slot` (the default), an endpoint below the limit has room only
while it can also start the request now (`slots.BatchSlots`: a free batch slot, learned from
the gauges and the in-flight count), so contended requests wait in the EPP's fair order, not
in a server's FCFS queue. That is why a Headroom has state: the slots it has learned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.flowcontrol.config import BandConfig, Dispatch, Placement
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.flowcontrol.slots import BatchSlots


class Headroom:
    __slots__ = ("detector", "slots")

    def __init__(self, detector: SaturationDetector) -> None:
        self.detector = detector
        self.slots = BatchSlots()

    def fits(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None = None,
        contended: bool = True,
    ) -> bool:
        return self.room(states, band, now, adapter, 0, contended) is not None

    def room(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None = None,
        keep: int = 0,
        contended: bool = True,
    ) -> list[EndpointState] | None:
        """`fits` and `within` in one pass: the endpoints to schedule on, or None (no room).
        `keep`: free batch slots to leave for others (the dispatcher's `kept`): room only
        when more than that many are free (a server whose slots are unknown counts as many).
        `contended` (the dispatcher's): flows compete in the band, so `dispatch: slot` holds
        the queue in the EPP; uncontended, the saturation limit alone decides, as for
        `dispatch: saturation` (batches stay full and the scheduler's prefix affinity free)."""
        if not states:
            return list(states)
        slot = band.dispatch is Dispatch.SLOT and contended
        values = self._values(states, band, now, adapter, slot)
        blind = slot and self._blind(states, values)
        below = [
            s
            for s, v in zip(states, values, strict=True)
            if self._open(s, v, band, slot, adapter, blind)
        ]
        if below and keep > 0 and slot and self._free(below) <= keep:
            return None
        if below:
            if len(below) == len(states) or (band.placement is Placement.SCHEDULER and not slot):
                return list(states)
            return below
        if blind:
            return None  # every learned batch is busy: the EPP's exact in-flight count says so
        if all(v == STALE for v in values) and self.detector.config.all_stale_policy == "admit":
            return list(states)
        return None

    def within(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        contended: bool = True,
        adapter: str | None = None,
    ) -> Sequence[EndpointState]:
        """Where a dispatched request of `band` may go: every candidate for `scheduler`
        placement; for `headroom` placement (or a contended `dispatch: slot` band) the
        endpoints with room, or all of them when none has (fail open: the caller decided to
        dispatch), so the scheduler's prefix affinity cannot pile the band's work onto an
        endpoint past its limit (or into a server's own queue, out of the fair order).
        `adapter`: as for `room` (a server running it has room past other adapters' deferred
        requests), so the narrowing keeps the servers that already run the request's adapter."""
        slot = band.dispatch is Dispatch.SLOT and contended
        if band.placement is Placement.SCHEDULER and not slot:
            return states
        values = self._values(states, band, now, adapter, slot)
        blind = slot and self._blind(states, values)
        below = [
            s
            for s, v in zip(states, values, strict=True)
            if self._open(s, v, band, slot, adapter, blind)
        ]
        return below if below and len(below) < len(states) else states

    def _blind(self, states: Sequence[EndpointState], values: Sequence[float]) -> bool:
        """Every endpoint's metrics are stale but some server's batch is learned: the learned
        slots and the EPP's own in-flight count (exact, and current without a scrape) judge
        those servers instead of `allStalePolicy`'s fail-open. Issue 35, live: on a loaded
        machine the scraper fell 200 ms behind for a moment, every endpoint went stale, the
        band failed open, and 23 requests of the busier model went at once into the servers'
        own first-come-first-served queues (beta/alpha 0.18 in that run instead of 1.0)."""
        return all(v == STALE for v in values) and any(
            self.slots.slots(s) is not None for s in states
        )

    def _free(self, states: Sequence[EndpointState]) -> float:
        return sum(self.slots.free(s) for s in states)

    def _open(
        self,
        state: EndpointState,
        value: float,
        band: BandConfig,
        slot: bool,
        adapter: str | None = None,
        blind: bool = False,
    ) -> bool:
        """Room on one endpoint: below the band's limit (for `slot`, the KV part only) and,
        for `slot`, a free batch slot (`BatchSlots.can_start`). `blind` (`_blind`): only a
        learned batch with a free slot by the EPP's in-flight count."""
        if blind:
            return self.slots.can_start_blind(state)
        if not value < band.saturation_limit:
            return False
        if not slot:
            return True
        queue = band.queue_depth_threshold or self.detector.config.queue_depth_threshold
        return self.slots.can_start(state, queue * band.saturation_limit, adapter)

    def _values(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None,
        slot: bool,
    ) -> list[float]:
        self.slots.observe(states)
        c = self.detector.config
        queue = band.queue_depth_threshold
        kv = band.kv_cache_util_threshold
        if slot:
            queue = math.inf  # the queue is judged by the slots (`_open`), KV and age here
        return saturations(
            states,
            now=now,
            staleness_s=self.detector.staleness_s,
            queue_threshold=c.queue_depth_threshold if queue is None else queue,
            kv_threshold=c.kv_cache_util_threshold if kv is None else kv,
            count_unseen=c.count_unseen,
            adapter=adapter,
        )
