"""The Envoy bootstrap `poolkeeper serve` runs (and `poolkeeper envoy-config` prints).

One HTTP listener whose filter chain is ext_proc (to the EPP) then the router. The EPP names the
pod and its fallbacks in `x-gateway-destination-endpoint` (`ip:port,ip:port,...`, protocol
v0.4+) and the same value in `envoy.lb` metadata; a route matching that header sends the request
to the EPP-routed cluster (`override_host` policy, see `clusters.py`), whose retry policy moves on
to the next listed endpoint when one cannot be reached. Requests the EPP did not route (it is
down and the pool is FailOpen) match the next route: a round-robin cluster over the pool's
endpoints, or, for FailClose, a 503 with an OpenAI error body.

Why client copies of the destination header can never steer traffic: the HTTP connection
manager's *early header mutation* removes every `x-gateway-destination-endpoint*` header (and
`x-envoy-original-dst-host`) before any filter or route sees the request, so the only way the
header exists is the EPP setting it. Response headers name the pod that served
(`x-gateway-destination-endpoint-served`, from the upstream address).

Everything is a plain dict (JSON is valid YAML, so `envoy -c` takes either).
"""

from __future__ import annotations

import json
import re
from typing import Any

from poolkeeper import observation
from poolkeeper.envoy.clusters import clusters
from poolkeeper.envoy.failopen import (
    FAILOPEN_FILTER,
    fail_open_rewrite,
    fail_open_rewrite_disabled,
)
from poolkeeper.envoy.guard import header_guard
from poolkeeper.envoy.observer import (
    RESPONSE_PROCESSOR,
    access_log,
    lua_disabled,
    lua_filter,
    response_processor_disabled,
    response_processor_enabled,
    via_epp_matcher,
)
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EARLY_TYPE,
    EPP_CLUSTER,
    EXT_PROC_ERROR_STATUS,
    EXT_PROC_FILTER,
    EXT_PROC_PER_ROUTE_TYPE,
    EXT_PROC_SERVICE,
    EXT_PROC_TYPE,
    FALLBACK_CLUSTER,
    FILE_LOG_TYPE,
    HCM,
    HEADER_HEADROOM,
    HEADER_KB_HEADROOM,
    RETRY_ON,
    ROUTED_CLUSTER,
    ROUTER_TYPE,
    SERVED_HEADER,
    SHRINK_HEAP_TYPE,
    STRIPPED_PREFIXES,
    UPSTREAM_FAILURE_FLAGS,
    BootstrapParams,
    T,
    duration,
    epp_grpc_service,
    socket_address,
)

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


def _openai_error(message: str, type_: str, code: str) -> str:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return json.dumps(body, separators=(",", ":"))


NO_EPP_BODY = _openai_error(
    "the endpoint picker is unavailable and the pool is FailClose",
    "service_unavailable_error",
    "endpoint_picker_unavailable",
)


NOT_FOUND = _openai_error(
    "no such inference API path on this gateway", "invalid_request_error", "not_found"
)
NOT_ALLOWED = _openai_error(
    "method not allowed on this path", "invalid_request_error", "method_not_allowed"
)
UNSUPPORTED_ENCODING = _openai_error(
    "Content-Encoding is not supported: send the body uncompressed (identity)",
    "invalid_request_error",
    "unsupported_media_type",
)
TOO_LARGE_BODY = _openai_error(
    "request body is larger than {limit} bytes", "invalid_request_error", "request_too_large"
)


def _retry_policy(p: BootstrapParams) -> dict[str, Any]:
    """Try the listed fallbacks, one per retry (override_host takes the next address), when a
    model server cannot be reached. A short backoff: the next try goes to another host. The
    per-try timeout is a first-byte timeout (Envoy disarms it once response headers arrive)."""
    return {
        "retry_on": RETRY_ON,
        "num_retries": p.retries,
        "per_try_timeout": duration(p.first_byte_timeout_s),
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
    }


def _json_direct(status: int, body: str, *, skip_epp: bool = True) -> dict[str, Any]:
    """A route answered by Envoy itself with an OpenAI error body; with `skip_epp` the EPP is
    never consulted (the route is chosen before ext_proc runs, from the client's request)."""
    route: dict[str, Any] = {
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }
    if skip_epp:
        route["typed_per_filter_config"] = {
            EXT_PROC_FILTER: {T: EXT_PROC_PER_ROUTE_TYPE, "disabled": True}
        }
    return route


def inference_path_regex(paths: tuple[str, ...]) -> str:
    """One RE2 pattern for the allowlist: each path exactly, with an optional trailing slash
    (Envoy matches it against the normalised path without the query string)."""
    alternatives = "|".join(re.escape(path.rstrip("/")) for path in paths)
    return f"^(?:{alternatives})/?$"


def method_groups(paths: tuple[str, ...]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(route-name suffix, method, paths): the model list is read with GET, every other
    inference path is POSTed (round 2, finding 6: the method was not checked)."""
    reads = tuple(path for path in paths if path.rstrip("/").endswith("/models"))
    posts = tuple(path for path in paths if path not in reads)
    return [(suffix, method, group) for suffix, method, group in
            (("", "POST", posts), ("_get", "GET", reads)) if group]  # fmt: skip


def _routes(p: BootstrapParams) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = [
        {
            # A declared Content-Length over the limit: 413 before any body is read or buffered
            # (and, with proxy_100_continue, before any `100 Continue`).
            "name": "too_large",
            "match": {
                "prefix": "/",
                "headers": [
                    {
                        "name": "content-length",
                        "range_match": {"start": p.max_body_bytes + 1, "end": 1 << 62},
                    }
                ],
            },
            **_json_direct(413, TOO_LARGE_BODY.replace("{limit}", str(p.max_body_bytes))),
        },
        {
            # A body the gateway and the server could read differently (round 2, finding 6):
            # only identity is accepted, before the EPP reads anything.
            "name": "unsupported_encoding",
            "match": {
                "prefix": "/",
                "headers": [
                    {"name": "content-encoding", "present_match": True},
                    {
                        "name": "content-encoding",
                        "string_match": {"exact": "identity", "ignore_case": True},
                        "invert_match": True,
                    },
                ],
            },
            **_json_direct(415, UNSUPPORTED_ENCODING),
        },
    ]
    for suffix, method, paths in method_groups(p.inference_paths):
        routes += _inference_routes(p, suffix, method, paths)
    # An inference path with another method: 405, the EPP not consulted.
    every_path = {"safe_regex": {"regex": inference_path_regex(p.inference_paths)}}
    routes.append(
        {"name": "method_not_allowed", "match": every_path, **_json_direct(405, NOT_ALLOWED)}
    )
    # Everything outside the inference API: the model servers' admin paths included.
    routes.append({"name": "not_found", "match": {"prefix": "/"}, **_json_direct(404, NOT_FOUND)})
    if _rewrites_split_names(p):  # on the FailOpen route only
        for route in routes:
            if not route["name"].startswith("fail_open"):
                per_filter = route.setdefault("typed_per_filter_config", {})
                per_filter[FAILOPEN_FILTER] = fail_open_rewrite_disabled()
    if p.observe_responses:
        for route in routes:
            per_filter = route.setdefault("typed_per_filter_config", {})
            per_filter.setdefault(RESPONSE_PROCESSOR, response_processor_disabled())
            if "direct_response" in route:  # answered by Envoy: nothing to observe
                per_filter.update(lua_disabled())
    return routes


def _inference_routes(
    p: BootstrapParams, suffix: str, method: str, paths: tuple[str, ...]
) -> list[dict[str, Any]]:
    """The routes of the inference paths `paths` with `method`: EPP-routed, then FailOpen or
    the EPP's 503."""
    served = [
        {
            "header": {"key": SERVED_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    # No total timeout (a generation can run for minutes); idle timeouts bound dead streams.
    # The per-try timeout ends when the response headers arrive: a first-byte timeout.
    route_opts = {"timeout": "0s", "idle_timeout": duration(p.stream_idle_timeout_s)}
    by_method = {"name": ":method", "string_match": {"exact": method}}
    allowed = {"safe_regex": {"regex": inference_path_regex(paths)}, "headers": [by_method]}
    routed = {
        **allowed,
        "headers": [by_method, {"name": DESTINATION_HEADER, "present_match": True}],
    }
    routes: list[dict[str, Any]] = []
    epp_routed = {
        # The body kept for a retry: larger than the client connection's buffer.
        "per_request_buffer_limit_bytes": p.buffer_limit_bytes,
        "route": {"cluster": ROUTED_CLUSTER, **route_opts, "retry_policy": _retry_policy(p)},
        "response_headers_to_add": served,
    }
    if p.observe_responses:
        # The EPP asked to see this response (it rewrites it): the same route, with the
        # response processor on (chosen again once the EPP has set its metadata).
        routes.append(
            {
                "name": f"epp_routed_response_via_epp{suffix}",
                "match": {**routed, "dynamic_metadata": [via_epp_matcher()]},
                **epp_routed,
                "typed_per_filter_config": {RESPONSE_PROCESSOR: response_processor_enabled()},
            }
        )
    routes.append({"name": f"epp_routed{suffix}", "match": routed, **epp_routed})
    if p.fail_open and p.fallback_endpoints:
        routes.append(
            {
                "name": f"fail_open{suffix}",
                "match": allowed,
                # The split-name rewrite buffers the body (envoy/failopen.py).
                **(
                    {"per_request_buffer_limit_bytes": p.max_body_bytes}
                    if _rewrites_split_names(p)
                    else {}
                ),
                "route": {
                    "cluster": FALLBACK_CLUSTER,
                    # Chosen before the EPP answers: its idle timeout bounds a hung EPP too.
                    **route_opts,
                    "idle_timeout": duration(p.message_timeout_s),
                    "retry_policy": {
                        "per_try_timeout": duration(p.first_byte_timeout_s),
                        "num_retries": 0,
                    },
                },
                "response_headers_to_add": served,
            }
        )
    else:
        # Chosen first for every inference request (the EPP adds the destination header and
        # clears the route cache), so the EPP must run here; only if it did not route it is
        # this the answer.
        routes.append(
            {
                "name": f"not_routed{suffix}",
                "match": allowed,
                **_json_direct(503, NO_EPP_BODY, skip_epp=False),
            }
        )
    return routes


def _rewrites_split_names(p: BootstrapParams) -> bool:
    return p.fail_open and bool(p.fallback_endpoints) and bool(p.fail_open_targets)


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
        ]
    }


def _http_connection_manager(p: BootstrapParams) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        T: HCM,
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        # HTTP/1.0 clients are served (they got an empty reply: round 2, finding 6); without
        # a Host header the request gets this authority.
        "http_protocol_options": {"accept_http_10": True, "default_host_for_http_10": "gateway"},
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        # The codec's limits leave room for the EPP's header mutation; the header guard holds
        # clients to `max_request_headers_kb` / `max_headers_count` (envoy/guard.py).
        "max_request_headers_kb": p.max_request_headers_kb + HEADER_KB_HEADROOM,
        # Until the EPP has routed a request, its stream may idle only this long: a hung EPP
        # (alive, never answering) costs a request at most this. Envoy's ext_proc message
        # timer does not run for FULL_DUPLEX_STREAMED bodies, so this is the bound that holds.
        # Routed requests get the route's idle timeout (stream_idle_timeout_s) instead.
        "stream_idle_timeout": duration(p.message_timeout_s),
        # The whole request (headers and body) within this, counted from its start: a body
        # trickling one byte at a time resets the idle timers but not this one. Disarmed once
        # the last byte went upstream, so a long generation is not cut.
        "request_timeout": duration(p.request_timeout_s),
        "request_headers_timeout": duration(p.request_headers_timeout_s),
        "common_http_protocol_options": {
            "headers_with_underscores_action": "REJECT_REQUEST",
            "max_headers_count": p.max_headers_count + HEADER_HEADROOM,
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
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": _routes(p)}],
        },
        "http_filters": [
            header_guard(max_headers=p.max_headers_count, max_kb=p.max_request_headers_kb),
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


def build_bootstrap(p: BootstrapParams) -> dict[str, Any]:
    """The complete Envoy bootstrap as a dict."""
    return {
        # File-based EDS (the routed cluster's endpoints) needs a node id and cluster.
        "node": {"id": "poolkeeper", "cluster": "poolkeeper"},
        "admin": {"address": socket_address(p.admin_address, p.admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": socket_address(p.listen_address, p.listen_port),
                    "per_connection_buffer_limit_bytes": p.connection_buffer_bytes,
                    # A connection that sends nothing is closed `accept_timeout_s` after
                    # accept: the HTTP inspector waits for the first bytes, and the listener
                    # filters' timeout closes the socket when none came (Envoy's own header
                    # timer starts only at the first byte).
                    "listener_filters": [_http_inspector()],
                    "listener_filters_timeout": duration(p.accept_timeout_s),
                    "continue_on_listener_filters_timeout": False,
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
            "clusters": clusters(p),
        },
        "overload_manager": _overload_manager(p),
    }


def _http_inspector() -> dict[str, Any]:
    return {
        "name": "envoy.filters.listener.http_inspector",
        "typed_config": {
            T: "type.googleapis.com/envoy.extensions.filters.listener.http_inspector.v3."
            "HttpInspector"
        },
    }


def _overload_manager(p: BootstrapParams) -> dict[str, Any]:
    """Edge defaults: bounded downstream connections (Envoy's edge guide), and heap given back
    to the OS after a burst of big bodies (reliability finding 3): while the heap in use is
    above `shrink_heap_at` of `heap_limit_bytes` (the fixed_heap monitor measures memory in
    use, not free memory, so the default threshold is tiny: always), Envoy releases tcmalloc's
    free pages beyond `shrink_heap_keep_bytes` every `shrink_heap_every_s` (`shrink_heap`);
    tcmalloc would otherwise keep them for ever. Free pages inside huge pages that still hold
    live objects stay: what a burst leaves behind depends on its peak (docs/reliability.md)."""
    return {
        "refresh_interval": "1s",
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
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
            }
        ],
    }


def render(bootstrap: dict[str, Any]) -> str:
    """JSON text, which Envoy reads as YAML too."""
    return json.dumps(bootstrap, indent=2) + "\n"
