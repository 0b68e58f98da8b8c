"""The bootstrap's clusters: the EPP (HTTP/2, health-checked), the EPP-routed cluster, and the
FailOpen fallback over the pool's endpoints.

The EPP-routed cluster holds every pool endpoint and picks with Envoy's `override_host` policy:
the request goes to the first `ip:port` the EPP listed (`envoy.lb` metadata, else the
`x-gateway-destination-endpoint` header, protocol v0.4+) and each retry to the next one. When the
list is used up the policy's fallback must pick: a subset policy with no subset and
NO_FALLBACK, so it picks nothing (503) rather than an endpoint the EPP did not choose.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EPP_CLUSTER,
    EXT_PROC_SERVICE,
    FALLBACK_CLUSTER,
    HTTP_OPTS_TYPE,
    LB_NAMESPACE,
    OVERRIDE_HOST_TYPE,
    ROUND_ROBIN_TYPE,
    ROUTED_CLUSTER,
    SO_RCVBUF,
    SUBSET_TYPE,
    BootstrapParams,
    T,
    duration,
    lb_endpoints,
    socket_buffer,
    thresholds,
)

# HTTP/2 to model servers: Envoy's default windows (256 MiB) let a server push that much of a
# stream Envoy cannot pass on (a client that stopped reading) into Envoy's memory: 16.8 MB
# and +30 MB of RSS for one such client, measured. A stream may hold at most its window; the
# connection's window covers every stream it may carry, so stalled streams never block the
# others sharing their connection (Envoy opens another past `UPSTREAM_H2_STREAMS`).
UPSTREAM_H2_STREAM_WINDOW = 64 << 10
UPSTREAM_H2_STREAMS = 100


def _upstream_protocol(p: BootstrapParams) -> dict[str, Any]:
    """HTTP/1.1 to model servers by default; HTTP/2 cleartext for `appProtocol: h2c` pools."""
    if not p.upstream_h2c:
        return {}
    h2 = {
        "max_concurrent_streams": UPSTREAM_H2_STREAMS,
        "initial_stream_window_size": UPSTREAM_H2_STREAM_WINDOW,
        "initial_connection_window_size": UPSTREAM_H2_STREAM_WINDOW * UPSTREAM_H2_STREAMS,
    }
    return {
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                T: HTTP_OPTS_TYPE,
                "explicit_http_config": {"http2_protocol_options": h2},
            }
        }
    }


def _epp_health_check(p: BootstrapParams) -> dict[str, Any]:
    """Why: with FULL_DUPLEX_STREAMED bodies Envoy can fail open only before the first body
    chunk went to the processor. Opening a stream to a dead EPP fails only after the chunk was
    queued, so FailOpen would still answer 503. A host that health checks have marked down
    makes the stream fail at once, before any body, and the request fails open. One failure
    marks it down (a refused connection is seen within an interval); the timeout is long
    enough that an EPP answering late under CPU starvation is not taken for a dead one."""
    interval = duration(p.epp_health_interval_s)
    return {
        "timeout": duration(p.epp_health_timeout_s),
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_interval": interval,
        "unhealthy_threshold": 1,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
    }


def epp_tls_socket() -> dict[str, Any]:
    """TLS to a `--secure-serving` EPP, as upstream's standalone Envoy preset: ALPN h2, no
    validation (health checks and the observer's gRPC calls use it too)."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            T: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"alpn_protocols": ["h2"]},
        },
    }


def _policy(name: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": config}}]}


def override_host_policy() -> dict[str, Any]:
    """The EPP's list first, then nothing (see the module docstring)."""
    pick_nothing = {
        T: SUBSET_TYPE,
        "fallback_policy": "NO_FALLBACK",
        "subset_selectors": [{"keys": ["poolkeeper.no-such-subset"]}],
        "subset_lb_policy": _policy(
            "envoy.load_balancing_policies.round_robin", {T: ROUND_ROBIN_TYPE}
        ),
    }
    return _policy(
        "envoy.load_balancing_policies.override_host",
        {
            T: OVERRIDE_HOST_TYPE,
            "override_host_sources": [
                {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
                {"header": DESTINATION_HEADER},
            ],
            "fallback_policy": _policy("envoy.load_balancing_policies.subset", pick_nothing),
        },
    )


def _server_sockets(p: BootstrapParams) -> dict[str, Any]:
    """Model-server connections' receive buffer, pinned (`server_receive_buffer_bytes`)."""
    options = socket_buffer(SO_RCVBUF, p.server_receive_buffer_bytes)
    return {"upstream_bind_config": {"socket_options": options}} if options else {}


def _routed_cluster(p: BootstrapParams) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": ROUTED_CLUSTER,
        "connect_timeout": duration(p.connect_timeout_s),
        "load_balancing_policy": override_host_policy(),
        "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
        # Retries go to other hosts: allow as many at once as requests.
        "circuit_breakers": thresholds(p, max_retries=p.max_connections),
        **_server_sockets(p),
        **_upstream_protocol(p),
    }
    if p.endpoints_file:
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {
            "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {
                    "path": p.endpoints_file,
                    "watched_directory": {"path": str(PurePath(p.endpoints_file).parent)},
                },
            }
        }
    else:
        cluster["type"] = "STATIC"
        cluster["load_assignment"] = {
            "cluster_name": ROUTED_CLUSTER,
            "endpoints": [{"lb_endpoints": lb_endpoints(sorted(set(p.routed_endpoints)))}],
        }
    return cluster


def clusters(p: BootstrapParams) -> list[dict[str, Any]]:
    clusters: list[dict[str, Any]] = [
        {
            "name": EPP_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    T: HTTP_OPTS_TYPE,
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "circuit_breakers": thresholds(p),
            # A single EPP host: never "panic-route" to it while it is unhealthy.
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            "load_assignment": {
                "cluster_name": EPP_CLUSTER,
                "endpoints": [
                    {"lb_endpoints": lb_endpoints([f"{p.extproc_address}:{p.extproc_port}"])}
                ],
            },
        },
        _routed_cluster(p),
    ]
    if p.epp_health_interval_s > 0:
        clusters[0]["health_checks"] = [_epp_health_check(p)]
    if p.epp_tls:
        clusters[0]["transport_socket"] = epp_tls_socket()
    if p.fail_open and p.fallback_endpoints:
        clusters.append(
            {
                "name": FALLBACK_CLUSTER,
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": duration(p.connect_timeout_s),
                "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
                "circuit_breakers": thresholds(p),
                **_server_sockets(p),
                **_upstream_protocol(p),
                "load_assignment": {
                    "cluster_name": FALLBACK_CLUSTER,
                    "endpoints": [{"lb_endpoints": lb_endpoints(p.fallback_endpoints)}],
                },
            }
        )
    return clusters
