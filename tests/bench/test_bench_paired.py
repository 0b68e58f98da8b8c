"""Paired live comparison: quantiles, per-round ratios and the bootstrap interval over rounds."""

from __future__ import annotations

import pytest

from poolkeeper.bench.results.paired import compare, quantile


def test_quantile_interpolates_between_order_statistics() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert quantile([7.0], 0.9) == 7.0
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.9)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantile([1.0], 1.5)


def test_identical_runs_give_one_with_a_point_interval() -> None:
    rounds = [[0.1 * i for i in range(1, 101)], [0.2 * i for i in range(1, 101)]]
    c = compare(rounds, rounds, resamples=200)
    assert c.rounds == 2
    assert c.per_round == (1.0, 1.0)
    for est in (c.pooled, c.paired):
        assert (est.value, est.low, est.high) == pytest.approx((1.0, 1.0, 1.0))


def test_a_uniformly_slower_variant_is_found_inside_the_interval() -> None:
    base = [[0.01 * i * (1 + r / 10) for i in range(1, 201)] for r in range(8)]
    variant = [[1.1 * t for t in run] for run in base]
    c = compare(base, variant, resamples=500)
    assert c.pooled.value == pytest.approx(1.1)
    assert c.paired.value == pytest.approx(1.1)
    assert c.paired.low == pytest.approx(1.1)
    assert c.paired.high == pytest.approx(1.1)


def test_round_to_round_spread_widens_the_interval_and_it_is_deterministic() -> None:
    base = [[float(i) for i in range(1, 101)] for _ in range(6)]
    factors = [0.8, 1.3, 0.9, 1.2, 1.0, 1.1]
    variant = [[f * t for t in run] for f, run in zip(factors, base, strict=True)]
    c = compare(base, variant, resamples=2000, seed=3)
    assert c.per_round == pytest.approx(tuple(factors))
    assert c.paired.low < c.paired.value < c.paired.high
    assert c.paired.low < 1.0 < c.paired.high  # six rounds this spread cannot tell 5 % apart
    assert c == compare(base, variant, resamples=2000, seed=3)
    assert str(c.paired).startswith(f"{c.paired.value:.3f}x [")


def test_bad_input_gets_a_precise_error() -> None:
    with pytest.raises(ValueError, match="2 baseline rounds against 1"):
        compare([[1.0], [1.0]], [[1.0]])
    with pytest.raises(ValueError, match="no rounds"):
        compare([], [])
    with pytest.raises(ValueError, match="round 0 has a run without TTFTs"):
        compare([[]], [[1.0]])
    with pytest.raises(ValueError, match="not positive"):
        compare([[0.0]], [[1.0]])
    with pytest.raises(ValueError, match=r"round 0: quantile 0\.0 is not positive"):
        compare([[1.0]], [[0.0]])  # the variant's too (was a math domain error from log)
