"""`ModelIndex`: what a client-facing model name means. The one home of that rule, for every
GIE generation: InferenceModel (v0.x), InferenceObjective and InferenceModelRewrite (v1.x).

Built once per resource write (`Datastore` keeps it across metrics writes) and read by the
Director on every request, by status computation (`verdicts`) and by `poolkeeper status`:

- `verdicts`: every InferenceModel's Accepted verdict (`poolkeeper.api.status.judge_models`): a
  model whose pool is missing, whose poolRef is foreign, or whose weights are all zero does not
  compete for its name; within one pool the oldest model wins (`api.status.age_order`).
  `objective_verdicts` / `rewrite_verdicts`: the same for the v1.x kinds (`judge_pool_refs`);
  only accepted ones take part below.
- `by_pool`: pool key -> modelName -> the accepted InferenceModel.
- `resolve(name)`: the pool a request for `name` goes to, and the InferenceModel if one declares
  it. A name declared in several pools goes to the oldest of those models (ties broken by
  namespace/name), so every replica and every reader picks the same one. A name no
  InferenceModel declares but an InferenceModelRewrite matches exactly goes to the pool of the
  oldest such rewrite (model None).
- `rewrite_rule(pool, name)`: the InferenceModelRewrite rule for `name` in a pool: an exact
  match beats a generic rule (no `matches`), then the oldest resource, then the first rule in
  list order (upstream `modelrewritestore.go`).
- `objective(pool, name)`: the accepted InferenceObjective `name` of a pool, for the
  `x-gateway-inference-objective` header.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.rewrite import InferenceModelRewrite
from poolkeeper.api.status import Verdict, age_order, judge_models, judge_pool_refs

__all__ = [
    "EMPTY_MODEL_INDEX",
    "ModelIndex",
    "ModelResource",
    "ModelRoute",
    "RewriteRule",
    "WeightedTarget",
    "build_model_index",
]

# Every kind that says something about model names or request policy; a source hands these to
# the datastore together.
ModelResource = InferenceModel | InferenceObjective | InferenceModelRewrite


class ModelRoute(NamedTuple):
    """Where a model name is served: the pool (`namespace/name`) and the winning
    InferenceModel (None when an InferenceModelRewrite's exact match routes it)."""

    pool_key: str
    model: InferenceModel | None


@dataclass(frozen=True, slots=True)
class WeightedTarget:
    """One target of a traffic split (what `requestcontrol/split.py` draws from)."""

    name: str
    weight: int | None


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """The rule an InferenceModelRewrite contributes for a model name, with its origin."""

    rewrite: str  # `namespace/name` of the InferenceModelRewrite
    index: int  # position in `spec.rules`
    targets: tuple[WeightedTarget, ...]


@dataclass(frozen=True, slots=True)
class _PoolRewrites:
    exact: Mapping[str, RewriteRule]
    generic: RewriteRule | None


@dataclass(frozen=True, slots=True)
class ModelIndex:
    """The resolved model names of one datastore state; never changes after it is built."""

    verdicts: Mapping[str, Verdict]  # InferenceModel key `namespace/name` -> Accepted verdict
    by_pool: Mapping[str, Mapping[str, InferenceModel]]  # pool key -> modelName -> model
    by_name: Mapping[str, ModelRoute]  # modelName -> where it is served (oldest across pools)
    objective_verdicts: Mapping[str, Verdict]
    rewrite_verdicts: Mapping[str, Verdict]
    objectives: Mapping[tuple[str, str], InferenceObjective]  # (pool key, name) -> objective
    rewrites: Mapping[str, _PoolRewrites]  # pool key -> its rewrite rules

    def resolve(self, model_name: str) -> ModelRoute | None:
        """Where requests for `model_name` go; None when nothing declares it."""
        return self.by_name.get(model_name)

    def models(self, pool_key: str) -> Mapping[str, InferenceModel]:
        """modelName -> accepted model in one pool (empty for an unknown pool)."""
        return self.by_pool.get(pool_key, _NO_MODELS)

    def names(self) -> tuple[str, ...]:
        """Every servable model name, sorted."""
        return tuple(sorted(self.by_name))

    def rewrite_rule(self, pool_key: str, model_name: str) -> RewriteRule | None:
        """The InferenceModelRewrite rule for `model_name` in a pool (exact, else generic)."""
        table = self.rewrites.get(pool_key)
        if table is None:
            return None
        return table.exact.get(model_name, table.generic)

    def objective(self, pool_key: str, name: str) -> InferenceObjective | None:
        """The accepted InferenceObjective `name` that references the pool."""
        return self.objectives.get((pool_key, name))


_NO_MODELS: Mapping[str, InferenceModel] = MappingProxyType({})


def _targets(rule_targets: Iterable[tuple[str, int | None]]) -> tuple[WeightedTarget, ...]:
    """Upstream's weights: all unset = even split; where some are set, unset ones get 0."""
    pairs = list(rule_targets)
    if all(weight is None for _, weight in pairs):
        return tuple(WeightedTarget(name, None) for name, _ in pairs)
    return tuple(WeightedTarget(name, weight or 0) for name, weight in pairs)


def _pool_rewrites(rewrites: list[InferenceModelRewrite]) -> _PoolRewrites:
    exact: dict[str, RewriteRule] = {}
    generic: RewriteRule | None = None
    for rw in sorted(rewrites, key=age_order):  # oldest first: setdefault keeps the oldest
        for index, rule in enumerate(rw.spec.rules):
            if not rule.targets:
                continue  # a rule without targets rewrites nothing
            entry = RewriteRule(
                rw.key, index, _targets((t.model_rewrite, t.weight) for t in rule.targets)
            )
            if rule.generic:
                generic = generic or entry
            for name in rule.exact_models():
                exact.setdefault(name, entry)
    return _PoolRewrites(MappingProxyType(exact), generic)


def build_model_index(
    pools: Iterable[AnyInferencePool], resources: Iterable[ModelResource]
) -> ModelIndex:
    """The index of `resources` against `pools` (pure; input order never matters)."""
    pools = list(pools)
    resources = list(resources)
    models = [r for r in resources if isinstance(r, InferenceModel)]
    objectives = [r for r in resources if isinstance(r, InferenceObjective)]
    rewrites = [r for r in resources if isinstance(r, InferenceModelRewrite)]
    verdicts = judge_models(pools, models)
    objective_verdicts = judge_pool_refs(pools, objectives)
    rewrite_verdicts = judge_pool_refs(pools, rewrites)

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

    accepted_rewrites = [r for r in rewrites if rewrite_verdicts[r.key].status == "True"]
    rewrites_by_pool: dict[str, list[InferenceModelRewrite]] = {}
    for rw in accepted_rewrites:
        rewrites_by_pool.setdefault(rw.pool_key, []).append(rw)
    # A name only a rewrite declares is served by the pool of the oldest rewrite matching it.
    for rw in sorted(accepted_rewrites, key=age_order):
        for rule in rw.spec.rules:
            if rule.targets:
                for name in rule.exact_models():
                    by_name.setdefault(name, ModelRoute(rw.pool_key, None))

    accepted_objectives = {
        (o.pool_key, o.name): o for o in objectives if objective_verdicts[o.key].status == "True"
    }
    return ModelIndex(
        verdicts=MappingProxyType(verdicts),
        by_pool=MappingProxyType({k: MappingProxyType(v) for k, v in sorted(by_pool.items())}),
        by_name=MappingProxyType(by_name),
        objective_verdicts=MappingProxyType(objective_verdicts),
        rewrite_verdicts=MappingProxyType(rewrite_verdicts),
        objectives=MappingProxyType(accepted_objectives),
        rewrites=MappingProxyType(
            {k: _pool_rewrites(v) for k, v in sorted(rewrites_by_pool.items())}
        ),
    )


EMPTY_MODEL_INDEX = build_model_index((), ())
