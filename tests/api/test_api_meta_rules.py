"""ObjectMeta and Condition: the API server's metadata rules and wording."""

from __future__ import annotations

import pytest

from tests.api.apidocs import Doc, edit, messages, model_doc

M = model_doc()
SUBDOMAIN = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    r"for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
NAME_PART = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
    "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
    "validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def cond(**over: object) -> Doc:
    base: Doc = {
        "type": "Accepted",
        "status": "True",
        "reason": "Accepted",
        "message": "ok",
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }
    return edit(M, "status", {"conditions": [base | over]})


RULES: list[tuple[str, Doc, list[str]]] = [
    (
        "name-required",
        edit(M, "metadata", {}),
        ["metadata.name: Required value: name or generateName is required"],
    ),
    (
        "name-uppercase",
        edit(M, "metadata.name", "Chat"),
        [f'metadata.name: Invalid value: "Chat": {SUBDOMAIN}'],
    ),
    ("name-dotted-ok", edit(M, "metadata.name", "chat.v2"), []),
    (
        "name-too-long",
        edit(M, "metadata.name", "a" * 254),
        [f'metadata.name: Invalid value: "{"a" * 254}": must be no more than 253 characters'],
    ),
    (
        "namespace-dot",
        edit(M, "metadata.namespace", "team.a"),
        [f'metadata.namespace: Invalid value: "team.a": {LABEL}'],
    ),
    ("namespace-ok", edit(M, "metadata.namespace", "team-a"), []),
    (
        "label-key-bad",
        edit(M, "metadata.labels", {"-app": "x"}),
        [f'metadata.labels: Invalid value: "-app": {NAME_PART}'],
    ),
    (
        "label-key-empty-prefix",
        edit(M, "metadata.labels", {"/app": "x"}),
        ['metadata.labels: Invalid value: "/app": prefix part must be non-empty'],
    ),
    (
        "label-key-name-too-long",
        edit(M, "metadata.labels", {"a" * 64: "x"}),
        [
            f'metadata.labels: Invalid value: "{"a" * 64}": '
            "name part must be no more than 63 characters"
        ],
    ),
    ("label-key-prefixed-ok", edit(M, "metadata.labels", {"app.kubernetes.io/name": "x"}), []),
    (
        "label-value-bad",
        edit(M, "metadata.labels", {"app": "x y"}),
        [f'metadata.labels: Invalid value: "x y": {VALUE}'],
    ),
    ("label-value-empty-ok", edit(M, "metadata.labels", {"app": ""}), []),
    (
        "annotation-key-bad",
        edit(M, "metadata.annotations", {"a/b/c": "x"}),
        [
            'metadata.annotations: Invalid value: "a/b/c": a qualified name must consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
            "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
            "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and "
            "'/' (e.g. 'example.com/MyName')"
        ],
    ),
    (
        "annotations-too-big",
        edit(M, "metadata.annotations", {"big": "x" * 262_142}),
        ["metadata.annotations: Too long: may not be more than 262144 bytes"],
    ),
    ("annotation-ok", edit(M, "metadata.annotations", {"example.com/Owner": "team a"}), []),
    (
        "generation-negative",
        edit(M, "metadata.generation", -1),
        ["metadata.generation: Invalid value: -1: must be greater than or equal to 0"],
    ),
    (
        "creation-timestamp-bad",
        edit(M, "metadata.creationTimestamp", "yesterday"),
        [
            'metadata.creationTimestamp: Invalid value: "yesterday": metadata.creationTimestamp in '
            "body must be of type string (RFC 3339 date-time)"
        ],
    ),
    ("kubectl-dump-fields-ok", edit(M, "metadata.managedFields", [{"manager": "kubectl"}]), []),
    (
        "unknown-metadata-field",
        edit(M, "metadata.nmae", "x"),
        ['metadata.nmae: unknown field "metadata.nmae"'],
    ),
    ("condition-ok", cond(), []),
    (
        "condition-type-pattern",
        cond(type="Ready!"),
        [
            'status.conditions[0].type: Invalid value: "Ready!": status.conditions[0].type in body '
            "should match '^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
            "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$'"
        ],
    ),
    ("condition-type-prefixed-ok", cond(type="example.com/Ready"), []),
    (
        "condition-type-too-long",
        cond(type="T" * 317),
        ["status.conditions[0].type: Too long: may not be more than 316 bytes"],
    ),
    (
        "condition-status",
        cond(status="true"),
        [
            'status.conditions[0].status: Unsupported value: "true": supported values: "True", '
            '"False", "Unknown"'
        ],
    ),
    (
        "condition-reason-empty",
        cond(reason=""),
        [
            'status.conditions[0].reason: Invalid value: "": status.conditions[0].reason in body '
            "should be at least 1 chars long"
        ],
    ),
    (
        "condition-reason-pattern",
        cond(reason="Model_Name:In,Use_"),
        [],
    ),
    (
        "condition-reason-trailing-comma",
        cond(reason="InUse,"),
        [
            'status.conditions[0].reason: Invalid value: "InUse,": status.conditions[0].reason in '
            "body should match '^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$'"
        ],
    ),
    (
        "condition-message-too-long",
        cond(message="m" * 32769),
        ["status.conditions[0].message: Too long: may not be more than 32768 bytes"],
    ),
    (
        "condition-message-required",
        edit(
            M,
            "status",
            {
                "conditions": [
                    {
                        "type": "A",
                        "status": "True",
                        "reason": "R",
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }
                ]
            },
        ),
        ["status.conditions[0].message: Required value"],
    ),
    (
        "condition-observed-generation",
        cond(observedGeneration=-2),
        [
            "status.conditions[0].observedGeneration: Invalid value: -2: "
            "status.conditions[0].observedGeneration in body should be greater than or equal to 0"
        ],
    ),
    (
        "condition-time-required",
        edit(
            M,
            "status",
            {"conditions": [{"type": "A", "status": "True", "reason": "R", "message": ""}]},
        ),
        ["status.conditions[0].lastTransitionTime: Required value"],
    ),
]


@pytest.mark.parametrize(("doc", "expected"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(doc: Doc, expected: list[str]) -> None:
    assert messages(doc) == expected
