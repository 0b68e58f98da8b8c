"""Names, limits and inputs of the Envoy bootstrap, shared by its builders."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poolkeeper.envoy.config import DEFAULT_INFERENCE_PATHS
from poolkeeper.hostport import split_hostport

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
# Requests the EPP routed: override_host LB over every pool endpoint, retries on the fallbacks.
ROUTED_CLUSTER = "epp_routed_cluster"
OVERRIDE_HOST_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
SUBSET_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset"
ROUND_ROBIN_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
LB_NAMESPACE = "envoy.lb"
# What the proxy retries on with the next listed endpoint: the server could not be reached or
# reset the stream before answering (never a completed answer, whatever its status).
RETRY_ON = "connect-failure,refused-stream,reset"
FALLBACK_CLUSTER = "pool_fallback_cluster"
EPP_CLUSTER = "epp"
EXT_PROC_ERROR_STATUS = 502  # ext_proc status_on_error; bootstrap maps it to 503 + body
# Response flags of Envoy's local replies when the chosen model server cannot be reached.
UPSTREAM_FAILURE_FLAGS = ("UF", "UH", "URX", "UO", "UC", "UPE")
EPP_TOKEN_HEADER = "x-poolkeeper-epp-token"  # extproc.auth.TOKEN_HEADER
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Client-supplied headers removed before anything else runs: exact names and name prefixes.
STRIPPED_HEADERS = ("x-envoy-original-dst-host",)
# `x-sim-`: the simulator's fault headers are for its own tests, never a client's to send.
STRIPPED_PREFIXES = (DESTINATION_HEADER, "x-poolkeeper-", "x-sim-")
# Envoy applies the client header-count limit to the EPP's header mutation too: the headers
# Envoy itself adds (x-forwarded-*, x-request-id, ...) plus the EPP's would push a request with
# 94-100 client headers over it. The listener's limit is the client limit plus this headroom,
# wide enough that 101-120 client headers get the EPP's 431, over HTTP/2 too (its codec counts
# the four pseudo headers: 117-120 were reset by the codec with a headroom of 20).
HEADER_HEADROOM = 30
# The same for size: the codec allows the client's `max_request_headers_kb` plus this, and the
# EPP holds clients to their own limits before it routes (`ExtProcSettings.client_header_limits`,
# given these two by `serve`).
HEADER_KB_HEADROOM = 4
CLIENT_MAX_HEADERS = 100
CLIENT_MAX_HEADER_KB = 60
ADMIN_ALLOW_PATHS = ("/ready", "/stats*", "/drain_listeners", "/memory")
EXT_PROC_PER_ROUTE_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"

T = "@type"
HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
EARLY_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
HTTP_OPTS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
FILE_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
# Since Envoy 1.38; not in the xds-protos stubs, so written here by name.
SHRINK_HEAP_TYPE = "type.googleapis.com/envoy.config.overload.v3.ShrinkHeapConfig"
SCALE_TIMERS_TYPE = "type.googleapis.com/envoy.config.overload.v3.ScaleTimersOverloadActionConfig"
DOWNSTREAM_CONNECTIONS_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"


@dataclass(frozen=True, slots=True)
class BootstrapParams:
    """Everything the bootstrap depends on; `serve` fills it from the GatewayConfig and pools."""

    listen_address: str = "127.0.0.1"
    listen_port: int = 8080
    extproc_address: str = "127.0.0.1"
    extproc_port: int = 9002
    admin_address: str = "127.0.0.1"
    admin_port: int = 9901
    # What Envoy's admin answers (exact paths, or prefixes ending in `*`): what `serve` and its
    # tests read and the drain. Anything on the host can reach a loopback port, and the rest
    # would give it the EPP's token (/config_dump), a stop (/quitquitquit) or runtime edits.
    admin_allow_paths: tuple[str, ...] = ADMIN_ALLOW_PATHS
    fail_open: bool = False
    fallback_endpoints: tuple[str, ...] = ()  # "ip:port" of the pool's endpoints (FailOpen)
    # FailOpen with the EPP down: client-facing split names -> the split's first target,
    # rewritten in the body by Envoy itself (envoy/failopen.py).
    fail_open_targets: tuple[tuple[str, str], ...] = ()
    # Every pool endpoint ("ip:port"), the hosts the EPP may name. With `endpoints_file` they
    # come from that file instead (kept current on hot reload), this is then only its start.
    routed_endpoints: tuple[str, ...] = ()
    endpoints_file: str | None = None
    retries: int = 3  # attempts on the listed fallbacks (requestHandling.fallbackEndpoints)
    message_timeout_s: float = 60.0  # per ext_proc message; bounds a hung EPP (edge section)
    stream_idle_timeout_s: float = 300.0  # long generations: no total timeout, only idle
    first_byte_timeout_s: float = 300.0  # model server silent before its response headers
    # The public listener serves these paths only (everything else: 404 in OpenAI JSON), so
    # a model server's admin paths (/v1/load_lora_adapter, /metrics, ...) are never reachable.
    inference_paths: tuple[str, ...] = DEFAULT_INFERENCE_PATHS
    max_body_bytes: int = 16 << 20  # a larger declared Content-Length: 413 before any body
    # Connection limits (reliability round 2, finding 1). A connection with no request in
    # progress, from accept (Envoy's connection idle timer starts there: a connection that
    # never sends a byte is idle) or between keep-alive requests, is closed after
    # `connection_idle_timeout_s`; once bytes came, headers have `request_headers_timeout_s`.
    # A request has `request_timeout_s` in all to be received (a body trickling a byte at a
    # time resets the idle timers, never this one).
    request_headers_timeout_s: float = 10.0
    request_timeout_s: float = 120.0
    connection_idle_timeout_s: float = 10.0
    # Under descriptor pressure the idle timeout shrinks (the overload manager's
    # reduce_timeouts, scaled by client connections over `max_downstream_connections`): from
    # `pressure_from` of the cap it falls linearly, to `pressure_min_idle_s` at
    # `pressure_saturated_at`. Idle connections then cost an attacker a reconnect a second
    # each, and a full cap empties itself within about a second (connection timers of Envoy
    # are rescaled as they run).
    pressure_from: float = 0.5
    pressure_saturated_at: float = 0.9
    pressure_min_idle_s: float = 0.5
    overload_refresh_s: float = 0.25
    # Connections the kernel completes before Envoy accepts them (a burst of connects must not
    # drop a legitimate SYN: its retry comes a second later). Capped by net.core.somaxconn.
    tcp_backlog: int = 4096
    # Connections accepted per wake-up of the listener: under a connection flood Envoy would
    # otherwise accept (and, over the cap, close) until the queue is empty before it runs a
    # timer or serves an accepted connection, so idle timeouts fire late and clients wait.
    accept_batch: int = 64
    connect_timeout_s: float = 5.0
    # Request body Envoy keeps for a retry on a fallback endpoint (per request, routed routes).
    buffer_limit_bytes: int = 1 << 20
    # Each client connection's read buffer (flow-control watermark): small, because Envoy's
    # allocator keeps what a burst of big uploads used (reliability finding 3: after two
    # bursts of 50 x 17 MB bodies Envoy sat +59-118 MB over idle with 1 MiB here, +19-54 MB
    # with 256 KiB; 128 KiB measured no better, +15-68 MB).
    connection_buffer_bytes: int = 256 << 10
    # The kernel's buffers of Envoy's own sockets on the response path, pinned (SO_SNDBUF on
    # client connections, SO_RCVBUF on model-server connections; 0: the kernel autotunes):
    # for a client that stops reading a fast stream they hold what Envoy's limits above do
    # not, and autotuned they grow to tcp_wmem's / tcp_rmem's maximum (4 MB and 32 MB on
    # common hosts) per connection. The kernel doubles the value for its bookkeeping. A
    # response still goes out at this much per round trip (2.5 MB/s at 100 ms): far above
    # a token stream, and request bodies (the other direction) are not limited by it.
    client_send_buffer_bytes: int = 256 << 10
    server_receive_buffer_bytes: int = 256 << 10
    max_request_headers_kb: int = CLIENT_MAX_HEADER_KB
    max_headers_count: int = CLIENT_MAX_HEADERS
    max_connections: int = 1024 * 40  # circuit-breaker limits, as in GIE's test config
    # The overload manager's cap on client connections: `serve` derives it from the descriptor
    # limit it gives Envoy (`downstream_connection_cap`), so the cap acts before descriptors
    # run out (each proxied request also holds an upstream descriptor).
    max_downstream_connections: int = 50_000
    heap_limit_bytes: int = 1 << 30  # the overload manager's heap scale (not a hard limit)
    # Above this fraction of it Envoy answers new requests 503 ("envoy overloaded": Envoy 1.40
    # sends that reply past the local reply mappers, so it is not OpenAI JSON) instead of
    # growing: held requests cost memory (about 50 KB each in Envoy and 25 KB in the EPP for a
    # body trickled a byte at a time), and HTTP/2 carries 100 of them per connection.
    stop_requests_at: float = 0.95
    # Heap in use above this fraction of heap_limit_bytes (1 MiB: always, in practice) makes
    # Envoy give its free heap back (shrink_heap) every `shrink_heap_every_s`, down to
    # `shrink_heap_keep_bytes` of free pages. Envoy's own default keeps 100 MB, which made the
    # action a no-op after a burst of big bodies (they leave 10-60 MB free).
    shrink_heap_at: float = 0.001
    shrink_heap_keep_bytes: int = 2 << 20
    shrink_heap_every_s: float = 2.0
    upstream_h2c: bool = False  # model servers speak HTTP/2 cleartext (appProtocol h2c)
    access_log_path: str | None = None
    epp_health_interval_s: float = 1.0  # 0 disables Envoy's gRPC health check of the EPP
    # A check that times out marks the EPP down at once (Envoy counts a timeout as one network
    # failure, threshold 1), and a FailClose pool then answers 503 to everyone. A starved but
    # live EPP (a CPU-bound host, a GC pause) answers late, so the timeout is generous; a dead
    # EPP refuses or resets the check's connection and is still marked down within an interval.
    epp_health_timeout_s: float = 5.0
    stripped_headers: tuple[str, ...] = field(default=STRIPPED_HEADERS)
    # The response observer (envoy/observer.py): a Lua filter and gRPC access log tell the EPP
    # how a response ended, so the EPP need not process response bodies.
    observe_responses: bool = False
    observer_flush_s: float = 0.02  # access-log batches: at most this late
    # With the observer: the Lua filter also tells the EPP at once when a streamed response's
    # first byte passed (one unary gRPC call per request), for schedulers that learn from
    # first tokens (`Scheduler.observes_first_tokens`); otherwise the access log tells it later.
    report_first_bytes: bool = False
    # Sent as gRPC metadata (`extproc.auth.TOKEN_HEADER`) on every call to the EPP: `serve`
    # makes one per run and its EPP refuses calls without it. None: no token (envoy-config).
    epp_token: str | None = None
    # The EPP serves ext_proc over TLS (`--secure-serving`): Envoy dials it as upstream's
    # standalone Envoy preset does, TLS with ALPN h2 and no certificate validation (the EPP's
    # certificate is self-signed unless `--cert-path`; the EPP is on loopback).
    epp_tls: bool = False
    # The per-client-address connection cap (envoy/conncap.py): the counter's loopback port
    # in the `serve` process (0: no cap), and how long a connection's first bytes wait for it
    # before the connection is let in uncounted. 1 s, not 250 ms: at load average 20 the
    # counter's own thread answered at p95 in 339 ms, and 50 of 228 checks failed open at 250 ms
    # (0 of 304 at 1 s); a check that slow means `serve` is starved, and the request would wait
    # as long for its routing by the same process (docs/reliability.md, "Connection limits").
    conncap_port: int = 0
    conncap_timeout_s: float = 1.0


# Descriptors kept back from the cap for Envoy itself: admin, EPP, logs, EDS file, upstream pools.
FD_RESERVE = 1024


def downstream_connection_cap(descriptors: int) -> int:
    """The most client connections Envoy accepts with `descriptors` file descriptors: each may
    hold an upstream connection too, and `FD_RESERVE` stay free for everything else."""
    return max(64, (descriptors - FD_RESERVE) // 2)


def epp_grpc_service(p: BootstrapParams) -> dict[str, Any]:
    """How every filter and log reaches the EPP: its cluster, with the run's token."""
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": EPP_CLUSTER}}
    if p.epp_token is not None:
        service["initial_metadata"] = [{"key": EPP_TOKEN_HEADER, "value": p.epp_token}]
    return service


SOL_SOCKET, SO_SNDBUF, SO_RCVBUF = 1, 7, 8  # Linux's values (Envoy's socket_options are raw)


def socket_buffer(name: int, size: int) -> list[dict[str, Any]]:
    """Envoy `socket_options` pinning one kernel buffer of a socket (none where `size` is 0,
    or off Linux: the raw numbers are Linux's, and elsewhere Envoy could not bind with them)."""
    if size <= 0 or not sys.platform.startswith("linux"):
        return []
    return [{"level": SOL_SOCKET, "name": name, "int_value": size, "state": "STATE_PREBIND"}]


def duration(seconds: float) -> str:
    return f"{seconds:g}s"


def socket_address(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def lb_endpoints(hostports: Sequence[str]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": socket_address(*split_hostport(hp))}} for hp in hostports]


def thresholds(p: BootstrapParams, *, max_retries: int = 3) -> dict[str, Any]:
    limit = p.max_connections
    return {
        "thresholds": [
            {
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "max_retries": max_retries,
            }
        ]
    }
