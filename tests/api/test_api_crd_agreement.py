"""The generated CRDs and the Python types must accept and reject exactly the same objects."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.api.crds import custom_resource_definitions
from tests.api.apidocs import (
    DELETE,
    M1,
    Doc,
    condition,
    edit,
    model_doc,
    pool1_doc,
    pool2_doc,
    pool_alpha1_doc,
    python_errors,
)
from tests.api.crd_oracle import oracle_errors

VALID, INVALID = True, False


def targets(n: int, weight: int | None = None) -> list[dict[str, Any]]:
    return [{"name": f"t{i}"} | ({} if weight is None else {"weight": weight}) for i in range(n)]


def conditions(*items: Doc) -> dict[str, Any]:
    return {"conditions": list(items)}


M = model_doc()
# (id, document, old document for update checks or None, expected verdict)
CORPUS: list[tuple[str, Doc, Doc | None, bool]] = [
    ("model-minimal", M, None, VALID),
    (
        "model-full",
        model_doc(
            criticality="Critical",
            targetModels=[{"name": "a", "weight": 70}, {"name": "b", "weight": 30}],
            poolRef={
                "group": "inference.networking.x-k8s.io",
                "kind": "InferencePool",
                "name": "p",
            },
        ),
        None,
        VALID,
    ),
    ("model-targets-without-weights", model_doc(targetModels=targets(3)), None, VALID),
    ("model-weight-max", model_doc(targetModels=targets(1, 1_000_000)), None, VALID),
    ("model-ten-targets", model_doc(targetModels=targets(10, 1)), None, VALID),
    ("model-name-256", edit(M, "spec.modelName", "m" * 256), None, VALID),
    ("model-pool-group-empty", edit(M, "spec.poolRef.group", ""), None, VALID),
    ("model-criticality-null", model_doc(criticality=None), None, VALID),
    ("model-status", edit(M, "status", conditions(condition())), None, VALID),
    ("v1alpha1-weight-zero", model_doc(M1, targetModels=targets(2, 0)), None, VALID),
    (
        "v1alpha1-zero-and-positive",
        model_doc(M1, targetModels=[{"name": "a", "weight": 0}, {"name": "b", "weight": 5}]),
        None,
        VALID,
    ),
    ("update-same-model-name", M, edit(M, "spec.criticality", "Sheddable"), VALID),
    (
        "v1alpha1-update-model-name",
        model_doc(M1),
        edit(model_doc(M1), "spec.modelName", "x"),
        VALID,
    ),
    ("model-missing-model-name", edit(M, "spec.modelName", DELETE), None, INVALID),
    ("model-name-257", edit(M, "spec.modelName", "m" * 257), None, INVALID),
    ("model-criticality-high", model_doc(criticality="High"), None, INVALID),
    ("model-eleven-targets", model_doc(targetModels=targets(11, 1)), None, INVALID),
    ("model-target-name-254", model_doc(targetModels=[{"name": "n" * 254}]), None, INVALID),
    ("model-target-without-name", model_doc(targetModels=[{"weight": 1}]), None, INVALID),
    ("v1alpha2-weight-zero", model_doc(targetModels=targets(2, 0)), None, INVALID),
    ("model-weight-over-max", model_doc(targetModels=targets(1, 1_000_001)), None, INVALID),
    ("v1alpha1-weight-negative", model_doc(M1, targetModels=targets(1, -1)), None, INVALID),
    (
        "model-weights-mixed",
        model_doc(targetModels=[{"name": "a", "weight": 1}, {"name": "b"}]),
        None,
        INVALID,
    ),
    ("model-weight-string", model_doc(targetModels=[{"name": "a", "weight": "5"}]), None, INVALID),
    ("model-missing-pool-ref", edit(M, "spec.poolRef", DELETE), None, INVALID),
    ("model-pool-name-empty", edit(M, "spec.poolRef.name", ""), None, INVALID),
    ("model-pool-kind-bad", edit(M, "spec.poolRef.kind", "1Pool"), None, INVALID),
    ("model-pool-kind-64", edit(M, "spec.poolRef.kind", "K" * 64), None, INVALID),
    ("model-pool-group-bad", edit(M, "spec.poolRef.group", "Bad_Group"), None, INVALID),
    ("model-unknown-spec-field", edit(M, "spec.foo", 1), None, INVALID),
    ("model-unknown-top-field", edit(M, "extra", {}), None, INVALID),
    (
        "model-nine-conditions",
        edit(M, "status", conditions(*(condition(type=f"T{i}") for i in range(9)))),
        None,
        INVALID,
    ),
    (
        "model-duplicate-condition-type",
        edit(M, "status", conditions(condition(), condition(status="False"))),
        None,
        INVALID,
    ),
    (
        "model-condition-bad-status",
        edit(M, "status", conditions(condition(status="Yes"))),
        None,
        INVALID,
    ),
    (
        "model-condition-bad-reason",
        edit(M, "status", conditions(condition(reason="bad reason!"))),
        None,
        INVALID,
    ),
    (
        "model-condition-bad-type",
        edit(M, "status", conditions(condition(type="-bad"))),
        None,
        INVALID,
    ),
    (
        "model-condition-negative-generation",
        edit(M, "status", conditions(condition(observedGeneration=-1))),
        None,
        INVALID,
    ),
    (
        "model-condition-without-time",
        edit(
            M,
            "status",
            conditions({k: v for k, v in condition().items() if k != "lastTransitionTime"}),
        ),
        None,
        INVALID,
    ),
    ("update-model-name-changed", M, edit(M, "spec.modelName", "other"), INVALID),
    ("pool2-minimal", pool2_doc(), None, VALID),
    (
        "pool2-extension-full",
        pool2_doc(
            extensionRef={
                "group": "",
                "kind": "Service",
                "name": "e",
                "portNumber": 9002,
                "failureMode": "FailOpen",
            }
        ),
        None,
        VALID,
    ),
    ("pool2-prefixed-key", pool2_doc(selector={"example.com/app": "x"}), None, VALID),
    ("pool2-empty-value", pool2_doc(selector={"app": ""}), None, VALID),
    ("pool2-port-zero", pool2_doc(targetPortNumber=0), None, INVALID),
    ("pool2-port-65536", pool2_doc(targetPortNumber=65536), None, INVALID),
    ("pool2-no-extension-ref", edit(pool2_doc(), "spec.extensionRef", DELETE), None, INVALID),
    (
        "pool2-failure-mode-bad",
        pool2_doc(extensionRef={"name": "e", "failureMode": "Open"}),
        None,
        INVALID,
    ),
    ("pool2-selector-value-bad", pool2_doc(selector={"app": "-x"}), None, INVALID),
    ("pool2-selector-key-bad", pool2_doc(selector={"bad key": "x"}), None, INVALID),
    ("pool2-selector-65", pool2_doc(selector={f"k{i}": "v" for i in range(65)}), None, INVALID),
    ("pool-v1alpha1-minimal", pool_alpha1_doc(), None, VALID),
    (
        "pool-v1alpha1-extension-port",
        pool_alpha1_doc(extensionRef={"name": "e", "targetPortNumber": 9002}),
        None,
        VALID,
    ),
    (
        "pool-v1alpha1-status-conditions",
        edit(pool_alpha1_doc(), "status", conditions(condition(type="Ready"))),
        None,
        VALID,
    ),
    (
        "pool-v1alpha1-v1alpha2-port-name",
        pool_alpha1_doc(extensionRef={"name": "e", "portNumber": 9002}),
        None,
        INVALID,
    ),
    ("pool-v1alpha1-port-zero", pool_alpha1_doc(targetPortNumber=0), None, INVALID),
    (
        "pool2-status-object-reference",
        edit(
            pool2_doc(),
            "status",
            {
                "parent": [
                    {
                        "parentRef": {
                            "apiVersion": "gateway.networking.k8s.io/v1",
                            "kind": "Gateway",
                            "name": "gw",
                            "namespace": "default",
                            "uid": "0f6e8e3c-1111-2222-3333-444455556666",
                            "resourceVersion": "42",
                        },
                        "conditions": [condition()],
                    }
                ]
            },
        ),
        None,
        VALID,
    ),
    (
        "pool2-status-gateway-reference",
        edit(
            pool2_doc(),
            "status",
            {"parent": [{"parentRef": {"kind": "Status", "name": "default"}}]},
        ),
        None,
        VALID,
    ),
    (
        "pool2-status-parent-ref-unknown-field",
        edit(pool2_doc(), "status", {"parent": [{"parentRef": {"name": "gw", "port": 1}}]}),
        None,
        INVALID,
    ),
    ("pool1-minimal", pool1_doc(), None, VALID),
    (
        "pool1-no-endpoint-picker-ref",
        edit(pool1_doc(), "spec.endpointPickerRef", DELETE),
        None,
        VALID,
    ),
    (
        "pool1-eight-ports",
        pool1_doc(targetPorts=[{"number": 8000 + i} for i in range(8)]),
        None,
        VALID,
    ),
    ("pool1-h2c", pool1_doc(appProtocol="kubernetes.io/h2c"), None, VALID),
    (
        "pool1-epp-not-service",
        pool1_doc(endpointPickerRef={"kind": "Backend", "group": "example.com", "name": "e"}),
        None,
        VALID,
    ),
    ("pool1-empty-match-labels", pool1_doc(selector={"matchLabels": {}}), None, INVALID),
    (
        "pool1-nine-ports",
        pool1_doc(targetPorts=[{"number": 8000 + i} for i in range(9)]),
        None,
        INVALID,
    ),
    ("pool1-duplicate-ports", pool1_doc(targetPorts=[{"number": 1}, {"number": 1}]), None, INVALID),
    ("pool1-no-ports", pool1_doc(targetPorts=[]), None, INVALID),
    ("pool1-app-protocol-bad", pool1_doc(appProtocol="grpc"), None, INVALID),
    ("pool1-epp-service-without-port", pool1_doc(endpointPickerRef={"name": "e"}), None, INVALID),
    ("pool1-selector-key-bad", pool1_doc(selector={"matchLabels": {"a/b/c": "x"}}), None, INVALID),
    ("pool1-unknown-field", edit(pool1_doc(), "spec.ports", [1]), None, INVALID),
]


def test_corpus_is_large_and_mixed() -> None:
    verdicts = [case[3] for case in CORPUS]
    assert len(CORPUS) >= 40
    assert verdicts.count(VALID) >= 15
    assert verdicts.count(INVALID) >= 25
    assert len({case[0] for case in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize(
    ("doc", "old", "expected"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS]
)
def test_python_and_crd_schema_agree(doc: Doc, old: Doc | None, expected: bool) -> None:
    python = python_errors(doc, old)
    schema = oracle_errors(doc, old)
    assert (not python) is expected, python
    assert (not schema) is expected, schema


def test_crd_layout() -> None:
    crds = {c["metadata"]["name"]: c for c in custom_resource_definitions()}
    assert set(crds) == {
        "inferencemodels.inference.networking.x-k8s.io",
        "inferencepools.inference.networking.x-k8s.io",
        "inferencepools.inference.networking.k8s.io",
        "inferenceobjectives.llm-d.ai",  # the x-k8s group of these two: read, never served
        "inferencemodelrewrites.llm-d.ai",
    }
    for name in ("inferenceobjectives.llm-d.ai", "inferencemodelrewrites.llm-d.ai"):
        spec = crds[name]["spec"]
        assert [(v["name"], v["served"], v["storage"]) for v in spec["versions"]] == [
            ("v1alpha2", True, True)
        ]
        assert spec["versions"][0]["subresources"] == {"status": {}}
        assert "api-approved.kubernetes.io" not in crds[name]["metadata"]["annotations"]
    model = crds["inferencemodels.inference.networking.x-k8s.io"]["spec"]
    assert [(v["name"], v["served"], v["storage"]) for v in model["versions"]] == [
        ("v1alpha1", True, False),
        ("v1alpha2", True, True),
    ]
    v2 = model["versions"][1]
    assert v2["subresources"] == {"status": {}}
    assert [c["name"] for c in v2["additionalPrinterColumns"]] == [
        "Model Name",
        "Inference Pool",
        "Criticality",
        "Age",
    ]
    schema = v2["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]
    assert spec["modelName"]["x-kubernetes-validations"] == [
        {"rule": "self == oldSelf", "message": "modelName is immutable"}
    ]
    v1alpha1_spec = model["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "x-kubernetes-validations" not in v1alpha1_spec["properties"]["modelName"]
    assert spec["poolRef"]["properties"]["group"]["default"] == "inference.networking.x-k8s.io"
    assert spec["poolRef"]["properties"]["kind"]["default"] == "InferencePool"
    conds = schema["properties"]["status"]["properties"]["conditions"]
    assert conds["x-kubernetes-list-type"] == "map"
    assert conds["x-kubernetes-list-map-keys"] == ["type"]
    assert conds["default"][0]["reason"] == "Pending"
    v1 = crds["inferencepools.inference.networking.k8s.io"]["spec"]
    assert v1["names"]["shortNames"] == ["infpool"]
    ports = v1["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "targetPorts"
    ]
    assert ports["x-kubernetes-validations"][0]["message"] == "port number must be unique"
    v1_spec = v1["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "endpointPickerRef" not in v1_spec["required"]  # optional since upstream v1.6
    # v1alpha1 pools load from files only: no CRD version serves them (see docs/api.md).
    x_pool = crds["inferencepools.inference.networking.x-k8s.io"]["spec"]
    assert [(v["name"], v["served"], v["storage"]) for v in x_pool["versions"]] == [
        ("v1alpha2", True, True)
    ]
    parent_ref = x_pool["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"][
        "properties"
    ]["parent"]["items"]["properties"]["parentRef"]
    assert {"group", "kind", "name", "namespace", "apiVersion", "uid"} <= set(
        parent_ref["properties"]
    )
    assert "required" not in parent_ref


def _walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node, *(n for v in node.values() for n in _walk(v))]
    if isinstance(node, list):
        return [n for v in node for n in _walk(v)]
    return []


def test_schemas_are_structural() -> None:
    """Every schema node has a type, no unions or refs survive, no `additionalProperties: false`."""
    for crd in custom_resource_definitions():
        for version in crd["spec"]["versions"]:
            root = version["schema"]["openAPIV3Schema"]
            for key in ("$ref", "anyOf", "oneOf", "title", "$defs"):
                assert all(key not in node for node in _walk(root)), key
            for node in _walk(root["properties"]["spec"]):
                if "properties" in node or "items" in node:
                    assert node.get("type") in ("object", "array"), node
                assert node.get("additionalProperties") is not False
