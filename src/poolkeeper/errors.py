"""The one exception tree of poolkeeper. Each error knows its HTTP status and OpenAI error shape.

    GatewayError                       500 internal_error
    ├── ConfigError                    (startup: bad files or settings; never reaches a client)
    ├── BadRequest                     400 invalid_request_error
    │   └── PayloadTooLarge            413 (body over requestHandling.maxBodyBytes)
    ├── PathNotFound                   404 invalid_request_error / not_found (not an inference path)
    ├── ModelNotFound                  404 invalid_request_error / model_not_found
    │   └── NoValidTargetModel         404 (every target model has weight 0)
    ├── RequestShed                    429 rate_limit_error (saturated pool, criticality too low)
    │   ├── QueueFull                  429 rejected-saturated (flow-control capacity exceeded)
    │   ├── QueueTimeout               429 rejected-ttl-expired (waited in a flow-control
    │   │                                  queue past its TTL; upstream's code)
    │   └── FilteredOut                429 rejected-saturated (the profile's filters kept none)
    ├── ServiceUnavailable             503 service_unavailable_error
    │   ├── NoReadyEndpoint            503 rejected-no-endpoints (no endpoint to pick from)
    │   └── ServerBusy                 503 (the EPP's in-flight body budget is spent)
    └── UpstreamError                  502 (the model server failed)

An error that drops a request the way llm-d-router names it carries that name in
`dropped_reason`, sent to the client as `x-llm-d-request-dropped-reason`.

Inside the package raise these (with `from exc` when wrapping); only the wire layers
(ext_proc, HTTP servers) turn them into responses, through `openai_error_body`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class GatewayError(Exception):
    """Base of every error poolkeeper raises on purpose."""

    http_status: ClassVar[int] = 500
    code: ClassVar[str] = "Internal"
    openai_type: ClassVar[str] = "internal_error"
    openai_code: ClassVar[str | None] = None
    dropped_reason: ClassVar[str | None] = None  # llm-d-router's x-llm-d-request-dropped-reason

    def __init__(self, message: str, *, model: str = "", target_model: str = "") -> None:
        super().__init__(message)
        self.message = message
        # What the request path had learned when it failed (the body's `model`, the target
        # chosen by the split), so front ends label errors without parsing the body again.
        self.model = model
        self.target_model = target_model

    def openai_body(self) -> dict[str, Any]:
        return openai_error_body(
            self.message, type_=self.openai_type, code=self.openai_code or self.code
        )


class ConfigError(GatewayError):
    code = "BadConfiguration"


class BadRequest(GatewayError):
    http_status = 400
    code = "BadRequest"
    openai_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    http_status = 413
    code = "PayloadTooLarge"
    openai_code = "request_too_large"


class HeadersTooLarge(BadRequest):
    """More request headers, or larger ones, than the gateway takes from a client: refused
    before routing, so that the routing headers the EPP adds cannot push the request over
    Envoy's own limits, which Envoy would blame on the EPP (reliability round 2, finding 3)."""

    http_status = 431
    openai_code = "request_header_fields_too_large"


class UnsupportedEncoding(BadRequest):
    """A body with a Content-Encoding other than identity: the gateway does not decode bodies,
    so it would read a different body from the server's (reliability round 2, finding 6)."""

    http_status = 415
    code = "UnsupportedMediaType"
    openai_code = "unsupported_media_type"


class PathNotFound(GatewayError):
    http_status = 404
    code = "BadRequest"
    openai_type = "invalid_request_error"
    openai_code = "not_found"


class ModelNotFound(GatewayError):
    http_status = 404
    code = "BadConfiguration"  # upstream's error code for an unknown model (v0.2-v0.4)
    openai_type = "invalid_request_error"
    openai_code = "model_not_found"


class NoValidTargetModel(ModelNotFound):
    code = "BadConfiguration"
    openai_code = "no_valid_target_model"


class RequestShed(GatewayError):
    http_status = 429
    code = "InferencePoolResourceExhausted"
    openai_type = "rate_limit_error"
    openai_code = "request_shed"


class QueueFull(RequestShed):
    openai_code = "queue_full"
    dropped_reason = "rejected-saturated"


class QueueTimeout(RequestShed):
    """Waited in a flow-control queue past its TTL: 429, as llm-d-router answers while the
    pool has endpoints (GIE-era poolkeeper answered 503)."""

    openai_code = "queue_timeout"
    dropped_reason = "rejected-ttl-expired"


class FilteredOut(RequestShed):
    """The pool has endpoints but the scheduling profile's filters kept none (upstream 429)."""

    openai_code = "no_endpoint_passed_filters"
    dropped_reason = "rejected-saturated"


class ServiceUnavailable(GatewayError):
    http_status = 503
    code = "ServiceUnavailable"
    openai_type = "service_unavailable_error"


class NoReadyEndpoint(ServiceUnavailable):
    openai_code = "no_ready_endpoint"
    dropped_reason = "rejected-no-endpoints"


class ServerBusy(ServiceUnavailable):
    openai_code = "server_busy"


class UpstreamError(GatewayError):
    http_status = 502
    code = "ModelServerError"
    openai_type = "upstream_error"


def openai_error_body(message: str, *, type_: str, code: str | None) -> dict[str, Any]:
    """The OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def openai_error_bytes(error: GatewayError) -> bytes:
    return json.dumps(error.openai_body(), separators=(",", ":")).encode()
