"""The gateway listener's routes: what Envoy answers itself and where everything else goes.

In order: 405 for CONNECT, 413 for a declared body over the limit, 415 for a `Content-Encoding`
other than identity (the gateway does not decode bodies, so it and the server never read
different ones), then for each method group of the inference paths (the model list is GET,
everything else POST) the EPP-routed routes (the destination header present) and either the
FailOpen route or the EPP's 503; then 405 for an inference path with another method, and 404 for
everything else (so no request reaches the EPP without a route that expects it). Envoy's direct
answers carry OpenAI error bodies and never consult the EPP. The first three and the last two
(`guard_routes`, `outside_api_routes`) are the BBR bootstrap's too (`bbr.py`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from poolkeeper.envoy.failopen import FAILOPEN_FILTER, fail_open_rewrite_disabled
from poolkeeper.envoy.observer import (
    RESPONSE_PROCESSOR,
    lua_disabled,
    response_processor_disabled,
    response_processor_enabled,
    via_epp_matcher,
)
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EXT_PROC_FILTER,
    EXT_PROC_PER_ROUTE_TYPE,
    FALLBACK_CLUSTER,
    RETRY_ON,
    ROUTED_CLUSTER,
    SERVED_HEADER,
    BootstrapParams,
    T,
    duration,
)


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


def _json_direct(
    status: int, body: str, *, skip: tuple[str, ...] = (EXT_PROC_FILTER,)
) -> dict[str, Any]:
    """A route answered by Envoy itself with an OpenAI error body; the ext_proc filters named
    in `skip` (the EPP's by default) are never consulted (the route is chosen before they run,
    from the client's request)."""
    route: dict[str, Any] = {
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }
    if skip:
        route["typed_per_filter_config"] = {
            name: {T: EXT_PROC_PER_ROUTE_TYPE, "disabled": True} for name in skip
        }
    return route


def inference_path_regex(paths: tuple[str, ...]) -> str:
    """One RE2 pattern for the allowlist: each path exactly, with an optional trailing slash
    (Envoy matches it against the normalised path without the query string)."""
    alternatives = "|".join(re.escape(path.rstrip("/")) for path in paths)
    return f"^(?:{alternatives})/?$"


# Paths a client reads with GET (everything else is POSTed): the engines' model list and version.
READ_PATH_ENDINGS: Final = ("/models", "/version")


def method_groups(paths: tuple[str, ...]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(route-name suffix, method, paths): the read paths (the model list, `/version`) are
    read with GET, every other inference path is POSTed (round 2, finding 6: the method was
    not checked)."""
    reads = tuple(path for path in paths if path.rstrip("/").endswith(READ_PATH_ENDINGS))
    posts = tuple(path for path in paths if path not in reads)
    return [(suffix, method, group) for suffix, method, group in
            (("", "POST", posts), ("_get", "GET", reads)) if group]  # fmt: skip


def guard_routes(
    p: BootstrapParams, *, skip: tuple[str, ...] = (EXT_PROC_FILTER,)
) -> list[dict[str, Any]]:
    """The first routes of a public listener (serve's and the BBR bootstrap's): what Envoy
    refuses from the client's headers alone, no ext_proc filter in `skip` consulted."""
    return [
        {
            # CONNECT has no path, so no other route matches it: without this the EPP was
            # asked and waited for a body that never comes, holding the stream 60 s.
            "name": "connect",
            "match": {"connect_matcher": {}},
            **_json_direct(405, NOT_ALLOWED, skip=skip),
        },
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
            **_json_direct(
                413, TOO_LARGE_BODY.replace("{limit}", str(p.max_body_bytes)), skip=skip
            ),
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
            **_json_direct(415, UNSUPPORTED_ENCODING, skip=skip),
        },
    ]


def outside_api_routes(
    p: BootstrapParams, *, skip: tuple[str, ...] = (EXT_PROC_FILTER,)
) -> list[dict[str, Any]]:
    """The last routes of a public listener: what no inference route took, answered by Envoy
    with no ext_proc filter in `skip` consulted."""
    every_path = {"safe_regex": {"regex": inference_path_regex(p.inference_paths)}}
    return [
        # An inference path with another method: 405.
        {
            "name": "method_not_allowed",
            "match": every_path,
            **_json_direct(405, NOT_ALLOWED, skip=skip),
        },
        # Everything outside the inference API: the model servers' admin paths included, and
        # request targets that are not paths (`OPTIONS *`), which a prefix never matches.
        {
            "name": "not_found",
            "match": {"safe_regex": {"regex": ".*"}},
            **_json_direct(404, NOT_FOUND, skip=skip),
        },
    ]


def _routes(p: BootstrapParams) -> list[dict[str, Any]]:
    routes = guard_routes(p)
    for suffix, method, paths in method_groups(p.inference_paths):
        routes += _inference_routes(p, suffix, method, paths)
    routes += outside_api_routes(p)
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
                **_json_direct(503, NO_EPP_BODY, skip=()),
            }
        )
    return routes


def _rewrites_split_names(p: BootstrapParams) -> bool:
    return p.fail_open and bool(p.fallback_endpoints) and bool(p.fail_open_targets)
