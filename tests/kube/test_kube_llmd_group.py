"""InferenceObjective and InferenceModelRewrite in `llm-d.ai/v1alpha2` (llm-d-router v0.10) and
the read-only fallback to `inference.networking.x-k8s.io`, from files and from the API server."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from poolkeeper.api.load import load_text
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.rewrite import InferenceModelRewrite
from poolkeeper.controller.kubernetes.objects import parse_object
from tests.kube.conftest import NS, Factory, X, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer

LLMD = "llm-d.ai"


def objective_obj(name: str, group: str, priority: int = 5) -> dict[str, Any]:
    return {
        "apiVersion": f"{group}/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"priority": priority, "poolRef": {"group": X, "name": "pool"}},
    }


def rewrite_obj(name: str, group: str, target: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{group}/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "poolRef": {"group": X, "name": "pool"},
            "rules": [
                {"matches": [{"model": {"value": "m"}}], "targets": [{"modelRewrite": target}]}
            ],
        },
    }


FILE = """
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: urgent}
spec: {priority: 10, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: pool}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: canary}
spec:
  poolRef: {name: pool}
  rules: [{targets: [{modelRewrite: m-v2, weight: 10}]}]
"""


def test_both_groups_load_from_files() -> None:
    result = load_text(FILE)
    assert result.ok, result.errors
    by_name = {o.name: o for o in result.objectives()}
    assert by_name["urgent"].api_version == "llm-d.ai/v1alpha2"
    assert by_name["urgent"].priority == 10
    assert by_name["batch"].api_version == "inference.networking.x-k8s.io/v1alpha2"
    (rewrite,) = result.rewrites()
    assert rewrite.api_version == "llm-d.ai/v1alpha2"
    assert rewrite.spec.rules[0].targets[0].model_rewrite == "m-v2"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            "spec: {priority: high, poolRef: {name: pool}}",
            'spec.priority: Invalid value: "string": spec.priority in body must be of type integer',
        ),
        ("spec: {priority: 1}", "spec.poolRef: Required value"),
        (
            "spec: {poolRef: {name: pool, kind: 9bad}}",
            'spec.poolRef.kind: Invalid value: "9bad": spec.poolRef.kind in body should match',
        ),
    ],
)
def test_an_invalid_llmd_objective_gets_a_precise_error(doc: str, message: str) -> None:
    text = (
        f"apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {{name: o}}\n{doc}\n"
    )
    result = load_text(text)
    assert not result.ok
    assert message in str(result.errors[0])


def test_an_unknown_llmd_version_names_the_supported_ones() -> None:
    result = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: InferenceObjective\nmetadata: {name: o}\n"
    )
    assert 'Unsupported value: "llm-d.ai/v1alpha1": supported values: "llm-d.ai/v1alpha2"' in str(
        result.errors[0]
    )


def test_the_api_server_double_parses_both_groups() -> None:
    for group in (LLMD, X):
        parsed, problems = parse_object(objective_obj("o", group))
        assert isinstance(parsed, InferenceObjective), problems
        parsed, problems = parse_object(rewrite_obj("r", group, "m2"))
        assert isinstance(parsed, InferenceModelRewrite), problems


def seed(fake: FakeApiServer) -> None:
    fake.put(pool_obj(), "inferencepools")
    fake.put(pod_obj("p0", "10.0.0.1"), "pods")
    fake.put(objective_obj("urgent", LLMD, 10), "inferenceobjectives")
    fake.put(objective_obj("legacy", X, 3), "inferenceobjectives")
    fake.put(rewrite_obj("new", LLMD, "m-new"), "inferencemodelrewrites")
    fake.put(rewrite_obj("old", X, "m-old"), "inferencemodelrewrites")


async def test_with_the_llmd_crds_installed_legacy_objects_are_ignored(
    fake: FakeApiServer, make_source: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    seed(fake)
    source, store = await make_source(write_status=False)
    with caplog.at_level(logging.WARNING):
        await source.start()
    assert sorted(p.name for p in source.state.policies()) == ["new", "urgent"]
    view = store.snapshot().model_index
    assert view.objective(f"{NS}/pool", "urgent") is not None
    assert view.objective(f"{NS}/pool", "legacy") is None
    ignored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring")]
    assert any("InferenceObjective default/legacy" in m for m in ignored)
    assert any("InferenceModelRewrite default/old" in m for m in ignored)
    caplog.clear()
    source.state.policies()  # logged once per object, not on every change
    assert not [r for r in caplog.records if "legacy" in r.getMessage()]


async def test_without_the_llmd_crds_the_legacy_group_is_read_as_deprecated(
    fake: FakeApiServer, make_source: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    seed(fake)
    fake.unserved.add((LLMD, "v1alpha2", "inferenceobjectives"))
    fake.unserved.add((LLMD, "v1alpha2", "inferencemodelrewrites"))
    source, store = await make_source(write_status=False)
    with caplog.at_level(logging.WARNING):
        await source.start()
    assert sorted(p.name for p in source.state.policies()) == ["legacy", "old"]
    assert store.snapshot().model_index.objective(f"{NS}/pool", "legacy") is not None
    deprecated = [r.getMessage() for r in caplog.records if "DEPRECATION" in r.getMessage()]
    assert len(deprecated) == 2


async def test_the_fallback_is_per_kind(fake: FakeApiServer, make_source: Factory) -> None:
    seed(fake)
    fake.unserved.add((LLMD, "v1alpha2", "inferencemodelrewrites"))  # only objectives moved
    source, _ = await make_source(write_status=False)
    await source.start()
    assert sorted(p.name for p in source.state.policies()) == ["old", "urgent"]


async def test_installing_the_llmd_crd_later_switches_off_the_fallback(
    fake: FakeApiServer, make_source: Factory
) -> None:
    seed(fake)
    fake.unserved.add((LLMD, "v1alpha2", "inferenceobjectives"))
    source, _ = await make_source(write_status=False)
    await source.start()
    assert "legacy" in {p.name for p in source.state.policies()}
    fake.unserved.discard((LLMD, "v1alpha2", "inferenceobjectives"))
    cache = next(
        c
        for c in source.state.policy_caches
        if c.kind.group == LLMD and c.kind.kind == "InferenceObjective"
    )
    await source._list(cache)  # what the watch loop does when it looks for the CRD again
    assert "legacy" not in {p.name for p in source.state.policies()}
    assert "urgent" in {p.name for p in source.state.policies()}
