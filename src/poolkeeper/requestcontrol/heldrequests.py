"""`HeldRequests`: the flow-control gate's `holdNewPrefixes` requests, held in front of each
pool's queue (the async edge of `flowcontrol/prefixhold.py`, one `PrefixHold` per pool).

Before a `queue` band's request enters the dispatcher, the gate offers it here (`offer`): the
Director's `job.prefill` (the scheduler's prefix index and prefill backlogs) says whether it
would open a new long prefill while every candidate is backlogged; if so it is held, outside
the queue (it blocks nothing behind it), counted against its band's bounds with the queue
(`_room_to_hold`). At each of the gate's pumps the oldest `HOLD_ASKS_PER_PUMP` held requests
are asked again (`release`), in arrival order, each released one entering the dispatcher
(the gate's `enter`) before the next is asked; the gate's timer at the oldest's `maxHoldMs`
(`next_release`) releases it whatever the backlog. With `placeUnderBacklog` a released new
long prefix goes only to the candidates under the backlog (`place`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import GatewayError, NoReadyEndpoint
from poolkeeper.flowcontrol.bandconfig import BandMode
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.prefixhold import Held, PrefixHold
from poolkeeper.requestcontrol.flowoutcomes import (
    HOLD_CANCELLED,
    HOLD_CAPPED,
    HOLD_RELEASED,
    deliver,
    fail,
)
from poolkeeper.requestcontrol.ports import Job
from poolkeeper.requestcontrol.types import RoutingDecision

# The gate's logger: one name for everything the flow-control edge logs.
log = logging.getLogger("poolkeeper.requestcontrol.flowgate")

# At each pump, at most this many held requests are asked again (the oldest first; each ask is
# a snapshot and a prefix match, ~0.2-0.3 ms): with hundreds held, asking them all at every
# first byte, end and metrics write blocked the event loop for 80-300 ms. Those not asked wait
# for a later pump or their `maxHoldMs`. With `placeUnderBacklog` a released request's placement
# (`place`, another snapshot and prefix match) counts too (`PrefixHold.release`).
HOLD_ASKS_PER_PUMP = 16


class HeldRequests:
    """The requests `holdNewPrefixes` holds, per pool (see the module docstring). `pools` is
    the gate's dispatchers (read: their queued counts); `enter` offers a released request to
    its pool's dispatcher; `ended` records how a hold ended (`HOLD_*`) and how long it took."""

    def __init__(
        self,
        config: FlowControlConfig,
        *,
        clock: Callable[[], float],
        pools: Mapping[str, FlowDispatcher[Job]],
        enter: Callable[[FlowItem[Job]], RoutingDecision | FlowItem[Job]],
        ended: Callable[[FlowItem[Job], str, float], None],
    ) -> None:
        self.config = config
        self._clock = clock
        self._pools = pools
        self._enter = enter
        self._ended = ended
        self._held: dict[str, PrefixHold[FlowItem[Job]]] = {}  # per pool
        # (pool, band) -> requests and bytes held: counted with the queue by `_room_to_hold`
        self._held_count: Counter[tuple[str, Criticality]] = Counter()
        self._held_bytes: Counter[tuple[str, Criticality]] = Counter()

    def offer(self, item: FlowItem[Job]) -> bool:
        """Hold an arriving request if the rule holds it and its band has room; False: it
        goes to the dispatcher."""
        job = item.payload
        if job.prefill is not None and self._room_to_hold(item) and self.holds(item):
            self._held[job.pool].hold(item, self._clock())
            self._held_count[(job.pool, item.band)] += 1
            self._held_bytes[(job.pool, item.band)] += item.size
            return True
        return False

    def holds(self, item: FlowItem[Job]) -> bool:
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

    def place(self, item: FlowItem[Job]) -> None:
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

    def release(self, now: float) -> None:
        """Ask the oldest held requests of each pool again (`HOLD_ASKS_PER_PUMP`) and send
        those let go, and those at their cap, to the dispatcher (`_release`)."""
        for hold in self._held.values():
            if hold.waiting():
                hold.release(now, self.holds, self._release, asks=HOLD_ASKS_PER_PUMP)

    def _release(self, entry: Held[FlowItem[Job]]) -> None:
        """A held item goes to its pool's dispatcher: dispatched, queued or refused, as an
        arriving request would be; its time held counts as queue time."""
        item = entry.payload
        job = item.payload
        job.held_s = self._clock() - entry.since
        job.released = True
        self._unload(item)
        self._ended(item, HOLD_CAPPED if entry.capped else HOLD_RELEASED, job.held_s)
        try:
            decision = self._enter(item)
        except GatewayError as exc:
            fail(item, exc)
            return
        except Exception:  # a bug below must not kill the pump; the request gets a 500
            log.exception("internal error dispatching a held request")
            fail(item, GatewayError("internal error while routing the request"))
            return
        if isinstance(decision, RoutingDecision):
            deliver(job, decision)

    def remove(self, item: FlowItem[Job]) -> bool:
        """Take a held item out of its hold (client gone); False if it is not held."""
        hold = self._held.get(item.payload.pool)
        entry = hold.remove(item) if hold is not None else None
        if entry is None:
            return False
        item.payload.held_s = self._clock() - entry.since
        self._unload(item)
        self._ended(item, HOLD_CANCELLED, item.payload.held_s)
        return True

    def next_release(self) -> float:
        """When the oldest held request of any pool reaches its cap (inf: none held)."""
        return min((hold.next_release() for hold in self._held.values()), default=math.inf)

    def count(self, pool: str | None = None, band: Criticality | None = None) -> int:
        """Requests held (of one pool or all, of one band or all)."""
        holds = self._held.values() if pool is None else [self._held.get(pool)]
        if band is None:
            return sum(h.waiting() for h in holds if h is not None)
        return sum(e.payload.band is band for h in holds if h is not None for e in h.held)
