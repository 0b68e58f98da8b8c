"""Status computation: Accepted / ModelNameInUse / PoolNotFound / NoValidTargetModel / Pending,
conflict resolution by age, lastTransitionTime stability."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from poolkeeper.api.model import InferenceModel, InferenceModelStatus
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool, InferencePool, InferencePoolV1
from poolkeeper.api.status import (
    compute_model_statuses,
    judge_models,
    judge_pool_refs,
    with_status,
)
from tests.api.apidocs import M1, model_doc, pool1_doc, pool2_doc

T0 = datetime(2025, 6, 1, 10, 0, tzinfo=UTC)
NOW = datetime(2025, 7, 1, 12, 0, 0, 123456, tzinfo=UTC)
POOL = InferencePool.model_validate(pool2_doc())


def statuses_of(
    pools: list[AnyInferencePool], models: list[InferenceModel], **kwargs: Any
) -> dict[str, InferenceModelStatus]:
    """Statuses from the verdicts, as the datastore's model index computes them."""
    return compute_model_statuses(models, judge_models(pools, models), **kwargs)


def model(
    name: str,
    model_name: str = "llama",
    *,
    created: datetime | None = T0,
    namespace: str = "default",
    pool: str = "pool",
    api_version: str = "inference.networking.x-k8s.io/v1alpha2",
    **spec: Any,
) -> InferenceModel:
    doc = model_doc(api_version, **spec)
    doc["metadata"] = {"name": name, "namespace": namespace}
    if created is not None:
        doc["metadata"]["creationTimestamp"] = created.isoformat()
    doc["spec"]["modelName"] = model_name
    doc["spec"]["poolRef"] = doc["spec"].get("poolRef", {}) | {"name": pool}
    return InferenceModel.model_validate(doc)


def reasons(
    pools: list[AnyInferencePool], models: list[InferenceModel]
) -> dict[str, tuple[str, str]]:
    statuses = statuses_of(pools, models, now=NOW)
    out: dict[str, tuple[str, str]] = {}
    for key, status in statuses.items():
        cond = status.condition("Accepted")
        assert cond is not None
        out[key] = (cond.status, cond.reason)
    return out


def test_single_model_is_accepted() -> None:
    statuses = statuses_of([POOL], [model("a")], now=NOW)
    (cond,) = statuses["default/a"].conditions
    assert (cond.type, cond.status, cond.reason) == ("Accepted", "True", "Accepted")
    assert cond.last_transition_time == NOW.replace(microsecond=0)
    assert cond.observed_generation == 1


def test_observed_generation_follows_metadata() -> None:
    m = model("a")
    m = m.model_copy(update={"metadata": m.metadata.model_copy(update={"generation": 7})})
    statuses = statuses_of([POOL], [m], now=NOW)
    assert statuses["default/a"].conditions[0].observed_generation == 7


def test_oldest_wins_and_newer_gets_model_name_in_use() -> None:
    old, new = model("old", created=T0), model("new", created=T0 + timedelta(hours=1))
    result = reasons([POOL], [new, old])
    assert result == {
        "default/old": ("True", "Accepted"),
        "default/new": ("False", "ModelNameInUse"),
    }
    message = statuses_of([POOL], [new, old], now=NOW)["default/new"].conditions[0].message
    assert "default/old" in message
    assert "'llama'" in message


def test_equal_timestamps_are_broken_by_name_whatever_the_order() -> None:
    a, b = model("alpha"), model("beta")
    assert reasons([POOL], [b, a]) == reasons([POOL], [a, b])
    assert reasons([POOL], [b, a])["default/alpha"] == ("True", "Accepted")
    assert reasons([POOL], [b, a])["default/beta"] == ("False", "ModelNameInUse")


def test_missing_timestamp_loses_to_a_stated_one() -> None:
    undated, dated = model("aaa", created=None), model("zzz", created=T0 + timedelta(days=300))
    assert reasons([POOL], [undated, dated])["default/zzz"] == ("True", "Accepted")


def test_naive_timestamps_count_as_utc() -> None:
    naive = model("naive", created=None)
    naive = naive.model_copy(
        update={
            "metadata": naive.metadata.model_copy(
                update={"creation_timestamp": datetime(2020, 1, 1)}
            )
        }
    )
    assert reasons([POOL], [naive, model("aware")])["default/naive"] == ("True", "Accepted")


def test_same_model_name_in_different_pools_is_fine() -> None:
    other = InferencePool.model_validate(pool2_doc() | {"metadata": {"name": "other"}})
    a, b = model("a", pool="pool"), model("b", pool="other", created=T0 + timedelta(1))
    assert reasons([POOL, other], [a, b]) == {
        "default/a": ("True", "Accepted"),
        "default/b": ("True", "Accepted"),
    }


def test_pool_is_looked_up_in_the_models_namespace() -> None:
    elsewhere = model("a", namespace="team-b")
    result = statuses_of([POOL], [elsewhere], now=NOW)["team-b/a"].conditions[0]
    assert (result.status, result.reason) == ("False", "PoolNotFound")
    assert "team-b/pool" in result.message


def test_v1_pool_satisfies_a_pool_ref() -> None:
    v1 = InferencePoolV1.model_validate(pool1_doc())
    assert reasons([v1], [model("a")]) == {"default/a": ("True", "Accepted")}


def test_foreign_pool_kind_stays_pending() -> None:
    foreign = model("a", poolRef={"group": "example.com", "kind": "Backend"})
    assert reasons([POOL], [foreign]) == {"default/a": ("Unknown", "Pending")}


def test_all_zero_weights_is_no_valid_target_and_does_not_block_others() -> None:
    zero = model("zero", api_version=M1, targetModels=[{"name": "a", "weight": 0}])
    newer = model("newer", created=T0 + timedelta(hours=2))
    assert reasons([POOL], [zero, newer]) == {
        "default/zero": ("False", "NoValidTargetModel"),
        "default/newer": ("True", "Accepted"),
    }


def test_some_zero_weights_are_fine() -> None:
    mixed = model(
        "m", api_version=M1, targetModels=[{"name": "a", "weight": 0}, {"name": "b", "weight": 1}]
    )
    assert reasons([POOL], [mixed]) == {"default/m": ("True", "Accepted")}


def test_deleting_the_winner_promotes_the_next_oldest() -> None:
    first = model("first", created=T0)
    second = model("second", created=T0 + timedelta(minutes=1))
    third = model("third", created=T0 + timedelta(minutes=2))
    before = statuses_of([POOL], [first, second, third], now=NOW)
    assert before["default/second"].conditions[0].reason == "ModelNameInUse"
    later = NOW + timedelta(minutes=5)
    survivors = [
        with_status(second, before["default/second"]),
        with_status(third, before["default/third"]),
    ]
    after = statuses_of([POOL], survivors, now=later)
    promoted = after["default/second"].conditions[0]
    assert (promoted.status, promoted.reason) == ("True", "Accepted")
    assert promoted.last_transition_time == later.replace(microsecond=0)
    still = after["default/third"].conditions[0]
    assert (still.status, still.reason) == ("False", "ModelNameInUse")
    assert "default/second" in still.message
    # third stayed False: its transition time is the one from the first computation.
    assert still.last_transition_time == before["default/third"].conditions[0].last_transition_time


def test_last_transition_time_only_moves_when_status_changes() -> None:
    m = model("a")
    first = statuses_of([POOL], [m], now=NOW)
    again = statuses_of([POOL], [m], now=NOW + timedelta(hours=1), previous=first)
    assert again["default/a"].conditions[0].last_transition_time == NOW.replace(microsecond=0)
    gone = statuses_of([], [m], now=NOW + timedelta(hours=2), previous=again)
    lost = gone["default/a"].conditions[0]
    assert (lost.status, lost.reason) == ("False", "PoolNotFound")
    assert lost.last_transition_time == (NOW + timedelta(hours=2)).replace(microsecond=0)
    # False -> False with another reason keeps the time.
    conflict = [m, model("older", created=T0 - timedelta(days=1))]
    moved = statuses_of([POOL], conflict, now=NOW + timedelta(hours=3), previous=gone)[
        "default/a"
    ].conditions[0]
    assert (moved.status, moved.reason) == ("False", "ModelNameInUse")
    assert moved.last_transition_time == lost.last_transition_time


def test_pending_default_transitions_at_first_reconcile() -> None:
    m = model("a")
    assert m.status.conditions[0].reason == "Pending"
    cond = statuses_of([POOL], [m], now=NOW)["default/a"].conditions[0]
    assert cond.status == "True"
    assert cond.last_transition_time == NOW.replace(microsecond=0)


def test_previous_defaults_to_the_objects_own_status() -> None:
    m = model("a")
    earlier = datetime(2025, 1, 1, tzinfo=UTC)
    status = InferenceModelStatus.model_validate(
        {
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True",
                    "reason": "Accepted",
                    "message": "",
                    "lastTransitionTime": earlier.isoformat(),
                }
            ]
        }
    )
    cond = statuses_of([POOL], [with_status(m, status)], now=NOW)["default/a"].conditions[0]
    assert cond.last_transition_time == earlier


def test_judge_models_reports_the_pool_key() -> None:
    verdicts = judge_models([POOL], [model("a")])
    assert verdicts["default/a"].pool_key == "default/pool"


def test_pending_needs_only_one_of_kind_or_group_foreign_and_does_not_stop_the_rest() -> None:
    wrong_kind = model("kind", "k", poolRef={"kind": "Service"}, created=T0)
    wrong_group = model("group", "g", poolRef={"group": "", "kind": "InferencePool"}, created=T0)
    fine = model("fine", "f", created=T0)
    verdicts = judge_models([POOL], [wrong_kind, wrong_group, fine])
    assert verdicts["default/kind"].message == (
        "poolRef refers to Service in group inference.networking.x-k8s.io, "
        "which poolkeeper does not reconcile"
    )
    assert verdicts["default/group"].message == (
        "poolRef refers to InferencePool in group core, which poolkeeper does not reconcile"
    )
    assert verdicts["default/kind"].reason == verdicts["default/group"].reason == "Pending"
    assert verdicts["default/fine"].reason == "Accepted"  # judged although it came after


def test_rejected_verdicts_name_their_pool() -> None:
    zero = model("zero", "z", api_version=M1, targetModels=[{"name": "a", "weight": 0}])
    old = model("old", created=T0)
    new = model("new", created=T0 + timedelta(hours=1))
    verdicts = judge_models([POOL], [zero, old, new])
    assert verdicts["default/zero"].pool_key == POOL.key
    assert verdicts["default/zero"].message == (
        "every target model has weight 0, so no request could be served"
    )
    assert verdicts["default/new"].pool_key == POOL.key
    assert verdicts["default/new"].reason == "ModelNameInUse"


def test_age_compares_instants_across_time_zones() -> None:
    plus_two = timezone(timedelta(hours=2))
    # 10:00+02:00 is 08:00 UTC: older than 09:00 UTC although its wall clock reads later.
    east = model("east", created=datetime(2025, 6, 1, 10, 0, tzinfo=plus_two))
    utc = model("utc", created=datetime(2025, 6, 1, 9, 0, tzinfo=UTC))
    assert reasons([POOL], [utc, east]) == {
        "default/east": ("True", "Accepted"),
        "default/utc": ("False", "ModelNameInUse"),
    }


def test_a_model_without_its_pool_does_not_stop_the_rest() -> None:
    lost = model("lost", "l", pool="no-such-pool")
    fine = model("fine", "f")
    assert reasons([POOL], [lost, fine]) == {
        "default/lost": ("False", "PoolNotFound"),
        "default/fine": ("True", "Accepted"),
    }


def _objective(object_name: str, **pool_ref: str) -> InferenceObjective:
    return InferenceObjective.model_validate(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": object_name, "namespace": "default"},
            "spec": {"poolRef": {"name": "pool", **pool_ref}},
        }
    )


def test_pool_referrers_are_judged_by_kind_group_and_name() -> None:
    x_group, v1_group = "inference.networking.x-k8s.io", "inference.networking.k8s.io"
    objects = [
        _objective("service", kind="Service"),
        _objective("core", group=""),
        _objective("lost", name="nope", group=x_group),
        _objective("other-group"),  # poolRef's default group is v1; this pool is v1alpha2
        _objective("fine", group=x_group),
    ]
    verdicts = judge_pool_refs([POOL], objects)
    got = {k: (v.status, v.reason, v.message, v.pool_key) for k, v in verdicts.items()}
    pending = "which poolkeeper does not reconcile"
    assert got == {
        "default/service": (
            "Unknown",
            "Pending",
            f"poolRef refers to Service in group {v1_group}, {pending}",
            None,
        ),
        "default/core": (
            "Unknown",
            "Pending",
            f"poolRef refers to InferencePool in group core, {pending}",
            None,
        ),
        "default/lost": (
            "False",
            "PoolNotFound",
            f"InferencePool default/nope (group {x_group}) not found",
            None,
        ),
        "default/other-group": (
            "False",
            "PoolNotFound",
            f"InferencePool default/pool (group {v1_group}) not found",
            None,
        ),
        "default/fine": (
            "True",
            "Accepted",
            "applies to InferencePool default/pool",
            "default/pool",
        ),
    }
