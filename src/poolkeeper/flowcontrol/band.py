"""`Band`: the queue of one priority band of one pool, and its overload state.

Within the band, flows (`flows`: only those with something waiting) are picked by the band's
fairness policy and each flow's next request by its ordering policy (`head`). Once a flow has
had requests waiting without a break for its band's `overloadAfterMs`, the TTL of its requests
queued from then on is the band's `overloadTtlMs` (CoDel's short limit for a standing queue,
per flow as in FQ-CoDel; `BandConfig.deadline`, `deadline_of`): the old ones run out quickly
instead of waiting out the long TTL, and a light flow that drains between its requests keeps
the long one. With `onlyWhileGrowing` the overload rules apply only to a flow whose requests in
the system grow (`observe`, `growing`, `bounded`): a closed population of clients is served
first come first served. A full band pushes out the newest request of its longest flow, or
an overdue one (`make_room`: longest-queue drop). The band also keeps who shares it
(`running`, `recent`, `present`) and the places kept for a flow (`reserved`, `sharing.py`).

Pure and synchronous: time is passed in; `FlowDispatcher` (`dispatcher.py`) owns one per band.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from poolkeeper.flowcontrol.answers import AnswerAdvance
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.flowcontrol.fairness import FairnessPolicy
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.ordering import FcfsAdaptiveLifo, OrderingPolicy, rescued

T = TypeVar("T")

# How long a flow whose last request ended still counts as present in its band (sharing it, and
# not idle for the fairness policy's lift): a closed loop's clients are on their way back. Live
# at load 15-20 on 2 cores, all 3 clients of the light model were between an answer and their
# next request for up to 1.4 s; counted absent after 0.5 s, the band looked uncontended and the
# busier model's 27 waiting requests went into the servers' queues at once (beta/alpha 0.49).
PRESENT_S = 5.0
GROWTH_WINDOW_S = 1.0  # a flow's requests in the system are compared across windows this long
MAX_RECENT = 1024  # flows whose last request just ended, remembered before pruning
GROWTH_MIN = 4  # growth per window that counts (and a tenth of the flow's waiting requests)


class Band(Generic[T]):
    """The queue of one band of one pool and its overload state (see the module docstring)."""

    __slots__ = (
        "answers", "band_mark", "busy_since", "bytes", "config", "count", "drainable",
        "fairness", "flows", "marks", "ordering", "overload_at", "recent", "refused", "reserved",
        "running",
    )  # fmt: skip

    def __init__(
        self,
        fairness: FairnessPolicy,
        ordering: OrderingPolicy,
        config: BandConfig,
        *,
        answers_ahead: bool = True,
        drainable: Callable[[float], bool] = lambda _within_s: False,
    ) -> None:
        self.fairness = fairness
        # Whether the pool's whole queue drains within the given seconds at the measured rate
        # (`FlowDispatcher.drains_within`): the band's `drainWithinMs` reads it.
        self.drainable = drainable
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
        if item is not waiting[0] and self.draining():
            band = self.config
            saved = rescued(waiting, now, band.rescue_after_ms / 1000, band.rescue_before_ms / 1000)
            if saved is not None:
                return saved  # the aging bound: served before it is late (`drainWithinMs`)
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
            if len(self.marks) >= MAX_RECENT:
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

    def make_room(
        self, item: FlowItem[T], band: BandConfig, now: float, pushed_out: list[FlowItem[T]]
    ) -> bool:
        """Room for `item` within the band's bounds, pushing out the newest requests of the
        longest flow if `item`'s flow is shorter (longest-queue drop: one busy flow must not
        fill the band and lock the others out); in overload (the ordering policy finds the
        longest flow's request overdue: today its oldest waited past `lifoAfterMs`) that one
        instead, even from `item`'s own flow: it can no longer be served in time, the
        newcomer can (each pushed out is appended to `pushed_out`). False: no room, `item` is
        refused."""
        requests, size = band.max_requests, band.max_bytes
        while self.count + 1 > requests or self.bytes + item.size > size:
            if item.size > size:
                return False
            longest = max(self.flows, key=lambda f: len(self.flows[f]), default=None)
            if longest is None:
                return False
            waiting = self.flows[longest]
            mine = len(self.flows.get(item.flow, ()))
            overdue = (
                self.ordering.overdue(waiting, now)
                if self.overloaded(longest) or not isinstance(self.ordering, FcfsAdaptiveLifo)
                else None
            )
            if overdue is not None:
                victim = overdue
            elif longest == item.flow or len(waiting) <= mine + 1:
                return False
            else:
                victim = waiting[-1]
            self.remove(victim)
            victim.queued = False
            pushed_out.append(victim)
        return True

    def items(self) -> Iterator[FlowItem[T]]:
        for queue in self.flows.values():
            yield from queue


def _roll(mark: list[float], now: float, n: int) -> None:
    """Close the growth window of `mark` once it is `GROWTH_WINDOW_S` long (see `Band`)."""
    if now - mark[0] >= GROWTH_WINDOW_S:
        mark[2], mark[3], mark[4] = mark[3], n - mark[1], mark[0]
        mark[0], mark[1] = now, n
