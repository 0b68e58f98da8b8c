"""ModelIndex: one answer to "which InferenceModel does this modelName mean", whatever the order."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import InferencePool
from poolkeeper.api.status import judge_models
from poolkeeper.datastore.models import build_model_index


def pool(name: str) -> Any:
    return InferencePool.model_validate(
        {
            "metadata": {"name": name},
            "spec": {
                "selector": {"app": name},
                "targetPortNumber": 8000,
                "extensionRef": {"name": "epp"},
            },
        }
    )


def model(name: str, model_name: str, pool_name: str, created: str | None) -> InferenceModel:
    meta: dict[str, Any] = {"name": name}
    if created is not None:
        meta["creationTimestamp"] = created
    return InferenceModel.model_validate(
        {"metadata": meta, "spec": {"modelName": model_name, "poolRef": {"name": pool_name}}}
    )


POOLS = [pool("a"), pool("b")]
MODELS = [
    model("winner", "chat", "a", "2025-01-01T00:00:00Z"),
    model("loser", "chat", "a", "2025-01-01T00:00:01Z"),
    model("base", "llama-base", "b", None),
    model("orphan", "orphan", "missing", "2024-01-01T00:00:00Z"),
    # Older than `winner` but only in pool b: resolves there across pools.
    model("elsewhere", "chat-b", "b", "2020-01-01T00:00:00Z"),
]


@pytest.mark.parametrize("order", range(5))
def test_index_is_independent_of_input_order(order: int) -> None:
    models = MODELS[order:] + MODELS[:order]
    pools = POOLS[order % 2 :] + POOLS[: order % 2]
    index = build_model_index(pools, models)
    assert {name: (r.pool_key, r.model and r.model.name) for name, r in index.by_name.items()} == {
        "chat": ("default/a", "winner"),
        "llama-base": ("default/b", "base"),
        "chat-b": ("default/b", "elsewhere"),
    }
    assert dict(index.models("default/a")) == {"chat": MODELS[0]}
    assert index.names() == ("chat", "chat-b", "llama-base")
    assert index.resolve("orphan") is None
    assert index.models("default/missing") == {}


def test_verdicts_are_the_status_rules() -> None:
    index = build_model_index(POOLS, MODELS)
    assert dict(index.verdicts) == judge_models(POOLS, MODELS)


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("2025-01-01T00:00:00Z", "2025-06-01T00:00:00Z", "one"),
        ("2025-06-01T00:00:00Z", "2025-01-01T00:00:00Z", "two"),
        # A model that states its age outranks one that does not (the status rule), in every
        # pool order: the Director used to treat a missing timestamp as the oldest.
        (None, "2025-01-01T00:00:00Z", "two"),
        ("2025-01-01T00:00:00Z", None, "one"),
        # Equal ages: namespace/name decides, never the pool order.
        ("2025-01-01T00:00:00Z", "2025-01-01T00:00:00Z", "one"),
    ],
)
def test_a_name_in_two_pools_goes_to_the_oldest_model(
    first: str | None, second: str | None, expected: str
) -> None:
    models = [model("one", "chat", "a", first), model("two", "chat", "b", second)]
    for pools, ms in itertools.product([POOLS, POOLS[::-1]], [models, models[::-1]]):
        route = build_model_index(pools, ms).resolve("chat")
        assert route is not None
        assert route.model is not None
        assert route.model.name == expected
        assert route.pool_key == ("default/a" if expected == "one" else "default/b")
