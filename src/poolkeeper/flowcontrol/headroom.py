"""Headroom: may a request of a band be sent to this pool now?

Yes when some candidate endpoint's saturation (`datastore.load.saturations`, the one
definition, with the thresholds, in-flight counting and freshness of admission's
`SaturationDetector`; a band may set its own thresholds) is below the band's
`saturationLimit`. Per endpoint, not the pool
average: a request is never held while one eligible endpoint has room. Stale endpoints have no
headroom; when every endpoint is stale the detector knows nothing and `allStalePolicy`
decides (`admit`, the default: fail open, as admission does; a `dispatch: slot` band only as
far as the EPP's own in-flight count allows, `_blind`). No endpoints: yes, so the
scheduler answers 503 at once instead of the request waiting for its TTL. For a band with
`placement: headroom` (Sheddable), `within` narrows the candidates of a dispatched request to
the endpoints with headroom; other bands leave placement to the scheduler. `adapter` (the
request's target model) lets an endpoint that already runs that LoRA adapter count only what
can hold the request up there (`saturations`).

With the band's `dispatch: slot` (the default), an endpoint below the limit has room only
while it can also start the request now (`slots.BatchSlots`: a free batch slot, learned from
the gauges and the in-flight count), so contended requests wait in the EPP's fair order, not
in a server's FCFS queue: while flows contend in the EPP's queue, or share the band while a
server shows a queue of its own (`_slot`). Where a server defers LoRA adapter requests (an
adapter waits there without a slot), the EPP's requests for such adapters hold no batch slot
(`slots.holding`, by its in-flight count per target model) and the scheduler places among all
candidates (`_lora`: its adapter affinity). A place the dispatcher keeps for a returning flow
(`keep`) is one in a server's short queue, never an idle batch slot (`_room_besides`). That is
why a Headroom has state: the slots it has learned. A band's `avoidPrefillTokens` (Critical's)
narrows the candidates to the servers not just sent a long prompt (`spread`; prefix-aware with
`avoidPrefillUnlessCached`: `avoidance.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import STALE, saturations
from poolkeeper.flowcontrol.avoidance import CachedTokens, avoid_prefills
from poolkeeper.flowcontrol.bandconfig import BandConfig, Dispatch, Placement
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.flowcontrol.slots import BatchSlots, queued


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
        sharing: bool = False,
    ) -> bool:
        return self.room(states, band, now, adapter, 0, contended, sharing) is not None

    def room(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None = None,
        keep: int = 0,
        contended: bool = True,
        sharing: bool = False,
        cached: CachedTokens | None = None,
    ) -> list[EndpointState] | None:
        """`fits` and `within` in one pass: the endpoints to schedule on, or None (no room).
        `keep`: free batch slots to leave for others (the dispatcher's `kept`): room only
        when more than that many are free (a server whose slots are unknown counts as many).
        `contended` (the dispatcher's): flows compete in the band, so `dispatch: slot` holds
        the queue in the EPP; uncontended, the saturation limit alone decides, as for
        `dispatch: saturation` (batches stay full and the scheduler's prefix affinity free).
        `sharing` (the dispatcher's): two or more flows have requests in the band; with a
        queue at some server (`queueing`), the band is contended there. `cached`: as for
        `spread`."""
        if not states:
            return list(states)
        slot = self._slot(states, band, contended, sharing)
        below, values, blind = self._below(states, band, now, adapter, slot)
        if below and keep > 0 and slot and not self._room_besides(below, keep):
            return None
        if below:
            every = (
                (slot and self._lora(states))  # the scheduler places (adapter affinity)
                or len(below) == len(states)
                or (band.placement is Placement.SCHEDULER and not slot and not blind)
            )
            return list(self.spread(states if every else below, band, adapter, cached))
        if blind:
            return None  # every server is busy by the EPP's exact in-flight count
        if all(v == STALE for v in values) and self.detector.config.all_stale_policy == "admit":
            return list(self.spread(states, band, adapter, cached))
        return None

    def spread(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        adapter: str | None = None,
        cached: CachedTokens | None = None,
    ) -> Sequence[EndpointState]:
        """`states` narrowed by the band's `avoidPrefillTokens` (`avoidance.avoid_prefills`;
        `cached`: the request's prefix match per endpoint, for `avoidPrefillUnlessCached`).
        The band's `send` requests (Critical's) get it from the gate directly; the others
        through `room` and `within`."""
        return avoid_prefills(states, band, adapter, cached)

    def within(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        contended: bool = True,
        adapter: str | None = None,
        sharing: bool = False,
        cached: CachedTokens | None = None,
    ) -> Sequence[EndpointState]:
        """Where a dispatched request of `band` may go: every candidate for `scheduler`
        placement; for `headroom` placement (or a contended `dispatch: slot` band) the
        endpoints with room, or all of them when none has (fail open: the caller decided to
        dispatch), so the scheduler's prefix affinity cannot pile the band's work onto an
        endpoint past its limit (or into a server's own queue, out of the fair order).
        `adapter`: as for `room` (a server running it has room past other adapters' deferred
        requests), so the narrowing keeps the servers that already run the request's adapter.
        `cached`: as for `spread`."""
        slot = self._slot(states, band, contended, sharing)
        blind = self._maybe_blind(band, states) and self._all_stale(states, now)
        if band.placement is Placement.SCHEDULER and not slot and not blind:
            return self.spread(states, band, adapter, cached)
        if slot and self._lora(states):
            return self.spread(states, band, adapter, cached)
        below, _values, _blind = self._below(states, band, now, adapter, slot)
        narrowed = below if below and len(below) < len(states) else states
        return self.spread(narrowed, band, adapter, cached)

    def _slot(
        self, states: Sequence[EndpointState], band: BandConfig, contended: bool, sharing: bool
    ) -> bool:
        """Whether the band's `dispatch: slot` applies: flows contend in the EPP's queue, or
        share the band while some server shows a queue of its own (`queueing`). It stays on
        where a server's queue may hold requests deferred for a LoRA adapter (`_lora`): the
        rule it had until round 6, stepping aside there, flipped the whole pool between two
        rules whenever some server deferred (multi-LoRA 1.3x, seed 3: 5.27 s, 67.7 req/s;
        0.084 s, 85.4 since, and no seed worse: docs/flowcontrol.md)."""
        if band.dispatch is not Dispatch.SLOT or not (contended or sharing):
            return False
        return contended or self.queueing(states)

    def _lora(self, states: Sequence[EndpointState]) -> bool:
        """Some server defers adapter requests: slot dispatch decides when a request goes (by
        the batch slots the EPP's requests hold, `slots.holding`), the scheduler where (its
        adapter affinity; narrowed to the servers with a free slot, requests for adapters
        those did not run were deferred there and piled up unbounded: multi-LoRA 1.1x seed 2
        p90 TTFT 10.5 s against 0.088 s)."""
        return any(self.slots.deferring(s) for s in states)

    def queueing(self, states: Sequence[EndpointState]) -> bool:
        """Some server shows requests waiting for a batch slot (`slots.queued`: the EPP's own
        requests deferred there for an adapter slot do not count). Flows that share a band
        are contended there even while nothing waits in the EPP: a closed population small
        enough to sit in the servers' own queues (2 x 2 slots, 4 + 8 clients) was served in
        their first-come-first-served order, beta/alpha 0.48; and live, the first arrivals
        of the busier model filled the servers' queues before the other model's first
        request waited (11 per 2-slot server), which then waited 4 s."""
        return any(queued(s) > 0 for s in states)

    def _below(
        self,
        states: Sequence[EndpointState],
        band: BandConfig,
        now: float,
        adapter: str | None,
        slot: bool,
    ) -> tuple[list[EndpointState], list[float], bool]:
        """The endpoints with room (`_open`), the saturation values, and whether the check
        was blind (`_blind`)."""
        values = self._values(states, band, now, adapter, slot)
        blind = self._blind(states, values, band, slot)
        below = [
            s
            for s, v in zip(states, values, strict=True)
            if self._open(s, v, band, slot, adapter, blind)
        ]
        return below, values, blind

    def _blind(
        self,
        states: Sequence[EndpointState],
        values: Sequence[float],
        band: BandConfig,
        slot: bool,
    ) -> bool:
        """Every endpoint's metrics are stale, and the EPP's own in-flight count (exact, and
        current without a scrape) judges instead of `allStalePolicy`'s fail-open: for `slot`
        dispatch once some server's batch is learned (`BatchSlots.can_start_blind`); for an
        uncontended band with `dispatch: slot` under the `admit` policy, once gauges have
        come and gone stale, as the saturation limit's allowance beyond the batch
        (`_maybe_blind`). Issue 35, live: on a loaded machine the scraper fell 200 ms behind
        for a moment, every endpoint went stale, the band failed open, and 23 requests of the
        busier model went at once into the servers' own first-come-first-served queues
        (beta/alpha 0.18 in that run instead of 1.0); and before the light model's first
        request (uncontended), the busier model's first arrivals filled them up to 14 per
        2-slot server, which took 7 s to clear (live beta/alpha 0.90 at load 16-21)."""
        if not all(v == STALE for v in values):
            return False
        if slot:
            return any(self.slots.slots(s) is not None for s in states)
        return self._maybe_blind(band, states)

    def _all_stale(self, states: Sequence[EndpointState], now: float) -> bool:
        """Every endpoint's gauges are older than the staleness limit (`saturations`' STALE)."""
        fresh_since = now - self.detector.staleness_s
        return all(
            s.metrics.updated_at <= 0.0 or s.metrics.updated_at < fresh_since for s in states
        )

    def _maybe_blind(self, band: BandConfig, states: Sequence[EndpointState]) -> bool:
        """An uncontended band bounded by the in-flight count when every gauge is stale: a
        `dispatch: slot` band (not Sheddable's `saturation`) under `allStalePolicy: admit`
        (with `shed` nothing is sent then anyway), once some endpoint has been scraped: gauges
        that went stale (a scraper late on a loaded machine), not the moment before the first
        scrape, which stays as admission has it (and leaves virtual-time runs as they were)."""
        return (
            band.dispatch is Dispatch.SLOT
            and self.detector.config.all_stale_policy == "admit"
            and any(s.metrics.updated_at > 0.0 for s in states)
        )

    def _allowance(self, band: BandConfig) -> float:
        """Requests the saturation limit lets wait at a server (`queueDepthThreshold` x
        `saturationLimit`: 6 for Standard)."""
        queue = band.queue_depth_threshold or self.detector.config.queue_depth_threshold
        return queue * band.saturation_limit

    def _room_besides(self, states: Sequence[EndpointState], keep: int) -> bool:
        """Room for a request beside the `keep` places held for other flows (the dispatcher's
        `kept`): a free batch slot, or more free places in the servers' short queues than are
        held. A hold keeps a place in a server's queue, never a batch slot idle: a returning
        closed-loop client finds its place however long its round trip took (live on a
        loaded machine 80 ms at the median, up to 0.9 s; a 50 ms hold that kept batch slots
        idle missed most returns, beta/alpha 0.69-0.75), and the servers stay busy."""
        slots = places = 0.0
        for s in states:
            free, queue = self.slots.free(s)
            slots += free
            places += queue
        return slots > 0 or places > keep

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
        for `slot`, a free batch slot (`BatchSlots.can_start`). `blind` (`_blind`): by the
        EPP's in-flight count only (`BatchSlots.can_start_blind`)."""
        if blind:
            return self.slots.can_start_blind(state, None if slot else self._allowance(band))
        if not value < band.saturation_limit:
            return False
        if not slot:
            return True
        return self.slots.can_start(state, self._allowance(band), adapter)

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
