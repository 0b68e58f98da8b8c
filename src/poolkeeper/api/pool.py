"""InferencePool: the set of model-server pods (label selector + port) and its endpoint picker.

Three API versions with different shapes, one Python class each:

* `InferencePoolV1Alpha1` `inference.networking.x-k8s.io/v1alpha1` (upstream v0.1): as v1alpha2,
  but the EPP port is `extensionRef.targetPortNumber` and status is a plain `conditions` list.
* `InferencePool`   `inference.networking.x-k8s.io/v1alpha2`: `selector` map, one
  `targetPortNumber`, `extensionRef` (inline `failureMode`). Status `parent[].parentRef` in
  either upstream shape (v0.2-v0.4 `ObjectReference`, v0.5 `ParentGatewayReference`).
* `InferencePoolV1` `inference.networking.k8s.io/v1` (GA): `selector.matchLabels`, up to 8
  `targetPorts`, `appProtocol`, optional (since upstream v1.6) `endpointPickerRef` with
  `port.number`. Without one, poolkeeper's own EPP picks for the pool, FailClose.

Both offer the same accessors (`key`, `selector()`, `target_ports()`, `failure_mode()`,
`matches()`, `endpoint_picker()`), so the rest of poolkeeper takes an `AnyInferencePool` and
never looks at the version.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Final, Literal

from pydantic import Field, StrictInt, StrictStr, field_validator, model_validator

from poolkeeper.api.fielderrors import go_value, rule_error
from poolkeeper.api.meta import ApiModel, ApiObject, Condition, duplicate_condition_issues
from poolkeeper.api.model import GROUP_PATTERN, KIND_PATTERN

X_GROUP: Final = "inference.networking.x-k8s.io"
V1_GROUP: Final = "inference.networking.k8s.io"
V1ALPHA1: Final = "inference.networking.x-k8s.io/v1alpha1"
V1ALPHA2: Final = "inference.networking.x-k8s.io/v1alpha2"
V1: Final = "inference.networking.k8s.io/v1"
KIND: Final = "InferencePool"

FailureMode = Literal["FailOpen", "FailClose"]
AppProtocol = Literal["http", "kubernetes.io/h2c"]

LABEL_KEY_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
LABEL_KEY_MAX: Final = 253
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
MAX_SELECTOR_LABELS: Final = 64
MAX_TARGET_PORTS: Final = 8

SELECTOR_KEY_MESSAGE: Final = (
    "selector keys must be valid label keys: an optional DNS subdomain prefix and '/', then a "
    "name of at most 63 characters (alphanumeric, '-', '_' or '.', alphanumeric at both ends), "
    f"at most {LABEL_KEY_MAX} characters in all"
)
PORTS_UNIQUE_RULE: Final = "self.all(p1, self.exists_one(p2, p1.number == p2.number))"
PORTS_UNIQUE_MESSAGE: Final = "port number must be unique"
EPP_PORT_RULE: Final = "self.kind != 'Service' || has(self.port)"
EPP_PORT_MESSAGE: Final = (
    "port is required when kind is 'Service' or unspecified (defaults to 'Service')"
)

_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)


def cel_string(value: str) -> str:
    """A CEL single-quoted string literal for `value` (regexes need their backslashes kept)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


SELECTOR_KEY_RULE: Final = (
    f"self.all(key, size(key) <= {LABEL_KEY_MAX} && key.matches({cel_string(LABEL_KEY_PATTERN)}))"
)

LabelValue = Annotated[StrictStr, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
PortNumber = Annotated[StrictInt, Field(ge=1, le=65535, json_schema_extra={"format": "int32"})]
Group = Annotated[StrictStr, Field(max_length=253, pattern=GROUP_PATTERN)]
Kind = Annotated[StrictStr, Field(min_length=1, max_length=63, pattern=KIND_PATTERN)]
ObjectName = Annotated[StrictStr, Field(min_length=1, max_length=253)]

_SELECTOR_EXTRA = {
    "x-kubernetes-validations": [{"rule": SELECTOR_KEY_RULE, "message": SELECTOR_KEY_MESSAGE}]
}


def _selector_key_issues(selector: Mapping[str, str]) -> list[tuple[str, str]]:
    return [
        ("", f"Invalid value: {go_value(key)}: {SELECTOR_KEY_MESSAGE}")
        for key in selector
        if len(key) > LABEL_KEY_MAX or not _LABEL_KEY.match(key)
    ]


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Equality-based label selection; an empty selector selects everything."""
    return all(labels.get(key) == value for key, value in selector.items())


@dataclass(frozen=True, slots=True)
class EndpointPickerTarget:
    """Where the pool's endpoint picker runs, whichever API version described it."""

    group: str
    kind: str
    name: str
    port: int | None
    failure_mode: str


# A v1 pool without `endpointPickerRef` (allowed since upstream v1.6): poolkeeper's managed
# gateway always routes through its own EPP, so such a pool is picked for by that EPP, and the
# gateway fails closed (the API's default failure mode) when the EPP cannot answer.
BUILT_IN_EPP: Final = EndpointPickerTarget("", "", "", None, "FailClose")


class _Conditions(ApiModel):
    conditions: Annotated[
        list[Condition],
        Field(
            max_length=8,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        ),
    ] = Field(default_factory=list)

    @field_validator("conditions")
    @classmethod
    def _unique_types(cls, value: list[Condition]) -> list[Condition]:
        issues = duplicate_condition_issues(value)
        if issues:
            raise rule_error(*issues)
        return value


class ParentReference(ApiModel):
    """The Gateway (or other parent) a pool status entry is about."""

    group: Group = "gateway.networking.k8s.io"
    kind: Kind = "Gateway"
    name: ObjectName
    namespace: Annotated[StrictStr, Field(min_length=1, max_length=63)] | None = None


# ---------------------------------------------------------------- v1alpha2


class _ExtensionRef(ApiModel):
    """What both x-k8s.io versions' `extensionRef` share (the port field follows)."""

    group: Annotated[Group, Field(description='API group; "" is the core group.')] = ""
    kind: Annotated[
        Kind, Field(description="Referent kind (ExternalName Services are not supported).")
    ] = "Service"
    name: Annotated[ObjectName, Field(description="Name of the referent.")]


_EppPort = Annotated[
    PortNumber | None,
    Field(description="Port of the ext_proc service; implementations assume 9002 when unset."),
]
_FailureMode = Annotated[
    FailureMode,
    Field(description="What the gateway does when the endpoint picker cannot be reached."),
]


class Extension(_ExtensionRef):
    """v1alpha2 `extensionRef`: the Service running the endpoint picker."""

    port_number: _EppPort = None
    failure_mode: _FailureMode = "FailClose"

    def port(self) -> int | None:
        return self.port_number


class _SelectorSpec(ApiModel):
    """What both x-k8s.io versions' spec share (`extensionRef` follows)."""

    selector: Annotated[
        dict[str, LabelValue],
        Field(
            max_length=MAX_SELECTOR_LABELS,
            json_schema_extra=_SELECTOR_EXTRA,
            description="Pod labels that select the pool's model servers (same namespace).",
        ),
    ]
    target_port_number: Annotated[
        PortNumber, Field(description="Port the model servers listen on.")
    ]

    @field_validator("selector")
    @classmethod
    def _selector_keys(cls, value: dict[str, str]) -> dict[str, str]:
        issues = _selector_key_issues(value)
        if issues:
            raise rule_error(*issues)
        return value


class InferencePoolSpec(_SelectorSpec):
    """v1alpha2 pool: pods matching `selector`, served on `targetPortNumber`."""

    extension_ref: Annotated[Extension, Field(description="The endpoint picker service.")]


class PoolParentReference(ParentReference):
    """v1alpha2 status `parentRef`: upstream v0.5's ParentGatewayReference, or the
    `corev1.ObjectReference` of v0.2-v0.4 (`apiVersion`, `uid`, ... and an optional name).
    Status is written by gateways, never user input, so both shapes load."""

    name: ObjectName | None = None  # type: ignore[assignment]
    api_version: Annotated[StrictStr, Field(description="ObjectReference (v0.2-v0.4).")] = ""
    uid: Annotated[StrictStr, Field(description="ObjectReference (v0.2-v0.4).")] = ""
    resource_version: Annotated[StrictStr, Field(description="ObjectReference (v0.2-v0.4).")] = ""
    field_path: Annotated[StrictStr, Field(description="ObjectReference (v0.2-v0.4).")] = ""


class PoolStatus(_Conditions):
    parent_ref: PoolParentReference


class InferencePoolStatus(ApiModel):
    """Per-parent conditions, written by the gateway controller (not by poolkeeper)."""

    parent: Annotated[list[PoolStatus], Field(max_length=32)] = Field(default_factory=list)


class _SelectorPool(ApiObject):
    """The accessors of the two `inference.networking.x-k8s.io` pools: a selector map, one
    target port and an `extensionRef` (v1alpha1 differs from v1alpha2 in names only)."""

    spec: InferencePoolSpec | InferencePoolV1Alpha1Spec

    def selector(self) -> dict[str, str]:
        return dict(self.spec.selector)

    def target_ports(self) -> tuple[int, ...]:
        return (self.spec.target_port_number,)

    def failure_mode(self) -> str:
        return self.spec.extension_ref.failure_mode

    def app_protocol(self) -> str:
        return "http"

    def matches(self, labels: Mapping[str, str]) -> bool:
        return selector_matches(self.spec.selector, labels)

    def endpoint_picker(self) -> EndpointPickerTarget:
        ref = self.spec.extension_ref
        return EndpointPickerTarget(ref.group, ref.kind, ref.name, ref.port(), ref.failure_mode)


class InferencePool(_SelectorPool):
    """`inference.networking.x-k8s.io/v1alpha2` InferencePool."""

    api_version: Literal["inference.networking.x-k8s.io/v1alpha2"] = V1ALPHA2
    kind: Literal["InferencePool"] = KIND
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None


# ---------------------------------------------------------------- v1alpha1


class ExtensionV1Alpha1(_ExtensionRef):
    """v1alpha1 `extensionRef`: as v1alpha2, the port is called `targetPortNumber`."""

    target_port_number: _EppPort = None
    failure_mode: _FailureMode = "FailClose"

    def port(self) -> int | None:
        return self.target_port_number


class InferencePoolV1Alpha1Spec(_SelectorSpec):
    """v1alpha1 pool (upstream v0.1): pods matching `selector`, served on `targetPortNumber`."""

    extension_ref: Annotated[ExtensionV1Alpha1, Field(description="The endpoint picker service.")]


class InferencePoolV1Alpha1Status(_Conditions):
    """v1alpha1 status: one conditions list (upstream's `Ready`), written by the gateway."""


class InferencePoolV1Alpha1(_SelectorPool):
    """`inference.networking.x-k8s.io/v1alpha1` InferencePool (upstream v0.1, removed in v0.2)."""

    api_version: Literal["inference.networking.x-k8s.io/v1alpha1"] = V1ALPHA1
    kind: Literal["InferencePool"] = KIND
    spec: InferencePoolV1Alpha1Spec
    status: InferencePoolV1Alpha1Status | None = None


# ---------------------------------------------------------------- v1


class LabelSelector(ApiModel):
    """v1 selector: `matchLabels` only (matchExpressions are not part of the API)."""

    match_labels: Annotated[
        dict[str, LabelValue],
        Field(min_length=1, max_length=MAX_SELECTOR_LABELS, json_schema_extra=_SELECTOR_EXTRA),
    ]

    @field_validator("match_labels")
    @classmethod
    def _selector_keys(cls, value: dict[str, str]) -> dict[str, str]:
        issues = _selector_key_issues(value)
        if issues:
            raise rule_error(*issues)
        return value


class Port(ApiModel):
    number: Annotated[PortNumber, Field(description="Port number.")]


class EndpointPickerRef(ApiModel):
    """v1 `endpointPickerRef`: the endpoint picker service and its port."""

    model_config = {
        "json_schema_extra": {
            "x-kubernetes-validations": [{"rule": EPP_PORT_RULE, "message": EPP_PORT_MESSAGE}]
        }
    }

    group: Group = ""
    kind: Kind = "Service"
    name: ObjectName
    port: Port | None = None
    failure_mode: FailureMode = "FailClose"

    @model_validator(mode="after")
    def _port_required_for_service(self) -> EndpointPickerRef:
        if self.kind == "Service" and self.port is None:
            raise rule_error(("", f'Invalid value: "object": {EPP_PORT_MESSAGE}'))
        return self


class InferencePoolV1Spec(ApiModel):
    selector: LabelSelector
    target_ports: Annotated[
        list[Port],
        Field(
            min_length=1,
            max_length=MAX_TARGET_PORTS,
            json_schema_extra={
                "x-kubernetes-list-type": "atomic",
                "x-kubernetes-validations": [
                    {"rule": PORTS_UNIQUE_RULE, "message": PORTS_UNIQUE_MESSAGE}
                ],
            },
            description="Ports the model servers listen on (one per data-parallel rank).",
        ),
    ]
    app_protocol: AppProtocol = "http"
    endpoint_picker_ref: Annotated[
        EndpointPickerRef | None,
        Field(
            description="The endpoint picker (optional since upstream v1.6; without it "
            "poolkeeper's own EPP picks, FailClose)."
        ),
    ] = None

    @field_validator("target_ports")
    @classmethod
    def _unique_ports(cls, value: list[Port]) -> list[Port]:
        numbers = [p.number for p in value]
        if len(set(numbers)) != len(numbers):
            raise rule_error(("", f'Invalid value: "array": {PORTS_UNIQUE_MESSAGE}'))
        return value


class ParentStatus(_Conditions):
    parent_ref: ParentReference
    controller_name: Annotated[StrictStr, Field(max_length=253)] | None = None


class InferencePoolV1Status(ApiModel):
    parents: Annotated[list[ParentStatus], Field(max_length=32)] = Field(default_factory=list)


class InferencePoolV1(ApiObject):
    """`inference.networking.k8s.io/v1` InferencePool (GA shape)."""

    api_version: Literal["inference.networking.k8s.io/v1"] = V1
    kind: Literal["InferencePool"] = KIND
    spec: InferencePoolV1Spec
    status: InferencePoolV1Status | None = None

    def selector(self) -> dict[str, str]:
        return dict(self.spec.selector.match_labels)

    def target_ports(self) -> tuple[int, ...]:
        return tuple(p.number for p in self.spec.target_ports)

    def failure_mode(self) -> str:
        ref = self.spec.endpoint_picker_ref
        return BUILT_IN_EPP.failure_mode if ref is None else ref.failure_mode

    def app_protocol(self) -> str:
        return self.spec.app_protocol

    def matches(self, labels: Mapping[str, str]) -> bool:
        return selector_matches(self.spec.selector.match_labels, labels)

    def endpoint_picker(self) -> EndpointPickerTarget:
        ref = self.spec.endpoint_picker_ref
        if ref is None:
            return BUILT_IN_EPP
        port = ref.port.number if ref.port is not None else None
        return EndpointPickerTarget(ref.group, ref.kind, ref.name, port, ref.failure_mode)


AnyInferencePool = InferencePoolV1Alpha1 | InferencePool | InferencePoolV1
