"""The bootstrap's clusters: the EPP (HTTP/2, health-checked), the ORIGINAL_DST cluster keyed
on the destination header, and the FailOpen fallback over the pool's endpoints."""

from __future__ import annotations

from typing import Any

from poolkeeper.envoy.params import (
    DESTINATION_HEADER,
    EPP_CLUSTER,
    EXT_PROC_SERVICE,
    FALLBACK_CLUSTER,
    HTTP_OPTS_TYPE,
    ORIGINAL_DST_CLUSTER,
    BootstrapParams,
    T,
    duration,
    lb_endpoints,
    thresholds,
)


def _upstream_protocol(p: BootstrapParams) -> dict[str, Any]:
    """HTTP/1.1 to model servers by default; HTTP/2 cleartext for `appProtocol: h2c` pools."""
    if not p.upstream_h2c:
        return {}
    return {
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                T: HTTP_OPTS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    }


def _epp_health_check(p: BootstrapParams) -> dict[str, Any]:
    """Why: with FULL_DUPLEX_STREAMED bodies Envoy can fail open only before the first body
    chunk went to the processor. Opening a stream to a dead EPP fails only after the chunk was
    queued, so FailOpen would still answer 503. A host that health checks have marked down
    makes the stream fail at once, before any body, and the request fails open."""
    interval = duration(p.epp_health_interval_s)
    return {
        "timeout": "1s",
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_interval": interval,
        "unhealthy_threshold": 1,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
    }


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
        {
            "name": ORIGINAL_DST_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": duration(p.connect_timeout_s),
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
            "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
            "circuit_breakers": thresholds(p),
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
                "connect_timeout": duration(p.connect_timeout_s),
                "per_connection_buffer_limit_bytes": p.buffer_limit_bytes,
                "circuit_breakers": thresholds(p),
                **_upstream_protocol(p),
                "load_assignment": {
                    "cluster_name": FALLBACK_CLUSTER,
                    "endpoints": [{"lb_endpoints": lb_endpoints(p.fallback_endpoints)}],
                },
            }
        )
    return clusters
