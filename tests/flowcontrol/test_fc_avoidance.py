"""`avoid_prefills`: a band's `avoidPrefillTokens` narrowing, and its prefix-aware form
`avoidPrefillUnlessCached` (a cached prefix worth more than the wait keeps its holder)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from pydantic import ValidationError

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.avoidance import avoid_prefills
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.flowcontrol.config import FlowControlConfig
from tests.scheduling.sched_factories import state

PLAIN = BandConfig.model_validate({"avoidPrefillTokens": 256})
AWARE = BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillUnlessCached": 300})


def _asked(found: dict[str, int]) -> tuple[list[int], Callable[[], dict[str, int]]]:
    calls: list[int] = []

    def cached() -> dict[str, int]:
        calls.append(1)
        return found

    return calls, cached


def test_a_holder_just_sent_a_prompt_stays_while_its_prefix_is_worth_the_wait() -> None:
    # Shared-prefix chat: pod1 holds the request's 2,000-token system prompt and was just sent
    # a prompt; pod2 and pod3 are clear and cache nothing of it.
    holder, clear, other = state(1, unseen_tokens=2100), state(2), state(3)
    found = {holder.endpoint.hostport: 2000}
    _calls, cached = _asked(found)
    assert avoid_prefills([holder, clear, other], PLAIN, cached=cached) == [clear, other]
    assert avoid_prefills([holder, clear, other], AWARE, cached=cached) == [holder, clear, other]
    # Another holder that is clear: the busy one has no advantage over it and is left out.
    clear_holder = state(4)
    found[clear_holder.endpoint.hostport] = 2000
    assert avoid_prefills([holder, clear, clear_holder], AWARE, cached=cached) == [
        clear, clear_holder]  # fmt: skip


def test_an_advantage_below_the_margin_or_no_facts_avoids_as_before() -> None:
    busy, clear = state(1, unseen_tokens=900), state(2)
    # Cached 400 there, 120 on the clear one: 280 more, under the 300 tokens asked for.
    _calls, cached = _asked({busy.endpoint.hostport: 400, clear.endpoint.hostport: 120})
    assert avoid_prefills([busy, clear], AWARE, cached=cached) == [clear]
    _calls, cached = _asked({busy.endpoint.hostport: 420, clear.endpoint.hostport: 120})
    assert avoid_prefills([busy, clear], AWARE, cached=cached) == [busy, clear]  # exactly 300
    # A unique prompt (nothing cached anywhere) and a caller without facts: narrowed.
    _calls, cached = _asked({})
    assert avoid_prefills([busy, clear], AWARE, cached=cached) == [clear]
    assert avoid_prefills([busy, clear], AWARE) == [clear]


def test_the_prefix_match_is_asked_only_when_the_narrowing_has_a_choice() -> None:
    busy, clear = state(1, unseen_tokens=900), state(2)
    calls, cached = _asked({})
    assert avoid_prefills([clear, state(3)], AWARE, cached=cached) == [clear, state(3)]
    assert avoid_prefills([busy, state(3, unseen_tokens=500)], AWARE, cached=cached) == [
        busy, state(3, unseen_tokens=500)]  # fmt: skip
    assert avoid_prefills([busy], AWARE, cached=cached) == [busy]
    assert avoid_prefills([busy, clear], PLAIN, cached=cached) == [clear]
    assert calls == []
    avoid_prefills([busy, clear], AWARE, cached=cached)
    assert calls == [1]


def test_unless_cached_without_avoid_prefill_tokens_is_a_precise_error() -> None:
    with pytest.raises(ValidationError, match=r"avoidPrefillUnlessCached \(256\) takes effect"):
        FlowControlConfig.model_validate(
            {"bands": {"sheddable": {"avoidPrefillUnlessCached": 256}}}
        )
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillUnlessCached": 0})
    # Critical has avoidPrefillTokens by default: the margin alone is enough there.
    config = FlowControlConfig.model_validate(
        {"holdNewPrefixes": None, "bands": {"critical": {"avoidPrefillUnlessCached": 256}}}
    )
    assert config.bands.critical.avoid_prefill_unless_cached == 256
    assert config.asks_prefill_facts  # the Director reads the prefix facts for it
    # Standard's default sets it too; off with the hold and Standard's avoidance, no facts.
    assert FlowControlConfig.model_validate({"holdNewPrefixes": None}).asks_prefill_facts
    plain = {"holdNewPrefixes": None, "bands": {"standard": {"avoidPrefillTokens": None}}}
    assert not FlowControlConfig.model_validate(plain).asks_prefill_facts


def test_a_released_new_prefix_is_placed_without_the_avoidance() -> None:
    # `holdNewPrefixes.placeUnderBacklog`: the hold released a new long prefix because some
    # endpoint is under its backlog limit, often the one just sent a prompt; placed by that
    # room, not by the band's avoidance, which would take it away.
    band = FlowControlConfig().bands.of(Criticality.STANDARD)
    assert band.avoid_prefill_tokens is not None  # the default Standard band avoids
    just_sent = [
        replace(state(i, unseen_tokens=2100 if i == 1 else 0), seconds_per_output_token=0.01)
        for i in range(1, 10)
    ]  # (speeds observed and equal: the speed check lets the avoidance act)
    assert len(avoid_prefills(just_sent, band)) == 8
    released = band.without_avoidance()
    assert avoid_prefills(just_sent, released) == just_sent
    assert released.avoid_prefill_tokens is None
    assert released.model_dump(exclude={"avoid_prefill_tokens", "avoid_prefill_unless_cached",
        "avoid_prefill_slowdown", "avoid_prefill_min_clear"}) == band.model_dump(
        exclude={"avoid_prefill_tokens", "avoid_prefill_unless_cached",
                 "avoid_prefill_slowdown", "avoid_prefill_min_clear"})  # fmt: skip
    assert PLAIN.without_avoidance().without_avoidance() == PLAIN.without_avoidance()
    no_avoid = BandConfig()
    assert no_avoid.without_avoidance() is no_avoid
