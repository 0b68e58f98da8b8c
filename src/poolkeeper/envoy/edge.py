"""The edge around the HTTP connection manager, serve's and the BBR bootstrap's alike: the
public listener (`edge_listener`: buffers, accept queue, accepts per wake-up), Envoy's admin
(`admin_interface`: allowed paths only) and the overload manager (bounded downstream
connections, heap given back after a burst, idle timeouts shortened under pressure)."""

from __future__ import annotations

from typing import Any

from poolkeeper.envoy.params import (
    DOWNSTREAM_CONNECTIONS_MONITOR,
    SCALE_TIMERS_TYPE,
    SHRINK_HEAP_TYPE,
    SO_SNDBUF,
    BootstrapParams,
    T,
    duration,
    socket_address,
    socket_buffer,
)


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
