"""A band's `catchUpWindowMs` (issue 38, goodput at the end of a passing overload): while the
band's queue shrinks, adaptive LIFO serves the oldest request still in time first; while it
grows, newest first as before."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.catchup import CatchUp
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher, FlowItem
from tests.flowcontrol.fc_factories import (
    S,
    never,
    standard_config as _config,
    standard_item as _item,
)


def _room(n: int) -> Any:
    """A `fits` with room for `n` requests (the pump counts each before asking again)."""
    asked: list[bool] = []

    def fits(_item: FlowItem[str]) -> bool:
        asked.append(True)
        return len(asked) <= n

    return fits


def _sent(d: FlowDispatcher[str], now: float, n: int) -> list[str]:
    out: list[str] = []
    d.pump(now, _room(n), lambda item: out.append(item.payload))
    return out


def test_catch_up_counts_a_window_of_joins_and_dispatches() -> None:
    c = CatchUp(0.25)
    for t in (0.0, 0.05, 0.1):
        c.joined(t)
    c.left(0.1)
    c.left(0.15)
    assert not c.shrinking(0.2, 100.0)  # 3 joined, 2 left
    c.left(0.2)
    assert not c.shrinking(0.2, 100.0)  # level is not shrinking
    c.left(0.22)
    assert c.shrinking(0.22, 100.0)
    assert not c.shrinking(0.22, None)  # no measured service rate: not trusted
    assert not c.shrinking(0.22, 12.0)  # 3 joined in 250 ms: as fast as 12 a second is served
    assert c.shrinking(0.3, 12.0)  # 0.0 and 0.05 fell out of the window: 1 joined, 4 left
    assert not c.shrinking(0.6, 100.0)  # nothing in the window
    assert c.shrinking(0.3, 12.0)  # asking about a later time forgot nothing
    with pytest.raises(ValueError, match="must be positive"):
        CatchUp(0.0)


def _measured(**standard: Any) -> tuple[FlowDispatcher[str], float]:
    """A dispatcher whose queue has drained 10 a second for 2 s (its measured service rate),
    emptied; and the time then."""
    d = FlowDispatcher[str](_config(**standard))
    for n in range(25):
        d.submit(_item(f"old{n}"), 0.0, never)
    t = 0.0
    for _ in range(20):
        t = round(t + 0.1, 6)
        _sent(d, t, 1)
    assert d.drain.rate() == pytest.approx(10.0, rel=0.05)
    for item in d.items(S):
        d.cancel(item)
    return d, t


def _grown(d: FlowDispatcher[str], t0: float) -> None:
    """Ten requests queued 0.1 s apart from `t0`; 0.5 s in, the newest two (r5, r4) were sent."""
    for k in range(10):
        d.submit(_item(f"r{k}"), round(t0 + k * 0.1, 6), never)
        if k == 5:
            _sent(d, round(t0 + 0.5, 6), 2)


def test_a_shrinking_queue_serves_its_oldest_request_in_time_first() -> None:
    rules = {"onlyWhileGrowing": False}  # adaptive LIFO from 200 ms, as in an open-loop overload
    for window, expected in ((250, ["r9", "r0", "r1"]), (None, ["r9", "r8", "r7"])):
        d, t0 = _measured(**rules, catchUpWindowMs=window)
        _grown(d, t0)
        # Arrivals stopped at t0 + 0.9; 0.3 s later the pump sends 3. Nothing joined in the
        # last 250 ms (below 10 a second), and from the second send on more left than joined:
        # the oldest, still in time, go next. Without the window: newest first throughout.
        assert _sent(d, round(t0 + 1.2, 6), 3) == expected


def test_the_newest_first_while_the_queue_grows() -> None:
    d, t0 = _measured(onlyWhileGrowing=False, catchUpWindowMs=250)
    _grown(d, t0)
    # 3 joined in the last 250 ms (above 10 a second) and 1 leaves: still growing.
    assert _sent(d, round(t0 + 0.9, 6), 1) == ["r9"]


def test_a_request_past_rescue_before_ms_is_not_taken_first() -> None:
    d, t0 = _measured(onlyWhileGrowing=False, catchUpWindowMs=250, rescueBeforeMs=1000)
    _grown(d, t0)
    # 1.2 s in, r0-r2 have waited 1.0 s or more (the bound): the oldest in time is r3.
    assert _sent(d, round(t0 + 1.2, 6), 3) == ["r9", "r3", "r6"]  # r4 and r5 went at 0.5 s


def test_off_by_default_and_the_rescue_bound_without_drain_within() -> None:
    bands = FlowControlConfig().bands
    assert all(bands.of(c).catch_up_window_ms is None for c in Criticality)
    band = _config(catchUpWindowMs=250, rescueBeforeMs=1200).bands.standard
    assert (band.catch_up_window_ms, band.rescue_before_ms) == (250, 1200)
    with pytest.raises(ValidationError, match=r"rescueBeforeMs takes effect only with"):
        _config(rescueBeforeMs=1200)
    with pytest.raises(ValidationError, match=r"rescueAfterMs takes effect only with"):
        _config(catchUpWindowMs=250, rescueAfterMs=1000)
