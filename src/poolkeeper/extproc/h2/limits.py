"""What one peer may cost the lean transport, and the counters that show what it refused.

Each limit answers a known HTTP/2 attack on servers (header-block and CONTINUATION floods,
PING/SETTINGS floods, rapid reset, stream exhaustion, a peer that never reads). Envoy's own
pattern must never trip them: Envoy resets every ext_proc stream after the processor's trailers
(docs/gateway.md, Transport), so only a reset of a stream still running counts as premature.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Limits:
    # Streams open at once on one connection (advertised; more are refused with REFUSED_STREAM).
    # Queued requests hold their stream, so this is well above any flow-control queue.
    max_concurrent_streams: int = 16_384
    max_connections: int = 256  # open at once; more are closed on accept
    # Decoded header list of one request (gRPC's own headers: Envoy sends the HTTP request's
    # headers inside the message, so these stay small) and its HEADERS + CONTINUATION frames.
    max_header_list_bytes: int = 16_384
    max_header_block_bytes: int = 16_384
    max_continuation_frames: int = 16
    max_message_bytes: int = 64 << 20  # one gRPC message (grpcio's setting in extproc/server.py)
    # Receive windows: per stream, and for the connection; a stream whose handler has this much
    # unread gets no more credit until it reads (backpressure on Envoy, per stream).
    stream_window: int = 4 << 20
    connection_window: int = 16 << 20
    # Frames that cost work but carry no request (PING, SETTINGS, PRIORITY, WINDOW_UPDATE,
    # RST_STREAM, empty DATA, unknown types): a bucket of `control_burst`, refilled by
    # `control_per_s` and by `control_per_stream` for each stream the peer opens.
    control_burst: int = 2_000
    control_per_s: float = 500.0
    control_per_stream: int = 6
    # Resets of streams whose handler still ran: `reset_burst`, refilled at `reset_per_s`.
    # Clients giving up on queued requests cause these; a rapid-reset attack far more.
    reset_burst: int = 10_000
    reset_per_s: float = 1_000.0
    # Streams refused for a missing or wrong token before the connection is closed.
    max_unauthenticated: int = 16
    # Bytes waiting to be written when another control reply would be queued: the peer does
    # not read (a PING flood's aim), so the connection is closed instead.
    max_write_backlog: int = 8 << 20
    preface_timeout_s: float = 10.0  # from accept to the client preface and its SETTINGS


class Bucket:
    """A token bucket on the loop's clock: `take` is False once the peer spent its allowance."""

    __slots__ = ("burst", "last", "per_s", "tokens")

    def __init__(self, burst: int, per_s: float, now: float) -> None:
        self.burst = float(burst)
        self.per_s = per_s
        self.tokens = float(burst)
        self.last = now

    def take(self, now: float) -> bool:
        tokens = min(self.burst, self.tokens + (now - self.last) * self.per_s)
        self.last = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True

    def earn(self, tokens: float) -> None:
        self.tokens = min(self.burst, self.tokens + tokens)


@dataclass(slots=True)
class TransportStats:
    """Counters of one server (exported as poolkeeper_extproc_transport_*)."""

    connections: int = 0  # accepted since start
    refused_connections: int = 0  # closed on accept: `max_connections` were open
    open_connections: int = 0
    streams: int = 0  # opened since start
    active_streams: int = 0
    refused_streams: int = 0  # REFUSED_STREAM: over the stream limit or draining
    premature_resets: int = 0  # the peer reset a stream whose handler still ran
    unauthenticated: int = 0  # streams without the gateway Envoy's token
    handler_errors: int = 0  # answered with grpc-status INTERNAL
    goaways: dict[str, int] = field(default_factory=dict)  # sent, by reason

    def goaway(self, reason: str) -> None:
        self.goaways[reason] = self.goaways.get(reason, 0) + 1
