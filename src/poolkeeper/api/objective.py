"""InferenceObjective (`llm-d.ai/v1alpha2`, llm-d-router v0.10+; before it
`inference.networking.x-k8s.io/v1alpha2`, GIE v1.0-v1.5): the InferenceModel's successor for
*policy*: an integer `priority` for the requests that name it.

The two groups carry the same schema, so one type validates both apiVersions (two rows of
`poolkeeper.api.versions`). In a cluster the x-k8s group is a read-only fallback, as upstream
reads it: its objects count only while the llm-d.ai CRD is not installed
(`poolkeeper.controller.kubernetes.state`).

Upstream split InferenceModel in two (proposal 1199): identity and traffic split moved to
`InferenceModelRewrite` (`poolkeeper.api.rewrite`) and to HTTPRoutes, and the criticality enum
became `spec.priority`: higher is more important, unset means 0, negative means sheddable. A
request selects an objective by name with the `x-gateway-inference-objective` header (which
poolkeeper honours only when the GatewayConfig trusts it: `requestHandling.trustedHeaders`).

poolkeeper serves priorities through the same criticality bands as InferenceModel
(`poolkeeper.api.criticality.criticality_of_priority`): > 0 Critical, 0 Standard, < 0
Sheddable; the integer itself travels with the request for logs and metrics.

The CRD shape is upstream's field for field (`poolRef.group` defaults to the v1 pool group).
`status.conditions` defaults to `Accepted/Unknown/Pending` (upstream's CRD says `Ready`: the
same documented deviation as InferenceModel's).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, StrictInt, StrictStr

from poolkeeper.api.criticality import Criticality, criticality_of_priority
from poolkeeper.api.meta import ApiModel, ApiObject
from poolkeeper.api.model import GROUP_PATTERN, KIND_PATTERN, InferenceModelStatus
from poolkeeper.api.pool import V1_GROUP

V1ALPHA2: Final = "inference.networking.x-k8s.io/v1alpha2"
GROUP: Final = "inference.networking.x-k8s.io"
LLMD_GROUP: Final = "llm-d.ai"
LLMD_V1ALPHA2: Final = "llm-d.ai/v1alpha2"
KIND: Final = "InferenceObjective"
OBJECTIVE_HEADER: Final = "x-gateway-inference-objective"
DEFAULT_PRIORITY: Final = 0


class PoolReference(ApiModel):
    """The InferencePool, in the referrer's namespace (upstream v1.x `PoolObjectReference`)."""

    group: Annotated[
        StrictStr, Field(max_length=253, pattern=GROUP_PATTERN, description="API group.")
    ] = V1_GROUP
    kind: Annotated[
        StrictStr,
        Field(min_length=1, max_length=63, pattern=KIND_PATTERN, description="Referent kind."),
    ] = "InferencePool"
    name: Annotated[
        StrictStr, Field(min_length=1, max_length=253, description="Name of the InferencePool.")
    ]


class InferenceObjectiveSpec(ApiModel):
    """Desired state: how important the requests that name this objective are."""

    priority: Annotated[
        StrictInt | None,
        Field(
            description=(
                "Higher is more important; negative values are allowed and mean sheddable. "
                "Unset is treated as 0. poolkeeper bands: > 0 Critical, 0 Standard, "
                "< 0 Sheddable."
            )
        ),
    ] = None
    pool_ref: Annotated[
        PoolReference, Field(description="The InferencePool, in the same namespace.")
    ]


class InferenceObjectiveStatus(InferenceModelStatus):
    """Observed state: the `Accepted` condition (see docs/api.md for reasons)."""


class InferenceObjective(ApiObject):
    """A named request objective (priority) for one InferencePool."""

    api_version: Literal["llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"] = V1ALPHA2
    kind: Literal["InferenceObjective"] = KIND
    spec: InferenceObjectiveSpec
    status: InferenceObjectiveStatus = Field(default_factory=InferenceObjectiveStatus)

    @property
    def priority(self) -> int:
        """The effective priority: unset means 0."""
        value = self.spec.priority
        return DEFAULT_PRIORITY if value is None else value

    @property
    def criticality(self) -> Criticality:
        return criticality_of_priority(self.priority)

    @property
    def pool_key(self) -> str:
        return f"{self.metadata.namespace}/{self.spec.pool_ref.name}"

    @property
    def pool_ref_triple(self) -> tuple[str, str, str]:
        """(group, kind, name) of the referenced pool."""
        ref = self.spec.pool_ref
        return ref.group, ref.kind, ref.name
