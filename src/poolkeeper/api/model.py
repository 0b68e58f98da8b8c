"""InferenceModel (`inference.networking.x-k8s.io` v1alpha1 and v1alpha2): a client-facing model
name, its criticality, optional weighted target models, and the InferencePool serving it.

Every kubebuilder marker of the upstream type is a constraint here, so constructing an object
validates it exactly as the API server would; `poolkeeper.api.crds` turns the same types into the
CRD. The two versions differ in two places only, both tabled below: the minimum weight (0 vs 1)
and modelName immutability (v1alpha2).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, Self

from pydantic import Field, StrictInt, StrictStr, field_validator, model_validator

from poolkeeper.api.criticality import Criticality, effective_criticality
from poolkeeper.api.fielderrors import FieldError, rule_error
from poolkeeper.api.meta import (
    EPOCH,
    ApiModel,
    ApiObject,
    Condition,
    duplicate_condition_issues,
)

GROUP: Final = "inference.networking.x-k8s.io"
V1ALPHA1: Final = "inference.networking.x-k8s.io/v1alpha1"
V1ALPHA2: Final = "inference.networking.x-k8s.io/v1alpha2"
KIND: Final = "InferenceModel"
VERSIONS: Final = ("v1alpha1", "v1alpha2")

MAX_WEIGHT: Final = 1_000_000
MIN_WEIGHT_BY_VERSION: Final = {"v1alpha1": 0, "v1alpha2": 1}
IMMUTABLE_MODEL_NAME_VERSIONS: Final = frozenset({"v1alpha2"})

WEIGHTS_RULE: Final = "self.all(model, has(model.weight)) || self.all(model, !has(model.weight))"
WEIGHTS_MESSAGE: Final = "Weights should be set for all models, or none of the models."
IMMUTABLE_RULE: Final = "self == oldSelf"
IMMUTABLE_MESSAGE: Final = "modelName is immutable"

GROUP_PATTERN: Final = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
KIND_PATTERN: Final = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"

CONDITION_ACCEPTED: Final = "Accepted"
REASON_ACCEPTED: Final = "Accepted"
REASON_MODEL_NAME_IN_USE: Final = "ModelNameInUse"
REASON_PENDING: Final = "Pending"
REASON_POOL_NOT_FOUND: Final = "PoolNotFound"
REASON_NO_VALID_TARGET_MODEL: Final = "NoValidTargetModel"
PENDING_MESSAGE: Final = "Waiting for controller"


class TargetModel(ApiModel):
    """A model the server knows (base model or LoRA adapter) and its share of the traffic."""

    name: Annotated[
        StrictStr,
        Field(max_length=253, description="Name of the adapter or base model, as served."),
    ]
    weight: Annotated[
        StrictInt | None,
        Field(
            ge=0,
            le=MAX_WEIGHT,
            json_schema_extra={"format": "int32"},
            description=(
                "Proportion of traffic: weight / sum of weights (not a percentage). Either every "
                "target model has a weight or none has (then they share traffic equally)."
            ),
        ),
    ] = None


class PoolObjectReference(ApiModel):
    """The InferencePool this model is served by, in the model's own namespace."""

    group: Annotated[
        StrictStr, Field(max_length=253, pattern=GROUP_PATTERN, description="API group.")
    ] = GROUP
    kind: Annotated[
        StrictStr,
        Field(min_length=1, max_length=63, pattern=KIND_PATTERN, description="Referent kind."),
    ] = "InferencePool"
    name: Annotated[
        StrictStr, Field(min_length=1, max_length=253, description="Name of the InferencePool.")
    ]


class InferenceModelSpec(ApiModel):
    """Desired state: how requests for `modelName` are served."""

    model_name: Annotated[
        StrictStr,
        Field(
            max_length=256,
            description=(
                "The name clients put in the request's `model` field. Unique within a pool "
                "(the oldest InferenceModel wins); may be reused across pools."
            ),
        ),
    ]
    criticality: Annotated[
        Criticality | None,
        Field(description="Critical, Standard or Sheddable. Unset behaves as Standard."),
    ] = None
    target_models: Annotated[
        list[TargetModel],
        Field(
            max_length=10,
            json_schema_extra={
                "x-kubernetes-validations": [{"rule": WEIGHTS_RULE, "message": WEIGHTS_MESSAGE}]
            },
            description="Weighted targets; empty means the request's model name is used as is.",
        ),
    ] = Field(default_factory=list)
    pool_ref: Annotated[
        PoolObjectReference, Field(description="The InferencePool that serves this model.")
    ]

    @field_validator("target_models")
    @classmethod
    def _weights_all_or_none(cls, value: list[TargetModel]) -> list[TargetModel]:
        with_weight = sum(1 for target in value if target.weight is not None)
        if 0 < with_weight < len(value):
            raise rule_error(("", f'Invalid value: "array": {WEIGHTS_MESSAGE}'))
        return value

    @property
    def effective_criticality(self) -> Criticality:
        """The criticality requests get: unset means Standard."""
        return effective_criticality(self.criticality)


def pending_condition() -> Condition:
    """The condition a freshly created object shows before any controller has looked at it."""
    return Condition(
        type=CONDITION_ACCEPTED,
        status="Unknown",
        reason=REASON_PENDING,
        message=PENDING_MESSAGE,
        last_transition_time=EPOCH,
    )


_DEFAULT_CONDITIONS_JSON = [
    {
        "type": CONDITION_ACCEPTED,
        "status": "Unknown",
        "reason": REASON_PENDING,
        "message": PENDING_MESSAGE,
        "lastTransitionTime": "1970-01-01T00:00:00Z",
    }
]


class InferenceModelStatus(ApiModel):
    """Observed state: the `Accepted` condition (see docs/api.md for reasons)."""

    conditions: Annotated[
        list[Condition],
        Field(
            max_length=8,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "default": _DEFAULT_CONDITIONS_JSON,
            },
            description="Conditions, keyed by type.",
        ),
    ] = Field(default_factory=lambda: [pending_condition()])

    @field_validator("conditions")
    @classmethod
    def _unique_types(cls, value: list[Condition]) -> list[Condition]:
        issues = duplicate_condition_issues(value)
        if issues:
            raise rule_error(*issues)
        return value

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


class InferenceModel(ApiObject):
    """A client-facing model name served by an InferencePool."""

    api_version: Literal[
        "inference.networking.x-k8s.io/v1alpha1", "inference.networking.x-k8s.io/v1alpha2"
    ] = V1ALPHA2
    kind: Literal["InferenceModel"] = KIND
    spec: InferenceModelSpec
    status: InferenceModelStatus = Field(default_factory=InferenceModelStatus)

    @model_validator(mode="after")
    def _version_minimum_weight(self) -> Self:
        minimum = MIN_WEIGHT_BY_VERSION[self.version]
        issues = [
            (
                f"spec.targetModels[{i}].weight",
                f"Invalid value: {t.weight}: spec.targetModels[{i}].weight in body should be "
                f"greater than or equal to {minimum}",
            )
            for i, t in enumerate(self.spec.target_models)
            if t.weight is not None and t.weight < minimum
        ]
        if issues:
            raise rule_error(*issues)
        return self

    @property
    def model_name(self) -> str:
        return self.spec.model_name

    @property
    def pool_key(self) -> str:
        """`namespace/poolName` of the referenced InferencePool (always the model's namespace)."""
        return f"{self.metadata.namespace}/{self.spec.pool_ref.name}"

    @property
    def effective_criticality(self) -> Criticality:
        return self.spec.effective_criticality


def validate_update(old: InferenceModel, new: InferenceModel) -> list[FieldError]:
    """Transition rules the API server checks on update (v1alpha2: modelName is immutable)."""
    if new.version in IMMUTABLE_MODEL_NAME_VERSIONS and old.spec.model_name != new.spec.model_name:
        return [FieldError("spec.modelName", f'Invalid value: "string": {IMMUTABLE_MESSAGE}')]
    return []
