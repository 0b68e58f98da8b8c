"""The GatewayConfig section the Director reads: `spec.requestHandling`.

How the Endpoint Picker treats a request before scheduling: unknown models, the default pool,
body limits, stream usage, fallbacks and which client headers it trusts. The GatewayConfig
(`poolkeeper.config.gateway`) gathers it.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, field_validator

from poolkeeper.api.fielderrors import checked
from poolkeeper.api.names import dns1123_label_errors, dns1123_subdomain_errors
from poolkeeper.schema import CamelModel

__all__ = ["RequestHandling", "TrustedHeader", "UnknownModelPolicy"]


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


class RequestHandling(CamelModel, use_attribute_docstrings=True):
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
        checked(value, dns1123_label_errors(namespace or "default"))
        checked(value, dns1123_subdomain_errors(name))
        return value if namespace else f"default/{value}"
