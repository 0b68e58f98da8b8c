"""The HTTP connection manager towards clients: its shared settings (`client_facing_hcm`,
serve's and the BBR bootstrap's: path normalisation, HTTP/1.0, timeouts, header and HTTP/2
limits, the early header mutation that strips client copies of the destination header, the
OpenAI-shaped local replies), and serve's manager (routes, the filter chain: ext_proc, the
fail-open rewrite, the response observer's filters, the router; the access logs).
"""

from __future__ import annotations

from typing import Any

from poolkeeper.envoy.extproc_filters import ext_proc_filter, response_processor
from poolkeeper.envoy.failopen import fail_open_rewrite
from poolkeeper.envoy.local_replies import local_reply_config
from poolkeeper.envoy.observer import access_log, lua_filter
from poolkeeper.envoy.params import (
    EARLY_TYPE,
    FILE_LOG_TYPE,
    HCM,
    HEADER_HEADROOM,
    HEADER_KB_HEADROOM,
    ROUTER_TYPE,
    STRIPPED_PREFIXES,
    BootstrapParams,
    T,
    duration,
    epp_grpc_service,
)
from poolkeeper.envoy.routes import _rewrites_split_names, _routes


def _early_header_mutation(p: BootstrapParams) -> dict[str, Any]:
    mutations: list[dict[str, Any]] = [{"remove": name} for name in p.stripped_headers]
    mutations += [
        {"remove_on_match": {"key_matcher": {"prefix": prefix}}} for prefix in STRIPPED_PREFIXES
    ]
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {T: EARLY_TYPE, "mutations": mutations},
    }


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
        "local_reply_config": local_reply_config(),
    }


def http_connection_manager(p: BootstrapParams) -> dict[str, Any]:
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


def hcm_filter(hcm: dict[str, Any]) -> dict[str, Any]:
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
