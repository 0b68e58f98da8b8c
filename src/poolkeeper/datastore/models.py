"""`ModelIndex`: which InferenceModel a client-facing modelName means. The one home of that rule.

Built once per resource write (`Datastore` keeps it across metrics writes) and read by the
Director on every request, by status computation (`verdicts`) and by `poolkeeper status`:

- `verdicts`: every model's Accepted verdict (`poolkeeper.api.status.judge_models`): a model
  whose pool is missing, whose poolRef is foreign, or whose weights are all zero does not
  compete for its name; within one pool the oldest model wins (`api.status.age_order`).
- `by_pool`: pool key -> modelName -> the accepted model.
- `resolve(name)`: the (pool key, model) a request for `name` goes to. A name accepted in
  several pools goes to the oldest of those models, by the same age rule (ties broken by
  namespace/name), so every replica and every reader picks the same one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.status import Verdict, age_order, judge_models

__all__ = ["EMPTY_MODEL_INDEX", "ModelIndex", "ModelRoute", "build_model_index"]


class ModelRoute(NamedTuple):
    """Where a modelName is served: the pool (`namespace/name`) and the winning model."""

    pool_key: str
    model: InferenceModel


@dataclass(frozen=True, slots=True)
class ModelIndex:
    """The resolved model names of one datastore state; never changes after it is built."""

    verdicts: Mapping[str, Verdict]  # model key `namespace/name` -> its Accepted verdict
    by_pool: Mapping[str, Mapping[str, InferenceModel]]  # pool key -> modelName -> model
    by_name: Mapping[str, ModelRoute]  # modelName -> where it is served (oldest across pools)

    def resolve(self, model_name: str) -> ModelRoute | None:
        """Where requests for `model_name` go; None when no accepted model declares it."""
        return self.by_name.get(model_name)

    def models(self, pool_key: str) -> Mapping[str, InferenceModel]:
        """modelName -> accepted model in one pool (empty for an unknown pool)."""
        return self.by_pool.get(pool_key, _NO_MODELS)

    def names(self) -> tuple[str, ...]:
        """Every servable modelName, sorted."""
        return tuple(sorted(self.by_name))


_NO_MODELS: Mapping[str, InferenceModel] = MappingProxyType({})


def build_model_index(
    pools: Iterable[AnyInferencePool], models: Iterable[InferenceModel]
) -> ModelIndex:
    """The index of `models` against `pools` (pure; input order never matters)."""
    pools = list(pools)
    models = list(models)
    verdicts = judge_models(pools, models)
    by_pool: dict[str, dict[str, InferenceModel]] = {pool.key: {} for pool in pools}
    by_name: dict[str, ModelRoute] = {}
    for m in sorted(models, key=lambda m: (m.spec.model_name, age_order(m))):
        verdict = verdicts[m.key]
        if verdict.status != "True" or verdict.pool_key is None:
            continue
        name = m.spec.model_name
        by_pool.setdefault(verdict.pool_key, {})[name] = m
        # Sorted oldest first, so across pools the first accepted model of a name wins.
        by_name.setdefault(name, ModelRoute(verdict.pool_key, m))
    return ModelIndex(
        verdicts=MappingProxyType(verdicts),
        by_pool=MappingProxyType({k: MappingProxyType(v) for k, v in sorted(by_pool.items())}),
        by_name=MappingProxyType(by_name),
    )


EMPTY_MODEL_INDEX = build_model_index((), ())
