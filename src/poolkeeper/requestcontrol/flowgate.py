"""`FlowGate`: the Director's gate when flow control is on; the async edge of flow control in
the EPP (the pure core is `flowcontrol/`: the dispatcher and the headroom check).

One `FlowDispatcher` per pool (capacity is per pool). A request the dispatcher queues waits on
a future while its ext_proc stream stays open; the pump dispatches it later:

- `submit(job)`: the fast path dispatches at once (`job.run` schedules it); a queued
  request gets a FlowItem; `shed`-mode bands raise 429 (RequestShed), full bands and
  requests whose queue ahead cannot drain within their TTL 429 `rejected-saturated`
  (QueueFull). Every refusal logs the rule that made it
  (`rule=shed_mode|band_full|pushed_out|cannot_drain|ttl_expired`; `flowoutcomes.py`).
- `wait(item)`: awaits the decision. Cancelled (client gone): the item leaves the queue at
  once; a decision that raced the cancellation is handed back (`abandon`) so its in-flight
  accounting ends. Nothing is left behind either way.
- the pump: expires items past their TTL (503 QueueTimeout), then dispatches heads in priority
  and fairness order. Each head is scheduled synchronously (`job.run()`: fresh snapshot,
  scheduler, in-flight start) before the next headroom check (`flowroom.py`), so a burst of
  wake-ups cannot over-dispatch on one stale view (late binding). It runs on `wake()`
  (enqueue, completion, datastore metrics writes; thread-safe) and on a short timer while
  anything waits in the queue (TTL expiry, recovery from stale metrics).
- `holdNewPrefixes` (`heldrequests.py`): a `queue` band's request that would open a new long
  prefill while every candidate is backlogged is held in front of the queue, asked again at
  each pump and released to the dispatcher; a timer at the oldest's `maxHoldMs` releases it
  whatever the backlog. No polling: with only held requests, the short queue timer does not
  run.

The reads (`waiting`, `held`, the queue gauges, `next_deadline`) are its base's,
`FlowGateReads` in `flowgate_reads.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import GatewayError, QueueFull, QueueTimeout
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher, FlowPolicies
from poolkeeper.flowcontrol.flowitem import FlowItem, Submitted
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.requestcontrol.flowgate_reads import FlowGateReads
from poolkeeper.requestcontrol.flowoutcomes import (
    DISPATCHED,
    EVICTED_CANCELLED,
    EVICTED_TTL,
    REJECTED_CAPACITY,
    REJECTED_OTHER,
    FlowObserver,
    deliver,
    fail,
    refusal,
)
from poolkeeper.requestcontrol.flowroom import FlowRoom
from poolkeeper.requestcontrol.heldrequests import HeldRequests
from poolkeeper.requestcontrol.ports import Job
from poolkeeper.requestcontrol.types import RoutingDecision

log = logging.getLogger(__name__)

TICK_S = 0.05  # pump period while something waits (TTL precision, stale-metrics recovery)


class FlowGate(FlowGateReads):
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
        self._room = FlowRoom(config, headroom, clock=clock, pools=self._pools)
        self._held = HeldRequests(
            config, clock=clock, pools=self._pools, enter=self._enter, ended=self._held_outcome
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._soon = False
        self._timer: asyncio.TimerHandle | None = None
        self._hold_timer: asyncio.TimerHandle | None = None

    # -- the request path ---------------------------------------------------------------------

    def submit(self, job: Job) -> RoutingDecision | FlowItem[Job]:
        item = FlowItem(
            job, job.criticality, job.flow, job.tokens, job.size, bound=job.max_tokens or 0
        )
        if self._held.offer(item):
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
        verdict = dispatcher.submit(item, self._clock(), self._room.fits)
        for victim in dispatcher.take_pushed_out():
            self._outcome(victim, REJECTED_CAPACITY, self._clock() - victim.arrived)
            self._refuse(
                victim, "pushed_out",
                QueueFull(f"pushed out of the full {band} queue of pool {job.pool} by a flow "
                          "with fewer requests waiting"),
            )  # fmt: skip
        if verdict is Submitted.DISPATCH:
            if job.ready is None and self.config.bands.of(band).avoid_prefill_tokens is not None:
                self._room.spread(job)  # a `send` band: placed away from a prefill just sent
            decision = self._dispatch(item, 0.0)
            dispatcher.dispatched(item)
            return decision
        if verdict is Submitted.QUEUED:
            self.totals[(band, "queued")] += 1
            return item
        outcome, rule, exc = refusal(verdict, item, dispatcher, self.config)
        self._outcome(item, outcome, 0.0)
        raise _refused(item, rule, exc)

    async def wait(self, item: FlowItem[Job]) -> RoutingDecision:
        loop = asyncio.get_running_loop()
        self._loop = loop
        future: asyncio.Future[RoutingDecision] = loop.create_future()
        item.payload.future = future
        self._arm()
        try:
            return await future
        except asyncio.CancelledError:
            if self._held.remove(item):
                self._outcome(item, EVICTED_CANCELLED, 0.0)
            elif self._pools[item.payload.pool].cancel(item):
                self._outcome(item, EVICTED_CANCELLED, self._clock() - item.arrived)
            elif future.done() and not future.cancelled() and future.exception() is None:
                item.payload.abandon(future.result())  # dispatched just as the client left
            raise

    def withdraw(self, item: FlowItem[Job]) -> None:
        """Take a queued item back (its caller cannot wait)."""
        if self._held.remove(item) or self._pools[item.payload.pool].cancel(item):
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
                dispatcher.pump(now, self._room.fits, self._go)
        self._held.release(now)
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
            at = self._held.next_release()
            self._hold_timer = loop.call_later(max(0.0, at - self._clock()), self._hold_tick)

    def _held_outcome(self, item: FlowItem[Job], outcome: str, held_s: float) -> None:
        self.totals[(item.band, f"held_{outcome}")] += 1
        if self.observer is not None:
            self.observer.flow_held(
                pool=item.payload.pool, band=item.band, outcome=outcome, held_s=held_s
            )

    def _go(self, item: FlowItem[Job]) -> None:
        job = item.payload
        try:
            decision = self._dispatch(item, self._clock() - item.arrived)
        except GatewayError as exc:
            fail(item, exc)
            return
        except Exception as exc:  # a bug below must not kill the pump; the request gets a 500
            log.exception("internal error dispatching a queued request")
            fail(item, GatewayError("internal error while routing the request"))
            del exc
            return
        deliver(job, decision)

    def _dispatch(self, item: FlowItem[Job], waited: float) -> RoutingDecision:
        """Schedule an item flow control let go (at once, from the queue, or released from a
        hold) and record its one outcome: Dispatched, or RejectedOther when scheduling fails
        (a 503 because its pool lost every endpoint while it waited, or an internal error).
        Without this a request refused after a hold or a wait left flow control unrecorded."""
        self._held.place(item)
        try:
            decision = _run(item.payload)
        except Exception:
            self._outcome(item, REJECTED_OTHER, waited)
            raise
        self._outcome(item, DISPATCHED, waited)
        return decision

    def _refuse(self, item: FlowItem[Job], rule: str, exc: GatewayError) -> None:
        """Fail a queued request that flow control refuses, logging the rule that did."""
        fail(item, _refused(item, rule, exc))

    def _outcome(self, item: FlowItem[Job], outcome: str, waited: float) -> None:
        self.totals[(item.band, outcome)] += 1
        if self.observer is not None:
            job = item.payload
            waited += job.held_s  # a held request's wait began before the queue
            self.observer.flow_outcome(
                pool=job.pool, band=item.band, model=job.model, target=job.target,
                fairness_id=item.flow, priority=job.priority, outcome=outcome, waited_s=waited,
            )  # fmt: skip


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
