"""A band's `shortestFirst` (issue 38, size-aware ordering; opt-in): while
the overload rules apply to a flow, its waiting request with the fewest prompt tokens goes first
(among equals oldest first, newest once late); the oldest stays the one pushed out, and without
overload the order is first come first served."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from pydantic import ValidationError

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.ordering import FcfsAdaptiveLifo

S = Criticality.STANDARD


def _config(**standard: Any) -> FlowControlConfig:
    return FlowControlConfig.model_validate({"bands": {"standard": standard}})


def test_the_fewest_prompt_tokens_go_first_in_the_plain_order_among_equals() -> None:
    waiting = deque(
        FlowItem(n, S, "m", t, 100, arrived=a)
        for n, a, t in [("a", 0.0, 900), ("b", 0.1, 40), ("c", 0.2, 40)]
    )
    order = FcfsAdaptiveLifo(0.2, shortest_first=True)
    assert order.head(waiting, 0.1) is waiting[1]  # before lifoAfterMs too: b (40, oldest)
    assert order.head(waiting, 0.3) is waiting[2]  # late (a waited 0.3 s): c (40, newest)
    assert order.overdue(waiting, 0.1) is None
    assert order.overdue(waiting, 0.3) is waiting[0]  # the oldest is still the one pushed out
    plain = FcfsAdaptiveLifo(0.2)
    assert (plain.head(waiting, 0.1), plain.head(waiting, 0.3)) == (waiting[0], waiting[2])


def test_the_band_option_builds_the_ordering_and_is_off_by_default() -> None:
    bands = FlowControlConfig().bands
    assert not [c for c in Criticality if bands.of(c).shortest_first]
    order = FcfsAdaptiveLifo.of(_config(shortestFirst=True).bands.of(S))
    assert order.shortest_first
    assert order.lifo_after_s == 0.2  # Standard's own lifoAfterMs is kept
    assert not FcfsAdaptiveLifo.of(bands.of(S)).shortest_first


def test_a_non_boolean_is_refused_with_its_path() -> None:
    with pytest.raises(ValidationError) as info:
        _config(shortestFirst=[1])
    assert "bands.standard.shortestFirst" in str(info.value)
    assert "Input should be a valid boolean" in str(info.value)


def _dispatched(**standard: Any) -> list[str]:
    d: FlowDispatcher[str] = FlowDispatcher(_config(onlyWhileGrowing=False, **standard))
    for t, (name, tokens) in enumerate([("long", 3000), ("mid", 300), ("short", 30)]):
        d.submit(FlowItem(name, S, "m", tokens, 100), 10.0 + t * 0.01, lambda _i: False)
    sent: list[str] = []
    d.pump(10.05, lambda _i: True, lambda item: sent.append(item.payload))
    return sent


def test_in_overload_the_dispatcher_sends_the_shortest_prompts_first() -> None:
    assert _dispatched(shortestFirst=True) == ["short", "mid", "long"]
    # Off (the default): not yet late, so first come first served.
    assert _dispatched() == _dispatched(shortestFirst=False) == ["long", "mid", "short"]
