"""Pickers: max-score with random tie-break and fallbacks, random, weighted random."""

from __future__ import annotations

import collections

import pytest

from tests.scheduling.sched_factories import plugin, state

CANDS = [state(i) for i in range(6)]


@pytest.mark.parametrize(
    ("scores", "k", "want"),
    [
        ([0.1, 0.9, 0.5, 0.3, 0.7, 0.0], 1, [1]),
        ([0.1, 0.9, 0.5, 0.3, 0.7, 0.0], 3, [1, 4, 2]),
        ([0.1, 0.9, 0.5, 0.3, 0.7, 0.0], 10, [1, 4, 2, 3, 0, 5]),
    ],
)
def test_max_score_picker_orders_by_score(scores: list[float], k: int, want: list[int]) -> None:
    picker = plugin("max-score-picker", {"maxNumOfEndpoints": k})
    assert picker.pick(CANDS, scores) == want


def test_max_score_picker_breaks_ties_randomly() -> None:
    picker = plugin("max-score-picker", {"maxNumOfEndpoints": 1}, seed=3)
    scores = [0.5, 1.0, 1.0, 1.0, 0.2, 1.0]
    counts = collections.Counter(picker.pick(CANDS, scores)[0] for _ in range(4000))
    assert set(counts) == {1, 2, 3, 5}  # never a lower score, never only index 0 of the ties
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_max_score_picker_fallbacks_are_distinct_and_ranked() -> None:
    picker = plugin("max-score-picker", {"maxNumOfEndpoints": 4}, seed=5)
    scores = [0.3, 0.9, 0.3, 0.3, 0.9, 0.1]
    seen_third: collections.Counter[int] = collections.Counter()
    for _ in range(600):
        out = picker.pick(CANDS, scores)
        assert len(out) == len(set(out)) == 4
        assert set(out[:2]) == {1, 4}
        assert set(out[2:]) <= {0, 2, 3}
        seen_third[out[2]] += 1
    assert set(seen_third) == {0, 2, 3}  # ties at the boundary are sampled randomly


def test_random_picker_is_uniform_and_ignores_scores() -> None:
    picker = plugin("random-picker", {"maxNumOfEndpoints": 1}, seed=11)
    counts = collections.Counter(picker.pick(CANDS, [1, 0, 0, 0, 0, 0])[0] for _ in range(6000))
    assert set(counts) == set(range(6))
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_random_picker_returns_distinct_fallbacks() -> None:
    out = plugin("random-picker", {"maxNumOfEndpoints": 4}).pick(CANDS, [0.0] * 6)
    assert len(out) == len(set(out)) == 4


def test_weighted_random_picker_follows_weights_and_skips_zero() -> None:
    picker = plugin("weighted-random-picker", {"maxNumOfEndpoints": 1}, seed=2)
    scores = [0.0, 3.0, 1.0, 0.0, 0.0, 0.0]
    counts = collections.Counter(picker.pick(CANDS, scores)[0] for _ in range(8000))
    assert set(counts) == {1, 2}
    assert 0.72 < counts[1] / 8000 < 0.78  # 3 / (3 + 1)


def test_weighted_random_picker_all_zero_is_uniform_and_fills_fallbacks() -> None:
    picker = plugin("weighted-random-picker", {"maxNumOfEndpoints": 3}, seed=4)
    out = picker.pick(CANDS, [0.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    assert out[0] == 2
    assert len(set(out)) == 3
    firsts = collections.Counter(picker.pick(CANDS, [0.0] * 6)[0] for _ in range(3000))
    assert set(firsts) == set(range(6))
