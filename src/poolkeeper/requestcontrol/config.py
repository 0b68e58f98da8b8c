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
    """A client request header that may steer the Endpoint Picker: llm-d-router's names and
    the GIE v1.x names it still reads (its deprecated aliases)."""

    INFERENCE_OBJECTIVE = "x-gateway-inference-objective"
    MODEL_NAME_REWRITE = "x-gateway-model-name-rewrite"
    FAIRNESS_ID = "x-gateway-inference-fairness-id"
    LLMD_INFERENCE_OBJECTIVE = "x-llm-d-inference-objective"
    LLMD_MODEL_NAME_REWRITE = "x-llm-d-model-name-rewrite"
    LLMD_FAIRNESS_ID = "x-llm-d-inference-fairness-id"

    def spellings(self) -> tuple[TrustedHeader, TrustedHeader]:
        """(llm-d name, GIE name) of this header's meaning; the llm-d name wins, as upstream."""
        gie = TrustedHeader(self.value.replace("x-llm-d-", "x-gateway-"))
        return TrustedHeader(gie.value.replace("x-gateway-", "x-llm-d-")), gie


class RequestHandling(CamelModel, use_attribute_docstrings=True):
    """How the Endpoint Picker treats request bodies before scheduling."""

    unknown_model_policy: UnknownModelPolicy | None = None
    """Unset (default): by the API generation of the default pool, as each upstream generation
    did: an `inference.networking.k8s.io/v1` pool passes any model through at priority 0
    (Passthrough: upstream v1.x and llm-d-router have no model list), an
    `inference.networking.x-k8s.io` pool refuses it (Reject; a v0.5 setup sets
    PassthroughSheddable). Reject: 404 model_not_found (upstream v0.2-v0.4).
    PassthroughSheddable: route the request unchanged to the default pool as a Sheddable
    request (upstream v0.5). Passthrough: route it unchanged to the default pool at priority
    0, Standard, unless an InferenceObjective says otherwise (upstream v1.x)."""
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
    max_streams: int = Field(default=16_384, ge=1, le=1_000_000)
    """ext_proc streams the endpoint picker holds at once (each about 26 KB; a request holds one
    while it is queued or routed, and while its response passes the endpoint picker); more get
    gRPC RESOURCE_EXHAUSTED at once, counted in `poolkeeper_extproc_streams_refused_total`, so
    a runaway or direct client cannot grow memory without bound. The default sits under the
    managed Envoy's limit on streams to the endpoint picker (40,960)."""
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
    trusted_headers: list[TrustedHeader] = Field(default_factory=lambda: list(TrustedHeader))
    """Client headers the Endpoint Picker honours: by default all six, both spellings, as
    upstream (llm-d-router) reads them; `[]` turns them off, where clients must not choose
    how they are served. Where both spellings come, the `x-llm-d-` one wins.
    `x-llm-d-inference-objective` / `x-gateway-inference-objective: <name>` selects the
    InferenceObjective of that name in the request's pool (its priority sets the band: > 0
    Critical, 0 Standard, < 0 Sheddable; it overrides the InferenceModel's criticality).
    `x-llm-d-model-name-rewrite` / `x-gateway-model-name-rewrite: <model>` names the model
    sent to the server when no InferenceModel split or InferenceModelRewrite rule decides it
    (upstream's order). `x-llm-d-inference-fairness-id` / `x-gateway-inference-fairness-id:
    <id>` makes flow control share fairly between these ids instead of between modelNames
    (docs/flowcontrol.md). Untrusted, they are ignored; trusted or not, they are removed
    before the request reaches the model server."""
    conformance_served_endpoint_header: bool = False
    """Conformance testing only: add `x-conformance-test-served-endpoint: <ip:port>` (the
    proxy's `envoy.lb` served-endpoint metadata) to every response, as llm-d-router's
    `destination-endpoint-served-verifier` does for the gateway conformance suite. Needs the
    responses to pass the endpoint picker (`edge.observeResponses` off). Off by default."""
    answer_models_list: bool = False
    """Answer `GET /v1/models` in the endpoint picker: one OpenAI list of every client-facing
    model name of every pool, without asking a model server. Off (default, as upstream's
    gateways): the request goes to a random ready endpoint of the default pool, like any
    request without a body, and that server's own list comes back."""
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
