"""The GatewayConfig document (`poolkeeper.dev/v1alpha1`): how one poolkeeper gateway runs.

Loaded by `poolkeeper.config.load` from the same YAML files as the InferencePool /
InferenceModel objects. Validated once, up front; pydantic error locations carry the camelCase
field path (`spec.endpoints.1.port`). Every field has a default, so an empty `spec: {}` (or no
document at all: `GatewayConfig.default()`) gives a working local gateway. The field reference
lives in docs/configuration.md, generated from this schema by `poolkeeper.config.docs`.

This module only gathers: each section is declared by the package that reads it (listeners and
edge: `envoy/config.py`; request handling: `requestcontrol/config.py`; scraping:
`backend/config.py`; scheduling, admission, flow control, replica sync: their packages), except
`spec.endpoints[]`, the document's own (`config/endpoints.py`). Rules that span sections live
here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, Self, TypeVar

from pydantic import BaseModel, Field, model_validator

from poolkeeper.api.fielderrors import go_value, rule_error
from poolkeeper.api.meta import ObjectMeta
from poolkeeper.api.names import host_errors as host_errors
from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.engines import Engine as Engine  # the field type of endpoints[].engine
from poolkeeper.config.endpoints import StaticEndpoint as StaticEndpoint
from poolkeeper.envoy.config import (
    DEFAULT_INFERENCE_PATHS as DEFAULT_INFERENCE_PATHS,
    Edge as Edge,
    Listeners as Listeners,
)
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.bandconfig import BandMode
from poolkeeper.flowcontrol.config import FlowControlConfig, HoldNewPrefixes
from poolkeeper.hostport import join_hostport
from poolkeeper.requestcontrol.config import (
    RequestHandling as RequestHandling,
    TrustedHeader as TrustedHeader,
    UnknownModelPolicy as UnknownModelPolicy,
)
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.schema import CamelModel

API_VERSION: Final = "poolkeeper.dev/v1alpha1"
KIND: Final = "GatewayConfig"

_M = TypeVar("_M", bound=BaseModel)


class _Section(CamelModel, use_attribute_docstrings=True):
    """A GatewayConfig section: documented by the docstring under each field."""


def _defaults_of(cls: type[_M]) -> Callable[[], _M]:
    """A default factory: the section validated from `{}` (all its own defaults)."""
    return lambda: cls.model_validate({})


class GatewayConfigSpec(_Section):
    """The gateway's settings. Every section is optional."""

    listeners: Listeners = Field(default_factory=Listeners)
    """Bind address and ports."""
    endpoints: list[StaticEndpoint] = Field(default_factory=list)
    """Standalone mode: the model servers pool selectors choose from (Kubernetes mode uses
    Pods instead)."""
    scheduling: SchedulingConfig = Field(default_factory=_defaults_of(SchedulingConfig))
    """Scheduler plugins and profiles; omitted means the documented default profile."""
    scraping: ScrapingConfig = Field(default_factory=_defaults_of(ScrapingConfig))
    """Metrics scraping: interval, timeout, engine mappings, staleness."""
    admission: AdmissionConfig = Field(default_factory=_defaults_of(AdmissionConfig))
    """Saturation thresholds for shedding by criticality."""
    request_handling: RequestHandling = Field(default_factory=RequestHandling)
    """Body parsing, unknown models, stream usage, fallbacks."""
    flow_control: FlowControlConfig = Field(default_factory=_defaults_of(FlowControlConfig))
    """Queueing instead of shedding: strict criticality bands, fair sharing of token
    throughput between models, per-band bounds and time-to-live (docs/flowcontrol.md)."""
    edge: Edge = Field(default_factory=Edge)
    """The public listener: inference paths, timeouts."""
    replica_sync: ReplicaSyncConfig = Field(default_factory=ReplicaSyncConfig)
    """Cross-replica sync: active-active EPP replicas tell each other their routing
    decisions (off by default)."""

    def longest_queue_wait(self) -> tuple[str, float] | None:
        """The queueing band with the longest TTL and that TTL in seconds; None without flow
        control or without a `queue` band."""
        if not self.flow_control.enabled:
            return None
        bands = self.flow_control.bands
        waits = {
            name: band.ttl_ms / 1000.0
            for name, band in (
                ("critical", bands.critical),
                ("standard", bands.standard),
                ("sheddable", bands.sheddable),
            )
            if band.mode is BandMode.QUEUE
        }
        if not waits:
            return None
        return max(waits.items(), key=lambda item: item[1])

    def hold_left_out(self) -> str | None:
        """Why `holdNewPrefixes` (on by default) is off where its default would not fit before
        Envoy gives up on the EPP (left at its default it steps aside there, see below), for
        the EPP to say at start; None where the hold is on or would fit."""
        queued = self.longest_queue_wait()
        if queued is None or self.flow_control.hold_new_prefixes is not None:
            return None
        name, longest = queued
        held_ms = HoldNewPrefixes().max_hold_ms
        if longest + held_ms / 1000.0 < self.edge.epp_timeout_s:
            return None
        return (
            f"flowControl.holdNewPrefixes is off (its default would not fit): the longest "
            f"queue TTL (flowControl.bands."
            f"{name}.ttlMs {longest * 1000:g}) plus the hold's maxHoldMs {held_ms} reaches "
            f"edge.eppTimeoutS {self.edge.epp_timeout_s:g}"
        )

    @model_validator(mode="after")
    def _epp_timeout_outlasts_queueing(self) -> Self:
        # Envoy gives up on the EPP after eppTimeoutS; a request still waiting in a
        # flow-control queue then would get Envoy's 504 instead of its band's outcome.
        queued = self.longest_queue_wait()
        if queued is None:
            return self
        name, longest = queued
        # A held request's queue TTL starts when its hold ends.
        flow_control = self.flow_control
        hold = flow_control.hold_new_prefixes
        held_ms = hold.max_hold_ms if hold is not None else 0
        late = longest + held_ms / 1000.0 >= self.edge.epp_timeout_s
        if late and held_ms and "hold_new_prefixes" not in flow_control.model_fields_set:
            # The hold is on by default: where it would not fit, it steps aside rather
            # than fail a config that loaded before it was (set it to be told; the EPP
            # says so at start: `hold_left_out`). The section is frozen, and this spec is
            # the one being validated now.
            off = flow_control.model_copy(update={"hold_new_prefixes": None})
            object.__setattr__(self, "flow_control", off)
            held_ms = 0
        if longest + held_ms / 1000.0 >= self.edge.epp_timeout_s:
            plus = f" plus holdNewPrefixes.maxHoldMs {held_ms}" if held_ms else ""
            raise rule_error(
                (
                    ".edge.eppTimeoutS",
                    f"Invalid value: {go_value(self.edge.epp_timeout_s)}: must exceed the "
                    f"longest flow-control queue TTL (flowControl.bands.{name}.ttlMs "
                    f"{longest * 1000:g}){plus}, or a request still queued gets "
                    "Envoy's 504",
                )
            )
        return self

    @model_validator(mode="after")
    def _unique_endpoints(self) -> Self:
        names: dict[str, int] = {}
        hostports: dict[str, int] = {}
        issues: list[tuple[str, str]] = []
        for i, endpoint in enumerate(self.endpoints):
            if endpoint.name in names:
                issues.append(
                    (
                        f".endpoints[{i}].name",
                        f"Duplicate value: {go_value(endpoint.name)}: "
                        f"already used by endpoints[{names[endpoint.name]}]",
                    )
                )
            names.setdefault(endpoint.name, i)
            if endpoint.port is None:
                continue  # the port comes from the selecting pool; clashes are the pool's
            hostport = join_hostport(endpoint.address, endpoint.port)
            if hostport in hostports:
                issues.append(
                    (
                        f".endpoints[{i}].port",
                        f"Duplicate value: {go_value(hostport)}: "
                        f"already used by endpoints[{hostports[hostport]}]",
                    )
                )
            hostports.setdefault(hostport, i)
        if issues:
            raise rule_error(*issues)
        return self


class GatewayConfig(_Section):
    """`apiVersion: poolkeeper.dev/v1alpha1`, `kind: GatewayConfig`."""

    api_version: Literal["poolkeeper.dev/v1alpha1"] = API_VERSION
    kind: Literal["GatewayConfig"] = KIND
    metadata: ObjectMeta = Field(default_factory=lambda: ObjectMeta(name="default"))
    spec: GatewayConfigSpec = Field(default_factory=GatewayConfigSpec)

    @classmethod
    def default(cls) -> GatewayConfig:
        """The configuration used when no GatewayConfig document is given."""
        return cls()

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> GatewayConfig:
        """Validate a decoded YAML/JSON document (raises pydantic.ValidationError)."""
        return cls.model_validate(document)
