"""The traffic split: which target model of an InferenceModel, or of an InferenceModelRewrite
rule (`datastore/models.py` `RewriteRule`, upstream v1.3+), serves one request.

Pure; randomness comes from the caller's `random.Random`. Rules (upstream semantics):
- no `targetModels` -> the client-facing `modelName` itself;
- no weight set on any target -> uniform;
- otherwise proportional to the weights; a target with weight 0 is never chosen; a target without
  a weight among weighted ones counts as weight 1 (the API rejects that mix; this is the
  defensive reading);
- every weight 0 -> `NoValidTargetModel` (404).
Rewrite rules arrive with upstream's weights already applied by the model index (where some
targets are weighted, unweighted ones are 0), so one draw serves both generations.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from poolkeeper.api.model import InferenceModel
from poolkeeper.datastore.models import RewriteRule
from poolkeeper.errors import NoValidTargetModel


class Weighted(Protocol):
    """A split target: InferenceModel's `TargetModel` or a rewrite rule's `WeightedTarget`."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> int | None: ...


def choose_target_model(model: InferenceModel, rng: random.Random) -> str:
    """The target model name for one request to `model`."""
    targets = model.spec.target_models
    if not targets:
        return model.spec.model_name
    name = choose_weighted(targets, rng)
    if name is None:
        raise NoValidTargetModel(
            f"model {model.spec.model_name!r} has no target model with a weight above 0"
        )
    return name


def choose_rewrite_target(rule: RewriteRule, rng: random.Random) -> str:
    """The target model name for one request matched by an InferenceModelRewrite rule."""
    name = choose_weighted(rule.targets, rng)
    if name is None:  # not reachable through the API (weights >= 1); kept for safety
        raise NoValidTargetModel(f"InferenceModelRewrite {rule.rewrite} has no usable target")
    return name


def choose_weighted(targets: Sequence[Weighted], rng: random.Random) -> str | None:
    """A target name drawn by weight; None when every weight is 0."""
    if all(t.weight is None for t in targets):
        return targets[rng.randrange(len(targets))].name
    weights = [1 if t.weight is None else t.weight for t in targets]
    total = sum(weights)
    if total <= 0:
        return None
    point = rng.randrange(total)
    for target, weight in zip(targets, weights, strict=True):
        if point < weight:
            return target.name
        point -= weight
    raise AssertionError("unreachable: point < total")  # pragma: no cover
