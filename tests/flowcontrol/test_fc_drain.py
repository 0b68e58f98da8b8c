"""A band's `drainWithinMs` (issue 38): while the pool's queue drains in time, adaptive LIFO
rescues a request before it is late (an aging bound) and the overload TTL refuses nothing;
otherwise both overload rules stay as they were."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.ordering import rescued

S = Criticality.STANDARD


@dataclass
class _Waiting:
    name: str
    arrived: float
    tokens: int = 0


def _config(**standard: Any) -> FlowControlConfig:
    return FlowControlConfig.model_validate({"bands": {"standard": standard}})


def _item(name: str) -> FlowItem[str]:
    return FlowItem(name, S, "m", 10, 100)


def never(_item: FlowItem[str]) -> bool:
    return False


def _one() -> Callable[[FlowItem[str]], bool]:
    """A `fits` with room for one request (the pump counts it before asking again)."""
    asked: list[bool] = []

    def fits(_item: FlowItem[str]) -> bool:
        asked.append(True)
        return len(asked) == 1

    return fits


def _drop(_item: FlowItem[str]) -> None:
    return None


def _measure_rate(d: FlowDispatcher[str], per_s: int, until: float) -> float:
    """Queue a backlog at 0 and pump `per_s` a second from it until `until`: the measured
    drain rate is then `per_s`. Returns the time of the last pump."""
    for n in range(int(per_s * until) + 1):
        d.submit(_item(f"old{n}"), 0.0, never)
    t = 0.0
    while t < until:
        t = round(t + 1 / per_s, 6)
        d.pump(t, _one(), _drop)
    return t


def test_rescued_is_the_oldest_request_aged_within_the_window() -> None:
    waiting = deque(_Waiting(n, a) for n, a in [("a", 0.0), ("b", 1.0), ("c", 1.5), ("d", 2.9)])
    assert rescued(waiting, 2.5, 1.2, 1.8) is waiting[1]  # a waited 2.5 s (past), b 1.5 s
    assert rescued(waiting, 2.9, 1.2, 1.8) is waiting[2]  # b waited 1.9 s (past), c 1.4 s
    assert rescued(waiting, 2.0, 1.2, 1.8) is None  # a waited 2.0 s (past), b only 1.0 s
    assert rescued(deque([_Waiting("x", 0.0)]), 5.0, 1.2, 1.8) is None


def test_lifo_rescues_an_aged_request_while_the_queue_drains_in_time() -> None:
    """Newest first passes over a request; once it has waited `rescueAfterMs` it goes first,
    as long as the whole queue drains within `drainWithinMs` at the measured rate."""
    rules = {"lifoAfterMs": 200, "onlyWhileGrowing": False}
    d = FlowDispatcher[str](_config(**rules, drainWithinMs=1000))
    plain = FlowDispatcher[str](_config(**rules))
    for disp in (d, plain):
        t = _measure_rate(disp, 10, 2.0)  # 10 a second, the backlog drained to a few
        assert disp.drain.rate() == pytest.approx(10.0, rel=0.05)
        for item in disp.items(S):
            disp.cancel(item)
        for k, name in enumerate("abcde"):  # a waited 1.4 s at t + 1.4, e 0.6 s
            disp.submit(_item(name), t + k * 0.2, never)
        head = disp.head(S, t + 1.4)
        assert head is not None
        assert head.payload == ("a" if disp is d else "e")
        late = disp.head(S, t + 1.9)  # a waited 1.9 s (past rescuing), b 1.7 s
        assert late is not None
        assert late.payload == ("b" if disp is d else "e")


def test_no_rescue_while_the_queue_does_not_drain_in_time_or_the_rate_is_unknown() -> None:
    d = FlowDispatcher[str](_config(lifoAfterMs=200, onlyWhileGrowing=False, drainWithinMs=1000))
    for k in range(5):
        d.submit(_item(f"r{k}"), k * 0.2, never)
    head = d.head(S, 1.4)  # r0 waited 1.4 s, but no rate measured yet: newest first
    assert head is not None
    assert head.payload == "r4"
    busy = FlowDispatcher[str](_config(lifoAfterMs=200, onlyWhileGrowing=False, drainWithinMs=1000))
    t = _measure_rate(busy, 10, 2.0)
    for k in range(20):  # 20 more waiting at 10 a second: 2 s to drain, over the bound
        busy.submit(_item(f"n{k}"), t + 0.05 * k, never)
    head = busy.head(S, t + 1.4)
    assert head is not None
    assert head.payload == "n19"


def _open_loop(**standard: Any) -> tuple[int, int]:
    """One Standard flow arriving at `per` requests a second (above) on a pool that serves 10
    a second for 12 s: it keeps growing, so the 300 ms overload TTL applies from 3 s. Returns
    (expired, dispatched)."""
    d = FlowDispatcher[str](_config(**standard))
    expired = sent = n = 0
    t = 0.0
    while t < 12.0:
        t = round(t + 0.1, 1)
        for _ in range(3 if int(t * 10) % 2 else 1):  # 20 a second
            d.submit(_item(f"o{n}"), t, never)
            n += 1
        expired += len(d.expire(t))
        if d.pump(t, _one(), _drop):
            sent += 1
            d.completed("m", S, 10)
    return expired, sent


def test_the_overload_ttl_keeps_requests_only_while_the_queue_drains_in_time() -> None:
    """An open loop at twice the service rate: by the time the overload rule starts (3 s) its
    queue holds more than a second of service, so the overload TTL refuses, and that first
    refusal ends the exemption until the flow's queue empties: the run is the same as without
    `drainWithinMs` (without the latch, the trimmed queue looked drainable again and stood at
    a second of service, the 1.3x regression of docs/flowcontrol.md). A bound the queue always
    meets keeps every request until its plain 30 s TTL, and the servers stay as busy."""
    before = _open_loop()
    assert before[0] > 50
    assert _open_loop(drainWithinMs=1000) == before
    expired, sent = _open_loop(drainWithinMs=3_600_000)
    assert expired == 0
    assert sent == before[1]


def test_the_rescue_window_must_be_a_window() -> None:
    with pytest.raises(ValidationError, match=r"rescueAfterMs .* must be below rescueBeforeMs"):
        _config(rescueAfterMs=1800, rescueBeforeMs=1200, drainWithinMs=1000)
    # Without drainWithinMs the window would be ignored: said, not silently dropped.
    with pytest.raises(ValidationError, match=r"take effect only with drainWithinMs"):
        _config(rescueAfterMs=1000)
    band = _config(drainWithinMs=1000).bands.standard
    assert (band.rescue_after_ms, band.rescue_before_ms) == (1200, 1800)
