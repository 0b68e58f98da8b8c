"""`holdNewPrefixes` (`flowcontrol/prefixhold.py`): the rule, the release order and the cap,
and the setting's validation (on by default, `placeUnderBacklog` too)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import ValidationError

from poolkeeper.flowcontrol.config import FlowControlConfig, HoldNewPrefixes
from poolkeeper.flowcontrol.prefixhold import Held, PrefixHold


def _hold(**kw: int) -> PrefixHold[str]:
    return PrefixHold(HoldNewPrefixes.model_validate(kw))


def test_held_only_while_every_endpoint_is_backlogged_and_the_prefill_is_long() -> None:
    hold = _hold(backlog_tokens=2048, min_prompt_tokens=1024)
    assert hold.holds(2100, [2048, 5000, 3000])
    assert not hold.holds(2100, [2048, 2047, 3000])  # one endpoint under the backlog
    assert not hold.holds(1023, [9000, 9000])  # its prefix is placed: 1,023 uncached tokens
    assert not hold.holds(5000, [])  # no endpoints: the scheduler answers at once


def test_place_under_backlog_narrows_a_new_prefix_to_the_endpoints_with_room() -> None:
    """`room`: a new long prefix goes where the backlog is under `backlogTokens` (the room its
    release waited for); a placed prefix, a pool all under or all over, or the option off: not
    narrowed, and the prefix match is not asked where nothing would be narrowed."""
    asked: list[int] = []

    def uncached() -> int:
        asked.append(1)
        return 2100

    on = PrefixHold[str](HoldNewPrefixes(place_under_backlog=True))
    assert on.room(2100, [30_000, 2047, 4096, 0]) == [1, 3]
    assert on.room(1023, [30_000, 0]) is None  # its prefix is placed: the scheduler decides
    assert on.room(uncached, [0, 100]) is None  # every endpoint has room
    assert on.room(uncached, [2048, 9000]) is None  # none has: a capped release
    assert on.room(uncached, [5000]) is None
    assert asked == []
    assert on.room(uncached, [5000, 10]) == [1]
    assert asked == [1]
    assert HoldNewPrefixes().place_under_backlog  # on by default
    off = PrefixHold[str](HoldNewPrefixes(place_under_backlog=False))
    assert off.room(2100, [30_000, 0]) is None


def test_the_prefix_match_is_asked_only_when_every_backlog_is_long() -> None:
    """The uncached-token count (a prefix match over the prompt) is the dear part of the
    question: an idle pool, the common case with the hold on by default, never asks it."""
    hold: PrefixHold[str] = PrefixHold(HoldNewPrefixes())
    asked: list[int] = []

    def uncached() -> int:
        asked.append(1)
        return 2100

    assert not hold.holds(uncached, [0, 5000])
    assert not hold.holds(uncached, [])
    assert asked == []
    assert hold.holds(uncached, [2048, 5000])
    assert asked == [1]


def test_release_in_arrival_order_each_answer_seeing_the_ones_before() -> None:
    hold = _hold(max_hold_ms=1000)
    for rid in ("a1", "b1", "a2", "c1"):
        hold.hold(rid, 0.0)
    placed: set[str] = {"b"}  # b's prefix was placed meanwhile
    sent: list[str] = []

    def go(entry: Held[str]) -> None:
        sent.append(entry.payload)
        placed.add(entry.payload[0])

    def still(rid: str) -> bool:
        return rid[0] not in placed and rid != "a1"  # a1: some backlog fell for it

    assert hold.release(0.5, still, go) == 3
    assert sent == ["a1", "b1", "a2"]  # a2 released because a1 placed "a" before it was asked
    assert hold.waiting() == 1
    assert hold.total == 4
    assert hold.capped == 0


def test_released_at_the_cap_whatever_the_backlog() -> None:
    hold = _hold(max_hold_ms=1500)
    hold.hold("x", 1.0)
    hold.hold("y", 2.0)
    sent: list[str] = []
    assert hold.release(2.4, lambda _r: True, lambda e: sent.append(e.payload)) == 0
    assert hold.next_release() == pytest.approx(2.5)
    assert hold.release(2.5, lambda _r: True, lambda e: sent.append(e.payload)) == 1
    assert sent == ["x"]
    assert hold.capped == 1
    assert hold.remove("y")
    assert not hold.remove("y")
    assert hold.next_release() == float("inf")


def test_on_by_default_off_with_null_or_no_queue_and_validated_like_its_neighbours() -> None:
    assert FlowControlConfig().hold_new_prefixes == HoldNewPrefixes()
    assert FlowControlConfig.model_validate({"holdNewPrefixes": None}).hold_new_prefixes is None
    # no queue, no default hold; one set explicitly is refused (test_fc_config)
    assert FlowControlConfig.model_validate({"enabled": False}).hold_new_prefixes is None
    off = FlowControlConfig(enabled=False)
    assert FlowControlConfig.model_validate(off.model_dump(by_alias=True)) == off
    on = FlowControlConfig.model_validate(
        {"holdNewPrefixes": {"backlogTokens": 4096, "maxHoldMs": 800}}
    )
    assert on.hold_new_prefixes == HoldNewPrefixes(
        backlog_tokens=4096, min_prompt_tokens=1024, max_hold_ms=800
    )
    assert FlowControlConfig.model_validate({"holdNewPrefixes": {}}).hold_new_prefixes
    for bad in ({"maxHoldMs": 0}, {"backlogTokens": -1}, {"minPromptTokens": "x"}, {"cap": 1}):
        with pytest.raises(ValidationError):
            FlowControlConfig.model_validate({"holdNewPrefixes": bad})


def test_a_release_asks_at_most_its_budget_and_never_asks_the_capped() -> None:
    """`asks` bounds the questions one release asks (the oldest first; the rest stay held,
    unasked); a request past `maxHoldMs` goes without being asked."""
    config = HoldNewPrefixes(max_hold_ms=1000, place_under_backlog=False)  # no placement asks
    hold: PrefixHold[str] = PrefixHold(config)
    for i, name in enumerate("abcdef"):
        hold.hold(name, i * 0.1)
    asked: list[str] = []
    sent: list[str] = []

    def still(r: str) -> bool:
        asked.append(r)
        return r != "e"  # the rule would release e, but e is not asked this time

    assert hold.release(0.6, still, lambda e: sent.append(e.payload), asks=2) == 0
    assert (asked, sent) == (["a", "b"], [])
    asked.clear()
    # At 1.15 a and b are past the cap: they go unasked; the budget goes to c and d.
    assert hold.release(1.15, still, lambda e: sent.append(e.payload), asks=2) == 2
    assert (asked, sent) == (["c", "d"], ["a", "b"])
    assert [e.payload for e in hold.held] == ["c", "d", "e", "f"]
    assert hold.capped == 2


def test_place_under_backlog_counts_a_released_requests_placement_in_the_budget() -> None:
    """`placeUnderBacklog`: a released request's dispatch asks once more (its placement), so
    a budget of 4 asks two requests that the rule releases, not four; one that stays held
    costs one; a capped one goes unasked but its placement uses up one of the budget."""
    hold: PrefixHold[str] = PrefixHold(HoldNewPrefixes(max_hold_ms=1000, place_under_backlog=True))
    for i, name in enumerate("abcdef"):
        hold.hold(name, i * 0.1)
    asked: list[str] = []
    sent: list[str] = []

    def answer(holds: bool) -> Callable[[str], bool]:
        def still(r: str) -> bool:
            asked.append(r)
            return holds

        return still

    def go(entry: Held[str]) -> None:
        sent.append(entry.payload)

    assert hold.release(0.6, answer(False), go, asks=4) == 2
    assert (sent, asked) == (["a", "b"], ["a", "b"])  # two x (the rule's ask + the placement)
    asked.clear()
    assert hold.release(0.6, answer(True), go, asks=3) == 0
    assert asked == ["c", "d"]  # held: one question each; the one left is too few to ask
    asked.clear()
    # At 1.25 c is past the cap: it goes unasked, and its placement takes one of the four.
    assert hold.release(1.25, answer(False), go, asks=4) == 2
    assert (sent[2:], asked) == (["c", "d"], ["d"])
    assert [e.payload for e in hold.held] == ["e", "f"]
    with pytest.raises(ValueError, match="at least 2"):
        hold.release(1.25, answer(False), go, asks=1)
