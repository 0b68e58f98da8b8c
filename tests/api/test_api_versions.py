"""One table of API generations: validation, CRDs, watches, RBAC and pool types agree with it."""

from __future__ import annotations

import typing

import pytest

import poolkeeper.api as api_package
from poolkeeper.api import objective, pool, rewrite
from poolkeeper.api.crds import custom_resource_definitions, version_schema
from poolkeeper.api.kinds import default_registry
from poolkeeper.api.meta import ApiObject
from poolkeeper.api.status import POOL_GROUPS
from poolkeeper.api.versions import GENERATIONS, Generation, fallback_applies, groups_of
from poolkeeper.cli.deploy_objects import role_rules
from poolkeeper.cli.deploy_params import DeployParams
from poolkeeper.controller.kubernetes.objects import MODEL_KINDS, POLICY_KINDS, POOL_KINDS

ROWS = {(row.api_version, row.kind): row for row in GENERATIONS}
WATCH_SLOTS = (*POOL_KINDS, MODEL_KINDS, *POLICY_KINDS)


def _api_types() -> list[type[ApiObject]]:
    found: list[type[ApiObject]] = []
    todo = list(ApiObject.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith(api_package.__name__ + "."):
            found.append(cls)
    return found


def test_rows_are_unique_and_each_names_a_type_that_validates_it() -> None:
    assert len(ROWS) == len(GENERATIONS)
    for row in GENERATIONS:
        assert row.model.model_fields["api_version"].default in typing.get_args(
            row.model.model_fields["api_version"].annotation
        )


def test_every_api_type_is_in_the_table_for_each_version_it_accepts() -> None:
    for cls in _api_types():
        accepted = typing.get_args(cls.model_fields["api_version"].annotation)
        if not accepted:
            continue  # a shared base (`_SelectorPool`): no apiVersion of its own
        (kind,) = typing.get_args(cls.model_fields["kind"].annotation)
        for api_version in accepted:
            assert ROWS[(api_version, kind)].model is cls, (api_version, kind)


def test_the_kind_registry_validates_exactly_the_table() -> None:
    api_entries = {
        (e.api_version, e.kind): e.target
        for e in default_registry().entries()
        if (e.api_version, e.kind) in ROWS
    }
    assert api_entries == {key: row.model for key, row in ROWS.items()}


def test_the_crds_serve_exactly_the_served_rows() -> None:
    served = set()
    for crd in custom_resource_definitions():
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
        assert [v["storage"] for v in spec["versions"]].count(True) == 1
        for version in spec["versions"]:
            key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
            assert version["storage"] is ROWS[key].storage
            assert version["schema"]["openAPIV3Schema"] == version_schema(*key)
            served.add(key)
    assert served == {key for key, row in ROWS.items() if row.served}
    for key in ROWS:
        assert version_schema(*key)["properties"]["spec"]


def test_the_watches_cover_every_row_one_slot_per_resource() -> None:
    watched = {(k.api_version, k.kind, k.plural) for slot in WATCH_SLOTS for k in slot}
    assert watched == {(r.api_version, r.kind, r.plural) for r in GENERATIONS}
    for slot in WATCH_SLOTS:
        assert len({(k.group, k.kind) for k in slot}) == 1
        rows = [ROWS[(k.api_version, k.kind)] for k in slot]
        if any(row.served for row in rows):
            assert rows[0].storage  # the stored version first
        else:
            assert all(row.fallback for row in rows)  # a legacy group: read, never served


def test_the_controller_may_read_every_watched_resource() -> None:
    rules = role_rules(DeployParams())
    readable = {
        (group, resource)
        for rule in rules
        if "watch" in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert {(row.group, row.plural) for row in GENERATIONS} <= readable


def test_pool_types_and_groups_follow_the_table() -> None:
    pool_rows = [row for row in GENERATIONS if row.kind == pool.KIND]
    assert {row.model for row in pool_rows} == set(typing.get_args(pool.AnyInferencePool))
    assert POOL_GROUPS == groups_of(pool.KIND) == (pool.X_GROUP, pool.V1_GROUP)


def test_a_row_its_type_does_not_validate_is_refused() -> None:
    with pytest.raises(ValueError, match="does not validate"):
        Generation("example.dev/v1", pool.KIND, pool.InferencePool)
    with pytest.raises(ValueError, match="must be served"):
        Generation(pool.V1, pool.KIND, pool.InferencePoolV1, storage=True, served=False)


def test_the_legacy_group_of_objectives_and_rewrites_is_a_read_only_fallback() -> None:
    for kind in (objective.KIND, rewrite.KIND):
        assert groups_of(kind) == ("llm-d.ai", "inference.networking.x-k8s.io")
        assert fallback_applies(kind, "llm-d.ai", ()) is True
        assert fallback_applies(kind, "llm-d.ai", ("llm-d.ai",)) is True
        legacy = "inference.networking.x-k8s.io"
        assert fallback_applies(kind, legacy, ()) is True
        assert fallback_applies(kind, legacy, (legacy,)) is True
        assert fallback_applies(kind, legacy, ("llm-d.ai", legacy)) is False
        assert fallback_applies(kind, "example.dev", ()) is None
    assert fallback_applies(pool.KIND, pool.X_GROUP, (pool.V1_GROUP,)) is True  # both count
    with pytest.raises(ValueError, match="never served"):
        Generation(objective.V1ALPHA2, objective.KIND, objective.InferenceObjective, fallback=True)
