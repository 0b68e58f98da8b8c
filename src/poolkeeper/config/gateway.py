"""The GatewayConfig document (`poolkeeper.dev/v1alpha1`): how one poolkeeper gateway runs.

Loaded by `poolkeeper.api.load` from the same YAML files as the InferencePool / InferenceModel
objects. Validated once, up front; pydantic error locations carry the camelCase field path
(`spec.endpoints.1.port`). Every field has a default, so an empty `spec: {}` (or no document at
all: `GatewayConfig.default()`) gives a working local gateway. The field reference lives in
docs/configuration.md, generated from this schema by `docs_tables()`.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from poolkeeper.config._placeholders import (
    AdmissionConfig,
    ObjectMeta,
    SchedulingConfig,
    ScrapingConfig,
)

API_VERSION: Final = "poolkeeper.dev/v1alpha1"
KIND: Final = "GatewayConfig"

Port = Annotated[int, Field(ge=1, le=65535)]

_HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENDPOINT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        use_attribute_docstrings=True,
    )


def validate_host(value: str) -> str:
    """An IPv4 address or a DNS hostname (RFC 1123). IPv6 literals are refused for now: an
    `ip:port` destination value would need brackets that the rest of the path does not add.
    """
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        pass
    else:
        if ip.version == 6:
            raise ValueError("IPv6 addresses are not supported yet; use an IPv4 address")
        return value
    if len(value) > 253 or not all(_HOSTNAME_LABEL.match(p) for p in value.split(".")):
        raise ValueError(f"{value!r} is neither an IPv4 address nor a valid hostname")
    if value.replace(".", "").isdigit():
        raise ValueError(f"{value!r} is not a valid IPv4 address")
    return value


def validate_labels(labels: dict[str, str]) -> dict[str, str]:
    """Kubernetes label rules: `[prefix/]name` keys (name <= 63 chars, prefix a DNS subdomain
    <= 253 chars) and values of <= 63 chars of alphanumerics, `-`, `_`, `.` (or empty).
    """
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
            raise ValueError(f"label key {key!r}: prefix must be a DNS subdomain")
        if len(name) > 63 or not _LABEL_NAME.match(name):
            raise ValueError(
                f"label key {key!r}: name must be 1-63 alphanumerics, '-', '_' or '.', "
                "starting and ending with an alphanumeric"
            )
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise ValueError(
                f"label {key!r} value {value!r}: must be at most 63 alphanumerics, '-', '_' or "
                "'.', starting and ending with an alphanumeric"
            )
    return labels


class Listeners(_Section):
    """Where the gateway listens. Every port must differ from the others."""

    address: str = "127.0.0.1"
    """Bind address of every listener. 127.0.0.1 keeps a local gateway private; use 0.0.0.0
    to serve other hosts."""
    http: Port = 8080
    """OpenAI-compatible HTTP front door (Envoy's listener when Envoy is used)."""
    ext_proc: Port = 9002
    """ext_proc gRPC server of the Endpoint Picker (upstream default 9002)."""
    metrics: Port = 9090
    """Prometheus /metrics of the gateway itself (upstream default 9090)."""
    health: Port = 9003
    """gRPC health service (upstream default 9003)."""
    admin: Port = 9901
    """Envoy admin interface (bound to 127.0.0.1 regardless of `address`)."""

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return validate_host(value)

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        ports = {name: getattr(self, name) for name in ("http", "ext_proc", "metrics", "health")}
        ports["admin"] = self.admin
        counts = Counter(ports.values())
        clashes = sorted(to_camel(n) for n, p in ports.items() if counts[p] > 1)
        if clashes:
            raise ValueError(f"listener ports must be distinct: {', '.join(clashes)} share a port")
        return self


class Engine(StrEnum):
    """Model-server engine: decides how its /metrics are read."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM_SERVE = "trtllm-serve"
    TRITON_TRTLLM = "triton-trtllm"


class StaticEndpoint(_Section):
    """One model server, standing in for a pod in standalone mode."""

    name: str
    """Unique name (like a pod name: lower-case alphanumerics, '-' and '.')."""
    address: str
    """IPv4 address or hostname. Envoy's original-destination cluster needs an IP, so prefer
    IPs when Envoy carries the traffic."""
    port: Port | None = None
    """Serving port; when unset, the target port of the pool that selects this endpoint."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels that InferencePool selectors match (Kubernetes label rules)."""
    engine: Engine | None = None
    """Engine of the server; unset means the scraping section's default engine."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ENDPOINT_NAME.match(value):
            raise ValueError(
                f"{value!r}: must be 1-253 lower-case alphanumerics, '-' or '.', starting and "
                "ending with an alphanumeric"
            )
        return value

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return validate_host(value)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return validate_labels(value)


class UnknownModelPolicy(StrEnum):
    """What to do with a request whose `model` no InferenceModel declares."""

    REJECT = "Reject"
    PASSTHROUGH_SHEDDABLE = "PassthroughSheddable"


class RequestHandling(_Section):
    """How the Endpoint Picker treats request bodies before scheduling."""

    unknown_model_policy: UnknownModelPolicy = UnknownModelPolicy.REJECT
    """Reject: 404 model_not_found (upstream v0.2-v0.4). PassthroughSheddable: route the
    request unchanged to the default pool as a Sheddable request (upstream v0.5)."""
    default_pool: str | None = None
    """Pool (`namespace/name`, or `name` in namespace `default`) for bodyless requests and
    passthrough models. Unset: the only pool, or the first by key when there are several."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    """Largest request body accepted, in bytes; larger bodies get 413 request_too_large."""
    inject_stream_usage: bool = True
    """Add `stream_options.include_usage: true` to streaming chat/completions requests that
    did not ask for it, so the gateway learns token usage; the extra usage chunk is removed
    from the response before the client sees it."""
    fallback_endpoints: int = Field(default=1, ge=0, le=8)
    """Endpoints listed after the pick, in order, for the proxy to retry on connection
    failure (protocol v0.4 fallbacks)."""
    honor_subset_hint: bool = True
    """Restrict the pick to the proxy's `envoy.lb.subset_hint` endpoints when it sends one
    (matched by IP, like upstream). The hint comes from the proxy, never from client headers."""

    @field_validator("default_pool")
    @classmethod
    def _pool_key(cls, value: str | None) -> str | None:
        if value is None:
            return None
        namespace, _, name = value.rpartition("/")
        for part in (namespace or "default", name):
            if len(part) > 253 or not _DNS_SUBDOMAIN.match(part):
                raise ValueError(f"{value!r}: expected 'namespace/name' or 'name'")
        return value if namespace else f"default/{value}"


class GatewayConfigSpec(_Section):
    """The gateway's settings. Every section is optional."""

    listeners: Listeners = Field(default_factory=Listeners)
    """Bind address and ports."""
    endpoints: list[StaticEndpoint] = Field(default_factory=list)
    """Standalone mode: the model servers pool selectors choose from (Kubernetes mode uses
    Pods instead)."""
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    """Scheduler plugins and profiles; omitted means the documented default profile."""
    scraping: ScrapingConfig = Field(default_factory=ScrapingConfig)
    """Metrics scraping: interval, timeout, engine mappings, staleness."""
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    """Saturation thresholds for shedding by criticality."""
    request_handling: RequestHandling = Field(default_factory=RequestHandling)
    """Body parsing, unknown models, stream usage, fallbacks."""

    @model_validator(mode="after")
    def _unique_endpoints(self) -> Self:
        names = Counter(e.name for e in self.endpoints)
        duplicates = sorted(n for n, c in names.items() if c > 1)
        if duplicates:
            raise ValueError(f"endpoints: duplicate name(s): {', '.join(duplicates)}")
        hostports = Counter(f"{e.address}:{e.port}" for e in self.endpoints if e.port is not None)
        duplicates = sorted(h for h, c in hostports.items() if c > 1)
        if duplicates:
            raise ValueError(f"endpoints: address:port used twice: {', '.join(duplicates)}")
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
