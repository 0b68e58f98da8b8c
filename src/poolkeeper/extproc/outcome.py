"""Envoy's access-log entry of a detached exchange, read as an `Outcome`.

`outcome_of` turns one HTTP access-log entry into the exchange key the EPP put in the stream's
`poolkeeper.exchange` metadata and an `Outcome` (a pure function of the entry): the status
(cut short when Envoy's response flags say so), the model server that answered, the Lua
filter's counts and Envoy's own timings. `extproc/accesslog.py`'s `DetachedExchanges` settles
the waiting exchange with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import duration_pb2, struct_pb2

from poolkeeper import observation as wire
from poolkeeper.hostport import join_hostport

CUT_STATUS = 499  # the stream ended before its response did (as a cancelled ext_proc stream)
UNKNOWN_STATUS = 0
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
