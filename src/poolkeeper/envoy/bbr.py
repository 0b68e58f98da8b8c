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

The pools and their names are envoy/bbr_params.py's, the route table envoy/bbr_routes.py's; this
module builds the rest and stays the import of both (`__all__`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from poolkeeper.envoy.bbr_params import (
    BBR_CLUSTER,
    MODEL_HEADER,
    BbrParams,
    PoolRoute,
    epp_cluster,
    pool_cluster,
)
from poolkeeper.envoy.bbr_routes import bbr_routes
from poolkeeper.envoy.client_hcm import client_facing_hcm, hcm_filter
from poolkeeper.envoy.clusters import override_host_policy
from poolkeeper.envoy.conncap import conncap_access_log, conncap_filter
from poolkeeper.envoy.edge import admin_interface, edge_listener, overload_manager
from poolkeeper.envoy.extproc_filters import ext_proc_filter
from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    HCM,
    HEADER_HEADROOM,
    HEADER_KB_HEADROOM,
    HTTP_OPTS_TYPE,
    ROUTER_TYPE,
    BootstrapParams,
    T,
    duration,
    lb_endpoints,
    socket_address,
    thresholds,
)


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
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": bbr_routes(p)}],
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
