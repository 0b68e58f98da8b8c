"""`FlowRoom`: the flow-control gate's headroom question, asked on a request's candidates of
the moment: may it go now, and to which endpoints (`fits`, `spread`).

The answer's endpoints go to the `job.run` that follows in the same synchronous step (the
gate's fast path or its pump), as `job.ready`, so a dispatch reads the pool once, not twice
(late binding). The pure check is `flowcontrol/headroom.py`'s `Headroom`; the places the
dispatcher keeps for returning flows and whether flows contend for the band come from the
pool's `FlowDispatcher`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from poolkeeper.errors import NoReadyEndpoint
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.requestcontrol.ports import Job


class FlowRoom:
    """Headroom on a job's candidates (see the module docstring)."""

    def __init__(
        self,
        config: FlowControlConfig,
        headroom: Headroom,
        *,
        clock: Callable[[], float],
        pools: Mapping[str, FlowDispatcher[Job]],
    ) -> None:
        self.config = config
        self.headroom = headroom
        self._clock = clock
        self._pools = pools  # the gate's dispatchers, one per pool

    def fits(self, item: FlowItem[Job]) -> bool:
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
            band = band.without_avoidance()  # placed by the backlog's room (`HeldRequests.place`)
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

    def spread(self, job: Job) -> None:
        """The candidates of a request sent at once, narrowed by its band's
        `avoidPrefillTokens` (`Headroom.spread`); read once, as the scheduler would."""
        try:
            states = job.states()
        except NoReadyEndpoint:
            return  # the scheduler answers 503
        band = self.config.bands.of(job.criticality)
        job.ready = list(self.headroom.spread(states, band, job.target, job.cached))
