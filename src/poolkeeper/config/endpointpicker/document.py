"""The shape of an `EndpointPickerConfig` (llm-d-router `apix/config/v1alpha1`), strict like
upstream's decoder: an unknown key anywhere is an error. Plugin `parameters` stay raw here;
`catalogue.py` checks them per plugin type, as upstream's per-plugin strict decoding does.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field

from poolkeeper.schema import CamelModel

API_VERSIONS: Final = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
DEPRECATED_API_VERSION: Final = "inference.networking.x-k8s.io/v1alpha1"
KIND: Final = "EndpointPickerConfig"


class _Part(CamelModel):
    """A part of the document (frozen, camelCase, unknown keys refused)."""


class PluginSpec(_Part):
    type: str = Field(min_length=1)
    name: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def instance_name(self) -> str:
        return self.name or self.type


class ProfilePlugin(_Part):
    plugin_ref: str = Field(min_length=1)
    weight: float | None = None


class SchedulingProfile(_Part):
    name: str = Field(min_length=1)
    plugins: list[ProfilePlugin] = Field(default_factory=list)


class PluginRef(_Part):
    plugin_ref: str = Field(min_length=1)


class DataSource(_Part):
    plugin_ref: str = Field(min_length=1)
    extractors: list[PluginRef] = Field(default_factory=list)


class DataLayer(_Part):
    inject_defaults: bool | None = None
    sources: list[DataSource] = Field(default_factory=list)
    discovery: PluginRef | None = None
    peer_discovery: PluginRef | None = None
    cross_replica_syncer_plugin_ref: str | None = None
    cross_replica_sync_interval: str | None = None


class PriorityBand(_Part):
    priority: int
    max_bytes: int | str | None = None
    max_requests: int | None = None
    fairness_policy_ref: str | None = None
    ordering_policy_ref: str | None = None


class FlowControl(_Part):
    max_bytes: int | str | None = None
    max_requests: int | None = None
    default_request_ttl: str | None = Field(default=None, alias="defaultRequestTTL")
    no_endpoint_request_ttl: str | None = Field(default=None, alias="noEndpointRequestTTL")
    default_priority_band: PriorityBand | None = None
    default_negative_priority_band: PriorityBand | None = None
    priority_bands: list[PriorityBand] = Field(default_factory=list)
    usage_limit_policy_plugin_ref: str | None = None
    saturation_detector: PluginRef | None = None
    enable_eviction: bool | None = None


class RequestHandler(_Part):
    parsers: list[PluginRef] = Field(default_factory=list)


class EndpointPickerConfig(_Part):
    """The whole document."""

    api_version: Literal["llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"]
    kind: Literal["EndpointPickerConfig"]
    feature_gates: list[str] = Field(default_factory=list)
    plugins: list[PluginSpec]
    scheduling_profiles: list[SchedulingProfile] = Field(default_factory=list)
    data_layer: DataLayer | None = None
    flow_control: FlowControl | None = None
    request_handler: RequestHandler | None = None
    saturation_detector: PluginRef | None = None  # deprecated: flowControl.saturationDetector
    parser: PluginRef | None = None  # deprecated: requestHandler.parsers
