"""Observed speed: the estimator, the tracker that surfaces it, and the scorer that reads it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.speed import ObservedSpeed
from poolkeeper.scheduling.candidate_presets import candidate_document
from poolkeeper.scheduling.presets import preset_document
from tests.scheduling.sched_factories import NOW, key, plugin, request, scheduler, scores_of, state


@pytest.mark.parametrize(
    ("alpha", "samples", "want"),
    [
        (0.1, [(2.0, 100)], 0.02),  # the first sample is the whole estimate
        (0.5, [(1.0, 100), (3.0, 100)], 0.02),  # (0.5*1 + 0.5*3) / 100
        (0.5, [(1.0, 10), (1.0, 90)], 1.0 / 50),  # token-weighted: sums, not mean of ratios
        (1.0, [(9.0, 10), (1.0, 10)], 0.1),  # alpha 1 keeps only the newest request
        (0.5, [(1.0, 100), (5.0, 0)], 0.01),  # no tokens: ignored
        (0.5, [(1.0, 100), (-1.0, 10)], 0.01),  # negative elapsed: ignored
        (0.5, [(1.0, 100), (math.nan, 10)], 0.01),  # NaN elapsed: ignored
    ],
    ids=["first", "ewma", "token-weighted", "alpha-1", "no-tokens", "negative", "nan"],
)
def test_estimator(alpha: float, samples: list[tuple[float, int]], want: float) -> None:
    speed = ObservedSpeed(alpha=alpha)
    for elapsed, tokens in samples:
        speed.observe(key(1), elapsed, tokens)
    assert speed.seconds_per_token(key(1)) == pytest.approx(want)


def test_estimator_rejects_bad_samples_and_alpha() -> None:
    speed = ObservedSpeed()
    assert speed.observe(key(1), 1.0, 0) is False
    assert speed.seconds_per_token(key(1)) is None
    assert speed.observe(key(1), 1.0, 4) is True
    assert speed.get(key(1)) is not None
    speed.forget(key(1))
    assert len(speed) == 0
    for alpha in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            ObservedSpeed(alpha=alpha)


def test_estimator_apply_fills_only_observed_endpoints() -> None:
    speed = ObservedSpeed()
    speed.observe(key(2), 3.0, 30)
    pool = [state(1), state(2)]
    out = speed.apply(pool)
    assert out[0] is pool[0]
    assert out[0].seconds_per_output_token is None
    assert out[1].seconds_per_output_token == pytest.approx(0.1)
    assert out[1].endpoint is pool[1].endpoint
    assert speed.apply(pool)[1] is out[1]  # unchanged input and estimate: the same object
    speed.observe(key(2), 1.0, 30)
    again = speed.apply(pool)
    assert again[1].seconds_per_output_token == pytest.approx((0.9 * 3.0 + 0.1) / 30)
    busier = replace(pool[1], inflight_requests=3)
    assert speed.apply([busier])[0].inflight_requests == 3  # a new input state is rebuilt
    assert speed.apply([busier])[0].seconds_per_output_token == pytest.approx(
        again[1].seconds_per_output_token
    )


@pytest.mark.parametrize(
    ("tolerance", "observed", "want"),
    [
        (0.0, [0.01, 0.02, 0.04], [1.0, 0.5, 0.25]),  # fastest / own
        (0.0, [None, 0.02, 0.04], [1.0, 1.0, 0.5]),  # unobserved scores 1 (gets tried)
        (0.0, [None, None], [1.0, 1.0]),  # nothing observed: no effect
        (0.0, [0.05, 0.05], [1.0, 1.0]),  # equal speeds
        (0.0, [0.0, 0.02], [1.0, 1.0]),  # a zero estimate is not a signal
        (0.5, [0.01, 0.014, 0.03], [1.0, 1.0, 0.5]),  # within 1.5x: noise; beyond: 0.015/own
        (1.0, [0.01, 0.02, 0.08], [1.0, 1.0, 0.25]),
    ],
    ids=["ratio", "unobserved", "none", "equal", "zero", "tolerance", "tolerance-1"],
)
def test_observed_speed_scorer(
    tolerance: float, observed: list[float | None], want: list[float]
) -> None:
    pool = [replace(state(i), seconds_per_output_token=v) for i, v in enumerate(observed)]
    got = scores_of(plugin("observed-speed-scorer", {"tolerance": tolerance}), request(), pool)
    assert got == [pytest.approx(w) for w in want]


def test_observed_speed_scorer_rejects_negative_tolerance() -> None:
    with pytest.raises(ValidationError, match="tolerance"):
        plugin("observed-speed-scorer", {"tolerance": -0.1})


@settings(max_examples=200, deadline=None)
@given(
    st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    st.lists(
        st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e6, allow_nan=False)),
        min_size=1,
        max_size=12,
    ),
)
def test_observed_speed_scores_stay_in_unit_range(
    tolerance: float, observed: list[float | None]
) -> None:
    pool = [replace(state(i), seconds_per_output_token=v) for i, v in enumerate(observed)]
    got = scores_of(plugin("observed-speed-scorer", {"tolerance": tolerance}), request(), pool)
    assert len(got) == len(pool)
    assert all(0.0 <= s <= 1.0 for s in got)


def test_tracker_finish_with_usage_observes_speed() -> None:
    t = InflightTracker(speed_alpha=0.5)
    t.start("a", key(1), 10, now=10.0)
    t.start("b", key(1), 10, now=10.0)
    t.start("c", key(2), 10, now=10.0)
    assert t.finish("a", now=12.0, output_tokens=100) is True  # 0.02 s/token
    assert t.finish("c") is True  # an error or disconnect: no observation
    assert t.seconds_per_token(key(1)) == pytest.approx(0.02)
    assert t.seconds_per_token(key(2)) is None
    assert t.finish("a", now=20.0, output_tokens=1) is False  # already finished: no sample
    assert t.seconds_per_token(key(1)) == pytest.approx(0.02)


def test_tracker_apply_surfaces_speed_and_refreshes_on_change() -> None:
    t = InflightTracker(speed_alpha=1.0)
    pool = [state(1), state(2)]
    t.start("a", key(1), 10, now=100.0)
    t.finish("a", now=101.0, output_tokens=10)  # key(1): 0.1 s/token, nothing in flight
    t.start("b", key(2), 10, now=100.0)
    first = t.apply(pool)
    assert first[0].seconds_per_output_token == pytest.approx(0.1)
    assert first[0].inflight_requests == 0
    assert first[1].seconds_per_output_token is None
    assert first[1].inflight_requests == 1
    assert t.apply(pool)[0] is first[0]  # unchanged: the cached state comes back
    t.start("c", key(1), 10, now=101.0)
    second = t.apply(pool)
    assert second[0].inflight_requests == 1
    assert second[0].seconds_per_output_token == pytest.approx(0.1)
    t.finish("c", now=101.5, output_tokens=10)  # 0.05 s/token, and key(1) is idle again
    third = t.apply(pool)
    assert third[0].inflight_requests == 0
    assert third[0].seconds_per_output_token == pytest.approx(0.05)
    t.start("d", key(1), 10, now=102.0)
    t.finish("b", now=102.0, output_tokens=20)  # key(2): 2 s / 20 tokens
    fourth = t.apply(pool)
    assert fourth[0].inflight_requests == 1
    assert fourth[1].seconds_per_output_token == pytest.approx(0.1)
    assert fourth[1].inflight_requests == 0


def test_speed_scorer_prefers_the_observed_faster_endpoint() -> None:
    t = InflightTracker()
    for i, seconds in ((1, 4.0), (2, 1.0)):
        t.start(f"r{i}", key(i), 10, now=100.0)
        t.finish(f"r{i}", now=100.0 + seconds, output_tokens=100)
    got = scores_of(plugin("observed-speed-scorer"), request(), t.apply([state(1), state(2)]))
    assert got == [pytest.approx(0.25), pytest.approx(1.0)]


def test_speed15_candidate_weighs_observed_speed_less_than_the_default() -> None:
    """The default's backlog scorer already scales its costs by observed speed (an idle
    server twice as slow loses 0.7 of its 2 points there) and its speed scorer takes 0.7 of 2
    more; `default-speed15` weighs the speed scorer 1.5 (0.525 lost). A fast server 5
    requests deeper (1.25 of the queue scorer's 2 points) keeps the request on the default
    (1.4 lost by the slow one) and loses it to the idle slow server on the candidate (1.225).
    Heterogeneous fleet at 1.1x: docs/notes/2026-12-07-heterogeneous-overload.md."""
    fast = replace(state(1, waiting=5), seconds_per_output_token=0.015)
    slow = replace(state(2), seconds_per_output_token=0.030)
    picked = [
        scheduler(doc).schedule(request(), [fast, slow], now=NOW).primary.endpoint.name
        for doc in (preset_document("default"), candidate_document("default-speed15"))
    ]
    assert picked == ["pod1", "pod2"]
