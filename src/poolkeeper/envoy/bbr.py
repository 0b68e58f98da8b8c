"""The Envoy bootstrap for body-based routing: several InferencePools, each with its own Endpoint
Picker, behind one listener (what a Gateway builds from HTTPRoutes that match
`X-Gateway-Model-Name`, upstream `config/manifests/bbr-example/httproute_bbr.yaml`).

    client -> Envoy: early header mutation drops client copies of routing headers
           -> guard routes: CONNECT, a declared body over the limit, a compressed body, a path
              outside the inference API or a method it does not take get Envoy's own answer
           -> ext_proc "bbr" (poolkeeper bbr): body `model` -> x-gateway-model-name, route again
           -> route by x-gateway-model-name (one route per model name)
           -> ext_proc "epp", overridden per route to that pool's EPP cluster: destination header
           -> the pool's cluster (override_host over its endpoints, retries on the fallbacks)

A model no route names gets 404 (OpenAI body) without asking any EPP; a request without a body
(e.g. GET /v1/models) goes to the first pool's EPP. The public side is serve's (`bootstrap.py`,
`routes.py`, from the same `BootstrapParams`): its listener, the connection manager's limits,
timeouts and local replies, the guard and outside-the-API routes, the overload manager, the
admin interface (serve's paths only), the per-client-address connection cap (whose counter runs
in `poolkeeper bbr`, on the BBR cluster, rather than in serve). What differs is said where it
differs. The client's header limits are held by `poolkeeper bbr` (431), as serve's EPP holds
them behind serve's listener.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from poolkeeper.envoy.client_hcm import client_facing_hcm, hcm_filter
from poolkeeper.envoy.clusters import override_host_policy
from poolkeeper.envoy.conncap import conncap_access_log, conncap_filter
from poolkeeper.envoy.edge import admin_interface, edge_listener, overload_manager
from poolkeeper.envoy.extproc_filters import ext_proc_filter
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EXT_PROC_PER_ROUTE_TYPE,
    HCM,
    HEADER_HEADROOM,
    HEADER_KB_HEADROOM,
    HTTP_OPTS_TYPE,
    ROUTER_TYPE,
    SERVED_HEADER,
    BootstrapParams,
    T,
    duration,
    lb_endpoints,
    socket_address,
    thresholds,
)
from poolkeeper.envoy.routes import (
    _json_direct,
    _openai_error,
    _retry_policy,
    guard_routes,
    inference_path_regex,
    method_groups,
    outside_api_routes,
)

MODEL_HEADER = "x-gateway-model-name"
BBR_CLUSTER = "bbr"
# Envoy's own answers (guard routes, paths outside the API) consult neither ext_proc filter.
BOTH_FILTERS = ("bbr", "epp")


@dataclass(frozen=True, slots=True)
class PoolRoute:
    """One InferencePool behind the BBR listener."""

    pool: str  # pool key `namespace/name` (cluster names derive from it)
    models: tuple[str, ...]  # values of x-gateway-model-name routed to this pool
    epp: str  # host:port of the pool's Endpoint Picker (ext_proc gRPC)
    endpoints: tuple[str, ...]  # ip:port of the pool's model servers (the EPP picks among them)


@dataclass(frozen=True, slots=True)
class BbrParams:
    base: BootstrapParams  # listener, admin, timeouts and limits (its EPP fields are unused)
    bbr: str  # host:port of the BBR ext_proc service
    pools: tuple[PoolRoute, ...]
    # The per-client-address connection cap (envoy/conncap.py): the listener asks `poolkeeper
    # bbr`'s connection counter (on the BBR cluster) on each connection's first bytes and
    # reports every close to it; fails open when it does not answer.
    client_cap: bool = False


def _slug(pool: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", pool.lower()).strip("_")


def epp_cluster(pool: str) -> str:
    return f"epp_{_slug(pool)}"


def pool_cluster(pool: str) -> str:
    return f"pool_{_slug(pool)}"


def _grpc_cluster(name: str, hostport: str) -> dict[str, Any]:
    host, _, port = hostport.rpartition(":")
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                T: HTTP_OPTS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": socket_address(host, int(port))}}]}
            ],
        },
    }


def _pool_cluster(p: BootstrapParams, route: PoolRoute) -> dict[str, Any]:
    name = pool_cluster(route.pool)
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": duration(p.connect_timeout_s),
        "load_balancing_policy": override_host_policy(),
        "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
        "circuit_breakers": thresholds(p, max_retries=p.max_connections),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": lb_endpoints(sorted(set(route.endpoints)))}],
        },
    }


def bbr_filter(p: BbrParams) -> dict[str, Any]:
    """ext_proc to the BBR service: request headers and body only, nothing of the response."""
    return {
        "name": "bbr",
        "typed_config": {
            T: "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": BBR_CLUSTER}},
            "failure_mode_allow": False,
            "message_timeout": duration(p.base.message_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
        },
    }


def _routes(p: BbrParams) -> list[dict[str, Any]]:
    """Guard routes, then the models' routes, the entry routes (no model header yet: every
    request's first route), the unknown model's 404, and the outside-the-API answers."""
    base = p.base
    served = [
        {
            "header": {"key": SERVED_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    every_path = inference_path_regex(base.inference_paths)
    routed = {"name": DESTINATION_HEADER, "present_match": True}
    # Each pool route twice: once the EPP has named a destination, and while it decides.
    states = (("", routed, True), ("_deciding", {**routed, "invert_match": True}, False))

    def to_pool(
        name: str, route: PoolRoute, match: dict[str, Any], decided: bool
    ) -> dict[str, Any]:
        # No total timeout (a generation can run for minutes); idle timeouts bound dead
        # streams. Until the EPP has named a destination (it clears the route cache, so the
        # route is chosen again), BBR or the EPP may be deciding: a hung one costs a request
        # at most the message timeout, as behind serve's listener (Envoy's ext_proc message
        # timer does not run for FULL_DUPLEX_STREAMED bodies).
        idle_s = base.stream_idle_timeout_s if decided else base.message_timeout_s
        return {
            "name": name,
            "match": match,
            # The body kept for a retry: larger than the client connection's buffer.
            "per_request_buffer_limit_bytes": base.buffer_limit_bytes,
            "route": {
                "cluster": pool_cluster(route.pool),
                "timeout": "0s",
                "idle_timeout": duration(idle_s),
                "retry_policy": _retry_policy(base),
            },
            "response_headers_to_add": served,
            "typed_per_filter_config": {
                "epp": {
                    T: EXT_PROC_PER_ROUTE_TYPE,
                    "overrides": {
                        "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster(route.pool)}}
                    },
                }
            },
        }

    routes = guard_routes(base, skip=BOTH_FILTERS)
    # The model header exists only once BBR set it, and BBR runs only on an entry route (the
    # others skip it), which checks the path and the method: so these check the path only.
    routes += [
        to_pool(
            f"{_slug(route.pool)}_{i}{suffix}",
            route,
            {
                "safe_regex": {"regex": every_path},
                "headers": [{"name": MODEL_HEADER, "string_match": {"exact": model}}, state],
            },
            decided,
        )
        for route in p.pools
        for i, model in enumerate(route.models)
        for suffix, state, decided in states
    ]
    # Entry routes, and the answer for bodyless requests (no model header at all): the first
    # pool's EPP decides.
    no_model = {"name": MODEL_HEADER, "present_match": True, "invert_match": True}
    routes += [
        to_pool(
            f"bodyless{suffix}{state_suffix}",
            p.pools[0],
            {
                "safe_regex": {"regex": inference_path_regex(paths)},
                "headers": [
                    no_model,
                    {"name": ":method", "string_match": {"exact": method}},
                    state,
                ],
            },
            decided,
        )
        for suffix, method, paths in method_groups(base.inference_paths)
        for state_suffix, state, decided in states
    ]
    unknown = _openai_error(
        "no InferencePool serves the requested model", "invalid_request_error", "model_not_found"
    )
    routes.append(
        {
            "name": "no_pool",
            "match": {
                "safe_regex": {"regex": every_path},
                "headers": [{"name": MODEL_HEADER, "present_match": True}],
            },
            **_json_direct(404, unknown, skip=("epp",)),  # BBR has run: it set the header
        }
    )
    return routes + outside_api_routes(base, skip=BOTH_FILTERS)


def build_bbr_bootstrap(p: BbrParams) -> dict[str, Any]:
    """The complete Envoy bootstrap (a dict) for BBR in front of per-pool EPPs."""
    if not p.pools:
        raise ValueError("body-based routing needs at least one pool")
    base = replace(
        p.base,
        stripped_headers=(*p.base.stripped_headers, MODEL_HEADER),
    )
    epp = ext_proc_filter(base)
    epp["name"] = "epp"
    epp["typed_config"]["grpc_service"] = {
        "envoy_grpc": {"cluster_name": epp_cluster(p.pools[0].pool)}
    }
    hcm = {
        T: HCM,
        "stat_prefix": "bbr_gateway",
        **client_facing_hcm(
            base,
            # As serve's: room above the client's limits for the headers BBR and the EPP add
            # (at the exact limits, 94-100 client headers got an empty 500). `poolkeeper bbr`,
            # the first filter, holds clients to the limits themselves (431), as serve's EPP does.
            max_request_headers_kb=base.max_request_headers_kb + HEADER_KB_HEADROOM,
            max_headers_count=base.max_headers_count + HEADER_HEADROOM,
            # As serve's: until a route is chosen (Envoy's own answers), and on the routes a
            # request has while BBR and the EPP decide, a stream may idle only this long.
            stream_idle_timeout_s=base.message_timeout_s,
        ),
        "route_config": {
            "name": "bbr",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": _routes(p)}],
        },
        "http_filters": [
            bbr_filter(p),
            epp,
            {"name": "envoy.filters.http.router", "typed_config": {T: ROUTER_TYPE}},
        ],
    }
    clusters = [_grpc_cluster(BBR_CLUSTER, p.bbr)]
    for route in p.pools:
        clusters.append(_grpc_cluster(epp_cluster(route.pool), route.epp))
        clusters.append(_pool_cluster(base, route))
    return {
        "node": {"id": "poolkeeper-bbr", "cluster": "poolkeeper"},
        "admin": admin_interface(base),
        "static_resources": {
            "listeners": [
                edge_listener(
                    base,
                    "bbr_gateway",
                    [
                        *([conncap_filter(base, BBR_CLUSTER)] if p.client_cap else []),
                        hcm_filter(hcm),
                    ],
                    access_log=[conncap_access_log(base, BBR_CLUSTER)] if p.client_cap else [],
                )
            ],
            "clusters": clusters,
        },
        "overload_manager": overload_manager(base),
    }


def render(bootstrap: dict[str, Any]) -> str:
    return json.dumps(bootstrap, indent=2) + "\n"


__all__ = [
    "DESTINATION_HEADER",
    "MODEL_HEADER",
    "BbrParams",
    "PoolRoute",
    "build_bbr_bootstrap",
    "epp_cluster",
    "pool_cluster",
    "render",
]
