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
`FlowPolicies` the dispatcher is built with, so a new policy needs no edit here. Once a flow has had
requests waiting without a break for its band's `overloadAfterMs`, the TTL of its requests
queued from then on is the band's `overloadTtlMs` (CoDel's short limit for a standing queue,
per flow as in FQ-CoDel; `BandConfig.deadline`): the old ones run out quickly instead of
waiting out the long TTL, and a light flow that drains between its requests keeps the long one.
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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.answers import AnswerAdvance
from poolkeeper.flowcontrol.catchup import CatchUp
from poolkeeper.flowcontrol.config import BandConfig, BandMode, FlowControlConfig
from poolkeeper.flowcontrol.fairness import FairnessFactory, FairnessPolicy, vtc_fairness
from poolkeeper.flowcontrol.ordering import (
    FcfsAdaptiveLifo,
    OrderingFactory,
    OrderingPolicy,
    rescued,
)

T = TypeVar("T")

BANDS: tuple[Criticality, ...] = (Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE)


class Submitted(StrEnum):
    DISPATCH = "dispatch"  # go now (the caller schedules it and calls `dispatched`)
    QUEUED = "queued"
    SHED = "shed"  # band mode `shed` and no headroom: 429
    FULL = "full"  # the band's request or byte limit: 429 queue_full
    SATURATED = "saturated"  # the queue ahead cannot drain within its TTL: 429


# How long a place freed by the answer of an under-served flow with nothing waiting is kept for
# it: a closed-loop client's round trip (the answer through Envoy to the client, its next
# request back), 3-8 ms at the median on an idle machine but 80 ms at the median and up to
# 0.9 s on this project's 2-core VM at load 15-18. The place is one in a server's short queue,
# never an idle batch slot (`Headroom.room`), so a long hold costs the servers nothing.
HOLD_S = 0.5
# How long a flow whose last request ended still counts as present in its band (sharing it, and
# not idle for the fairness policy's lift): a closed loop's clients are on their way back. Live
# at load 15-20 on 2 cores, all 3 clients of the light model were between an answer and their
# next request for up to 1.4 s; counted absent after 0.5 s, the band looked uncontended and the
# busier model's 27 waiting requests went into the servers' queues at once (beta/alpha 0.49).
PRESENT_S = 5.0
DRAIN_TAU_S = 10.0  # memory of the measured drain rate (exponential decay, seconds of backlog)
DRAIN_MIN_S = 1.0  # backlogged seconds measured before the rate is trusted to refuse anything
DRAIN_MIN_SENT = 4.0  # and dispatches seen over them
GROWTH_WINDOW_S = 1.0  # a flow's requests in the system are compared across windows this long
_MAX_RECENT = 1024  # flows whose last request just ended, remembered before pruning
GROWTH_MIN = 4  # growth per window that counts (and a tenth of the flow's waiting requests)


class DrainRate:
    """How fast this pool's queue drains: requests dispatched from the queue per second of
    backlog (time with something waiting), exponentially weighted. While something waits,
    no endpoint has room, so this is the rate at which the fleet frees room: its measured
    service rate. Unknown (None) until `DRAIN_MIN_S` of backlog and `DRAIN_MIN_SENT`
    dispatches were seen; time with nothing waiting does not count (nor lower the rate)."""

    __slots__ = ("_busy_s", "_last", "_sent")

    def __init__(self) -> None:
        self._busy_s = 0.0
        self._sent = 0.0
        self._last: float | None = None  # when the current backlog was last accounted

    def account(self, now: float, sent: int, still_waiting: bool) -> None:
        last = self._last
        if last is not None and now > last:
            dt = now - last
            decay = math.exp(-dt / DRAIN_TAU_S)
            self._busy_s = self._busy_s * decay + dt
            self._sent *= decay
        self._sent += sent
        self._last = now if still_waiting else None

    def start(self, now: float) -> None:
        self._last = now

    def rate(self) -> float | None:
        if self._busy_s < DRAIN_MIN_S or self._sent < DRAIN_MIN_SENT:
            return None
        return self._sent / self._busy_s


@dataclass(eq=False, slots=True)
class FlowItem(Generic[T]):
    """One request in flow control. `payload` is the caller's."""

    payload: T
    band: Criticality
    flow: str
    tokens: int  # prompt tokens, charged to the flow at dispatch
    size: int  # request bytes, counted against maxBytes while queued
    arrived: float = 0.0
    deadline: float = math.inf
    seq: int = field(default=0)
    queued: bool = False
    bound: int = 0  # the request's bound on its answer (max_tokens; 0: none), `answers.py`


@dataclass(frozen=True, slots=True)
class FlowPolicies:
    """The policies a dispatcher orders its queue by, one of each per band (the seams of
    `fairness.py` and `ordering.py`); the defaults are today's behaviour."""

    fairness: FairnessFactory = vtc_fairness
    ordering: OrderingFactory = FcfsAdaptiveLifo.of


class _Band(Generic[T]):
    __slots__ = (
        "answers", "band_mark", "busy_since", "bytes", "catch_up", "config", "count", "drainable",
        "fairness", "flows", "marks", "ordering", "overload_at", "recent", "refused", "reserved",
        "running", "service_rate",
    )  # fmt: skip

    def __init__(
        self,
        fairness: FairnessPolicy,
        ordering: OrderingPolicy,
        config: BandConfig,
        *,
        answers_ahead: bool = True,
        drainable: Callable[[float], bool] = lambda _within_s: False,
        service_rate: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.fairness = fairness
        # Whether the pool's whole queue drains within the given seconds at the measured rate
        # (`FlowDispatcher.drains_within`): the band's `drainWithinMs` reads it.
        self.drainable = drainable
        # The pool's measured drain rate (`DrainRate`): `catchUpWindowMs` compares arrivals to it.
        self.service_rate = service_rate
        self.ordering = ordering
        self.config = config
        self.flows: dict[str, deque[FlowItem[T]]] = {}  # only flows with something waiting
        self.count = 0
        self.bytes = 0
        # Per waiting flow: since when it has had requests waiting without a break (CoDel per
        # flow, as FQ-CoDel: a flow that keeps a standing queue gets the short overload TTL, a
        # light flow that drains between its requests does not).
        self.busy_since: dict[str, float] = {}
        # Slots kept for an under-served flow whose request just ended: flow -> (count, until).
        self.reserved: dict[str, tuple[int, float]] = {}
        # Per flow with nothing left in the band: when its last request ended. It still shares
        # the band for `PRESENT_S` (`FlowDispatcher.sharing`, `present`).
        self.recent: dict[str, float] = {}
        # Requests dispatched and not completed, per flow (flows with none are dropped).
        self.running: dict[str, int] = {}
        # Answers charged ahead, at dispatch (`answers.py`).
        self.answers = AnswerAdvance(ahead=answers_ahead)
        # Per flow, its requests in the system (waiting + running) as sampled at arrivals:
        # [window start, count then, growth over the window before, growth over the last,
        # when the last window started].
        self.marks: dict[str, list[float]] = {}
        # The same for the whole band: many small flows past capacity together (multi-LoRA
        # adapters) grow too little each to be seen one by one.
        self.band_mark: list[float] = []
        # `onlyWhileGrowing`: when a flow entered sustained overload (kept until its queue
        # empties); the overload TTL applies to its requests from then on.
        self.overload_at: dict[str, float] = {}
        # Flows whose overload TTL refused a request in their current busy period: the
        # `drainWithinMs` exemption is over for them until their queue empties.
        self.refused: set[str] = set()
        # `catchUpWindowMs`: whether the band's queue is shrinking (`catchup.py`).
        window = config.catch_up_window_ms
        self.catch_up = None if window is None else CatchUp(window / 1000.0)

    def push(self, item: FlowItem[T]) -> None:
        queue = self.flows.get(item.flow)
        if queue is None:
            # A flow with requests still in service is not idle: it keeps its counter. Lifted
            # each time its queue went empty for a moment, a closed loop of 3 clients (every
            # request dispatched at once, so often nothing waiting) lost a request's worth of
            # service each time, live beta/alpha 0.91 (issue 35).
            if not self.running.get(item.flow) and not self.present(item.flow, item.arrived):
                self.fairness.activate(item.flow, self.flows)
            queue = self.flows[item.flow] = deque()
            self.busy_since[item.flow] = item.arrived
        queue.append(item)
        self.count += 1
        self.bytes += item.size
        if self.catch_up is not None:
            self.catch_up.joined(item.arrived)

    def present(self, flow: str, now: float) -> bool:
        """`flow`'s last request ended less than `PRESENT_S` ago (`recent`)."""
        ended = self.recent.get(flow)
        return ended is not None and now - ended <= PRESENT_S

    def head(self, now: float) -> FlowItem[T] | None:
        """The next item: the fairness policy's flow, the ordering policy's item of it."""
        flows = self.flows
        flow = self.fairness.pick(flows, lambda f: flows[f][0].seq)
        if flow is None:
            return None
        waiting = flows[flow]
        if not self.overloaded(flow) and isinstance(self.ordering, FcfsAdaptiveLifo):
            return waiting[0]  # a bounded flow: no adaptive LIFO (an overload rule)
        item = self.ordering.head(waiting, now)
        if item is waiting[0]:
            return item
        band = self.config
        if self.draining():
            saved = rescued(waiting, now, band.rescue_after_ms / 1000, band.rescue_before_ms / 1000)
            if saved is not None:
                return saved  # the aging bound: served before it is late (`drainWithinMs`)
        elif self.catch_up is not None and self.catch_up.shrinking(now, self.service_rate()):
            # `catchUpWindowMs`: the newest can wait; the oldest still in time goes first.
            saved = rescued(waiting, now, 0.0, band.rescue_before_ms / 1000)
            if saved is not None:
                return saved
        return item

    def draining(self) -> bool:
        """The band's `drainWithinMs` holds now: the pool's queue drains within it."""
        within = self.config.drain_within_ms
        return within is not None and self.drainable(within / 1000)

    def overloaded(self, flow: str) -> bool:
        """Whether adaptive LIFO applies to `flow`: always without `onlyWhileGrowing`; with
        it, unless the flow is a bounded population (`bounded`). A burst is newest-first as
        before; a closed population, once its queue has stood a window without growing, is
        served first come first served (newest-first would starve its oldest requests until
        their TTL: the clients' next requests keep arriving ahead of them)."""
        return not self.config.only_while_growing or self.band_growing() or not self.bounded(flow)

    def bounded(self, flow: str) -> bool:
        """The flow's queue has stood for a whole window and its requests in the system did
        not grow over it (by more than the margin of `growing`), and it has not entered
        sustained overload."""
        mark = self.marks.get(flow)
        busy = self.busy_since.get(flow)
        if mark is None or busy is None or flow in self.overload_at or mark[4] < busy:
            return False
        return mark[3] <= max(GROWTH_MIN, len(self.flows.get(flow, ())) / 10)

    def growing(self, flow: str) -> bool:
        """The flow's requests in the system grew over the last two windows, each time by more
        than `GROWTH_MIN` and a tenth of its waiting requests: open-loop overload. A closed
        population cannot (its requests are bounded by its clients; between two arrivals the
        count differs by the clients whose answers are on their way)."""
        mark = self.marks.get(flow)
        if mark is None:
            return False
        margin = max(GROWTH_MIN, len(self.flows.get(flow, ())) / 10)
        return mark[3] > margin and mark[2] > margin

    def band_growing(self) -> bool:
        """`growing` for the band's requests in the system as a whole."""
        mark = self.band_mark
        if not mark:
            return False
        margin = max(GROWTH_MIN, self.count / 10)
        return mark[3] > margin and mark[2] > margin

    def observe(self, flow: str, now: float) -> None:
        """Sample the flow's requests in the system at an arrival (the arriving one counted)."""
        n = len(self.flows.get(flow, ())) + self.running.get(flow, 0) + 1
        mark = self.marks.get(flow)
        if mark is None:
            if len(self.marks) >= _MAX_RECENT:
                self._forget_idle_marks(now)
            mark = self.marks[flow] = [now, n, 0.0, 0.0, -math.inf]
        _roll(mark, now, n)
        total = self.count + sum(self.running.values()) + 1
        if not self.band_mark:
            self.band_mark = [now, total, 0.0, 0.0, -math.inf]
        _roll(self.band_mark, now, total)
        busy = self.busy_since.get(flow)
        band = self.config
        if (
            band.only_while_growing
            and band.overload_ttl_ms is not None
            and busy is not None
            and flow not in self.overload_at
            and now - busy >= band.overload_after_ms / 1000.0
            and (self.growing(flow) or self.band_growing())
        ):
            self.overload_at[flow] = now

    def _forget_idle_marks(self, now: float) -> None:
        """Drop the growth marks of flows with nothing waiting or running whose last window
        began two windows ago: flows are whatever clients name (a fairness id, a model name),
        so without this a stream of one-off names grows the table without bound. Such a mark
        says nothing current (its flow's next arrival would compare against a count from
        before its idle spell); the table then holds the live flows plus those seen in the
        last two windows."""
        stale = now - 2 * GROWTH_WINDOW_S
        self.marks = {
            f: m
            for f, m in self.marks.items()
            if f in self.flows or f in self.running or m[0] > stale
        }

    def deadline_of(self, item: FlowItem[T]) -> float:
        """When `item` times out: its TTL, or with `onlyWhileGrowing` the overload TTL once
        its flow entered sustained overload (no later than that moment for a request that has
        already waited that long, as CoDel's rule treats a standing queue: deadlines stay in
        arrival order along the flow). Not while the band's `drainWithinMs` holds (`draining`):
        the deadline then moves with the queue, which the pump's `expire` follows at each call."""
        at = self.overload_at.get(item.flow)
        ttl = self.config.overload_ttl_ms
        if at is None or ttl is None:
            return item.deadline
        if item.flow not in self.refused and self.draining():
            return item.deadline  # `drainWithinMs`: a queue served in time refuses nothing early
        return min(item.deadline, max(item.arrived + ttl / 1000.0, at))

    def remove(self, item: FlowItem[T]) -> None:
        queue = self.flows[item.flow]
        if queue[0] is item:
            queue.popleft()
        elif queue[-1] is item:
            queue.pop()
        else:
            queue.remove(item)
        self.count -= 1
        self.bytes -= item.size
        if not queue:
            del self.flows[item.flow]
            del self.busy_since[item.flow]
            self.overload_at.pop(item.flow, None)
            self.refused.discard(item.flow)
            self.fairness.deactivate(item.flow, self.flows)

    def items(self) -> Iterator[FlowItem[T]]:
        for queue in self.flows.values():
            yield from queue


def _roll(mark: list[float], now: float, n: int) -> None:
    """Close the growth window of `mark` once it is `GROWTH_WINDOW_S` long (see `_Band`)."""
    if now - mark[0] >= GROWTH_WINDOW_S:
        mark[2], mark[3], mark[4] = mark[3], n - mark[1], mark[0]
        mark[0], mark[1] = now, n


class FlowDispatcher(Generic[T]):
    """Bands, fairness and bounds of one pool (see the module docstring)."""

    def __init__(self, config: FlowControlConfig, policies: FlowPolicies | None = None) -> None:
        self.config = config
        policies = policies if policies is not None else FlowPolicies()
        self.drain = DrainRate()
        self._bands: dict[Criticality, _Band[T]] = {
            b: _Band(
                policies.fairness(config, b),
                policies.ordering(config.bands.of(b)),
                config.bands.of(b),
                answers_ahead=config.charge_answers_ahead,
                drainable=self.drains_within,
                service_rate=self.drain.rate,
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
        if self._take_reserved(item, now, fits):
            return Submitted.DISPATCH
        if not self._waiting_at_or_above(item.band) and fits(item):
            return Submitted.DISPATCH
        if band.mode is BandMode.SHED:
            return Submitted.SHED
        queue = self._bands[item.band]
        if not self._make_room(queue, item, band, now):
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

    def _make_room(self, queue: _Band[T], item: FlowItem[T], band: BandConfig, now: float) -> bool:
        """Room for `item` within the band's bounds, pushing out the newest requests of the
        longest flow if `item`'s flow is shorter (longest-queue drop: one busy flow must not
        fill the band and lock the others out); in overload (the ordering policy finds the
        longest flow's request overdue: today its oldest waited past `lifoAfterMs`) that one
        instead, even from `item`'s own flow: it can no longer be served in time, the
        newcomer can. False: no room, `item` is refused."""
        requests, size = band.max_requests, band.max_bytes
        while queue.count + 1 > requests or queue.bytes + item.size > size:
            if item.size > size:
                return False
            longest = max(queue.flows, key=lambda f: len(queue.flows[f]), default=None)
            if longest is None:
                return False
            waiting = queue.flows[longest]
            mine = len(queue.flows.get(item.flow, ()))
            overdue = (
                queue.ordering.overdue(waiting, now)
                if queue.overloaded(longest) or not isinstance(queue.ordering, FcfsAdaptiveLifo)
                else None
            )
            if overdue is not None:
                victim = overdue
            elif longest == item.flow or len(waiting) <= mine + 1:
                return False
            else:
                victim = waiting[-1]
            queue.remove(victim)
            victim.queued = False
            self.pushed_out.append(victim)
        return True

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

    def _drains_in_time(self, queue: _Band[T], item: FlowItem[T], band: BandConfig) -> bool:
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
        `now`, keep the freed place for `flow` a moment (`HOLD_S`)
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
        if now is None or flow in queue.flows:
            return
        if left <= 0:
            queue.recent[flow] = now
            if len(queue.recent) > _MAX_RECENT:  # many small flows: keep only the recent ones
                queue.recent = {f: t for f, t in queue.recent.items() if now - t <= PRESENT_S}
        if not queue.count:
            return
        counter = queue.fairness.counter(flow)
        if all(counter <= queue.fairness.counter(f) for f in queue.flows):
            held, _until = queue.reserved.get(flow, (0, now))
            queue.reserved[flow] = (held + 1, now + HOLD_S)

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
        completed), counting with `now` a flow whose last request ended less than `PRESENT_S`
        ago: a closed loop's clients are then on their way back (see `PRESENT_S`)."""
        queue = self._bands[band]
        if len(queue.flows) >= 2:
            return True
        seen = len(queue.flows)
        for flow in queue.running:
            if flow not in queue.flows:
                seen += 1
                if seen >= 2:
                    return True
        if now is None or not queue.recent:
            return False
        for flow, ended in list(queue.recent.items()):
            if now - ended > PRESENT_S:
                del queue.recent[flow]
            elif flow not in queue.running and flow not in queue.flows:  # not counted above
                seen += 1
                if seen >= 2:
                    return True
        return False

    def kept(self, item: FlowItem[T], now: float) -> int:
        """Slots kept for flows other than `item`'s, in `item`'s band and the bands above:
        `fits` must leave that many free when it answers for `item`."""
        total = 0
        for b in BANDS:
            if b.rank < item.band.rank:
                break
            queue = self._bands[b]
            for flow, (held, until) in list(queue.reserved.items()):
                if until < now:
                    del queue.reserved[flow]
                elif flow != item.flow or b is not item.band:
                    total += held
        return total

    def _take_reserved(
        self, item: FlowItem[T], now: float, fits: Callable[[FlowItem[T]], bool]
    ) -> bool:
        """A newcomer of a flow a slot is kept for takes it (if the slot is still there)."""
        queue = self._bands[item.band]
        found = queue.reserved.get(item.flow)
        if found is None:
            return False
        held, until = found
        if until < now:
            del queue.reserved[item.flow]
            return False
        if not fits(item):
            return False
        if held > 1:
            queue.reserved[item.flow] = (held - 1, until)
        else:
            del queue.reserved[item.flow]
        return True

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
                if queue.catch_up is not None:
                    queue.catch_up.left(now)
                self._release_reserved(queue, item.flow)
                self.dispatched(item)
                go(item)
                sent += 1
        return sent

    @staticmethod
    def _release_reserved(queue: _Band[T], flow: str) -> None:
        found = queue.reserved.pop(flow, None)
        if found is not None and found[0] > 1:
            queue.reserved[flow] = (found[0] - 1, found[1])

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
