"""`avoidPrefillSlowdown`: the speed-aware form of a band's `avoidPrefillTokens` (a server just
sent a long prompt is avoided only in favour of one about as fast)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.avoidance import avoid_prefills
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.saturation import SaturationDetector
from tests.scheduling.sched_factories import NOW, state

SPEED = BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillSlowdown": 1.0})
PLAIN = BandConfig.model_validate({"avoidPrefillTokens": 256})


def fleet(i: int, speed: float | None, unseen_tokens: int = 0, **kw: object) -> EndpointState:
    """pod{i} with an observed speed (seconds per output token; None: not observed)."""
    return replace(state(i, unseen_tokens=unseen_tokens, **kw), seconds_per_output_token=speed)  # type: ignore[arg-type]


def test_a_busy_fast_server_stays_unless_a_clear_one_is_as_fast() -> None:
    # Mixed speeds: pod1 twice as fast as pod2 and just sent 900 tokens: the plain rule moves
    # the request to the slow pod2, the speed-aware one leaves the scheduler both.
    fast, slow = fleet(1, 0.005, unseen_tokens=900), fleet(2, 0.01)
    assert avoid_prefills([fast, slow], PLAIN) == [slow]
    assert avoid_prefills([fast, slow], SPEED) == [fast, slow]
    # Another fast server that is clear: pod1 is avoided for it (the slow one stays too).
    other = fleet(3, 0.005)
    assert avoid_prefills([fast, slow, other], SPEED) == [slow, other]
    # The factor is the slowdown a move may cost: 2x lets pod2 count as fast enough.
    loose = BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillSlowdown": 2})
    assert avoid_prefills([fast, slow], loose) == [slow]
    quick = fleet(1, 0.0049, unseen_tokens=900)  # more than twice as fast: stays
    assert avoid_prefills([quick, slow], loose) == [quick, slow]


def test_identical_servers_are_narrowed_as_by_the_plain_rule() -> None:
    busy, clear, other = fleet(1, 0.01, 900), fleet(2, 0.01), fleet(3, 0.0105)
    assert avoid_prefills([busy, clear, other], SPEED) == [clear, other]


def test_without_speeds_or_on_a_lora_fleet_nothing_is_narrowed() -> None:
    busy, clear = fleet(1, 0.005, 900), fleet(2, None)
    assert avoid_prefills([busy, clear], SPEED) == [busy, clear]
    # Servers running LoRA adapters: a request waits there for an adapter slot, which the
    # speeds do not show (multi-LoRA 1.1x lost 2.3 % goodput to the narrowing).
    busy, clear = fleet(1, 0.01, 900, active=("a1",)), fleet(2, 0.01)
    assert avoid_prefills([busy, clear], SPEED, adapter="a2") == [busy, clear]
    assert avoid_prefills([busy, clear], PLAIN, adapter="a2") == [clear]


def test_a_cached_holder_stays_beside_the_speed_rule() -> None:
    both = BandConfig.model_validate(
        {"avoidPrefillTokens": 256, "avoidPrefillUnlessCached": 256, "avoidPrefillSlowdown": 1}
    )
    holder, clear = fleet(1, 0.01, 2000), fleet(2, 0.01)

    def cached() -> dict[str, int]:
        return {holder.endpoint.hostport: 1500}

    assert avoid_prefills([holder, clear], both, cached=cached) == [holder, clear]
    assert avoid_prefills([holder, clear], SPEED, cached=cached) == [clear]
    # Where speeds cannot be compared nothing is narrowed, and the match is not asked.
    asked: list[int] = []

    def counted() -> dict[str, int]:
        asked.append(1)
        return {}

    unobserved = fleet(3, None)
    assert avoid_prefills([holder, unobserved], both, cached=counted) == [holder, unobserved]
    assert asked == []


def test_slowdown_without_avoid_prefill_tokens_is_a_precise_error() -> None:
    with pytest.raises(ValidationError, match=r"avoidPrefillSlowdown \(1.5\) takes effect"):
        FlowControlConfig.model_validate({"bands": {"sheddable": {"avoidPrefillSlowdown": 1.5}}})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillSlowdown": 0.9})


def test_every_placement_path_of_the_headroom_applies_it() -> None:
    # The EPP's gate reads `room` (queued bands) and `spread` (sent at once); the virtual
    # fleet's policy reads `within`.
    headroom = Headroom(SaturationDetector())
    band = BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillSlowdown": 1})
    fast, slow, other = fleet(1, 0.005, unseen_tokens=900), fleet(2, 0.01), fleet(3, 0.005)
    assert headroom.room([fast, slow], band, NOW) == [fast, slow]
    assert headroom.room([fast, slow, other], band, NOW) == [slow, other]
    assert headroom.within([fast, slow], band, NOW) == [fast, slow]
    assert headroom.within([fast, slow, other], band, NOW) == [slow, other]
    assert list(headroom.spread([fast, slow], band)) == [fast, slow]
    assert headroom.spread([fast, slow, other], band) == [slow, other]


def test_too_few_clear_candidates_are_not_narrowed_to() -> None:
    band = BandConfig.model_validate({"avoidPrefillTokens": 256, "avoidPrefillMinClear": 2})
    busy, clear, other = fleet(1, 0.01, 900), fleet(2, 0.01), fleet(3, 0.01)
    assert avoid_prefills([busy, clear], band) == [busy, clear]  # one clear: left as it is
    assert avoid_prefills([busy, clear, other], band) == [clear, other]
    with pytest.raises(ValidationError, match=r"avoidPrefillMinClear \(8\) takes effect"):
        FlowControlConfig.model_validate({"bands": {"sheddable": {"avoidPrefillMinClear": 8}}})


def test_standard_avoids_a_prompt_just_sent_where_eight_servers_are_clear_by_default() -> None:
    standard = FlowControlConfig().bands.standard
    assert (
        standard.avoid_prefill_tokens,
        standard.avoid_prefill_unless_cached,
        standard.avoid_prefill_slowdown,
        standard.avoid_prefill_min_clear,
    ) == (256, 256, 1.0, 8)
    busy = fleet(1, 0.01, 900)
    clear = [fleet(i, 0.01) for i in range(2, 10)]
    assert avoid_prefills([busy, *clear], standard) == clear
    assert avoid_prefills([busy, *clear[:7]], standard) == [busy, *clear[:7]]  # 7 clear
    # Turning the avoidance off takes its default refinements along (no error about them);
    # a refinement set beside it still says it would be ignored.
    off = FlowControlConfig.model_validate({"bands": {"standard": {"avoidPrefillTokens": None}}})
    assert off.bands.standard.avoid_prefill_tokens is None
    assert off.bands.standard.avoid_prefill_min_clear is None
    with pytest.raises(ValidationError, match=r"avoidPrefillSlowdown \(2\) takes effect"):
        FlowControlConfig.model_validate(
            {"bands": {"standard": {"avoidPrefillTokens": None, "avoidPrefillSlowdown": 2}}}
        )


def test_field_names_replace_the_band_defaults_as_the_aliases_do() -> None:
    # `avoid_prefill_tokens` is the field's name (accepted as the alias is): it replaces the
    # default `avoidPrefillTokens` instead of standing beside it as a second key.
    bands = FlowControlConfig.model_validate(
        {"bands": {"standard": {"avoid_prefill_tokens": 512, "ttl_ms": 1000}}}
    ).bands
    assert (bands.standard.avoid_prefill_tokens, bands.standard.ttl_ms) == (512, 1000)
    assert bands.standard.avoid_prefill_min_clear == 8  # the other defaults stay
    off = FlowControlConfig.model_validate({"bands": {"standard": {"avoid_prefill_tokens": None}}})
    assert off.bands.standard.avoid_prefill_tokens is None
    assert off.bands.standard.avoid_prefill_unless_cached is None
    with pytest.raises(ValidationError, match=r"avoidPrefillMinClear \(2\) takes effect"):
        FlowControlConfig.model_validate(
            {"bands": {"standard": {"avoid_prefill_tokens": None, "avoid_prefill_min_clear": 2}}}
        )


def test_a_busy_server_not_yet_observed_leaves_the_candidates_as_they_are() -> None:
    # Its speed cannot be compared, so it is not moved from (a new pod keeps the narrowing
    # off until its first answers: the old placement, not a worse one).
    busy, clear = fleet(1, None, 900), fleet(2, 0.01)
    assert avoid_prefills([busy, clear], SPEED) == [busy, clear]
    assert avoid_prefills([busy, clear], PLAIN) == [clear]
