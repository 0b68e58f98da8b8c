"""`DrainRate`: how fast a pool's flow-control queue drains, measured only while something
waits (the fleet's service rate).

The dispatcher refuses a request before its TTL only when it cannot be served within it: the
requests ahead of it in fair order do not drain within its band's TTL at this rate
(`FlowDispatcher.expected_wait`, issue 35). The band's `drainWithinMs` reads it too
(`FlowDispatcher.drains_within`). Pure: time is passed in.
"""

from __future__ import annotations

import math

DRAIN_TAU_S = 10.0  # memory of the measured drain rate (exponential decay, seconds of backlog)
DRAIN_MIN_S = 1.0  # backlogged seconds measured before the rate is trusted to refuse anything
DRAIN_MIN_SENT = 4.0  # and dispatches seen over them


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
