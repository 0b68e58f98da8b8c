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

This module owns the pools and their accessors; their specs and statuses are `pool_specs`, what
the versions share (field types, the selector rule, the endpoint picker target) `pool_fields`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

from poolkeeper.api.meta import ApiObject
from poolkeeper.api.pool_fields import BUILT_IN_EPP, EndpointPickerTarget, selector_matches
from poolkeeper.api.pool_specs import (
    InferencePoolSpec,
    InferencePoolStatus,
    InferencePoolV1Alpha1Spec,
    InferencePoolV1Alpha1Status,
    InferencePoolV1Spec,
    InferencePoolV1Status,
)

X_GROUP: Final = "inference.networking.x-k8s.io"
V1_GROUP: Final = "inference.networking.k8s.io"
V1ALPHA1: Final = "inference.networking.x-k8s.io/v1alpha1"
V1ALPHA2: Final = "inference.networking.x-k8s.io/v1alpha2"
V1: Final = "inference.networking.k8s.io/v1"
KIND: Final = "InferencePool"


# ---------------------------------------------------------------- v1alpha2


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


class InferencePoolV1Alpha1(_SelectorPool):
    """`inference.networking.x-k8s.io/v1alpha1` InferencePool (upstream v0.1, removed in v0.2)."""

    api_version: Literal["inference.networking.x-k8s.io/v1alpha1"] = V1ALPHA1
    kind: Literal["InferencePool"] = KIND
    spec: InferencePoolV1Alpha1Spec
    status: InferencePoolV1Alpha1Status | None = None


# ---------------------------------------------------------------- v1


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
