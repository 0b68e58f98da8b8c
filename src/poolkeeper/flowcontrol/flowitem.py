"""`FlowItem`: one request in flow control, the bands it queues in (`BANDS`, highest first)
and the dispatcher's verdict on an arrival (`Submitted`).

The vocabulary the dispatcher (`dispatcher.py`), its bands (`band.py`) and its callers (the
EPP's `requestcontrol/flowgate.py`, the virtual fleet's `bench/policies/flowpolicy.py`) share;
`payload` is the caller's, flow control never reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from poolkeeper.api.criticality import Criticality

T = TypeVar("T")

BANDS: tuple[Criticality, ...] = (Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE)


class Submitted(StrEnum):
    DISPATCH = "dispatch"  # go now (the caller schedules it and calls `dispatched`)
    QUEUED = "queued"
    SHED = "shed"  # band mode `shed` and no headroom: 429
    FULL = "full"  # the band's request or byte limit: 429 queue_full
    SATURATED = "saturated"  # the queue ahead cannot drain within its TTL: 429


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
