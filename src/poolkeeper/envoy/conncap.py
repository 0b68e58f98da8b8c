"""The per-client-address connection cap, Envoy's side (the counter: extproc/conncap.py).

Envoy 1.40 counts connections per filter chain or per process, never per source address. So
the public listener's network ext_authz filter asks the counter on each connection's first
bytes (`Check`; a denial closes the connection before the HTTP codec sees a byte), and the
listener's TCP access log tells it of every close. The counter runs in the `serve` process on
loopback: `conncap_port` is 0 (no cap) unless `serve` started it. Body-based routing's
bootstrap (envoy/bbr.py) asks `poolkeeper bbr`, on its ext_proc cluster, instead.

Fails open: an unreachable or slow counter (over `conncap_timeout_s`) lets the connection in
(`failure_mode_allow`), so a dead or starved EPP process never locks clients out by this
filter (the counter counts such a connection later, from the kernel's list of connections:
extproc/conncap_service.py).
"""

from __future__ import annotations

from typing import Any

from poolkeeper.envoy.params import (
    EPP_TOKEN_HEADER,
    HTTP_OPTS_TYPE,
    BootstrapParams,
    T,
    duration,
    lb_endpoints,
)

CONNCAP_CLUSTER = "poolkeeper_conncap"
EXT_AUTHZ_TYPE = "type.googleapis.com/envoy.extensions.filters.network.ext_authz.v3.ExtAuthz"
TCP_ALS_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.TcpGrpcAccessLogConfig"
CONNCAP_LOG_NAME = "poolkeeper-connections"


def conncap_on(p: BootstrapParams) -> bool:
    return p.conncap_port > 0


def _service(p: BootstrapParams, cluster: str, *, timeout_s: float | None = None) -> dict[str, Any]:
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": cluster}}
    if timeout_s is not None:
        service["timeout"] = duration(timeout_s)
    if p.epp_token is not None:
        service["initial_metadata"] = [{"key": EPP_TOKEN_HEADER, "value": p.epp_token}]
    return service


def conncap_filter(p: BootstrapParams, cluster: str = CONNCAP_CLUSTER) -> dict[str, Any]:
    """The network filter, first in the public listener's chain; `cluster` reaches the counter
    (serve's loopback one, or `poolkeeper bbr`'s ext_proc cluster for body-based routing)."""
    return {
        "name": "envoy.filters.network.ext_authz",
        "typed_config": {
            T: EXT_AUTHZ_TYPE,
            "stat_prefix": "client_cap",
            "grpc_service": _service(p, cluster, timeout_s=p.conncap_timeout_s),
            "failure_mode_allow": True,
            "transport_api_version": "V3",
        },
    }


def conncap_access_log(p: BootstrapParams, cluster: str = CONNCAP_CLUSTER) -> dict[str, Any]:
    """The listener's log: one TCP entry per closed connection (its peer address is the key)."""
    return {
        "name": "envoy.access_loggers.tcp_grpc",
        "typed_config": {
            T: TCP_ALS_TYPE,
            "common_config": {
                "log_name": CONNCAP_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": _service(p, cluster),
                "buffer_flush_interval": duration(p.observer_flush_s),
                "buffer_size_bytes": 16384,
            },
        },
    }


def conncap_cluster(p: BootstrapParams) -> dict[str, Any]:
    return {
        "name": CONNCAP_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                T: HTTP_OPTS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": CONNCAP_CLUSTER,
            "endpoints": [{"lb_endpoints": lb_endpoints([f"127.0.0.1:{p.conncap_port}"])}],
        },
    }
