"""The GatewayConfig document (`poolkeeper.dev/v1alpha1`): how one poolkeeper gateway runs.

Loaded by `poolkeeper.api.load` from the same YAML files as the InferencePool / InferenceModel
objects. Validated once, up front; pydantic error locations carry the camelCase field path
(`spec.endpoints.1.port`). Every field has a default, so an empty `spec: {}` (or no document at
all: `GatewayConfig.default()`) gives a working local gateway. The field reference lives in
docs/configuration.md, generated from this schema by `poolkeeper.config.docs`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, Self, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from poolkeeper.admission.config import AdmissionConfig
from poolkeeper.api.fielderrors import go_value, rule_error
from poolkeeper.api.meta import ObjectMeta, label_key_errors
from poolkeeper.api.names import (
    dns1123_label_errors,
    dns1123_subdomain_errors,
    label_value_errors,
)
from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.flowcontrol.config import BandMode, FlowControlConfig
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.schema import CamelModel

API_VERSION: Final = "poolkeeper.dev/v1alpha1"
KIND: Final = "GatewayConfig"

_M = TypeVar("_M", bound=BaseModel)

Port = Annotated[int, Field(ge=1, le=65535)]

_HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?$")


class _Section(CamelModel, use_attribute_docstrings=True):
    """A GatewayConfig section: documented by the docstring under each field."""


def _defaults_of(cls: type[_M]) -> Callable[[], _M]:
    """A default factory: the section validated from `{}` (all its own defaults)."""
    return lambda: cls.model_validate({})


def host_errors(value: str) -> list[str]:
    """Problems with an address: it must be an IPv4 address or a DNS hostname (RFC 1123).

    IPv6 literals are refused for now: an `ip:port` destination value would need brackets that
    the rest of the request path does not add.
    """
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        pass
    else:
        if ip.version == 6:
            return ["IPv6 addresses are not supported yet; use an IPv4 address"]
        return []
    labels = value.split(".")
    if len(value) > 253 or not all(_HOSTNAME_LABEL.match(label) for label in labels):
        return ["must be an IPv4 address or a DNS hostname"]
    if labels[-1].isdigit():
        return ["must be an IPv4 address or a DNS hostname (the last label may not be numeric)"]
    return []


def _check(value: str, errors: list[str]) -> str:
    if errors:
        raise rule_error(*(("", f"Invalid value: {go_value(value)}: {msg}") for msg in errors))
    return value


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
    ext_proc_transport: Literal["grpcio", "lean"] = "grpcio"
    """What serves the ext_proc port: `grpcio` (grpc.aio) or `lean`, poolkeeper's own HTTP/2
    + gRPC framing for the EPP's methods (about 1 ms less per request; docs/gateway.md,
    Transport)."""

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return _check(value, host_errors(value))

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        first_user: dict[int, str] = {}
        issues: list[tuple[str, str]] = []
        for name in ("http", "ext_proc", "metrics", "health", "admin"):
            port: int = getattr(self, name)
            alias = to_camel(name)
            if port in first_user:
                issues.append(
                    (f".{alias}", f"Duplicate value: {port}: already used by {first_user[port]}")
                )
            else:
                first_user[port] = alias
        if issues:
            raise rule_error(*issues)
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
        return _check(value, dns1123_subdomain_errors(value))

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return _check(value, host_errors(value))

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        issues = [
            ("", f"Invalid value: {go_value(text)}: {msg}")
            for key, label in value.items()
            for text, msg in [(key, m) for m in label_key_errors(key)]
            + [(label, m) for m in label_value_errors(label)]
        ]
        if issues:
            raise rule_error(*issues)
        return value


# The OpenAI paths the public listener serves (everything else: 404 in OpenAI JSON).
DEFAULT_INFERENCE_PATHS: Final = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
)
_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*$")


class Edge(_Section):
    """What the public listener lets through, and how long it waits (reliability.md)."""

    inference_paths: list[str] = Field(default_factory=lambda: list(DEFAULT_INFERENCE_PATHS))
    """Request paths proxied to model servers (exact, a trailing slash and a query string
    allowed). Every other path gets 404 in OpenAI JSON, so model servers' admin endpoints
    (`/v1/load_lora_adapter`, `/metrics`, ...) are never reachable through the gateway."""
    epp_timeout_s: float = Field(default=60.0, ge=1.0, le=3600.0)
    """How long a request may wait for the endpoint picker's decision before Envoy answers
    504 (a hung EPP). Must exceed any queueing time in the EPP."""
    first_byte_timeout_s: float = Field(default=300.0, ge=1.0, le=86_400.0)
    """How long a model server may take to send its response headers (a non-streaming
    answer's whole generation) before the gateway answers 504 upstream_timeout."""
    stream_idle_timeout_s: float = Field(default=300.0, ge=1.0, le=86_400.0)
    """A response stream silent for this long is closed (there is no total timeout)."""
    observe_responses: bool | None = None
    """The response observer. On, once a request is routed the endpoint picker ends its
    ext_proc stream and learns how the response ended (status, first byte, token usage) from
    Envoy's gRPC access log and a small Lua filter: streams then outlive the endpoint picker
    under FailOpen, and its CPU per request no longer grows with the tokens generated.
    Responses the gateway rewrites (a split's model name, an injected usage chunk) still pass
    the endpoint picker, through a second, response-only ext_proc filter;
    `requestHandling.injectStreamUsage` then applies only to those. Other streams without
    `usage` are counted one token per event for fairness and speed, and kept out of the token
    metrics (as upstream, which counts only a response's own usage). Unset (default): on with
    the Envoy `serve` runs, off with `serve --no-envoy` or `--kubernetes` (a proxy the endpoint
    picker does not configure) and in what `envoy-config` prints. True: on everywhere; your
    own Envoy must then run the bootstrap `envoy-config` prints. False: every response passes
    through the endpoint picker."""

    def responses_observed(self, *, managed_envoy: bool) -> bool:
        """Whether the response observer is on, given whether `serve` runs the Envoy."""
        return managed_envoy if self.observe_responses is None else self.observe_responses

    @field_validator("inference_paths")
    @classmethod
    def _paths(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not _PATH.match(p)]
        if bad or not value:
            raise rule_error(
                *(("", f"Invalid value: {go_value(p)}: must be an absolute path") for p in bad)
            )
        return value


class UnknownModelPolicy(StrEnum):
    """What to do with a request whose `model` no InferenceModel (or InferenceModelRewrite
    exact match) declares."""

    REJECT = "Reject"
    PASSTHROUGH_SHEDDABLE = "PassthroughSheddable"
    PASSTHROUGH = "Passthrough"


class TrustedHeader(StrEnum):
    """A client request header that may steer the Endpoint Picker (upstream v1.x)."""

    INFERENCE_OBJECTIVE = "x-gateway-inference-objective"
    MODEL_NAME_REWRITE = "x-gateway-model-name-rewrite"
    FAIRNESS_ID = "x-gateway-inference-fairness-id"


class RequestHandling(_Section):
    """How the Endpoint Picker treats request bodies before scheduling."""

    unknown_model_policy: UnknownModelPolicy = UnknownModelPolicy.REJECT
    """Reject: 404 model_not_found (upstream v0.2-v0.4). PassthroughSheddable: route the
    request unchanged to the default pool as a Sheddable request (upstream v0.5). Passthrough:
    route it unchanged to the default pool at priority 0, Standard, unless an
    InferenceObjective says otherwise (upstream v1.x, which has no model lookup)."""
    default_pool: str | None = None
    """Pool (`namespace/name`, or `name` in namespace `default`) for bodyless requests and
    passthrough models. Unset: the only pool, or the first by key when there are several."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    """Largest request body accepted, in bytes; larger bodies get 413 request_too_large
    (a declared Content-Length over it before any byte of the body is read)."""
    max_inflight_body_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, le=16 * 1024 * 1024 * 1024
    )
    """Request-body bytes the endpoint picker holds at once, over all requests; a body that
    would pass it gets 503 server_busy at once, so hostile bodies cannot grow memory."""
    inject_stream_usage: bool = True
    """Add `stream_options.include_usage: true` to streaming chat/completions requests that
    did not ask for it, so the gateway learns token usage; the extra usage chunk is removed
    from the response before the client sees it. With `edge.observeResponses`, only into
    responses that pass the endpoint picker (see there)."""
    fallback_endpoints: int = Field(default=3, ge=0, le=16)
    """At most this many endpoints are listed after the pick, best first, for the proxy to
    retry on connection failure (protocol v0.4 fallbacks). The scheduler's picker may return
    fewer (default preset: 3, `maxNumOfEndpoints` 4); bodyless requests get this many random
    ones."""
    trusted_headers: list[TrustedHeader] = Field(default_factory=list)
    """Client headers the Endpoint Picker honours; none by default, because whatever a client
    sends must not choose how it is served unless the operator says so.
    `x-gateway-inference-objective: <name>` selects the InferenceObjective of that name in the
    request's pool (its priority sets the band: > 0 Critical, 0 Standard, < 0 Sheddable; it
    overrides the InferenceModel's criticality). `x-gateway-model-name-rewrite: <model>` names
    the model sent to the server when no InferenceModel split or InferenceModelRewrite rule
    decides it (upstream's order). `x-gateway-inference-fairness-id: <id>` makes flow control
    share fairly between these ids instead of between modelNames (docs/flowcontrol.md).
    Untrusted, they are ignored; trusted or not, they are removed before the request reaches
    the model server."""
    honor_subset_hint: bool = True
    """Restrict the pick to the proxy's `envoy.lb.subset_hint` endpoints when it sends one
    (matched by IP, like upstream). The hint comes from the proxy, never from client headers."""

    @field_validator("default_pool")
    @classmethod
    def _pool_key(cls, value: str | None) -> str | None:
        if value is None:
            return None
        namespace, _, name = value.rpartition("/")
        _check(value, dns1123_label_errors(namespace or "default"))
        _check(value, dns1123_subdomain_errors(name))
        return value if namespace else f"default/{value}"


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

    @model_validator(mode="after")
    def _epp_timeout_outlasts_queueing(self) -> Self:
        # Envoy gives up on the EPP after eppTimeoutS; a request still waiting in a
        # flow-control queue then would get Envoy's 504 instead of its band's outcome.
        if not self.flow_control.enabled:
            return self
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
        if waits:
            name, longest = max(waits.items(), key=lambda item: item[1])
            if longest >= self.edge.epp_timeout_s:
                raise rule_error(
                    (
                        ".edge.eppTimeoutS",
                        f"Invalid value: {go_value(self.edge.epp_timeout_s)}: must exceed the "
                        f"longest flow-control queue TTL (flowControl.bands.{name}.ttlMs "
                        f"{longest * 1000:g}), or a request still queued gets Envoy's 504",
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
            hostport = f"{endpoint.address}:{endpoint.port}"
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
