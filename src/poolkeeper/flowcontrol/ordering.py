"""Ordering within a flow: which of one flow's waiting requests goes next (a policy seam).

The dispatcher keeps each flow's waiting requests in arrival order (a deque, oldest first) and
asks the band's `OrderingPolicy` two questions: which request is the flow's head (`head`), and
which request, if any, can no longer be served in time (`overdue`: pushed out first when the
band is full, even from the newcomer's own flow). A new policy is a class with these two
methods and a factory from a band's settings (`OrderingFactory`), handed to the dispatcher in
`FlowPolicies` (`dispatcher.py`); `dispatcher.py` itself does not change.

Today's policy, `FcfsAdaptiveLifo`: first come first served, except in overload: while the
flow's oldest request has waited longer than the band's `lifoAfterMs`, its newest goes first
(adaptive LIFO, as in Facebook's and CoDel-style server queues), and that oldest is overdue.
A FIFO queue in sustained overload makes every request wait the whole queue, so every answer
is late; newest-first serves the requests that can still be on time, and the old ones run out
at their TTL or are pushed out of a full band first. With a band's `shortestFirst`, while the
overload rules apply to the flow, its request with the fewest prompt tokens goes first instead,
from the first moment of the overload rather than after `lifoAfterMs` (among equals the order
is the plain one: oldest first, newest once the flow is late): the p90 and the count of answers
in time are those of the many short prompts, and a long prompt's prefill takes a step's worth
of server time that several short ones would share
(docs/notes/2026-12-07-size-aware-placement.md). The oldest stays overdue as before.
Pure; `now` is passed in.

`rescued` is the aging bound the dispatcher lays over adaptive LIFO while the pool's queue
drains in time (a band's `drainWithinMs`): the oldest request aged within the rescue window
goes before the newest, so newest-first does not pass a request over until it is late.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVar

from poolkeeper.flowcontrol.bandconfig import BandConfig


class Arrived(Protocol):
    """What ordering reads of a waiting request (the dispatcher's `FlowItem`)."""

    @property
    def arrived(self) -> float: ...

    @property
    def tokens(self) -> int: ...


A = TypeVar("A", bound=Arrived)


class OrderingPolicy(Protocol):
    """Order within one flow of one band (see the module docstring)."""

    def head(self, waiting: deque[A], now: float) -> A:
        """The request of this flow to dispatch next; `waiting` is oldest first, not empty."""
        ...

    def overdue(self, waiting: deque[A], now: float) -> A | None:
        """A request of this flow that can no longer be served in time (pushed out first
        when the band is full), or None."""
        ...


OrderingFactory = Callable[[BandConfig], OrderingPolicy]


class FcfsAdaptiveLifo:
    """First come first served; newest first while the oldest is late (`lifoAfterMs`), or
    shortest prompt first in overload (`shortestFirst`)."""

    __slots__ = ("lifo_after_s", "shortest_first")

    def __init__(self, lifo_after_s: float | None, shortest_first: bool = False) -> None:
        self.lifo_after_s = lifo_after_s  # None: always FCFS
        # The dispatcher asks for a head only while the overload rules apply to the flow
        # (`Band.overloaded`); otherwise it serves the oldest without asking.
        self.shortest_first = shortest_first

    @classmethod
    def of(cls, band: BandConfig) -> FcfsAdaptiveLifo:
        return cls(band.lifo_after_s, band.shortest_first)

    def head(self, waiting: deque[A], now: float) -> A:
        late = self.lifo_after_s is not None and now - waiting[0].arrived > self.lifo_after_s
        if self.shortest_first:  # among equals: oldest, or newest once late (min keeps the first)
            return min(reversed(waiting) if late else waiting, key=_prompt_tokens)
        return waiting[-1] if late else waiting[0]

    def overdue(self, waiting: deque[A], now: float) -> A | None:
        if self.lifo_after_s is not None and now - waiting[0].arrived > self.lifo_after_s:
            return waiting[0]
        return None


def _prompt_tokens(item: Arrived) -> int:
    return item.tokens


def rescued(waiting: deque[A], now: float, after_s: float, before_s: float) -> A | None:
    """The oldest request of `waiting` (oldest first) that has waited at least `after_s` and
    less than `before_s`, or None. Ages fall along the deque, so the scan stops at the first
    request younger than `after_s`; the ones past `before_s` it skips are few, since the
    caller rescues only while the whole queue drains within about a second."""
    for item in waiting:
        age = now - item.arrived
        if age < after_s:
            return None
        if age < before_s:
            return item
    return None
