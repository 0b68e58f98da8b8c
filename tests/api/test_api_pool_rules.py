"""InferencePool (v1alpha1, v1alpha2 and v1): every rule failing and passing, and the shared
accessors."""

from __future__ import annotations

import pytest

from poolkeeper.api.pool import (
    AnyInferencePool,
    InferencePool,
    InferencePoolV1,
    InferencePoolV1Alpha1,
)
from poolkeeper.api.pool_fields import BUILT_IN_EPP
from tests.api.apidocs import DELETE, Doc, edit, messages, pool1_doc, pool2_doc, pool_alpha1_doc

KEY_MSG = (
    "selector keys must be valid label keys: an optional DNS subdomain prefix and '/', then a "
    "name of at most 63 characters (alphanumeric, '-', '_' or '.', alphanumeric at both ends), "
    "at most 253 characters in all"
)
VALUE_PATTERN = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
P2, P1 = pool2_doc(), pool1_doc()

RULES: list[tuple[str, Doc, list[str]]] = [
    ("v1alpha2-ok", P2, []),
    ("selector-required", edit(P2, "spec.selector", DELETE), ["spec.selector: Required value"]),
    (
        "selector-key-invalid",
        pool2_doc(selector={"app name": "x"}),
        [f'spec.selector: Invalid value: "app name": {KEY_MSG}'],
    ),
    ("selector-key-prefixed-ok", pool2_doc(selector={"example.com/app": "x"}), []),
    (
        "selector-key-too-long",
        pool2_doc(selector={"a" * 200 + ".com/" + "b" * 60: "x"}),
        [f'spec.selector: Invalid value: "{"a" * 200}.com/{"b" * 60}": {KEY_MSG}'],
    ),
    (
        "selector-value-invalid",
        pool2_doc(selector={"app": "vllm!"}),
        [
            'spec.selector.app: Invalid value: "vllm!": spec.selector.app in body should match '
            f"'{VALUE_PATTERN}'"
        ],
    ),
    (
        "selector-value-too-long",
        pool2_doc(selector={"app": "v" * 64}),
        ["spec.selector.app: Too long: may not be more than 63 bytes"],
    ),
    ("selector-value-empty-ok", pool2_doc(selector={"app": ""}), []),
    (
        "selector-too-many-labels",
        pool2_doc(selector={f"k{i}": "v" for i in range(65)}),
        ["spec.selector: Too many: 65: must have at most 64 properties"],
    ),
    (
        "target-port-required",
        edit(P2, "spec.targetPortNumber", DELETE),
        ["spec.targetPortNumber: Required value"],
    ),
    (
        "target-port-zero",
        pool2_doc(targetPortNumber=0),
        [
            "spec.targetPortNumber: Invalid value: 0: spec.targetPortNumber in body should be "
            "greater than or equal to 1"
        ],
    ),
    (
        "target-port-too-big",
        pool2_doc(targetPortNumber=70000),
        [
            "spec.targetPortNumber: Invalid value: 70000: spec.targetPortNumber in body should be "
            "less than or equal to 65535"
        ],
    ),
    ("target-port-65535-ok", pool2_doc(targetPortNumber=65535), []),
    (
        "extension-ref-required",
        edit(P2, "spec.extensionRef", DELETE),
        ["spec.extensionRef: Required value"],
    ),
    (
        "extension-name-required",
        pool2_doc(extensionRef={"portNumber": 9002}),
        ["spec.extensionRef.name: Required value"],
    ),
    (
        "extension-port-zero",
        pool2_doc(extensionRef={"name": "e", "portNumber": 0}),
        [
            "spec.extensionRef.portNumber: Invalid value: 0: spec.extensionRef.portNumber in body "
            "should be greater than or equal to 1"
        ],
    ),
    (
        "extension-failure-mode",
        pool2_doc(extensionRef={"name": "e", "failureMode": "FailSoft"}),
        [
            'spec.extensionRef.failureMode: Unsupported value: "FailSoft": supported values: '
            '"FailOpen", "FailClose"'
        ],
    ),
    (
        "extension-fail-open-ok",
        pool2_doc(extensionRef={"name": "e", "failureMode": "FailOpen"}),
        [],
    ),
    (
        "extension-kind-pattern",
        pool2_doc(extensionRef={"name": "e", "kind": "my service"}),
        [
            'spec.extensionRef.kind: Invalid value: "my service": spec.extensionRef.kind in body '
            "should match '^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$'"
        ],
    ),
    ("v1-ok", P1, []),
    (
        "match-labels-empty",
        pool1_doc(selector={"matchLabels": {}}),
        [
            "spec.selector.matchLabels: Invalid value: 0: spec.selector.matchLabels in body should "
            "have at least 1 properties"
        ],
    ),
    (
        "match-labels-required",
        pool1_doc(selector={}),
        ["spec.selector.matchLabels: Required value"],
    ),
    (
        "match-labels-65",
        pool1_doc(selector={"matchLabels": {f"k{i}": "v" for i in range(65)}}),
        ["spec.selector.matchLabels: Too many: 65: must have at most 64 properties"],
    ),
    (
        "target-ports-empty",
        pool1_doc(targetPorts=[]),
        [
            "spec.targetPorts: Invalid value: 0: spec.targetPorts in body should have at least "
            "1 items"
        ],
    ),
    (
        "target-ports-nine",
        pool1_doc(targetPorts=[{"number": 8000 + i} for i in range(9)]),
        ["spec.targetPorts: Too many: 9: must have at most 8 items"],
    ),
    (
        "target-ports-duplicate",
        pool1_doc(targetPorts=[{"number": 8000}, {"number": 8000}]),
        ['spec.targetPorts: Invalid value: "array": port number must be unique'],
    ),
    ("target-ports-eight-ok", pool1_doc(targetPorts=[{"number": 8000 + i} for i in range(8)]), []),
    (
        "app-protocol-unsupported",
        pool1_doc(appProtocol="grpc"),
        [
            'spec.appProtocol: Unsupported value: "grpc": supported values: "http", '
            '"kubernetes.io/h2c"'
        ],
    ),
    ("app-protocol-h2c-ok", pool1_doc(appProtocol="kubernetes.io/h2c"), []),
    (
        "epp-service-needs-port",
        pool1_doc(endpointPickerRef={"name": "epp"}),
        [
            'spec.endpointPickerRef: Invalid value: "object": port is required when kind is '
            "'Service' or unspecified (defaults to 'Service')"
        ],
    ),
    (
        "epp-other-kind-without-port-ok",
        pool1_doc(endpointPickerRef={"name": "epp", "kind": "Backend", "group": "example.com"}),
        [],
    ),
    (
        "epp-port-number-range",
        pool1_doc(endpointPickerRef={"name": "epp", "port": {"number": 0}}),
        [
            "spec.endpointPickerRef.port.number: Invalid value: 0: "
            "spec.endpointPickerRef.port.number in body should be greater than or equal to 1"
        ],
    ),
    (
        "v1-unknown-field",
        edit(P1, "spec.targetPortNumber", 8000),
        ['spec.targetPortNumber: unknown field "spec.targetPortNumber"'],
    ),
]


@pytest.mark.parametrize(("doc", "expected"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(doc: Doc, expected: list[str]) -> None:
    assert messages(doc) == expected


def test_v1alpha2_defaults() -> None:
    pool = InferencePool.model_validate(P2)
    ref = pool.spec.extension_ref
    assert (ref.group, ref.kind, ref.port_number, ref.failure_mode) == (
        "",
        "Service",
        None,
        "FailClose",
    )


def test_v1_defaults() -> None:
    pool = InferencePoolV1.model_validate(P1)
    assert pool.spec.app_protocol == "http"
    ref = pool.spec.endpoint_picker_ref
    assert ref is not None
    assert ref.failure_mode == "FailClose"
    assert ref.kind == "Service"


EQUIVALENT: list[AnyInferencePool] = [
    InferencePoolV1Alpha1.model_validate(
        pool_alpha1_doc(
            selector={"app": "vllm", "tier": "gpu"},
            targetPortNumber=8000,
            extensionRef={"name": "epp", "targetPortNumber": 9002, "failureMode": "FailOpen"},
        )
    ),
    InferencePool.model_validate(
        pool2_doc(
            selector={"app": "vllm", "tier": "gpu"},
            targetPortNumber=8000,
            extensionRef={"name": "epp", "portNumber": 9002, "failureMode": "FailOpen"},
        )
    ),
    InferencePoolV1.model_validate(
        pool1_doc(
            selector={"matchLabels": {"app": "vllm", "tier": "gpu"}},
            targetPorts=[{"number": 8000}],
            endpointPickerRef={"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
        )
    ),
]


@pytest.mark.parametrize("pool", EQUIVALENT, ids=["v1alpha1", "v1alpha2", "v1"])
def test_accessors_do_not_depend_on_version(pool: AnyInferencePool) -> None:
    assert pool.key == "default/pool"
    assert pool.selector() == {"app": "vllm", "tier": "gpu"}
    assert pool.target_ports() == (8000,)
    assert pool.failure_mode() == "FailOpen"
    assert pool.matches({"app": "vllm", "tier": "gpu", "extra": "x"})
    assert not pool.matches({"app": "vllm"})
    assert not pool.matches({"app": "vllm", "tier": "cpu"})
    epp = pool.endpoint_picker()
    assert (epp.name, epp.port, epp.kind) == ("epp", 9002, "Service")


def test_v1_multiple_ports_in_order() -> None:
    pool = InferencePoolV1.model_validate(
        pool1_doc(targetPorts=[{"number": 8001}, {"number": 8000}])
    )
    assert pool.target_ports() == (8001, 8000)


def test_v1_without_endpoint_picker_ref_uses_the_built_in_epp_fail_close() -> None:
    """Optional since upstream v1.6 (`api/v1/inferencepool_types.go@v1.6.0`)."""
    pool = InferencePoolV1.model_validate(edit(P1, "spec.endpointPickerRef", DELETE))
    assert pool.endpoint_picker() == BUILT_IN_EPP
    assert pool.failure_mode() == "FailClose"


def test_v1alpha1_messages() -> None:
    assert messages(pool_alpha1_doc(extensionRef={"name": "e", "portNumber": 1})) == [
        'spec.extensionRef.portNumber: unknown field "spec.extensionRef.portNumber"'
    ]
    assert messages(edit(pool_alpha1_doc(), "spec.extensionRef", DELETE)) == [
        "spec.extensionRef: Required value"
    ]
