"""ObjectMeta and Condition: the Kubernetes metadata every API object carries, validated like the
API server validates it (names, labels, annotations; metav1.Condition markers).

Also the base class `ApiModel` (a `schema.CamelModel`: unknown fields are errors, camelCase JSON
names; not frozen).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Self

from pydantic import Field, StrictInt, StrictStr, model_validator

from poolkeeper.api.fielderrors import go_value, rule_error
from poolkeeper.api.names import (
    TOTAL_ANNOTATION_SIZE_MAX,
    dns1123_label_errors,
    dns1123_subdomain_errors,
    label_value_errors,
    qualified_name_errors,
)
from poolkeeper.schema import CamelModel


class ApiModel(CamelModel, frozen=False, validate_default=False):
    """Base of every API type: unknown fields are errors, JSON names are camelCase."""

    def to_dict(self) -> dict[str, Any]:
        """The object as the API server would store it (camelCase, unset optionals omitted)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ObjectMeta(ApiModel):
    """Standard object metadata. Only `name` is required; `namespace` defaults to "default"."""

    name: StrictStr = ""
    namespace: StrictStr = "default"
    uid: StrictStr | None = None
    generation: StrictInt | None = None
    creation_timestamp: datetime | None = None
    resource_version: StrictStr | None = None
    labels: dict[str, StrictStr] = Field(default_factory=dict)
    annotations: dict[str, StrictStr] = Field(default_factory=dict)
    # Present in `kubectl get -o yaml` output; accepted so such dumps load, otherwise unused.
    generate_name: StrictStr | None = None
    deletion_timestamp: datetime | None = None
    deletion_grace_period_seconds: StrictInt | None = None
    finalizers: list[StrictStr] | None = None
    owner_references: list[dict[str, Any]] | None = None
    managed_fields: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_names(self) -> Self:
        issues = metadata_issues(self)
        if issues:
            raise rule_error(*issues)
        return self


def metadata_issues(meta: ObjectMeta) -> list[tuple[str, str]]:
    """ValidateObjectMeta's checks, as (relative path, message) pairs."""
    issues: list[tuple[str, str]] = []
    if not meta.name:
        issues.append((".name", "Required value: name or generateName is required"))
    else:
        issues += [
            (".name", f"Invalid value: {go_value(meta.name)}: {msg}")
            for msg in dns1123_subdomain_errors(meta.name)
        ]
    issues += [
        (".namespace", f"Invalid value: {go_value(meta.namespace)}: {msg}")
        for msg in dns1123_label_errors(meta.namespace)
    ]
    if meta.generation is not None and meta.generation < 0:
        issues.append(
            (".generation", f"Invalid value: {meta.generation}: must be greater than or equal to 0")
        )
    for key, value in meta.labels.items():
        issues += [
            (".labels", f"Invalid value: {go_value(key)}: {m}") for m in label_key_errors(key)
        ]
        issues += [
            (".labels", f"Invalid value: {go_value(value)}: {m}") for m in label_value_errors(value)
        ]
    size = 0
    for key, value in meta.annotations.items():
        issues += [
            (".annotations", f"Invalid value: {go_value(key)}: {m}")
            for m in qualified_name_errors(key.lower())
        ]
        size += len(key) + len(value)
    if size > TOTAL_ANNOTATION_SIZE_MAX:
        issues.append(
            (".annotations", f"Too long: may not be more than {TOTAL_ANNOTATION_SIZE_MAX} bytes")
        )
    return issues


def label_key_errors(key: str) -> list[str]:
    return qualified_name_errors(key)


CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """metav1.Condition: one aspect of an object's current state."""

    type: Annotated[
        StrictStr,
        Field(
            max_length=316,
            pattern=CONDITION_TYPE_PATTERN,
            description="Type of condition in CamelCase or in foo.example.com/CamelCase.",
        ),
    ]
    status: Annotated[
        ConditionStatus, Field(description="Status of the condition, one of True, False, Unknown.")
    ]
    observed_generation: Annotated[
        StrictInt | None,
        Field(
            ge=0,
            json_schema_extra={"format": "int64"},
            description="The .metadata.generation that the condition was set based upon.",
        ),
    ] = None
    last_transition_time: Annotated[
        datetime,
        Field(description="Last time the condition transitioned from one status to another."),
    ]
    reason: Annotated[
        StrictStr,
        Field(
            min_length=1,
            max_length=1024,
            pattern=CONDITION_REASON_PATTERN,
            description="Programmatic identifier of the reason for the last transition.",
        ),
    ]
    message: Annotated[
        StrictStr,
        Field(max_length=32768, description="Human readable details about the transition."),
    ]


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def duplicate_condition_issues(conditions: list[Condition]) -> list[tuple[str, str]]:
    """conditions is a list-map keyed by `type`: a repeated type is an error at its index."""
    seen: set[str] = set()
    issues: list[tuple[str, str]] = []
    for i, cond in enumerate(conditions):
        if cond.type in seen:
            value = f'map[string]interface {{}}{{"type":{go_value(cond.type)}}}'
            issues.append((f"[{i}]", f"Duplicate value: {value}"))
        seen.add(cond.type)
    return issues


class ApiObject(ApiModel):
    """A top-level object: apiVersion, kind, metadata (subclasses narrow apiVersion and kind)."""

    api_version: StrictStr
    kind: StrictStr
    metadata: ObjectMeta

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def key(self) -> str:
        """`namespace/name`, the identity of the object within its kind."""
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def ref(self) -> str:
        """`Kind/namespace/name`, how error messages name the object."""
        return f"{self.kind}/{self.metadata.namespace}/{self.metadata.name}"
