"""InferenceModel: every validation rule with a failing and a passing case, exact messages."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.api.fielderrors import FieldError
from poolkeeper.api.model import (
    InferenceModel,
    InferenceModelSpec,
    PoolObjectReference,
    TargetModel,
    validate_update,
)
from tests.api.apidocs import DELETE, M1, Doc, edit, messages, model_doc

M = model_doc()

# (id, document, exact expected error lines; empty = valid)
RULES: list[tuple[str, Doc, list[str]]] = [
    ("model-name-required", edit(M, "spec.modelName", DELETE), ["spec.modelName: Required value"]),
    ("model-name-present", M, []),
    (
        "model-name-too-long",
        edit(M, "spec.modelName", "m" * 257),
        ["spec.modelName: Too long: may not be more than 256 bytes"],
    ),
    ("model-name-256-ok", edit(M, "spec.modelName", "m" * 256), []),
    (
        "model-name-not-string",
        edit(M, "spec.modelName", 7),
        [
            'spec.modelName: Invalid value: "integer": spec.modelName in body must be of type '
            'string: "integer"'
        ],
    ),
    (
        "criticality-unsupported",
        model_doc(criticality="High"),
        [
            'spec.criticality: Unsupported value: "High": supported values: "Critical", '
            '"Standard", "Sheddable"'
        ],
    ),
    ("criticality-sheddable-ok", model_doc(criticality="Sheddable"), []),
    (
        "targets-too-many",
        model_doc(targetModels=[{"name": f"t{i}"} for i in range(11)]),
        ["spec.targetModels: Too many: 11: must have at most 10 items"],
    ),
    ("targets-ten-ok", model_doc(targetModels=[{"name": f"t{i}"} for i in range(10)]), []),
    (
        "target-name-required",
        model_doc(targetModels=[{"weight": 1}]),
        ["spec.targetModels[0].name: Required value"],
    ),
    (
        "target-name-too-long",
        model_doc(targetModels=[{"name": "n" * 254}]),
        ["spec.targetModels[0].name: Too long: may not be more than 253 bytes"],
    ),
    ("target-name-253-ok", model_doc(targetModels=[{"name": "n" * 253}]), []),
    (
        "weight-above-max",
        model_doc(targetModels=[{"name": "a", "weight": 2_000_000}]),
        [
            "spec.targetModels[0].weight: Invalid value: 2000000: spec.targetModels[0].weight in "
            "body should be less than or equal to 1000000"
        ],
    ),
    ("weight-max-ok", model_doc(targetModels=[{"name": "a", "weight": 1_000_000}]), []),
    (
        "v1alpha2-weight-zero",
        model_doc(targetModels=[{"name": "a", "weight": 0}, {"name": "b", "weight": 0}]),
        [
            "spec.targetModels[0].weight: Invalid value: 0: spec.targetModels[0].weight in body "
            "should be greater than or equal to 1",
            "spec.targetModels[1].weight: Invalid value: 0: spec.targetModels[1].weight in body "
            "should be greater than or equal to 1",
        ],
    ),
    ("v1alpha2-weight-one-ok", model_doc(targetModels=[{"name": "a", "weight": 1}]), []),
    (
        "v1alpha1-weight-negative",
        model_doc(M1, targetModels=[{"name": "a", "weight": -1}]),
        [
            "spec.targetModels[0].weight: Invalid value: -1: spec.targetModels[0].weight in body "
            "should be greater than or equal to 0"
        ],
    ),
    ("v1alpha1-weight-zero-ok", model_doc(M1, targetModels=[{"name": "a", "weight": 0}]), []),
    (
        "weight-not-integer",
        model_doc(targetModels=[{"name": "a", "weight": "5"}]),
        [
            'spec.targetModels[0].weight: Invalid value: "string": spec.targetModels[0].weight '
            'in body must be of type integer: "string"'
        ],
    ),
    (
        "weights-some-not-all",
        model_doc(targetModels=[{"name": "a", "weight": 1}, {"name": "b"}]),
        [
            'spec.targetModels: Invalid value: "array": Weights should be set for all models, '
            "or none of the models."
        ],
    ),
    ("weights-none-ok", model_doc(targetModels=[{"name": "a"}, {"name": "b"}]), []),
    ("pool-ref-required", edit(M, "spec.poolRef", DELETE), ["spec.poolRef: Required value"]),
    ("pool-ref-name-required", edit(M, "spec.poolRef", {}), ["spec.poolRef.name: Required value"]),
    (
        "pool-ref-name-empty",
        edit(M, "spec.poolRef.name", ""),
        [
            'spec.poolRef.name: Invalid value: "": spec.poolRef.name in body should be at least '
            "1 chars long"
        ],
    ),
    (
        "pool-ref-name-too-long",
        edit(M, "spec.poolRef.name", "p" * 254),
        ["spec.poolRef.name: Too long: may not be more than 253 bytes"],
    ),
    (
        "pool-ref-kind-pattern",
        edit(M, "spec.poolRef.kind", "Inference_Pool"),
        [
            'spec.poolRef.kind: Invalid value: "Inference_Pool": spec.poolRef.kind in body should '
            "match '^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$'"
        ],
    ),
    (
        "pool-ref-kind-empty",
        edit(M, "spec.poolRef.kind", ""),
        [
            'spec.poolRef.kind: Invalid value: "": spec.poolRef.kind in body should be at least '
            "1 chars long"
        ],
    ),
    ("pool-ref-kind-ok", edit(M, "spec.poolRef.kind", "InferencePool"), []),
    (
        "pool-ref-group-pattern",
        edit(M, "spec.poolRef.group", "Example.COM"),
        [
            'spec.poolRef.group: Invalid value: "Example.COM": spec.poolRef.group in body should '
            r"match '^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$'"
        ],
    ),
    (
        "pool-ref-group-too-long",
        edit(M, "spec.poolRef.group", "a" * 254),
        ["spec.poolRef.group: Too long: may not be more than 253 bytes"],
    ),
    ("pool-ref-group-empty-ok", edit(M, "spec.poolRef.group", ""), []),
    (
        "unknown-spec-field",
        edit(M, "spec.weightz", 1),
        ['spec.weightz: unknown field "spec.weightz"'],
    ),
    (
        "unknown-target-field",
        model_doc(targetModels=[{"name": "a", "wieght": 1}]),
        ['spec.targetModels[0].wieght: unknown field "spec.targetModels[0].wieght"'],
    ),
    (
        "status-too-many-conditions",
        edit(
            M,
            "status",
            {
                "conditions": [
                    {
                        "type": f"T{i}",
                        "status": "True",
                        "reason": "R",
                        "message": "",
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }
                    for i in range(9)
                ]
            },
        ),
        ["status.conditions: Too many: 9: must have at most 8 items"],
    ),
    (
        "status-duplicate-condition-type",
        edit(
            M,
            "status",
            {
                "conditions": [
                    {
                        "type": "Accepted",
                        "status": s,
                        "reason": "R",
                        "message": "",
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }
                    for s in ("True", "False")
                ]
            },
        ),
        ['status.conditions[1]: Duplicate value: map[string]interface {}{"type":"Accepted"}'],
    ),
]


@pytest.mark.parametrize(("doc", "expected"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(doc: Doc, expected: list[str]) -> None:
    assert messages(doc) == expected


def _model(**spec: Any) -> InferenceModel:
    return InferenceModel.model_validate(model_doc(**spec))


def test_defaults_and_unset_criticality() -> None:
    m = _model()
    assert m.spec.criticality is None
    assert m.effective_criticality is Criticality.STANDARD
    assert m.spec.pool_ref.group == "inference.networking.x-k8s.io"
    assert m.spec.pool_ref.kind == "InferencePool"
    assert m.spec.target_models == []
    assert "criticality" not in m.to_dict()["spec"]
    # A fresh object shows the CRD's default condition until a controller reconciles it.
    cond = m.status.condition("Accepted")
    assert cond is not None
    assert (cond.status, cond.reason, cond.message) == (
        "Unknown",
        "Pending",
        "Waiting for controller",
    )


def test_explicit_criticality_and_accessors() -> None:
    m = _model(criticality="Sheddable")
    assert m.effective_criticality is Criticality.SHEDDABLE
    assert m.key == "default/chat"
    assert m.pool_key == "default/pool"
    assert m.model_name == "llama"
    assert m.version == "v1alpha2"


def test_python_construction_uses_snake_case_and_validates() -> None:
    spec = InferenceModelSpec(
        model_name="x",
        target_models=[TargetModel(name="a", weight=3)],
        pool_ref=PoolObjectReference(name="p"),
    )
    assert spec.to_dict() == {
        "modelName": "x",
        "targetModels": [{"name": "a", "weight": 3}],
        "poolRef": {"group": "inference.networking.x-k8s.io", "kind": "InferencePool", "name": "p"},
    }
    with pytest.raises(ValueError, match="Weights should be set"):
        InferenceModelSpec(
            model_name="x",
            target_models=[TargetModel(name="a", weight=3), TargetModel(name="b")],
            pool_ref=PoolObjectReference(name="p"),
        )


def test_round_trip_is_stable() -> None:
    m = _model(criticality="Critical", targetModels=[{"name": "a", "weight": 2}])
    assert InferenceModel.model_validate(m.to_dict()) == m


@pytest.mark.parametrize(
    ("api_version", "new_name", "expected"),
    [
        (
            "inference.networking.x-k8s.io/v1alpha2",
            "other",
            [FieldError("spec.modelName", 'Invalid value: "string": modelName is immutable')],
        ),
        ("inference.networking.x-k8s.io/v1alpha2", "llama", []),
        ("inference.networking.x-k8s.io/v1alpha1", "other", []),
    ],
    ids=["v1alpha2-changed", "v1alpha2-unchanged", "v1alpha1-changed-allowed"],
)
def test_model_name_immutability(
    api_version: str, new_name: str, expected: list[FieldError]
) -> None:
    old = InferenceModel.model_validate(model_doc(api_version))
    new = InferenceModel.model_validate(edit(model_doc(api_version), "spec.modelName", new_name))
    assert validate_update(old, new) == expected
