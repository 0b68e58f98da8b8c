"""What `FlowGate` holds, as gauges and the pump read it: requests waiting and held, per pool,
band and flow, and the next queue deadline.

`FlowGateReads` is `FlowGate`'s base (requestcontrol/flowgate.py): one class through a base, as
before, so a read costs what it did. Its fields (the pools' dispatchers, the held requests) are
set by `FlowGate.__init__` and declared here for the type checker.
"""

from __future__ import annotations

import math

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import BANDS
from poolkeeper.requestcontrol.heldrequests import HeldRequests
from poolkeeper.requestcontrol.ports import Job


class FlowGateReads:
    """The reads of a `FlowGate`: what waits in its queues and holds."""

    _pools: dict[str, FlowDispatcher[Job]]
    _held: HeldRequests

    def waiting(self, pool: str | None = None, band: Criticality | None = None) -> int:
        pools = self._pools.values() if pool is None else [self._pools.get(pool)]
        return sum(d.waiting(band) for d in pools if d is not None)

    def held(self, pool: str | None = None, band: Criticality | None = None) -> int:
        """Requests `holdNewPrefixes` holds in front of the queue (of one pool or all, of
        one band or all)."""
        return self._held.count(pool, band)

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
