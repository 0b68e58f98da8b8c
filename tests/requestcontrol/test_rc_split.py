"""The weighted traffic split between an InferenceModel's target models."""

from __future__ import annotations

import random
from collections import Counter
from statistics import NormalDist
from typing import Any

import pytest

from poolkeeper.api.model import InferenceModel, TargetModel
from poolkeeper.datastore.models import RewriteRule, WeightedTarget
from poolkeeper.errors import NoValidTargetModel
from poolkeeper.requestcontrol.split import (
    choose_rewrite_target,
    choose_target_model,
    choose_weighted,
)


def _model(targets: list[dict[str, Any]], version: str = "v1alpha2") -> InferenceModel:
    return InferenceModel.model_validate(
        {
            "apiVersion": f"inference.networking.x-k8s.io/{version}",
            "kind": "InferenceModel",
            "metadata": {"name": "chat"},
            "spec": {"modelName": "chat", "poolRef": {"name": "pool"}, "targetModels": targets},
        }
    )


def _chi_square_critical(df: int, alpha: float) -> float:
    """Upper-alpha quantile of chi-square(df), Wilson-Hilferty approximation."""
    z = NormalDist().inv_cdf(1 - alpha)
    k = 2 / (9 * df)
    return float(df * (1 - k + z * k**0.5) ** 3)


def _draw(model: InferenceModel, n: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    return Counter(choose_target_model(model, rng) for _ in range(n))


def _assert_fits(counts: Counter[str], shares: dict[str, float], n: int) -> None:
    statistic = sum((counts[name] - n * p) ** 2 / (n * p) for name, p in shares.items())
    assert statistic < _chi_square_critical(len(shares) - 1, alpha=0.001), (counts, statistic)


def test_weights_are_proportional() -> None:
    weights = {"base": 10, "lora-a": 30, "lora-b": 60}
    n = 20_000
    counts = _draw(_model([{"name": k, "weight": w} for k, w in weights.items()]), n, seed=7)
    total = sum(weights.values())
    _assert_fits(counts, {k: w / total for k, w in weights.items()}, n)
    assert sum(counts.values()) == n


def test_a_skewed_split_is_detected_by_the_bound() -> None:
    """The statistical check has teeth: a 50/50 draw does not pass for a 40/60 split."""
    n = 20_000
    counts = _draw(_model([{"name": "a"}, {"name": "b"}]), n, seed=3)
    statistic = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in {"a": 0.4, "b": 0.6}.items())
    assert statistic > _chi_square_critical(1, alpha=0.001)


def test_no_weights_is_uniform() -> None:
    names = ["a", "b", "c", "d"]
    n = 20_000
    counts = _draw(_model([{"name": k} for k in names]), n, seed=11)
    _assert_fits(counts, dict.fromkeys(names, 1 / len(names)), n)


def test_weight_zero_is_never_chosen() -> None:
    model = _model([{"name": "off", "weight": 0}, {"name": "on", "weight": 1}], version="v1alpha1")
    assert set(_draw(model, 2_000, seed=1)) == {"on"}


def test_all_weights_zero_is_no_valid_target_model() -> None:
    model = _model([{"name": "a", "weight": 0}, {"name": "b", "weight": 0}], version="v1alpha1")
    with pytest.raises(NoValidTargetModel, match="no target model with a weight above 0") as info:
        choose_target_model(model, random.Random(0))
    assert info.value.http_status == 404


def test_no_target_models_uses_the_model_name() -> None:
    assert choose_target_model(_model([]), random.Random(0)) == "chat"


def test_same_seed_same_sequence() -> None:
    model = _model([{"name": "a", "weight": 1}, {"name": "b", "weight": 2}])
    rng_a, rng_b = random.Random(42), random.Random(42)
    seq_a = [choose_target_model(model, rng_a) for _ in range(200)]
    seq_b = [choose_target_model(model, rng_b) for _ in range(200)]
    assert seq_a == seq_b
    assert len(set(seq_a)) == 2


class _Points(random.Random):
    """randrange returns the given points in turn."""

    def __init__(self, *points: int) -> None:
        super().__init__(0)
        self.points = list(points)

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        return self.points.pop(0)


def test_a_target_without_weight_among_weighted_ones_counts_as_one() -> None:
    targets = [TargetModel(name="plain"), TargetModel(name="heavy", weight=2)]
    # Weights (1, 2): point 0 is "plain", points 1 and 2 are "heavy".
    assert [choose_weighted(targets, _Points(p)) for p in (0, 1, 2)] == ["plain", "heavy", "heavy"]
    only = [TargetModel(name="plain"), TargetModel(name="off", weight=0)]
    assert choose_weighted(only, _Points(0)) == "plain"


def test_a_rewrite_rule_without_a_usable_target_names_itself() -> None:
    rule = RewriteRule("default/canary", 0, (WeightedTarget("v1", 0), WeightedTarget("v2", 0)))
    with pytest.raises(NoValidTargetModel, match=r"InferenceModelRewrite default/canary has no"):
        choose_rewrite_target(rule, random.Random(1))
    rule = RewriteRule("default/canary", 0, (WeightedTarget("v1", 0), WeightedTarget("v2", 3)))
    assert choose_rewrite_target(rule, random.Random(1)) == "v2"
