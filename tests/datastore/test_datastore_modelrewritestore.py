"""InferenceModelRewrite precedence and InferenceObjective lookup in the one model index
(upstream `pkg/epp/datastore/modelrewritestore_test.go` cases, v1.5.0): exact beats generic,
then the oldest resource, then the first rule; deleting or replacing a rewrite is a new index."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import InferencePoolV1
from poolkeeper.api.rewrite import InferenceModelRewrite
from poolkeeper.datastore.models import ModelResource, ModelRoute, build_model_index
from poolkeeper.datastore.store import Datastore

POOL = "default/pool"
OLD, NEW = "2025-01-01T00:00:00Z", "2025-06-01T00:00:00Z"


def pool(name: str = "pool") -> InferencePoolV1:
    return InferencePoolV1.model_validate(
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": name}}, "targetPorts": [{"number": 8000}]},
        }
    )


def rewrite(name: str, created: str, *rules: dict[str, Any], pool_name: str = "pool") -> Any:
    return InferenceModelRewrite.model_validate(
        {
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"poolRef": {"name": pool_name}, "rules": list(rules)},
        }
    )


def exact(model: str, *targets: str) -> dict[str, Any]:
    return {
        "matches": [{"model": {"value": model}}],
        "targets": [{"modelRewrite": t} for t in targets],
    }


def generic(*targets: str) -> dict[str, Any]:
    return {"targets": [{"modelRewrite": t} for t in targets]}


def objective(name: str, priority: int | None, group: str | None = None) -> InferenceObjective:
    ref: dict[str, Any] = {"name": "pool"} | ({} if group is None else {"group": group})
    spec: dict[str, Any] = {"poolRef": ref} | ({} if priority is None else {"priority": priority})
    return InferenceObjective.model_validate({"metadata": {"name": name}, "spec": spec})


def winner(resources: list[ModelResource], model: str) -> tuple[str, str] | None:
    rule = build_model_index([pool()], resources).rewrite_rule(POOL, model)
    return None if rule is None else (rule.rewrite, rule.targets[0].name)


RULE_OLD_EXACT = rewrite("old-exact", OLD, exact("m1", "m1-v1"))
RULE_NEW_EXACT = rewrite("new-exact", NEW, exact("m1", "m1-v2"))
RULE_OLD_GENERIC = rewrite("old-generic", OLD, generic("base-v1"))
RULE_NEW_GENERIC = rewrite("new-generic", NEW, generic("base-v2"))

CASES = [
    ("simple exact match", [RULE_NEW_EXACT], "m1", ("default/new-exact", "m1-v2")),
    ("simple generic match", [RULE_NEW_GENERIC], "m1", ("default/new-generic", "base-v2")),
    ("no match", [RULE_NEW_EXACT], "other", None),
    (
        "exact wins over generic",
        [RULE_OLD_GENERIC, RULE_NEW_EXACT],
        "m1",
        ("default/new-exact", "m1-v2"),
    ),
    (
        "fallback to generic",
        [RULE_OLD_GENERIC, RULE_NEW_EXACT],
        "m2",
        ("default/old-generic", "base-v1"),
    ),
    ("oldest exact wins", [RULE_NEW_EXACT, RULE_OLD_EXACT], "m1", ("default/old-exact", "m1-v1")),
    (
        "oldest generic wins",
        [RULE_NEW_GENERIC, RULE_OLD_GENERIC],
        "m9",
        ("default/old-generic", "base-v1"),
    ),
    (
        "first rule of one resource wins",
        [rewrite("two", OLD, exact("m1", "first"), exact("m1", "second"))],
        "m1",
        ("default/two", "first"),
    ),
    (
        "a rule matches any of its models",
        [
            rewrite(
                "any",
                OLD,
                {
                    **exact("a", "t"),
                    "matches": [{"model": {"value": "a"}}, {"model": {"value": "b"}}],
                },
            )
        ],
        "b",
        ("default/any", "t"),
    ),
    (
        "other pool's rule does not apply",
        [rewrite("x", OLD, exact("m1", "t"), pool_name="p2")],
        "m1",
        None,
    ),
]


@pytest.mark.parametrize(
    ("resources", "model", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rewrite_precedence(resources: list[ModelResource], model: str, want: Any) -> None:
    assert winner(resources, model) == want
    assert winner(list(reversed(resources)), model) == want  # input order never matters


def test_delete_and_replace_are_a_rebuilt_index() -> None:
    store = Datastore()
    store.set_resources([pool()], [RULE_OLD_EXACT, RULE_NEW_EXACT])
    assert store.snapshot().rewrite_rule(POOL, "m1").rewrite == "default/old-exact"  # type: ignore[union-attr]
    store.set_resources([pool()], [RULE_NEW_EXACT])  # old-exact deleted
    assert store.snapshot().rewrite_rule(POOL, "m1").rewrite == "default/new-exact"  # type: ignore[union-attr]
    replaced = rewrite("new-exact", NEW, exact("m2", "m2-v1"))  # same object, new rules
    store.set_resources([pool()], [replaced])
    assert store.snapshot().rewrite_rule(POOL, "m1") is None
    assert store.snapshot().rewrite_rule(POOL, "m2").targets[0].name == "m2-v1"  # type: ignore[union-attr]


def test_exact_rewrite_names_route_to_their_pool() -> None:
    index = build_model_index(
        [pool(), pool("p2")], [rewrite("x", OLD, exact("m1", "t"), pool_name="p2")]
    )
    assert index.resolve("m1") == ModelRoute("default/p2", None)
    assert index.names() == ("m1",)
    assert index.rewrite_verdicts["default/x"].status == "True"


def test_rewrite_weights_follow_upstream() -> None:
    split = rewrite(
        "s", OLD, {"targets": [{"modelRewrite": "a", "weight": 3}, {"modelRewrite": "b"}]}
    )
    even = rewrite("e", OLD, exact("m", "a", "b"))
    index = build_model_index([pool()], [split, even])
    generic_rule, exact_rule = index.rewrite_rule(POOL, "x"), index.rewrite_rule(POOL, "m")
    assert generic_rule is not None
    assert exact_rule is not None
    assert [(t.name, t.weight) for t in generic_rule.targets] == [("a", 3), ("b", 0)]
    assert [(t.name, t.weight) for t in exact_rule.targets] == [("a", None), ("b", None)]


def test_objectives_by_pool_and_group() -> None:
    index = build_model_index(
        [pool()],
        [
            objective("gold", 5),
            objective("plain", None),
            objective("alpha", 1, "inference.networking.x-k8s.io"),
        ],
    )
    gold = index.objective(POOL, "gold")
    assert gold is not None
    assert gold.priority == 5
    plain = index.objective(POOL, "plain")
    assert plain is not None
    assert plain.priority == 0
    # Upstream's reconciler matches the poolRef group against the pool's: a v1 pool is not
    # referenced by a poolRef in the x-k8s.io group.
    assert index.objective(POOL, "alpha") is None
    assert index.objective_verdicts["default/alpha"].reason == "PoolNotFound"
    assert index.objective("default/other", "gold") is None
