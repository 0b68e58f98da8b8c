"""When the scheduler forgets an endpoint: absent from the pool for a grace, or replaced.

The scheduler keeps per endpoint (ip:port) what took traffic to learn: prefix-index blocks, the
hashring, exact KV-event blocks and their subscription, the prefill backlog, TTFT samples
(`Scheduler.forget_endpoints`). An endpoint leaving the datastore is often not gone: in
Kubernetes a pod that misses a readiness probe (the busiest ones do) leaves on that one event
and returns on the next, its engine cache intact, and a watch re-list may briefly list no pool.
So an endpoint is forgotten only once it has stayed absent for `FORGET_AFTER_S` (upstream's
prefix plugins drop indexer entries of pods absent at a check every `podActiveCheckInterval`,
2 minutes). An endpoint whose identity changed at the same ip:port (another pod on a reused IP,
a renamed endpoint in a files reload: what makes the datastore drop its metrics) is forgotten
at once: the new server's cache is empty.

`AbsentEndpoints` decides (pure: times are handed in); `EndpointForgetter` is the datastore
listener that feeds it pool changes and sweeps it on the running loop when an absence is due
(a timer, never per request or per metrics write), cancelled when the runtime stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Final

from poolkeeper.datastore.endpoint import Endpoint
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.snapshot import DatastoreSnapshot
from poolkeeper.datastore.store import ChangeKind
from poolkeeper.scheduling.scheduler import Scheduler

__all__ = ["FORGET_AFTER_S", "AbsentEndpoints", "EndpointForgetter"]

FORGET_AFTER_S: Final = 120.0  # upstream's podActiveCheckInterval


class AbsentEndpoints:
    """The endpoints seen at each ip:port, present or absent for less than `grace_s`, and
    which of them are to be forgotten now."""

    def __init__(self, start: Iterable[Endpoint], *, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._seen = {e.hostport: e for e in start}  # last endpoint at each kept ip:port
        self._gone_at: dict[str, float] = {}  # ip:port -> when it left (absent ones only)

    def changed(self, endpoints: Iterable[Endpoint], now: float) -> set[str]:
        """The pool is now `endpoints`: the ip:ports to forget at once (another endpoint at
        the same ip:port, and absences already due)."""
        current = {e.hostport: e for e in endpoints}
        replaced = {key for key, e in current.items() if self._seen.get(key, e) != e}
        for key in self._seen.keys() - current.keys():
            self._gone_at.setdefault(key, now)  # a second change keeps the first absence
        for key in current:
            self._gone_at.pop(key, None)  # back within the grace: its state stays
        self._seen.update(current)
        return replaced | self.due(now)

    def due(self, now: float) -> set[str]:
        """The ip:ports absent for `grace_s` by `now`, no longer tracked once returned."""
        gone = {key for key, at in self._gone_at.items() if now - at >= self.grace_s}
        for key in gone:
            del self._gone_at[key]
            del self._seen[key]
        return gone

    def kept(self) -> set[str]:
        """The ip:ports whose state stays: present, or absent within the grace."""
        return set(self._seen)

    def next_due(self) -> float | None:
        """When the earliest absence is due (None: none absent)."""
        return min(self._gone_at.values()) + self.grace_s if self._gone_at else None


class EndpointForgetter:
    """A datastore listener (pool changes only) calling `scheduler.forget_endpoints` (and the
    in-flight `tracker`'s) with what stays when `AbsentEndpoints` says some endpoint is to go:
    at the change for a replaced endpoint, from a timer on the running loop for an absence.
    Without a running loop (a write before the runtime's loop) no timer is armed and the next
    pool change sweeps.
    `stop` cancels the pending timer and arms no other (the runtime's shutdown: a sweep due
    after it would run on a loop being torn down, or keep a test's loop busy)."""

    def __init__(
        self,
        scheduler: Scheduler,
        start: DatastoreSnapshot,
        *,
        clock: Callable[[], float],
        grace_s: float = FORGET_AFTER_S,
        tracker: InflightTracker | None = None,
    ) -> None:
        self._scheduler, self._tracker, self._clock = scheduler, tracker, clock
        self._absent = AbsentEndpoints(start.all_endpoints(), grace_s=grace_s)
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = False

    @property
    def armed(self) -> bool:
        """Whether a sweep is pending on the loop."""
        return self._timer is not None

    def __call__(self, snapshot: DatastoreSnapshot, kind: ChangeKind) -> None:
        self._forget(self._absent.changed(snapshot.all_endpoints(), self._clock()))

    def stop(self) -> None:
        self._stopped = True
        self._disarm()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _forget(self, gone: set[str]) -> None:
        if gone:
            keep = self._absent.kept() - gone
            self._scheduler.forget_endpoints(keep)
            if self._tracker is not None:
                self._tracker.forget_endpoints(keep)
        self._disarm()
        due = self._absent.next_due()
        if due is None or self._stopped:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        # A timer that fires early by the clock's resolution finds nothing due and re-arms.
        self._timer = loop.call_later(max(0.0, due - self._clock()), self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        self._forget(self._absent.due(self._clock()))
