"""The Envoy bootstrap `poolkeeper serve` runs (and `poolkeeper envoy-config` prints).

One HTTP listener whose filter chain is ext_proc (to the EPP) then the router (with the
response observer, `observer.py`, its filters between them); its routes are built in
`routes.py`. The EPP names the pod and its fallbacks in `x-gateway-destination-endpoint`
(`ip:port,ip:port,...`, protocol v0.4+) and the same value in `envoy.lb` metadata; a route
matching that header sends the request to the EPP-routed cluster (`override_host` policy, see
`clusters.py`), whose retry policy moves on to the next listed endpoint when one cannot be
reached. Requests the EPP did not route (it is down and the pool is FailOpen) match the next
route: a round-robin cluster over the pool's endpoints, or, for FailClose, a 503 with an
OpenAI error body.

Why client copies of the destination header can never steer traffic: the HTTP connection
manager's *early header mutation* removes every `x-gateway-destination-endpoint*` header (and
`x-envoy-original-dst-host`) before any filter or route sees the request, so the only way the
header exists is the EPP setting it. Response headers name the pod that served
(`x-gateway-destination-endpoint-served`, from the upstream address).

Connection limits (reliability round 2): a connection with no request in progress (a silent
one from accept, a keep-alive one between requests) closes in seconds, and in about one second
as client connections near the overload manager's cap, which sits below the descriptor limit
`serve` gives Envoy; a request has a total timeout no trickle resets.

Everything is a plain dict (JSON is valid YAML, so `envoy -c` takes either).
"""

from __future__ import annotations

import json
from typing import Any

from poolkeeper import observation
from poolkeeper.envoy.clusters import clusters
from poolkeeper.envoy.conncap import conncap_access_log, conncap_cluster, conncap_filter, conncap_on
from poolkeeper.envoy.failopen import (
    fail_open_rewrite,
)
from poolkeeper.envoy.observer import (
    RESPONSE_PROCESSOR,
    access_log,
    lua_filter,
)
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    DOWNSTREAM_CONNECTIONS_MONITOR,
    EARLY_TYPE,
    EPP_CLUSTER,
    EXT_PROC_ERROR_STATUS,
    EXT_PROC_FILTER,
    EXT_PROC_SERVICE,
    EXT_PROC_TYPE,
    FALLBACK_CLUSTER,
    FILE_LOG_TYPE,
    HCM,
    HEADER_HEADROOM,
    HEADER_KB_HEADROOM,
    ROUTED_CLUSTER,
    ROUTER_TYPE,
    SCALE_TIMERS_TYPE,
    SERVED_HEADER,
    SHRINK_HEAP_TYPE,
    SO_SNDBUF,
    STRIPPED_PREFIXES,
    UPSTREAM_FAILURE_FLAGS,
    BootstrapParams,
    T,
    duration,
    epp_grpc_service,
    socket_address,
    socket_buffer,
)
from poolkeeper.envoy.routes import _openai_error, _rewrites_split_names, _routes

__all__ = [
    "DESTINATION_HEADER",
    "EPP_CLUSTER",
    "EXT_PROC_SERVICE",
    "FALLBACK_CLUSTER",
    "ROUTED_CLUSTER",
    "SERVED_HEADER",
    "BootstrapParams",
    "build_bootstrap",
    "render",
]


def ext_proc_filter(p: BootstrapParams) -> dict[str, Any]:
    """The EPP's ext_proc filter. With the response observer it sees requests only: responses
    that need the EPP go through `response_processor` (envoy/observer.py), the rest past it."""
    responses = "SKIP" if p.observe_responses else "SEND"
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            **ext_proc_config(p),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": responses,
                "response_body_mode": "NONE" if p.observe_responses else "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": responses,
            },
            # The EPP names each routed request in `poolkeeper` metadata (the response
            # observer's keys; poolkeeper.observation).
            "metadata_options": {"receiving_namespaces": {"untyped": [observation.NAMESPACE]}},
        },
    }


def response_processor(p: BootstrapParams) -> dict[str, Any]:
    """With the response observer: a second ext_proc filter that sends the EPP only responses,
    and only on the route the EPP chose for the responses it rewrites (envoy/observer.py)."""
    return {
        "name": RESPONSE_PROCESSOR,
        "typed_config": {
            **ext_proc_config(p),
            "processing_mode": {
                "request_header_mode": "SKIP",
                "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND",
            },
            # The exchange key tells the EPP which routed request this response belongs to.
            "metadata_options": {"forwarding_namespaces": {"untyped": [observation.NAMESPACE]}},
        },
    }


def ext_proc_config(p: BootstrapParams) -> dict[str, Any]:
    """What every ext_proc filter towards the EPP shares."""
    return {
        T: EXT_PROC_TYPE,
        "grpc_service": epp_grpc_service(p),
        "failure_mode_allow": p.fail_open,
        "allow_mode_override": False,
        "message_timeout": duration(p.message_timeout_s),
        # FailClose with the EPP unreachable: a marker status the local-reply mapper turns
        # into 503 "endpoint picker unavailable" with an OpenAI body.
        "status_on_error": {"code": EXT_PROC_ERROR_STATUS},
    }


def _early_header_mutation(p: BootstrapParams) -> dict[str, Any]:
    mutations: list[dict[str, Any]] = [{"remove": name} for name in p.stripped_headers]
    mutations += [
        {"remove_on_match": {"key_matcher": {"prefix": prefix}}} for prefix in STRIPPED_PREFIXES
    ]
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {T: EARLY_TYPE, "mutations": mutations},
    }


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
                # The stream idled before the EPP answered (or the server went silent).
                "filter": {"response_flag_filter": {"flags": ["SI"]}},
                "status_code": 504,
                "body_format_override": reply(
                    "no progress on the request in time (endpoint picker or model server)",
                    "timeout_error",
                    "stream_idle_timeout",
                ),
            },
            {
                # No response headers within the first-byte (per-try) timeout.
                "filter": {"response_flag_filter": {"flags": ["UT"]}},
                "status_code": 504,
                "body_format_override": reply(
                    "the model server did not start answering in time",
                    "timeout_error",
                    "upstream_timeout",
                ),
            },
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
            {
                # A request target no route can match; `OPTIONS *` (and any target that is
                # not a path) never reaches the routes: the connection manager answers it an
                # empty 404 itself (details `absolute_path`, no response flag).
                "filter": {
                    "or_filter": {
                        "filters": [
                            {"response_flag_filter": {"flags": ["NR"]}},
                            {
                                "and_filter": {
                                    "filters": [
                                        {"status_code_filter": _status_is(404)},
                                        _not_a_path_filter(),
                                    ]
                                }
                            },
                        ]
                    }
                },
                "body_format_override": reply(
                    "no such inference API path on this gateway",
                    "invalid_request_error",
                    "not_found",
                ),
            },
            {
                # Envoy refuses upgrades it is not configured for (WebSocket, CONNECT) with an
                # empty 403 before any filter runs; recognised by the request asking for one.
                "filter": {
                    "and_filter": {
                        "filters": [
                            {"status_code_filter": _status_is(403)},
                            {
                                "or_filter": {
                                    "filters": [
                                        _header_filter("upgrade", present=True),
                                        _header_filter(":method", exact="CONNECT"),
                                    ]
                                }
                            },
                        ]
                    }
                },
                "body_format_override": reply(
                    "protocol upgrades and CONNECT are not supported on this gateway",
                    "invalid_request_error",
                    "upgrade_not_supported",
                ),
            },
        ]
    }


def _status_is(status: int) -> dict[str, Any]:
    return {
        "comparison": {
            "op": "EQ",
            "value": {"default_value": status, "runtime_key": f"poolkeeper.status_{status}"},
        }
    }


def _header_filter(name: str, *, present: bool = False, exact: str = "") -> dict[str, Any]:
    matcher: dict[str, Any] = {"name": name}
    if present:
        matcher["present_match"] = True
    else:
        matcher["string_match"] = {"exact": exact}
    return {"header_filter": {"header": matcher}}


def _not_a_path_filter() -> dict[str, Any]:
    """The request's target is not a path (`*`, or an absolute form Envoy did not rewrite)."""
    matcher = {"name": ":path", "string_match": {"prefix": "/"}, "invert_match": True}
    return {"header_filter": {"header": matcher}}


def client_facing_hcm(
    p: BootstrapParams,
    *,
    max_request_headers_kb: int,
    max_headers_count: int,
    stream_idle_timeout_s: float,
) -> dict[str, Any]:
    """The HTTP connection manager's settings towards clients, in serve's and the BBR
    bootstrap alike: path normalisation, HTTP/1.0, timeouts, header and HTTP/2 limits, the
    early header mutation and the OpenAI-shaped local replies. The codec's header limits and
    the stream idle timeout before routing differ between the two (their callers say why)."""
    return {
        "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        # HTTP/1.0 clients are served (they got an empty reply: round 2, finding 6); without
        # a Host header the request gets this authority.
        "http_protocol_options": {"accept_http_10": True, "default_host_for_http_10": "gateway"},
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        "max_request_headers_kb": max_request_headers_kb,
        "stream_idle_timeout": duration(stream_idle_timeout_s),
        # The whole request (headers and body) within this, counted from its start: a body
        # trickling one byte at a time resets the idle timers but not this one. Disarmed once
        # the last byte went upstream, so a long generation is not cut.
        "request_timeout": duration(p.request_timeout_s),
        "request_headers_timeout": duration(p.request_headers_timeout_s),
        "common_http_protocol_options": {
            "headers_with_underscores_action": "REJECT_REQUEST",
            "max_headers_count": max_headers_count,
            # A connection with no request in progress (keep-alive between requests).
            "idle_timeout": duration(p.connection_idle_timeout_s),
        },
        "http2_protocol_options": {
            "max_concurrent_streams": 100,
            "initial_stream_window_size": 65536,
            "initial_connection_window_size": 1048576,
        },
        "early_header_mutation_extensions": [_early_header_mutation(p)],
        "local_reply_config": _local_reply_config(),
    }


def _http_connection_manager(p: BootstrapParams) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        T: HCM,
        "stat_prefix": "gateway",
        **client_facing_hcm(
            p,
            # The codec's limits leave room for the EPP's header mutation; the EPP holds
            # clients to `max_request_headers_kb` / `max_headers_count` (431 before routing: a
            # Lua filter doing the same in Envoy cost every request a Lua coroutine on the
            # request path).
            max_request_headers_kb=p.max_request_headers_kb + HEADER_KB_HEADROOM,
            max_headers_count=p.max_headers_count + HEADER_HEADROOM,
            # Until the EPP has routed a request, its stream may idle only this long: a hung
            # EPP (alive, never answering) costs a request at most this. Envoy's ext_proc
            # message timer does not run for FULL_DUPLEX_STREAMED bodies, so this is the bound
            # that holds. Routed requests get the route's idle timeout (stream_idle_timeout_s).
            stream_idle_timeout_s=p.message_timeout_s,
        ),
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": _routes(p)}],
        },
        "http_filters": [
            ext_proc_filter(p),
            *([fail_open_rewrite(p.fail_open_targets)] if _rewrites_split_names(p) else []),
            # Encoding runs backwards: Lua sees the model server's response as it came.
            *(
                [
                    response_processor(p),
                    lua_filter(report_first_bytes=p.report_first_bytes, token=p.epp_token),
                ]
                if p.observe_responses
                else []
            ),
            {"name": "envoy.filters.http.router", "typed_config": {T: ROUTER_TYPE}},
        ],
    }
    logs: list[dict[str, Any]] = []
    if p.access_log_path:
        logs.append(
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {T: FILE_LOG_TYPE, "path": p.access_log_path},
            }
        )
    if p.observe_responses:
        logs.append(access_log(p.observer_flush_s, epp_grpc_service(p)))
    if logs:
        hcm["access_log"] = logs
    return hcm


def admin_interface(p: BootstrapParams) -> dict[str, Any]:
    """Envoy's admin, answering only `admin_allow_paths` (403 for the rest): serve's and
    body-based routing's bootstraps alike."""
    return {
        "address": socket_address(p.admin_address, p.admin_port),
        "allow_paths": [
            {"prefix": path[:-1]} if path.endswith("*") else {"exact": path}
            for path in p.admin_allow_paths
        ],
    }


def build_bootstrap(p: BootstrapParams) -> dict[str, Any]:
    """The complete Envoy bootstrap as a dict."""
    return {
        # File-based EDS (the routed cluster's endpoints) needs a node id and cluster.
        "node": {"id": "poolkeeper", "cluster": "poolkeeper"},
        "admin": admin_interface(p),
        "static_resources": {
            "listeners": [
                edge_listener(
                    p,
                    "gateway",
                    [
                        *([conncap_filter(p)] if conncap_on(p) else []),
                        hcm_filter(_http_connection_manager(p)),
                    ],
                    access_log=[conncap_access_log(p)] if conncap_on(p) else [],
                )
            ],
            "clusters": [*clusters(p), *([conncap_cluster(p)] if conncap_on(p) else [])],
        },
        "overload_manager": overload_manager(p),
    }


def hcm_filter(hcm: dict[str, Any]) -> dict[str, Any]:
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}


def edge_listener(
    p: BootstrapParams,
    name: str,
    filters: list[dict[str, Any]],
    *,
    access_log: list[dict[str, Any]],
) -> dict[str, Any]:
    """The public listener (serve's and the BBR bootstrap's): one filter chain of `filters`,
    a small per-connection buffer, a pinned send buffer, a deep accept queue, bounded accepts
    per wake-up."""
    return {
        "name": name,
        "address": socket_address(p.listen_address, p.listen_port),
        "per_connection_buffer_limit_bytes": p.connection_buffer_bytes,
        # Accepted sockets inherit the listening socket's pinned send buffer.
        "socket_options": socket_buffer(SO_SNDBUF, p.client_send_buffer_bytes),
        # No listener filter: a connection that sends nothing is an HTTP connection at once,
        # closed by the (scaled) idle timeout. A listener filter's timeout would hold it in a
        # stage the overload manager cannot shorten.
        "tcp_backlog_size": p.tcp_backlog,
        "max_connections_to_accept_per_socket_event": p.accept_batch,
        "filter_chains": [{"filters": filters}],
        **({"access_log": access_log} if access_log else {}),
    }


def overload_manager(p: BootstrapParams) -> dict[str, Any]:
    """Edge defaults: bounded downstream connections (Envoy's edge guide), and heap given back
    to the OS after a burst of big bodies (reliability finding 3): while the heap in use is
    above `shrink_heap_at` of `heap_limit_bytes` (the fixed_heap monitor measures memory in
    use, not free memory, so the default threshold is tiny: always), Envoy releases tcmalloc's
    free pages beyond `shrink_heap_keep_bytes` every `shrink_heap_every_s` (`shrink_heap`);
    tcmalloc would otherwise keep them for ever. Free pages inside huge pages that still hold
    live objects stay: what a burst leaves behind depends on its peak (docs/reliability.md)."""
    return {
        "refresh_interval": duration(p.overload_refresh_s),
        "resource_monitors": [
            {
                "name": DOWNSTREAM_CONNECTIONS_MONITOR,
                "typed_config": {
                    T: "type.googleapis.com/envoy.extensions.resource_monitors."
                    "downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": p.max_downstream_connections,
                },
            },
            {
                "name": "envoy.resource_monitors.fixed_heap",
                "typed_config": {
                    T: "type.googleapis.com/envoy.extensions.resource_monitors."
                    "fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": p.heap_limit_bytes,
                },
            },
        ],
        "actions": [
            {
                "name": "envoy.overload_actions.shrink_heap",
                "typed_config": {
                    T: SHRINK_HEAP_TYPE,
                    "max_unfreed_memory_bytes": p.shrink_heap_keep_bytes,
                    "timer_interval": duration(p.shrink_heap_every_s),
                },
                "triggers": [
                    {
                        "name": "envoy.resource_monitors.fixed_heap",
                        "threshold": {"value": p.shrink_heap_at},
                    }
                ],
            },
            _idle_timeout_under_pressure(p),
            {
                "name": "envoy.overload_actions.stop_accepting_requests",
                "triggers": [
                    {
                        "name": "envoy.resource_monitors.fixed_heap",
                        "threshold": {"value": p.stop_requests_at},
                    }
                ],
            },
        ],
    }


def _idle_timeout_under_pressure(p: BootstrapParams) -> dict[str, Any]:
    """Idle client connections (a silent one from accept, keep-alive ones between requests)
    get less time as client connections near the cap: what lets a client in while idle
    connections hold the cap (round 2, finding 1). Envoy rescales running timers."""
    return {
        "name": "envoy.overload_actions.reduce_timeouts",
        "typed_config": {
            T: SCALE_TIMERS_TYPE,
            "timer_scale_factors": [
                {
                    "timer": "HTTP_DOWNSTREAM_CONNECTION_IDLE",
                    "min_timeout": duration(p.pressure_min_idle_s),
                }
            ],
        },
        "triggers": [
            {
                "name": DOWNSTREAM_CONNECTIONS_MONITOR,
                "scaled": {
                    "scaling_threshold": p.pressure_from,
                    "saturation_threshold": p.pressure_saturated_at,
                },
            }
        ],
    }


def render(bootstrap: dict[str, Any]) -> str:
    """JSON text, which Envoy reads as YAML too."""
    return json.dumps(bootstrap, indent=2) + "\n"
