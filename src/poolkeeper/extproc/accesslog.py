"""The EPP's end of the response observer: detached exchanges and Envoy's access-log entries.

Once a routed request's response needs no rewrite, its Exchange ends the ext_proc stream and
waits here, under the key the EPP put in the stream's `poolkeeper.exchange` metadata, until
Envoy's gRPC access log (envoy/observer.py) reports how the response ended. `outcome_of` turns
one access-log entry into an `Outcome` (a pure function of the entry); `DetachedExchanges`
settles the waiting exchange with it. Bounded: at most `limit` exchanges wait, the oldest is
settled as unknown (status 0) when a new one would pass the limit, and any left waiting longer
than `ttl_s` (an entry lost with a broken access-log stream) is settled the same way, by
the runtime's timer calling `expire()` (off the request path).
"""

from __future__ import annotations

import binascii
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import duration_pb2, empty_pb2, struct_pb2, wrappers_pb2

from poolkeeper import observation as wire
from poolkeeper.hostport import join_hostport

log = logging.getLogger("poolkeeper.extproc")

CUT_STATUS = 499  # the stream ended before its response did (as a cancelled ext_proc stream)
UNKNOWN_STATUS = 0
_KEY_BYTES = 12  # an exchange key's random bytes (96 bits: 16 base64 characters, no padding)
_URLSAFE = bytes.maketrans(b"+/", b"-_")  # base64's alphabet to the URL-safe one
# Response flags meaning a response that had begun was cut short: reported like an ext_proc
# stream that ended early. A failure before any response began has its own status.
_UPSTREAM_CUT = (  # the model server's side: its response cannot have been whole
    "upstream_remote_reset",
    "upstream_connection_termination",
    "upstream_protocol_error",  # e.g. unfinished chunked encoding: a server that died
    "upstream_request_timeout",
    "upstream_max_stream_duration_reached",
)
# protobuf's Timestamp and Duration validity bounds (well_known_types), and ns per second.
_TIMESTAMP_MIN_S, _TIMESTAMP_MAX_S = -62_135_596_800, 253_402_300_799
_DURATION_MAX_S = 315_576_000_000
_NANOS = 1_000_000_000
_DOWNSTREAM_CUT = (  # the client's side, or Envoy's: only if the response had not ended
    "downstream_connection_termination",
    "downstream_remote_reset",
    "downstream_protocol_error",
    "local_reset",
    "stream_idle_timeout",
    "duration_timeout",
    "overload_manager",
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a detached request ended, as Envoy saw it."""

    status: int
    served: str | None = None  # ip:port of the model server that answered
    first_byte_after_s: float | None = None  # request sent upstream -> first body byte
    prompt_tokens: int | None = None  # from the response's `usage`, when it had one
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    events: int = 0  # SSE `data:` events in the response
    done_events: int = 0  # of which `[DONE]`
    response_bytes: int = 0
    duration_s: float | None = None  # request start -> last byte to the client (Envoy's clock)


class Detached(Protocol):
    """What waits here: an Exchange whose ext_proc stream has ended."""

    def observed(self, outcome: Outcome) -> None: ...

    def first_byte_passed(self) -> None:
        """Envoy reports the response's first byte as it passes (before `observed`)."""
        ...


def _number(fields: Any, key: str) -> float | None:
    value = fields.get(key)
    if value is None or value.WhichOneof("kind") != "number_value":
        return None
    return float(value.number_value)


def _count(fields: Any, key: str) -> int | None:
    value = _number(fields, key)
    return int(value) if value is not None and 0 <= value < 1 << 53 else None


def _sent_at_ms(common: Any) -> float | None:
    """When the request went on to the model server, in whole ms on Envoy's clock: the entry's
    start plus its time to the first byte sent upstream (of the last try; None before any).
    Envoy's own timing: no Lua on the request path has to stamp it. Truncated to the ms as
    the Lua filter's stamps are (`handle:timestamp()`), so a first byte within the same
    millisecond is 0 s after it, never a negative time."""
    if not (common.HasField("start_time") and common.HasField("time_to_first_upstream_tx_byte")):
        return None
    start, upstream = common.start_time, common.time_to_first_upstream_tx_byte
    seconds, nanos = start.seconds, start.nanos
    if _TIMESTAMP_MIN_S <= seconds <= _TIMESTAMP_MAX_S and 0 <= nanos < _NANOS:
        sent = seconds * _NANOS + nanos  # `ToNanoseconds`, its validity check inline
    else:
        sent = start.ToNanoseconds()  # raises as it always did
    sent += upstream.seconds * _NANOS + upstream.nanos  # Duration.ToNanoseconds
    return float(sent // 1_000_000)


def _duration_s(duration: duration_pb2.Duration) -> float:
    """`duration.ToTimedelta().total_seconds()`, the same float (whole microseconds over a
    million, one division), without building the timedelta for a valid non-negative one."""
    seconds, nanos = duration.seconds, duration.nanos
    if 0 <= seconds <= _DURATION_MAX_S and 0 <= nanos < _NANOS:
        return (seconds * 1_000_000 + nanos // 1_000) / 1_000_000
    total: float = duration.ToTimedelta().total_seconds()
    return total


def _elapsed_s(start_ms: float | None, end_ms: float | None) -> float | None:
    """Seconds between two millisecond stamps (the request's departure, the Lua filter's
    first byte); None unless both are there and the difference is a real, non-negative
    time."""
    if start_ms is None or end_ms is None:
        return None
    seconds = (end_ms - start_ms) / 1000
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def outcome_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> tuple[str, Outcome] | None:
    """(exchange key, outcome) of one entry; None for entries the EPP did not detach."""
    common = entry.common_properties
    meta: struct_pb2.Struct | None = common.metadata.filter_metadata.get(wire.NAMESPACE)
    if meta is None:
        return None
    key_value = meta.fields.get(wire.EXCHANGE)
    if key_value is None or key_value.WhichOneof("kind") != "string_value":
        return None
    fields = meta.fields
    status = entry.response.response_code.value
    flags = common.response_flags
    # The Lua filter writes its counts once the whole response body has passed it: a client
    # that closes its connection just after the last byte did get the whole response.
    whole = wire.EVENTS in fields
    # (most entries carry no flag at all: an empty message, nothing to look up one by one)
    cut = bool(flags.ByteSize()) and (
        any(getattr(flags, name) for name in _UPSTREAM_CUT)
        or (not whole and any(getattr(flags, name) for name in _DOWNSTREAM_CUT))
    )
    if status == 0 or (status < 400 and cut):
        status = CUT_STATUS
    t0, first = _sent_at_ms(common), _number(fields, wire.FIRST_BYTE_AT)
    address = common.upstream_remote_address.socket_address
    served = join_hostport(address.address, address.port_value) if address.address else None
    outcome = Outcome(
        status=status,
        served=served,
        first_byte_after_s=_elapsed_s(t0, first),
        prompt_tokens=_count(fields, wire.PROMPT_TOKENS),
        completion_tokens=_count(fields, wire.COMPLETION_TOKENS),
        cached_tokens=_count(fields, wire.CACHED_TOKENS),
        events=_count(fields, wire.EVENTS) or 0,
        done_events=_count(fields, wire.DONE_EVENTS) or 0,
        response_bytes=entry.response.response_body_bytes,
        duration_s=(
            _duration_s(common.time_to_last_downstream_tx_byte)
            if common.HasField("time_to_last_downstream_tx_byte")
            else None
        ),
    )
    return key_value.string_value, outcome


class DetachedExchanges:
    """Exchanges waiting for their access-log entry, oldest first."""

    def __init__(
        self,
        *,
        limit: int = 65_536,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.ttl_s = ttl_s
        self.clock = clock
        self._waiting: dict[str, tuple[float, Detached]] = {}
        self._entropy = b""  # random bytes of the next keys (`_random_key`)
        self._entropy_at = 0
        self.settled = 0
        self.expired = 0  # settled as unknown: over the limit or the TTL

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, exchange: Detached) -> str:
        """Keep `exchange` until its entry arrives; returns the key Envoy will log."""
        if len(self._waiting) >= self.limit:
            oldest = next(iter(self._waiting))
            self._give_up(oldest, "over the limit of waiting exchanges")
        # Random per request (round 2, finding 2): a key seen once tells nothing of the next,
        # and keys of an earlier EPP process never match.
        key = self._random_key()
        while key in self._waiting:  # pragma: no cover  (96 random bits)
            key = self._random_key()
        self._waiting[key] = (self.clock(), exchange)
        return key

    def _random_key(self) -> str:
        """`secrets.token_urlsafe(12)`'s key (96 bits from `os.urandom`, 16 URL-safe base64
        characters), its bytes read from the OS 256 keys at a time: one system call and four
        Python frames fewer per routed request. Each key is still its own unpredictable bytes."""
        at = self._entropy_at
        if at >= len(self._entropy):
            self._entropy, at = os.urandom(_KEY_BYTES * 256), 0
        self._entropy_at = at + _KEY_BYTES
        raw = binascii.b2a_base64(self._entropy[at : at + _KEY_BYTES], newline=False)
        return raw.translate(_URLSAFE).decode("ascii")

    def resume(self, key: str | None) -> Detached | None:
        """The response processor's stream for `key` began: it takes the exchange over (its
        access-log entry is then ignored). None for a key this process never gave out."""
        held = self._waiting.pop(key, None) if key is not None else None
        return held[1] if held is not None else None

    def discard(self, key: str) -> None:
        """The detach never reached Envoy (the stream broke first): forget it."""
        self._waiting.pop(key, None)

    def first_byte(self, key: str) -> bool:
        """The first byte of `key`'s response passed Envoy; False for a key not waiting."""
        held = self._waiting.get(key)
        if held is None:
            return False
        held[1].first_byte_passed()
        return True

    def settle(self, key: str, outcome: Outcome) -> bool:
        held = self._waiting.pop(key, None)
        if held is None:
            return False
        self.settled += 1
        held[1].observed(outcome)
        return True

    def expire(self) -> int:
        """Settle, as unknown, the exchanges that waited longer than the TTL."""
        cutoff = self.clock() - self.ttl_s
        old = [key for key, (since, _) in self._waiting.items() if since < cutoff]
        for key in old:
            self._give_up(key, "no access-log entry within the TTL")
        return len(old)

    def give_up_all(self, why: str) -> int:
        """Settle every waiting exchange as unknown (their entries can no longer come: the
        Envoy that owed them died); returns how many."""
        keys = list(self._waiting)
        for key in keys:
            self._give_up(key, why, quiet=True)  # the caller logs once for all
        return len(keys)

    def _give_up(self, key: str, why: str, *, quiet: bool = False) -> None:
        held = self._waiting.pop(key, None)
        if held is None:
            return
        self.expired += 1
        if not quiet:
            log.warning("response observer: request settled as unknown (%s) key=%s", why, key)
        held[1].observed(Outcome(status=UNKNOWN_STATUS))


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's access-log stream: each HTTP entry settles its detached exchange."""

    def __init__(self, detached: DetachedExchanges) -> None:
        self.detached = detached

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext | None = None,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    parsed = outcome_of(entry)
                    log.debug("access-log entry %s", parsed)
                    if parsed is not None:
                        self.detached.settle(*parsed)
                except Exception:
                    log.exception("response observer: an access-log entry could not be applied")
        return als_pb2.StreamAccessLogsResponse()

    def register(self, server: grpc.aio.Server) -> None:
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self, server)


class FirstByteReceiver:
    """The Lua filter's first-byte reports (`observation.FIRST_BYTE_PATH`), as they happen.

    Unary calls with the exchange key as a StringValue; an unknown key (an earlier EPP
    process, or the access-log entry came first) is ignored. Always answered with Empty, so
    a report can never make Envoy retry or log an error for the client's request."""

    def __init__(self, detached: DetachedExchanges) -> None:
        self.detached = detached

    async def first_byte(
        self, request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext | None = None
    ) -> empty_pb2.Empty:
        try:
            self.detached.first_byte(request.value)
        except Exception:
            log.exception("response observer: a first-byte report could not be applied")
        return empty_pb2.Empty()

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            self.first_byte,
            request_deserializer=wrappers_pb2.StringValue.FromString,
            response_serializer=empty_pb2.Empty.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.FIRST_BYTE_SERVICE,
                                                  {wire.FIRST_BYTE_METHOD: handler}),)
        )  # fmt: skip
