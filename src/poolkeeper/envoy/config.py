"""The GatewayConfig sections about the network edge: `spec.listeners` and `spec.edge`.

Owned here because the Envoy bootstrap is what they mostly configure (the public listener,
its routes and timeouts, the admin port, where the EPP listens); the composition layer
(`server/`, `cli/`) reads them and passes plain values on (`envoy.params.BootstrapParams`,
the ext_proc settings). The GatewayConfig (`poolkeeper.config.gateway`) gathers them.
"""

from __future__ import annotations

import re
from typing import Final, Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from poolkeeper.api.fielderrors import checked, go_value, rule_error
from poolkeeper.api.names import host_errors
from poolkeeper.schema import CamelModel, Port

__all__ = ["DEFAULT_INFERENCE_PATHS", "Edge", "Listeners"]


class Listeners(CamelModel, use_attribute_docstrings=True):
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
    ext_proc_transport: Literal["grpcio", "lean"] = "lean"
    """What serves the ext_proc port: `lean` (the default), poolkeeper's own HTTP/2 + gRPC
    framing for the EPP's methods (about 1 ms less per request than grpc.aio, half its CPU
    per request), or `grpcio` (grpc.aio, with grpc-core's hardening); docs/gateway.md, The
    ext_proc transport."""

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return checked(value, host_errors(value))

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


# The paths the public listener serves (everything else: 404 in OpenAI JSON): the OpenAI
# inference API, and the engines' read paths that upstream's gateways pass to the pool (the
# model list, vLLM's server version). Admin paths stay blocked: adapter loading, cache resets,
# sleep, profiling, /metrics; so does /health (one random pod's liveness says nothing about
# the gateway, whose own health has its port).
DEFAULT_INFERENCE_PATHS: Final = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/version",
)
_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*$")


class Edge(CamelModel, use_attribute_docstrings=True):
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
    max_connections_per_client: int = Field(default=1024, ge=0, le=1_000_000)
    """Connections one client address may hold open on the public listener of the Envoy
    `serve` runs (the body-based routing Envoy has its own, opt-in: `bbr-envoy-config
    --count-connections` with `poolkeeper bbr --max-connections-per-client`); more are closed
    on their first bytes, before any request is read. Counted by the `serve` process for its
    Envoy, on a thread of its own (a silent connection is left to the idle timeout); if the
    counter cannot answer within 1 s, the connection is let in (fail open) and counted within
    a few seconds from the kernel's list of connections. 0: no cap.
    Behind a load balancer or proxy that hides client addresses every client shares its
    address: raise it or set 0 there."""
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
