"""`ReturnTimes`: the hold of a freed slot follows how fast the flow's clients send again."""

from __future__ import annotations

import pytest

from poolkeeper.flowcontrol.returns import HOLD_MAX_S, HOLD_S, SAMPLES, ReturnTimes


def _returns(delays: list[float]) -> ReturnTimes:
    r = ReturnTimes()
    t = 0.0
    for d in delays:
        t += 1.0
        r.answered("f", t)
        r.arrived("f", t + d)
    return r


def test_a_closed_loop_keeps_its_slot_until_it_returns_and_others_keep_the_short_hold() -> None:
    # Unknown flow: the short hold.
    assert ReturnTimes().hold("f") == HOLD_S
    # A closed loop on a loaded machine: mostly milliseconds, sometimes past HOLD_S.
    closed = _returns([0.004, 0.008, 0.003, 0.17, 0.006, 0.05, 0.009, 0.12])
    assert closed.hold("f") == HOLD_MAX_S
    # Arrivals that do not follow the answers (an open loop at a few per second).
    assert _returns([0.3, 0.12, 0.45, 0.08, 0.2, 0.35, 0.15, 0.4]).hold("f") == HOLD_S
    # Answers never followed by an arrival are misses (a client that stopped).
    stopped = ReturnTimes()
    for i in range(SAMPLES):
        stopped.answered("f", float(i))
    stopped.arrived("f", 100.0)
    assert stopped.hold("f") == HOLD_S


def test_answers_are_matched_to_arrivals_in_order() -> None:
    r = ReturnTimes()
    r.answered("f", 1.0)
    r.answered("f", 1.01)
    r.arrived("f", 1.02)  # returns the answer of 1.0 (0.02 s)
    r.arrived("f", 1.04)  # and of 1.01 (0.03 s)
    r.arrived("f", 1.05)  # nothing left to match
    r.arrived("g", 1.05)  # another flow: nothing answered
    assert r._delays["f"] == pytest.approx([0.02, 0.03])
    assert "g" not in r._delays
    calls = 0

    def live() -> set[str]:
        nonlocal calls
        calls += 1
        return {"f"}

    r.prune(live)
    assert calls == 0  # few flows: nothing to prune
