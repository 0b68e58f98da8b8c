"""`FlowDispatcher`: the queue of one pool and the decision of what to dispatch next.

    submit(item, fits)   -> DISPATCH | QUEUED | SHED | FULL | SATURATED   (the fast path
                            dispatches at once; a full band pushes out the newest request of
                            its longest flow when the newcomer's flow is shorter:
                            `take_pushed_out`; SATURATED: the queue ahead of it cannot drain
                            within its TTL at the measured rate, `expected_wait`)
    pump(now, fits, go)  -> dispatches heads while they fit; `go(item)` runs before the next check
    expire(now)          -> items past their deadline (TTL, or the overload TTL), removed
    cancel(item)         -> the client went away: removed at once
    completed(flow, band, output_tokens)  -> VTC charge of the answer

Order: strict priority between bands (Critical > Standard > Sheddable); between the flows of
a band, the band's fairness policy (`fairness.py`; today the Virtual Token Counter, `vtc.py`);
within a flow, the band's ordering policy (`ordering.py`; today first come first served,
except in overload: while a flow's oldest request has waited longer than its band's
`lifoAfterMs`, its newest goes first, adaptive LIFO). Both policies are chosen by the
`FlowPolicies` the dispatcher is built with, so a new policy needs no edit here. Each band's
queue, its TTLs and its overload rules (the overload TTL, `onlyWhileGrowing`) are `band.py`'s;
who shares a band and the places kept for a flow, `sharing.py`'s.
A request is refused before its TTL only when it cannot be served within it: the requests
ahead of it in fair order (every higher band; of each flow of its band at most as many as its
own flow will have waiting) do not drain within its band's TTL at the rate the queue has been
draining (`DrainRate`, measured only while something waits: the fleet's service rate). A flow
using more than its share has its own long queue ahead of its newcomers, so it is refused
first; a light flow's newcomer is not (issue 35: a closed population of clients, whose queue
is bounded by the clients, is served, not refused).
When the best head of a band does not fit, dispatching stops for every lower band too: a lower
band never overtakes a waiting higher one (no priority inversion; band limits are ordered, so a
lower head would not fit either unless the two requests have different candidates).

`fits(item)` answers "does some candidate endpoint have headroom for this item's band"; it is
the caller's (it reads the scheduler's view of the pool). `go(item)` must account for the
dispatched request before it returns (late binding: the next `fits` sees it), which is why
`pump` takes it as a callback instead of returning a batch.

Pure and synchronous: time is passed in; the same object runs in the EPP (requestcontrol's
async edge) and in the virtual-time fleet (bench).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol import sharing
from poolkeeper.flowcontrol.band import Band
from poolkeeper.flowcontrol.bandconfig import BandConfig, BandMode
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.drainrate import DrainRate
from poolkeeper.flowcontrol.fairness import FairnessFactory, vtc_fairness
from poolkeeper.flowcontrol.flowitem import BANDS, FlowItem, Submitted
from poolkeeper.flowcontrol.ordering import FcfsAdaptiveLifo, OrderingFactory

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FlowPolicies:
    """The policies a dispatcher orders its queue by, one of each per band (the seams of
    `fairness.py` and `ordering.py`); the defaults are today's behaviour."""

    fairness: FairnessFactory = vtc_fairness
    ordering: OrderingFactory = FcfsAdaptiveLifo.of


class FlowDispatcher(Generic[T]):
    """Bands, fairness and bounds of one pool (see the module docstring)."""

    def __init__(self, config: FlowControlConfig, policies: FlowPolicies | None = None) -> None:
        self.config = config
        policies = policies if policies is not None else FlowPolicies()
        self.drain = DrainRate()
        self._bands: dict[Criticality, Band[T]] = {
            b: Band(
                policies.fairness(config, b),
                policies.ordering(config.bands.of(b)),
                config.bands.of(b),
                answers_ahead=config.charge_answers_ahead,
                drainable=self.drains_within,
            )
            for b in BANDS
        }
        self._seq = itertools.count()
        self.pushed_out: list[FlowItem[T]] = []

    # -- arrivals -----------------------------------------------------------------------------

    def submit(
        self, item: FlowItem[T], now: float, fits: Callable[[FlowItem[T]], bool]
    ) -> Submitted:
        """Decide an arriving request. On DISPATCH the caller routes it and then calls
        `dispatched(item)`; on QUEUED it waits for `pump`, `expire` or `cancel`."""
        band = self.config.bands.of(item.band)
        item.arrived = now
        item.seq = next(self._seq)
        if band.mode is BandMode.SEND:
            return Submitted.DISPATCH
        self._bands[item.band].observe(item.flow, now)
        if sharing.take_kept(self._bands[item.band], item, now, fits):
            return Submitted.DISPATCH
        if not self._waiting_at_or_above(item.band) and fits(item):
            return Submitted.DISPATCH
        if band.mode is BandMode.SHED:
            return Submitted.SHED
        queue = self._bands[item.band]
        if not queue.make_room(item, band, now, self.pushed_out):
            return Submitted.FULL
        if not self._drains_in_time(queue, item, band):
            return Submitted.SATURATED
        if not self.waiting():
            self.drain.start(now)  # a backlog starts (the idle time before it does not count)
        item.queued = True
        queue.push(item)
        if band.only_while_growing:
            item.deadline = now + band.ttl_ms / 1000.0  # the overload TTL: `deadline_of`
        else:
            item.deadline = band.deadline(now, queue.busy_since[item.flow])
        return Submitted.QUEUED

    def expected_wait(self, item: FlowItem[T]) -> float | None:
        """Seconds until `item`, arriving now, would be dispatched at the measured drain rate
        (None: not measured yet). Ahead of it: every request of the bands above, and in its
        own band what fair sharing serves first: of each flow at most as many as `item`'s
        flow will have waiting with it (a flow using more than its share waits behind its
        own queue; a light flow is not held behind a heavy one)."""
        rate = self.drain.rate()
        if rate is None:
            return None
        ahead = sum(self._bands[b].count for b in BANDS if b.rank > item.band.rank)
        queue = self._bands[item.band]
        mine = len(queue.flows.get(item.flow, ())) + 1
        ahead += sum(min(len(q), mine) for q in queue.flows.values())
        if item.flow not in queue.flows:
            ahead += 1
        return ahead / rate

    def drains_within(self, seconds: float) -> bool:
        """Everything waiting in this pool drains within `seconds` at the measured rate
        (False while the rate is unknown: under `DRAIN_MIN_S` of backlog measured)."""
        rate = self.drain.rate()
        return rate is not None and self.waiting() <= seconds * rate

    def _drains_in_time(self, queue: Band[T], item: FlowItem[T], band: BandConfig) -> bool:
        """Refuse before the TTL only what cannot be served within it: the queue ahead of
        `item` (in fair order, `expected_wait`) does not drain in its TTL at the measured rate.
        Because a flow's own queue is counted in full, the flow using more than its share is
        the one refused first."""
        wait = self.expected_wait(item)
        return wait is None or wait <= band.ttl_ms / 1000.0

    def take_pushed_out(self) -> list[FlowItem[T]]:
        """Requests pushed out of a full band by `submit` since the last call (429 them)."""
        out, self.pushed_out = self.pushed_out, []
        return out

    def dispatched(self, item: FlowItem[T]) -> None:
        """Charge the prompt and the flow's expected answer (`answers.py`) to the flow (fast
        path and pump alike)."""
        queue = self._bands[item.band]
        queue.fairness.charge_input(item.flow, item.tokens)
        ahead = queue.answers.dispatched(item.flow, item.bound)
        if ahead:
            queue.fairness.charge_output(item.flow, ahead)
        queue.running[item.flow] = queue.running.get(item.flow, 0) + 1

    def completed(
        self, flow: str, band: Criticality, output_tokens: int, now: float | None = None
    ) -> None:
        """Charge the answer, less what was charged ahead for it (`answers.py`); with
        `now`, keep the freed place for `flow` a moment (`sharing.HOLD_S`)
        if it is the flow fair sharing would serve next but has nothing waiting: a client
        that sends its next request on an answer (a closed loop) gets its share instead of
        finding the place taken by a busier flow's waiting request each time."""
        queue = self._bands[band]
        running = queue.running.pop(flow, 0)
        settle = queue.answers.completed(flow, output_tokens, running)
        if settle:
            queue.fairness.charge_output(flow, settle)
        left = running - 1
        if left > 0:
            queue.running[flow] = left
        if now is not None:
            sharing.keep_place(queue, flow, left, now)

    def contended(self, band: Criticality, now: float | None = None) -> bool:
        """Whether flows compete in `band` in the EPP's queue: something waits, and two or
        more flows share the band (`sharing`). Uncontended, fair order decides nothing, so
        the headroom may let servers queue (`Headroom.room`: batches stay full and the
        scheduler's prefix affinity free; one model's shared-prefix chat at 0.5x capacity had
        p90 TTFT 3.1 s instead of 0.76 s with the queue held in the EPP). The caller also
        counts as contended a band that is `sharing` while the servers show a queue (the
        contention then sits in their own queues)."""
        return bool(self._bands[band].count) and self.sharing(band, now)

    def sharing(self, band: Criticality, now: float | None = None) -> bool:
        """Two or more flows have requests in `band` (waiting, or dispatched and not
        completed), counting with `now` a flow whose last request ended less than
        `band.PRESENT_S` ago: a closed loop's clients are then on their way back."""
        return sharing.sharing(self._bands[band], now)

    def kept(self, item: FlowItem[T], now: float) -> int:
        """Slots kept for flows other than `item`'s, in `item`'s band and the bands above:
        `fits` must leave that many free when it answers for `item`."""
        return sharing.kept(self._bands, item, now)

    # -- the pump -----------------------------------------------------------------------------

    def pump(
        self, now: float, fits: Callable[[FlowItem[T]], bool], go: Callable[[FlowItem[T]], None]
    ) -> int:
        """Dispatch heads in priority and fairness order while they fit; the number sent."""
        sent = self._pump(now, fits, go)
        self.drain.account(now, sent, self.waiting() > 0)
        return sent

    def _pump(
        self, now: float, fits: Callable[[FlowItem[T]], bool], go: Callable[[FlowItem[T]], None]
    ) -> int:
        sent = 0
        for criticality in BANDS:
            queue = self._bands[criticality]
            while queue.count:
                item = queue.head(now)
                if item is None or not fits(item):
                    return sent  # a waiting head blocks its band and every lower band
                queue.remove(item)
                item.queued = False
                sharing.release_kept(queue, item.flow)
                self.dispatched(item)
                go(item)
                sent += 1
        return sent

    def expire(self, now: float) -> list[FlowItem[T]]:
        """Remove and return the items whose TTL has passed (their flows keep FCFS order)."""
        out: list[FlowItem[T]] = []
        for queue in self._bands.values():
            if not queue.count:
                continue
            for flow in list(queue.flows):
                waiting = queue.flows[flow]
                # Deadlines grow along each flow's queue: one rule per band, applied in
                # arrival order, with the flow's `busy_since` fixed while it has anything waiting.
                while flow in queue.flows and queue.deadline_of(waiting[0]) <= now:
                    item = waiting[0]
                    if queue.deadline_of(item) < item.deadline:
                        queue.refused.add(flow)  # the overload TTL refused: `drainWithinMs` ends
                    item.deadline = queue.deadline_of(item)
                    queue.remove(item)
                    item.queued = False
                    out.append(item)
        return out

    def cancel(self, item: FlowItem[T]) -> bool:
        """Remove a waiting item (client gone). False if it is not waiting any more."""
        if not item.queued:
            return False
        self._bands[item.band].remove(item)
        item.queued = False
        return True

    # -- introspection ------------------------------------------------------------------------

    def _waiting_at_or_above(self, band: Criticality) -> bool:
        rank = band.rank
        return any(self._bands[b].count for b in BANDS if b.rank >= rank)

    def waiting(self, band: Criticality | None = None) -> int:
        if band is not None:
            return self._bands[band].count
        return sum(q.count for q in self._bands.values())

    def waiting_bytes(self, band: Criticality) -> int:
        return self._bands[band].bytes

    def items(self, band: Criticality) -> list[FlowItem[T]]:
        return list(self._bands[band].items())

    def head(self, band: Criticality, now: float = math.inf) -> FlowItem[T] | None:
        """The item `pump` would try next at `now` (by default: as if every wait were long)."""
        return self._bands[band].head(now)

    def counter(self, band: Criticality, flow: str) -> float:
        return self._bands[band].fairness.counter(flow)

    def next_deadline(self) -> float:
        return min(
            (b.deadline_of(q[0]) for b in self._bands.values() for q in b.flows.values()),
            default=math.inf,
        )
