"""InferenceObjective and InferenceModelRewrite (upstream
`apix/v1alpha2/inferenceobjective_types.go`, `inferencemodelrewrite_types.go`, v1.0-v1.5):
poolkeeper's types and the generated CRDs accept and reject the same documents, with the API
server's messages and field paths."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.api.crds import custom_resource_definitions
from poolkeeper.api.load import load_text
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.rewrite import InferenceModelRewrite
from tests.api.apidocs import DELETE, Doc, edit, python_errors
from tests.api.crd_oracle import oracle_errors

X2 = "inference.networking.x-k8s.io/v1alpha2"


def objective_doc(**spec: Any) -> Doc:
    return {
        "apiVersion": X2,
        "kind": "InferenceObjective",
        "metadata": {"name": "food-review", "namespace": "default"},
        "spec": {"poolRef": {"name": "pool"}, **spec},
    }


def rewrite_doc(*rules: Doc) -> Doc:
    return {
        "apiVersion": X2,
        "kind": "InferenceModelRewrite",
        "metadata": {"name": "canary", "namespace": "default"},
        "spec": {"poolRef": {"name": "pool"}, "rules": list(rules)},
    }


def rule(*values: str, **targets: int | None) -> Doc:
    return {
        "matches": [{"model": {"value": v}} for v in values],
        "targets": [
            {"modelRewrite": n} | ({} if w is None else {"weight": w}) for n, w in targets.items()
        ],
    }


OBJ = objective_doc()
R = rewrite_doc(rule("food", v1=90, v2=10))
VALID, INVALID = True, False
CORPUS: list[tuple[str, Doc, bool]] = [
    ("objective-minimal", OBJ, VALID),
    ("objective-priority", objective_doc(priority=10), VALID),
    ("objective-negative-priority", objective_doc(priority=-5), VALID),
    ("objective-priority-string", objective_doc(priority="high"), INVALID),
    ("objective-no-poolref", edit(OBJ, "spec.poolRef", DELETE), INVALID),
    ("objective-empty-pool-name", edit(OBJ, "spec.poolRef.name", ""), INVALID),
    ("objective-bad-kind", edit(OBJ, "spec.poolRef.kind", "1x"), INVALID),
    ("objective-criticality-gone", objective_doc(criticality="Critical"), INVALID),
    ("rewrite-split", R, VALID),
    ("rewrite-generic", rewrite_doc({"targets": [{"modelRewrite": "base"}]}), VALID),
    ("rewrite-unweighted", rewrite_doc(rule("a", x=None, y=None)), VALID),
    (
        "rewrite-type-exact",
        edit(
            R,
            "spec.rules",
            [{**rule("a", x=1), "matches": [{"model": {"type": "Exact", "value": "a"}}]}],
        ),
        VALID,
    ),
    (
        "rewrite-type-prefix",
        edit(
            R,
            "spec.rules",
            [{**rule("a", x=1), "matches": [{"model": {"type": "Prefix", "value": "a"}}]}],
        ),
        INVALID,
    ),
    ("rewrite-empty-value", rewrite_doc(rule("", x=1)), INVALID),
    ("rewrite-match-without-model", edit(R, "spec.rules", [{"matches": [{}]}]), INVALID),
    ("rewrite-weight-zero", rewrite_doc(rule("a", x=0)), INVALID),
    ("rewrite-weight-too-big", rewrite_doc(rule("a", x=1_000_001)), INVALID),
    ("rewrite-targets-empty", rewrite_doc({"matches": [], "targets": []}), INVALID),
    ("rewrite-target-without-name", rewrite_doc({"targets": [{"weight": 1}]}), INVALID),
    ("rewrite-no-rules", edit(R, "spec.rules", DELETE), INVALID),
    ("rewrite-no-poolref", edit(R, "spec.poolRef", DELETE), INVALID),
]


@pytest.mark.parametrize(
    ("doc", "expected"), [(d, e) for _, d, e in CORPUS], ids=[i for i, _, _ in CORPUS]
)
def test_python_and_crd_schema_agree(doc: Doc, expected: bool) -> None:
    python = python_errors(doc)
    schema = oracle_errors(doc, None)
    assert (not python) is expected, python
    assert (not schema) is expected, schema


def test_errors_name_the_field() -> None:
    assert [(e.path, e.message) for e in python_errors(rewrite_doc(rule("a", x=0)))] == [
        (
            "spec.rules[0].targets[0].weight",
            "Invalid value: 0: spec.rules[0].targets[0].weight in body should be greater than "
            "or equal to 1",
        )
    ]
    (error,) = python_errors(objective_doc(criticality="Critical"))
    assert error.path == "spec.criticality"


def test_defaults_follow_upstream() -> None:
    result = load_text(
        "\n---\n".join(
            [
                "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\n"
                "metadata: {name: o}\nspec: {poolRef: {name: p}}",
                "apiVersion: inference.networking.x-k8s.io/v1alpha2\n"
                "kind: InferenceModelRewrite\nmetadata: {name: r}\n"
                "spec: {poolRef: {name: p}, rules: [{matches: [{model: {value: a}}], "
                "targets: [{modelRewrite: b}]}]}",
            ]
        )
    )
    assert result.errors == []
    (objective,) = result.objectives()
    (rewrite,) = result.rewrites()
    assert isinstance(objective, InferenceObjective)
    assert isinstance(rewrite, InferenceModelRewrite)
    assert objective.spec.priority is None
    assert objective.priority == 0
    assert objective.spec.pool_ref.group == "inference.networking.k8s.io"  # the v1 pool group
    assert rewrite.spec.rules[0].matches[0].model.type == "Exact"
    assert objective.status.conditions[0].reason == "Pending"


def test_crd_layout() -> None:
    crds = {c["metadata"]["name"]: c["spec"] for c in custom_resource_definitions()}
    objective = crds["inferenceobjectives.llm-d.ai"]
    rewrite = crds["inferencemodelrewrites.llm-d.ai"]
    for crd in (objective, rewrite):
        assert [(v["name"], v["served"], v["storage"]) for v in crd["versions"]] == [
            ("v1alpha2", True, True)
        ]
    assert [c["name"] for c in objective["versions"][0]["additionalPrinterColumns"]] == [
        "Inference Pool",
        "Priority",
        "Age",
    ]
    spec = objective["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["priority"] == {
        "type": "integer",
        "description": spec["properties"]["priority"]["description"],
    }
    rules = rewrite["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert rules["required"] == ["poolRef", "rules"]
    match = rules["properties"]["rules"]["items"]["properties"]["matches"]["items"]
    assert match["properties"]["model"]["properties"]["type"]["enum"] == ["Exact"]
