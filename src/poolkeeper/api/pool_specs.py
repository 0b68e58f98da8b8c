"""The specs and statuses of the three InferencePool versions: v1alpha2's and v1alpha1's
`selector` map, `targetPortNumber` and `extensionRef` (which differ in the EPP port's name
only), v1's `selector.matchLabels`, `targetPorts` and `endpointPickerRef`, with the rules the
CRDs state in CEL checked here too. The pools that hold them are `pool`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictStr, field_validator, model_validator

from poolkeeper.api.fielderrors import rule_error
from poolkeeper.api.meta import ApiModel
from poolkeeper.api.pool_fields import (
    EPP_PORT_MESSAGE,
    EPP_PORT_RULE,
    MAX_SELECTOR_LABELS,
    MAX_TARGET_PORTS,
    PORTS_UNIQUE_MESSAGE,
    PORTS_UNIQUE_RULE,
    SELECTOR_EXTRA,
    AppProtocol,
    FailureMode,
    Group,
    Kind,
    LabelValue,
    ObjectName,
    ParentReference,
    PortNumber,
    StatusConditions,
    selector_key_issues,
)

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
            json_schema_extra=SELECTOR_EXTRA,
            description="Pod labels that select the pool's model servers (same namespace).",
        ),
    ]
    target_port_number: Annotated[
        PortNumber, Field(description="Port the model servers listen on.")
    ]

    @field_validator("selector")
    @classmethod
    def _selector_keys(cls, value: dict[str, str]) -> dict[str, str]:
        issues = selector_key_issues(value)
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


class PoolStatus(StatusConditions):
    parent_ref: PoolParentReference


class InferencePoolStatus(ApiModel):
    """Per-parent conditions, written by the gateway controller (not by poolkeeper)."""

    parent: Annotated[list[PoolStatus], Field(max_length=32)] = Field(default_factory=list)


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


class InferencePoolV1Alpha1Status(StatusConditions):
    """v1alpha1 status: one conditions list (upstream's `Ready`), written by the gateway."""


# ---------------------------------------------------------------- v1


class LabelSelector(ApiModel):
    """v1 selector: `matchLabels` only (matchExpressions are not part of the API)."""

    match_labels: Annotated[
        dict[str, LabelValue],
        Field(min_length=1, max_length=MAX_SELECTOR_LABELS, json_schema_extra=SELECTOR_EXTRA),
    ]

    @field_validator("match_labels")
    @classmethod
    def _selector_keys(cls, value: dict[str, str]) -> dict[str, str]:
        issues = selector_key_issues(value)
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


class ParentStatus(StatusConditions):
    parent_ref: ParentReference
    controller_name: Annotated[StrictStr, Field(max_length=253)] | None = None


class InferencePoolV1Status(ApiModel):
    parents: Annotated[list[ParentStatus], Field(max_length=32)] = Field(default_factory=list)
