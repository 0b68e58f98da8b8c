"""The Envoy bootstrap `poolkeeper serve` runs (and `poolkeeper envoy-config` prints).

One HTTP listener whose filter chain is ext_proc (to the EPP) then the router. The EPP names the
pod in `x-gateway-destination-endpoint`; a route matching that header sends the request to an
ORIGINAL_DST cluster keyed on it. Requests the EPP did not route (it is down and the pool is
FailOpen) match the next route: a round-robin cluster over the pool's endpoints, or, for
FailClose, a 503 with an OpenAI error body.

Why client copies of the destination header can never steer traffic: the HTTP connection
manager's *early header mutation* removes every `x-gateway-destination-endpoint*` header (and
`x-envoy-original-dst-host`) before any filter or route sees the request, so the only way the
header exists is the EPP setting it. Response headers name the pod that served
(`x-gateway-destination-endpoint-served`, from the upstream address).

Everything is a plain dict (JSON is valid YAML, so `envoy -c` takes either).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
ORIGINAL_DST_CLUSTER = "original_destination_cluster"
FALLBACK_CLUSTER = "pool_fallback_cluster"
EPP_CLUSTER = "epp"
EXT_PROC_ERROR_STATUS = 502  # ext_proc status_on_error; mapped to 503 + body (see below)
# Response flags of Envoy's local replies when the chosen model server cannot be reached.
UPSTREAM_FAILURE_FLAGS = ("UF", "UH", "URX", "UO", "UC", "UPE")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Client-supplied headers removed before anything else runs: exact names and name prefixes.
STRIPPED_HEADERS = ("x-envoy-original-dst-host",)
STRIPPED_PREFIXES = (DESTINATION_HEADER, "x-poolkeeper-")

_T = "@type"
_HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_EARLY = (
    "type.googleapis.com/"
    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


@dataclass(frozen=True, slots=True)
class BootstrapParams:
    """Everything the bootstrap depends on; `serve` fills it from the GatewayConfig and pools."""

    listen_address: str = "127.0.0.1"
    listen_port: int = 8080
    extproc_address: str = "127.0.0.1"
    extproc_port: int = 9002
    admin_address: str = "127.0.0.1"
    admin_port: int = 9901
    fail_open: bool = False
    fallback_endpoints: tuple[str, ...] = ()  # "ip:port" of the pool's endpoints (FailOpen)
    message_timeout_s: float = 1000.0  # per ext_proc message; requests may queue in the EPP
    stream_idle_timeout_s: float = 300.0  # long generations: no total timeout, only idle
    request_headers_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    buffer_limit_bytes: int = 1 << 20
    max_request_headers_kb: int = 60
    max_headers_count: int = 100
    max_connections: int = 1024 * 40  # circuit-breaker limits, as in GIE's test config
    max_downstream_connections: int = 50_000
    upstream_h2c: bool = False  # model servers speak HTTP/2 cleartext (appProtocol h2c)
    access_log_path: str | None = None
    epp_health_interval_s: float = 1.0  # 0 disables Envoy's gRPC health check of the EPP
    stripped_headers: tuple[str, ...] = field(default=STRIPPED_HEADERS)


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {value!r}: expected ip:port")
    return host, int(port)


def _lb_endpoints(hostports: Sequence[str]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": _socket(*_split_hostport(hp))}} for hp in hostports]


def _thresholds(p: BootstrapParams) -> dict[str, Any]:
    limit = p.max_connections
    return {
        "thresholds": [
            {
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "max_retries": 3,
            }
        ]
    }


def ext_proc_filter(p: BootstrapParams) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _T: _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
            "failure_mode_allow": p.fail_open,
            "allow_mode_override": False,
            "message_timeout": _duration(p.message_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND",
            },
            # FailClose with the EPP unreachable: a marker status the local-reply mapper turns
            # into 503 "endpoint picker unavailable" with an OpenAI body.
            "status_on_error": {"code": EXT_PROC_ERROR_STATUS},
        },
    }


def _early_header_mutation(p: BootstrapParams) -> dict[str, Any]:
    mutations: list[dict[str, Any]] = [{"remove": name} for name in p.stripped_headers]
    mutations += [
        {"remove_on_match": {"key_matcher": {"prefix": prefix}}} for prefix in STRIPPED_PREFIXES
    ]
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {_T: _EARLY, "mutations": mutations},
    }


def _openai_error(message: str, type_: str, code: str) -> str:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return json.dumps(body, separators=(",", ":"))


NO_EPP_BODY = _openai_error(
    "the endpoint picker is unavailable and the pool is FailClose",
    "service_unavailable_error",
    "endpoint_picker_unavailable",
)


def _routes(p: BootstrapParams) -> list[dict[str, Any]]:
    served = [
        {
            "header": {"key": SERVED_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    # No total timeout (a generation can run for minutes); idle timeouts bound dead streams.
    route_opts = {"timeout": "0s", "idle_timeout": _duration(p.stream_idle_timeout_s)}
    routes: list[dict[str, Any]] = [
        {
            "name": "epp_routed",
            "match": {
                "prefix": "/",
                "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
            },
            "route": {"cluster": ORIGINAL_DST_CLUSTER, **route_opts},
            "response_headers_to_add": served,
        }
    ]
    if p.fail_open and p.fallback_endpoints:
        routes.append(
            {
                "name": "fail_open",
                "match": {"prefix": "/"},
                "route": {"cluster": FALLBACK_CLUSTER, **route_opts},
                "response_headers_to_add": served,
            }
        )
    else:
        routes.append(
            {
                "name": "not_routed",
                "match": {"prefix": "/"},
                "direct_response": {"status": 503, "body": {"inline_string": NO_EPP_BODY}},
                "response_headers_to_add": [
                    {
                        "header": {"key": "content-type", "value": "application/json"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
            }
        )
    return routes


def _local_reply_config() -> dict[str, Any]:
    """OpenAI error bodies for Envoy's own 5xx replies (the EPP's replies already have one).

    Envoy's local replies carry no body. Upstream connection failures are recognised by their
    response flags. An unreachable EPP (FailClose) is recognised by its status: ext_proc's
    `status_on_error` is set to 502, a status the EPP itself never sends, and is answered as
    503 "endpoint picker unavailable". (Dynamic metadata on ImmediateResponses is not applied
    before the local reply, so it cannot tell the two apart.)
    """

    def reply(message: str, type_: str, code: str) -> dict[str, Any]:
        return {
            "text_format_source": {"inline_string": _openai_error(message, type_, code)},
            "content_type": "application/json",
        }

    return {
        "mappers": [
            {
                "filter": {"response_flag_filter": {"flags": list(UPSTREAM_FAILURE_FLAGS)}},
                "body_format_override": reply(
                    "the model server could not be reached",
                    "service_unavailable_error",
                    "upstream_unavailable",
                ),
            },
            {
                "filter": {
                    "status_code_filter": {
                        "comparison": {
                            "op": "EQ",
                            "value": {
                                "default_value": EXT_PROC_ERROR_STATUS,
                                "runtime_key": "poolkeeper.ext_proc_error_status",
                            },
                        }
                    }
                },
                "status_code": 503,
                "body_format_override": reply(
                    "the endpoint picker is unavailable and the pool is FailClose",
                    "service_unavailable_error",
                    "endpoint_picker_unavailable",
                ),
            },
        ]
    }


def _http_connection_manager(p: BootstrapParams) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        _T: _HCM,
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        "max_request_headers_kb": p.max_request_headers_kb,
        "stream_idle_timeout": _duration(p.stream_idle_timeout_s),
        "request_timeout": "0s",
        "request_headers_timeout": _duration(p.request_headers_timeout_s),
        "common_http_protocol_options": {
            "headers_with_underscores_action": "REJECT_REQUEST",
            "max_headers_count": p.max_headers_count,
            "idle_timeout": "3600s",
        },
        "http2_protocol_options": {
            "max_concurrent_streams": 100,
            "initial_stream_window_size": 65536,
            "initial_connection_window_size": 1048576,
        },
        "early_header_mutation_extensions": [_early_header_mutation(p)],
        "local_reply_config": _local_reply_config(),
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": _routes(p)}],
        },
        "http_filters": [
            ext_proc_filter(p),
            {"name": "envoy.filters.http.router", "typed_config": {_T: _ROUTER}},
        ],
    }
    if p.access_log_path:
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {_T: _FILE_LOG, "path": p.access_log_path},
            }
        ]
    return hcm


def _upstream_protocol(p: BootstrapParams) -> dict[str, Any]:
    """HTTP/1.1 to model servers by default; HTTP/2 cleartext for `appProtocol: h2c` pools."""
    if not p.upstream_h2c:
        return {}
    return {
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                _T: _HTTP_OPTS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    }


def _epp_health_check(p: BootstrapParams) -> dict[str, Any]:
    """Why: with FULL_DUPLEX_STREAMED bodies Envoy can fail open only before the first body
    chunk went to the processor. Opening a stream to a dead EPP fails only after the chunk was
    queued, so FailOpen would still answer 503. A host that health checks have marked down
    makes the stream fail at once, before any body, and the request fails open."""
    interval = _duration(p.epp_health_interval_s)
    return {
        "timeout": "1s",
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_interval": interval,
        "unhealthy_threshold": 1,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
    }


def _clusters(p: BootstrapParams) -> list[dict[str, Any]]:
    clusters: list[dict[str, Any]] = [
        {
            "name": EPP_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    _T: _HTTP_OPTS,
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "circuit_breakers": _thresholds(p),
            # A single EPP host: never "panic-route" to it while it is unhealthy.
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            "load_assignment": {
                "cluster_name": EPP_CLUSTER,
                "endpoints": [
                    {"lb_endpoints": _lb_endpoints([f"{p.extproc_address}:{p.extproc_port}"])}
                ],
            },
        },
        {
            "name": ORIGINAL_DST_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": _duration(p.connect_timeout_s),
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
            "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
            "circuit_breakers": _thresholds(p),
            **_upstream_protocol(p),
        },
    ]
    if p.epp_health_interval_s > 0:
        clusters[0]["health_checks"] = [_epp_health_check(p)]
    if p.fail_open and p.fallback_endpoints:
        clusters.append(
            {
                "name": FALLBACK_CLUSTER,
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": _duration(p.connect_timeout_s),
                "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
                "circuit_breakers": _thresholds(p),
                **_upstream_protocol(p),
                "load_assignment": {
                    "cluster_name": FALLBACK_CLUSTER,
                    "endpoints": [{"lb_endpoints": _lb_endpoints(p.fallback_endpoints)}],
                },
            }
        )
    return clusters


def build_bootstrap(p: BootstrapParams) -> dict[str, Any]:
    """The complete Envoy bootstrap as a dict."""
    return {
        "admin": {"address": _socket(p.admin_address, p.admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _socket(p.listen_address, p.listen_port),
                    "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": _http_connection_manager(p),
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": _clusters(p),
        },
        # Edge defaults: bounded downstream connections (Envoy's edge guide).
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        _T: "type.googleapis.com/envoy.extensions.resource_monitors."
                        "downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": p.max_downstream_connections,
                    },
                }
            ]
        },
    }


def render(bootstrap: dict[str, Any]) -> str:
    """JSON text, which Envoy reads as YAML too."""
    return json.dumps(bootstrap, indent=2) + "\n"
