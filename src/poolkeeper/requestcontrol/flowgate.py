"""`FlowGate`: the Director's gate when flow control is on; the async edge of flow control in
the EPP (the pure core is `flowcontrol/`: the dispatcher and the headroom check).

One `FlowDispatcher` per pool (capacity is per pool). A request the dispatcher queues waits on
a future while its ext_proc stream stays open; the pump dispatches it later:

- `submit(job)`: the fast path dispatches at once (`job.run` schedules it); a queued
  request gets a FlowItem; `shed`-mode bands raise 429 (RequestShed), full bands and
  requests whose queue ahead cannot drain within their TTL 429 `rejected-saturated`
  (QueueFull). Every refusal logs the rule that made it
  (`rule=shed_mode|band_full|pushed_out|cannot_drain|ttl_expired`).
- `wait(item)`: awaits the decision. Cancelled (client gone): the item leaves the queue at
  once; a decision that raced the cancellation is handed back (`abandon`) so its in-flight
  accounting ends. Nothing is left behind either way.
- the pump: expires items past their TTL (503 QueueTimeout), then dispatches heads in priority
  and fairness order. Each head is scheduled synchronously (`job.run()`: fresh snapshot,
  scheduler, in-flight start) before the next headroom check, so a burst of wake-ups cannot
  over-dispatch on one stale view (late binding). It runs on `wake()` (enqueue, completion,
  datastore metrics writes; thread-safe) and on a short timer while anything waits in the
  queue (TTL expiry, recovery from stale metrics).
- `holdNewPrefixes` (`flowcontrol/prefixhold.py`, one `PrefixHold` per pool): before a `queue`
  band's request enters the dispatcher, the gate asks the Director's `job.prefill` (the
  scheduler's prefix index and prefill backlogs) whether it would open a new long prefill
  while every candidate is backlogged; if so it is held, outside the queue (it blocks
  nothing behind it). At each pump (a first byte or an end, a metrics write) the oldest
  `HOLD_ASKS_PER_PUMP` held requests are asked again, in arrival order, each released one
  entering the dispatcher before the next is asked; a timer at the oldest's `maxHoldMs`
  releases it whatever the backlog. No polling: with only held requests, the short queue
  timer does not run.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import GatewayError, NoReadyEndpoint, QueueFull, QueueTimeout, RequestShed
from poolkeeper.flowcontrol.config import BandMode, FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher, FlowPolicies
from poolkeeper.flowcontrol.flowitem import BANDS, FlowItem, Submitted
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.prefixhold import Held, PrefixHold
from poolkeeper.requestcontrol.ports import Job
from poolkeeper.requestcontrol.types import RoutingDecision

log = logging.getLogger(__name__)

TICK_S = 0.05  # pump period while something waits (TTL precision, stale-metrics recovery)

# Upstream's flow-control queue outcomes (inference_extension_flow_control_* metrics).
DISPATCHED = "Dispatched"
REJECTED_CAPACITY = "RejectedCapacity"
REJECTED_OTHER = "RejectedOther"
EVICTED_TTL = "EvictedTTL"
EVICTED_CANCELLED = "EvictedContextCancelled"

# At each pump, at most this many held requests are asked again (the oldest first; each ask is
# a snapshot and a prefix match, ~0.2-0.3 ms): with hundreds held, asking them all at every
# first byte, end and metrics write blocked the event loop for 80-300 ms. Those not asked wait
# for a later pump or their `maxHoldMs`. With `placeUnderBacklog` a released request's placement
# (`_place`, another snapshot and prefix match) counts too (`PrefixHold.release`).
HOLD_ASKS_PER_PUMP = 16

# How a `holdNewPrefixes` hold ended (poolkeeper_flow_control_hold_duration_seconds).
HOLD_RELEASED = "released"  # the rule let it go (a prefix placed, a backlog fell)
HOLD_CAPPED = "capped"  # `maxHoldMs` reached while the rule still held it
HOLD_CANCELLED = "cancelled"  # the client went away (or the caller could not wait)


class FlowObserver(Protocol):
    """Metrics hook (telemetry implements it)."""

    def flow_outcome(
        self,
        *,
        pool: str,
        band: Criticality,
        model: str,
        target: str,
        fairness_id: str,
        priority: int,
        outcome: str,
        waited_s: float,
    ) -> None: ...

    def flow_held(self, *, pool: str, band: Criticality, outcome: str, held_s: float) -> None:
        """A `holdNewPrefixes` hold ended (`HOLD_*`) after `held_s` seconds."""
        ...


class FlowGate:
    """The `Gate` (requestcontrol/ports.py) that queues: see the module docstring."""

    def __init__(
        self,
        config: FlowControlConfig,
        headroom: Headroom,
        *,
        clock: Callable[[], float],
        observer: FlowObserver | None = None,
        policies: FlowPolicies | None = None,
    ) -> None:
        self.config = config
        self.headroom = headroom
        self.policies = policies  # fairness and ordering (None: today's, VTC and FCFS/LIFO)
        self.observer = observer
        self.totals: Counter[tuple[Criticality, str]] = Counter()  # (band, outcome or "queued")
        self._clock = clock
        self._pools: dict[str, FlowDispatcher[Job]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._soon = False
        self._timer: asyncio.TimerHandle | None = None
        self._held: dict[str, PrefixHold[FlowItem[Job]]] = {}  # per pool (`holdNewPrefixes`)
        # (pool, band) -> requests and bytes held: counted with the queue by `_room_to_hold`
        self._held_count: Counter[tuple[str, Criticality]] = Counter()
        self._held_bytes: Counter[tuple[str, Criticality]] = Counter()
        self._hold_timer: asyncio.TimerHandle | None = None

    # -- the request path ---------------------------------------------------------------------

    def submit(self, job: Job) -> RoutingDecision | FlowItem[Job]:
        item = FlowItem(
            job, job.criticality, job.flow, job.tokens, job.size, bound=job.max_tokens or 0
        )
        if job.prefill is not None and self._room_to_hold(item) and self._holds(item):
            self._held[job.pool].hold(item, self._clock())
            self._held_count[(job.pool, item.band)] += 1
            self._held_bytes[(job.pool, item.band)] += item.size
            self.totals[(job.criticality, "held")] += 1
            return item
        return self._enter(item)

    def _enter(self, item: FlowItem[Job]) -> RoutingDecision | FlowItem[Job]:
        """Offer the item to its pool's dispatcher: the decision (dispatched now), the item
        (queued) or a GatewayError raised (refused)."""
        job = item.payload
        dispatcher = self._pools.get(job.pool)
        if dispatcher is None:
            dispatcher = self._pools[job.pool] = FlowDispatcher(self.config, self.policies)
        band = job.criticality
        verdict = dispatcher.submit(item, self._clock(), self._fits)
        for victim in dispatcher.take_pushed_out():
            self._outcome(victim, REJECTED_CAPACITY, self._clock() - victim.arrived)
            self._refuse(
                victim, "pushed_out",
                QueueFull(f"pushed out of the full {band} queue of pool {job.pool} by a flow "
                          "with fewer requests waiting"),
            )  # fmt: skip
        if verdict is Submitted.DISPATCH:
            if job.ready is None and self.config.bands.of(band).avoid_prefill_tokens is not None:
                self._spread(job)  # a `send` band: placed away from a prefill just sent
            decision = self._dispatch(item, 0.0)
            dispatcher.dispatched(item)
            return decision
        if verdict is Submitted.QUEUED:
            self.totals[(band, "queued")] += 1
            return item
        if verdict is Submitted.FULL:
            self._outcome(item, REJECTED_CAPACITY, 0.0)
            raise _refused(item, "band_full", QueueFull(
                f"the {band} queue of pool {job.pool} is full"))  # fmt: skip
        if verdict is Submitted.SATURATED:
            self._outcome(item, REJECTED_CAPACITY, 0.0)
            wait = dispatcher.expected_wait(item) or 0.0
            raise _refused(item, "cannot_drain", QueueFull(
                f"pool {job.pool} is saturated: the {band} requests ahead of this one would "
                f"take {wait:.1f} s to drain at the measured rate, longer than the "
                f"{self.config.bands.of(band).ttl_ms} ms it may wait"))  # fmt: skip
        self._outcome(item, REJECTED_OTHER, 0.0)
        raise _refused(item, "shed_mode", RequestShed(
            f"pool {job.pool} has no endpoint below the {band} saturation limit "
            f"({self.config.bands.of(band).saturation_limit:g}) and {band} requests do not "
            "queue"))  # fmt: skip

    async def wait(self, item: FlowItem[Job]) -> RoutingDecision:
        loop = asyncio.get_running_loop()
        self._loop = loop
        future: asyncio.Future[RoutingDecision] = loop.create_future()
        item.payload.future = future
        self._arm()
        try:
            return await future
        except asyncio.CancelledError:
            if self._unhold(item):
                self._outcome(item, EVICTED_CANCELLED, 0.0)
            elif self._pools[item.payload.pool].cancel(item):
                self._outcome(item, EVICTED_CANCELLED, self._clock() - item.arrived)
            elif future.done() and not future.cancelled() and future.exception() is None:
                item.payload.abandon(future.result())  # dispatched just as the client left
            raise

    def withdraw(self, item: FlowItem[Job]) -> None:
        """Take a queued item back (its caller cannot wait)."""
        if self._unhold(item) or self._pools[item.payload.pool].cancel(item):
            self._outcome(item, REJECTED_CAPACITY, 0.0)

    def completed(self, pool: str, flow: str, band: Criticality, output_tokens: int) -> None:
        dispatcher = self._pools.get(pool)
        if dispatcher is not None:
            dispatcher.completed(flow, band, output_tokens, self._clock())
        self.wake()

    # -- the pump -----------------------------------------------------------------------------

    def wake(self) -> None:
        """Run the pump soon (from any thread); free when nothing waits."""
        loop = self._loop
        if loop is None or self._soon or not (self.waiting() or self.held()):
            return
        self._soon = True
        try:
            loop.call_soon_threadsafe(self.pump)
        except RuntimeError:  # loop closed: nothing can wait on it any more
            self._soon = False

    def pump(self) -> None:
        self._soon = False
        now = self._clock()
        for dispatcher in self._pools.values():
            for item in dispatcher.expire(now):
                self._outcome(item, EVICTED_TTL, now - item.arrived)
                self._refuse(
                    item,
                    "ttl_expired",
                    QueueTimeout(
                        f"request waited {now - item.arrived:.1f} s in the {item.band} queue "
                        f"(its limit: {(item.deadline - item.arrived) * 1000:.0f} ms)"
                    ),
                )
            if dispatcher.waiting():
                dispatcher.pump(now, self._fits, self._go)
        for hold in self._held.values():
            if hold.waiting():
                hold.release(now, self._holds, self._release, asks=HOLD_ASKS_PER_PUMP)
        self._arm()

    def _tick(self) -> None:
        self._timer = None
        self.pump()

    def _hold_tick(self) -> None:
        self._hold_timer = None
        self.pump()

    def _arm(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._timer is None and self.waiting():
            self._timer = loop.call_later(TICK_S, self._tick)
        if self._hold_timer is None and self.held():
            # The oldest held request's cap: the one release no event would bring.
            at = min(hold.next_release() for hold in self._held.values())
            self._hold_timer = loop.call_later(max(0.0, at - self._clock()), self._hold_tick)

    # -- holdNewPrefixes ----------------------------------------------------------------------

    def _holds(self, item: FlowItem[Job]) -> bool:
        """Whether `holdNewPrefixes` holds the item now: a `queue` band's request (a `send`
        band's goes at once, a `shed` band's gets its answer at once) that the Director asks
        about, on the pool's candidates of this moment."""
        job = item.payload
        config = self.config.hold_new_prefixes
        if config is None or job.prefill is None:
            return False
        if self.config.bands.of(item.band).mode is not BandMode.QUEUE:
            return False
        try:
            uncached, backlogs = job.prefill(job.states())
        except NoReadyEndpoint:
            return False  # the scheduler answers 503 now
        except Exception:  # a bug in a plugin must not hold (or kill the pump): let it go
            log.exception("internal error asking whether to hold request %s", job.request_id)
            return False
        hold = self._held.get(job.pool)
        if hold is None:
            hold = self._held[job.pool] = PrefixHold(config)
        return hold.holds(uncached, backlogs)

    def _place(self, item: FlowItem[Job]) -> None:
        """`holdNewPrefixes.placeUnderBacklog`: a new long prefix released from the hold goes
        only to the candidates under the backlog (`PrefixHold.room`), when some are and some
        are not."""
        job = item.payload
        config = self.config.hold_new_prefixes
        if config is None or not config.place_under_backlog or not job.released:
            return
        if job.prefill is None:
            return
        if self.config.bands.of(item.band).mode is not BandMode.QUEUE:
            return
        try:
            candidates = job.ready if job.ready is not None else job.states()
            uncached, backlogs = job.prefill(candidates)
        except NoReadyEndpoint:
            return  # the scheduler answers 503
        except Exception:  # a bug in a plugin must not stop the dispatch: placed as without it
            log.exception("internal error placing request %s", job.request_id)
            return
        if len(backlogs) != len(candidates):
            return  # facts not per candidate (a stub or an empty pool): placed as without it
        hold = self._held.get(job.pool)
        if hold is None:
            hold = self._held[job.pool] = PrefixHold(config)
        room = hold.room(uncached, backlogs)
        if room is not None:
            job.ready = [candidates[i] for i in room]

    def _room_to_hold(self, item: FlowItem[Job]) -> bool:
        """Whether an arriving item fits its band's bounds (`maxRequests`, `maxBytes` per
        pool) with the requests held and queued in that band now: held requests wait too, and
        a flood of new prefixes must not grow the router's memory past the band's bounds (one
        that does not fit goes to the dispatcher, whose bounds decide: queue, push out, 429)."""
        pool, band = item.payload.pool, item.band
        limits = self.config.bands.of(band)
        count, size = self._held_count[(pool, band)], self._held_bytes[(pool, band)]
        dispatcher = self._pools.get(pool)
        if dispatcher is not None:
            count += dispatcher.waiting(band)
            size += dispatcher.waiting_bytes(band)
        return count + 1 <= limits.max_requests and size + item.size <= limits.max_bytes

    def _unload(self, item: FlowItem[Job]) -> None:
        """A held item left its hold (released or gone): its share of the band's load too."""
        key = (item.payload.pool, item.band)
        self._held_count[key] -= 1
        self._held_bytes[key] -= item.size

    def _release(self, entry: Held[FlowItem[Job]]) -> None:
        """A held item goes to its pool's dispatcher: dispatched, queued or refused, as an
        arriving request would be; its time held counts as queue time."""
        item = entry.payload
        job = item.payload
        job.held_s = self._clock() - entry.since
        job.released = True
        self._unload(item)
        self._held_outcome(item, HOLD_CAPPED if entry.capped else HOLD_RELEASED, job.held_s)
        try:
            decision = self._enter(item)
        except GatewayError as exc:
            self._fail(item, exc)
            return
        except Exception:  # a bug below must not kill the pump; the request gets a 500
            log.exception("internal error dispatching a held request")
            self._fail(item, GatewayError("internal error while routing the request"))
            return
        if isinstance(decision, RoutingDecision):
            future = job.future
            if future is None or future.done():
                job.abandon(decision)  # nobody waits for it any more
            else:
                future.set_result(decision)

    def _unhold(self, item: FlowItem[Job]) -> bool:
        """Take a held item out of its hold (client gone); False if it is not held."""
        hold = self._held.get(item.payload.pool)
        entry = hold.remove(item) if hold is not None else None
        if entry is None:
            return False
        item.payload.held_s = self._clock() - entry.since
        self._unload(item)
        self._held_outcome(item, HOLD_CANCELLED, item.payload.held_s)
        return True

    def _held_outcome(self, item: FlowItem[Job], outcome: str, held_s: float) -> None:
        self.totals[(item.band, f"held_{outcome}")] += 1
        if self.observer is not None:
            self.observer.flow_held(
                pool=item.payload.pool, band=item.band, outcome=outcome, held_s=held_s
            )

    def _fits(self, item: FlowItem[Job]) -> bool:
        """Does some candidate endpoint have headroom for the item's band now? The endpoints
        with room go to the `job.run` that follows in the same synchronous step (fast path or
        pump), so a dispatch reads the pool once, not twice."""
        job = item.payload
        job.ready = None
        try:
            states = job.states()
        except NoReadyEndpoint:
            return True  # the pool went away: dispatch, so the scheduler answers 503 now
        band = self.config.bands.of(item.band)
        hold = self.config.hold_new_prefixes
        if job.released and hold is not None and hold.place_under_backlog:
            band = band.without_avoidance()  # placed by the backlog's room (`_place`)
        now = self._clock()
        dispatcher = self._pools[job.pool]
        keep = dispatcher.kept(item, now)
        contended = dispatcher.contended(item.band, now)
        sharing = not contended and dispatcher.sharing(item.band, now)
        room = self.headroom.room(
            states, band, now, job.target, keep, contended, sharing, job.cached
        )
        if room is None:
            return False
        job.ready = room
        return True

    def _spread(self, job: Job) -> None:
        """The candidates of a request sent at once, narrowed by its band's
        `avoidPrefillTokens` (`Headroom.spread`); read once, as the scheduler would."""
        try:
            states = job.states()
        except NoReadyEndpoint:
            return  # the scheduler answers 503
        band = self.config.bands.of(job.criticality)
        job.ready = list(self.headroom.spread(states, band, job.target, job.cached))

    def _go(self, item: FlowItem[Job]) -> None:
        job = item.payload
        try:
            decision = self._dispatch(item, self._clock() - item.arrived)
        except GatewayError as exc:
            self._fail(item, exc)
            return
        except Exception as exc:  # a bug below must not kill the pump; the request gets a 500
            log.exception("internal error dispatching a queued request")
            self._fail(item, GatewayError("internal error while routing the request"))
            del exc
            return
        future = job.future
        if future is None or future.done():
            job.abandon(decision)  # nobody waits for it any more
        else:
            future.set_result(decision)

    def _dispatch(self, item: FlowItem[Job], waited: float) -> RoutingDecision:
        """Schedule an item flow control let go (at once, from the queue, or released from a
        hold) and record its one outcome: Dispatched, or RejectedOther when scheduling fails
        (a 503 because its pool lost every endpoint while it waited, or an internal error).
        Without this a request refused after a hold or a wait left flow control unrecorded."""
        self._place(item)
        try:
            decision = _run(item.payload)
        except Exception:
            self._outcome(item, REJECTED_OTHER, waited)
            raise
        self._outcome(item, DISPATCHED, waited)
        return decision

    def _refuse(self, item: FlowItem[Job], rule: str, exc: GatewayError) -> None:
        """Fail a queued request that flow control refuses, logging the rule that did."""
        self._fail(item, _refused(item, rule, exc))

    def _fail(self, item: FlowItem[Job], exc: GatewayError) -> None:
        future = item.payload.future
        if future is not None and not future.done():
            future.set_exception(exc)

    def _outcome(self, item: FlowItem[Job], outcome: str, waited: float) -> None:
        self.totals[(item.band, outcome)] += 1
        if self.observer is not None:
            job = item.payload
            waited += job.held_s  # a held request's wait began before the queue
            self.observer.flow_outcome(
                pool=job.pool, band=item.band, model=job.model, target=job.target,
                fairness_id=item.flow, priority=job.priority, outcome=outcome, waited_s=waited,
            )  # fmt: skip

    # -- introspection ------------------------------------------------------------------------

    def waiting(self, pool: str | None = None, band: Criticality | None = None) -> int:
        pools = self._pools.values() if pool is None else [self._pools.get(pool)]
        return sum(d.waiting(band) for d in pools if d is not None)

    def held(self, pool: str | None = None, band: Criticality | None = None) -> int:
        """Requests `holdNewPrefixes` holds in front of the queue (of one pool or all, of
        one band or all)."""
        holds = self._held.values() if pool is None else [self._held.get(pool)]
        if band is None:
            return sum(h.waiting() for h in holds if h is not None)
        return sum(e.payload.band is band for h in holds if h is not None for e in h.held)

    def queue_stats(self) -> list[tuple[str, Criticality, int, int]]:
        """(pool, band, requests waiting, bytes waiting) for every pool and band (gauges)."""
        return [
            (pool, band, d.waiting(band), d.waiting_bytes(band))
            for pool, d in self._pools.items()
            for band in BANDS
        ]

    def queued_flows(
        self, pool: str, band: Criticality
    ) -> dict[tuple[str, int, str, str], tuple[int, int]]:
        """(fairness id, priority, model, target) -> (requests, bytes) waiting in one band of
        one pool (the per-flow queue gauges)."""
        dispatcher = self._pools.get(pool)
        out: dict[tuple[str, int, str, str], tuple[int, int]] = {}
        for item in dispatcher.items(band) if dispatcher is not None else ():
            job = item.payload
            key = (item.flow, job.priority, job.model, job.target)
            requests, size = out.get(key, (0, 0))
            out[key] = (requests + 1, size + item.size)
        return out

    def next_deadline(self) -> float:
        return min((d.next_deadline() for d in self._pools.values()), default=math.inf)


def _refused(item: FlowItem[Job], rule: str, exc: GatewayError) -> GatewayError:
    """Log which flow-control rule refused a request (one line each; the reason travels in the
    error's message to the client)."""
    job = item.payload
    log.info(
        "flow control refused request_id=%s pool=%s band=%s flow=%s rule=%s status=%d: %s",
        job.request_id, job.pool, item.band, item.flow, rule, exc.http_status, exc.message,
    )  # fmt: skip
    return exc


def _run(job: Job) -> RoutingDecision:
    """Schedule a dispatched job on the endpoints its headroom check found (late binding)."""
    ready, job.ready = job.ready, None
    return job.run(ready, None)
