"""InferenceModel status computation: the `Accepted` condition, as a pure function.

Upstream documents the condition but never writes it (gie.md §6.1); poolkeeper computes it from
the current pools and models, with the same conflict rule the upstream datastore uses internally:
within one pool a modelName belongs to the oldest InferenceModel (creationTimestamp; ties and
missing timestamps are broken by namespace/name, so the result never depends on input order).

Reasons, in the order they are checked:
  Unknown/Pending          poolRef names a kind or group poolkeeper does not reconcile
  False/PoolNotFound       no InferencePool of that name in the model's namespace
  False/NoValidTargetModel targetModels is non-empty and every weight is 0 (v1alpha1 only)
  False/ModelNameInUse     an older InferenceModel in the same pool claims the same modelName
  True/Accepted            this model serves modelName in its pool
Models rejected for the first three reasons do not compete for their modelName.

InferenceObjective and InferenceModelRewrite (upstream v1.x) have no name to compete for:
`judge_pool_refs` gives them Unknown/Pending, False/PoolNotFound or True/Accepted by the same
poolRef rules. Upstream defines their `Accepted` condition but never writes it either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Protocol

from poolkeeper.api import model as im
from poolkeeper.api.meta import ApiObject, Condition, ConditionStatus
from poolkeeper.api.model import InferenceModel, InferenceModelStatus
from poolkeeper.api.pool import KIND as POOL_KIND, AnyInferencePool
from poolkeeper.api.versions import groups_of

POOL_GROUPS: Final = groups_of(POOL_KIND)  # the groups whose InferencePools a reference may name


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the status writer decided for one model (before timestamps are attached)."""

    status: ConditionStatus
    reason: str
    message: str
    pool_key: str | None = None


def judge_models(
    pools: Iterable[AnyInferencePool], models: Iterable[InferenceModel]
) -> dict[str, Verdict]:
    """The Accepted verdict of every model, keyed by the model's `namespace/name`."""
    by_name: dict[tuple[str, str], list[AnyInferencePool]] = {}
    for pool in pools:
        by_name.setdefault((pool.namespace, pool.name), []).append(pool)
    verdicts: dict[str, Verdict] = {}
    contenders: dict[tuple[str, str], list[InferenceModel]] = {}
    for m in models:
        ref = m.spec.pool_ref
        if ref.kind != "InferencePool" or ref.group not in POOL_GROUPS:
            verdicts[m.key] = Verdict(
                "Unknown",
                im.REASON_PENDING,
                f"poolRef refers to {ref.kind} in group {ref.group or 'core'}, "
                "which poolkeeper does not reconcile",
            )
            continue
        candidates = by_name.get((m.namespace, ref.name), [])
        if not candidates:
            verdicts[m.key] = Verdict(
                "False", im.REASON_POOL_NOT_FOUND, f"InferencePool {m.pool_key} not found"
            )
            continue
        pool = next((p for p in candidates if p.group == ref.group), candidates[0])
        targets = m.spec.target_models
        if targets and all(t.weight == 0 for t in targets):
            verdicts[m.key] = Verdict(
                "False",
                im.REASON_NO_VALID_TARGET_MODEL,
                "every target model has weight 0, so no request could be served",
                pool.key,
            )
            continue
        contenders.setdefault((pool.key, m.spec.model_name), []).append(m)
    for (pool_key, model_name), group in contenders.items():
        winner, *losers = sorted(group, key=age_order)
        verdicts[winner.key] = Verdict(
            "True",
            im.REASON_ACCEPTED,
            f"serving modelName {model_name!r} in InferencePool {pool_key}",
            pool_key,
        )
        for loser in losers:
            verdicts[loser.key] = Verdict(
                "False",
                im.REASON_MODEL_NAME_IN_USE,
                f"modelName {model_name!r} is already served in InferencePool {pool_key} by "
                f"the older InferenceModel {winner.key}",
                pool_key,
            )
    return verdicts


class PoolReferrer(Protocol):
    """An object that names an InferencePool in its own namespace (objective, rewrite)."""

    @property
    def key(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def pool_key(self) -> str: ...

    @property
    def pool_ref_triple(self) -> tuple[str, str, str]: ...


def judge_pool_refs(
    pools: Iterable[AnyInferencePool], objects: Iterable[PoolReferrer]
) -> dict[str, Verdict]:
    """The Accepted verdict of objects that only reference a pool, keyed by `namespace/name`.

    The poolRef's group must be the pool's group (upstream's reconcilers filter on it).
    """
    known = {(p.namespace, p.name, p.group) for p in pools}
    verdicts: dict[str, Verdict] = {}
    for obj in objects:
        group, kind, name = obj.pool_ref_triple
        if kind != "InferencePool" or group not in POOL_GROUPS:
            verdicts[obj.key] = Verdict(
                "Unknown",
                im.REASON_PENDING,
                f"poolRef refers to {kind} in group {group or 'core'}, "
                "which poolkeeper does not reconcile",
            )
        elif (obj.namespace, name, group) not in known:
            verdicts[obj.key] = Verdict(
                "False",
                im.REASON_POOL_NOT_FOUND,
                f"InferencePool {obj.pool_key} (group {group}) not found",
            )
        else:
            verdicts[obj.key] = Verdict(
                "True", im.REASON_ACCEPTED, f"applies to InferencePool {obj.pool_key}", obj.pool_key
            )
    return verdicts


def age_order(m: ApiObject) -> tuple[bool, datetime, str, str]:
    """Sort key, oldest first: the one age rule for every "oldest wins" decision."""
    ts = m.metadata.creation_timestamp
    # A missing timestamp sorts after every real one: an object that states its age outranks
    # one that does not.
    return (ts is None, _utc(ts) if ts else datetime.min.replace(tzinfo=UTC), m.namespace, m.name)


def _utc(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


def compute_model_statuses(
    models: Iterable[InferenceModel],
    verdicts: Mapping[str, Verdict],
    *,
    now: datetime,
    previous: Mapping[str, InferenceModelStatus] | None = None,
) -> dict[str, InferenceModelStatus]:
    """The new status of every model, keyed by `namespace/name`, from its verdict (`judge_models`,
    which the datastore's model index computes once per write).

    `previous` holds the statuses written last time (default: each model's own `.status`);
    `lastTransitionTime` is carried over when the condition's status value did not change.
    """
    now = now.replace(microsecond=0)  # metav1.Time has one-second resolution
    out: dict[str, InferenceModelStatus] = {}
    for m in models:
        verdict = verdicts[m.key]
        before = previous.get(m.key) if previous is not None else m.status
        prior = before.condition(im.CONDITION_ACCEPTED) if before is not None else None
        changed = prior is None or prior.status != verdict.status
        condition = Condition(
            type=im.CONDITION_ACCEPTED,
            status=verdict.status,
            reason=verdict.reason,
            message=verdict.message,
            last_transition_time=now if changed or prior is None else prior.last_transition_time,
            # Objects from files carry no generation; they are in their first one.
            observed_generation=m.metadata.generation or 1,
        )
        out[m.key] = InferenceModelStatus(conditions=[condition])
    return out


def with_status(m: InferenceModel, status: InferenceModelStatus) -> InferenceModel:
    """A copy of `m` carrying `status` (objects are treated as immutable values)."""
    return m.model_copy(update={"status": status})
