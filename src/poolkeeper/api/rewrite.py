"""InferenceModelRewrite (`llm-d.ai/v1alpha2`, llm-d-router v0.10+; before it
`inference.networking.x-k8s.io/v1alpha2`, GIE v1.3-v1.5; one type for both groups, the x-k8s
one a read-only fallback in a cluster as for InferenceObjective): maps
the model a client asks for onto weighted target models within one InferencePool, the traffic
split that InferenceModel's `targetModels` used to carry.

    rules[].matches[].model {type: Exact (default, the only type), value}  -> the rule applies
    rules[].targets[] {modelRewrite, weight 1..1,000,000}                  -> what is served

A rule without `matches` is generic: it applies to every model of the pool. Precedence (upstream
`modelrewritestore.go`): an exact match beats a generic rule; between resources the oldest wins
(creationTimestamp, ties broken by namespace/name here so that every replica agrees); within one
resource the first rule in list order wins. The datastore's model index applies these rules
(`poolkeeper.datastore.rewrites`), the Director draws a target with the same weighted split as
InferenceModel (`requestcontrol/split.py`).

Weights follow upstream's reading: every target unweighted means an even split; where some
targets carry a weight, an unweighted one gets 0 (never chosen).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import Field, StrictInt, StrictStr

from poolkeeper.api.meta import ApiModel, ApiObject
from poolkeeper.api.model import MAX_WEIGHT, InferenceModelStatus
from poolkeeper.api.objective import PoolReference

V1ALPHA2: Final = "inference.networking.x-k8s.io/v1alpha2"
LLMD_V1ALPHA2: Final = "llm-d.ai/v1alpha2"
KIND: Final = "InferenceModelRewrite"
REWRITE_HEADER: Final = "x-gateway-model-name-rewrite"


class MatchType(StrEnum):
    """String matching of a model match (upstream `MatchValidationType`)."""

    EXACT = "Exact"


class ModelMatch(ApiModel):
    """How the request's `model` is matched."""

    type: Annotated[
        MatchType, Field(description="String matching to use; only Exact is supported.")
    ] = MatchType.EXACT
    value: Annotated[StrictStr, Field(min_length=1, description="The model name to match.")]


class Match(ApiModel):
    """One match criterion of a rule."""

    model: Annotated[ModelMatch, Field(description="Criteria for the body's `model` field.")]


class RewriteTarget(ApiModel):
    """A weighted model destination."""

    model_rewrite: Annotated[
        StrictStr, Field(description="The model name sent to the model server.")
    ]
    weight: Annotated[
        StrictInt | None,
        Field(
            ge=1,
            le=MAX_WEIGHT,
            json_schema_extra={"format": "int32"},
            description=(
                "Proportion of traffic: weight / sum of weights (not a percentage). With no "
                "weight on any target the split is even."
            ),
        ),
    ] = None


class InferenceModelRewriteRule(ApiModel):
    """Match criteria (any of them; none = every model) and the targets to draw from."""

    matches: Annotated[
        list[Match],
        Field(description="A request matches if ANY criterion does; empty matches all requests."),
    ] = Field(default_factory=list)
    targets: Annotated[
        list[RewriteTarget],
        Field(min_length=1, description="Weighted model targets (at least one when set)."),
    ] = Field(default_factory=list)

    def exact_models(self) -> tuple[str, ...]:
        """The model names this rule matches exactly, without repeats, in list order."""
        return tuple(dict.fromkeys(m.model.value for m in self.matches))

    @property
    def generic(self) -> bool:
        return not self.matches


class InferenceModelRewriteSpec(ApiModel):
    """Desired state: the ordered rewrite rules of one pool."""

    pool_ref: Annotated[
        PoolReference, Field(description="The InferencePool, in the same namespace.")
    ]
    rules: Annotated[
        list[InferenceModelRewriteRule],
        Field(description="Ordered rules; the first matching rule of this resource is used."),
    ]


class InferenceModelRewriteStatus(InferenceModelStatus):
    """Observed state: the `Accepted` condition (see docs/api.md for reasons)."""


class InferenceModelRewrite(ApiObject):
    """Model-name rewrite and traffic-split rules for one InferencePool."""

    api_version: Literal["llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"] = V1ALPHA2
    kind: Literal["InferenceModelRewrite"] = KIND
    spec: InferenceModelRewriteSpec
    status: InferenceModelRewriteStatus = Field(default_factory=InferenceModelRewriteStatus)

    @property
    def pool_key(self) -> str:
        return f"{self.metadata.namespace}/{self.spec.pool_ref.name}"

    @property
    def pool_ref_triple(self) -> tuple[str, str, str]:
        """(group, kind, name) of the referenced pool."""
        ref = self.spec.pool_ref
        return ref.group, ref.kind, ref.name
