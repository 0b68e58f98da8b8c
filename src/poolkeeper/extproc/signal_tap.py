"""Bench only: when the EPP learns a detached request's first byte and end, and what Envoy says.

`scripts/step_signal.py` measures how late, and how spread, the EPP learns a model server's
step ends (docs/notes/2026-12-07-step-signal-timing.md). It starts the EPP with
`POOLKEEPER_BENCH_SIGNAL_LOG` naming a file; `DetachedExchanges` then holds a `SignalTap` that
writes one JSON line per first-byte report (`FirstByteReceiver`) and per access-log entry
(`AccessLogReceiver`), as the EPP's event loop handles it: the receive time on the system-wide
monotonic clock (`time.monotonic`, comparable across processes on Linux) and on the wall clock,
the request's `x-bench-signal-tag` header (the client's own id: Envoy replaces an
external `x-request-id`) and, for an entry, Envoy's own stamps
(its start on the wall clock, the durations from it, the Lua filter's first-byte millisecond).

With kvEvents, the runtime also hands `kv_batch` to the prefix scorer's KV-event subscriber
(`KVEventSubscriber.on_batch`): one line per KV-event batch applied, with the engine's stamp
`ts` and the wall-clock receipt (how late the engines' step clock arrives,
docs/notes/2026-12-07-kv-events-decode.md).

Without the variable (every deployment) there is no tap: the receivers test one attribute for
None per message, nothing else runs.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from envoy.data.accesslog.v3 import accesslog_pb2

from poolkeeper import observation as wire

SIGNAL_LOG_ENV = "POOLKEEPER_BENCH_SIGNAL_LOG"
TAG_HEADER = "x-bench-signal-tag"
_TIMINGS = (  # Envoy's durations from the entry's start_time (monotonic inside Envoy)
    "time_to_first_upstream_tx_byte",
    "time_to_first_upstream_rx_byte",
    "time_to_last_upstream_rx_byte",
    "time_to_first_downstream_tx_byte",
    "time_to_last_downstream_tx_byte",
)


class SignalTap:
    """Appends one JSON line per observation to a file (line-buffered: a killed EPP loses
    nothing written)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    @classmethod
    def from_env(cls) -> SignalTap | None:
        """A tap writing to `$POOLKEEPER_BENCH_SIGNAL_LOG`, or None when it is unset."""
        path = os.environ.get(SIGNAL_LOG_ENV)
        if not path:
            return None
        return cls(open(path, "a", buffering=1, encoding="utf-8"))  # open for the process

    def close(self) -> None:
        self.out.close()

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")

    def first_byte(self, key: str, held: object | None) -> None:
        """A first-byte report for `key` arrived now (`held`: its waiting exchange, if any)."""
        self._write(
            {"kind": "first", "mono": time.monotonic(), "wall": time.time(), "key": key,
             "rid": _tag(held)}
        )  # fmt: skip

    def kv_batch(self, endpoint: str, ts: float, received_at: float) -> None:
        """A KV-event batch from `endpoint` stamped `ts` (the engine's wall clock) was taken
        off its socket at `received_at` (the EPP's wall clock) and applied now (`applied`)."""
        self._write(
            {"kind": "kv", "mono": time.monotonic(), "wall": received_at, "ts": ts,
             "applied": time.time(), "endpoint": endpoint}
        )  # fmt: skip

    def entry(self, entry: accesslog_pb2.HTTPAccessLogEntry, key: str, held: object | None) -> None:
        """An access-log entry for `key` arrived now: its receive time and Envoy's stamps."""
        common = entry.common_properties
        record: dict[str, Any] = {
            "kind": "end",
            "mono": time.monotonic(),
            "wall": time.time(),
            "key": key,
            "rid": _tag(held),
            "envoy_rid": entry.request.request_id,
            "status": entry.response.response_code.value,
            "start": common.start_time.ToNanoseconds() / 1e9,
            "upstream_port": common.upstream_remote_address.socket_address.port_value,
        }
        for name in _TIMINGS:
            if common.HasField(name):
                record[name] = getattr(common, name).ToNanoseconds() / 1e9
        meta = common.metadata.filter_metadata.get(wire.NAMESPACE)
        first = meta.fields.get(wire.FIRST_BYTE_AT) if meta is not None else None
        if first is not None:
            record["lua_first_ms"] = first.number_value
        self._write(record)


def _tag(held: object | None) -> str | None:
    """The waiting exchange's bench tag header (None: no exchange, or no tag)."""
    headers = getattr(held, "headers", None)
    return headers.get(TAG_HEADER) if isinstance(headers, dict) else None
